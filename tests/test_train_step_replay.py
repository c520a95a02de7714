"""verify --per-node and tune on a TF2 train-step signature (issue 28): the replay runs the step
body by body, every run from the weights and optimizer state the SavedModel saved, every call
from the state it saw, without touching the SavedModel's files; the loss-scaled backward pass
is compared unscaled, a step the loss scale skips is left out of the ranking with its reason,
and a float16 overflow planted in the step comes first."""

import hashlib
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import cli, convert_file
from amp_rewrite.core.errors import InputError
from amp_rewrite.tools.replay import unscale
from amp_rewrite.tools.runner import open_model
from amp_rewrite.tools.traces import Trace
from amp_rewrite.tools.tuning import tune
from amp_rewrite.tools.verify import verify


class Trainer(tf.Module):
    """Ids embedded by a nested tf.function (a call handed the table's handle), joined with
    dense features, a hidden layer, ``log1p((1000 h)^2)`` (named energy: its Square passes
    float16's 65504) and 5 scores. The step clips the gradients by their global norm, applies
    Keras' Adam to the dense weights and the table's IndexedSlices gradient as a sparse update
    (``scatter_sub``)."""

    def __init__(self, rng):
        super().__init__()
        self.table = tf.Variable(rng.normal(0, 0.3, [32, 8]).astype(np.float32), name="table")
        self.w1 = tf.Variable(rng.normal(0, 0.3, [12, 16]).astype(np.float32), name="w1")
        self.b1 = tf.Variable(np.zeros(16, np.float32), name="b1")
        self.w2 = tf.Variable(rng.normal(0, 0.3, [16, 5]).astype(np.float32), name="w2")
        self.b2 = tf.Variable(np.zeros(5, np.float32), name="b2")
        self.opt = keras.optimizers.Adam(0.01)
        self.opt.build(self.dense)

    @property
    def dense(self):
        return [self.w1, self.b1, self.w2, self.b2]

    @tf.function
    def embed(self, ids):
        return tf.reduce_mean(tf.nn.embedding_lookup(self.table, ids), axis=1)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32),
                                  tf.TensorSpec([None, 4], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def train_step(self, ids, x, labels):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.matmul(tf.concat([self.embed(ids), x], 1), self.w1) + self.b1)
            with tf.name_scope("energy"):
                h = tf.math.log1p(tf.square(1000.0 * h))
            logits = tf.matmul(h, self.w2) + self.b2
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        grads, _ = tf.clip_by_global_norm(tape.gradient(loss, [self.table] + self.dense), 1.0)
        self.opt.apply_gradients(zip(grads[1:], self.dense))
        self.table.scatter_sub(tf.IndexedSlices(0.1 * grads[0].values, grads[0].indices))
        return {"loss": loss}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The step saved, its data, the table as saved, and three float16 conversions: with a
    loss scale starting at 256 (its gradients fit float16), at the default 32768 (they
    overflow: the step is skipped), and with the energy Square forced to float16."""
    root = tmp_path_factory.mktemp("train_step")
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    module = Trainer(rng)
    tf.saved_model.save(module, str(root / "fp32"), signatures={"train_step": module.train_step})
    np.savez(root / "data.npz", ids=rng.integers(0, 32, (16, 3)).astype(np.int32),
             x=rng.normal(size=(16, 4)).astype(np.float32),
             labels=rng.integers(0, 5, 16).astype(np.int32))
    (root / "force.toml").write_text(
        '[[override]]\nglob = "*energy/Square"\naction = "force_lowp"\n')
    convert_file(root / "fp32", root / "f16", target="float16", loss_scale_options={"start": 256})
    convert_file(root / "fp32", root / "f16_skips", target="float16")
    convert_file(root / "fp32", root / "f16_forced", target="float16",
                 rules=[str(root / "force.toml")])
    return root, module.table.numpy()


def _hashes(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_per_node_ranks_the_train_step_with_its_backward_pass_unscaled(trained):
    root, _ = trained
    before = {name: _hashes(root / name) for name in ("fp32", "f16")}
    result = verify(root / "fp32", root / "f16", inputs=str(root / "data.npz"),
                    signature="train_step", nodes=True)
    assert result.ok and [o.name for o in result.outputs] == ["loss"]
    # the backward pass holds 256 x its values in the converted step: compared divided by it
    grads = [n for n in result.nodes if "/gradient_tape/" in n.tensor and n.op == "MatMul"]
    assert len(grads) == 4 and all(n.dtype == "float16" and 0 < n.rel_l2 < 0.05 for n in grads)
    # the forward pass, the clipping, Adam's arithmetic, the moments read back after update
    assert {"MatMul", "ResourceGather", "L2Loss", "Sqrt"} <= {n.op for n in result.nodes}
    assert any(n.op == "ReadVariableOp" and n.rel_l2 > 0 for n in result.nodes)
    assert all(n.added < 0.05 for n in result.nodes)
    assert [u.reason for u in result.uncompared] == ["only_converted"]
    assert {name: _hashes(root / name) for name in ("fp32", "f16")} == before


def test_every_run_starts_from_the_saved_state_and_every_call_from_its_own(trained):
    """Two calls of the step give the same loss (the second does not start from the first's
    update), and the replay of the nested embedding call gathers from the table as saved,
    although the step's sparse update changed those rows before the call is replayed."""
    root, table = trained
    feed = dict(np.load(root / "data.npz"))
    with open_model(root / "fp32", signature="train_step") as runner:
        call = runner.callable()
        first = call(feed)[0]
        trace = runner.trace(feed)
        assert call(feed)[0] == first
    (gather,) = [name for name, info in trace.info.items() if info.op == "ResourceGather"]
    assert gather.startswith("__forward_embed")
    assert np.array_equal(trace.values[gather][0], table[feed["ids"]])


