"""Training graphs: detection of the backward pass, loss scaling, skipped steps, state variables.

Every graph is a real TF1 training graph (tests/training_graphs.py) trained on scikit-learn's
bundled digits data; the float16 graphs run on TensorFlow's CPU float16 kernels.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from training_graphs import Trainer, batches, build

from amp_rewrite import cli, convert_file
from amp_rewrite.conversion.pipeline import Options, convert_model
from amp_rewrite.core.errors import InputError, UnsupportedGraphError
from amp_rewrite.core.ir import Graph
from amp_rewrite.io.load import Model
from amp_rewrite.training.detect import find_backprop

SCALE = "amp_loss_scale/scale/Read/ReadVariableOp:0"
SKIPPED = "amp_loss_scale/skipped_steps/Read/ReadVariableOp:0"
GOOD = "amp_loss_scale/good_steps/Read/ReadVariableOp:0"
FINITE = "amp_loss_scale/all_finite:0"


def convert(meta, target="float16", loss_scale=None, **scale_options):
    """Convert a training MetaGraphDef in memory; returns ``(converted MetaGraphDef, report)``."""
    model = Model(Path("train.meta"), "metagraph", False, (meta,))
    converted, report = convert_model(model, Options(target=target, device="cpu",
                                                     loss_scale=loss_scale,
                                                     loss_scale_options=scale_options))
    return converted.meta_graph, report


def ops_of(meta, *kinds):
    return [n for n in meta.graph_def.node if n.op in kinds]


def overflow_feed():
    """A real batch with its pixels scaled up: finite in float32, but its float16 gradients,
    times the loss scale, overflow."""
    feed = next(batches(1, seed=7))
    return {"x:0": feed["x:0"] * 300.0, "y:0": feed["y:0"]}


def infinite_feed():
    """A real batch scaled past float16's range (65504): infinite in float16 at any scale."""
    feed = next(batches(1, seed=7))
    return {"x:0": feed["x:0"] * 1e6, "y:0": feed["y:0"]}


def state_without_amp(trainer):
    return {k: v for k, v in trainer.variables().items() if not k.startswith("amp_loss_scale/")}


# ----------------------------------------------------------------- detection
@pytest.mark.parametrize("model,optimizer,resource,backprop,update_ops", [
    ("mlp", "adam", False, "gradients", {"ApplyAdam"}),
    ("mlp", "momentum", True, "tape", {"ResourceApplyMomentum"}),
    ("embedding", "sgd", True, "gradients", {"ResourceScatterAdd", "ResourceApplyGradientDescent"}),
    ("embedding", "sgd", False, "gradients", {"ScatterSub", "ApplyGradientDescent"}),
    ("embedding", "momentum", True, "gradients", {"ResourceSparseApplyMomentum", "ResourceApplyMomentum"}),
    ("mlp", "sgd", True, "manual", {"AssignSubVariableOp"}),
    ("mlp", "sgd", False, "manual", {"AssignSub"}),
])
def test_detection_finds_seed_and_every_update(model, optimizer, resource, backprop, update_ops):
    meta = build(model, optimizer, resource=resource, backprop=backprop)
    out, report = convert(meta)
    found = report.extra["loss_scaling"]
    assert found["mode"] == "dynamic" and found["start"] == 2.0 ** 15
    assert len(found["seeds"]) == 1
    writes = {n.name for n in ops_of(meta, *update_ops)}
    assert {u["name"] for u in found["updates"]} == writes
    assert {u["op"] for u in found["updates"]} == update_ops
    # each update now reads its gradient through the finiteness Switch, in float32
    by_name = {n.name: n for n in out.graph_def.node}
    for name in writes:
        gated = [by_name[i.split(":")[0]] for i in by_name[name].input if not i.startswith("^")
                 and by_name[i.split(":")[0]].op == "Switch"]
        assert gated and all(g.attr["T"].type == tf.float32.as_datatype_enum for g in gated)
    assert found["init_ops"] == ["init"] and found["in_saver"] and found["in_collection"]


def test_user_seed_needs_a_hint():
    meta = build("mlp", "sgd", backprop="grad_ys")
    with pytest.raises(UnsupportedGraphError, match="seed is missing"):
        convert(meta)
    with pytest.raises(UnsupportedGraphError, match="no backprop seed reads the shape of loss"):
        convert(meta, loss="loss")
    out, report = convert(meta, grads=["seed"])
    assert report.extra["loss_scaling"]["seeds"] == ["seed"]
    trainer = Trainer(out)
    losses = trainer.train(60)
    assert losses[-1] < losses[0] / 3 and trainer.fetch(SKIPPED) == [0]


