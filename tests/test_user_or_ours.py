"""Where TensorFlow or Keras reads the user's file, only what they raise for a file they refuse
is the user's (exit 2, one line); anything else there, a bug of ours first, is an internal error
(exit 70, docs/reliability.md). Each place that caught every exception as the user's (constant
folding, --freeze's load and freezing, the checkpoint reader of loss-scale state, the Keras
loader and export) now catches TensorFlow's and Keras' types for a refused input only.

A bug of ours is made by one of our own functions handing TensorFlow or Keras what it should
not (a config that is no ConfigProto, a folder that is a file, no path at all), or raising
itself; TensorFlow is never mocked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from refusals import assert_refused, run_cli, snapshot

from amp_rewrite.core.errors import INTERNAL_EXIT, InputError
from amp_rewrite.io import frozen, keras_files
from amp_rewrite.io.save import write_variables
from amp_rewrite.transforms import constfold

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"


def _assert_ours(code: int, err: str, folder: Path, before: dict) -> None:
    """Exit 70, one line saying it is our bug, nothing written."""
    assert code == INTERNAL_EXIT, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "bug in amp-rewrite" in lines[0], err
    assert snapshot(folder) == before


# ----------------------------------------------------------------- constant folding
def test_a_bug_of_ours_in_constant_folding_is_exit_70(tmp_path, monkeypatch, capsys):
    """Our config for grappler made wrong: TensorFlow's TypeError is no refusal of the graph.
    (A graph with a batch norm computed from Consts: grappler's pass runs only where something
    computes from Consts alone, constfold.foldable.)"""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4], name="x")
        scale = tf.constant(np.full(4, 2.0, np.float32)) * tf.constant(np.full(4, 0.5, np.float32))
        tf.identity(x * scale, name="out")
    src = tmp_path / "in" / "scaled.pb"
    src.parent.mkdir()
    src.write_bytes(g.as_graph_def().SerializeToString())
    assert constfold.foldable(g.as_graph_def())
    monkeypatch.setattr(constfold, "grappler_alone", lambda name: f"only {name}")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "out.pb", "--fold-constants"])
    _assert_ours(code, err, tmp_path, before)
    assert "TypeError" in err


# ----------------------------------------------------------------- --freeze
class _Dense(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
    def serve(self, x):
        return {"y": tf.matmul(x, self.w)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("freeze_errors") / "model"
    module = _Dense()
    tf.saved_model.save(module, str(folder), signatures={"serving_default": module.serve})
    return folder


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_freezing_a_damaged_savedmodel_is_the_users_error(saved, damage, tmp_path, capsys):
    """Variable data TensorFlow's loader refuses: an IndexError (OUT_OF_RANGE, a truncated
    file) or an OpError (a checksum), each the file's, exit 2 in one line."""
    model = tmp_path / "model"
    shutil.copytree(saved, model)
    for data in (model / "variables").glob("variables.data-*"):
        raw = data.read_bytes()
        data.write_bytes(raw[:10] if damage == "truncated" else bytes(len(raw)))
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [model, "-o", tmp_path / "out", "--freeze"])
    assert_refused(code, err, "model", tmp_path, before)
    assert "TensorFlow could not load the SavedModel to freeze it" in err


def test_a_bug_of_ours_while_freezing_is_exit_70(saved, tmp_path, monkeypatch, capsys):
    def broken(loaded):
        raise RuntimeError("a bug of ours")
    monkeypatch.setattr(frozen, "_resources", broken)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [saved, "-o", tmp_path / "out", "--freeze"])
    _assert_ours(code, err, tmp_path, before)


# ----------------------------------------------------------------- the checkpoint reader
def test_the_checkpoint_reader_refuses_a_missing_bundle_as_the_users(tmp_path):
    with pytest.raises(InputError, match="cannot read the checkpoint"):
        write_variables(tmp_path / "missing" / "variables", tmp_path / "out", {})


def test_a_prefix_that_is_no_path_is_our_bug_not_a_bad_checkpoint(tmp_path):
    """A caller of ours passing no prefix: before, str(None) read as a missing file "None"."""
    with pytest.raises(TypeError):
        write_variables(None, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- Keras files
@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keras_errors") / "dense.keras"
    inp = keras.Input((8,), name="x")
    keras.Model(inp, keras.layers.Dense(4)(inp)).save(path)
    return path


def test_a_folder_of_ours_keras_cannot_export_into_is_exit_70(keras_file, tmp_path, monkeypatch,
                                                               capsys):
    """The export's folder made a file (our temporary folder gone wrong): Keras' write
    failure (a FailedPreconditionError) is ours, not the model's."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / keras_file.stem).write_text("in the way")
    monkeypatch.setattr(keras_files.tempfile, "mkdtemp", lambda prefix="": str(scratch))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, [keras_file, "-o", out])
    assert code == INTERNAL_EXIT and "bug in amp-rewrite" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_keras_path_that_is_no_path_is_our_bug(tmp_path):
    """Before, Keras' "File format not supported: filepath=None" read as the user's file."""
    with pytest.raises(TypeError):
        keras_files._load(None)
