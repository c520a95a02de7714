"""Verdicts say "ok" only where the user gets it (issue 34: sound verdicts).

* verify fails an output that float16 turns into inf, whatever the sign (the user receives
  that inf), says how many elements and which output, and lets no numpy warning through;
* the one rule for infinities inside a model (amp_rewrite.tools.masks): a tensor is past the
  range harmlessly only by construction, a constant mask, never because the data drove it
  there on the batch at hand;
* tune keeps what overflows on its samples, masks aside, so the tuned model holds on held-out
  batches whose overflows have the other sign;
* an output with a class axis is judged position by position (a segmentation's pixels), an
  integer output by exact match.
"""

import math
import warnings

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import convert_file
from amp_rewrite.io.load import Model
from amp_rewrite.tools.masks import constant_masks
from amp_rewrite.tools.ranges import Ranges
from amp_rewrite.tools.runner import open_model
from amp_rewrite.tools.tuning import tune
from amp_rewrite.tools.verify import ErrorStats, verify
import tune_graphs
from refusals import run_cli

v1 = tf.compat.v1
F16_MAX = 65504.0


def _pb(path, build):
    g = tf.Graph()
    with g.as_default():
        build()
    path.write_bytes(g.as_graph_def().SerializeToString())
    return path


# ----------------------------------------------------------------- verify's outputs
class WideLogits(tf.Module):
    """Token ids -> embedding -> logits whose float32 values reach about 1.25e5."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.emb = tf.Variable(rng.uniform(0.5, 1.0, (20, 16)).astype(np.float32))
        self.w = tf.Variable(np.full((16, 5), 1e4, np.float32) * rng.uniform(0.5, 1, (16, 5)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int32)])
    def serve(self, ids):
        pooled = tf.reduce_mean(tf.gather(self.emb, ids), axis=1)
        return {"logits": tf.matmul(pooled, self.w)}


def test_verify_fails_a_savedmodels_outputs_past_float16s_range(tmp_path, capsys):
    module = WideLogits()
    tf.saved_model.save(module, str(tmp_path / "fp32"), signatures={"serving_default": module.serve})
    convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    ids = np.random.default_rng(1).integers(0, 20, (8, 4)).astype(np.int32)
    np.savez(tmp_path / "ids.npz", ids=ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run_cli(capsys, ["verify", tmp_path / "fp32", tmp_path / "f16",
                                          "--inputs", tmp_path / "ids.npz"])
    assert code == 1, out + err
    want = module.serve(tf.constant(ids))["logits"].numpy()
    past = int(np.count_nonzero(np.abs(want) > F16_MAX))
    assert past > 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("logits")]
    assert f"{past} of {want.size} element(s) inf or NaN where float32 is finite" in line
    assert "FAIL: finite" in line
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], \
        [str(w.message) for w in caught]
    assert "RuntimeWarning" not in err


def test_an_inf_of_either_sign_fails_an_output():
    """The 16-bit rounding of -1e9 to -inf agreed at outputs before; now an output element
    non-finite where float32 is finite fails, whatever its sign."""
    ref = np.array([[-1e9, 7e4, 1.0]], np.float32)
    for out in ([[-np.inf, 7e4, 1.0]], [[-1e9, np.inf, 1.0]], [[-1e9, 7e4, np.nan]]):
        s = ErrorStats(0.0, 0.0)
        s.update(ref, np.array(out, np.float32))
        assert s.lost == 1 and math.isinf(s.rel_l2)


# ----------------------------------------------------------------- the mask rule
def _masks_of(build, feed, limit=F16_MAX):
    """The constant masks among the tensors of the graph ``build`` makes, traced on ``feed``
    (by op name), and every tensor past ``limit``."""
    g = tf.Graph()
    with g.as_default():
        build()
    with open_model(Model.of_graph_def(g.as_graph_def())) as runner:
        ranges = Ranges()
        trace = runner.trace(feed)
        ranges.add(trace)
    past = {n for n, t in ranges.tensors.items() if t.max_abs > limit or t.infinite}
    found = constant_masks(ranges.info, ranges.tensors, limit)
    return {n.split(":")[0] for n in found}, {n.split(":")[0] for n in past}


def test_constant_masks_are_past_the_range_by_construction_data_is_not():
    rng = np.random.default_rng(0)

    def build():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        keep = v1.placeholder(tf.bool, [None, 6], name="keep")
        scores = tf.matmul(x, tf.constant(rng.normal(size=(6, 6)).astype(np.float32)), name="scores")
        # BERT's padding mask: (1 - cast(mask)) * -1e9, added to the scores
        pad = tf.multiply(1.0 - tf.cast(keep, tf.float32), -1e9, name="pad")
        tf.add(scores, pad, name="padded")
        # tf.where(mask, scores, float32.min)
        tf.where(keep, scores, tf.fill(tf.shape(scores), np.float32(np.finfo(np.float32).min)),
                 name="selected")
        # data times a large constant: past the range because of the data
        tf.multiply(x, 1e5, name="loud")
        # a constant times data that is not 0/1: its sign is the data's
        tf.multiply(x, -1e9, name="scaled_by_data")
        # the difference of two 0/1 masks may be -1: its sign is the data's too
        other = tf.cast(tf.logical_not(keep), tf.float32)
        tf.multiply(tf.cast(keep, tf.float32) - other, -1e9, name="signed")

    feed = {"x": rng.normal(size=(4, 6)).astype(np.float32),
            "keep": rng.random((4, 6)) < 0.5}
    masks, past = _masks_of(build, feed)
    assert {"pad", "padded", "selected"} <= masks
    assert {"loud", "scaled_by_data", "signed"} <= past - masks


def test_what_only_looks_like_a_mask_on_the_batch_is_data():
    """Tensors that hold a mask's values on the batch at hand, by the data's doing: infinite
    in float32 itself though no constant made them so; 1 - x of a float input that happens to
    hold 0s and 1s; the difference of two 0/1 masks that happens to stay 0/1 here. None is a
    constant mask: the next batch may give them any sign and magnitude."""
    def build():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        gate = v1.placeholder(tf.float32, [None, 6], name="gate")         # fed 0s and 1s
        a, b = (v1.placeholder(tf.bool, [None, 6], name=n) for n in ("a", "b"))
        tf.exp(x * 100.0, name="overflowed")                 # inf in float32 on this batch
        tf.add(tf.exp(x * 100.0), x, name="overflowed_plus_x")
        tf.multiply(1.0 - gate, -1e9, name="one_minus_data")
        tf.multiply(tf.cast(a, tf.float32) - tf.cast(b, tf.float32), -1e9, name="mask_diff")

    rng = np.random.default_rng(3)
    a = rng.random((4, 6)) < 0.7
    feed = {"x": np.abs(rng.normal(size=(4, 6))).astype(np.float32) + 1.0,
            "gate": (rng.random((4, 6)) < 0.5).astype(np.float32),
            "a": a, "b": a & (rng.random((4, 6)) < 0.5)}    # b within a: a - b is 0 or 1 here
    masks, past = _masks_of(build, feed)
    data = {"overflowed", "overflowed_plus_x", "one_minus_data", "mask_diff"}
    assert data <= past, "the case is void: a tensor stays within float16's range"
    assert not data & masks, data & masks


def test_the_mask_rule_walks_a_100000_tensor_chain_in_seconds():
    """AddV2 after AddV2 from a -1e9 constant: every tensor of the chain is a constant mask;
    the rule walks the chain without recursion (a RecursionError past ~11,000 before)."""
    import time

    from amp_rewrite.tools.ranges import TensorRange
    from amp_rewrite.tools.traces import TensorInfo
    n = 100_000
    info = {"mask:0": TensorInfo("Const", "float32", set(), 0),
            "x:0": TensorInfo("Placeholder", "float32", set(), 1)}
    ranges = {"mask:0": TensorRange("mask:0", "Const", "float32", 0, 1e9, 6, 6, binary=False),
              "x:0": TensorRange("x:0", "Placeholder", "float32", 1, 3.0, 6, 6, binary=False)}
    previous = "mask:0"
    for i in range(n):
        name = f"add_{i}:0"
        info[name] = TensorInfo("AddV2", "float32", {previous, "x:0"}, i + 2)
        ranges[name] = TensorRange(name, "AddV2", "float32", i + 2, 1e9, 6, 6, binary=False)
        previous = name
    started = time.perf_counter()
    found = constant_masks(info, ranges, F16_MAX, [previous])
    seconds = time.perf_counter() - started
    assert found == {previous}
    assert constant_masks(info, ranges, F16_MAX) == set(ranges) - {"x:0"}
    assert seconds < 10, f"{seconds:.1f} s for a chain of {n}"


# ----------------------------------------------------------------- tune on unseen batches
def test_tuned_model_holds_on_held_out_batches_whose_overflow_sign_differs(tmp_path):
    src = tmp_path / "hot.pb"
    src.write_bytes(tune_graphs.sign_flip_softmax().SerializeToString())
    tuning = [tune_graphs.hot_rows(16, -1.0, seed=s) for s in (1, 2)]
    held = [tune_graphs.hot_rows(16, +1.0, seed=s) for s in range(100, 108)]
    plain = convert_file(src, tmp_path / "plain.pb", target="float16")
    assert plain is not None
    np.savez(tmp_path / "next.npz", **held[0])
    assert not verify(src, tmp_path / "plain.pb", inputs=str(tmp_path / "next.npz")).ok, \
        "the case is void: the plain conversion holds on a positive overflow"
    result = tune(str(src), tmp_path / "tuned.pb", feeds=tuning, target="float16")
    assert result.ok, result.summary()
    # the range margin keeps the data's overflow, though the tuning batch shows it harmless
    assert [k.op for k in result.kept if k.largest is not None and k.largest > F16_MAX] == \
        ["Mul"], result.summary()
    for i, feed in enumerate(held):
        np.savez(tmp_path / f"held{i}.npz", **feed)
        r = verify(src, tmp_path / "tuned.pb", inputs=str(tmp_path / f"held{i}.npz"))
        assert r.ok, f"held-out batch {i}"


def test_per_node_blames_an_overflow_the_data_drives_though_this_batch_hides_it(tmp_path,
                                                                                  capsys):
    """The scores times 40 pass float16's range negative on this batch: -inf, which the
    softmax turns into the zeros float32 gives, so the outputs agree. They are no constant
    mask: the next batch's sign may differ (+inf: NaN), so per-node ranks them first, an
    infinite error, and says why."""
    src = tmp_path / "hot.pb"
    src.write_bytes(tune_graphs.sign_flip_softmax().SerializeToString())
    convert_file(src, tmp_path / "f16.pb", target="float16")
    np.savez(tmp_path / "cold.npz", **tune_graphs.hot_rows(16, -1.0, seed=1))
    result = verify(src, tmp_path / "f16.pb", inputs=str(tmp_path / "cold.npz"), nodes=True)
    assert result.ok, "the case is void: the outputs show the overflow on this batch"
    first = result.nodes[0]
    assert first.tensor == "scaled:0" and first.dtype == "float16" and first.beyond_range
    assert not first.harmless and first.data_driven and not first.differs
    assert math.isinf(first.added) and math.isinf(first.rel_l2)
    code, out, _ = run_cli(capsys, ["verify", src, tmp_path / "f16.pb", "--inputs",
                                    tmp_path / "cold.npz", "--per-node"])
    assert code == 0
    line = next(ln for ln in out.splitlines() if "scaled:0" in ln)
    assert "added inf" in line and "past float16's range as ±inf: the data drives it there" in line


def _sigmoid_by_hand(path):
    """``1 / (1 + exp(-s)) @ V``: Exp is float16's deny list, so the painted graph computes
    it in float32; where s is about -15 exp(-s) is 3.3e6, past float16's range, and float16's
    +inf becomes the 0 float32 gives to within 3e-7: the outputs agree on this batch."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(8, 8)).astype(np.float32)

    def build():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        s = tf.matmul(x, tf.constant(w), name="s")
        e = tf.exp(-s, name="e")
        gate = tf.math.reciprocal(1.0 + e, name="gate")
        tf.identity(tf.matmul(gate, tf.constant(rng.normal(size=(8, 4)).astype(np.float32))),
                    name="y")
    return _pb(path, build), w.astype(np.float64)


