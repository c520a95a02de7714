"""Issue 37 item 4, the papercuts: each as a user meets it, through the command line (exit code
and message) or the Python API, on real models (the bundled example CNN, small Keras models)."""

import subprocess
import sys
from pathlib import Path

import pytest

from amp_rewrite.cli.run import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cnn_fp32.pb"
AMP = str(Path(sys.executable).parent / "amp-rewrite")


def _usage_error(argv, capsys) -> str:
    """The one line a usage error prints (exit 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.count("\n") == 1, err
    return err.strip()


# ----------------------------------------------------------------- the command line
@pytest.mark.fast
@pytest.mark.parametrize("argv, closest", [
    ([str(EXAMPLE), "-o", "x.pb", "--targt", "bfloat16"], "--target"),
    ([str(EXAMPLE), "-o", "x.pb", "--targt=bfloat16"], "--target"),
    ([str(EXAMPLE), "-o", "x.pb", "--fold-constant", "--lowpio"], "--lowp-io"),   # (a prefix is fine)
    (["verify", "a.pb", "b.pb", "--samles", "4"], "--samples"),
    (["kernels", "m.pb", "--devise", "cpu"], "--device"),
])
def test_a_misspelled_flag_names_the_closest_one(argv, closest, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = _usage_error(argv, capsys)
    assert said.startswith("amp-rewrite") and "error: unrecognized arguments: " in said
    assert said.endswith(f"; did you mean {closest}?")


@pytest.mark.fast
def test_an_unknown_flag_with_nothing_close_gets_no_guess(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = _usage_error([str(EXAMPLE), "-o", "x.pb", "--zzzzz", "-5"], capsys)
    assert said == "amp-rewrite: error: unrecognized arguments: --zzzzz -5"


def test_convert_is_a_command_word_as_its_help_says(tmp_path, capsys, monkeypatch):
    out = tmp_path / "x.pb"
    assert main(["convert", str(EXAMPLE), "-o", str(out)]) == 0
    assert out.is_file() and "4/4 MatMul/Conv-family ops in float16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["-h"])
    assert "'amp-rewrite convert IN -o OUT' says the same" in " ".join(capsys.readouterr().out.split())
    # a file named convert is still a model to convert
    monkeypatch.chdir(tmp_path)
    Path("convert").write_bytes(EXAMPLE.read_bytes())
    assert main(["convert", "-o", "y.pb", "-q"]) == 0 and Path("y.pb").is_file()


@pytest.mark.fast
def test_a_first_word_that_is_no_file_and_no_command_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = _usage_error(["frobnicate", "x"], capsys)
    assert said.startswith("amp-rewrite: error: no file 'frobnicate' and no command of that name")
    assert "commands: bench, convert, costs, explain, kernels, ranges, rules, tune, verify" in said
    assert "-o" not in said.partition("(")[0]       # not "-o/--output is required"
    said = _usage_error(["convrt", "m.pb", "-o", "x.pb"], capsys)
    assert "did you mean 'amp-rewrite convert'?" in said
    # what looks like a path goes on to the usual checks
    assert main(["frob.pb", "-o", "x.pb"]) == 2
    assert capsys.readouterr().err == "amp-rewrite: error: frob.pb: no such file\n"


# ----------------------------------------------------------------- help texts
def _parser(command):
    from amp_rewrite.cli import run
    return run._convert_parser() if command == "convert" else run._command_parser(command)


def _helps(command) -> dict[str, str]:
    """Each argument's help by its first option string (or its name), as -h shows it."""
    return {(a.option_strings[-1] if a.option_strings else a.dest): " ".join((a.help or "").split())
            for a in _parser(command)._actions}


MODEL_ARGS = {"convert": ["input"], "explain": ["input"], "verify": ["original", "converted"],
              "bench": ["original", "converted"], "kernels": ["model"], "ranges": ["model"],
              "tune": ["input"]}


@pytest.mark.fast
@pytest.mark.parametrize("command", sorted(MODEL_ARGS))
def test_every_model_argument_says_it_takes_keras_files(command):
    """Each command takes a Keras file (cli/commands.py exports it first): its help says so."""
    helps = _helps(command)
    first = helps[MODEL_ARGS[command][0]]
    assert "Keras file" in first and "SavedModel" in first, first
    for other in MODEL_ARGS[command][1:]:
        assert helps[other].endswith("(the same formats)"), helps[other]


