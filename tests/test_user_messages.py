"""What a user reads on the models users bring: explain's near names on frozen TF2 graphs and
SavedModels, TensorFlow's C++ log kept off stderr unless -v (children included), the CPU line
saying what the target means on this machine, and rule-file errors quoting the bad value at
its line."""

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

from amp_rewrite import cli, convert_file
from amp_rewrite.core import hardware
from amp_rewrite.core.errors import InputError, RuleError
from amp_rewrite.rules.loader import load_rules

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cnn_fp32.pb"
# absl's format: severity and date, time, thread, file:line] (as tests/test_newcomer.py)
TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] ")


# ----------------------------------------------------------------- explain's near names
@pytest.fixture(scope="module")
def keras_models(tmp_path_factory):
    """A Keras model as users bring it: its SavedModel (nodes in functions named
    ``__inference_serving_default_N/tiny_1/...``) and the frozen graph of its serving
    signature (``StatefulPartitionedCall/tiny_1/predictions_1/Softmax``)."""
    folder = tmp_path_factory.mktemp("keras")
    inputs = tf.keras.Input((6, 6, 3), name="images")
    x = tf.keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = tf.keras.layers.Flatten(name="flat")(x)
    outputs = tf.keras.layers.Dense(5, activation="softmax", name="predictions")(x)
    model = tf.keras.Model(inputs, outputs, name="tiny")
    saved = folder / "saved"
    tf.saved_model.save(model, str(saved))
    loaded = tf.saved_model.load(str(saved))   # held: the signature reads its variables
    frozen = folder / "frozen.pb"
    frozen.write_bytes(convert_variables_to_constants_v2(loaded.signatures["serving_default"])
                       .graph.as_graph_def().SerializeToString())
    return {"frozen": frozen, "saved": saved}


