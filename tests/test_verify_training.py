"""verify on a loss-scaled TF1 training MetaGraph: it compares the forward outputs and the
unscaled gradients, with the same weights on both sides, and never trains either graph."""

import json
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf
import training_graphs
from test_html import _Dom

from amp_rewrite import cli, convert_file
from amp_rewrite.tools.runner import open_pair
from amp_rewrite.tools.verify import (
    attribute,
    compare_outputs,
    criteria,
    feed_sets,
    format_result,
    per_node,
    verify,
)

v1 = tf.compat.v1


def _build(path):
    """conv -> fused batch norm in training mode (moving mean and variance updated under
    UPDATE_OPS, which the train op waits on) -> relu -> dropout -> dense, trained by Adam;
    Glorot initializers without seeds, as tf.compat.v1 code writes them."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        kernel = v1.get_variable("conv/kernel", [3, 3, 1, 16], initializer=v1.glorot_uniform_initializer())
        conv = tf.nn.conv2d(tf.reshape(x, [-1, 8, 8, 1]), kernel, 1, "SAME")
        gamma = v1.get_variable("bn/gamma", [16], initializer=v1.ones_initializer())
        beta = v1.get_variable("bn/beta", [16], initializer=v1.zeros_initializer())
        moving = [v1.get_variable(f"bn/moving_{k}", [16], initializer=v1.zeros_initializer(),
                                  trainable=False) for k in ("mean", "variance")]
        bn, mean, var = v1.nn.fused_batch_norm(conv, gamma, beta, is_training=True)
        for m, value in zip(moving, (mean, var)):
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign_sub(m, 0.1 * (m - value)))
        h = tf.nn.dropout(tf.reshape(tf.nn.relu(bn), [-1, 1024]), rate=0.5)
        w = v1.get_variable("dense/kernel", [1024, 10], initializer=v1.glorot_uniform_initializer())
        b = v1.get_variable("dense/bias", [10], initializer=v1.zeros_initializer())
        logits = tf.add(tf.matmul(h, w), b, name="logits")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        hits = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y)
        tf.reduce_mean(tf.cast(hits, tf.float32), name="accuracy")
        step = v1.train.get_or_create_global_step()
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train = v1.train.AdamOptimizer(1e-3).minimize(loss, global_step=step, name="train")
        init = v1.global_variables_initializer()
        saver = v1.train.Saver()
        saver.export_meta_graph(str(path))
        with v1.Session(graph=g) as sess:   # a few FP32 steps, then a checkpoint
            sess.run(init)
            for feed in training_graphs.batches(5):
                sess.run(train, feed)
            return saver.save(sess, str(path.parent / "ckpt"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("training")
    ckpt = _build(folder / "train.meta")
    # float16 for GPUs (the default device): every matrix op, forward and backward, in float16
    report = convert_file(folder / "train.meta", folder / "train16.meta", target="float16")
    _, _, x, y = training_graphs.digits()
    np.savez(folder / "test.npz", x=x[:256], y=y[:256])
    return folder, ckpt, report.to_dict()["loss_scaling"]


def test_forward_outputs_and_unscaled_gradients(trained):
    folder, ckpt, scaling = trained
    orig, conv, data = folder / "train.meta", folder / "train16.meta", str(folder / "test.npz")
    result = verify(orig, conv, inputs=data, checkpoint=ckpt, nodes=True)
    assert result.ok, result.failures()
    assert result.criteria.dtype == "float16"
    forward = [o for o in result.outputs if o.kind == "output"]
    assert [o.name for o in forward] == ["loss:0", "accuracy:0"]
    # dropout draws the same mask on both sides (rate 0.5: another mask would move the loss)
    assert forward[0].rel_l2 < 1e-3
    # the accuracy moves by whole samples (an argmax of float16 logits near a tie may flip):
    # judged by how far it moved (top1's allowance), not by a relative error
    assert [c.check for c in forward[1].checks] == ["top1"] and forward[1].decisions
    gradients = [o for o in result.outputs if o.kind == "gradient"]
    # the gradients the conversion scales (its report names the float32 cast of a float16 one)
    assert {o.name for o in gradients} == {g.removesuffix("/amp_float") + ":0" for g in scaling["gradients"]}
    for o in gradients:
        assert o.converted.startswith(o.name[:-2]) and o.converted.endswith("/amp_unscaled:0")
        assert 0 < o.rel_l2 < result.criteria.grad_rel_l2 == 0.1
        assert o.top1 is None          # a [1024, 10] weight gradient is no batch of scores
    # per node: backward tensors unscaled; nothing that only sets variables up (fresh random
    # draws), nothing of the loss-scale state, nothing of the saver
    names = [n.tensor for n in result.nodes]
    assert not [n for n in names if "/Initializer/" in n or n.startswith(("amp_loss_scale/", "save/"))]
    backward = {n.op: n for n in result.nodes if n.tensor.startswith("gradients/")}
    assert {"Conv2DBackpropFilter", "FusedBatchNormGradV3", "ReluGrad"} <= set(backward)
    assert max(n.rel_l2 for n in backward.values()) < 0.1
    # the default outputs run through the command too (exit 0), from fresh initializers as well:
    # drawn once, in the original, and copied, so the loss still agrees
    assert cli.main(["verify", str(orig), str(conv), "--inputs", data, "--checkpoint", ckpt, "-q"]) == 0
    fresh = verify(orig, conv, inputs=data)
    assert fresh.ok and fresh.outputs[0].rel_l2 < 1e-3


def test_comparing_never_trains_either_graph(trained):
    folder, ckpt, _ = trained
    saved = tf.train.load_checkpoint(ckpt)
    with open_pair(folder / "train.meta", folder / "train16.meta", checkpoint=ckpt) as (a, b):
        before = a.variable_values(), b.variable_values()
        assert before[0]["dense/kernel"] == pytest.approx(saved.get_tensor("dense/kernel"))
        assert all(np.array_equal(before[1][k], v) for k, v in before[0].items())
        assert before[1]["amp_loss_scale/scale"] == 2.0 ** 15
        crit = criteria()
        feeds = feed_sets(a, str(folder / "test.npz"), 1, {})
        compare_outputs(a, b, feeds, crit)
        nodes, compared = per_node(a, b, feeds, crit)
        assert compared > 50
        after = a.variable_values(), b.variable_values()
    for old, new in zip(before, after):
        assert old.keys() == new.keys()
        assert all(np.array_equal(old[k], new[k]) for k in old), \
            [k for k in old if not np.array_equal(old[k], new[k])]
    # the moving averages (updated under UPDATE_OPS, which the gradients wait on) kept their bits
    assert np.array_equal(after[0]["bn/moving_mean"], saved.get_tensor("bn/moving_mean"))
    assert after[1]["amp_loss_scale/skipped_steps"] == 0 and after[0]["global_step"] == 5


def test_outputs_named_by_the_user(trained, tmp_path):
    folder, ckpt, _ = trained
    orig, conv, data = folder / "train.meta", folder / "train16.meta", str(folder / "test.npz")
    # a gradient named with --output is compared unscaled, and judged as a gradient
    result = verify(orig, conv, inputs=data, checkpoint=ckpt,
                    outputs=["gradients/MatMul_grad/tuple/control_dependency_1"])
    (grad,) = result.outputs
    assert grad.kind == "gradient" and grad.converted.endswith("/amp_unscaled:0")
    assert result.ok and 0 < grad.rel_l2 < 0.1 and grad.top1 is None
    # the result of an update (a ref variable's value after ApplyGradientDescent): fetching it
    # would train, so it is refused, exit 2
    (tmp_path / "ref.meta").write_bytes(
        training_graphs.build("mlp", "sgd", resource=False).SerializeToString())
    convert_file(tmp_path / "ref.meta", tmp_path / "ref16.meta", target="float16")
    assert cli.main(["verify", str(tmp_path / "ref.meta"), str(tmp_path / "ref16.meta"),
                     "--inputs", data, "-q"]) == 0
    assert cli.main(["verify", str(tmp_path / "ref.meta"), str(tmp_path / "ref16.meta"),
                     "--inputs", data, "--output", "train/update_w1/ApplyGradientDescent", "-q"]) == 2


def _float_tensors(runner):
    """Every float tensor of a graph runner's computation (not setting variables up, not the
    loss-scale state): what --per-node must either rank or count as not compared."""
    setup = runner.setup_ops()
    return {t.name for op in runner.graph.get_operations()
            if op.name not in setup and not op.name.startswith("amp_loss_scale/")
            for t in op.outputs if t.dtype.is_floating}


def test_per_node_counts_every_tensor_it_cannot_compare(trained, tmp_path):
    """No silent drops: in the loss-scaled float16 training graph every float tensor of
    either model is ranked or counted as not compared, by reason. The batch norm's reserve
    space has another shape in float16, the optimizer runs after variable writes, the
    scale's skip-if-not-finite conds sit in cond branches, and the conversion adds casts."""
    folder, ckpt, _ = trained
    orig, conv, data = folder / "train.meta", folder / "train16.meta", str(folder / "test.npz")
    with open_pair(orig, conv, checkpoint=ckpt) as (a, b):
        found = attribute(a, b, feed_sets(a, data, 1, {}), criteria())
        everything = _float_tensors(a) | _float_tensors(b)
        bn = next(op for op in a.graph.get_operations() if op.type == "FusedBatchNormV3")
        reserve = bn.outputs[5].name
        assert b.graph.get_tensor_by_name(reserve).dtype == tf.float32   # float32 both sides
    ranked = {n.tensor for n in found.ranked}
    assert not ranked & set(found.skipped)
    assert ranked | set(found.skipped) == everything
    # the reserve space's shape is its kernel's: oneDNN gives it another shape in float16 on
    # some CPUs (AVX512-BF16), the same on others (AMX), where it is compared
    changed = found.skipped.get(reserve) == "shape_changed"
    assert changed or reserve in ranked
    assert {"after_write", "control_flow", "only_converted"} | ({"shape_changed"} if changed else set()) \
        <= set(found.skipped.values())
    example = reserve if changed else next(t for t, why in found.skipped.items()
                                           if why == "after_write")
    # the result, its text, its JSON and the HTML page say how many and why
    result = verify(orig, conv, inputs=data, checkpoint=ckpt, nodes=True)
    groups = {u.reason: u for u in result.uncompared}
    assert result.nodes_compared == len(ranked)
    assert {r: u.count for r, u in groups.items()} == dict(Counter(found.skipped.values()))
    assert example in groups[found.skipped[example]].tensors
    text = format_result(result)
    total = len(found.skipped)
    assert f"not compared: {total} " in text and example in text
    for u in result.uncompared:
        assert f"{u.count}  {u.why}" in text
    data_json = json.loads(json.dumps(result.to_dict()))
    assert sum(u["count"] for u in data_json["uncompared"]) == total
    page = tmp_path / "verify.html"
    assert cli.main(["verify", str(orig), str(conv), "--inputs", data, "--checkpoint", ckpt,
                     "--per-node", "-q", "--html", str(page)]) == 0
    dom = _Dom()
    dom.feed(page.read_text())
    rows = dom.tables["uncompared"]
    assert sorted(int(r[0]) for r in rows) == sorted(u.count for u in result.uncompared)
    assert any(example in r[2] for r in rows)