def test_loss_hint_picks_the_seed_of_that_loss():
    meta = build("mlp", "sgd")
    _, report = convert(meta, loss="loss")
    assert report.extra["loss_scaling"]["seeds"] == ["gradients/grad_ys_0"]
    with pytest.raises(UnsupportedGraphError, match="no backprop seed reads the shape of loss"):
        convert(meta, loss="accuracy")


def two_losses(towers: bool):
    """Two losses with a tf.gradients call each: as towers (half a batch each, gradients
    averaged into one update of one weight) or as two models with their own optimizers."""
    g = tf.Graph()
    rng = np.random.default_rng(0)
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        shared = tf.compat.v1.get_variable("w", initializer=rng.normal(0, 0.1, (64, 10)).astype(np.float32))
        pairs = []
        for i, name in enumerate(("a", "b")):
            w = shared if towers else tf.compat.v1.get_variable(
                name, initializer=rng.normal(0, 0.1, (64, 10)).astype(np.float32))
            part = slice(i * 32, (i + 1) * 32) if towers else slice(None)
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y[part], logits=tf.matmul(x[part], w))
            loss = tf.reduce_mean(xent, name=f"loss_{name}")
            pairs.append((tf.gradients(loss, [w])[0], w))
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.5)
        if towers:
            opt.apply_gradients([((pairs[0][0] + pairs[1][0]) / 2, shared)], name="train")
        else:
            tf.group(*[opt.apply_gradients([p]) for p in pairs], name="train")
        tf.compat.v1.global_variables_initializer()
        return tf.compat.v1.train.Saver().export_meta_graph()


def test_separate_train_steps_need_a_hint():
    meta = two_losses(towers=False)
    with pytest.raises(UnsupportedGraphError, match="2 backprop seeds reach separate"):
        convert(meta)
    with pytest.raises(UnsupportedGraphError, match="no backprop seed found"):
        convert(meta, loss="loss_a")      # loss_b's update would go unscaled
    _, report = convert(meta, grads=["gradients/grad_ys_0", "gradients_1/grad_ys_0"])
    assert len(report.extra["loss_scaling"]["updates"]) == 2


def test_towers_sharing_updates_scale_together():
    out, report = convert(two_losses(towers=True))
    assert report.extra["loss_scaling"]["seeds"] == ["gradients/grad_ys_0", "gradients_1/grad_ys_0"]
    trainer = Trainer(out)
    losses = [trainer.sess.run(["loss_a:0", "train"], feed)[0] for feed in batches(40)]
    assert losses[-1] < losses[0] * 0.6 and trainer.fetch(SKIPPED) == [0]
    trainer.sess.run("train", overflow_feed())
    assert trainer.fetch(SKIPPED, SCALE) == [1, 2.0 ** 14]


def test_inference_graph_and_bfloat16_get_no_loss_scaling():
    from graphs import mlp
    graph_def, _, _ = mlp()
    meta = tf.compat.v1.MetaGraphDef(graph_def=graph_def)
    out, report = convert(meta)
    assert "loss_scaling" not in report.extra
    out, report = convert(build("mlp", "sgd"), target="bfloat16")
    assert "loss_scaling" not in report.extra
    assert not [n for n in out.graph_def.node if n.name.startswith("amp_loss_scale/")]


# ----------------------------------------------------------------- training to accuracy
@pytest.mark.parametrize("model,optimizer,resource,steps", [
    ("mlp", "sgd", True, 200),
    ("mlp", "momentum", False, 200),
    ("mlp", "adam", True, 200),
    ("cnn", "sgd", False, 80),
    ("cnn", "momentum", True, 80),
    ("cnn", "adam", True, 80),
])
def test_float16_training_matches_float32_accuracy(model, optimizer, resource, steps):
    meta = build(model, optimizer, resource=resource)
    out, _ = convert(meta)
    half_ops = {n.op for n in out.graph_def.node if n.attr["T"].type == tf.float16.as_datatype_enum}
    assert {"MatMul"} <= half_ops
    if model == "cnn":
        assert {"Conv2DBackpropFilter", "FusedBatchNormGradV3"} <= half_ops
    fp32, fp16 = Trainer(meta), Trainer(out)
    loss32, loss16 = fp32.train(steps), fp16.train(steps)
    assert all(math.isfinite(v) for v in loss16)
    assert fp32.accuracy() > 0.9
    assert abs(fp16.accuracy() - fp32.accuracy()) <= 0.01
    assert fp16.fetch(SKIPPED, SCALE) == [0, 2.0 ** 15]


