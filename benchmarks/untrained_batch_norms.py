"""Why grappler's bfloat16 painting of an untrained MobileNetV2 runs faster than float32 while
amp-rewrite keeps it float32: the batch norms, not the convolutions.

Keras' ``weights=None`` MobileNetV2, frozen at batch 8, has batch norms with offset 0, mean 0 and
variance 1: each is a Mul by ``1/sqrt(1 + 0.001)`` = 0.9995 and nothing else (constant folding
removes the add of zeros, so no bias follows a convolution and no Relu6 fuses). In bfloat16,
0.9995 rounds to exactly 1.0, and grappler's arithmetic optimizer drops a Mul by ones: the
painted graph loses the 17 Muls after its depthwise convolutions (float32 keeps them; those
after a ``Conv2D`` are folded into its filter in both). The same model with every variance set
to 0.9 (a scale of 1.054, which bfloat16 keeps) has the same structure, the same unfused Relu6
and convolutions, and no such Mul to drop. Each variant runs four ways round-robin in one
process: FP32, amp-rewrite's default conversion, painted whole (``--min-matrix-intensity 0``)
and grappler's ``auto_mixed_precision_onednn_bfloat16``; medians. The Mul count is that of the
graph grappler's passes leave (``train_step.runtime_ops``, before oneDNN's fusions).

Run: ``.venv/bin/python benchmarks/untrained_batch_norms.py [--rounds 15] [--write]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import publish  # noqa: E402
from keras_models import freeze  # noqa: E402
from train_step import runtime_ops, session, time_round_robin  # noqa: E402

from amp_rewrite import convert  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402

SECTION = "## Untrained batch norms in bfloat16"
VARIANCES = (1.0, 0.9)


def model(variance: float):
    """MobileNetV2 (224x224, ``weights=None``) with every batch norm's variance ``variance``
    (1.0: as Keras leaves it untrained)."""
    import keras
    keras.utils.set_random_seed(0)
    m = keras.applications.MobileNetV2(weights=None, classifier_activation=None)
    for layer in m.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            layer.set_weights([gamma, beta, mean, np.full_like(var, variance)])
    return m


def _muls(graph_def, out: str, grappler: bool) -> int:
    return sum(n for (op, _), n in runtime_ops(graph_def, [out.split(":")[0]], grappler).items()
               if op == "Mul")


def measure(variance: float, rounds: int) -> dict:
    gd, inp, out, value = freeze(model(variance), "images")
    ours, report = convert(gd, target="bfloat16", device="cpu")
    painted, _ = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    sessions = {"fp32": session(gd, False), "ours": session(ours, False),
                "painted": session(painted, False), "grappler": session(gd, True)}
    times = time_round_robin({k: functools.partial(s.run, out, {inp: value})
                              for k, s in sessions.items()}, rounds, warmup=2)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    matrix = [n for n in report.nodes if n.op in MATRIX_OPS]
    before = {n.name: n for n in gd.node}
    changed = sum(before.get(n.name) != n for n in ours.node) + len(before) - len(ours.node)
    return {"changed": changed, "variance": variance, "scale": 1 / np.sqrt(variance + 1e-3),
            "scale_bf16": float(tf.cast(tf.constant(1 / np.sqrt(variance + 1e-3)), tf.bfloat16)),
            "matrix": f"{sum(n.precision == 'bfloat16' for n in matrix)}/{len(matrix)}",
            "muls": (_muls(gd, out, False), _muls(gd, out, True)), **med}


def run(rounds: int) -> str:
    rows = [measure(v, rounds) for v in VARIANCES]
    lines = [SECTION, "",
             "`benchmarks/untrained_batch_norms.py`: Keras MobileNetV2 (224x224x3, "
             "`weights=None`, batch 8, frozen), its batch norms as Keras leaves them untrained "
             "(variance 1) and with every variance 0.9 (the same structure: offsets 0, so no "
             "bias follows a convolution and every Relu6 runs unfused); FP32, amp-rewrite's "
             "default conversion, painted whole (`--min-matrix-intensity 0`) and grappler's "
             f"bfloat16 pass, round-robin in one process, {rounds} rounds after 2 warm-up "
             f"rounds, medians; on {hardware.describe()}, {os.cpu_count()} cores, TensorFlow "
             f"{tf.__version__}, Python {platform.python_version()}. \"Muls left\": the Mul ops "
             "in the graph grappler's passes leave, FP32 / with its bfloat16 pass. Ratios are "
             "FP32 time / variant time; where amp-rewrite changed no node of the graph, its "
             "ratio is this run's noise.",
             "",
             "| batch norm variance | scale in float32 / bfloat16 | amp-rewrite MatMul/Conv in "
             "bf16 | nodes amp-rewrite changed | Muls left FP32 / grappler | FP32 ms | amp-rewrite ms (ratio) | painted "
             "whole ms (ratio) | grappler ms (ratio) | amp-rewrite / grappler speed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cell = {k: f"{r[k]:.1f} ({r['fp32'] / r[k]:.2f}x)" for k in ("ours", "painted", "grappler")}
        lines.append(f"| {r['variance']} | {r['scale']:.4f} / {r['scale_bf16']:.4f} | "
                     f"{r['matrix']} | {r['changed']} | {r['muls'][0]} / {r['muls'][1]} | {r['fp32']:.1f} | "
                     f"{cell['ours']} | {cell['painted']} | {cell['grappler']} | "
                     f"{r['grappler'] / r['ours']:.2f}x |")
    lines += ["", "With Keras' untrained batch norms grappler's painting drops the Muls whose "
              "scale bfloat16 rounds to 1 and runs faster than float32; with a scale bfloat16 "
              "keeps, painting the same convolutions and Relu6 gains nothing, and amp-rewrite's "
              "float32 runs at grappler's speed. The gap on the untrained model is that "
              "rounding, which no trained network's batch norms (scales spread around their "
              "channels' statistics) give (docs/decisions.md \"Small matrix ops stay float32\")."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    return publish(run(args.rounds), args.write)


if __name__ == "__main__":
    sys.exit(main())
