"""What a frozen Keras model's graph is made of, weighed: the swish's custom-gradient IdentityN,
the squeeze-excite reshape to a target computed from the input's shape, and a swish whose
``beta * x`` constant folding left an Identity of x. Before, each left every matrix op after it
unweighed (a frozen EfficientNetV2B0: 91 of 92) or counted a swish TensorFlow fuses as an
unfused Sigmoid."""

import numpy as np
import tensorflow as tf

from amp_rewrite import convert
from amp_rewrite.core.ir import Graph, TensorRef
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.paint.costs import slow_unfused
from amp_rewrite.schema.shapes import ROWS, Shapes

v1 = tf.compat.v1


def _se_block():
    """x -> 1x1 conv -> swish as Keras writes it for its custom gradient (IdentityN of
    x * sigmoid(x) and x) -> squeeze (Mean) -> Reshape to [tf.shape(s)[0], 1, 1, C] (Keras'
    Reshape layer) -> 1x1 conv (squeeze-excite) -> sigmoid -> scale."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 16, 16, 32], name="x")
        y = tf.nn.conv2d(x, tf.constant(r.normal(0, 0.1, (1, 1, 32, 64)).astype(np.float32)), 1,
                         "SAME", name="expand")
        act, _ = tf.raw_ops.IdentityN(input=[y * tf.sigmoid(tf.identity(y, name="beta_x")), y],
                                      name="swish")
        s = tf.reduce_mean(act, [1, 2], name="squeeze")
        target = tf.stack([tf.shape(s)[0], 1, 1, 64], name="target")
        s = tf.reshape(s, target, name="se_reshape")
        e = tf.nn.conv2d(s, tf.constant(r.normal(0, 0.1, (1, 1, 64, 64)).astype(np.float32)), 1,
                         "SAME", name="se_expand")
        tf.identity(act * tf.sigmoid(e), name="out")
    return g.as_graph_def()


def test_identityn_and_a_reshape_to_a_computed_target_keep_their_shapes():
    graph = Graph.from_graph_def(_se_block())
    shapes = Shapes(graph, {"x": (1, 16, 16, 32)})
    assert shapes.shape(TensorRef("swish", 0)) == (1, 16, 16, 64)
    assert shapes.shape(TensorRef("swish", 1)) == (1, 16, 16, 64)
    assert shapes.shape(TensorRef("se_reshape", 0)) == (1, 1, 1, 64)
    assert shapes.shape(TensorRef("se_expand", 0)) == (1, 1, 1, 64)
    # an open batch stays open through the computed target, as TensorFlow's shape says
    assert Shapes(graph).shape(TensorRef("se_reshape", 0)) == (-1, 1, 1, 64)


def test_a_swish_past_an_identity_of_its_input_is_fused_not_slow():
    graph = Graph.from_graph_def(_se_block())
    swish_sigmoid = next(n for n in graph.nodes() if n.op == "Sigmoid"
                         and graph.inputs(n.name)[0].node == "beta_x")
    assert not slow_unfused(graph, swish_sigmoid)


def test_every_matrix_op_of_the_block_is_weighed():
    _, report = convert(_se_block(), target="bfloat16", device="cpu", min_matrix_intensity=1,
                        shapes={"x": (1, 16, 16, 32)})
    assert report.extra["estimate"]["unknown"] == 0
    assert all(n.flops for n in report.nodes if n.op in MATRIX_OPS)


def test_a_tensordot_of_a_sequence_has_its_shapes():
    """Keras' Dense on a sequence (a transformer's) is a tensordot: a Reshape of the input to
    [prod(free dims), in] and back, both targets computed from its shape (GatherV2, Prod,
    Pack, ConcatV2); its MatMul's FLOPs are known once the batch is."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 128, 256], name="x")
        w = tf.constant(np.random.default_rng(1).normal(0, 0.05, (256, 1024)).astype(np.float32))
        tf.identity(tf.nn.relu(tf.tensordot(x, w, [[2], [0]])), name="out")
    graph = Graph.from_graph_def(g.as_graph_def())
    (mm,) = [n for n in graph.nodes() if n.op == "MatMul"]
    shapes = Shapes(graph, {"x": (2, 128, 256)})
    assert shapes.shape(TensorRef(mm.name, 0)) == (256, 1024)
    # the batch open, its rows are (batch x 128): not a batch, rows a count is per (ROWS)
    assert Shapes(graph).shape(TensorRef(mm.name, 0)) == (ROWS, 1024)
    _, report = convert(g.as_graph_def(), target="bfloat16", device="cpu", shapes={"x": (2, 128, 256)})
    assert report.node(mm.name).flops == 2 * (2 * 128) * 256 * 1024


def test_an_embedding_and_an_attention_mask_keep_their_shapes():
    """A frozen Keras encoder's path to its attention: an embedding's GatherV2 of token ids,
    a padding mask built with ones_like (a Fill of a Shape) and LogicalAnd, a masked softmax:
    every matrix op of it is weighed."""
    r = np.random.default_rng(2)
    g = tf.Graph()
    with g.as_default():
        ids = v1.placeholder(tf.int32, [None, 16], name="ids")
        table = tf.constant(r.normal(0, 0.1, (100, 32)).astype(np.float32))
        h = tf.gather(table, ids, axis=0, name="embed")                      # [B, 16, 32]
        pad = tf.not_equal(ids, 0)
        keep = tf.logical_and(tf.ones_like(tf.expand_dims(pad, 1)), tf.expand_dims(pad, 2),
                              name="mask")                                    # [B, 16, 16]
        q = tf.einsum("btd,de->bte", h, tf.constant(r.normal(0, 0.1, (32, 32)).astype(np.float32)))
        scores = tf.einsum("bqd,bkd->bqk", q, h)
        weights = tf.nn.softmax(tf.where(keep, scores, -1e9 * tf.ones_like(scores)))
        tf.identity(tf.einsum("bqk,bkd->bqd", weights, h), name="out")
    graph = Graph.from_graph_def(g.as_graph_def())
    shapes = Shapes(graph, {"ids": (2, 16)})
    assert shapes.shape(TensorRef("embed", 0)) == (2, 16, 32)
    assert shapes.shape(TensorRef("mask", 0)) == (2, 16, 16)
    _, report = convert(g.as_graph_def(), target="bfloat16", device="cpu", min_matrix_intensity=1,
                        shapes={"ids": (2, 16)})
    assert all(n.flops for n in report.nodes if n.op in MATRIX_OPS)
