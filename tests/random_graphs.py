"""Random real TensorFlow graphs for the property tests, built layer by layer.

A graph is a list of layer names applied to a ``[batch, width]`` float32 Placeholder ``x``;
every layer keeps the batch, most keep the width, and values stay within a few units of zero
(weights scaled by 1/sqrt(fan-in), ``Exp`` behind a ``Tanh``) so float16 and bfloat16 errors
measure precision, not overflow. The layers mix each list of the rules: allow (MatMul, Conv2D),
infer (Add, Mul, BiasAdd, Tanh, Sigmoid, Softmax), clear (Relu, Reshape, Identity, Transpose,
ConcatV2, MaxPool), deny (Exp, Sum, Mean) and a control-flow-v1 while loop.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


def _const(r, shape, scale):
    return tf.constant(r.normal(0, scale, shape).astype(np.float32))


def _width(h) -> int:
    return int(h.shape[1])


def _matmul(h, r, history):
    w = _width(h)
    return tf.matmul(h, _const(r, (w, int(r.choice([8, 16]))), w ** -0.5))


def _conv(h, r, history):
    b, w = int(h.shape[0]), _width(h)
    y = tf.nn.conv2d(tf.reshape(h, [b, 2, w // 2, 1]), _const(r, (2, 2, 1, 1), 0.5), 1, "SAME")
    return tf.reshape(y, [b, w])


def _bias_add(h, r, history):
    return tf.nn.bias_add(h, _const(r, (_width(h),), 0.1))


def _add(h, r, history):
    same = [t for t in history if t.shape == h.shape and t is not h]
    return tf.add(h, same[-1] if same else _const(r, (_width(h),), 0.5))


def _mul(h, r, history):
    return tf.multiply(h, tf.constant(r.uniform(0.5, 1.5, _width(h)).astype(np.float32)))


def _reshape(h, r, history):
    b, w = int(h.shape[0]), _width(h)
    return tf.reshape(tf.nn.relu(tf.reshape(h, [b, 2, w // 2])), [b, w])


def _transpose(h, r, history):
    b, w = int(h.shape[0]), _width(h)
    t = tf.transpose(tf.reshape(h, [b, 2, w // 2]), [0, 2, 1])
    return tf.reshape(t, [b, w])


def _concat(h, r, history):
    joined = tf.concat([h, history[max(0, len(history) - 2)]], axis=1)
    return tf.matmul(joined, _const(r, (_width(joined), _width(h)), _width(joined) ** -0.5))


def _maxpool(h, r, history):
    b, w = int(h.shape[0]), _width(h)
    y = tf.nn.max_pool2d(tf.reshape(h, [b, 1, w, 1]), [1, 2], 1, "SAME")
    return tf.reshape(y, [b, w])


def _exp(h, r, history):
    return tf.exp(tf.tanh(h))


def _sum(h, r, history):
    return h + tf.reduce_sum(h, axis=1, keepdims=True) / _width(h)


def _mean(h, r, history):
    return h - tf.reduce_mean(h, axis=1, keepdims=True)


def _while(h, r, history):
    w = _width(h)
    weight = _const(r, (w, w), w ** -0.5)

    def body(i, s):
        return i + 1, tf.tanh(tf.matmul(s, weight))

    return tf.while_loop(lambda i, s: i < 3, body, [tf.constant(0), h])[1]


LAYERS = {
    "matmul": _matmul, "conv": _conv,
    "bias_add": _bias_add, "add": _add, "mul": _mul, "tanh": lambda h, r, _: tf.tanh(h),
    "sigmoid": lambda h, r, _: tf.sigmoid(h), "softmax": lambda h, r, _: tf.nn.softmax(h),
    "relu": lambda h, r, _: tf.nn.relu(h), "reshape": _reshape,
    "identity": lambda h, r, _: tf.identity(h), "transpose": _transpose, "concat": _concat,
    "maxpool": _maxpool,
    "exp": _exp, "sum": _sum, "mean": _mean,
    "while": _while,
}


def build(layers: list[str], batch: int, width: int, seed: int):
    """The graph of ``layers`` on ``x: [batch, width]``; returns ``(graph_def, feeds, fetches)``."""
    r = np.random.default_rng(seed)
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, [batch, width], name="x")
            history = [x]
            for i, name in enumerate(layers):
                with tf.name_scope(f"l{i}_{name}"):
                    history.append(LAYERS[name](history[-1], r, history))
            tf.identity(history[-1], name="out")
        finally:
            v1.enable_control_flow_v2()
    feeds = {"x:0": r.normal(0, 1, (batch, width)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["out:0"]