# ----------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("optimizer,resource", [("adam", True), ("momentum", False), ("adam", False)])
def test_overflow_step_is_skipped_bit_identically(optimizer, resource):
    out, _ = convert(build("mlp", optimizer, resource=resource))
    trainer = Trainer(out)
    trainer.train(5)
    before = state_without_amp(trainer)
    loss, finite = trainer.step(overflow_feed(), FINITE)
    assert not finite
    after = state_without_amp(trainer)
    assert before.keys() == after.keys() and "global_step" in after
    for name in before:
        assert np.array_equal(before[name], after[name]), name
    assert trainer.fetch(SCALE, SKIPPED, GOOD) == [2.0 ** 14, 1, 0]
    losses = trainer.train(30, seed=3)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert trainer.fetch(SKIPPED) == [1] and trainer.variables()["global_step"] == 35


@pytest.mark.parametrize("backprop", ["step_in_group", "all_reduce", "manual"])
def test_skip_covers_grouped_global_step_and_follows_all_reduce(backprop):
    out, report = convert(build("mlp", "sgd" if backprop == "manual" else "adam", backprop=backprop))
    found = report.extra["loss_scaling"]
    by_name = {n.name: n for n in out.graph_def.node}
    if backprop == "all_reduce":
        # the gradients are unscaled and checked after the all-reduce, so replicas agree
        assert found["after_all_reduce"] == 4
        for grad in found["gradients"]:
            assert by_name[grad.split(":")[0]].op == "CollectiveReduceV2"
    elif backprop == "step_in_group":
        assert [by_name[w].op for w in found["gated_writes"]] == ["AssignAddVariableOp"]
    trainer = Trainer(out)
    trainer.train(3)
    before = state_without_amp(trainer)
    trainer.step(overflow_feed())
    after = state_without_amp(trainer)
    assert all(np.array_equal(before[k], after[k]) for k in before) and after["global_step"] == 3
    trainer.train(3)
    assert trainer.variables()["global_step"] == 6 and trainer.fetch(SKIPPED) == [1]


def test_cnn_skip_keeps_everything_but_the_moving_average_the_gradients_wait_on():
    # a start scale of 2^24 makes the float16 gradients of an ordinary batch overflow
    out, _ = convert(build("cnn", "momentum"), start=2.0 ** 24)
    trainer = Trainer(out)
    before = state_without_amp(trainer)
    _, finite = trainer.step(next(batches(1)), FINITE)
    assert not finite and trainer.fetch(SCALE) == [2.0 ** 23]
    after = state_without_amp(trainer)
    changed = sorted(k for k in before if not np.array_equal(before[k], after[k]))
    # the moving mean is updated under control_dependencies(UPDATE_OPS): before the backprop
    # starts, so before the check (README: Skipped steps)
    assert changed == ["bn/moving_mean"]


def test_float32_graph_does_not_skip_the_same_batch():
    meta = build("mlp", "adam")
    trainer = Trainer(meta)
    trainer.train(5)
    before = trainer.variables()["w1"]
    trainer.step(overflow_feed())
    assert not np.array_equal(before, trainer.variables()["w1"])


def test_underflow_needs_loss_scaling():
    # loss x 1e-7 with the learning rate x 1e7: float32 trains as usual, but the float16
    # gradients (about 1e-9) are below float16's smallest subnormal (6e-8) without scaling
    meta = build("mlp", "sgd", loss_factor=1e-7, lr_factor=1e7)
    fp32 = Trainer(meta)
    fp32.train(150)
    unscaled, report = convert(meta, loss_scale="none")
    assert "loss_scaling" not in report.extra
    scaled, _ = convert(meta)
    stuck, learns = Trainer(unscaled), Trainer(scaled)
    start = stuck.variables()["w2"]
    stuck.train(150)
    learns.train(150)
    assert np.array_equal(start, stuck.variables()["w2"])
    assert stuck.accuracy() < 0.5
    assert fp32.accuracy() > 0.9 and abs(learns.accuracy() - fp32.accuracy()) <= 0.01


