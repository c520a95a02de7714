"""Real TF1 training graphs on scikit-learn's bundled digits data, and a trainer that runs them.

A builder returns the MetaGraphDef a ``tf.compat.v1.train.Saver`` exports (graph, variables
collection, saver, train_op collection). Initial values come from a seeded numpy generator, so
an FP32 graph and its converted copy start from the same weights. Names the tests rely on:
placeholders ``x`` / ``y``, ``loss``, ``accuracy``, train op ``train``, init op ``init``.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

v1 = tf.compat.v1

OPTIMIZERS = {
    "sgd": lambda lr: v1.train.GradientDescentOptimizer(0.2 * lr),
    "momentum": lambda lr: v1.train.MomentumOptimizer(0.05 * lr, 0.9),
    "adam": lambda lr: v1.train.AdamOptimizer(0.005 * lr),
}


@functools.lru_cache(maxsize=1)
def digits():
    """``(x_train, y_train, x_test, y_test)``: 8x8 digits scaled to [0, 1], a fixed split."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    return x[:1400], y[:1400], x[1400:], y[1400:]


def batches(steps: int, size: int = 64, seed: int = 1):
    """The same sequence of training batches (feed dicts) for every graph."""
    x, y, _, _ = digits()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(x), size, replace=False)
        yield {"x:0": x[idx], "y:0": y[idx]}


def test_feed():
    _, _, x, y = digits()
    return {"x:0": x, "y:0": y}


def _mlp(x, var):
    h = tf.nn.relu(tf.matmul(x, var("w1", (64, 64), 0.15)) + var("b1", (64,), 0.0))
    return tf.matmul(h, var("w2", (64, 10), 0.15)) + var("b2", (10,), 0.0)


def _cnn(x, var):
    """conv 3x3 -> fused batch norm (training mode, with moving averages) -> relu -> dense."""
    img = tf.reshape(x, [-1, 8, 8, 1])
    conv = tf.nn.conv2d(img, var("k", (3, 3, 1, 16), 0.3), 1, "SAME")
    scale, offset = var("bn/gamma", (16,), 0.0, 1.0), var("bn/beta", (16,), 0.0)
    bn, mean, _ = v1.nn.fused_batch_norm(conv, scale, offset, is_training=True)
    moving = var("bn/moving_mean", (16,), 0.0, trainable=False)
    v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign_sub(moving, 0.1 * (moving - mean)))
    h = tf.reshape(tf.nn.relu(bn), [-1, 8 * 8 * 16])
    return tf.matmul(h, var("w", (8 * 8 * 16, 10), 0.05)) + var("b", (10,), 0.0)


def _embedding(x, var):
    """A bag of (pixel position, intensity) embeddings: its gradients are IndexedSlices."""
    ids = tf.cast(tf.round(x * 16.0), tf.int32) + 17 * tf.range(64)
    return tf.reduce_sum(tf.gather(var("emb", (64 * 17, 10), 0.01), ids), axis=1) + var("b", (10,), 0.0)


MODELS = {"mlp": _mlp, "cnn": _cnn, "embedding": _embedding}


