"""How the batch moves the worth of bfloat16 on a CPU for SavedModels, whose weights are
variables cast on every run: FP32, painted whole, and amp-rewrite's conversion told the batch
with ``--shape``, at several batches, in one run.

A SavedModel casts each variable weight to bfloat16 once a run, whatever the batch, while its
matrix ops save time per sample: small batches pay the casts for few samples. The cost model
(``amp_rewrite.paint.costs.runtime_estimate``) weighs the two with the batch ``--shape`` gives
(else ``DEFAULT_BATCH``). For each model of ``benchmarks/savedmodels.py`` and each batch (Xception's up to
32: its convolutions are slow on 2 cores), this converts the FP32 SavedModel twice, painted whole
(``min_matrix_intensity=0``) and with ``shapes={input: (batch, ...)}``, and times FP32 and
both in TF1 sessions round-robin (``--rounds`` rounds after a warm-up run, medians). The table
gives FP32 time / variant time, and how many matrix ops the cost model painted at that batch:
where painting whole is slower than FP32 the cost model should keep float32, and where it is
faster it should paint.

Run: ``.venv/bin/python benchmarks/batch_sizes.py [--rounds 15] [--batch 1 --batch 8 ...]
[--write]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402
from savedmodels import _feed, _load, input_key, models  # noqa: E402
from train_step import time_round_robin  # noqa: E402

from amp_rewrite import convert_file  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402
from amp_rewrite.paint.costs import DEFAULT_BATCH  # noqa: E402

SECTION = "## Batch size and weight casts"
BATCHES = (1, 4, 16, 64, 128, 256)
# convolutional models are slow to sweep on 2 cores: their batches stop at 32
IMAGE_BATCHES = (1, 2, 8, 32)


def _sample_shape(kind: str) -> tuple[int, ...]:
    """One sample's shape for an input kind of savedmodels.models(): 'tokens', 'features', or
    'images' and the side ('images71': 71x71x3), as savedmodels._feed makes them."""
    if kind in ("tokens", "features"):
        return (64,)
    size = int(kind.removeprefix("images"))
    return (size, size, 3)


def measure(build, kind: str, batches, rounds: int) -> list[dict]:
    """One row per batch: medians in ms, and the matrix ops the cost model painted."""
    import keras
    keras.utils.set_random_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fp32, painted = Path(tmp) / "fp32", Path(tmp) / "painted"
        build().export(str(fp32), verbose=False)
        convert_file(fp32, painted, target="bfloat16", device="cpu", min_matrix_intensity=0)
        sessions = {"fp32": _load(fp32, False), "painted": _load(painted, False)}
        key = input_key(fp32)
        for batch in batches:
            ours = Path(tmp) / f"ours{batch}"
            report = convert_file(fp32, ours, target="bfloat16", device="cpu",
                                  shapes={key: (batch, *_sample_shape(kind))})
            matrix = [n for n in report.nodes if n.op in MATRIX_OPS]
            runs = {**sessions, "ours": _load(ours, False)}
            value = _feed(kind, batch)
            times = time_round_robin({k: functools.partial(s.run, o, {i: value})
                                      for k, (s, i, o) in runs.items()}, rounds, warmup=1)
            runs["ours"][0].close()
            med = {k: statistics.median(v) * 1000 for k, v in times.items()}
            rows.append({"batch": batch, **{f"{k}_ms": v for k, v in med.items()},
                         "matrix": f"{sum(n.precision == 'bfloat16' for n in matrix)}/{len(matrix)}"})
            print(rows[-1], file=sys.stderr, flush=True)
        for s, _, _ in sessions.values():
            s.close()
    return rows


def run(rounds: int, batches, only=()) -> str:
    lines = [SECTION, "",
             "`benchmarks/batch_sizes.py`: Keras SavedModels of `benchmarks/savedmodels.py` "
             "(weights in variables, cast to bfloat16 once a run) at several batches: FP32, "
             "painted whole (`--min-matrix-intensity 0`), and amp-rewrite's default conversion "
             "told the batch (`--shape NAME=BATCH,...`), each in a TF1 session, round-robin in one "
             f"process, {rounds} rounds after a warm-up run, medians ({hardware.describe()}). "
             f"{provenance()} Ratios are FP32 time / variant time (above 1: faster "
             "than FP32); \"painted by the cost model\" counts its MatMul/Conv ops in bfloat16.",
             "",
             "| model | batch | FP32 ms | painted whole ms (ratio) | amp-rewrite with --shape ms "
             "(ratio) | painted by the cost model |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, (build, kind) in models().items():
        if only and not any(o in name for o in only):
            continue
        for r in measure(build, kind, batches or (IMAGE_BATCHES if kind.startswith("images") else BATCHES), rounds):
            lines.append(f"| {name} | {r['batch']} | {r['fp32_ms']:.2f} | {r['painted_ms']:.2f} "
                         f"({r['fp32_ms'] / r['painted_ms']:.2f}x) | {r['ours_ms']:.2f} "
                         f"({r['fp32_ms'] / r['ours_ms']:.2f}x) | {r['matrix']} |")
    lines += ["", "The cost model's column is the decision to check against the painted-whole "
              "ratio: at a batch where painting whole runs slower than FP32 it should paint "
              "nothing (its graph is then the FP32 one, and its ratio is 1 within the noise of "
              "this shared machine), where painting whole gains it should paint. Without "
              f"`--shape`, an open batch counts as {DEFAULT_BATCH} "
              "(`amp_rewrite/paint/costs.py` DEFAULT_BATCH; docs/decisions.md \"The batch the "
              "cost model assumes\")."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--batch", type=int, action="append", default=[])
    p.add_argument("--only", action="append", default=[], help="model names to run")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    return publish(run(args.rounds, args.batch, args.only), args.write)


if __name__ == "__main__":
    sys.exit(main())
