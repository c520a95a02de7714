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
from amp_rewrite.core.ir import Graph
from amp_rewrite.paint.costs import runtime_estimate
from amp_rewrite.schema.shapes import Shapes

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
        est = runtime_estimate(graph, Shapes(graph), ["mm", "act"])
        if weight == "variable":
            assert est is None
        else:
            assert est.per_row and est.slow == {"Sigmoid": 1} and est.flops == 2 * 64 * 64