@pytest.mark.fast
@pytest.mark.parametrize("flag", ["--keep", "--lowp-io", "--min-matrix-intensity"])
def test_painting_flags_have_the_same_help_everywhere(flag):
    said = {command: _helps(command)[flag] for command in ("convert", "explain", "tune")}
    assert said["convert"] and len(set(said.values())) == 1, said


@pytest.mark.fast
@pytest.mark.parametrize("command, replaced", [
    ("convert", {"--report", "--html"}), ("verify", {"--html"}), ("bench", {"--json", "--html"}),
    ("kernels", {"--json"}), ("ranges", {"--json"}), ("tune", {"--report", "--html"})])
def test_force_names_the_files_that_command_writes(command, replaced):
    import re
    helps = _helps(command)
    named = set(re.findall(r"--[a-z-]+", helps["--force"]))
    assert named == replaced and named <= set(helps), helps["--force"]


# ----------------------------------------------------------------- messages
KERAS_EXPORT = ROOT / "tests" / "data" / "keras_export"   # serve and serving_default: one input


@pytest.mark.parametrize("shape, hint", [("nosuch=1,8,8,1", ""),
                                         ("keras_tensr=1,8,8,1", " (did you mean 'keras_tensor'?)")])
def test_shape_naming_no_input_lists_each_input_once(shape, hint, tmp_path, capsys):
    assert main([str(KERAS_EXPORT), "-o", str(tmp_path / "out"), "--target", "bfloat16",
                 "--device", "cpu", "--shape", shape]) == 2
    err = capsys.readouterr().err
    name = shape.partition("=")[0]
    assert err == (f"amp-rewrite: error: {KERAS_EXPORT}: --shape {name!r} names no input of the "
                   f"model{hint}; its inputs: keras_tensor (float32 [?,8,8,1])\n")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- the Python API
def _samples(tmp_path, n=2):
    import numpy as np
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        paths.append(tmp_path / f"s{i}.npz")
        np.savez(paths[-1], images=rng.random((4, 8, 8, 1), "float32"))
    return paths


def test_tune_takes_inputs_as_the_command_names_them(tmp_path):
    from amp_rewrite import InputError, tune
    samples = _samples(tmp_path)
    result = tune(EXAMPLE, tmp_path / "tuned.pb", inputs=[str(p) for p in samples],
                  tolerance=0.05, max_trials=4)
    assert result.ok and result.samples == 2 and (tmp_path / "tuned.pb").is_file()
    with pytest.raises(InputError, match=r"^tune: give the samples once, as inputs= \(the "
                                         r"command's --inputs\) or as feeds=, not both$"):
        tune(EXAMPLE, tmp_path / "other.pb", inputs=[str(samples[0])], feeds=[str(samples[1])])
    assert not (tmp_path / "other.pb").exists()


def test_convert_takes_a_graph_def_or_its_bytes_and_says_what_else_it_is_not():
    from tensorflow.core.framework import graph_pb2

    from amp_rewrite import InputError, convert
    data = EXAMPLE.read_bytes()
    from_bytes, report = convert(data)
    from_proto, _ = convert(graph_pb2.GraphDef.FromString(data))
    assert from_bytes == from_proto and report.summary()["matrix_converted"] == 4
    for given, says in ((b"garbage", "convert: the bytes given: not a serialized GraphDef (they "
                                     "do not parse as one; "),
                        (b"", "convert: the bytes given: not a serialized GraphDef (empty; "),
                        (data[:-3], "convert: the bytes given: not a serialized GraphDef ("),
                        (str(EXAMPLE), "convert: takes a GraphDef (tf.compat.v1.GraphDef) or its "
                                       f"serialized bytes, not str {str(EXAMPLE)!r} (for a file, "
                                       "convert_file(path, output_path))"),
                        ({"node": []}, "not dict {'node': []}")):
        with pytest.raises(InputError) as err:
            convert(given)
        assert says in str(err.value) and "\n" not in str(err.value)


