"""Build the bundled example: a small FP32 CNN classifier for 8x8 digits, frozen to a GraphDef.

Run ``python examples/make_example.py`` to regenerate ``examples/cnn_fp32.pb`` (and a
``.pbtxt`` twin); the weights come from a fixed seed, so the file is the same every time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

v1 = tf.compat.v1
HERE = Path(__file__).resolve().parent


def build() -> tf.compat.v1.GraphDef:
    r = np.random.default_rng(0)

    def const(shape, scale, name):
        return tf.constant(r.normal(0, scale, shape).astype(np.float32), name=name)

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
        with tf.name_scope("block1"):
            y = tf.nn.conv2d(x, const((3, 3, 1, 32), 0.3, "kernel"), 1, "SAME", name="conv")
            y = tf.raw_ops.FusedBatchNormV3(
                x=y, scale=tf.ones([32]), offset=const((32,), 0.1, "beta"),
                mean=const((32,), 0.1, "mean"), variance=tf.ones([32]), is_training=False,
                name="bn")[0]
            y = tf.nn.relu(y, name="relu")
        with tf.name_scope("block2"):
            y = tf.nn.conv2d(y, const((3, 3, 32, 64), 0.06, "kernel"), 1, "SAME", name="conv")
            y = tf.nn.bias_add(y, const((64,), 0.1, "bias"), name="bias")
            y = tf.nn.relu(y, name="relu")
            y = tf.nn.max_pool2d(y, 2, 2, "VALID", name="pool")
        with tf.name_scope("head"):
            y = tf.reshape(y, [-1, 4 * 4 * 64], name="flatten")
            y = tf.nn.relu(tf.matmul(y, const((1024, 128), 0.03, "w1"), name="fc1"), name="relu")
            logits = tf.nn.bias_add(tf.matmul(y, const((128, 10), 0.1, "w2"), name="fc2"),
                                    const((10,), 0.1, "b2"), name="logits")
        tf.nn.softmax(logits, name="probabilities")
    return g.as_graph_def()


def main() -> int:
    gd = build()
    (HERE / "cnn_fp32.pb").write_bytes(gd.SerializeToString(deterministic=True))
    print(f"wrote {HERE / 'cnn_fp32.pb'} ({len(gd.node)} nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
