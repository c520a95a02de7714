"""Every benchmark model in one run: FP32, amp-rewrite's bfloat16 and grappler's own bfloat16 pass.

The training steps (``train_step.py``: MLP, CNN, LSTM, attention; Adam and momentum) and then
the Keras models (``keras_models.py``: ResNet50, MobileNetV2, DenseNet121, EfficientNetB0,
ConvNeXtTiny, a BERT-style encoder; with conversion time and peak memory beside grappler's),
each three ways round-robin in this one process. ``TF_ENABLE_ONEDNN_OPTS=1`` is set before
TensorFlow starts, so grappler's bfloat16 pass runs on CPUs without AVX-512 too. ``--write``
replaces both sections of BENCHMARKS.md.

Run: ``.venv/bin/python benchmarks/models.py [--steps 40] [--rounds 7] [--write]`` (about 25
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras_models  # noqa: E402
import train_step  # noqa: E402
from benchmd import publish  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed training steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed training steps first")
    p.add_argument("--rounds", type=int, default=7, help="timed inference rounds per Keras model")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    code = publish(train_step.run(args.steps, args.warmup), args.write)
    return publish(keras_models.run(args.rounds), args.write) or code


if __name__ == "__main__":
    sys.exit(main())