# ----------------------------------------------------------------- modes
def test_static_scale_stays_and_still_skips_overflow():
    out, report = convert(build("mlp", "momentum"), loss_scale="1024")
    found = report.extra["loss_scaling"]
    assert found["mode"] == "static" and found["start"] == 1024.0
    assert "amp_loss_scale/good_steps" not in {n.name for n in out.graph_def.node}
    trainer = Trainer(out)
    losses = trainer.train(40)
    assert losses[-1] < losses[0] / 2
    trainer.step(infinite_feed())
    assert trainer.fetch(SCALE, SKIPPED) == [1024.0, 1]


def test_dynamic_scale_grows_after_interval_and_never_drops_below_one():
    out, _ = convert(build("mlp", "sgd"), start=2.0, interval=3, factor=4.0)
    trainer = Trainer(out)
    seen = []
    for feed in batches(7):
        trainer.step(feed)
        seen.append(trainer.fetch(SCALE, GOOD))
    assert seen == [[2, 1], [2, 2], [8, 0], [8, 1], [8, 2], [32, 0], [32, 1]]
    low, _ = convert(build("mlp", "sgd"), start=1.0)
    trainer = Trainer(low)
    trainer.step(infinite_feed())
    assert trainer.fetch(SCALE, SKIPPED) == [1.0, 1]


@pytest.mark.parametrize("value,message", [("banana", "--loss-scale"), ("-4", "--loss-scale"),
                                           ("inf", "--loss-scale")])
def test_bad_loss_scale_is_an_input_error(value, message):
    with pytest.raises(InputError, match=message):
        convert(build("mlp", "sgd"), loss_scale=value)


def test_bad_interval_and_factor_are_input_errors():
    with pytest.raises(InputError, match="interval"):
        convert(build("mlp", "sgd"), interval=0)
    with pytest.raises(InputError, match="factor"):
        convert(build("mlp", "sgd"), factor=1.0)


# ----------------------------------------------------------------- state users keep
def test_checkpoint_keeps_scale_and_counters(tmp_path):
    out, _ = convert(build("mlp", "adam"))
    trainer = Trainer(out)
    trainer.train(3)
    trainer.step(overflow_feed())
    with trainer.graph.as_default():   # the Saver works in graph mode only
        path = trainer.saver.save(trainer.sess, str(tmp_path / "ckpt"))
    stored = dict(tf.train.list_variables(path))
    assert {"amp_loss_scale/scale", "amp_loss_scale/skipped_steps", "amp_loss_scale/good_steps"} <= set(stored)
    fresh = Trainer(out)
    assert fresh.fetch(SCALE, SKIPPED) == [2.0 ** 15, 0]
    with fresh.graph.as_default():
        fresh.saver.restore(fresh.sess, path)
    assert fresh.fetch(SCALE, SKIPPED) == [2.0 ** 14, 1]
    assert np.array_equal(fresh.variables()["w1"], trainer.variables()["w1"])


def test_checkpoint_from_before_conversion_restores_with_the_graphs_own_saver(tmp_path, capfd):
    """Resuming: the FP32 run's checkpoint restores into the converted graph without a
    var_list; the loss-scale state it does not hold starts fresh, and the restore says so."""
    meta = build("mlp", "adam")
    original = Trainer(meta)
    original.train(3)
    with original.graph.as_default():
        path = original.saver.save(original.sess, str(tmp_path / "fp32"))
    out, _ = convert(meta)
    resumed = Trainer(out)
    resumed.train(2)
    resumed.step(overflow_feed())
    assert resumed.fetch(SCALE, SKIPPED) == [2.0 ** 14, 1]
    capfd.readouterr()
    with resumed.graph.as_default():
        resumed.saver.restore(resumed.sess, path)
    assert resumed.fetch(SCALE, SKIPPED) == [2.0 ** 15, 0]     # fresh, not the run's
    assert "holds no loss-scale state" in capfd.readouterr().err
    theirs, ours = original.variables(), resumed.variables()
    assert all(np.array_equal(theirs[name], ours[name]) for name in theirs)
    # a checkpoint written after conversion holds the state and restores it, silently
    resumed.step(overflow_feed())
    with resumed.graph.as_default():
        path = resumed.saver.save(resumed.sess, str(tmp_path / "amp"))
        resumed.saver.restore(resumed.sess, path)
    assert resumed.fetch(SCALE, SKIPPED) == [2.0 ** 14, 1]
    assert "loss-scale state" not in capfd.readouterr().err


