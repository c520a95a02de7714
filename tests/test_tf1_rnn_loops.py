"""Frozen recurrent graphs as TF1 users bring them, on a CPU in bfloat16: control flow v1 (the
loop's Enter, Merge, Switch, NextIteration and Exit in the graph itself, no While op), the steps
read from a TensorArray (TensorArrayV3, TensorArrayReadV3), the weights frozen to Consts.

Two builders: a hand-written cell under ``tf.compat.v1.while_loop``, and
``tf.compat.v1.nn.dynamic_rnn`` with cells built as TF1's ``LSTMCell`` and ``GRUCell`` build
theirs (those classes went with Keras 3: ``tf.compat.v1.nn.rnn_cell.LSTMCell`` raises
AttributeError in TensorFlow 2.21 without tf_keras), their variables VariableV2s frozen by
``graph_util.convert_variables_to_constants``. dynamic_rnn's first state is
``RNNCell.zero_state``'s: a Fill of ConcatV2([ExpandDims(batch), [units]]), not the Pack of a
TF2 loop (tests/test_frozen_loops.py)."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util, rnn_cell_impl

from amp_rewrite import convert
from amp_rewrite.core.ir import Graph, TensorRef
from amp_rewrite.schema.shapes import ROWS, Shapes

v1 = tf.compat.v1
STEPS, FEATURES, UNITS = 8, 64, 128


@contextlib.contextmanager
def _control_flow_v1():
    """Control flow v1 for the graphs built inside (what ``disable_control_flow_v2`` sets for
    the whole process; while_loop and TensorArray read the flag as they build), then back."""
    was = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        yield
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = was


def _weight(r, *shape):
    return r.normal(0, 0.2, shape).astype(np.float32)


def _hand_written(cell):
    """A GRU or LSTM step written out: MatMul of concat([x_t, h]) by a Const, BiasAdd, gates
    cut by Split (LSTM) or SplitV then Split (GRU); x_t read from a TensorArray of the steps."""
    r = np.random.default_rng(0)
    gates = 4 if cell == "lstm" else 3
    x = v1.placeholder(tf.float32, [None, STEPS, FEATURES], name="x")
    w = tf.constant(_weight(r, FEATURES + UNITS, gates * UNITS), name="w")
    b = tf.constant(_weight(r, gates * UNITS), name="b")
    xs = tf.TensorArray(tf.float32, size=STEPS).unstack(tf.transpose(x, [1, 0, 2]))
    zeros = tf.zeros(tf.stack([tf.shape(x)[0], UNITS]))

    def body(t, h, c):
        z = tf.nn.bias_add(tf.matmul(tf.concat([xs.read(t), h], 1), w), b)
        if cell == "lstm":
            i, f, o, n = tf.split(z, 4, axis=1)
            c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(n)
            return t + 1, tf.sigmoid(o) * tf.tanh(c), c
        ru, n = tf.split(z, [2 * UNITS, UNITS], axis=1)
        reset, update = tf.split(tf.sigmoid(ru), 2, axis=1)
        return t + 1, update * h + (1 - update) * tf.tanh(n * reset), c

    _, h, _ = v1.while_loop(lambda t, h, c: t < STEPS, body, (0, zeros, zeros))
    tf.identity(h, name="out")


class _Cell:
    """What dynamic_rnn needs of a cell (``rnn_cell_impl.assert_like_rnncell``), computed with
    the ops of TF1's ``LSTMCell`` (one MatMul, four gates by Split, forget bias 1) or ``GRUCell``
    (gates MatMul + BiasAdd + Sigmoid cut in two, candidate MatMul + BiasAdd + Tanh)."""

    def __init__(self, kind):
        self.kind = kind
        r = np.random.default_rng(1)
        width = (4 if kind == "lstm" else 2) * UNITS
        with v1.variable_scope(f"{kind}_cell"):
            self.kernel = v1.get_variable(
                "kernel", initializer=_weight(r, FEATURES + UNITS, width), use_resource=False)
            self.bias = v1.get_variable("bias", initializer=_weight(r, width), use_resource=False)
            if kind == "gru":
                self.candidate = v1.get_variable(
                    "candidate/kernel", initializer=_weight(r, FEATURES + UNITS, UNITS),
                    use_resource=False)
                self.candidate_bias = v1.get_variable(
                    "candidate/bias", initializer=_weight(r, UNITS), use_resource=False)

    @property
    def state_size(self):
        return (UNITS, UNITS) if self.kind == "lstm" else UNITS

    @property
    def output_size(self):
        return UNITS

    def zero_state(self, batch_size, dtype):
        return rnn_cell_impl._zero_state_tensors(self.state_size, batch_size, dtype)

    def __call__(self, inputs, state):
        if self.kind == "lstm":
            c, h = state
            z = tf.nn.bias_add(tf.matmul(tf.concat([inputs, h], 1), self.kernel), self.bias)
            i, j, f, o = tf.split(z, 4, axis=1)
            c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(j)
            h = tf.sigmoid(o) * tf.tanh(c)
            return h, (c, h)
        gates = tf.sigmoid(tf.nn.bias_add(
            tf.matmul(tf.concat([inputs, state], 1), self.kernel), self.bias))
        reset, update = tf.split(gates, 2, axis=1)
        candidate = tf.tanh(tf.nn.bias_add(
            tf.matmul(tf.concat([inputs, reset * state], 1), self.candidate),
            self.candidate_bias))
        h = update * state + (1 - update) * candidate
        return h, h


def _dynamic_rnn(cell, graph):
    x = v1.placeholder(tf.float32, [None, STEPS, FEATURES], name="x")
    outputs, _ = v1.nn.dynamic_rnn(_Cell(cell), x, dtype=tf.float32)
    tf.identity(outputs[:, -1], name="out")
    with v1.Session(graph=graph) as sess:
        sess.run(v1.global_variables_initializer())
        return v1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), ["out"])


CASES = ["while_loop-gru", "while_loop-lstm", "dynamic_rnn-gru", "dynamic_rnn-lstm"]


@pytest.fixture(scope="module")
def graphs():
    """Each case's frozen GraphDef, built once (input x:0, output out:0)."""
    built = {}
    for case in CASES:
        how, cell = case.split("-")
        g = tf.Graph()
        with g.as_default(), _control_flow_v1():
            if how == "while_loop":
                _hand_written(cell)
                gd = g.as_graph_def()
            else:
                gd = _dynamic_rnn(cell, g)
        ops = {n.op for n in gd.node}
        # a TF1 frame and a TensorArray, as a TF1 graph has them (not a While, not a list)
        assert {"Enter", "Merge", "Switch", "NextIteration", "Exit", "TensorArrayV3",
                "TensorArrayReadV3"} <= ops and not ops & {"While", "StatelessWhile"}, ops
        assert not ops & {"VariableV2", "VarHandleOp"}, ops   # frozen
        built[case] = gd
    return built


