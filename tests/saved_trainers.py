"""TF2 train-step SavedModels of the digits data set, trained before and after a float16
conversion: the accuracy comparison of tests/test_saved_training.py and
benchmarks/fp16_training.py.

Each model is a ``tf.Module`` with a Keras Adam optimizer, a ``train_step`` tf.function
(GradientTape, ``apply_gradients``, plus the batch-norm moving averages where there is one) and a
serving signature; :func:`compare` saves it, converts it with ``--target float16`` (dynamic loss
scaling), trains the FP32 SavedModel and the converted one on the same batches, and measures both
on the held-out digits.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from tensorflow.core.framework import types_pb2
from tensorflow.python.saved_model import loader_impl

from amp_rewrite import convert_file
from amp_rewrite.core.ops import MATRIX_OPS

TRAIN = 1400        # digits 0..1399 train, the other 397 test


def _var(rng, shape, scale, name):
    return tf.Variable(rng.normal(0, scale, shape).astype(np.float32) if scale else
                       np.zeros(shape, np.float32), name=name)


class _Base(tf.Module):
    def _finish(self):
        self.opt = keras.optimizers.Adam(self.lr)
        self.opt.build(self.params)

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, self.logits(x, training=True)))
        self.opt.apply_gradients(zip(tape.gradient(loss, self.params), self.params))
        return loss

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def serve(self, x):
        return {"logits": self.logits(x, training=False)}


class MLP(_Base):
    """64-128-10."""
    lr = 3e-3

    def __init__(self, seed):
        super().__init__()
        r = np.random.default_rng(seed)
        self.params = [_var(r, (64, 128), 0.12, "w1"), _var(r, (128,), 0, "b1"),
                       _var(r, (128, 10), 0.09, "w2"), _var(r, (10,), 0, "b2")]
        self._finish()

    def logits(self, x, training):
        w1, b1, w2, b2 = self.params
        return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2


class CNN(_Base):
    """conv3x3x16 -> batch norm (moving averages updated by the step) -> relu -> 2x2 pool ->
    dense 10, on the 8x8 digits."""
    lr = 3e-3

    def __init__(self, seed):
        super().__init__()
        r = np.random.default_rng(seed)
        self.params = [_var(r, (3, 3, 1, 16), 0.3, "kernel"), tf.Variable(np.ones(16, np.float32), name="gamma"),
                       _var(r, (16,), 0, "beta"), _var(r, (256, 10), 0.06, "dense"), _var(r, (10,), 0, "bias")]
        self.moving_mean = tf.Variable(np.zeros(16, np.float32), trainable=False, name="moving_mean")
        self.moving_var = tf.Variable(np.ones(16, np.float32), trainable=False, name="moving_var")
        self._finish()

    def logits(self, x, training):
        kernel, gamma, beta, dense, bias = self.params
        h = tf.nn.conv2d(tf.reshape(x, [-1, 8, 8, 1]), kernel, 1, "SAME")
        if training:
            mean, var = tf.nn.moments(h, [0, 1, 2])
            self.moving_mean.assign(0.9 * self.moving_mean + 0.1 * mean)
            self.moving_var.assign(0.9 * self.moving_var + 0.1 * var)
        else:
            mean, var = self.moving_mean, self.moving_var
        h = tf.nn.relu(tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        return tf.matmul(tf.reshape(h, [-1, 256]), dense) + bias


class LSTM(_Base):
    """The digit read row by row (8 steps of 8 pixels) by an LSTM of 32 units (Keras' layer),
    then dense 10."""
    lr = 1e-2

    def __init__(self, seed):
        super().__init__()
        keras.utils.set_random_seed(seed)
        self.lstm = keras.layers.LSTM(32)
        self.lstm.build((None, 8, 8))
        r = np.random.default_rng(seed)
        self.params = list(self.lstm.trainable_variables) + [_var(r, (32, 10), 0.15, "dense"),
                                                             _var(r, (10,), 0, "bias")]
        self._finish()

    def logits(self, x, training):
        return tf.matmul(self.lstm(tf.reshape(x, [-1, 8, 8])), self.params[-2]) + self.params[-1]


class _Routed(_Base):
    """A Mixture-of-Experts block: 64 -> 128 (ReLU) -> a gate over 4 experts, each token sent to
    the 2 experts of largest gate logit (``tf.math.top_k``) and their outputs (each expert
    128 -> 10) summed weighted by the softmax of those two logits. ``top_k``'s gradient is a
    ``ScatterNd``, a stateless op that writes no variable. The subclasses route alike and
    differ in how the tokens reach their experts (:meth:`combine`)."""
    lr = 3e-3
    EXPERTS, CHOSEN = 4, 2

    def __init__(self, seed):
        super().__init__()
        r = np.random.default_rng(seed)
        self.params = [_var(r, (64, 128), 0.12, "w1"), _var(r, (128,), 0, "b1"),
                       _var(r, (128, self.EXPERTS), 0.09, "gate"),
                       _var(r, (self.EXPERTS, 128, 10), 0.09, "experts"),
                       _var(r, (self.EXPERTS, 10), 0, "expert_bias")]
        self._finish()

    def logits(self, x, training):
        w1, b1, gate = self.params[:3]
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        top = tf.math.top_k(tf.matmul(h, gate), k=self.CHOSEN)
        return self.combine(h, top.indices, tf.nn.softmax(top.values))   # [B, 10]


class RoutedGather(_Routed):
    """Each token's two experts' weights gathered by index (``tf.gather`` of the expert
    variable, whose gradient is sparse) and applied with a batched einsum."""

    def combine(self, h, chosen, weights):
        experts, bias = self.params[3:]
        out = tf.einsum("bh,bkhc->bkc", h, tf.gather(experts, chosen)) + tf.gather(bias, chosen)
        return tf.reduce_sum(out * weights[:, :, None], axis=1)


class RoutedSegmentSum(_Routed):
    """Dispatch by assignment: each (token, choice) pair gathers its token and its expert's
    weights, and ``tf.math.unsorted_segment_sum`` adds the weighted outputs back per token."""

    def combine(self, h, chosen, weights):
        experts, bias = self.params[3:]
        tokens = tf.shape(h)[0]
        expert = tf.reshape(chosen, [-1])                                   # [B * 2]
        token = tf.repeat(tf.range(tokens), self.CHOSEN)
        inputs = tf.gather(h, token)                                        # [B * 2, 128]
        out = tf.einsum("nh,nhc->nc", inputs, tf.gather(experts, expert)) + tf.gather(bias, expert)
        return tf.math.unsorted_segment_sum(out * tf.reshape(weights, [-1, 1]), token, tokens)


class RoutedEinsum(_Routed):
    """Dense dispatch as GShard and Switch write it: every expert runs on every token (one
    einsum), and a one-hot combine tensor of the gate's weights picks and weighs the two."""

    def combine(self, h, chosen, weights):
        experts, bias = self.params[3:]
        combine = tf.einsum("bk,bke->be", weights, tf.one_hot(chosen, self.EXPERTS))
        out = tf.einsum("bh,ehc->bec", h, experts) + bias
        return tf.einsum("be,bec->bc", combine, out)


class Transformer(tf.Module):
    """A decoder-only Transformer language model as Keras users write one: token and position
    ``Embedding`` layers, ``layers`` blocks of ``MultiHeadAttention`` (causal and padding mask
    together: token 0 pads), ``LayerNormalization`` and a GELU ``Dense`` feed-forward layer
    (pre-norm, residuals), a ``Dense`` head over the vocabulary, softmax cross-entropy over the
    tokens that are not padding and Keras' Adam. ``train_step(tokens)`` predicts each next token
    of a ``[batch, seq]`` int32 batch; ``serve(tokens)`` returns the logits."""

    def __init__(self, seed: int = 0, layers: int = 2, width: int = 64, heads: int = 4,
                 seq: int = 16, vocab: int = 64, lr: float = 1e-3):
        super().__init__()
        keras.utils.set_random_seed(seed)
        L = keras.layers
        self.seq, self.vocab = seq, vocab
        self.embed = L.Embedding(vocab, width)
        self.position = L.Embedding(seq, width)
        self.blocks = [(L.LayerNormalization(), L.MultiHeadAttention(heads, width // heads),
                        L.LayerNormalization(), L.Dense(4 * width, activation="gelu"),
                        L.Dense(width)) for _ in range(layers)]
        self.norm, self.head = L.LayerNormalization(), L.Dense(vocab)
        self.logits(tf.zeros([1, seq], tf.int32))   # builds every layer
        self.params = [v for layer in self._layers() for v in layer.trainable_variables]
        self.opt = keras.optimizers.Adam(lr)
        self.opt.build(self.params)
        self.train_step = tf.function(self._train_step, input_signature=[
            tf.TensorSpec([None, seq], tf.int32)])
        self.serve = tf.function(self.logits, input_signature=[tf.TensorSpec([None, seq], tf.int32)])

    def _layers(self):
        return [self.embed, self.position] + [l for b in self.blocks for l in b] + [self.norm, self.head]

    def logits(self, tokens):
        pad = tf.not_equal(tokens, 0)                       # [batch, seq]
        causal = tf.linalg.band_part(tf.ones([self.seq, self.seq], tf.bool), -1, 0)
        mask = tf.logical_and(causal[None], pad[:, None, :])
        h = self.embed(tokens) + self.position(tf.range(self.seq))[None]
        for norm1, attention, norm2, ff_in, ff_out in self.blocks:
            x = norm1(h)
            h = h + attention(x, x, attention_mask=mask)
            h = h + ff_out(ff_in(norm2(h)))
        return self.head(self.norm(h))

    def _train_step(self, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        inputs = tf.pad(inputs, [[0, 0], [0, 1]])            # keep the signature's length
        weights = tf.cast(tf.not_equal(targets, 0), tf.float32)
        with tf.GradientTape() as tape:
            logits = self.logits(inputs)[:, :-1]
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
            loss = tf.reduce_sum(losses * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
        self.opt.apply_gradients(zip(tape.gradient(loss, self.params), self.params))
        return {"loss": loss}


def token_batches(batch: int, seq: int, vocab: int, count: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` batches of a learnable token language for :class:`Transformer`: each sequence
    counts up from a random start by a random step (mod ``vocab - 1``, ids 1..vocab-1), then is
    padded with 0 from a random length on (at least half the sequence)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        start = rng.integers(0, vocab - 1, (batch, 1))
        step = rng.integers(1, 4, (batch, 1))
        tokens = (start + step * np.arange(seq)[None]) % (vocab - 1) + 1
        lengths = rng.integers(seq // 2, seq + 1, (batch, 1))
        out.append(np.where(np.arange(seq)[None] < lengths, tokens, 0).astype(np.int32))
    return out


def save_transformer(module: Transformer, path: Path) -> None:
    """The Transformer as a SavedModel: ``serving_default`` (logits) and ``train`` (one step)."""
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve,
                                                       "train": module.train_step})


MODELS = {"MLP": MLP, "CNN": CNN, "LSTM": LSTM}
#: Mixture-of-Experts blocks, one per way of sending tokens to their experts (tests/test_routed_steps.py)
ROUTED = {"routed_gather": RoutedGather, "routed_segment_sum": RoutedSegmentSum,
          "routed_einsum": RoutedEinsum}


@dataclass
class Run:
    """One seed of one model: test accuracies, the float16 run's loss-scale history and what
    shows that float16 ran: its train step's matrix ops, its weights, its predictions."""

    model: str
    seed: int
    fp32: float
    float16: float
    scale_history: list = field(default_factory=list)   # (step, new scale), first: (0, start)
    skipped: int = 0
    steps: int = 0
    good_steps: int = 0         # the loss scale's count of finite steps since its last change
    float16_matrix_ops: int = 0   # MatMul/Conv ops in float16 in the converted train step
    weight_difference: float = 0.0   # largest |float16 - FP32| weight after training
    disagreements: int = 0      # held-out digits the two trained models classify differently


def digits():
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def _train(model, x, y, steps, seed, watch=None):
    rng = np.random.default_rng(seed + 100)
    for step in range(steps):
        idx = rng.choice(TRAIN, 64, replace=False)
        model.train_step(x[idx], y[idx])
        if watch:
            watch(step)


def _predictions(model, x) -> np.ndarray:
    logits = model.signatures["serving_default"](x=tf.constant(x[TRAIN:]))["logits"].numpy()
    return np.argmax(logits, 1)


def float16_matrix_ops(saved_model: Path, functions: list[str]) -> int:
    """How many MatMul/Conv-family ops of the named functions of a SavedModel run in float16."""
    meta = loader_impl.parse_saved_model(str(saved_model)).meta_graphs[0]
    return sum(n.op in MATRIX_OPS and n.attr["T"].type == types_pb2.DT_HALF
               for f in meta.graph_def.library.function if f.signature.name in functions
               for n in f.node_def)


def compare(name: str, seed: int, steps: int = 300, folder: Path | None = None,
            as_signature: bool = True) -> Run:
    """Train model ``name`` (of :data:`MODELS` or :data:`ROUTED`) from ``seed`` in FP32 and
    converted to float16, its train step saved as the ``train`` signature or, with
    ``as_signature=False``, only as the module's method (``loaded.train_step``)."""
    folder = Path(folder or tempfile.mkdtemp(prefix=f"amp_{name}_{seed}_"))
    module = {**MODELS, **ROUTED}[name](seed)
    signatures = {"serving_default": module.serve}
    if as_signature:
        signatures["train"] = module.train_step
    tf.saved_model.save(module, str(folder / "fp32"), signatures=signatures)
    report = convert_file(folder / "fp32", folder / "f16", target="float16", force=True)
    train_functions = report.to_dict()["loss_scaling"]["functions"]
    x, y = digits()
    reference = tf.saved_model.load(str(folder / "fp32"))
    _train(reference, x, y, steps, seed)
    converted = tf.saved_model.load(str(folder / "f16"))
    scale = converted.amp_loss_scale
    history, watch = scale_history(scale)
    _train(converted, x, y, steps, seed, watch)
    ours, theirs = _predictions(converted, x), _predictions(reference, x)
    return Run(name, seed, float(np.mean(theirs == y[TRAIN:])), float(np.mean(ours == y[TRAIN:])),
               history, int(scale.skipped_steps.numpy()), steps, int(scale.good_steps.numpy()),
               float16_matrix_ops(folder / "f16", train_functions),
               max(float(np.max(np.abs(a.numpy() - b.numpy())))
                   for a, b in zip(converted.params, reference.params)),
               int(np.sum(ours != theirs)))


def all_variables(obj) -> dict:
    """Every variable reachable from ``obj`` (a trainer, a GAN or a loaded SavedModel), by its
    path in the object graph, each once: the same paths on both."""
    out, seen = {}, set()

    def walk(o, path):
        for name, child in tf.train.TrackableView(o).children(o).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            where = f"{path}/{name}" if path else name
            if isinstance(child, tf.Variable):
                out[where] = child
            else:
                walk(child, where)
    walk(obj, "")
    return out


def scale_history(state) -> tuple[list, Callable[[int], None]]:
    """The loss scale's history ``[(step, scale), ...]`` from its start, and the callback that
    a training loop calls after each step to record where the scale moved."""
    history = [(0, float(state.scale.numpy()))]

    def watch(step: int) -> None:
        value = float(state.scale.numpy())
        if value != history[-1][1]:
            history.append((step + 1, value))
    return history, watch
