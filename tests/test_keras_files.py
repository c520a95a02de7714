"""Keras files (``.keras``, legacy ``.h5``) convert directly: loaded with Keras in safe mode,
their serving function exported to a temporary folder and converted to a SavedModel directory
(amp_rewrite/io/keras_files.py). The converted SavedModel, loaded with ``tf.saved_model.load``,
serves what the Keras model predicts within the low-precision tolerance; verify, explain,
bench, kernels and tune take the Keras file too; a file Keras cannot load safely is refused in
one line, and nothing is left behind (no output, no temporary folder, nothing beside the input).
"""

import html
import json
import os
import re
import shlex
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from refusals import assert_refused, run_cli, snapshot
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2

from amp_rewrite import InputError, convert_file

VOCAB, LENGTH, CLASSES = 200, 10, 4
# verify's default rel_l2 bounds (docs/verify.md), which a converted classifier must meet
REL_L2 = {"float16": 1e-2, "bfloat16": 5e-2}
LOWP = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}


def gru_classifier() -> keras.Model:
    """A small text classifier: token ids -> Embedding -> GRU -> Dense softmax."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, 16)(tokens)
    x = keras.layers.GRU(16)(x)
    probs = keras.layers.Dense(CLASSES, activation="softmax", name="probs")(x)
    return keras.Model(tokens, probs, name="gru_classifier")


@pytest.fixture(scope="module")
def gru(tmp_path_factory):
    """The classifier saved as ``.keras`` and ``.h5`` in a folder of their own, some token
    sequences, and what Keras predicts for them."""
    folder = tmp_path_factory.mktemp("keras_files")
    model = gru_classifier()
    model.save(folder / "gru.keras")
    model.save(folder / "gru.h5")
    tokens = np.random.default_rng(1).integers(0, VOCAB, (32, LENGTH)).astype(np.int32)
    np.savez(folder / "tokens.npz", tokens=tokens)
    return folder, tokens, model.predict(tokens, verbose=0)


@pytest.fixture
def scratch_tmp(tmp_path, monkeypatch):
    """The system's temporary directory, for this test, an empty folder of its own: what the
    exports leave there is seen (and other processes' files are not)."""
    folder = tmp_path / "system_tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _exports_in(folder) -> list[str]:
    """What exports left in ``folder`` (TensorFlow's autograph writes its own files there)."""
    return [p.name for p in folder.iterdir() if p.name.startswith("amp-rewrite-keras-")]


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _lowp_matmuls(saved_model_dir, target: str) -> list[str]:
    """The MatMuls of the SavedModel's function bodies that compute in ``target``."""
    saved = saved_model_pb2.SavedModel.FromString((saved_model_dir / "saved_model.pb").read_bytes())
    return [f"{f.signature.name}/{n.name}" for m in saved.meta_graphs
            for f in m.graph_def.library.function for n in f.node_def
            if n.op == "MatMul" and n.attr["T"].type == LOWP[target]]


@pytest.mark.parametrize("name, target, via", [("gru.keras", "float16", "cli"),
                                               ("gru.keras", "bfloat16", "api"),
                                               ("gru.h5", "bfloat16", "cli")])
def test_keras_file_converts_to_a_saved_model_that_serves_its_predictions(
        gru, name, target, via, tmp_path, scratch_tmp, capsys):
    folder, tokens, predicted = gru
    before = snapshot(folder)
    out = tmp_path / "gru_amp"
    # bfloat16 on a CPU keeps this small GRU float32 by default (its variable weights, cast on
    # every run, cost more than its MatMuls save: test_costs.py); the knob at 0 paints it
    knob = ["--min-matrix-intensity", "0"] if target == "bfloat16" else []
    if via == "cli":
        code, stdout, err = run_cli(capsys, [folder / name, "-o", out, "--target", target,
                                             "--device", "cpu", "--report", tmp_path / "r.json",
                                             *knob])
        assert code == 0, err
        assert f"wrote {out}" in stdout
        matrix = json.loads((tmp_path / "r.json").read_text())["summary"]["matrix_converted"]
    else:
        report = convert_file(folder / name, out, target=target, device="cpu",
                              **({"min_matrix_intensity": 0} if knob else {}))
        matrix = report.summary()["matrix_converted"]
    assert matrix > 0 and _lowp_matmuls(out, target), "nothing computes in low precision"
    served = tf.saved_model.load(str(out)).signatures["serving_default"]
    got = served(tokens=tf.constant(tokens))["output_0"].numpy()
    assert got.dtype == np.float32 and got.shape == predicted.shape
    assert _rel_l2(got, predicted) < REL_L2[target]
    assert np.mean(got.argmax(1) == predicted.argmax(1)) >= 0.9
    # the output directory is made like any other (not the temporary folder's 0700)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~_umask()
    assert snapshot(folder) == before              # nothing written beside the input
    assert _exports_in(scratch_tmp) == []       # the export is gone


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_commands_take_a_keras_file(gru, tmp_path, scratch_tmp, capsys):
    """verify, explain, bench, kernels and tune run on a Keras file as on its export."""
    folder, _, _ = gru
    keras_file, data = folder / "gru.keras", folder / "tokens.npz"
    converted, report = tmp_path / "bf16", tmp_path / "bf16.json"
    common = ["--target", "bfloat16", "--device", "cpu"]
    # (the conversion that keeps the variables, so its nodes are the export's; a Keras file
    # that only serves is frozen by default, test_default_conversion.py)
    assert run_cli(capsys, [keras_file, "-o", converted, *common, "--no-freeze",
                            "--report", report])[0] == 0
    page = tmp_path / "verify.html"
    code, out, err = run_cli(capsys, ["verify", keras_file, converted, "--inputs", data,
                                      "--html", page])
    assert code == 0 and "verdict: within tolerance" in out, out + err
    # the page's next command names the Keras file as given, not its export (gone by then)
    command = re.search(r'<code id="next-command">([^<]*)</code>', page.read_text()).group(1)
    assert shlex.split(html.unescape(command)) == [
        "amp-rewrite", "bench", str(keras_file), str(converted), "--inputs", str(data)]
    # the Dense head's MatMul, by its name inside the function (the function's name carries
    # TensorFlow's trace counter)
    head, = [n["name"].split("/", 1)[1] for n in json.loads(report.read_text())["nodes"]
             if n["op"] == "MatMul" and "probs" in n["name"]]
    code, out, err = run_cli(capsys, ["explain", keras_file, head, *common, "--no-freeze"])
    # its weight, a variable in the export, has a known shape: too small for bfloat16 on a CPU
    assert code == 0 and f"{head} (MatMul): kept float32" in out and "FLOPs per element" in out, \
        out + err
    code, out, err = run_cli(capsys, ["bench", keras_file, converted, "--inputs", data,
                                      "--runs", "2", "--warmup", "1"])
    assert code == 0 and "speed-up" in out, out + err
    code, out, err = run_cli(capsys, ["kernels", keras_file, "--inputs", data])
    assert code == 0 and "CPU:" in out, out + err
    tuned = tmp_path / "tuned"
    code, out, err = run_cli(capsys, ["tune", keras_file, "-o", tuned, "--inputs", data,
                                      "--max-trials", "3", *common])
    assert code == 0 and (tuned / "saved_model.pb").is_file(), out + err
    # the rules file names the Keras file, not its temporary export
    rules = (tmp_path / "tuned.tune.toml").read_text()
    assert rules.startswith(f"# Written by amp-rewrite tune for {keras_file}:")
    assert _exports_in(scratch_tmp) == []


def test_an_error_names_the_keras_file_not_its_export(gru, capsys, scratch_tmp):
    folder, _, _ = gru
    code, _, err = run_cli(capsys, ["explain", folder / "gru.keras", "no_such_node"])
    assert code == 2 and err.startswith(f"amp-rewrite: error: {folder / 'gru.keras'}: ")
    assert "amp-rewrite-keras-" not in err and len(err.strip().splitlines()) == 1
    assert _exports_in(scratch_tmp) == []


def test_a_graph_file_name_for_the_output_is_refused(gru, tmp_path):
    folder, _, _ = gru
    with pytest.raises(InputError, match="SavedModel directory"):
        convert_file(folder / "gru.h5", tmp_path / "gru.pb")
    assert list(tmp_path.iterdir()) == []


def _lambda_model(marker) -> keras.Model:
    """A model whose Lambda layer creates ``marker`` whenever Keras calls it (building the
    model does, and so would loading it)."""
    inp = keras.Input((4,), name="x")
    touch = eval(f"lambda t: (open({str(marker)!r}, 'w').close(), t)[1]")  # noqa: S307
    return keras.Model(inp, keras.layers.Dense(2)(keras.layers.Lambda(touch)(inp)))


class Doubled(keras.layers.Layer):
    """A custom layer never registered with Keras: a file holding it cannot be loaded by name."""

    def call(self, x):
        return 2 * x


@pytest.mark.parametrize("kind", ["lambda.keras", "lambda.h5", "custom.keras", "custom.h5"])
def test_code_keras_cannot_load_safely_is_refused_in_one_line(kind, tmp_path, scratch_tmp, capsys):
    marker = tmp_path / "lambda_ran"
    if kind.startswith("lambda"):
        _lambda_model(marker).save(tmp_path / kind)
    else:
        inp = keras.Input((4,), name="x")
        keras.Model(inp, keras.layers.Dense(2)(Doubled()(inp))).save(tmp_path / kind)
    marker.unlink(missing_ok=True)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [tmp_path / kind, "-o", tmp_path / "out"])
    assert_refused(code, err, kind, tmp_path, before)
    assert "Keras could not load it in safe mode" in err and "model.export(" in err
    assert ("Lambda" if kind.startswith("lambda") else "Doubled") in err
    assert not marker.exists()                     # the lambda never ran
    assert _exports_in(scratch_tmp) == []


@pytest.mark.parametrize("name, says", [("renamed.pb", "rename it"),
                                        ("garbage.keras", "first bytes are not"),
                                        ("garbage.h5", "first bytes are not")])
def test_a_name_that_does_not_match_the_bytes_is_refused(gru, name, says, tmp_path, capsys):
    folder, _, _ = gru
    path = tmp_path / name
    path.write_bytes((folder / "gru.keras").read_bytes() if name == "renamed.pb" else b"garbage")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [path, "-o", tmp_path / "out"])
    assert_refused(code, err, name, tmp_path, before)
    assert says in err