def _minimize(optimizer, loss, step, backprop: str):
    """``optimizer.minimize`` through tf.gradients, a GradientTape, or a user-given seed."""
    if backprop == "gradients":
        return optimizer.minimize(loss, global_step=step, name="train")
    if backprop == "step_in_group":   # the global step does not wait on the updates
        return tf.group(optimizer.minimize(loss), step.assign_add(1), name="train")
    variables = v1.trainable_variables()
    if backprop == "manual":   # plain SGD written with assign_sub, no optimizer ops
        updates = [v.assign_sub(0.2 * g) for v, g in zip(variables, tf.gradients(loss, variables))]
        with tf.control_dependencies(updates):
            return tf.group(step.assign_add(1), name="train")
    if backprop == "hand_momentum":   # momentum written by hand: v = 0.9 v + g, w -= lr v
        lr = optimizer._learning_rate   # noqa: SLF001 (the optimizer's own rate, by the factor)
        updates = []
        for var, grad in zip(variables, tf.gradients(loss, variables)):
            velocity = v1.get_variable(f"{var.op.name}/velocity", trainable=False,
                                       initializer=np.zeros(var.shape, np.float32),
                                       use_resource=isinstance(var, tf.Variable) and
                                       hasattr(var, "handle"))
            new = velocity.assign(0.9 * velocity + grad)
            updates.append(var.assign_sub(lr * new))
        with tf.control_dependencies(updates):
            return tf.group(step.assign_add(1), name="train")
    if backprop == "grad_ys":
        grads = tf.gradients(loss, variables, grad_ys=tf.ones_like(loss, name="seed"))
    elif backprop == "all_reduce":   # a one-replica collective all-reduce of each gradient
        grads = [tf.raw_ops.CollectiveReduceV2(
            input=g, group_size=tf.constant(1), group_key=tf.constant(1),
            instance_key=tf.constant(i + 1), ordering_token=[], merge_op="Add", final_op="Id")
            for i, g in enumerate(tf.gradients(loss, variables))]
    else:
        grads = backprop.gradient(loss, variables)
    return optimizer.apply_gradients(zip(grads, variables), global_step=step, name="train")


def build(model: str = "mlp", optimizer: str = "sgd", *, resource: bool = True,
          loss_factor: float = 1.0, lr_factor: float = 1.0, backprop: str = "gradients",
          seed: int = 0):
    """A training MetaGraphDef: ``model`` a key of MODELS, ``optimizer`` a key of OPTIMIZERS.

    ``loss_factor`` multiplies the loss and ``lr_factor`` the learning rate: together they make
    a graph whose FP32 training is unchanged but whose gradients are tiny. ``backprop`` is
    ``"gradients"`` (minimize), ``"tape"`` (tf.GradientTape), ``"grad_ys"`` (tf.gradients
    seeded by the user's ``tf.ones_like(loss, name="seed")``), ``"manual"`` (SGD by
    ``assign_sub``, no optimizer), ``"hand_momentum"`` (momentum written by hand with a
    velocity variable per weight, at the optimizer's learning rate), ``"all_reduce"`` (each gradient
    through a collective all-reduce) or ``"step_in_group"`` (the global step increment grouped
    with the updates instead of waiting on them).
    """
    rng = np.random.default_rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")

        def var(name, shape, std, mean=0.0, trainable=True):
            init = (mean + rng.normal(0, std, shape)).astype(np.float32)
            return v1.get_variable(name, initializer=init, use_resource=resource, trainable=trainable)

        tape = tf.GradientTape()
        with tape:
            logits = MODELS[model](x, var)
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.multiply(tf.reduce_mean(xent), loss_factor, name="loss")
        hits = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32)
        tf.reduce_mean(hits, name="accuracy")
        step = v1.train.get_or_create_global_step()
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            _minimize(OPTIMIZERS[optimizer](lr_factor), loss, step, tape if backprop == "tape" else backprop)
        v1.global_variables_initializer().name  # noqa: B018 (creates "init")
        return v1.train.Saver().export_meta_graph()


class Trainer:
    """A session over an imported MetaGraphDef, initialized by the graph's own ``init`` op."""

    def __init__(self, meta_graph):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.saver = v1.train.import_meta_graph(meta_graph)
        self.sess = v1.Session(graph=self.graph)
        self.sess.run("init")

    def step(self, feed, *extra):
        """One train step; returns the loss (and the extra fetches)."""
        out = self.sess.run(["loss:0", *extra, "train"], feed_dict=feed)
        return out[:-1] if extra else out[0]

    def train(self, steps, **kwargs):
        return [self.step(feed) for feed in batches(steps, **kwargs)]

    def accuracy(self) -> float:
        return float(self.sess.run("accuracy:0", feed_dict=test_feed()))

    def variables(self) -> dict[str, np.ndarray]:
        """Every global variable's value (weights, slots, beta powers, global step ...)."""
        with self.graph.as_default():
            variables = v1.global_variables()
        return dict(zip([v.op.name for v in variables], self.sess.run(variables)))

    def fetch(self, *names):
        return self.sess.run(list(names))

    def close(self):
        self.sess.close()
