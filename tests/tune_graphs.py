"""Frozen graphs that fail out of the box in float16 (for tests/test_tune.py and the tune
benchmark): each computes something real whose float16 version overflows or loses its
accuracy where the rule lists call the ops safe."""

import numpy as np
import tensorflow as tf

import graphs


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


def attention_softmax(seed=0, width=32, keys=64):
    """A softmax over large values: attention scores that differ by about 1 on top of a
    large shared bias (near 2000), where float16's step is 1: the shift the softmax removes
    exactly in float32 rounds the differences away in float16."""
    rng = graphs._rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        wk = tf.constant(rng.standard_normal((width, keys)).astype(np.float32) * 0.2, name="keys")
        bias = tf.constant(2000 + rng.standard_normal(keys).astype(np.float32), name="bias")
        scores = tf.nn.bias_add(tf.matmul(x, wk, name="scores"), bias, name="biased")
        weights = tf.nn.softmax(scores, name="attention")
        values = tf.constant(rng.standard_normal((keys, 10)).astype(np.float32), name="values")
        tf.identity(tf.matmul(weights, values, name="mix"), name="out")
    return g.as_graph_def()


def inputs(width, n=16, scale=1.0, seed=0):
    return {"x": (np.random.default_rng(seed).standard_normal((n, width)) * scale).astype(np.float32)}
