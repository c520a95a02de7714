"""Training step time on this CPU: FP32, amp-rewrite's bfloat16 graph, grappler's bfloat16 AMP.

    .venv/bin/python benchmarks/train_step.py [--steps 40] [--warmup 5] [--only TITLE] [--write]

TF1 training graphs on digits data from scikit-learn (scaled up to fill the models): a wide
MLP and a CNN with fused batch norm (Momentum), the tests' small MLP and embedding bag (Adam),
an LSTM over the image rows (Adam) and a transformer block over them (Momentum); then a TF2
train-step SavedModel of a Keras Transformer language model (:func:`bench_savedmodel`).
Each is run three ways in one process,
from the same initial weights on the same batches, timed round-robin (the order rotates every
round, so clock drift falls on all three alike):

* ``fp32``: the FP32 graph in a default session;
* ``amp-rewrite``: the graph ``amp-rewrite --target bfloat16 --device cpu`` writes, in a default
  session;
* ``grappler``: the FP32 graph in a session with grappler's
  ``auto_mixed_precision_onednn_bfloat16`` on (TensorFlow's own run-time AMP).

Prints a Markdown table of median step times and their ratios to FP32; ``--write`` also puts it
in BENCHMARKS.md under "## Training step" (only that section is replaced).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402
import saved_trainers  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from tensorflow.core.framework import types_pb2  # noqa: E402
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

from amp_rewrite import convert_file  # noqa: E402
from amp_rewrite.conversion.pipeline import Options, convert_model  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402
from amp_rewrite.io.load import Model  # noqa: E402

v1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Training step"


def _digits(side: int):
    """Digits images upsampled (nearest) from 8x8 to ``side`` x ``side``, one-channel."""
    x, y = load_digits(return_X_y=True)
    img = (x.reshape(-1, 8, 8) / 16.0).astype(np.float32)
    img = np.kron(img, np.ones((side // 8, side // 8), np.float32))
    return img[..., None], y.astype(np.int32)


def _wide_mlp(x, var):
    h = tf.reshape(x, [-1, 32 * 32])
    for i, width in enumerate((2048, 2048)):
        h = tf.nn.relu(tf.matmul(h, var(f"w{i}", (h.shape[-1], width), 0.02)) + var(f"b{i}", (width,), 0.0))
    return tf.matmul(h, var("out", (2048, 10), 0.02))


def _cnn(x, var):
    h = x
    for i, channels in enumerate((32, 64)):
        k = var(f"k{i}", (3, 3, h.shape[-1], channels), 0.1)
        conv = tf.nn.conv2d(h, k, 1, "SAME")
        bn, _, _ = v1.nn.fused_batch_norm(conv, var(f"g{i}", (channels,), 0.0, 1.0),
                                          var(f"o{i}", (channels,), 0.0), is_training=True)
        h = tf.nn.max_pool2d(tf.nn.relu(bn), 2, 2, "VALID")
    h = tf.reshape(h, [-1, 8 * 8 * 64])
    return tf.matmul(h, var("out", (8 * 8 * 64, 10), 0.02))


def _pixels(x):
    """The 8x8 digit back from its 32x32 upsampling: 64 features, as the tests' models read."""
    return tf.reshape(tf.nn.avg_pool2d(x, 4, 4, "VALID"), [-1, 64])


def _small_mlp(x, var):
    """The tests' MLP (tests/training_graphs.py): 64-64-10."""
    h = tf.nn.relu(tf.matmul(_pixels(x), var("w1", (64, 64), 0.15)) + var("b1", (64,), 0.0))
    return tf.matmul(h, var("w2", (64, 10), 0.15)) + var("b2", (10,), 0.0)


def _embedding(x, var):
    """The tests' embedding bag: (pixel, intensity) embeddings summed; no matrix op at all."""
    ids = tf.cast(tf.round(_pixels(x) * 16.0), tf.int32) + 17 * tf.range(64)
    return tf.reduce_sum(tf.gather(var("emb", (64 * 17, 10), 0.01), ids), axis=1) + var("b", (10,), 0.0)


