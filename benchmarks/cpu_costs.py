"""What a bfloat16 op costs or saves on this CPU against float32: the basis of the runtime cost
model (:mod:`amp_rewrite.paint.costs`, docs/decisions.md "Small matrix ops stay float32").

Matrix ops save time in proportion to their FLOPs; an elementwise op whose bfloat16 kernel is
slower than its float32 one (TensorFlow's CPU kernels for most activations are Eigen loops, not
oneDNN's, unless the remapper fuses them into a convolution) costs time in proportion to the
elements it writes. Each op runs on a tensor computed in the graph (a Cast of the input), once in
float32 and once in bfloat16, the same graph without the op timed beside it and subtracted;
``rounds`` runs each, interleaved in one process, medians. The result is picoseconds saved per
FLOP (matrix ops) and picoseconds lost per element (elementwise ops, negative: bfloat16 faster).

Run: ``.venv/bin/python benchmarks/cpu_costs.py --write``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import publish  # noqa: E402

from amp_rewrite.core import hardware  # noqa: E402

v1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Op costs in bfloat16 on this CPU"
SHAPE = (8, 56, 56, 144)   # a MobileNetV2 expansion's activations at batch 8
N = int(np.prod(SHAPE))


def _filter(shape, dt):
    return tf.constant(np.random.default_rng(0).normal(0, 0.1, shape).astype(np.float32), dt)


# name -> (function of (x, dtype), its FLOPs on SHAPE)
MATRIX = {
    "Conv2D 1x1, 144 -> 144": (lambda x, dt: tf.nn.conv2d(x, _filter((1, 1, 144, 144), dt), 1, "SAME"), 2 * 144 * N),
    "Conv2D 3x3, 144 -> 144": (lambda x, dt: tf.nn.conv2d(x, _filter((3, 3, 144, 144), dt), 1, "SAME"), 2 * 9 * 144 * N),
    "DepthwiseConv2dNative 3x3": (lambda x, dt: tf.nn.depthwise_conv2d(
        x, _filter((3, 3, 144, 1), dt), [1, 1, 1, 1], "SAME"), 2 * 9 * N),
    "MatMul 144 -> 576": (lambda x, dt: tf.matmul(tf.reshape(x, [-1, 144]), _filter((144, 576), dt)), 2 * 144 * 576 * N // 144),
}
ELEMENTWISE = {
    "Relu": lambda x, dt: tf.nn.relu(x),
    "Relu6": lambda x, dt: tf.nn.relu6(x),
    "Elu": lambda x, dt: tf.nn.elu(x),
    "Selu": lambda x, dt: tf.nn.selu(x),
    "LeakyRelu": lambda x, dt: tf.nn.leaky_relu(x),
    "Sigmoid": lambda x, dt: tf.sigmoid(x),
    "Tanh": lambda x, dt: tf.tanh(x),
    "Softplus": lambda x, dt: tf.nn.softplus(x),
    "Erf": lambda x, dt: tf.math.erf(x),
    "Exp": lambda x, dt: tf.exp(x),
    "Mul (per-channel vector)": lambda x, dt: x * _filter((144,), dt),
    "AddV2 (per-channel vector)": lambda x, dt: x + _filter((144,), dt),
    "AddV2 (two tensors)": lambda x, dt: x + tf.nn.relu(x),
    "BiasAdd": lambda x, dt: tf.nn.bias_add(x, _filter((144,), dt)),
}


def graph(fn, dt) -> tf.Graph:
    """``out`` = fn(cast(x)), ``base`` = the cast alone, each summed over a slice so that
    fetching costs nothing."""
    g = tf.Graph()
    with g.as_default():
        x = tf.cast(v1.placeholder(tf.float32, SHAPE, name="x"), dt)
        y = x if fn is None else fn(x, dt)
        tf.identity(tf.reduce_sum(tf.cast(tf.reshape(y, [-1])[:8], tf.float32)), name="out")
    return g


def measure(fn, rounds: int) -> dict[str, float]:
    """Median seconds of the op alone (graph minus its base), float32 and bfloat16."""
    runs = {(k, dt): v1.Session(graph=graph(f, dt))
            for k, f in (("op", fn), ("base", None)) for dt in (tf.float32, tf.bfloat16)}
    feed = {"x:0": np.random.default_rng(1).normal(size=SHAPE).astype(np.float32)}
    times = {k: [] for k in runs}
    keys = list(runs)
    for i in range(rounds + 3):
        for k in keys[i % 4:] + keys[:i % 4]:
            start = time.perf_counter()
            runs[k].run("out:0", feed)
            if i >= 3:
                times[k].append(time.perf_counter() - start)
    for s in runs.values():
        s.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {dt.name: med[("op", dt)] - med[("base", dt)] for dt in (tf.float32, tf.bfloat16)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    elements = float(np.prod(SHAPE))
    rows = []
    for name, (fn, flops) in MATRIX.items():
        t = measure(fn, args.rounds)
        saved = (t["float32"] - t["bfloat16"]) / flops * 1e12
        rows.append((name, t, f"saves {saved:.2f} ps per FLOP"))
        print(rows[-1], flush=True)
    for name, fn in ELEMENTWISE.items():
        t = measure(fn, args.rounds)
        lost = (t["bfloat16"] - t["float32"]) / elements * 1e12
        rows.append((name, t, f"costs {lost:.0f} ps per element"))
        print(rows[-1], flush=True)
    text = "\n".join([
        f"{SECTION}\n",
        f"`benchmarks/cpu_costs.py`: each op alone on a {'x'.join(map(str, SHAPE))} tensor "
        "computed in the graph, in float32 and in bfloat16, less the same graph without it, "
        f"{args.rounds} runs each interleaved in one process, medians, on {platform.machine()} "
        f"with {os.cpu_count()} cores ({hardware.describe()}), TensorFlow {tf.__version__}. "
        "Matrix ops: time saved per FLOP; elementwise ops: time bfloat16 adds per element it "
        "writes (negative: bfloat16 is faster). The cost model's constants "
        "(`amp_rewrite/costs.py`) come from this table.\n",
        "| op | float32 ms | bfloat16 ms | per unit |",
        "| --- | --- | --- | --- |",
        *(f"| {n} | {t['float32'] * 1e3:.2f} | {t['bfloat16'] * 1e3:.2f} | {u} |" for n, t, u in rows)]) + "\n"
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