def test_a_step_the_loss_scale_skips_leaves_its_backward_pass_out(trained):
    """At the default start scale the step's scaled gradients overflow float16 and it skips
    its update, as dynamic loss scaling does: what was computed from them differs on purpose,
    so it is counted, not ranked; the forward pass is still compared."""
    root, _ = trained
    result = verify(root / "fp32", root / "f16_skips", inputs=str(root / "data.npz"),
                    signature="train_step", nodes=True)
    assert result.ok and all(math.isfinite(n.added) for n in result.nodes)
    (skipped,) = [u for u in result.uncompared if u.reason == "skipped_step"]
    assert skipped.count > 50 and "skipped its update" in skipped.why
    assert not any("/gradient_tape/MatMul" in n.tensor   # the backward pass, the clipped
                   or "/clip_by_global_norm/clip_by_global_norm/" in n.tensor  # gradients
                   for n in result.nodes)
    # variables read before the (skipped) update agree; those read back after it are out
    reads = [n for n in result.nodes if n.op == "ReadVariableOp"]
    assert len(reads) > 10 and all(n.rel_l2 == 0 for n in reads)
    assert any(n.op == "MatMul" and n.dtype == "float16" and n.rel_l2 > 0 for n in result.nodes)


def test_a_scaled_tensor_recorded_at_two_scales_is_left_out(trained):
    """The converted step's trace read its scale once (256). Recorded twice, at two scales (as
    a loop of steps whose scale changed would be), its backward pass cannot be divided by
    either: it is left out as loss_scaled; the gradients unscaled by the step stay."""
    root, _ = trained
    feed = dict(np.load(root / "data.npz"))
    with open_model(root / "f16", signature="train_step") as runner:
        trace = runner.trace(feed)
    (seed,) = [name for name in trace.info if name.endswith("/amp_scaled:0")]
    function = seed.split("/", 1)[0]
    grad, scale = (f"{function}/gradient_tape/MatMul_1/MatMul_1:0",
                   f"{function}/amp_loss_scale/scale/read:0")
    assert trace.values[scale] == [256] and grad in trace.values
    twice = Trace({name: values * 2 for name, values in trace.values.items()}, trace.info)
    twice.values[scale] = [np.float32(256), np.float32(128)]
    left_out = unscale(twice)
    assert left_out[grad] == "loss_scaled" and set(left_out.values()) == {"loss_scaled"}
    assert seed in left_out and not any(t.endswith("/amp_unscaled:0") for t in left_out)


def test_a_float16_overflow_seeded_in_the_train_step_comes_first(trained, capsys):
    """The issue's command: the forced Square is the one tensor with an infinite added error,
    ranked first; the loss it makes infinite fails verify (exit 1)."""
    root, _ = trained
    assert cli.main(["verify", str(root / "fp32"), str(root / "f16_forced"), "--inputs",
                     str(root / "data.npz"), "--signature", "train_step", "--per-node"]) == 1
    ranking = [line for line in capsys.readouterr().out.splitlines()
               if line[:5].strip().rstrip(".").isdigit()]
    assert ranking[0].split()[1].endswith("/energy/Square:0")
    assert ranking[0].split()[2:5] == ["Square", "float16", "added"]
    assert [line for line in ranking if "added inf" in line] == ranking[:1]