def _lstm(x, var, units: int = 256):
    """An LSTM over the image's 32 rows as time steps (unrolled); logits from the last state."""
    rows = tf.unstack(tf.reshape(x, [-1, 32, 32]), axis=1)
    w, b = var("lstm_w", (32 + units, 4 * units), 0.05), var("lstm_b", (4 * units,), 0.0)
    h = c = tf.zeros([tf.shape(x)[0], units])
    for row in rows:
        i, f, g, o = tf.split(tf.matmul(tf.concat([row, h], 1), w) + b, 4, axis=1)
        c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
    return tf.matmul(h, var("out", (units, 10), 0.05))


def _attention(x, var, width: int = 128, heads: int = 4):
    """One transformer block over the image's 32 rows as tokens (multi-head self-attention and a
    feed-forward layer, residuals); logits from the mean token."""
    size = width // heads
    h = tf.reshape(tf.matmul(tf.reshape(x, [-1, 32]), var("embed", (32, width), 0.1)), [-1, width])

    def split(t):   # [batch * 32, width] -> [batch, heads, 32, size]
        return tf.transpose(tf.reshape(t, [-1, 32, heads, size]), [0, 2, 1, 3])

    q, k, v = (split(tf.matmul(h, var(n, (width, width), 0.08))) for n in ("wq", "wk", "wv"))
    attended = tf.matmul(tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / size ** 0.5), v)
    h = h + tf.matmul(tf.reshape(tf.transpose(attended, [0, 2, 1, 3]), [-1, width]),
                      var("wo", (width, width), 0.08))
    h = h + tf.matmul(tf.nn.relu(tf.matmul(h, var("ff1", (width, 4 * width), 0.08))),
                      var("ff2", (4 * width, width), 0.04))
    return tf.matmul(tf.reduce_mean(tf.reshape(h, [-1, 32, width]), axis=1),
                     var("out", (width, 10), 0.08))


# title: (body, batch, learning rate, optimizer)
MODELS = {"wide MLP (1024-2048-2048-10), batch 512": (_wide_mlp, 512, 0.01, "momentum"),
          "CNN (2x conv3x3 + fused BN + pool, 32x32x1), batch 128": (_cnn, 128, 0.001, "momentum"),
          "small MLP (64-64-10, the tests' model), Adam, batch 64": (_small_mlp, 64, 0.01, "adam"),
          "embedding bag (the tests' model), Adam, batch 64": (_embedding, 64, 0.01, "adam"),
          "LSTM (256 units, 32 steps, unrolled), Adam, batch 128": (_lstm, 128, 0.001, "adam"),
          "attention block (4 heads, 128 wide, 32 tokens), momentum, batch 128":
              (_attention, 128, 0.01, "momentum")}
OPTIMIZERS = {"momentum": lambda lr: v1.train.MomentumOptimizer(lr, 0.9),
              "adam": lambda lr: v1.train.AdamOptimizer(lr)}


def build(body, lr: float, optimizer: str = "momentum") -> tf.compat.v1.GraphDef:
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 32, 32, 1], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")

        def var(name, shape, std, mean=0.0):
            return v1.get_variable(name, initializer=(mean + rng.normal(0, std, shape)).astype(np.float32))

        logits = body(x, var)
        tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        OPTIMIZERS[optimizer](lr).minimize(g.get_tensor_by_name("loss:0"), name="train")
        v1.global_variables_initializer()
    return g.as_graph_def()


def to_bfloat16(graph_def):
    converted, report = convert_model(Model.of_graph_def(graph_def, "train.pb"),
                                      Options(target="bfloat16", device="cpu"))
    return converted.graph_def, report


def session_config(grappler_amp: bool) -> config_pb2.ConfigProto:
    """TensorFlow's default session config, with grappler's oneDNN bfloat16 pass on if asked."""
    config = config_pb2.ConfigProto()
    if grappler_amp:
        config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = (
            rewriter_config_pb2.RewriterConfig.ON)
    return config