def _run(gd, value):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with v1.Session(graph=g) as sess:
        return sess.run("out:0", {"x:0": value})


def _matmuls(report):
    return [n for n in report.nodes if n.op == "MatMul"]


@pytest.mark.parametrize("case", CASES)
def test_a_tf1_frame_has_the_shapes_tensorflow_infers_and_its_state_rows_marked(graphs, case):
    """Every dimension TensorFlow's importer works out, ours has the same; the first state
    (a Fill of the run-time batch: a Pack, or RNNCell.zero_state's ConcatV2) and the state in
    the loop are (ROWS, units), so every gate's Sigmoid and Tanh has a count per row."""
    gd = graphs[case]
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    shapes = Shapes(Graph.from_graph_def(gd))
    for op in g.get_operations():
        for port, out in enumerate(op.outputs):
            ours = shapes.shape(TensorRef(op.name, port))
            if ours is None or out.shape.rank is None:
                continue
            theirs = [-1 if d is None else d for d in out.shape.as_list()]
            assert len(ours) == len(theirs), (op.name, ours, theirs)
            assert all(b == -1 or a == b for a, b in zip(ours, theirs)), (op.name, ours, theirs)
    graph = shapes.graph
    by_op = {}
    for node in gd.node:
        by_op.setdefault(node.op, []).append(shapes.shape(TensorRef(node.name, 0)))
    assert by_op["Fill"] and all(s == (ROWS, UNITS) for s in by_op["Fill"]), by_op["Fill"]
    # the states: the Merges whose value enters from a Fill (not the step counter, not a
    # TensorArray's flow)
    states = [shapes.shape(TensorRef(n.name, 0)) for n in gd.node if n.op == "Merge"
              and any(graph.node(graph.inputs(r.node)[0].node).op == "Fill"
                      for r in graph.inputs(n.name) if graph.node(r.node).op == "Enter")]
    assert len(states) == (1 if case == "dynamic_rnn-gru" else 2), states   # h (and c)
    assert all(s == (ROWS, UNITS) for s in states), states
    for op in ("Sigmoid", "Tanh", "Mul"):
        assert by_op[op] and all(s and s[0] == ROWS and s[1] > 0 for s in by_op[op]), by_op[op]


# what each case's MatMuls get: their gates' activations outweigh them per row (kept float32),
# or, TF1's GRUCell, every activation follows a MatMul + BiasAdd the remapper fuses it into:
# nothing loses, and the island is painted
KEPT = {"while_loop-gru": True, "while_loop-lstm": True, "dynamic_rnn-gru": False,
        "dynamic_rnn-lstm": True}


@pytest.mark.parametrize("case", CASES)
def test_a_tf1_recurrent_loop_is_weighed_per_row_and_runs(graphs, case):
    gd = graphs[case]
    converted, report = convert(gd, target="bfloat16", device="cpu")
    value = np.random.default_rng(2).normal(size=(4, STEPS, FEATURES)).astype(np.float32)
    want = _run(gd, value)
    matmuls = _matmuls(report)
    assert matmuls
    for node in matmuls:
        if KEPT[case]:
            assert node.precision == "float32" and node.code == "cost", node
            assert "per row of its matrix ops" in node.reason, node.reason
        else:
            assert node.precision == "bfloat16", node
    got = _run(converted, value)
    if KEPT[case]:
        np.testing.assert_array_equal(got, want)
    else:
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    # the knob at 0 paints every step's MatMul; the painted loop runs, within bfloat16's error
    painted, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert all(n.precision == "bfloat16" for n in _matmuls(report))
    got = _run(painted, value)
    assert not np.array_equal(got, want)   # it did compute in bfloat16
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
