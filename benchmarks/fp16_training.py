"""float16 training after conversion against FP32: test accuracy of TF2 train-step SavedModels.

    .venv/bin/python benchmarks/fp16_training.py [--seeds 3] [--steps 300] [--write]

The digits MLP, CNN (batch norm) and LSTM of ``tests/saved_trainers.py``: each saved as a
train-step SavedModel, converted with ``--target float16`` (dynamic loss scaling), and trained
``--steps`` Adam steps beside the FP32 SavedModel on the same batches, per seed; the table gives
the mean and spread (max - min) of the held-out accuracy, and the loss scale's history.
``--write`` puts it in BENCHMARKS.md under "## float16 training" (only that section).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402
import saved_trainers  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402

from amp_rewrite.core import hardware  # noqa: E402

SECTION = "## float16 training"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    measured = provenance()   # the load average as it starts
    rows = []
    for name in saved_trainers.MODELS:
        runs = [saved_trainers.compare(name, seed, args.steps) for seed in range(args.seeds)]
        fp32, half = (np.array([getattr(r, k) for r in runs]) for k in ("fp32", "float16"))
        history = "; ".join(", ".join(f"{s}: {v:g}" for s, v in r.scale_history)
                            + f" ({r.skipped} skipped)" for r in runs)
        # the same accuracy could hide an unconverted model: say what ran in float16 and how
        # far the two trainings went apart
        rows.append(f"| {name} | {'/'.join(str(r.float16_matrix_ops) for r in runs)} | "
                    f"{100 * fp32.mean():.2f} ({100 * np.ptp(fp32):.2f}) | "
                    f"{100 * half.mean():.2f} ({100 * np.ptp(half):.2f}) | "
                    f"{100 * (half.mean() - fp32.mean()):+.2f} | "
                    f"{'/'.join(str(r.disagreements) for r in runs)} | "
                    f"{max(r.weight_difference for r in runs):.2g} | {history} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        SECTION, "",
        f"`benchmarks/fp16_training.py`: TF2 train-step SavedModels of the digits data set "
        f"(`tests/saved_trainers.py`), converted with `--target float16` (dynamic loss scaling), "
        f"trained {args.steps} Adam steps (batch 64) beside the FP32 SavedModel on the same "
        f"batches, {args.seeds} seeds each; accuracy on the 397 held-out digits, mean (spread) in "
        f"percent. {measured} TensorFlow's float16 CPU kernels ({hardware.describe()}), so this "
        "checks the numbers, not the speed.", "",
        "| model | train step's MatMul/Conv in float16, per seed | FP32 accuracy | float16 "
        "accuracy | difference (points) | held-out predictions that differ, per seed | largest "
        "weight difference after training | loss scale per seed (step: value) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        "`tests/test_saved_training.py` runs the same comparison (3 seeds, 300 steps) and "
        "requires the means within 1 point; with every op kept float32 and the scaling added, "
        "the converted CNN and LSTM train bit for bit like the originals.", ""])
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