def test_cli_converts_meta_file_and_refuses_missing_seed(tmp_path, capsys):
    src, dst = tmp_path / "train.meta", tmp_path / "train_amp.meta"
    src.write_bytes(build("mlp", "adam").SerializeToString())
    assert cli.main([str(src), "-o", str(dst), "--device", "cpu", "--loss-scale-interval", "5"]) == 0
    meta = tf.compat.v1.MetaGraphDef.FromString(dst.read_bytes())
    trainer = Trainer(meta)
    trainer.train(6)
    assert trainer.fetch(SCALE) == [2.0 ** 16]

    bad, none = tmp_path / "seedless.meta", tmp_path / "out.meta"
    bad.write_bytes(build("mlp", "sgd", backprop="grad_ys").SerializeToString())
    capsys.readouterr()
    assert cli.main([str(bad), "-o", str(none), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not none.exists()
    assert cli.main([str(bad), "-o", str(none), "--device", "cpu", "--grad", "seed"]) == 0
    named = Trainer(tf.compat.v1.MetaGraphDef.FromString(none.read_bytes()))
    named.train(2)
    assert named.fetch(SCALE, GOOD) == [2.0 ** 15, 2]   # the named seed is scaled and checked


def test_graphdef_input_keeps_init_op_and_saver_nodes(tmp_path):
    meta = build("mlp", "momentum", resource=False)
    src, dst = tmp_path / "train.pb", tmp_path / "train_amp.pb"
    src.write_bytes(meta.graph_def.SerializeToString())
    assert cli.main([str(src), "-o", str(dst), "--device", "cpu", "-q"]) == 0
    graph_def = tf.compat.v1.GraphDef.FromString(dst.read_bytes())
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run("init")
        for feed in batches(3):
            sess.run("train", feed)
        sess.run("train", overflow_feed())
        path = str(tmp_path / "ckpt")
        sess.run("save/control_dependency:0", {"save/Const:0": path})
        assert sess.run([SCALE, SKIPPED]) == [2.0 ** 14, 1]
    stored = dict(tf.train.list_variables(path))
    assert stored["amp_loss_scale/scale"] == [] and "amp_loss_scale/skipped_steps" in stored
    assert tf.train.load_checkpoint(path).get_tensor("amp_loss_scale/scale") == 2.0 ** 14

    # converting the converted graph again is refused: it would scale twice
    again = tmp_path / "twice.pb"
    assert cli.main([str(dst), "-o", str(again), "--device", "cpu", "-q"]) == 2
    assert not again.exists()


# ----------------------------------------------------------------- malformed input
def test_malformed_seed_const_is_an_input_error_naming_it(tmp_path, capsys):
    """A seed Const whose tensor_content does not fit its dtype is the user's input error
    (exit 2, naming the node), not an internal ValueError from reading it."""
    meta = build("mlp", "sgd")
    seed = next(n for n in meta.graph_def.node if n.name == "gradients/grad_ys_0/Const")
    seed.attr["value"].tensor.ClearField("float_val")
    seed.attr["value"].tensor.tensor_content = b"\x00\x00\x80"   # 3 bytes: not one float32
    with pytest.raises(InputError, match="gradients/grad_ys_0/Const"):
        find_backprop(Graph.from_graph_def(meta.graph_def))
    with pytest.raises(InputError, match="gradients/grad_ys_0/Const"):
        convert(meta)
    src, dst = tmp_path / "bad_seed.meta", tmp_path / "out.meta"
    src.write_bytes(meta.SerializeToString())
    capsys.readouterr()
    assert cli.main([str(src), "-o", str(dst), "--device", "cpu"]) == 2
    assert "gradients/grad_ys_0/Const" in capsys.readouterr().err and not dst.exists()


def test_only_the_global_init_op_resets_the_scale():
    """Re-running a local or partial variable initializer (an eval loop resetting its metrics)
    keeps the scale and counters; the global init op still initializes them."""
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        start = np.random.default_rng(0).normal(0, 0.05, [64, 10]).astype(np.float32)
        w = v1.get_variable("w", initializer=start)
        b = v1.get_variable("b", initializer=np.zeros([10], np.float32))
        logits = tf.matmul(x, w) + b
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        v1.metrics.mean(loss, name="loss_metric")                    # local variables
        v1.global_variables_initializer().name  # noqa: B018 ("init")
        v1.local_variables_initializer().name   # noqa: B018 ("init_1")
        v1.variables_initializer([w], name="init_w")                 # a partial group
        meta = v1.train.Saver().export_meta_graph()
    out, report = convert(meta, interval=1)
    assert report.extra["loss_scaling"]["init_ops"] == ["init"]
    assert not any("no init op" in w for w in report.warnings)
    trainer = Trainer(out)
    trainer.sess.run("init_1")
    trainer.train(3)
    grown = [2.0 ** 18, 0, 0]
    assert trainer.fetch(SCALE, SKIPPED, GOOD) == grown
    trainer.sess.run(["init_1", "init_w"])
    assert trainer.fetch(SCALE, SKIPPED, GOOD) == grown
    trainer.sess.run("init")
    assert trainer.fetch(SCALE, SKIPPED, GOOD) == [2.0 ** 15, 0, 0]


# ----------------------------------------------------------------- train steps in functions
def function_train_step():
    """The graph of an outer tf.function calling an inner GradientTape step (``w.assign_sub``):
    the train step lives in a library function, the graph only calls it."""
    w = tf.Variable(tf.random.stateless_normal([16, 4], seed=[1, 2]), name="w")

    @tf.function
    def inner(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    @tf.function
    def outer(x):
        return inner(x)

    return outer.get_concrete_function(tf.TensorSpec([8, 16], tf.float32)).graph.as_graph_def()


def test_train_step_in_a_library_function_is_scaled_inside_it(tmp_path, capsys):
    """An outer tf.function calling an inner GradientTape step, exported as a graph: the
    scaling goes into the inner function, the state comes from the graph through the outer
    one (both gain three resource inputs), and the graph's call reads the new variables."""
    graph_def = function_train_step()
    [step_fn] = [f.signature.name for f in graph_def.library.function if "inner" in f.signature.name]
    model, report = convert_model(Model.of_graph_def(graph_def, tmp_path / "step.pb"),
                                  Options(device="cpu", target="float16"))
    found = report.extra["loss_scaling"]
    assert found["functions"] == [step_fn] and found["gated_writes"] == 1
    assert found["variables"] == [f"amp_loss_scale/{n}" for n in ("scale", "skipped_steps", "good_steps")]
    assert any("run amp_loss_scale/init" in w for w in report.warnings)   # a bare graph: no init op
    body = {f.signature.name: f for f in model.graph_def.library.function}
    grads = [n for n in body[step_fn].node_def if n.op == "MatMul" and n.name.startswith("gradient_tape/")]
    assert grads and all(n.attr["T"].type == tf.float16.as_datatype_enum for n in grads)
    assert [n.op for n in body[step_fn].node_def if n.name == "AssignSubVariableOp"] == ["If"]
    calls = [n for n in model.graph_def.node if n.op == "StatefulPartitionedCall"]
    assert all(list(c.input[-3:]) == [f"amp_loss_scale/{n}" for n in ("scale", "skipped_steps", "good_steps")]
               for c in calls)
    # and the CLI converts it too
    src, dst = tmp_path / "step.pb", tmp_path / "step_amp.pb"
    src.write_bytes(graph_def.SerializeToString())
    assert cli.main([str(src), "-o", str(dst), "--device", "cpu", "-q"]) == 0
    assert tf.compat.v1.GraphDef.FromString(dst.read_bytes()) == model.graph_def


def _metagraph_with_function_step():
    """A MetaGraph whose variables are the graph's (get_variable, an init op, a Saver) and whose
    train step is a tf.function the graph calls: a GradientTape and assign_sub updates."""
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        r = np.random.default_rng(0)
        w1 = v1.get_variable("w1", initializer=r.normal(0, .15, (64, 64)).astype(np.float32), use_resource=True)
        w2 = v1.get_variable("w2", initializer=r.normal(0, .15, (64, 10)).astype(np.float32), use_resource=True)

        @tf.function
        def step(a, b):
            with tf.GradientTape() as tape:
                logits = tf.matmul(tf.nn.relu(tf.matmul(a, w1)), w2)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(b, logits))
            for var, grad in zip([w1, w2], tape.gradient(loss, [w1, w2])):
                var.assign_sub(0.5 * grad)
            return loss

        tf.identity(step(x, y), name="loss")
        v1.global_variables_initializer()
        return v1.train.Saver().export_meta_graph()


def test_a_metagraph_trains_through_its_function_step_and_skips_overflow(tmp_path):
    v1 = tf.compat.v1
    (tmp_path / "t.meta").write_bytes(_metagraph_with_function_step().SerializeToString())
    report = convert_file(tmp_path / "t.meta", tmp_path / "amp.meta", target="float16", device="cpu")
    found = report.to_dict()["loss_scaling"]
    assert found["init_ops"] == ["init"] and found["in_saver"] and found["in_collection"]
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        saver = v1.train.import_meta_graph(str(tmp_path / "amp.meta"))
        sess.run("init")
        feed = lambda i, k=1.0: {"x:0": x[64 * i:64 * i + 64] * k, "y:0": y[64 * i:64 * i + 64]}  # noqa: E731
        losses = [sess.run("loss:0", feed(i)) for i in range(20)]
        assert losses[-1] < 0.5 * losses[0]
        state = ["amp_loss_scale/scale/Read/ReadVariableOp:0", "amp_loss_scale/skipped_steps/Read/ReadVariableOp:0"]
        assert sess.run(state) == [2.0 ** 15, 0]
        weights = ["w1/Read/ReadVariableOp:0", "w2/Read/ReadVariableOp:0"]
        before = [w.tobytes() for w in sess.run(weights)]
        assert not np.isfinite(sess.run("loss:0", feed(0, 1e30)))
        assert [w.tobytes() for w in sess.run(weights)] == before
        assert sess.run(state) == [2.0 ** 14, 1]
        path = saver.save(sess, str(tmp_path / "ckpt"))
    assert tf.train.load_checkpoint(path).get_tensor("amp_loss_scale/skipped_steps") == 1


def test_forward_pass_in_a_function_still_gets_loss_scaling():
    """tf.gradients through a tf.function puts the backward pass in a library function that
    writes nothing: the graph's own updates train, and are loss-scaled as usual."""
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w = v1.get_variable("w", initializer=np.zeros([64, 10], np.float32))

        @tf.function
        def forward(a, b):
            return tf.matmul(a, b)

        logits = forward(x, w)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        v1.global_variables_initializer().name  # noqa: B018 ("init")
        meta = v1.train.Saver().export_meta_graph()
    assert any(n.name.startswith("gradients/") for f in meta.graph_def.library.function for n in f.node_def)
    out, report = convert(meta)
    assert [u["op"] for u in report.extra["loss_scaling"]["updates"]] == ["ResourceApplyGradientDescent"]
    trainer = Trainer(out)
    losses = trainer.train(20)
    assert losses[-1] < 0.9 * losses[0] and trainer.fetch(SCALE, SKIPPED) == [2.0 ** 15, 0]


def test_seed_search_never_expands_a_splat_const():
    """A splat Const (one listed value and a shape, as tf.fill constants are stored) of 2**40
    ones is read by its listed value, not expanded to terabytes, even where it could be a
    tape's seed (read only by gradient_tape/ nodes)."""
    meta = build("mlp", "sgd")
    plain = find_backprop(Graph.from_graph_def(meta.graph_def))
    big = meta.graph_def.node.add(name="ones", op="Const")
    big.attr["dtype"].type = tf.float32.as_datatype_enum
    tensor = big.attr["value"].tensor
    tensor.dtype = tf.float32.as_datatype_enum
    tensor.tensor_shape.dim.add(size=1 << 20)
    tensor.tensor_shape.dim.add(size=1 << 20)
    tensor.float_val.append(1.0)
    out = meta.graph_def.node.add(name="probe/gradient_tape/Identity", op="Identity", input=["ones"])
    out.attr["T"].type = tf.float32.as_datatype_enum
    found = find_backprop(Graph.from_graph_def(meta.graph_def))
    assert found.seeds == plain.seeds and found.updates == plain.updates
    assert found.gradients == plain.gradients
    # a tape's seed for a vector loss is such a splat (ones of shape [8]): still found
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [8, 16], name="x")
        w = v1.get_variable("w", [16, 4], use_resource=True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.matmul(x, w)), axis=1)
        w.assign_sub(0.1 * tape.gradient(loss, w))
    graph_def = g.as_graph_def()
    [seed] = find_backprop(Graph.from_graph_def(graph_def)).seeds
    value = next(n for n in graph_def.node if n.name == seed).attr["value"].tensor
    assert list(value.float_val) == [1.0] and [d.size for d in value.tensor_shape.dim] == [8]


