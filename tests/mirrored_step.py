"""A MirroredStrategy train step over two logical CPUs, as a TF1 MetaGraph, and a run of it.

Run as a script in its own process (TF1 graph mode is process-wide):

    python mirrored_step.py build OUT.meta
    python mirrored_step.py train IN.meta STEPS OVERFLOW_STEP   -> one JSON line per step

``build``: ``tf.compat.v1.distribute.MirroredStrategy`` on ``/cpu:0`` and ``/cpu:1``, an MLP on
mirrored resource variables, each replica fed its own placeholders (``x_0``/``y_0``,
``x_1``/``y_1``), Momentum's ``apply_gradients`` in replica context (its gradients are summed
across the replicas: an AddN on cpu:0, copied back), the step returning the mean loss as
``train_op:0``. ``train``: imports the MetaGraph into a Session with two CPUs, runs the steps
on digits batches, and on ``OVERFLOW_STEP`` feeds replica 1 alone inputs times 1e30; prints per
step whether each replica's weights changed, whether the replicas are bit-identical, the
global steps and (in a converted graph) the loss scale and skipped steps.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

v1 = tf.compat.v1
WEIGHTS = ["w1", "b1", "w2", "b2", "w1/Momentum"]
STATE = ["amp_loss_scale/scale/Read/ReadVariableOp:0",
         "amp_loss_scale/skipped_steps/Read/ReadVariableOp:0"]


def build(path: str) -> None:
    v1.disable_eager_execution()
    g = tf.Graph()
    with g.as_default():
        strategy = v1.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
        xs = [v1.placeholder(tf.float32, [None, 64], name=f"x_{i}") for i in range(2)]
        ys = [v1.placeholder(tf.int32, [None], name=f"y_{i}") for i in range(2)]
        with strategy.scope():
            init = v1.glorot_uniform_initializer(seed=1)
            w1 = v1.get_variable("w1", [64, 32], initializer=init, use_resource=True)
            b1 = v1.get_variable("b1", [32], initializer=v1.zeros_initializer(), use_resource=True)
            w2 = v1.get_variable("w2", [32, 10], initializer=init, use_resource=True)
            b2 = v1.get_variable("b2", [10], initializer=v1.zeros_initializer(), use_resource=True)
            opt = v1.train.MomentumOptimizer(0.1, momentum=0.9)
            step = v1.train.get_or_create_global_step()

        def step_fn():
            # a constant in each replica's graph: pick that replica's placeholders by it
            replica = int(tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group))
            x, y = xs[replica], ys[replica]
            logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            # apply_gradients sums the replicas' gradients: halve each replica's loss
            grads = opt.compute_gradients(loss / 2.0, var_list=[w1, b1, w2, b2])
            with tf.control_dependencies([opt.apply_gradients(grads, global_step=step)]):
                return tf.identity(loss)

        with strategy.scope():
            losses = strategy.extended.call_for_each_replica(step_fn)
            loss = strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)
        tf.identity(loss, name="train_op")
        v1.global_variables_initializer()
        v1.train.export_meta_graph(path, graph=g, clear_devices=False)


def train(path: str, steps: int, overflow_step: int) -> None:
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    g = tf.Graph()
    with g.as_default():
        v1.train.import_meta_graph(path, clear_devices=False)
        reads = {name: [tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(f"{h}:0"),
                                                  dtype=tf.float32)
                        for h in (name, f"{name}/replica_1")] for name in WEIGHTS}
        steps_read = [tf.raw_ops.ReadVariableOp(resource=g.get_tensor_by_name(f"{h}:0"),
                                                dtype=tf.int64)
                      for h in ("global_step", "global_step/replica_1")]
        names = {op.name for op in g.get_operations()}
        state = [s for s in STATE if s.split(":")[0] in names]
        config = v1.ConfigProto(device_count={"CPU": 2})
        with v1.Session(graph=g, config=config) as sess:
            sess.run("init")
            if "amp_loss_scale/init" in names:
                sess.run("amp_loss_scale/init")
            for i in range(steps):
                feed = {}
                for r in range(2):
                    rows = slice(64 * (2 * i + r), 64 * (2 * i + r) + 64)
                    feed[f"x_{r}:0"] = x[rows] * (1e30 if i == overflow_step and r == 1 else 1.0)
                    feed[f"y_{r}:0"] = y[rows]
                before = sess.run(reads)
                loss = sess.run("train_op:0", feed)
                after = sess.run(reads)
                print(json.dumps({
                    "step": i, "loss": float(loss),
                    "changed": [any(not np.array_equal(before[n][r], after[n][r]) for n in WEIGHTS)
                                for r in range(2)],
                    "identical": all(np.array_equal(*after[n]) for n in WEIGHTS),
                    "global_steps": [int(s) for s in sess.run(steps_read)],
                    "state": [float(s) for s in sess.run(state)]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
