"""Optimizers written by hand in a train step, as research code writes them, and a reader of the
update region of a saved train step: the models of tests/test_float32_updates.py and
tests/test_saved_methods.py.

:class:`HandAdamW` is a small BERT-style classifier of the digits (dense, GELU, layer norm,
dense) whose ``train_step`` tf.function writes AdamW itself: moment variables, bias correction,
a linear warmup and decoupled weight decay, no Keras optimizer. Converted to float16 with that
math painted float16, ``(1 - b2) * g * g`` rounds to zero and the step diverges (issue 34).

:func:`update_nodes` finds, in a saved FunctionDef or GraphDef, the nodes on a path from the
backward pass to a variable write, written here from the protos alone (not with amp_rewrite's
own walk), so a test of its dtypes does not take the converter's word for what the region is.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

WRITES = ("Assign", "ResourceApply", "ApplyGradient", "ApplyMomentum", "ApplyAdam", "Scatter",
          "ResourceScatter")
#: named like a write, but stateless: they compute a new tensor (ScatterNd is top_k's gradient)
NOT_WRITES = ("ScatterNd", "ScatterNdNonAliasingAdd")
SIXTEEN_BITS = (tf.float16.as_datatype_enum, tf.bfloat16.as_datatype_enum)
SIGNATURE = [tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int64)]


class HandAdamW(tf.Module):
    """64 -> 128 (GELU, layer norm) -> 10, AdamW by hand: lr 1e-2 after a 20-step linear
    warmup, b1 0.9, b2 0.999, eps 1e-7, decoupled weight decay 1e-4."""

    def __init__(self, seed: int = 0):
        super().__init__()
        r = np.random.default_rng(seed)
        self.w1 = tf.Variable(r.normal(0, 0.12, (64, 128)).astype(np.float32), name="w1")
        self.b1 = tf.Variable(np.zeros(128, np.float32), name="b1")
        self.gamma = tf.Variable(np.ones(128, np.float32), name="gamma")
        self.beta = tf.Variable(np.zeros(128, np.float32), name="beta")
        self.w2 = tf.Variable(r.normal(0, 0.09, (128, 10)).astype(np.float32), name="w2")
        self.b2 = tf.Variable(np.zeros(10, np.float32), name="b2")
        self.t = tf.Variable(0.0, name="t")
        self.m = [tf.Variable(tf.zeros_like(w), name=f"m{i}") for i, w in enumerate(self.params)]
        self.v = [tf.Variable(tf.zeros_like(w), name=f"v{i}") for i, w in enumerate(self.params)]

    @property
    def params(self):
        return [self.w1, self.b1, self.gamma, self.beta, self.w2, self.b2]

    def logits(self, x):
        h = tf.nn.gelu(tf.matmul(x, self.w1) + self.b1)
        mean, var = tf.nn.moments(h, [-1], keepdims=True)
        h = (h - mean) * tf.math.rsqrt(var + 1e-5) * self.gamma + self.beta
        return tf.matmul(h, self.w2) + self.b2

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, self.logits(x)))
        grads = tape.gradient(loss, self.params)
        self.t.assign_add(1.0)
        lr = 1e-2 * tf.minimum(1.0, self.t / 20.0)
        for w, g, m, v in zip(self.params, grads, self.m, self.v):
            m.assign(0.9 * m + 0.1 * g)
            v.assign(0.999 * v + 0.001 * g * g)
            m_hat = m / (1.0 - 0.9 ** self.t)
            v_hat = v / (1.0 - 0.999 ** self.t)
            w.assign_sub(lr * (m_hat / (tf.sqrt(v_hat) + 1e-7) + 1e-4 * w))
        return {"loss": loss}

    @tf.function(input_signature=SIGNATURE[:1])
    def serve(self, x):
        return {"logits": self.logits(x)}


def save(module, path, as_signature: bool) -> None:
    """``serve`` as the serving signature; ``train_step`` as the ``train`` signature too, or only
    as the module's method (``loaded.train_step``)."""
    signatures = {"serving_default": module.serve}
    if as_signature:
        signatures["train"] = module.train_step
    tf.saved_model.save(module, str(path), signatures=signatures)


def _source(ref: str) -> str:
    """The node an input names: ``node``, ``node:port`` (a GraphDef) or ``node:arg:index``."""
    return ref.lstrip("^").split(":")[0]


def _writes(nodes, library) -> set[str]:
    """The write nodes: write ops, and the If ops loss scaling turned them into (a branch that
    writes)."""
    bodies = {f.signature.name: f for f in library.function} if library is not None else {}
    out = set()
    def writes(op: str) -> bool:
        return op.startswith(WRITES) and op not in NOT_WRITES

    for n in nodes:
        if writes(n.op):
            out.add(n.name)
        elif n.op == "If" and any(writes(m.op)
                                  for m in bodies[n.attr["then_branch"].func.name].node_def):
            out.add(n.name)
    return out


def update_nodes(nodes, library=None, scope: str = "gradient_tape/") -> dict:
    """The nodes of ``nodes`` (a FunctionDef's ``node_def`` or a GraphDef's ``node``) outside
    the backward pass (names holding ``scope``, and what lies between them) on a data path from
    it to a variable write, by name; ``library`` looks into the branches of gated writes."""
    nodes = list(nodes)
    inputs = {n.name: [_source(i) for i in n.input if not i.startswith("^")] for n in nodes}
    readers: dict[str, list[str]] = {}
    for name, sources in inputs.items():
        for src in sources:
            readers.setdefault(src, []).append(name)

    def walk(roots, step):
        seen, stack = set(), list(roots)
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(step.get(name, ()))
        return seen

    scoped = [n.name for n in nodes if scope in n.name]
    after, before = walk(scoped, readers), walk(scoped, inputs)
    backward = set(scoped) | (after & before)
    region = (after & walk(_writes(nodes, library), inputs)) - backward
    return {n.name: n for n in nodes if n.name in region}


def sixteen_bit(node) -> list[str]:
    """The type attributes of ``node`` that hold a 16-bit dtype."""
    return [key for key, value in node.attr.items()
            if value.WhichOneof("value") == "type" and value.type in SIXTEEN_BITS
            or value.WhichOneof("value") == "list" and set(value.list.type) & set(SIXTEEN_BITS)]