def test_tape_gradient_sums_outside_the_scope_are_part_of_the_backward_pass():
    """A GradientTape sums a tensor's gradient contributions (here h's, used twice) with an
    AddN outside the gradient_tape/ scope, which the scope reads again (the MatMul gradient
    of w): the gradients are what the updates read, one per update. Unscaling the AddN's terms
    instead would hand the rest of the backward pass unscaled values."""
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        w = v1.get_variable("w", [64, 64], use_resource=True)
        out = v1.get_variable("out", [64, 10], use_resource=True)
        with tf.GradientTape() as tape:
            h = tf.matmul(x, w)
            loss = tf.reduce_mean(tf.matmul(h + tf.nn.relu(h), out), name="loss")
        grads = tape.gradient(loss, [w, out])
        v1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, [w, out]), name="train")
        v1.global_variables_initializer()
        meta = v1.train.export_meta_graph()
    sums = [n.name for n in meta.graph_def.node if n.op == "AddN"
            and not n.name.startswith("gradient_tape/")]
    assert sums, "the tape should sum h's two gradient terms outside its scope"
    _, report = convert(meta)
    found = report.extra["loss_scaling"]
    assert len(found["gradients"]) == len(found["updates"]) == 2
    assert [u["op"] for u in found["updates"]] == ["ResourceApplyGradientDescent"] * 2