def session(graph_def, grappler_amp: bool):
    """A Session over ``graph_def``, with grappler's oneDNN bfloat16 pass on if asked."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return v1.Session(graph=g, config=session_config(grappler_amp))


def runtime_ops(graph_def, fetches: list[str], grappler_amp: bool) -> collections.Counter:
    """Each (op, type attrs) of ``graph_def`` after grappler's passes as a :func:`session`'s
    config sets them (constant folding, arithmetic simplification ..., and the bfloat16 pass
    if asked), counted; run by ``OptimizeGraph`` on the unplaced graph, so without the oneDNN
    fusions a session adds once ops are placed on the CPU."""
    meta = meta_graph_pb2.MetaGraphDef(graph_def=graph_def)
    meta.collection_def["train_op"].node_list.value.extend(fetches)
    optimized = tf_optimizer.OptimizeGraph(session_config(grappler_amp), meta)
    return collections.Counter(
        (n.op, tuple(sorted((k, v.type) for k, v in n.attr.items() if v.WhichOneof("value") == "type")))
        for n in optimized.node)


def runtime_difference(ours, fp32, fetches: list[str]) -> int:
    """How many ops (by op and dtypes, :func:`runtime_ops`) differ between our converted graph
    and the FP32 graph with grappler's bfloat16 pass on, both after grappler's passes; 0: the
    same ops in the same dtypes, so any difference in their speed is the machine's noise."""
    ours_only, theirs_only = runtime_delta(ours, fp32, fetches)
    return sum((ours_only + theirs_only).values())


def runtime_delta(ours, fp32, fetches: list[str]) -> tuple[collections.Counter, collections.Counter]:
    """The ops (op and type attrs, :func:`runtime_ops`) only our converted graph runs, and those
    only the FP32 graph with grappler's bfloat16 pass on runs."""
    a, b = runtime_ops(ours, fetches, False), runtime_ops(fp32, fetches, True)
    return a - b, b - a


def delta_text(ours_only: collections.Counter, theirs_only: collections.Counter) -> str:
    """The difference said by op: what amp-rewrite's graph runs in float32 that grappler's
    runs in bfloat16, and the casts grappler's adds."""
    def by_op(counter, dtype):
        ops = collections.Counter()
        for (op, types), n in counter.items():
            if op not in ("Cast", "Const") and any(t == dtype for _, t in types):
                ops[op] += n
        return ", ".join(f"{op} {n}" for op, n in ops.most_common())
    casts = sum(n for (op, _), n in theirs_only.items() if op == "Cast") \
        - sum(n for (op, _), n in ours_only.items() if op == "Cast")
    return (f"in float32 in amp-rewrite's graph and in bfloat16 in grappler's: "
            f"{by_op(ours_only, types_pb2.DT_FLOAT) or 'none'}; grappler's has {casts} casts more")


