"""A newcomer's first hour, on models built the way users build them (a Keras SavedModel export,
a TF1 .meta with Adam and batch norm): names users can find, reports that count what the output
holds, no surprises from options or containers, quiet output."""

import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grappler_graphs
import pytest
import training_graphs
from tensorflow.core.framework import types_pb2

from amp_rewrite import cli, convert, convert_file
from amp_rewrite.core.errors import InputError, UnsupportedGraphError
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.io.load import load
from amp_rewrite.report.html import graph_precision

HERE = Path(__file__).resolve().parent
KERAS_EXPORT = HERE / "data" / "keras_export"
EXAMPLE = HERE.parent / "examples" / "cnn_fp32.pb"


@pytest.fixture(scope="module")
def keras_bf16(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keras")
    src = folder / "model"
    shutil.copytree(KERAS_EXPORT, src)
    # painted whole (the knob at 0): by default on a CPU its LSTM stays float32, its variable
    # weights cast every step costing more than its MatMuls save (test_costs.py); these tests
    # count what a body holds, so every matrix op is painted
    # (variables kept: frozen, bfloat16's default on a CPU, the bodies would be inlined)
    report = convert_file(src, folder / "bf16", target="bfloat16", device="cpu",
                          min_matrix_intensity=0, freeze=False)
    return src, folder / "bf16", report


@pytest.fixture(scope="module")
def two_functions(tmp_path_factory):
    """The report of a SavedModel whose one Keras Dense layer is traced into two functions
    (two signatures), converted."""
    import keras
    import tensorflow as tf

    class TwoHeads(tf.Module):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)
            self.dense.build((None, 8))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def logits(self, x):
            return self.dense(x)

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def probabilities(self, x):
            return tf.nn.softmax(self.dense(x))

    folder = tmp_path_factory.mktemp("two_functions")
    module = TwoHeads()
    tf.saved_model.save(module, str(folder / "model"),
                        signatures={"logits": module.logits, "probabilities": module.probabilities})
    return convert_file(folder / "model", folder / "f16", target="float16")


@pytest.fixture(scope="module")
def adam_bn_meta(tmp_path_factory):
    path = tmp_path_factory.mktemp("meta") / "train.meta"
    path.write_bytes(training_graphs.build("cnn", "adam").SerializeToString())
    return path


# ----------------------------------------------------------------- names users can find
def test_function_nodes_are_found_without_their_function_prefix(keras_bf16):
    _, _, report = keras_bf16
    functions = report.to_dict()["functions"]
    assert report.summary()["functions"] == len(functions) > 0
    inside = [n for n in report.nodes if n.op in MATRIX_OPS and "/" in n.name]
    short = {}
    for n in report.nodes:
        for scope in functions:
            if n.name.startswith(scope + "/"):
                short.setdefault(n.name[len(scope) + 1:], []).append(n)
    unique = [name for name, found in short.items() if len(found) == 1
              and found[0] in inside and name not in {n.name for n in report.nodes}]
    assert unique, "the export has matrix ops inside functions"
    for name in unique:
        assert report.find(name) is short[name][0]
        assert report.explain(name).startswith(short[name][0].name)


def test_a_miss_suggests_close_names(keras_bf16):
    _, _, report = keras_bf16
    node = next(n for n in report.nodes if n.op == "MatMul" and "/" in n.name)
    with pytest.raises(LookupError) as miss:
        report.find(node.name[:-1])
    assert node.name in str(miss.value)


def test_an_ambiguous_name_lists_where(two_functions):
    """One Keras layer traced into two functions: its short name means two nodes, and the
    refusal names both, each with its function."""
    report = two_functions
    matmuls = [n.name for n in report.nodes if n.op == "MatMul"]
    scopes = [next(s for s in report.functions() if m.startswith(s + "/")) for m in matmuls]
    short = {m[len(s) + 1:] for m, s in zip(matmuls, scopes)}
    assert len(matmuls) == len(set(scopes)) == 2 and len(short) == 1
    with pytest.raises(LookupError) as ambiguous:
        report.find(short.pop())
    assert all(m in str(ambiguous.value) for m in matmuls)


def test_explain_command_takes_the_short_name_and_says_no_in_one_line(keras_bf16, capsys):
    src, _, report = keras_bf16
    full = next(n.name for n in report.nodes if n.op == "MatMul" and "/" in n.name)
    scope = next(s for s in report.functions() if full.startswith(s + "/"))
    short = full[len(scope) + 1:]
    flags = ["--target", "bfloat16", "--device", "cpu", "--no-freeze"]
    assert cli.main(["explain", str(src), short, *flags]) == 0
    assert capsys.readouterr().out.startswith(f"{full} (MatMul): ")   # found in its function
    assert cli.main(["explain", str(src), short[:-1], *flags]) == 2
    err = capsys.readouterr().err
    # one line, suggesting the close name where the node lives: with its function
    assert len(err.strip().splitlines()) == 1 and f"'{full}'" in err