# ----------------------------------------------------------------- replicas
def _mirrored(*argv) -> list[dict]:
    script = Path(__file__).parent / "mirrored_step.py"
    proc = subprocess.run([sys.executable, str(script), *map(str, argv)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_mirrored_strategy_replicas_skip_the_same_steps_and_stay_identical(tmp_path):
    """A MirroredStrategy step over two CPUs (a TF1 MetaGraph: TF 2.21 cannot save a TF2 step
    that calls strategy.run), converted to float16: an overflow on replica 1 alone skips the
    step on both replicas (one finiteness check over both replicas' gradients, which the
    replicas then sum), the replicas' weights stay bit-identical, and the step's returned
    loss can still be fetched on the skipped step."""
    _mirrored("build", tmp_path / "mirrored.meta")
    report = convert_file(tmp_path / "mirrored.meta", tmp_path / "amp.meta", target="float16",
                          device="cpu")
    scaling = report.to_dict()["loss_scaling"]
    assert len(scaling["seeds"]) == 2 and len(scaling["gradients"]) == 8
    assert report.summary()["matrix_converted"] == report.summary()["matrix_total"] > 0
    steps = _mirrored("train", tmp_path / "amp.meta", 6, 3)
    assert [s["changed"] for s in steps] == [[True, True]] * 3 + [[False, False]] + [[True, True]] * 2
    assert all(s["identical"] for s in steps)
    assert [s["global_steps"] for s in steps] == [[1, 1], [2, 2], [3, 3], [3, 3], [4, 4], [5, 5]]
    assert [s["state"] for s in steps][2:5] == [[32768.0, 0.0], [16384.0, 1.0], [16384.0, 1.0]]
    assert math.isnan(steps[3]["loss"]) and steps[5]["loss"] < steps[0]["loss"]


def test_a_loss_fetched_after_the_train_op_has_a_value_on_a_skipped_step():
    """``with tf.control_dependencies([train_op]): out = tf.identity(loss)`` waits on the
    updates, which a skipped step does not run: it waits on their join instead."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        w = tf.compat.v1.get_variable("w", initializer=np.full((64, 10), 0.01, np.float32),
                                      use_resource=True)
        logits = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        with tf.control_dependencies([train]):
            tf.identity(loss, name="loss_after")
        tf.compat.v1.global_variables_initializer()
        meta = tf.compat.v1.train.export_meta_graph()
    out, _ = convert(meta)
    trainer = Trainer(out)
    feed = next(batches(1))
    assert np.isfinite(trainer.sess.run("loss_after:0", feed))
    before = trainer.variables()["w"]
    assert not np.isfinite(trainer.sess.run("loss_after:0", {**feed, "x:0": feed["x:0"] * 1e30}))
    assert trainer.fetch(SKIPPED) == [1]
    assert np.array_equal(trainer.variables()["w"], before)