def test_errors_name_the_keyword_in_python_and_the_flag_on_the_command_line(tmp_path, capsys):
    from amp_rewrite import InputError, convert_file, tune
    out = tmp_path / "out.pb"
    out.write_bytes(b"")
    with pytest.raises(InputError, match=r"out\.pb: already exists; pass force=True to replace it$"):
        convert_file(EXAMPLE, out)
    with pytest.raises(InputError, match=r"pass force=True to replace it$"):
        tune(EXAMPLE, out, inputs=[str(p) for p in _samples(tmp_path, 1)])
    with pytest.raises(InputError, match=r"the output is the input; pass in_place=True to "):
        convert_file(EXAMPLE, EXAMPLE)
    with pytest.raises(InputError, match=r"fold_constants=True applies to graph files"):
        convert_file(KERAS_EXPORT, tmp_path / "saved", fold_constants=True)
    # the command line names its flags, for the same checks
    assert main([str(EXAMPLE), "-o", str(out)]) == 2
    assert capsys.readouterr().err.endswith("out.pb: already exists; pass --force to replace it\n")
    assert main([str(KERAS_EXPORT), "-o", str(tmp_path / "saved"), "--fold-constants"]) == 2
    assert "--fold-constants applies to graph files" in capsys.readouterr().err
    # ... also where the library finds it, after the command line's own checks
    saved = tmp_path / "saved"
    assert main([str(KERAS_EXPORT), "-o", str(saved), "-q"]) == 0
    with pytest.raises(InputError, match=r"saved: already exists; pass force=True to replace it$"):
        convert_file(KERAS_EXPORT, saved)


def test_report_node_is_a_test_and_find_and_explain_raise_alike():
    from amp_rewrite import Report, convert
    _, report = convert(EXAMPLE.read_bytes())
    assert report.node("head/fc2").name == "head/fc2"
    assert report.node("fc2") is None and report.node("no/such") is None   # never raises
    for lookup in (report.find, report.explain):
        with pytest.raises(LookupError, match=r"^no node named 'fc2'.*did you mean 'head/fc2'"):
            lookup("fc2")
    doc = " ".join(Report.__doc__.split())
    assert "returns None for any other, never raising" in doc and "raise :class:`LookupError`" in doc
    assert "None for any other name" in " ".join(Report.node.__doc__.split())


# ----------------------------------------------------------------- converting a converted model
@pytest.fixture(scope="module")
def converted_twice(tmp_path_factory):
    """A TF2 train-step SavedModel (tests/saved_trainers.py) and the Keras export, each
    converted to float16 once."""
    import saved_trainers
    import tensorflow as tf
    folder = tmp_path_factory.mktemp("converted")
    module = saved_trainers.MLP(0)
    tf.saved_model.save(module, str(folder / "train_fp32"), signatures={
        "serving_default": module.serve, "train_step": module.train_step})
    for name, src in (("train", folder / "train_fp32"), ("keras", KERAS_EXPORT)):
        assert main([str(src), "-o", str(folder / name), "-q"]) == 0
    return folder


