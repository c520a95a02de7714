"""float16 GAN training after conversion against FP32: the DCGAN tutorial's two-tape step.

    .venv/bin/python benchmarks/gan_training.py [--seeds 3] [--steps 1000] [--last 200] [--write]

The GAN of ``tests/gan_steps.py`` (one ``train_step`` with a generator tape and a
discriminator tape, two Adam optimizers, on the 8x8 digits) saved as a SavedModel, converted
with ``--target float16`` (dynamic loss scaling: one scale, one check over both tapes), and
trained ``--steps`` steps beside the FP32 SavedModel from the same start on the same batches and
noise, once per seed. Each run's generator and discriminator losses are averaged over its last
``--last`` steps; the table gives the mean and spread (max - min) over the seeds, and the steps
the loss scale skipped. Twice: with the default scale, and with one that grows every 25 finite
steps (``--loss-scale-interval 25``), so that it overflows and skips the whole step again and
again. ``--write`` puts it in BENCHMARKS.md under "## float16 GAN training" (only that section).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import gan_steps  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402

from amp_rewrite.core import hardware  # noqa: E402

SECTION = "## float16 GAN training"
SETTINGS = {"default scale (start 2^15, x2 after 2000 finite steps)": {},
            "scale grown every 25 finite steps": {"loss_scale_options": {"interval": 25}}}


def _row(name: str, runs: list, last: int) -> str:
    fp32 = np.array([r.final("fp32", last) for r in runs])
    half = np.array([r.final("float16", last) for r in runs])
    spread = np.ptp(fp32, axis=0)
    inside = np.abs(half.mean(0) - fp32.mean(0)) <= spread
    cells = [f"{fp32[:, i].mean():.4f} ({spread[i]:.4f}) | {half[:, i].mean():.4f} "
             f"({np.ptp(half[:, i]):.4f}) | {'yes' if inside[i] else 'no'}" for i in (0, 1)]
    skipped = ", ".join(str(r.skipped) for r in runs)
    return f"| {name} | {cells[0]} | {cells[1]} | {skipped} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--last", type=int, default=200)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    measured = provenance()   # the load average as it starts
    rows, skipped, started = [], [], time.perf_counter()
    for name, options in SETTINGS.items():
        folder = Path(tempfile.mkdtemp(prefix="amp_gan_bench_"))
        gan_steps.convert(folder, **options)
        models = gan_steps.load(folder)
        runs = [gan_steps.compare(folder, seed, args.steps, models) for seed in range(args.seeds)]
        rows.append(_row(name, runs, args.last))
        skipped.append(np.mean([r.skipped for r in runs]))
        print(rows[-1], flush=True)
    minutes = (time.perf_counter() - started) / 60
    text = "\n".join([
        SECTION, "",
        f"`benchmarks/gan_training.py`: the GAN train step of TensorFlow's DCGAN tutorial (one "
        f"`tf.function`, a generator tape and a discriminator tape, two Adam optimizers; "
        f"`tests/gan_steps.py`) on the 8x8 digits, saved as a SavedModel, converted with "
        f"`--target float16` (one loss scale, one check over both tapes), and trained "
        f"{args.steps} steps (batch {gan_steps.BATCH}) beside the FP32 SavedModel from the same "
        f"start on the same batches and noise, {args.seeds} seeds. Each run's losses are "
        f"averaged over its last {args.last} steps; mean (spread, max - min) over the seeds, and "
        f"whether the float16 mean lies within the FP32 spread of the FP32 mean. {measured} "
        f"{minutes:.0f} minutes, on TensorFlow's float16 CPU kernels ({hardware.describe()}), so "
        "this checks the numbers, not the speed.", "",
        "| loss scale | FP32 generator loss | float16 generator loss | within | "
        "FP32 discriminator loss | float16 discriminator loss | within | steps skipped per seed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        f"With the scale grown every 25 finite steps, {skipped[-1]:.0f} of the {args.steps} "
        "steps overflow on average and are skipped whole (neither player moves, the scale "
        f"halves), against {skipped[0]:.0f} with the default scale. "
        "`tests/test_two_tape_steps.py::test_float16_gan_training_tracks_fp32` runs a short "
        "version (3 seeds, 60 steps, the mean of the last 20) and requires both losses within "
        "the FP32 spread.", ""])
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
