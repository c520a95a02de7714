"""--fold-constants folds batch norms into the convolutions they follow (amp_rewrite.transforms.bnfold)."""

import graphs
import numpy as np
import tensorflow as tf

from amp_rewrite import convert
from amp_rewrite.core.ir import Graph
from amp_rewrite.transforms import constfold
from amp_rewrite.transforms.bnfold import fold_batch_norms

v1 = tf.compat.v1


def _bn(y, r, channels, name):
    """A batch norm as a frozen Keras 3 graph writes it: scale and offset from four Consts."""
    gamma = tf.constant(r.uniform(0.5, 1.5, channels).astype(np.float32))
    beta = tf.constant(r.normal(0, 0.2, channels).astype(np.float32))
    mean = tf.constant(r.normal(0, 0.1, channels).astype(np.float32))
    var = tf.constant(r.uniform(0.5, 2.0, channels).astype(np.float32))
    scale = gamma * tf.math.rsqrt(var + 1e-3)
    return tf.add(y * scale, beta - mean * scale, name=name)


def _folded(y, r, channels, name):
    """A batch norm as constant folding leaves it: Const scale and offset vectors (the offset
    read first, the other order from _bn's)."""
    scale = tf.constant(r.uniform(0.5, 1.5, channels).astype(np.float32))
    return tf.add(tf.constant(r.normal(0, 0.2, channels).astype(np.float32)), y * scale, name=name)


def _broadcast(y, r, channels, name, rank=4):
    """A batch norm as constant folding leaves a Keras one with ``axis=3`` (ResNet50's,
    EfficientNet's): scale and offset Consts shaped [1, 1, 1, C] (``rank`` dimensions)."""
    shape = (1,) * (rank - 1) + (channels,)
    scale = tf.constant(r.uniform(0.5, 1.5, shape).astype(np.float32))
    return tf.add(y * scale, tf.constant(r.normal(0, 0.2, shape).astype(np.float32)), name=name)


def _block(norm=_bn, seed=0):
    """conv -> norm -> relu6 -> depthwise (multiplier 2) -> norm -> relu6, as MobileNet's blocks."""
    r = np.random.default_rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 4], name="x")
        k = tf.constant(r.normal(0, 0.4, (3, 3, 4, 6)).astype(np.float32))
        y = tf.nn.relu6(norm(tf.nn.conv2d(x, k, 1, "SAME", name="conv"), r, 6, "conv_bn"))
        d = tf.identity(tf.constant(r.normal(0, 0.4, (3, 3, 6, 2)).astype(np.float32)))
        y = tf.nn.depthwise_conv2d(y, d, [1, 1, 1, 1], "SAME", name="dw")
        y = tf.nn.relu6(norm(y, r, 12, "dw_bn"))
        tf.identity(tf.reduce_mean(y, axis=[1, 2]), name="out")
    return g.as_graph_def(), {"x:0": r.normal(0, 1, (2, 8, 8, 4)).astype(np.float32)}


def _ops(graph_def):
    return [n.op for n in graph_def.node]


def test_batch_norms_become_filters_and_bias_adds_with_the_same_values():
    gd, feeds = _block()
    ref = graphs.run(gd, feeds, ["out:0"])[0]
    out, report = convert(gd, target="float16", device="cpu", fold_constants=True)
    # TensorFlow's constant folding pushes a Mul into a Conv2D's filter itself, not into a
    # depthwise one: that one is ours; the report counts both
    assert report.extra["fusion"]["scales_folded"] == 2
    assert report.extra["fusion"]["scales_folded_by_tensorflow"] == 1
    assert report.extra["fusion"]["bias_adds"] == 2
    assert "Mul" not in _ops(out) and "Rsqrt" not in _ops(out)
    nodes = {n.name: n for n in out.node}
    bias = {n.name: n for n in out.node if n.op == "BiasAdd"}
    assert set(bias) == {"conv_bn", "dw_bn"}             # the adds keep their names
    assert all(n.attr["data_format"].s == b"NHWC" for n in bias.values())
    assert sorted(nodes[n.input[0]].op for n in bias.values()) == ["Conv2D", "DepthwiseConv2dNative"]
    assert ("fusion: batch-norm scales folded into convolution filters: 2 (1 by TensorFlow's "
            "constant folding),") in report.format_summary()
    got = graphs.run(out, feeds, ["out:0"])[0]
    assert graphs.rel_l2(got, ref) < 5e-3                 # float16 rounding only


def test_the_float32_rewrite_alone_computes_what_the_input_does():
    gd, feeds = _block()
    for gd, feeds, counts in ((*_block(_folded, seed=2), (2, 2)),
                              (constfold.fold_constants(gd, {"out"}), feeds, (1, 2))):
        graph = Graph.from_graph_def(gd)
        done = fold_batch_norms(graph, set())
        assert (done.scales_folded, done.bias_adds) == counts
        out = graph.to_graph_def(gd)
        assert not {"Mul", "AddV2"} & set(_ops(out))
        ref = graphs.run(gd, feeds, ["out:0"])[0]
        np.testing.assert_allclose(graphs.run(out, feeds, ["out:0"])[0], ref, rtol=1e-5, atol=1e-6)


