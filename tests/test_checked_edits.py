"""Every edit is checked before anything is written: the steps that edit a graph after painting
(loss scaling in TF2 train-step functions and in the graph calling them, float16 emulation) run
the same lint and call-type check as the painted graph, so a bug in one of them is an internal
error (exit 70) with no output, never a file TensorFlow refuses or misreads.

The bugs are provoked by breaking one of amp-rewrite's own steps (monkeypatch on our code,
never on TensorFlow); the graphs and models are real.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from test_emulate import EXAMPLE
from test_savedmodel import Trainer

from amp_rewrite import cli, convert_file
from amp_rewrite.check.lint import lint_problems
from amp_rewrite.core.dtypes import FLOAT
from amp_rewrite.core.errors import INTERNAL_EXIT
from amp_rewrite.schema.functiondef import check_call_types, function_to_graph
from amp_rewrite.training import in_functions
from amp_rewrite.transforms import emulate


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    module = Trainer()
    path = tmp_path_factory.mktemp("trainer") / "model"
    tf.saved_model.save(module, str(path), signatures={"train": module.train,
                                                        "predict": module.predict})
    return path


def _saved_meta(path):
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((path / "saved_model.pb").read_bytes())
    return sm.meta_graphs[0]


def test_every_function_of_a_scaled_train_step_passes_the_lint(trainer, tmp_path):
    out = tmp_path / "f16"
    report = convert_file(trainer, out, target="float16")
    assert report.to_dict()["loss_scaling"]["gated_writes"] == 4
    meta = _saved_meta(out)
    library = meta.graph_def.library
    signatures = {f.signature.name: f.signature for f in library.function}
    gates = [n for f in library.function for n in f.node_def if n.op == "If"]
    assert len(gates) == 4   # the four variable writes, each behind the finiteness check
    for f in library.function:
        assert lint_problems(function_to_graph(f, signatures).graph) == [], f.signature.name
    assert check_call_types(meta.graph_def) == []


def _corrupt_next_state(monkeypatch):
    """Make the step that writes the next loss-scale state store an int64 counter through a
    float32 write: what a slip in that code would do."""
    original = in_functions._next_state

    def broken(body, *args):
        updates = original(body, *args)
        body.attr(updates[0])["dtype"].type = FLOAT
        return updates
    monkeypatch.setattr(in_functions, "_next_state", broken)


def test_a_broken_train_step_edit_is_our_bug_and_nothing_is_written(trainer, tmp_path, capsys,
                                                                     monkeypatch):
    _corrupt_next_state(monkeypatch)
    out = tmp_path / "f16"
    assert cli.main([str(trainer), "-o", str(out), "--report", str(tmp_path / "r.json")]) \
        == INTERNAL_EXIT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" in err and "skipped_steps" in err
    assert list(tmp_path.iterdir()) == []


def test_a_broken_emulation_is_our_bug_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    # readers of an op emulated in float32 left reading it as float16
    monkeypatch.setattr(emulate, "_widen_outputs", lambda *args, **kwargs: None)
    out = tmp_path / "emulated.pb"
    assert cli.main([str(EXAMPLE), "-o", str(out), "--emulate"]) == INTERNAL_EXIT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" in err and "block1/conv" in err
    assert not out.exists()


def test_the_checked_emulation_still_runs(tmp_path):
    """The lint takes the emulation as it is (the refusals above are not false alarms)."""
    out = tmp_path / "emulated.pb"
    report = convert_file(EXAMPLE, out, target="float16", emulate=True)
    assert report.to_dict()["emulation"]["ops"] > 0
    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString(out.read_bytes())
    with tf.Graph().as_default() as g:
        tf.graph_util.import_graph_def(gd, name="")
        x = g.get_tensor_by_name("images:0")
        y = g.get_operation_by_name(next(n.name for n in gd.node if not any(
            i.split(":")[0].lstrip("^") == n.name for m in gd.node for i in m.input))).outputs[0]
        with tf.compat.v1.Session(graph=g) as sess:
            value = sess.run(y, {x: np.ones((2, 8, 8, 1), np.float32)})
    assert np.isfinite(value).all()