@pytest.fixture(scope="module")
def reports(keras_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    return {kind: convert_file(path, out / kind, force=True)
            for kind, path in keras_models.items()}


def _suggested(report, name) -> list[str]:
    with pytest.raises(LookupError) as err:
        report.explain(name)
    message = err.value.args[0]
    assert "\n" not in message and message.startswith(f"no node named {name!r}")
    return re.findall(r"'([^']+)'", message.partition("did you mean")[2])


def test_frozen_tf2_graph_suggests_the_name_under_its_call_prefix(reports):
    report = reports["frozen"]
    real = "StatefulPartitionedCall/tiny_1/predictions_1/Softmax"
    assert report.node(real) is not None
    assert _suggested(report, "predictions_1/Softmax") == [real]       # the case
    assert _suggested(report, "tiny/predictions/Softmax") == [real]    # Keras's names, no _1
    assert _suggested(report, "predictions/Softmax:0") == [real]       # a tensor name


def test_saved_model_suggests_function_node_names(reports):
    report = reports["saved"]
    real = next(n.name for n in report.nodes if n.name.endswith("/tiny_1/predictions_1/Softmax"))
    assert real.startswith("__inference_")
    assert _suggested(report, "predictions/Softmax") == [real]
    # the frozen graph's name, asked of the SavedModel: the call prefix it lacks is no obstacle
    assert _suggested(report, "StatefulPartitionedCall/tiny_1/predictions_1/Softmax") == [real]


def test_a_layer_name_lists_several_of_its_nodes_on_one_line(reports):
    names = _suggested(reports["frozen"], "predictions")
    assert len(names) > 1 and all("/predictions_1/" in n for n in names)
    # misspelt: spelling decides when no path matches
    assert "StatefulPartitionedCall/tiny_1/predictions_1/MatMul" in \
        _suggested(reports["frozen"], "predictons/MatMul")


def test_keep_suggests_the_same_names(keras_models, tmp_path):
    with pytest.raises(InputError, match=r"--keep names no node 'predictions_1/Softmax'; did you "
                       r"mean 'StatefulPartitionedCall/tiny_1/predictions_1/Softmax'\?"):
        convert_file(keras_models["frozen"], tmp_path / "out.pb", keep=["predictions_1/Softmax"])


def test_explain_command_prints_the_suggestion(keras_models, capsys):
    assert cli.main(["explain", str(keras_models["frozen"]), "predictions_1/Softmax"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "did you mean 'StatefulPartitionedCall/tiny_1/predictions_1/Softmax'?" in err


# ----------------------------------------------------------------- TensorFlow's C++ log
@pytest.fixture(scope="module")
def f16_example(tmp_path_factory):
    path = tmp_path_factory.mktemp("f16") / "f16.pb"
    convert_file(EXAMPLE, path, target="float16")
    return path


def _run(argv, level="2"):
    """The command in a fresh process, as a shell with ``TF_CPP_MIN_LOG_LEVEL=level`` (a
    common setting, which lets TensorFlow's error lines through) runs it."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=level)
    proc = subprocess.run([sys.executable, "-m", "amp_rewrite", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines(), proc.stderr.splitlines()


def test_float16_verify_is_quiet_and_its_cpu_line_says_what_float16_means_here(f16_example):
    out, err = _run(["verify", EXAMPLE, f16_example, "--shape", "images=2,8,8,1"])
    # oneDNN's "supports DT_HALF only on platforms with AVX-512" (an error-level line, on
    # CPUs without AVX512-FP16) and every other C++ line stay off stderr without -v
    assert [line for line in err if TF_LOG_LINE.match(line) or ".cc:" in line] == []
    assert out[0] == hardware.machine_line("float16") and "float16" in out[0]


def test_kernels_with_verbose_shows_the_child_process_log(f16_example):
    _, err = _run(["kernels", f16_example, "--shape", "images=2,8,8,1", "-v"])
    header = next(i for i, line in enumerate(err) if "the kernels run's stderr:" in line)
    assert any(TF_LOG_LINE.match(line) for line in err[header + 1:]), err


# ----------------------------------------------------------------- the CPU line
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}          # Zen 4
AMX = AVX512_BF16 | {"amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}           # Sapphire Rapids
NUMBERS_ONLY = ("float16 on this CPU checks numbers only (TensorFlow's float16 CPU kernels are "
                "slow)")


def test_cpu_line_on_an_avx2_only_cpu():
    f16 = hardware.machine_line("float16", AVX2, "cpu")
    assert f16.startswith(f"CPU: cpu; 16-bit matrix units: none: {NUMBERS_ONLY}")
    assert "--target bfloat16" not in f16 and "float32 runs fastest" in f16
    bf16 = hardware.machine_line("bfloat16", AVX2, "cpu")
    assert "no matrix unit" in bf16 and "slower than float32" in bf16


def test_cpu_line_on_an_avx512_bf16_cpu():
    f16 = hardware.machine_line("float16", AVX512_BF16, "cpu")
    assert f16 == ("CPU: cpu; 16-bit matrix units: AVX512-BF16; " + NUMBERS_ONLY
                   + "; --target bfloat16 --device cpu runs faster here (on AVX512-BF16)")
    assert hardware.machine_line("bfloat16", AVX512_BF16, "cpu").endswith(
        "; bfloat16 runs on AVX512-BF16 here (oneDNN)")


def test_cpu_line_on_amx_cpus():
    # Sapphire Rapids: TensorFlow runs float16 through oneDNN on AVX512-FP16, bfloat16 on AMX
    f16 = hardware.target_note("float16", AMX)
    assert f16.startswith("float16 runs on AVX512-FP16") and NUMBERS_ONLY not in f16
    assert "--target bfloat16 --device cpu runs on AMX-BF16" in f16
    assert hardware.target_note("bfloat16", AMX) == "bfloat16 runs on AMX-BF16 here (oneDNN)"
    # an AMX-BF16 CPU without a float16 unit: float16 is for numbers there
    no_fp16 = AMX - {"avx512_fp16"}
    assert hardware.target_note("float16", no_fp16) == (
        NUMBERS_ONLY + "; --target bfloat16 --device cpu runs faster here (on AMX-BF16)")
    # a float32 model: the units only
    assert hardware.machine_line(None, AMX, "cpu") == (
        "CPU: cpu; 16-bit matrix units: AMX-BF16, AVX512-BF16, AVX512-FP16")


def test_convert_ends_with_the_cpu_line_where_tensorflow_sees_no_gpu(tmp_path, capsys):
    if hardware.gpu_visible():
        pytest.skip("TensorFlow sees a GPU here: float16 for it is no CPU matter")
    assert cli.main([str(EXAMPLE), "-o", str(tmp_path / "f16.pb")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wrote {tmp_path / 'f16.pb'}" and out[1].startswith("target float16 on gpu")
    assert out[-1] == hardware.machine_line("float16")


# ----------------------------------------------------------------- rule files
# a value of every TOML type as written, and what the error quotes of it
VALUES = {
    "string": ('"Relux"', "'Relux'"), "integer": ("7", "7"), "float": ("2.5", "2.5"),
    "boolean": ("true", "true"), "datetime": ("1979-05-27T07:32:00Z", "1979-05-27T07:32:00"),
    "date": ("1979-05-27", "1979-05-27"), "time": ("07:32:00", "07:32:00"),
    "strings": ('["Relux"]', "'Relux'"), "integers": ("[7, 8]", "[7, 8]"),
    "empty array": ("[]", "[]"), "tables": ('[{ glob = "x", action = "keep_fp32" }]', "glob = 'x'"),
    "table": ("{ zz = 7 }", "zz"), "empty table": ("{}", "{}"),
}
KEYS = [("", key, "") for key in ("target", "extends", "level", "painting", "override",
                                  "allow", "deny")]
KEYS += [(f"[{lst}]", key, "") for lst in ("allow", "clear") for key in ("ops", "add", "remove")]
KEYS += [("[painting]", "infer_follows_allow", "")]
KEYS += [("[[override]]", "glob", 'action = "keep_fp32"'),
         ("[[override]]", "regex", 'action = "keep_fp32"'),
         ("[[override]]", "action", 'glob = "x"')]


def test_every_refused_value_is_quoted_at_its_line(tmp_path):
    path = tmp_path / "r.toml"
    refused = 0
    for (table, key, extra), (kind, (written, quoted)) in itertools.product(KEYS, VALUES.items()):
        # a comment naming the key, and a table with the same keys (an override) before a
        # table's, so neither line 1 nor the first line naming the key would do
        bad = f"{key} = {written}"
        lines = [f"# {key} = as it was", ""]
        if table:
            lines += ["[[override]]", 'glob = "head/*"', 'action = "keep_fp32"', "", table, extra]
        lines.append(bad)
        path.write_text("\n".join(lines) + "\n")
        try:
            load_rules("float16", [path], env={})
        except RuleError as exc:
            refused += 1
            where, _, message = str(exc).partition(": ")
            assert where == f"{path}:{lines.index(bad) + 1}", (table, key, kind, str(exc))
            assert quoted in message, (table, key, kind, str(exc))
    assert refused > 100


def test_a_bad_override_action_is_quoted_with_the_nearest_action(tmp_path, capsys):
    rules = tmp_path / "keep.toml"
    rules.write_text('# keep the head\n[[override]]\nglob = "head/*"\naction = "keep_fp32"\n\n'
                     '[[override]]\nglob = "block1/*"\naction = "keep_f32"\n')
    assert cli.main(["rules", "show", "--rules", str(rules)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"amp-rewrite: error: {rules}:8: action = 'keep_f32': override action must "
                   "be one of keep_fp32, force_lowp; did you mean 'keep_fp32'?")


@pytest.mark.parametrize("text, line, quoted", [
    ('[[override]]\nglob = "x"\nactoin = "keep_fp32"\n', 3, "unknown key 'actoin' in [[override]]; did you mean 'action'?"),
    ('[[override]]\nglob = "x"\nregex = "x"\naction = "keep_fp32"\n', 3, "glob = 'x', regex = 'x'"),
    ('[[override]]\nglob = "x"\n', 1, "needs an action"),
    ('[[override]]\nregex = "("\naction = "keep_fp32"\n', 2, "bad regex '('"),
    ('[painting]\ninfer_follow_allow = true\n', 2, "did you mean 'infer_follows_allow'?"),
    ('[deny]\n# ops\nremove = [\n  "Exp",\n  "Lgo",\n]\n', 5, "no op 'Lgo'"),
    ('level = "default"\n\naction = keep_fp32\n', 3, "not valid TOML: Invalid value (at line 3, "
                                                     "column 10): 'action = keep_fp32'"),
])
def test_rule_file_messages_point_at_the_bad_line(tmp_path, text, line, quoted):
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(RuleError) as err:
        load_rules("float16", [path], env={})
    assert str(err.value).startswith(f"{path}:{line}: ") and quoted in str(err.value)