class Loud(tf.Module):
    """A train step whose inputs are scaled by 1e4 before a MatMul: float16 overflows it."""

    def __init__(self, rng):
        super().__init__()
        self.w = tf.Variable(rng.normal(0, 1, [4, 3]).astype(np.float32), name="w")
        self.opt = keras.optimizers.Adam(0.01)
        self.opt.build([self.w])

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def train_step(self, x, labels):
        with tf.GradientTape() as tape:
            logits = 1e-4 * tf.matmul(1e4 * x, self.w)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        self.opt.apply_gradients([(tape.gradient(loss, self.w), self.w)])
        return {"loss": loss}


def test_tune_keeps_the_overflowing_matmul_of_a_train_step(tmp_path):
    """tune traces the train step (its range margin the original, its attribution both
    models): the MatMul that overflows float16 is kept in float32, and the tuned step's loss
    passes."""
    rng = np.random.default_rng(0)
    module = Loud(rng)
    tf.saved_model.save(module, str(tmp_path / "loud"),
                        signatures={"train_step": module.train_step})
    np.savez(tmp_path / "data.npz", x=2 * rng.normal(size=(16, 4)).astype(np.float32),
             labels=rng.integers(0, 3, 16).astype(np.int32))
    before = _hashes(tmp_path / "loud")
    result = tune(tmp_path / "loud", tmp_path / "tuned", feeds=str(tmp_path / "data.npz"),
                  signature="train_step", target="float16")
    assert result.ok and math.isinf(result.before) and result.after <= result.tolerance
    assert ("MatMul", "MatMul") in [(k.op, k.node.split("/", 1)[1]) for k in result.kept]
    assert verify(tmp_path / "loud", tmp_path / "tuned", inputs=str(tmp_path / "data.npz"),
                  signature="train_step").ok
    assert _hashes(tmp_path / "loud") == before


def test_a_loop_that_writes_replays_each_iteration_from_the_state_the_last_one_left(tmp_path):
    """A While body reads a variable, then writes it, and the next iteration reads what it
    wrote. The replay starts the loop from the state it saw and each replayed iteration
    writes as TensorFlow's did, so the reads are 0, 1, 2 as in TensorFlow's run (not 3, 4, 5
    from the state the run left)."""
    class Loop(tf.Module):
        def __init__(self):
            super().__init__()
            self.v = tf.Variable(np.zeros(2, np.float32))

        @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
        def serve(self, x):
            total = tf.zeros([2])
            for _ in tf.range(3):
                total += self.v * 2.0
                self.v.assign_add(x)
            return {"y": total}

    module = Loop()
    tf.saved_model.save(module, str(tmp_path / "loop"),
                        signatures={"serving_default": module.serve})
    feed = {"x": np.ones(2, np.float32)}
    with open_model(tmp_path / "loop") as runner:
        assert np.array_equal(runner.callable()(feed)[0], [6.0, 6.0])
        trace = runner.trace(feed)
    (doubled,) = [name for name, info in trace.info.items()
                  if info.op == "Mul" and "while_body" in name]
    assert [v[0] for v in trace.values[doubled]] == [0.0, 2.0, 4.0]


def test_a_signature_that_writes_a_lookup_table_is_refused(tmp_path):
    """A mutable table's entries, unlike variables, cannot be put back after a replay."""
    class Seen(tf.Module):
        def __init__(self):
            super().__init__()
            self.seen = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)

        @tf.function(input_signature=[tf.TensorSpec([2], tf.int64)])
        def serve(self, ids):
            before = self.seen.lookup(ids)
            self.seen.insert(ids, tf.ones([2]))
            return {"y": before + 1.0}

    module = Seen()
    tf.saved_model.save(module, str(tmp_path / "seen"),
                        signatures={"serving_default": module.serve})
    feed = {"ids": np.array([1, 2], np.int64)}
    with open_model(tmp_path / "seen") as runner:
        runner.callable()(feed)
        with pytest.raises(InputError, match=r"writes a lookup table \(.*Insert.*\)"):
            runner.trace(feed)
