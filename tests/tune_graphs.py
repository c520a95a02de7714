"""Frozen graphs that fail out of the box in float16 (for tests/test_tune.py and the tune
benchmark): each computes something real whose float16 version overflows or loses its
accuracy where the rule lists call the ops safe."""

import graphs
import numpy as np
import tensorflow as tf


def large_sum(seed=0, width=64, hidden=256):
    """Large activations before a reduction: ``Square`` of a dense layer (values near 1e4,
    fine in float16) summed over 256 features by a MatMul (about 1e6: past 65504)."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        w1 = tf.constant(rng.standard_normal((width, hidden)).astype(np.float32), name="w1")
        h = tf.nn.relu(tf.matmul(x, w1, name="dense1"), name="relu")
        sq = tf.square(h, name="square")
        w2 = tf.constant(rng.uniform(0.5, 1.5, (hidden, 16)).astype(np.float32), name="w2")
        pooled = tf.matmul(sq, w2, name="pool")
        w3 = tf.constant(rng.standard_normal((16, 10)).astype(np.float32) * 1e-4, name="w3")
        tf.identity(tf.matmul(pooled, w3, name="head"), name="logits")
    return g.as_graph_def()


def attention_softmax(seed=0, width=32, keys=64, bias=2000.0):
    """A softmax over large values: attention scores that differ by about 1 on top of a
    large shared bias (near ``bias``, 2000 by default, where float16's step is 1): the shift
    the softmax removes exactly in float32 rounds the differences away in float16 (a smaller
    ``bias``, a finer step: less error)."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        wk = tf.constant(rng.standard_normal((width, keys)).astype(np.float32) * 0.2, name="keys")
        bias = tf.constant(bias + rng.standard_normal(keys).astype(np.float32), name="bias")
        scores = tf.nn.bias_add(tf.matmul(x, wk, name="scores"), bias, name="biased")
        weights = tf.nn.softmax(scores, name="attention")
        values = tf.constant(rng.standard_normal((keys, 10)).astype(np.float32), name="values")
        tf.identity(tf.matmul(weights, values, name="mix"), name="out")
    return g.as_graph_def()


def deep_mlp(seed=0, width=64, depth=32, loud=16, gain=1e5):
    """A deep ReLU MLP whose layer ``loud`` has its weights scaled by ``gain`` and the next
    layer's by ``1/gain`` (as a network trained without normalisation can end up): the
    function is the same, but layer ``loud``'s activations (about 1e5) overflow float16."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        h = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        for i in range(depth):
            scale = np.sqrt(2.0 / width) * (gain if i == loud else 1.0 / gain if i == loud + 1
                                            else 1.0)
            w = (rng.standard_normal((width, width)) * scale).astype(np.float32)
            h = tf.nn.relu(tf.matmul(h, tf.constant(w, name=f"w{i}"), name=f"layer{i}"),
                           name=f"relu{i}")
        tf.identity(h, name="out")
    return g.as_graph_def()


def deep_cnn(seed=0, channels=16, depth=8, loud=4, gain=1e5):
    """:func:`deep_mlp` as 3x3 convolutions over 16x16 images (input ``images``), with a
    global average pool and a dense head: conv layer ``loud`` overflows float16."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        h = tf.compat.v1.placeholder(tf.float32, [None, 16, 16, 3], name="images")
        c_in = 3
        for i in range(depth):
            scale = np.sqrt(2.0 / (9 * c_in)) * (gain if i == loud else 1.0 / gain
                                                 if i == loud + 1 else 1.0)
            w = (rng.standard_normal((3, 3, c_in, channels)) * scale).astype(np.float32)
            h = tf.nn.relu(tf.nn.conv2d(h, tf.constant(w, name=f"k{i}"), 1, "SAME",
                                        name=f"conv{i}"), name=f"relu{i}")
            c_in = channels
        pooled = tf.reduce_mean(h, axis=[1, 2], name="pool")
        w = tf.constant(rng.standard_normal((channels, 10)).astype(np.float32), name="wout")
        tf.identity(tf.matmul(pooled, w, name="head"), name="out")
    return g.as_graph_def()


def images(n=8, seed=0):
    return {"images": np.random.default_rng(seed).uniform(0, 1, (n, 16, 16, 3)).astype(np.float32)}


def inputs(width, n=16, scale=1.0, seed=0):
    return {"x": (np.random.default_rng(seed).standard_normal((n, width)) * scale).astype(np.float32)}


def scaled_softmax(scale, seed=0, width=32, hidden=64, classes=10):
    """A ReLU layer, then a softmax over logits whose weights are scaled by ``scale``: large
    logits that float16 holds while they stay under 65504, and turns into inf (the softmax
    into NaN) past it. The MatMuls are float16 in the painted graph, the Softmax float32."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        w1 = tf.constant((rng.standard_normal((width, hidden)) / np.sqrt(width)).astype(np.float32),
                         name="w1")
        h = tf.nn.relu(tf.matmul(x, w1, name="dense"), name="relu")
        w2 = tf.constant((rng.standard_normal((hidden, classes)) * scale).astype(np.float32),
                         name="w2")
        tf.nn.softmax(tf.matmul(h, w2, name="logits"), name="probs")
    return g.as_graph_def()


def loud_rows(n, width=32, seed=0, spread=0.8):
    """Rows of normal values, each row scaled by its own log-normal amplitude
    (``exp(spread * N(0, 1))``): as signals whose strength varies from one example to the
    next, a batch of 16 is a poor guide to the largest row of the next batch."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, width))
    return {"x": (z * np.exp(spread * rng.standard_normal((n, 1)))).astype(np.float32)}


def sign_flip_softmax(seed=0, width=32, classes=8, gain=40.0):
    """``softmax(gain * x @ W) @ V`` (output ``y``): scores that one batch drives past
    float16's range negative (-inf, which the softmax turns into the zeros float32 gives: the
    overflow looks harmless) and the next positive (+inf: NaN). :func:`hot_rows` makes such
    batches."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        w = tf.constant(rng.normal(0, 1, (width, width)).astype(np.float32), name="w")
        scores = tf.matmul(x, w, name="scores")
        p = tf.nn.softmax(tf.multiply(scores, gain, name="scaled"), name="probs")
        v = tf.constant(rng.normal(size=(width, classes)).astype(np.float32), name="v")
        tf.identity(tf.matmul(p, v, name="mix"), name="y")
    return g.as_graph_def()


def hot_rows(n, sign, seed=0, width=32, graph_seed=0, score=1700.0):
    """Rows of small values, each pushed so that one score of :func:`sign_flip_softmax`'s
    (``graph_seed``'s weights) is ``sign * score``: times its gain of 40, past 65504 with that
    sign, while the scores themselves stay under 65504 / 32 (the range margin's limit)."""
    rng = np.random.default_rng(seed)
    w = graphs._rng(graph_seed).normal(0, 1, (width, width)).astype(np.float32)
    x = rng.uniform(-0.05, 0.05, (n, width)).astype(np.float32)
    for r, c in enumerate(rng.integers(0, width, n)):
        x[r] += sign * score * w[:, c] / np.dot(w[:, c], w[:, c])
    return {"x": x}
