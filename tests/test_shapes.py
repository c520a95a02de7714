"""Static shapes for the cost model: TensorFlow's own shape inference is the oracle."""

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite.core.ir import Graph, TensorRef
from amp_rewrite.schema.shapes import Shapes

v1 = tf.compat.v1


def _const(shape):
    return tf.constant(np.random.default_rng(0).normal(0, 0.1, shape).astype(np.float32))


def convnet(batch=None, data_format="NHWC"):
    """A small network with every op the shape rules cover, open batch by default."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [batch, 30, 30, 3], name="x")
        h = tf.pad(x, [[0, 0], [1, 2], [1, 0], [0, 0]], name="pad")
        h = tf.nn.conv2d(h, _const([3, 3, 3, 16]), 2, "VALID", name="conv_valid")
        h = tf.nn.relu6(tf.nn.bias_add(h, _const([16])), name="act")
        h = tf.nn.depthwise_conv2d(h, _const([3, 3, 16, 2]), [1, 1, 1, 1], "SAME", name="dw")
        h = tf.nn.conv2d(h, _const([1, 1, 32, 8]), 1, "SAME", dilations=1, name="conv_same")
        h = tf.nn.conv2d(h, _const([3, 3, 8, 8]), 2, [[0, 0], [1, 1], [2, 0], [0, 0]],
                         name="conv_explicit")
        p = tf.nn.max_pool2d(h, 2, 2, "VALID", name="pool")
        a = tf.nn.avg_pool2d(h, 3, 1, "SAME", name="avg")
        c = tf.concat([a, a * _const([8])], axis=-1, name="concat")
        m = tf.reduce_mean(c, axis=[1, 2], name="mean")
        k = tf.reduce_sum(c, axis=[1], keepdims=True, name="sum")
        r = tf.reshape(p, [-1, int(np.prod(p.shape[1:]))], name="flat")
        d = tf.matmul(r, _const([r.shape[1], 10]), name="dense")
        t = tf.transpose(tf.expand_dims(d, 1, name="expand"), [0, 2, 1], name="transpose")
        b = tf.matmul(t, _const([1, 4]), name="bmm")
        tf.squeeze(tf.reduce_max(b, axis=-1, keepdims=True), axis=[2], name="squeezed")
        tf.identity(m, name="m")
        tf.identity(k, name="k")
    return g


@pytest.mark.parametrize("batch", [None, 4])
def test_shapes_agree_with_tensorflows_inference(batch):
    g = convnet(batch)
    graph, shapes = Graph.from_graph_def(g.as_graph_def()), None
    shapes = Shapes(graph)
    checked = set()
    for op in g.get_operations():
        if not op.outputs or op.type in ("NoOp",):
            continue
        tf_shape = op.outputs[0].shape
        ours = shapes.shape(TensorRef(op.name, 0))
        if ours is None:
            continue
        assert tf_shape.rank == len(ours), op.name
        assert [d if d is not None else -1 for d in tf_shape.as_list()] == list(ours), op.name
        checked.add(op.type)
    must = {"Placeholder", "Pad", "Conv2D", "BiasAdd", "Relu6", "DepthwiseConv2dNative",
            "MaxPool", "AvgPool", "ConcatV2", "Mean", "Sum", "Reshape", "MatMul", "ExpandDims",
            "Transpose", "BatchMatMulV2", "Max", "Squeeze", "Mul", "Identity"}
    assert must <= checked, must - checked


def test_elements_count_per_sample_where_the_batch_is_open():
    graph = Graph.from_graph_def(convnet(None).as_graph_def())
    shapes = Shapes(graph)
    # padded to 33x31, a 3x3 VALID window at stride 2: 16x15
    assert shapes.elements(TensorRef("conv_valid", 0)) == 16 * 15 * 16
    fixed = Shapes(Graph.from_graph_def(convnet(4).as_graph_def()))
    assert fixed.elements(TensorRef("conv_valid", 0)) == 4 * 16 * 15 * 16


def test_what_the_rules_do_not_cover_is_unknown_and_so_is_what_follows():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, None], name="x")
        y = v1.placeholder(tf.float32, None, name="y")
        tf.nn.relu(tf.unique(tf.reshape(y, [-1]))[0], name="after_unique")
        tf.nn.relu(x, name="open")
    shapes = Shapes(Graph.from_graph_def(g.as_graph_def()))
    assert shapes.shape(TensorRef("after_unique", 0)) is None
    assert shapes.shape(TensorRef("open", 0)) == (-1, -1)
    assert shapes.elements(TensorRef("open", 0)) is None   # an open dimension past the batch


def test_a_chain_of_thousands_of_nodes_needs_no_recursion():
    g = tf.Graph()
    with g.as_default():
        h = v1.placeholder(tf.float32, [None, 8], name="x")
        for _ in range(5000):
            h = tf.nn.relu(h)
        tf.identity(h, name="out")
    shapes = Shapes(Graph.from_graph_def(g.as_graph_def()))
    assert shapes.elements(TensorRef("out", 0)) == 8


def test_a_reshape_that_moves_elements_between_samples_is_unknown():
    """(-1, 14, 14, 768) -> (-1, 768) has 768 elements per row but 150,528 per sample: the
    per-sample count would be wrong, so the shape is not given."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 14, 14, 768], name="x")
        tf.reshape(x, [-1, 768], name="rows")
        tf.reshape(x, [-1, 14 * 14 * 768], name="flat")
    shapes = Shapes(Graph.from_graph_def(g.as_graph_def()))
    assert shapes.shape(TensorRef("rows", 0)) is None
    assert shapes.elements(TensorRef("flat", 0)) == 14 * 14 * 768


