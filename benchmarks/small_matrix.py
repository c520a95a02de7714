"""Where a bfloat16 MatMul on this CPU starts to pay for its casts: the basis of the default
``--min-matrix-intensity`` (docs/decisions.md "Small matrix ops stay float32").

For each width w: 8 blocks of ``h = relu(h @ W) + h`` with W of w×w (matrix intensity w), batch
256, in float32, and with each MatMul in bfloat16 between casts (its float32 neighbours stay
float32: the worst case for a lone small op). The two graphs run interleaved in one process;
the ratio is float32 time over bfloat16 time (above 1: bfloat16 is faster).

Run: ``.venv/bin/python benchmarks/small_matrix.py --write``
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
SECTION = "## Small matrix ops"


def graph(width: int, bf16: bool, depth: int = 8, batch: int = 256) -> tf.Graph:
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        h = v1.placeholder(tf.float32, [batch, width], name="x")
        for _ in range(depth):
            w = tf.constant(r.normal(0, 0.1, (width, width)).astype(np.float32))
            y = (tf.cast(tf.matmul(tf.cast(h, tf.bfloat16), tf.cast(w, tf.bfloat16)), tf.float32)
                 if bf16 else tf.matmul(h, w))
            h = tf.nn.relu(y) + h
        tf.identity(h, name="out")
    return g


def measure(width: int, rounds: int) -> float:
    sessions = {k: v1.Session(graph=graph(width, k == "bf16")) for k in ("f32", "bf16")}
    feed = {"x:0": np.random.default_rng(1).normal(size=(256, width)).astype(np.float32)}
    times = {k: [] for k in sessions}
    for i in range(rounds + 10):
        for k in (("f32", "bf16") if i % 2 else ("bf16", "f32")):
            start = time.perf_counter()
            sessions[k].run("out:0", feed)
            if i >= 10:
                times[k].append(time.perf_counter() - start)
    return statistics.median(times["f32"]) / statistics.median(times["bf16"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 48, 64, 96, 128, 256, 512, 1024])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    rows = []
    for width in args.widths:
        rows.append((width, measure(width, args.rounds)))
        print(width, f"{rows[-1][1]:.2f}", flush=True)
    text = "\n".join([
        f"{SECTION}\n",
        "`benchmarks/small_matrix.py`: 8 blocks of `h = relu(h @ W) + h`, W of width×width (matrix "
        "intensity = width FLOPs per element moved), batch 256; float32 against each MatMul alone in "
        f"bfloat16 between casts, {args.rounds} runs each interleaved in one process, on "
        f"{platform.machine()} with {os.cpu_count()} cores ({hardware.describe()}), TensorFlow "
        f"{tf.__version__}. Ratio: float32 median time over bfloat16's (above 1: bfloat16 faster). "
        "A lone bfloat16 MatMul starts to pay where the ratio crosses 1; the default "
        "`--min-matrix-intensity` for bfloat16 on a CPU, 128, sits above that crossing with a "
        "margin, because a whole training step of 64-wide layers gains nothing in bfloat16 "
        "(the small MLP under \"Training step\").\n",
        "| width = matrix intensity | float32 / bfloat16 time |",
        "| --- | --- |",
        *(f"| {w} | {r:.2f}x |" for w, r in rows)]) + "\n"
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
