"""Build, save, convert and train a TF2 train-step SavedModel in float16.

    .venv/bin/python examples/train_step_savedmodel.py [--steps 300] [--folder DIR]

1. A ``tf.Module`` holds a 64-128-10 classifier of the digits data set and a Keras Adam
   optimizer; its ``train_step`` tf.function computes a GradientTape and applies the gradients.
   ``tf.saved_model.save`` writes it with a serving and a training signature.
2. ``amp-rewrite`` converts it for float16 (dynamic loss scaling is the default).
3. ``tf.saved_model.load`` brings the converted model back; its ``train_step`` runs the
   matrix work in float16, keeps the variables float32 and keeps the loss scale in
   ``loaded.amp_loss_scale``; training prints the loss and the scale's history, then the test
   accuracy of the FP32 original trained the same way beside the converted model's.

No model code runs after step 1: the converted model trains from the SavedModel alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


class Classifier(tf.Module):
    """64-128-10 with Keras' Adam (``optimizer="sgd"``: SGD with momentum 0.9)."""

    def __init__(self, seed: int = 0, optimizer: str = "adam"):
        super().__init__()
        r = np.random.default_rng(seed)
        self.w1 = tf.Variable(r.normal(0, 0.12, (64, 128)).astype(np.float32), name="w1")
        self.b1 = tf.Variable(np.zeros(128, np.float32), name="b1")
        self.w2 = tf.Variable(r.normal(0, 0.09, (128, 10)).astype(np.float32), name="w2")
        self.b2 = tf.Variable(np.zeros(10, np.float32), name="b2")
        self.opt = (keras.optimizers.Adam(3e-3) if optimizer == "adam"
                    else keras.optimizers.SGD(0.1, momentum=0.9))
        self.opt.build(self.params)

    @property
    def params(self):
        return [self.w1, self.b1, self.w2, self.b2]

    def logits(self, x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, self.w1) + self.b1), self.w2) + self.b2

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, self.logits(x)))
        self.opt.apply_gradients(zip(tape.gradient(loss, self.params), self.params))
        return loss

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def serve(self, x):
        return {"logits": self.logits(x)}


def train(model, x, y, steps: int, watch=None) -> list[float]:
    rng = np.random.default_rng(1)
    losses = []
    for step in range(steps):
        idx = rng.choice(len(x), 64, replace=False)
        losses.append(float(model.train_step(x[idx], y[idx])))
        if watch is not None:
            watch(step)
    return losses


def accuracy(model, x, y) -> float:
    logits = model.signatures["serving_default"](x=tf.constant(x))["logits"].numpy()
    return float(np.mean(np.argmax(logits, 1) == y))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--folder", help="where to write the models (default: a temporary one)")
    args = parser.parse_args(argv)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="amp_train_step_"))
    fp32, f16 = folder / "fp32", folder / "f16"

    module = Classifier()
    tf.saved_model.save(module, str(fp32), signatures={"serving_default": module.serve,
                                                       "train": module.train_step})
    subprocess.run([sys.executable, "-m", "amp_rewrite", str(fp32), "-o", str(f16), "--force"],
                   check=True)

    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)
    (train_x, train_y), (test_x, test_y) = (x[:1400], y[:1400]), (x[1400:], y[1400:])
    loaded = tf.saved_model.load(str(f16))
    scale = loaded.amp_loss_scale
    history = [(0, float(scale.scale.numpy()))]

    def watch(step):
        if float(scale.scale.numpy()) != history[-1][1]:
            history.append((step + 1, float(scale.scale.numpy())))

    losses = train(loaded, train_x, train_y, args.steps, watch)
    reference = tf.saved_model.load(str(fp32))
    ref_losses = train(reference, train_x, train_y, args.steps)
    print(f"loss, float16 after conversion: {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"FP32: {ref_losses[0]:.3f} -> {ref_losses[-1]:.3f}")
    print("loss scale (step: value): " + ", ".join(f"{s}: {v:g}" for s, v in history)
          + f"; skipped steps {int(scale.skipped_steps.numpy())}")
    print(f"test accuracy, float16 after conversion: {accuracy(loaded, test_x, test_y):.3f}; "
          f"FP32: {accuracy(reference, test_x, test_y):.3f}")
    print(f"variables: {', '.join(f'{v.name} {v.dtype.name}' for v in (loaded.w1, loaded.w2))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