def test_open_channels_and_a_v1_loop_end_in_known_or_unknown_not_in_a_hang():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, None], name="x")
        tf.nn.depthwise_conv2d(x, _const([3, 3, 4, 2]), [1, 1, 1, 1], "SAME", name="dw")
        tf.squeeze(v1.placeholder(tf.float32, [None, 1, None], name="y"), name="squeezed")
    graph_def = g.as_graph_def()
    # a v1 loop as TensorFlow's importer allows it: Merge reads NextIteration at input 0
    loop = tf.compat.v1.GraphDef()
    text = """
    node { name: "start" op: "Const" attr { key: "dtype" value { type: DT_FLOAT } }
           attr { key: "value" value { tensor { dtype: DT_FLOAT tensor_shape {} float_val: 1 } } } }
    node { name: "merge" op: "Merge" input: "next" input: "enter"
           attr { key: "T" value { type: DT_FLOAT } } attr { key: "N" value { i: 2 } } }
    node { name: "enter" op: "Enter" input: "start" attr { key: "T" value { type: DT_FLOAT } }
           attr { key: "frame_name" value { s: "f" } } }
    node { name: "relu" op: "Relu" input: "merge" attr { key: "T" value { type: DT_FLOAT } } }
    node { name: "next" op: "NextIteration" input: "relu" attr { key: "T" value { type: DT_FLOAT } } }
    """
    from google.protobuf import text_format
    text_format.Merge(text, loop)
    graph_def.node.extend(loop.node)
    shapes = Shapes(Graph.from_graph_def(graph_def))
    assert shapes.shape(TensorRef("dw", 0)) == (-1, 8, 8, 8)   # the filter says 4 x 2 channels
    assert shapes.shape(TensorRef("squeezed", 0)) is None
    # the Merge takes the shape its value enters with (a scalar), not walking round the loop
    assert shapes.shape(TensorRef("relu", 0)) == ()


def test_a_stated_output_shape_stands_in_for_a_missing_rule_and_constant_folding_is_followed():
    """An op with no rule (Roll) takes the ``_output_shapes`` a SavedModel's function nodes
    carry, and what is computed from it; folded_value works out a frozen batch norm's offset
    from its Consts as constant folding does, and nothing computed from a placeholder."""
    from amp_rewrite.schema.shapes import folded_value
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 5, 7], name="x")
        tf.nn.relu(tf.roll(x, 1, 2, name="roll"), name="act")
        scale = tf.constant([2.0, 4.0]) * tf.math.rsqrt(tf.constant([4.0, 16.0]))
        tf.subtract(tf.constant([1.0, 1.0]), tf.constant([0.5, 0.25]) * scale, name="offset")
        tf.add(x, 1.0, name="from_x")
    gd = g.as_graph_def()
    graph = Graph.from_graph_def(gd)
    assert Shapes(graph).shape(TensorRef("act", 0)) is None
    roll = next(n for n in gd.node if n.name == "roll")
    stated = roll.attr["_output_shapes"].list.shape.add()
    for d in (-1, 5, 7):
        stated.dim.add(size=d)
    graph = Graph.from_graph_def(gd)
    assert Shapes(graph).shape(TensorRef("act", 0)) == (-1, 5, 7)
    np.testing.assert_allclose(folded_value(graph, TensorRef("offset", 0)), [0.5, 0.75])
    assert folded_value(graph, TensorRef("from_x", 0)) is None