def test_keep_signature_and_direct_reasons_have_codes_of_their_own(adam_bn_meta, tmp_path):
    """--keep, a signature's tensor (here one the graph reads on: not a graph output) and a
    direct call of a library function each say so in their own code."""
    meta = load(adam_bn_meta).meta_graph
    conv = next(n.name for n in meta.graph_def.node if n.op == "Conv2D")
    relu = next(n.name for n in meta.graph_def.node if n.op == "Relu")
    meta.signature_def["features"].outputs["relu"].name = relu + ":0"
    path = tmp_path / "signed.meta"
    path.write_bytes(meta.SerializeToString())
    report = convert_file(path, tmp_path / "kept.meta", keep=[conv], target="float16", device="cpu")
    assert report.node(conv).code == "user_keep" and report.node(conv).precision == "float32"
    assert report.node("x").code == "interface"    # a graph input
    assert report.node(relu).code == "interface" and report.node(relu).precision == "float32"
    graph_def, _ = grappler_graphs.direct_call()
    functions = {f.signature.name for f in graph_def.library.function}
    call = next(n for n in graph_def.node if n.op in functions)
    _, report = convert(graph_def, target="float16")
    assert report.node(call.name).code == "function_call"
    assert report.node("m1").precision == report.node("m2").precision == "float16"


def test_a_deny_path_runs_from_the_deny_op_along_data_edges(adam_bn_meta):
    report = convert_file(adam_bn_meta, adam_bn_meta.with_name("f16.meta"), target="float16",
                          device="cpu", loss_scale="none")
    graph = {n.name: n for n in load(adam_bn_meta).graph_def.node}
    denied = [node for node in report.nodes if node.code == "deny_propagated"]
    assert denied, "deny spreads from the softmax cross-entropy"
    for node in denied:
        path = node.via + [node.name]
        assert report.node(path[0]).code == "deny_list"
        for a, b in zip(path, path[1:]):   # each step is a data edge a -> b
            assert any(i.split(":")[0] == a for i in graph[b].input if not i.startswith("^"))


# ----------------------------------------------------------------- reports that read right
def test_converting_a_converted_graph_counts_what_the_output_holds(tmp_path):
    once = tmp_path / "once.pb"
    first = convert_file(EXAMPLE, once, target="float16")
    again = convert_file(once, tmp_path / "twice.pb", target="float16")
    for report in (first, again):
        s = report.summary()
        assert s["matrix_converted"] == s["matrix_total"] == 4


def test_matrix_ops_are_counted_whatever_the_rules_paint(monkeypatch):
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef()
    gd.ParseFromString(EXAMPLE.read_bytes())
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE", "MatMul")
    _, report = convert(gd, target="float16")
    s = report.summary()
    assert s["matrix_total"] == 4 and s["matrix_converted"] == 2    # the convolutions only


def test_bench_and_verify_pages_count_function_bodies_of_a_saved_model(keras_bf16):
    _, out, report = keras_bf16
    nodes = graph_precision(out)
    matrix = [n for n in nodes if n["op"] in MATRIX_OPS]
    assert matrix and all(n["precision"] == "bfloat16" for n in matrix)
    assert len(matrix) == report.summary()["matrix_total"]


def test_plumbing_is_counted_apart_from_the_math(keras_bf16):
    _, _, report = keras_bf16
    s = report.summary()
    assert s["plumbing"] + s["float_ops_total"] + s["matrix_total"] == s["nodes_total"]
    assert s["matrix_converted"] == s["matrix_total"] > 0


# ----------------------------------------------------------------- no surprises
def test_a_saved_model_is_not_written_as_a_pb_file(keras_bf16, tmp_path, capsys):
    src, _, _ = keras_bf16
    for given in (src, src / "saved_model.pb"):
        assert cli.main([str(given), "-o", str(tmp_path / "cx.pb")]) == 2
        assert "SavedModel directory" in capsys.readouterr().err
        assert not (tmp_path / "cx.pb").exists()
        with pytest.raises(InputError):
            convert_file(given, tmp_path / "cx.pb")


