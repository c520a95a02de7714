"""Small real TensorFlow graphs for the tests, and helpers to run them.

Every builder returns ``(graph_def, feeds, fetches)``: ``feeds`` maps placeholder tensor names
to numpy inputs, ``fetches`` lists the output tensor names to compare.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


def _rng(seed=0):
    return np.random.default_rng(seed)


def mlp(batch=8, width=64, seed=0):
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 32], name="x")
        w1 = tf.constant(r.normal(0, 0.2, (32, width)).astype(np.float32), name="w1")
        b1 = tf.constant(r.normal(0, 0.1, (width,)).astype(np.float32), name="b1")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1), name="h")
        w2 = tf.constant(r.normal(0, 0.2, (width, 10)).astype(np.float32), name="w2")
        logits = tf.matmul(h, w2, name="logits")
        tf.nn.softmax(logits, name="probs")
    feeds = {"x:0": r.normal(0, 1, (batch, 32)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["probs:0"]


def conv_bn(seed=0):
    """conv -> FusedBatchNormV3 (inference) -> relu, as in grappler's conv_bn test."""
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 16, 16, 8], name="x")
        k = tf.constant(r.normal(0, 0.2, (3, 3, 8, 16)).astype(np.float32), name="k")
        y = tf.nn.conv2d(x, k, strides=1, padding="SAME", name="conv")
        scale = tf.constant(r.uniform(0.5, 1.5, 16).astype(np.float32))
        offset = tf.constant(r.normal(0, 0.1, 16).astype(np.float32))
        mean = tf.constant(r.normal(0, 0.1, 16).astype(np.float32))
        var = tf.constant(r.uniform(0.5, 1.5, 16).astype(np.float32))
        bn = tf.raw_ops.FusedBatchNormV3(x=y, scale=scale, offset=offset, mean=mean, variance=var,
                                         is_training=False, name="bn")[0]
        out = tf.nn.relu(bn, name="relu")
        tf.identity(out, name="out")
    feeds = {"x:0": r.normal(0, 1, (2, 16, 16, 8)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["out:0"]


def conv_bias_relu_pool(seed=0):
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 16, 16, 3], name="x")
        k = tf.constant(r.normal(0, 0.3, (3, 3, 3, 8)).astype(np.float32), name="k")
        b = tf.constant(r.normal(0, 0.1, 8).astype(np.float32), name="b")
        y = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, k, 1, "SAME", name="conv"), b), name="relu")
        p = tf.nn.max_pool2d(y, 2, 2, "VALID", name="pool")
        k2 = tf.constant(r.normal(0, 0.3, (3, 3, 8, 8)).astype(np.float32), name="k2")
        z = tf.nn.conv2d(p, k2, 1, "SAME", name="conv2")
        tf.reduce_mean(z, axis=[1, 2], name="out")
    feeds = {"x:0": r.normal(0, 1, (2, 16, 16, 3)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["out:0"]


def attention(seed=0):
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 16], name="x")
        wq = tf.constant(r.normal(0, 0.25, (16, 16)).astype(np.float32))
        wk = tf.constant(r.normal(0, 0.25, (16, 16)).astype(np.float32))
        wv = tf.constant(r.normal(0, 0.25, (16, 16)).astype(np.float32))
        q = tf.einsum("bsd,de->bse", x, wq, name="q")
        k = tf.einsum("bsd,de->bse", x, wk, name="k")
        v = tf.einsum("bsd,de->bse", x, wv, name="v")
        scores = tf.raw_ops.BatchMatMulV2(x=q, y=k, adj_y=True, name="scores") * 0.25
        attn = tf.nn.softmax(scores, name="attn")
        ctx = tf.raw_ops.BatchMatMulV2(x=attn, y=v, name="ctx")
        tf.identity(ctx, name="out")
    feeds = {"x:0": r.normal(0, 1, (2, 8, 16)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["out:0"]


def while_v1(seed=0):
    """A control-flow-v1 while loop with a MatMul in its body."""
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, [4, 16], name="x")
            w = tf.constant(r.normal(0, 0.25, (16, 16)).astype(np.float32), name="w")

            def body(i, h):
                return i + 1, tf.nn.tanh(tf.matmul(h, w))

            _, h = tf.while_loop(lambda i, h: i < 5, body, [tf.constant(0), x], name="loop")
            tf.identity(h, name="out")
        finally:
            v1.enable_control_flow_v2()
    feeds = {"x:0": r.normal(0, 1, (4, 16)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["out:0"]


def tensorarray_lstm(seed=0, steps=6, units=16):
    """An LSTM unrolled by a control-flow-v1 while loop over TensorArrays (dynamic_rnn's shape)."""
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, [steps, 3, 8], name="x")
            w = tf.constant(r.normal(0, 0.2, (8 + units, 4 * units)).astype(np.float32), name="w")
            b = tf.constant(np.zeros(4 * units, np.float32), name="b")
            inputs = tf.TensorArray(tf.float32, size=steps).unstack(x)
            outputs = tf.TensorArray(tf.float32, size=steps)
            h0 = tf.zeros([3, units])

            def body(t, h, c, out):
                z = tf.nn.bias_add(tf.matmul(tf.concat([inputs.read(t), h], 1), w), b)
                i, f, gg, o = tf.split(z, 4, axis=1)
                c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(gg)
                h = tf.sigmoid(o) * tf.tanh(c)
                return t + 1, h, c, out.write(t, h)

            _, _, _, out = tf.while_loop(lambda t, *_: t < steps, body,
                                         [tf.constant(0), h0, h0, outputs], name="rnn")
            tf.identity(out.stack(), name="out")
        finally:
            v1.enable_control_flow_v2()
    feeds = {"x:0": r.normal(0, 1, (steps, 3, 8)).astype(np.float32)}
    return g.as_graph_def(), feeds, ["out:0"]


def functional_while(seed=0):
    """Control flow v2: a functional While whose body holds a MatMul."""
    r = _rng(seed)
    w = r.normal(0, 0.25, (16, 16)).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32)])
    def f(x):
        i = tf.constant(0)
        c = lambda i, h: i < 3  # noqa: E731
        b = lambda i, h: (i + 1, tf.nn.relu(tf.matmul(h, tf.constant(w))))  # noqa: E731
        _, h = tf.while_loop(c, b, [i, x])
        return tf.identity(h, name="out")

    gd = f.get_concrete_function().graph.as_graph_def()
    feeds = {"x:0": r.normal(0, 1, (4, 16)).astype(np.float32)}
    return gd, feeds, ["out:0"]


