"""Frozen recurrent models on a CPU in bfloat16: a lowered loop's matrix ops have no known rows,
so the cost model weighs one row of a step (what its MatMuls save against what its unfused
activations lose; both grow with the rows). A GRU or LSTM step of Keras' sizes loses: it stays
float32 where grappler's painting ran slower than float32 (BENCHMARKS.md "Keras SavedModels",
frozen columns)."""

import numpy as np
import pytest
import tensorflow as tf
from test_shapes import frozen_recurrence

from amp_rewrite import convert
from amp_rewrite.core.ir import Graph, TensorRef
from amp_rewrite.paint.costs import runtime_estimate
from amp_rewrite.schema.shapes import ROWS, Shapes

v1 = tf.compat.v1


def _run(gd, inp, out, value):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with v1.Session(graph=g) as sess:
        return sess.run(out, {inp: value})


def _matmuls(report):
    return [n for n in report.nodes if n.op == "MatMul"]


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_a_recurrent_step_whose_activations_outweigh_its_matmuls_stays_float32(cell):
    gd, inp, out = frozen_recurrence(cell, units=128, features=128)
    converted, report = convert(gd, target="bfloat16", device="cpu")
    matmuls = _matmuls(report)
    assert len(matmuls) == 2
    for node in matmuls:
        assert node.precision == "float32" and node.code == "cost", node
        assert "per row of its matrix ops" in node.reason
    value = np.random.default_rng(1).normal(size=(4, 6, 128)).astype(np.float32)
    np.testing.assert_array_equal(_run(converted, inp, out, value), _run(gd, inp, out, value))
    # the knob at 0 paints the step as grappler does: the decision above was the estimate's
    _, painted = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert all(n.precision == "bfloat16" for n in _matmuls(painted))


def test_a_stated_batch_gives_the_rows_their_number():
    """Frozen with a batch of 8, a step's input is (8, 128) but its state, zeros as many as
    the run-time batch, is ROWS: the island has one number of rows, so its ROWS counts take it
    and the estimate is per run, the per-row one times 8."""
    estimates = {}
    for batch in (None, 8):
        gd, _, _ = frozen_recurrence("gru", units=128, features=128, batch=batch)
        graph = Graph.from_graph_def(gd)
        shapes = Shapes(graph)
        matmuls = sorted(n.name for n in gd.node if n.op == "MatMul")
        if batch:   # the two rows the island holds: stated, and guessed
            assert {shapes.shape(TensorRef(n, 0))[0] for n in matmuls} == {8, ROWS}
        names = [n.name for n in gd.node if "while/body" in n.name]
        estimates[batch] = runtime_estimate(graph, shapes, names)
        _, report = convert(gd, target="bfloat16", device="cpu")
        for node in _matmuls(report):
            assert node.code == "cost", node
            assert ("per row" in node.reason) == (batch is None)
    one, eight = estimates[None], estimates[8]
    assert one.per_row and not eight.per_row
    assert eight.flops == 8 * one.flops and eight.lost_us == pytest.approx(8 * one.lost_us)


def test_rows_never_weigh_against_an_open_batch():
    """ROWS and an open batch (-1) in one island: how many rows a sample holds is not known, so
    there is no estimate (the lists decide)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        n = v1.placeholder(tf.int32, [], name="n")
        w = tf.constant(np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32))
        rows = tf.sigmoid(tf.matmul(tf.reshape(x, tf.stack([n, 64])), w, name="mm_rows"),
                          name="act_rows")
        batch = tf.sigmoid(tf.matmul(x, w, name="mm_batch"), name="act_batch")
        tf.identity(rows + batch, name="out")
    graph = Graph.from_graph_def(g.as_graph_def())
    shapes = Shapes(graph)
    assert shapes.shape(TensorRef("mm_rows", 0)) == (ROWS, 64)
    assert shapes.shape(TensorRef("mm_batch", 0)) == (-1, 64)
    assert runtime_estimate(graph, shapes, ["mm_rows", "act_rows"]).per_row
    assert runtime_estimate(graph, shapes, ["mm_rows", "act_rows", "mm_batch", "act_batch"]) is None


def test_a_recurrent_step_whose_matmuls_outweigh_its_activations_is_painted_and_runs():
    """1024 features into 128 units: per row the step's MatMuls save about 0.8 ns, its two
    Sigmoid and one Tanh lose about 0.2."""
    gd, inp, out = frozen_recurrence("gru", units=128, features=1024)
    converted, report = convert(gd, target="bfloat16", device="cpu")
    assert all(n.precision == "bfloat16" for n in _matmuls(report))
    value = np.random.default_rng(1).normal(size=(4, 6, 1024)).astype(np.float32)
    got, want = _run(converted, inp, out, value), _run(gd, inp, out, value)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_rows_not_known_are_not_weighed_against_a_weight_cast():
    """A MatMul whose input is reshaped to a size computed at run time (Keras' Dense on a
    sequence) has no known rows per sample; where its weight is a variable, cast once a run
    (its read's shape stated as a SavedModel's function body states it), no per-row estimate
    can weigh that cast: the estimate is unknown and the lists decide, as before rows were
    marked. With a Const weight (nothing a run) the same island is weighed per row."""
    for weight in ("variable", "const"):
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, None, 64], name="x")
            rows = tf.reshape(x, tf.stack([tf.shape(x)[0] * tf.shape(x)[1], 64]))
            w0 = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
            if weight == "variable":
                w = v1.get_variable("w", initializer=w0, use_resource=True).read_value()
            else:
                w = tf.constant(w0)
            tf.sigmoid(tf.matmul(rows, w, name="mm"), name="act")
        gd = g.as_graph_def()
        for node in gd.node:
            if node.op == "ReadVariableOp":
                node.attr["_output_shapes"].list.shape.add().dim.extend(
                    [tf.TensorShape([64]).as_proto().dim[0]] * 2)
        graph = Graph.from_graph_def(gd)
        shapes = Shapes(graph)
        assert shapes.shape(TensorRef("mm", 0)) == (ROWS, 64)   # known: only the cast stops it
        est = runtime_estimate(graph, shapes, ["mm", "act"])
        if weight == "variable":
            assert est is None
        else:
            assert est.per_row and est.slow == {"Sigmoid": 1} and est.flops == 2 * 64 * 64