def test_tune_relax_forces_no_node_whose_tensor_the_data_drives_past_the_range(tmp_path):
    """--relax tries the float32 nodes the lists kept (Exp, and what the deny list spread to)
    in float16; a trial holding exp(-s)'s +inf passes the metric and verify's checks on the
    batch, but its look inside finds an overflow the data drives: refused, Exp stays float32."""
    src, w = _sigmoid_by_hand(tmp_path / "sig.pb")
    rng = np.random.default_rng(6)
    scores = rng.normal(size=(16, 8))
    scores[::2, 0] = -15.0                      # exp(15) = 3.3e6 on every other row
    ref = {"x": (scores @ np.linalg.inv(w)).astype(np.float32)}
    result = tune(str(src), None, feeds=[ref], target="float16", relax=True)
    assert result.ok, result.summary()
    e = next(n for n in result.report.nodes if n.name == "e")
    assert e.precision == "float32", result.summary()
    forced_trials = [t for t in result.trial_log if t["why"].startswith("relax")]
    assert forced_trials and not forced_trials[0]["ok"], result.trial_log


def test_tune_refuses_a_trial_that_holds_an_overflow_inside(tmp_path):
    """a + b is 65503 in float32, within the range, so the range margin (at --headroom 1)
    keeps nothing; float16 rounds a and b up and their sum is inf, which a minimum turns back
    into the same 1000 float32 gives: the outputs agree on this batch. The look inside each
    trial finds the inf: the painted graph fails, and tune keeps the sum float32."""
    eye = np.eye(4, dtype=np.float32)

    def build():
        a, b = (v1.placeholder(tf.float32, [None, 4], name=n) for n in "ab")
        near = tf.add(tf.matmul(a, eye), tf.matmul(b, eye), name="near")
        tf.identity(tf.matmul(tf.minimum(near, 1000.0), eye), name="y")

    src = _pb(tmp_path / "near.pb", build)
    rows = np.ones((2, 4), np.float32)
    result = tune(str(src), None, feeds=[{"a": rows * 60017, "b": rows * 5486}],
                  target="float16", headroom=1.0)
    first = result.trial_log[0]
    assert first["why"] == "painted graph" and first["metric"] == 0.0 and not first["ok"]
    assert result.ok and [k.node for k in result.kept] == ["near"], result.summary()