def test_per_channel_consts_shaped_1_1_1_c_fold_as_vectors():
    """A Keras batch norm with axis=3 leaves [1, 1, 1, C] Consts (EfficientNetV2B0's and
    ResNet50's, BENCHMARKS.md "Serving SavedModels"): folded as the vectors are, the BiasAdd
    given a [C] bias, the same values; a [1, 1, 1, 1, C] one would make the output rank 5 and is
    left alone."""
    gd, feeds = _block(_broadcast, seed=3)
    graph = Graph.from_graph_def(gd)
    done = fold_batch_norms(graph, set())
    assert (done.scales_folded, done.bias_adds) == (2, 2)
    out = graph.to_graph_def(gd)
    assert not {"Mul", "AddV2"} & set(_ops(out))
    nodes = {n.name: n for n in out.node}
    for name in ("conv_bn", "dw_bn"):
        bias = nodes[nodes[name].input[1]]
        assert bias.op == "Const" and [d.size for d in bias.attr["value"].tensor.tensor_shape.dim] == [
            6 if name == "conv_bn" else 12]
    ref = graphs.run(gd, feeds, ["out:0"])[0]
    np.testing.assert_allclose(graphs.run(out, feeds, ["out:0"])[0], ref, rtol=1e-5, atol=1e-6)

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [1, 6, 6, 3], name="x")
        k = tf.constant(np.ones((3, 3, 3, 3), np.float32))
        y = _broadcast(tf.nn.conv2d(x, k, 1, "SAME"), np.random.default_rng(0), 3, "bn5", rank=5)
        tf.identity(y, name="out")
    graph = Graph.from_graph_def(g.as_graph_def())
    done = fold_batch_norms(graph, set())
    assert (done.scales_folded, done.bias_adds) == (0, 0)


def test_what_it_leaves_alone():
    """A convolution read twice, an NCHW one, a scalar scale, kept nodes, and a Mul that is a
    graph output (nothing reads it: its name is the interface) are not rewritten."""
    r = np.random.default_rng(1)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [1, 6, 6, 3], name="x")
        k = tf.constant(r.normal(0, 0.4, (3, 3, 3, 3)).astype(np.float32))
        shared = tf.nn.conv2d(x, k, 1, "SAME", name="shared")
        tf.identity(shared * tf.constant(r.uniform(1, 2, 3).astype(np.float32)) + 1.0, name="a")
        tf.identity(shared, name="also_reads_shared")
        scalar = tf.nn.conv2d(x, k, 1, "SAME", name="scalar_conv") * tf.constant(2.0)
        tf.identity(scalar, name="b")
        kept = tf.nn.conv2d(x, k, 1, "SAME", name="kept_conv")
        tf.identity(tf.multiply(kept, tf.constant(r.uniform(1, 2, 3).astype(np.float32)), name="kept_mul"), name="c")
        tf.multiply(tf.nn.conv2d(x, k, 1, "SAME", name="out_conv"),
                    tf.constant(r.uniform(1, 2, 3).astype(np.float32)), name="out_mul")
    graph = Graph.from_graph_def(g.as_graph_def())
    done = fold_batch_norms(graph, {"kept_mul"})
    assert (done.scales_folded, done.bias_adds) == (0, 0)
    assert {n.op for n in graph.nodes() if n.name.endswith("mul")} == {"Mul"}


def test_graphs_with_variables_are_not_rewritten():
    """The block whose batch norms constfold, with one variable beside it: nothing is rewritten
    (a variable's value may change between runs)."""
    gd, _ = _block(_folded)
    _, alone = convert(gd, fold_constants=True)
    assert alone.extra["fusion"]["bias_adds"] == 2     # without the variable it would be
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
        w = v1.get_variable("w", initializer=np.ones(3, np.float32), use_resource=True)
        tf.identity(w, name="w_out")
    _, report = convert(g.as_graph_def(), fold_constants=True)
    assert "fusion" not in report.extra
    assert report.node("conv_bn").op == "AddV2"


def _biased_block(norm, seed=4, depthwise=False):
    """A trained convolution: conv -> BiasAdd (a non-zero bias) -> ``norm`` -> relu, as a frozen
    Keras ``Conv2D(use_bias=True)`` before its batch norm (ResNet50's) leaves it; with
    ``depthwise`` a depthwise convolution (multiplier 2) instead."""
    r = np.random.default_rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 4], name="x")
        if depthwise:
            k = tf.constant(r.normal(0, 0.4, (3, 3, 4, 2)).astype(np.float32))
            y, channels = tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "SAME", name="conv"), 8
        else:
            k = tf.constant(r.normal(0, 0.4, (3, 3, 4, 6)).astype(np.float32))
            y, channels = tf.nn.conv2d(x, k, 1, "SAME", name="conv"), 6
        y = tf.nn.bias_add(y, tf.constant(r.normal(0, 0.5, channels).astype(np.float32)),
                           name="bias")
        tf.identity(tf.nn.relu(norm(y, r, channels, "bn")), name="out")
    return g.as_graph_def(), {"x:0": r.normal(0, 1, (2, 8, 8, 4)).astype(np.float32)}