def freeze(sess, graph_def, outputs):
    return v1.graph_util.convert_variables_to_constants(sess, graph_def, outputs)


def run(graph_def, feeds, fetches):
    """Import ``graph_def`` into a fresh graph and run ``fetches``; returns float64 arrays."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with v1.Session(graph=g) as sess:
        outs = sess.run(fetches, feed_dict=feeds)
    return [np.asarray(o, dtype=np.float64) for o in outs]


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def dtypes_of(graph_def, op=None, name=None):
    """{node name: {attr: DType name}} of the nodes with op ``op`` (or the one node ``name``)."""
    out = {}
    for n in graph_def.node:
        if (op is None or n.op == op) and (name is None or n.name == name):
            out[n.name] = {k: tf.dtypes.as_dtype(v.type).name for k, v in n.attr.items()
                           if v.WhichOneof("value") == "type"}
    return out


def training_mlp(seed=0, lr=0.1):
    """A tf.compat.v1 training graph: resource variables, tf.gradients, GradientDescent.

    Returns ``(graph_def, feeds, fetches)`` with fetches ``[loss, train_op]`` and the init op's
    name in ``feeds["__init__"]``.
    """
    g = tf.Graph()
    r = _rng(seed)
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w1 = v1.get_variable("w1", initializer=r.normal(0, 0.3, (16, 32)).astype(np.float32),
                             use_resource=True)
        w2 = v1.get_variable("w2", initializer=r.normal(0, 0.3, (32, 4)).astype(np.float32),
                             use_resource=True)
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        train = v1.train.GradientDescentOptimizer(lr).minimize(loss, name="train")
        init = v1.global_variables_initializer()
    feeds = {"x:0": r.normal(0, 1, (32, 16)).astype(np.float32),
             "y:0": r.integers(0, 4, 32).astype(np.int32), "__init__": init.name}
    return g.as_graph_def(), feeds, ["loss:0", train.name]


def train_losses(graph_def, feeds, fetches, steps):
    """Run ``steps`` training steps of a graph from :func:`training_mlp`; returns the losses."""
    feeds = dict(feeds)
    init = feeds.pop("__init__")
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    losses = []
    with v1.Session(graph=g) as sess:
        sess.run(init)
        for _ in range(steps):
            losses.append(float(sess.run(fetches, feeds)[0]))
    return losses