@pytest.mark.parametrize("flags", [
    ["--loss-scale", "1000", "--loss-scale-start", "100"],
    ["--loss-scale", "1000", "--loss-scale-interval", "10"],
    ["--loss-scale", "none", "--grad", "seed"],
    ["--target", "bfloat16", "--device", "cpu", "--loss-scale-factor", "4"],
])
def test_conflicting_loss_scale_options_are_refused(flags, adam_bn_meta, tmp_path, capsys):
    out = tmp_path / "out.meta"
    assert cli.main([str(adam_bn_meta), "-o", str(out), *flags]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not out.exists()


def test_refusal_of_a_saved_model_train_step_fits_the_options_given(tmp_path):
    """A TF1 SavedModel whose graph trains gets no loss scaling: the message fits what was
    asked (bfloat16 needs none; float16 has other ways). A TF2 train step gets it either way."""
    import tensorflow as tf
    import test_savedmodel
    src = tmp_path / "tf1"
    test_savedmodel._tf1_train_and_serve(src)
    with pytest.raises(UnsupportedGraphError) as bf16:
        convert_file(src, tmp_path / "bf16", target="bfloat16", device="cpu", loss_scale="dynamic")
    assert "drop --loss-scale" in str(bf16.value) and "--target bfloat16" not in str(bf16.value)
    with pytest.raises(UnsupportedGraphError) as f16:
        convert_file(src, tmp_path / "f16", target="float16")
    assert "--target bfloat16" in str(f16.value) and ".meta" in str(f16.value)
    module = test_savedmodel.Trainer()
    tf2 = tmp_path / "trainer"
    tf.saved_model.save(module, str(tf2), signatures={"train": module.train})
    report = convert_file(tf2, tmp_path / "tf2_bf16", target="bfloat16", device="cpu",
                          loss_scale="dynamic")
    assert report.to_dict()["loss_scaling"]["mode"] == "dynamic"


def test_keras_files_say_they_convert_to_a_saved_model_directory(tmp_path, capsys):
    """A Keras file converts (tests/test_keras_files.py), to a SavedModel directory: a graph
    file's name for the output is refused before Keras loads anything, naming a directory."""
    import keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    for name in ("m.keras", "m.h5"):
        model.save(tmp_path / name)
        assert cli.main([str(tmp_path / name), "-o", str(tmp_path / "out.pb")]) == 2
        err = capsys.readouterr().err
        assert "SavedModel directory" in err and f"e.g. {tmp_path / 'out'})" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.h5", "m.keras"]


# ----------------------------------------------------------------- quiet output
@pytest.mark.parametrize("argv", [
    [str(EXAMPLE), "-o", "out.pb", "--html", "r.html", "--tensorboard", "tb"],
    ["kernels", str(EXAMPLE), "--shape", "images=2,8,8,1"],
    ["verify", str(EXAMPLE), "f16.pb", "--shape", "images=2,8,8,1"],
])
def test_tensorflow_c_log_stays_quiet_without_verbose(argv, tmp_path):
    """TensorFlow's C++ log lines (``I0000 00:00:... port.cc:153] oneDNN custom operations
    are on``, a CUDA driver missing ...) are written at import whatever TF_CPP_MIN_LOG_LEVEL
    says, and running a float16 graph on a CPU logs an error-level line that is no error of
    the command (``oneDNN supports DT_HALF only on ...``): hidden by default, shown with -v."""
    convert_file(EXAMPLE, tmp_path / "f16.pb", target="float16")

    # as a user's shell runs it: the suite's own TF_CPP_MIN_LOG_LEVEL (conftest) left out
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}

    def stderr(*extra):
        proc = subprocess.run([sys.executable, "-m", "amp_rewrite", *argv, *extra], env=env,
                              capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr.splitlines()
    quiet = stderr()
    assert [line for line in quiet if not line.startswith("amp-rewrite:")] == []
    verbose = stderr("-v", *(["--force"] if argv[0] not in ("kernels", "verify") else []))
    assert [line for line in verbose if TF_LOG_LINE.match(line)], verbose


# absl's format: severity and date, time (before absl is set up: 00:00:<seconds since the
# epoch>), thread, file:line]
TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] ")


def test_converted_float16_stays_float16_in_every_matrix_op_of_the_meta(adam_bn_meta, tmp_path):
    out = tmp_path / "f16.meta"
    convert_file(adam_bn_meta, out, target="float16", device="cpu")
    matrix = [n for n in load(out).graph_def.node if n.op in MATRIX_OPS]
    assert matrix and all(n.attr["T"].type == types_pb2.DT_HALF for n in matrix)