# ----------------------------------------------------------------- per-element outputs
def _segmenter(path, flip=0.0, seed=0):
    """A 1x1 'segmentation head': per pixel, logits over 4 classes from 3 channels. ``flip``
    moves class 1's weights towards class 0's, so some pixels change class."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(1, 1, 3, 4)).astype(np.float32)
    w[..., 1] += flip * (w[..., 0] - w[..., 1])

    def build():
        x = v1.placeholder(tf.float32, [None, 16, 16, 3], name="image")
        tf.nn.conv2d(x, tf.constant(w), 1, "SAME", name="logits")
        tf.argmax(tf.nn.conv2d(x, tf.constant(w), 1, "SAME"), axis=-1, name="classes")
    return _pb(path, build)


def test_a_segmentation_output_is_judged_pixel_by_pixel(tmp_path):
    orig = _segmenter(tmp_path / "seg.pb")
    moved = _segmenter(tmp_path / "moved.pb", flip=0.3)
    np.savez(tmp_path / "img.npz", image=np.random.default_rng(2).normal(size=(2, 16, 16, 3)).astype(np.float32))
    same = verify(orig, orig, inputs=str(tmp_path / "img.npz"), outputs=["logits:0", "classes:0"])
    assert same.ok
    logits, classes = same.outputs
    assert logits.positions and logits.rows == 2 * 16 * 16 and logits.top1 == 1.0
    assert classes.match == 1.0 and classes.top1 is None
    r = verify(orig, moved, inputs=str(tmp_path / "img.npz"), outputs=["logits:0", "classes:0"],
               checks=["top1"])
    logits, classes = r.outputs
    assert 0.5 < logits.top1 < 0.99 and logits.failed == ["top1"]   # pixels changed class
    assert classes.match == pytest.approx(logits.top1, abs=0.02) and classes.failed == ["match"]


# ----------------------------------------------------------------- what tune tunes
class NarrowMLP(tf.Module):
    """64 -> 64 -> 10: at one sample a run, the CPU cost model keeps both MatMuls float32."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w1 = tf.Variable(rng.normal(0, 0.1, (64, 64)).astype(np.float32))
        self.w2 = tf.Variable(rng.normal(0, 0.1, (64, 10)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def serve(self, x):
        return {"logits": tf.matmul(tf.nn.relu(tf.matmul(x, self.w1)), self.w2)}


def test_tune_says_it_tuned_a_graph_the_cost_model_kept_float32(tmp_path, capsys):
    module = NarrowMLP()
    tf.saved_model.save(module, str(tmp_path / "sm"), signatures={"serving_default": module.serve})
    from sklearn.datasets import load_digits
    np.savez(tmp_path / "d.npz", x=(load_digits().data[:32] / 16).astype(np.float32))
    argv = ["tune", tmp_path / "sm", "-o", tmp_path / "tuned", "--inputs", tmp_path / "d.npz",
            "--target", "bfloat16", "--device", "cpu"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    assert "painted graph: 0 of 2 matrix ops in bfloat16; the CPU cost model kept 2 float32" in out
    assert "--shape NAME=D1,D2,..." in out and "--min-matrix-intensity 0" in out
    assert "warning: the tuned model runs 0 of 2 matrix ops in bfloat16: mostly float32" in err
    # asked to paint whole, the same model tunes the painted graph: no warning
    code, out, err = run_cli(capsys, argv + ["--min-matrix-intensity", "0", "--force"])
    assert code == 0 and "painted graph: 2 of 2 matrix ops in bfloat16" in out, out + err
    assert "mostly float32" not in out + err