def frozen_recurrence(cell="gru", steps=6, units=8, features=5, batch=None):
    """A recurrent cell over time in a ``tf.function`` (a ``tf.while_loop`` over a TensorArray
    of the steps, a state of zeros as many as the run-time batch), frozen as users freeze one:
    the loop lowered to a TF1 frame (Enter, Merge, Switch, NextIteration, Exit). ``cell``:
    "gru" (gates cut by StridedSlice), "lstm" (Split into four, a second state) or "sliced"
    (SplitV). Returns the GraphDef, its input and its output names."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)
    r = np.random.default_rng(0)
    width = {"gru": 3, "lstm": 4, "sliced": 2}[cell] * units
    w = tf.constant(r.normal(0, 0.3, (features, width)).astype(np.float32))
    u = tf.constant(r.normal(0, 0.3, (units, width)).astype(np.float32))

    def step(x_t, h, c):
        z = tf.matmul(x_t, w) + tf.matmul(h, u)
        if cell == "gru":
            a, b, n = z[:, :units], z[:, units:2 * units], z[:, 2 * units:]
            g = tf.sigmoid(a)
            return g * h + (1 - g) * tf.tanh(n * tf.sigmoid(b)), c
        if cell == "lstm":
            i, f, o, n = tf.split(z, 4, axis=1)
            c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(n)
            return tf.sigmoid(o) * tf.tanh(c), c
        a, b = tf.split(z, [units, units], axis=1)
        return tf.tanh(a) * tf.sigmoid(b), c

    @tf.function(input_signature=[tf.TensorSpec([batch, steps, features], tf.float32)])
    def run(x):
        xs = tf.TensorArray(tf.float32, size=steps).unstack(tf.transpose(x, [1, 0, 2]))
        zeros = tf.zeros(tf.stack([tf.shape(x)[0], units]))
        _, h, _ = tf.while_loop(lambda t, h, c: t < steps,
                                lambda t, h, c: (t + 1, *step(xs.read(t), h, c)),
                                (0, zeros, zeros))
        return tf.identity(h, name="out")

    frozen = convert_variables_to_constants_v2(run.get_concrete_function())
    return frozen.graph.as_graph_def(), frozen.inputs[0].name, frozen.outputs[0].name


@pytest.mark.parametrize("cell", ["gru", "lstm", "sliced"])
def test_a_frozen_loop_has_the_shapes_tensorflow_infers_with_its_rows_marked(cell):
    """Inside a lowered loop the rows of a step's MatMul are not known (TensorFlow's shape
    function says (?, columns)): ours say ROWS there and in what is computed from them; every
    dimension TensorFlow's importer works out, ours has the same."""
    from amp_rewrite.schema.shapes import ROWS
    gd, _, _ = frozen_recurrence(cell)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    shapes = Shapes(Graph.from_graph_def(gd))
    known, guessed = set(), set()
    for op in g.get_operations():
        for port, out in enumerate(op.outputs):
            ours = shapes.shape(TensorRef(op.name, port))
            if ours is None:
                continue
            known.add(op.type)
            if shapes.guessed(TensorRef(op.name, port)):
                guessed.add(op.type)
            if out.shape.rank is None:   # TensorFlow's importer leaves a frame's Merge unknown
                continue
            theirs = [-1 if d is None else d for d in out.shape.as_list()]
            assert len(ours) == len(theirs), (op.name, ours, theirs)
            # where TensorFlow knows a dimension ours is the same (ours may know more: the
            # columns of a MatMul whose weight TensorFlow's importer did not follow)
            assert all(b == -1 or a == b for a, b in zip(ours, theirs)), (op.name, ours, theirs)
            assert all(d >= 0 or (i == 0 and d == ROWS) or theirs[i] == -1
                       for i, d in enumerate(ours)), (op.name, ours, theirs)
    must = {"MatMul", "Sigmoid", "Tanh", "Enter", "Merge", "Switch", "AddV2", "Mul", "Fill"}
    must |= {"gru": {"StridedSlice"}, "lstm": {"Split"}, "sliced": {"SplitV"}}[cell]
    assert must <= known, must - known
    assert {"MatMul", "Sigmoid", "Tanh"} <= guessed
    # TensorFlow's importer leaves most of these open; what they must be, by hand: a step's
    # product is (rows, gates x units), each gate and the state (rows, units)
    width = {"gru": 3, "lstm": 4, "sliced": 2}[cell] * 8
    by_op = {}
    for node in gd.node:
        by_op.setdefault(node.op, []).append(shapes.shape(TensorRef(node.name, 0)))
    assert set(by_op["MatMul"]) == {(ROWS, width)}
    assert set(by_op["Sigmoid"]) == set(by_op["Tanh"]) == {(ROWS, 8)}
    assert set(by_op["Fill"]) == {(ROWS, 8)}
    assert (ROWS, 8) in by_op["Merge"] and () in by_op["Merge"]   # the state, the counter
    gates = {"gru": "StridedSlice", "lstm": "Split", "sliced": "SplitV"}[cell]
    pieces = {shapes.shape(TensorRef(n.name, port)) for n in gd.node
              if n.op == gates and "while/" in n.name   # not the batch cut from a Shape
              for port in range(n.attr["num_split"].i if "num_split" in n.attr else 1)}
    assert pieces == {(ROWS, 8)}