def test_reconverting_a_loss_scaled_savedmodel_is_one_line(converted_twice, tmp_path, capsys):
    capsys.readouterr()
    assert main([str(converted_twice / "train"), "-o", str(tmp_path / "again")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"amp-rewrite: error: {converted_twice / 'train'}: the SavedModel "
                                 "already has 'amp_loss_scale' state: converted before (it would "
                                 "be scaled twice)\n")
    assert not (tmp_path / "again").exists()


def test_reconverting_a_converted_savedmodel_warns_once(converted_twice, tmp_path, capsys):
    from amp_rewrite import convert_file
    capsys.readouterr()
    assert main([str(converted_twice / "keras"), "-o", str(tmp_path / "again")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "low-precision nodes" in warnings[0], warnings
    # the graph's and the function bodies' nodes in one count, the report's one warning
    report = convert_file(converted_twice / "keras", tmp_path / "again", force=True)
    held = [w for w in report.warnings if "low-precision nodes" in w]
    assert held == [warnings[0].partition("WARNING: ")[2]]
    assert int(held[0].split()[4]) == len(report.low_precision_input) > 14


# ----------------------------------------------------------------- summaries
def test_a_conversion_that_keeps_every_matrix_op_float32_says_it_is_a_float32_model(tmp_path, capsys):
    import json

    import numpy as np
    data = tmp_path / "loud.npz"
    np.savez(data, images=np.full((4, 8, 8, 1), 1e5, np.float32))   # past float16's range
    said = ("the output is a float32 model: none of its 4 MatMul/Conv-family ops computes in "
            "float16 (kept float32: range 4)")
    assert main([str(EXAMPLE), "-o", str(tmp_path / "out.pb"), "--calibration", str(data),
                 "--report", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "MatMul/Conv-family ops in float16" in line)
    assert lines[first].endswith(": 0/4 MatMul/Conv-family ops in float16")
    assert lines[first + 1] == said                                   # the summary says it
    assert err.splitlines() == [f"amp-rewrite: WARNING: {said}"]      # and warns it, once
    assert said in json.loads((tmp_path / "r.json").read_text())["warnings"]
    # ... whatever kept them (--keep here), from Python too; one 16-bit matrix op is enough
    from amp_rewrite import convert
    matrix = [n.name for n in convert(EXAMPLE.read_bytes())[1].nodes if n.op in ("Conv2D", "MatMul")]
    _, report = convert(EXAMPLE.read_bytes(), target="bfloat16", device="cpu", keep=matrix,
                        min_matrix_intensity=0)
    assert report.float32_model() == ("the output is a float32 model: none of its 4 "
                                      "MatMul/Conv-family ops computes in bfloat16 (kept float32: "
                                      "user_keep 4)") and report.float32_model() in report.warnings
    _, report = convert(EXAMPLE.read_bytes(), keep=matrix[1:])
    assert report.float32_model() is None
    _, report = convert(EXAMPLE.read_bytes())
    assert report.float32_model() is None and "float32 model" not in report.format_summary()


def _conv_bn(tmp_path) -> Path:
    """A Conv2D and its batch norm, as a frozen Keras graph has them (tests/test_fusion.py):
    TensorFlow's constant folding multiplies the scale into the filter itself."""
    import numpy as np
    import tensorflow as tf
    import test_fusion
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 8, 8, 3], name="x")
        k = tf.constant(r.normal(0, 0.4, (3, 3, 3, 4)).astype(np.float32))
        y = test_fusion._bn(tf.nn.conv2d(x, k, 1, "SAME", name="conv"), r, 4, "conv_bn")
        plain = tf.nn.conv2d(x, k, 1, "SAME", name="plain")        # no scale: nothing to fold
        tf.identity(tf.nn.relu(y) + plain, name="out")
    path = tmp_path / "conv_bn.pb"
    path.write_bytes(g.as_graph_def().SerializeToString())
    return path


def test_fold_constants_counts_the_scales_tensorflow_folded(tmp_path, capsys):
    import json

    from tensorflow.core.framework import graph_pb2
    src = _conv_bn(tmp_path)
    assert main([str(src), "-o", str(tmp_path / "out.pb"), "--fold-constants",
                 "--report", str(tmp_path / "r.json")]) == 0
    summary = capsys.readouterr().out
    assert ("fusion: batch-norm scales folded into convolution filters: 1 (1 by TensorFlow's "
            "constant folding), per-channel adds made BiasAdd: 1 ") in summary
    fusion = json.loads((tmp_path / "r.json").read_text())["fusion"]
    assert (fusion["scales_folded"], fusion["scales_folded_by_tensorflow"]) == (1, 1)
    # what it counts is there: no Mul left, the convolution reads a folded filter
    out = graph_pb2.GraphDef.FromString((tmp_path / "out.pb").read_bytes())
    assert "Mul" not in {n.op for n in out.node}
    assert sum(n.op == "Conv2D" for n in out.node) == 2


# ----------------------------------------------------------------- what the README says
README = " ".join((ROOT / "README.md").read_text().split())


@pytest.mark.parametrize("outputs", ["dict", "list"])
def test_a_converted_keras_model_names_its_outputs_as_the_readme_says(outputs, tmp_path, capsys):
    import keras
    import numpy as np
    import tensorflow as tf
    inputs = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    cls, price = keras.layers.Dense(3, name="cls")(hidden), keras.layers.Dense(1, name="price")(hidden)
    model = keras.Model(inputs, {"cls": cls, "price": price} if outputs == "dict" else [cls, price])
    model.save(tmp_path / "m.keras")
    assert main([str(tmp_path / "m.keras"), "-o", str(tmp_path / "amp"), "-q"]) == 0
    served = tf.saved_model.load(str(tmp_path / "amp")).signatures["serving_default"]
    got = served(features=tf.constant(np.ones((2, 6), np.float32)))
    names = ["cls", "price"] if outputs == "dict" else ["output_0", "output_1"]
    assert sorted(got) == names and got[names[0]].shape == (2, 3)
    assert ("outputs by their keys (a model returning a dict) or `output_0`, `output_1` ..."
            in README)


@pytest.mark.fast
def test_the_fast_subset_is_said_to_take_under_a_minute_everywhere():
    """Measured 34-36 s on this project's 2-core machine (issue 37 said 22-28 s), against the
    README's 'in seconds': README, docs/development.md and the marker say 'under a minute'."""
    import tomllib
    marker = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("fast:") and "under a minute" in m for m in marker)
    assert "runs the part that needs no TensorFlow session in under a minute" in README
    development = (ROOT / "docs" / "development.md").read_text()
    line = next(x for x in development.splitlines() if x.startswith(".venv/bin/python -m pytest -q -m fast"))
    assert line.endswith("# no TensorFlow session: under a minute")