def time_round_robin(steps: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Call every step function once per round, rotating the order; seconds per call."""
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def bench_model(title: str, body, batch: int, lr: float, optimizer: str, rounds: int,
                warmup: int) -> dict:
    images, labels = _digits(32)
    rng = np.random.default_rng(1)
    feeds = [{"x:0": images[idx], "y:0": labels[idx]}
             for idx in (rng.choice(len(images), batch, replace=False) for _ in range(warmup + rounds))]
    fp32 = build(body, lr, optimizer)
    bf16, report = to_bfloat16(fp32)
    sessions = {"fp32": session(fp32, False), "amp-rewrite": session(bf16, False),
                "grappler": session(fp32, True)}
    for sess in sessions.values():
        sess.run("init")
    counters = {name: iter(feeds) for name in sessions}
    losses = {name: [] for name in sessions}

    def stepper(name):
        def step():
            losses[name].append(sessions[name].run(["loss:0", "train"], next(counters[name]))[0])
        return step

    times = time_round_robin({n: stepper(n) for n in sessions}, rounds, warmup)
    for s in sessions.values():
        s.close()
    median = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    summary = report.summary()
    return {"title": title, "median_ms": median,
            "differ": runtime_difference(bf16, fp32, ["loss", "train"]),
            "last_loss": {n: float(v[-1]) for n, v in losses.items()},
            "first_loss": float(losses["fp32"][0]),
            "converted": f"{summary['matrix_converted']}/{summary['matrix_total']}"}


# the Transformer train-step SavedModel's size: big enough that a bfloat16 matrix unit matters
TRANSFORMER = {"layers": 4, "width": 256, "heads": 4, "seq": 64, "vocab": 512}
TRANSFORMER_BATCH = 16
TRANSFORMER_TITLE = ("Transformer train-step SavedModel (Keras layers: Embedding, 4 x causal + "
                     "padding-masked MultiHeadAttention 4 heads, LayerNormalization, GELU Dense "
                     "256-1024-256; vocab 512, seq 64), Adam, batch 16")


def _load_signature(path: Path, grappler_amp: bool, values: dict[str, np.ndarray]):
    """A TF1 session over a SavedModel's ``train`` signature: (session, input, loss) names.

    The TF1 loader restores a Keras 3 model's variables into copies the functions do not read
    (``Variable_N``; the functions capture handles named by each variable's Keras path), so
    every variable the session left uninitialized is set from ``values`` (path -> value)."""
    g = tf.Graph()
    sess = v1.Session(graph=g, config=session_config(grappler_amp))
    with g.as_default():
        meta = v1.saved_model.loader.load(sess, ["serve"], str(path))
        handles = [op for op in g.get_operations() if op.type == "VarHandleOp"]
        ready = sess.run([tf.raw_ops.VarIsInitializedOp(resource=h.outputs[0]) for h in handles])
        feeds, assigns = {}, []
        for handle, done in zip(handles, ready):
            if done:
                continue
            value = values[handle.get_attr("shared_name").decode()]
            feed = v1.placeholder(tf.as_dtype(value.dtype), value.shape)
            feeds[feed] = value
            assigns.append(tf.raw_ops.AssignVariableOp(resource=handle.outputs[0], value=feed))
        sess.run(assigns, feeds)
    sig = meta.signature_def["train"]
    return sess, sig.inputs["tokens"].name, sig.outputs["loss"].name


def bench_savedmodel(rounds: int, warmup: int) -> dict:
    """The Transformer train step (tests/saved_trainers.py ``Transformer``) as a TF2 SavedModel,
    three ways as :func:`bench_model` runs the TF1 graphs: each SavedModel loaded into a TF1
    session (its variables from the same checkpoint), its ``train`` signature run on the same
    token batches."""
    batches = saved_trainers.token_batches(TRANSFORMER_BATCH, TRANSFORMER["seq"],
                                           TRANSFORMER["vocab"], warmup + rounds)
    with tempfile.TemporaryDirectory() as tmp:
        fp32, ours = Path(tmp) / "fp32", Path(tmp) / "bf16"
        module = saved_trainers.Transformer(0, **TRANSFORMER)
        saved_trainers.save_transformer(module, fp32)
        values = {v.path: v.numpy() for v in module.params + list(module.opt.variables)}
        report = convert_file(fp32, ours, target="bfloat16", device="cpu")
        runs = {"fp32": _load_signature(fp32, False, values),
                "amp-rewrite": _load_signature(ours, False, values),
                "grappler": _load_signature(fp32, True, values)}
        delta = runtime_delta(runs["amp-rewrite"][0].graph.as_graph_def(),
                              runs["fp32"][0].graph.as_graph_def(),
                              [runs["fp32"][2].split(":")[0]])
    counters = {name: iter(batches) for name in runs}
    losses = {name: [] for name in runs}

    def stepper(name):
        sess, inp, out = runs[name]

        def step():
            losses[name].append(sess.run(out, {inp: next(counters[name])}))
        return step

    times = time_round_robin({n: stepper(n) for n in runs}, rounds, warmup)
    for sess, _, _ in runs.values():
        sess.close()
    matrix = [n for n in report.nodes if n.op in MATRIX_OPS]
    return {"title": TRANSFORMER_TITLE,
            "median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "differ": sum((delta[0] + delta[1]).values()), "delta": delta_text(*delta),
            "last_loss": {n: float(v[-1]) for n, v in losses.items()},
            "first_loss": float(losses["fp32"][0]),
            "converted": f"{sum(n.precision == 'bfloat16' for n in matrix)}/{len(matrix)}"}


def table(results: list[dict], rounds: int, warmup: int, measured: str) -> str:
    transformer_delta = next((r["delta"] for r in results if "delta" in r), "(not run)")
    lines = [
        f"{SECTION}\n",
        "One training step (forward, backward, optimizer update), median of "
        f"{rounds} steps after {warmup} warm-up steps, the three variants timed round-robin in one "
        f"process by `benchmarks/train_step.py` ({hardware.describe()}). {measured} "
        "Ratios are FP32 time / variant time (above 1: faster than FP32)."
        + ("" if hardware.onednn_enabled() else " TensorFlow's oneDNN ops were off "
           "(TF_ENABLE_ONEDNN_OPTS), so grappler's bfloat16 pass did not run: its column is FP32.")
        + "\n",
        "| model | MatMul/Conv ops in bf16 | FP32 ms | amp-rewrite bf16 ms (ratio) | "
        "grappler AMP bf16 ms (ratio) | ours / grappler speed | ops that differ at run time | "
        "loss after the run: FP32 / amp-rewrite / grappler |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        m, l = r["median_ms"], r["last_loss"]
        lines.append(
            f"| {r['title']} | {r['converted']} | {m['fp32']:.1f} | {m['amp-rewrite']:.1f} "
            f"({m['fp32'] / m['amp-rewrite']:.2f}x) | {m['grappler']:.1f} ({m['fp32'] / m['grappler']:.2f}x) "
            f"| {m['grappler'] / m['amp-rewrite']:.2f}x | {r['differ']} "
            f"| {l['fp32']:.3f} / {l['amp-rewrite']:.3f} / {l['grappler']:.3f} (first {r['first_loss']:.3f}) |")
    lines.append("\nThe ratios come from steps interleaved in one process, so load from other jobs on "
                 "the machine falls on all three alike; the absolute times are noisy. The MatMul/Conv "
                 "count is amp-rewrite's (forward and backward). bfloat16 needs no loss scaling, so "
                 "neither bfloat16 graph has any. \"Ops that differ at run time\" compares the "
                 "two bfloat16 graphs after grappler's passes (ops and their dtypes, counted; "
                 "`train_step.runtime_difference`; before placement, so without the oneDNN "
                 "fusions a session adds): 0 means the same ops in the same dtypes, so the two "
                 "speeds differ only by the machine's noise. Where amp-rewrite's cost model keeps every MatMul float32 (0 in bf16), its graph runs "
                 "as the FP32 graph does, and its ratio to FP32 is noise too.\n\n"
                 "The Transformer row is a TF2 SavedModel as Keras users write one "
                 "(`tests/saved_trainers.py` `Transformer`: token and position `Embedding`, "
                 "pre-norm blocks of `MultiHeadAttention` under a causal and padding mask, "
                 "`LayerNormalization`, a `Dense` GELU feed-forward layer, next-token softmax "
                 "cross-entropy over the tokens that are not padding, Keras' Adam) with its train "
                 "step saved as the `train` signature, converted by `convert_file(..., "
                 "target=\"bfloat16\", device=\"cpu\")` with default options; each SavedModel "
                 "is loaded into a TF1 session (grappler inlines the signature's function "
                 "bodies, so its bfloat16 pass reaches them) and run on the same token batches "
                 "from the same weights (`benchmarks/train_step.bench_savedmodel`). Its run-time "
                 f"difference (`train_step.runtime_delta`), ops {transformer_delta}: the GELU's "
                 "gradient (Erfc, Neg, a Reshape and some Square and Mul in each of the 4 "
                 "blocks), which amp-rewrite's lists keep float32, and Keras Adam's update (its "
                 "moments' Mul, Sub and Square), which amp-rewrite keeps float32 from the "
                 "gradients to the variable writes (docs/training.md \"Updates in float32\"). "
                 "The cost model "
                 "leaves this model's islands to the lists: Keras' `Dense` on a 3-D input "
                 "flattens it to a shape computed at run time, so its MatMuls' FLOPs per sample "
                 "are not known (the attention's Einsums and the gradients' FLOPs are).")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--only", action="append", default=[],
                        help="run only the models whose title holds this (repeatable)")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    return publish(run(args.steps, args.warmup, args.only), args.write)


def run(steps: int = 40, warmup: int = 5, only=()) -> str:
    """Every model's training step (the TF1 graphs, then the Transformer SavedModel), three
    ways; the section's Markdown. ``only``: the titles holding one of these strings."""
    measured = provenance()   # the load average as it starts
    chosen = [(title, spec) for title, spec in MODELS.items()
              if not only or any(o in title for o in only)]
    results = [bench_model(title, body, batch, lr, optimizer, steps, warmup)
               for title, (body, batch, lr, optimizer) in chosen]
    for r in results:
        print(r, file=sys.stderr, flush=True)
    if not only or any(o in TRANSFORMER_TITLE for o in only):
        results.append(bench_savedmodel(steps, warmup))
        print(results[-1], file=sys.stderr, flush=True)
    return table(results, steps, warmup, measured)


if __name__ == "__main__":
    sys.exit(main())