def test_a_lowered_cond_keeps_its_batch_open_and_rows_do_not_turn_into_a_batch():
    """A frozen tf.cond is a Switch and a Merge too, but no loop: its Merge keeps the open batch
    (-1), not ROWS. A concatenation of ROWS with an open batch stays ROWS whichever comes
    first, and a Squeeze of a tensor with ROWS in it does not guess which dimension is 1."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)
    from amp_rewrite.schema.shapes import ROWS

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([], tf.bool)])
    def run(x, flag):
        return tf.identity(tf.cond(flag, lambda: x * 2.0, lambda: x - 1.0), name="picked")

    gd = convert_variables_to_constants_v2(run.get_concrete_function()).graph.as_graph_def()
    merges = [n for n in gd.node if n.op == "Merge"]
    shapes = Shapes(Graph.from_graph_def(gd))
    assert merges and all(shapes.shape(TensorRef(n.name, 0)) == (-1, 4) for n in merges)

    g = tf.Graph()
    with g.as_default():
        ctx = v1.placeholder(tf.float32, [None, 64], name="ctx")
        n = v1.placeholder(tf.int32, [], name="n")
        h = tf.matmul(tf.reshape(ctx, tf.stack([n, 64])), _const([64, 64]), name="h")
        tf.concat([ctx, h], 1, name="ctx_h")
        tf.concat([h, ctx], 1, name="h_ctx")
        tf.squeeze(tf.reshape(h, tf.stack([n, 1, 64])) + tf.zeros([1, 1, 64]), name="squeezed")
        tf.squeeze(tf.expand_dims(h, 1), name="squeezed_rows")
    shapes = Shapes(Graph.from_graph_def(g.as_graph_def()))
    assert shapes.shape(TensorRef("h", 0)) == (ROWS, 64)
    assert shapes.shape(TensorRef("ctx_h", 0)) == shapes.shape(TensorRef("h_ctx", 0)) == (ROWS, 128)
    assert shapes.shape(TensorRef("squeezed_rows", 0)) is None


def test_a_loop_that_grows_a_value_leaves_its_shape_unknown():
    """A while loop may let a value grow (``shape_invariants``, which a frozen GraphDef does not
    keep): the Merge is checked against what its NextIteration brings back, and a sequence
    that one concatenation a step lengthens has no shape (TensorFlow: (None, None)), not the
    one it entered with; the counter beside it keeps its ()."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)
    w = _const([1, 64])

    @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32)])
    def run(x):
        def body(t, seq):
            return t + 1, tf.concat([seq, tf.tanh(tf.matmul(seq[:, -1:], w))[:, :1]], axis=1)
        _, seq = tf.while_loop(lambda t, s: t < 5, body, (0, x), shape_invariants=(
            tf.TensorShape([]), tf.TensorShape([None, None])))
        return tf.identity(tf.sigmoid(seq), name="out")

    gd = convert_variables_to_constants_v2(run.get_concrete_function()).graph.as_graph_def()
    shapes = Shapes(Graph.from_graph_def(gd))
    merges = {n.name: shapes.shape(TensorRef(n.name, 0)) for n in gd.node if n.op == "Merge"}
    assert None in merges.values() and () in merges.values()
    concat = next(n.name for n in gd.node if n.op == "ConcatV2")
    assert shapes.shape(TensorRef(concat, 0)) is None
    assert shapes.shape(TensorRef("out", 0)) is None