def _fused(y, r, channels, name, training=False):
    """A batch norm as tf.keras and frozen TF1 graphs write it: FusedBatchNormV3 of four Consts."""
    const = lambda v: tf.constant(v.astype(np.float32))   # noqa: E731
    out = tf.raw_ops.FusedBatchNormV3(
        x=y, scale=const(r.uniform(0.5, 1.5, channels)), offset=const(r.normal(0, 0.2, channels)),
        mean=const(r.normal(0, 0.1, channels)), variance=const(r.uniform(0.5, 2.0, channels)),
        epsilon=1e-3, is_training=training, name=name)
    return out.y


def _fold_alone(gd):
    graph = Graph.from_graph_def(gd)
    done = fold_batch_norms(graph, set())
    return done, graph.to_graph_def(gd)


def test_trained_biases_fold_into_the_filter_and_one_bias():
    """Conv2D -> BiasAdd -> Mul -> AddV2 (a trained bias before a Keras batch norm, folded or
    not by constant folding) and Conv2D -> BiasAdd -> FusedBatchNormV3 each become one
    convolution and one BiasAdd, computing what they did; a depthwise convolution too."""
    cases = [(_biased_block(_folded), (1, 1, 0)), (_biased_block(_broadcast, 5), (1, 1, 0)),
             (_biased_block(_fused, 6), (0, 0, 1)),
             (_biased_block(_folded, 7, depthwise=True), (1, 1, 0)),
             (_biased_block(_fused, 8, depthwise=True), (0, 0, 1))]
    for (gd, feeds), counts in cases:
        done, out = _fold_alone(gd)
        assert (done.scales_folded, done.bias_adds, done.batch_norms) == counts
        ops = _ops(out)
        assert not {"Mul", "AddV2", "FusedBatchNormV3"} & set(ops), ops
        assert ops.count("BiasAdd") == 1
        (bias,) = [n for n in out.node if n.op == "BiasAdd"]
        assert {n.name: n for n in out.node}[bias.input[0]].op in ("Conv2D", "DepthwiseConv2dNative")
        ref = graphs.run(gd, feeds, ["out:0"])[0]
        np.testing.assert_allclose(graphs.run(out, feeds, ["out:0"])[0], ref, rtol=1e-5, atol=1e-5)


def test_fused_batch_norms_without_a_bias_fold_too():
    """Conv2D -> FusedBatchNormV3 (``use_bias=False``, tf.keras's frozen graphs) becomes the
    convolution and a BiasAdd, through convert's --fold-constants too."""
    r = np.random.default_rng(9)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 4], name="x")
        k = tf.constant(r.normal(0, 0.4, (3, 3, 4, 6)).astype(np.float32))
        y = _fused(tf.nn.conv2d(x, k, 1, "SAME", name="conv"), r, 6, "bn")
        tf.identity(tf.nn.relu6(y), name="out")
    gd, feeds = g.as_graph_def(), {"x:0": r.normal(0, 1, (2, 8, 8, 4)).astype(np.float32)}
    out, report = convert(gd, target="bfloat16", device="cpu", fold_constants=True,
                          min_matrix_intensity=0)
    assert report.extra["fusion"]["batch_norms"] == 1
    assert "FusedBatchNormV3" not in _ops(out) and "BiasAdd" in _ops(out)
    got = graphs.run(out, feeds, ["out:0"])[0]
    assert graphs.rel_l2(got, graphs.run(gd, feeds, ["out:0"])[0]) < 2e-2   # bfloat16 rounding


def test_batch_norms_that_must_stay_are_left():
    """A FusedBatchNormV3 that trains (``is_training``), one whose batch mean is read, and a
    BiasAdd read by another op besides the batch norm are not folded."""
    r = np.random.default_rng(10)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 4], name="x")
        k = tf.constant(r.normal(0, 0.4, (3, 3, 4, 6)).astype(np.float32))
        b = tf.constant(r.normal(0, 0.5, 6).astype(np.float32))
        training = _fused(tf.nn.conv2d(x, k, 1, "SAME"), r, 6, "train_bn", training=True)
        stats = tf.raw_ops.FusedBatchNormV3(
            x=tf.nn.conv2d(x, k, 1, "SAME"), scale=tf.ones([6]), offset=tf.zeros([6]),
            mean=tf.zeros([6]), variance=tf.ones([6]), is_training=False, name="stats_bn")
        shared = tf.nn.bias_add(tf.nn.conv2d(x, k, 1, "SAME"), b, name="shared_bias")
        also = _folded(shared, r, 6, "shared_bn")
        tf.identity(training + stats.y + also + shared, name="out")
        tf.identity(stats.batch_mean, name="mean_out")
    done, _ = _fold_alone(g.as_graph_def())
    assert (done.scales_folded, done.batch_norms) == (0, 0)
