"""``tune`` on data it never saw (issue 26, items 3 to 5): users tune on a few batches and deploy
on millions.

A tensor that reaches a quarter of 65504 on the tuning batch passes float16 there and
overflows on the next batch: tune keeps such tensors float32 before the search (the range
margin, ``--headroom``), so the result holds on held-out batches from the same distribution.
An input that does not fit float16 at all is fixed in one trial after the painted graph, not
one node per trial. And a result that fails on ``--holdout`` samples is a failure: exit 1, one
line naming the output and the error, nothing written unless ``--allow-holdout-failure``.
"""

import math
from pathlib import Path

import graphs
import numpy as np
import pytest
import tensorflow as tf
import tune_graphs
from refusals import run_cli
from sklearn.datasets import load_digits

from amp_rewrite import convert
from amp_rewrite.core.dtypes import HALF, LARGEST
from amp_rewrite.io.load import Model
from amp_rewrite.tools.tuning import tune

F16 = LARGEST[HALF]
TOL = 1e-2      # verify's rel_l2 for float16, tune's default tolerance
KERAS_EXPORT = Path(__file__).parent / "data" / "keras_export"


def _largest_logit(graph_def, feed):
    logits, = graphs.run(graph_def, {"x:0": feed["x"]}, ["logits:0"])
    return float(np.abs(logits).max())


def _worst(original, converted, feeds):
    """The worst relative L2 error of ``converted``'s probabilities over ``feeds`` (inf where
    one is not finite), run here, not by tune."""
    worst = 0.0
    for feed in feeds:
        want, = graphs.run(original, {"x:0": feed["x"]}, ["probs:0"])
        got, = graphs.run(converted, {"x:0": feed["x"]}, ["probs:0"])
        worst = max(worst, math.inf if not np.isfinite(got).all() else graphs.rel_l2(got, want))
    return worst


@pytest.fixture(scope="module")
def softmax():
    """A softmax over logits scaled so that the tuning batch's largest is half of float16's
    largest value; the tuning batch (16 rows) and eight held-out batches (64 rows) drawn
    from the same distribution (:func:`tune_graphs.loud_rows`)."""
    tuning = tune_graphs.loud_rows(16, seed=3)
    scale = F16 / 2 / _largest_logit(tune_graphs.scaled_softmax(1.0), tuning)
    graph_def = tune_graphs.scaled_softmax(scale)
    held = [tune_graphs.loud_rows(64, seed=s) for s in range(100, 108)]
    return graph_def, tuning, held


def test_tuned_on_a_batch_that_passes_it_holds_on_held_out_batches_that_overflow(softmax):
    graph_def, tuning, held = softmax
    # the premise: on the tuning batch the logits come within a factor of 4 of 65504 and the
    # painted graph passes; on some held-out batches a row's largest logit goes past it, and
    # float16's inf makes that row's softmax NaN
    assert F16 / 4 <= _largest_logit(graph_def, tuning) < F16
    painted, _ = convert(graph_def)
    assert _worst(graph_def, painted, [tuning]) <= TOL
    assert sum(_worst(graph_def, painted, [feed]) == math.inf for feed in held) >= 2

    result = tune(Model.of_graph_def(graph_def), feeds=[tuning], holdout=held)
    assert result.ok and result.before <= TOL        # the tuning batch alone needs nothing
    assert [(k.node, k.tensor) for k in result.kept] == [("logits", "logits:0")]
    assert result.kept[0].largest == pytest.approx(F16 / 2, rel=1e-3)
    assert [t["why"] for t in result.trial_log] == ["painted graph", "range margin"]
    assert result.lowp_after > 0                     # the ReLU layer stays float16
    # the result holds on every held-out batch, run here on the graph tune returns
    assert _worst(graph_def, result.graph_def, held) <= TOL
    assert result.holdout_before == math.inf and result.holdout_after <= TOL
    assert not result.holdout_failure


def test_a_result_failing_held_out_samples_exits_1_and_writes_only_when_allowed(
        softmax, tmp_path, capsys):
    graph_def, tuning, held = softmax
    src, holdout = _files(tmp_path, "softmax.pb", graph_def, tuning, held)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "tuned.pb"
    # --headroom 1: no margin beyond the range itself, which the tuning batch stays under:
    # the painted graph passes there and fails on the held-out batches
    argv = ["tune", src, "-o", out, "--inputs", tmp_path / "tune.npz", *holdout, "--headroom", "1"]
    code, stdout, err = run_cli(capsys, argv)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "held-out samples: output 'probs:0' rel_l2 inf (limit 0.01)" in err
    assert "--allow-holdout-failure" in err and "FAIL: output 'probs:0'" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before     # nothing written

    code, stdout, err = run_cli(capsys, argv + ["--allow-holdout-failure"])
    assert code == 0 and "warning: held-out samples: output 'probs:0' rel_l2 inf" in err
    assert out.is_file() and (tmp_path / "tuned.pb.tune.toml").is_file()
    written = tf.compat.v1.GraphDef.FromString(out.read_bytes())
    assert _worst(graph_def, written, held) == math.inf    # what it was warned about

    # the default headroom keeps the logits float32: the same command passes
    code, stdout, err = run_cli(capsys, argv[:-2] + ["--force"])
    assert code == 0, err
    assert "held-out samples: inf -> " in stdout and "(ok)" in stdout
    assert "keep_fp32 logits (MatMul): logits:0 reaches 3.28e+04 on the tuning samples" in stdout
    # a headroom under 1 would call values past the range safe: refused, one line
    code, _, err = run_cli(capsys, argv[:-1] + ["0.5", "--force"])
    assert code == 2 and "--headroom 0.5" in err and len(err.strip().splitlines()) == 1


def test_an_input_past_float16s_range_is_fixed_in_at_most_3_trials(tmp_path):
    """The Keras CNN+LSTM export fed digits times 2e5: the input's cast to float16 overflows,
    and so do the activations it feeds, layer after layer, until the LSTM's gates bound
    them. One node per trial took 12 trials; the range margin keeps them at once."""
    digits = load_digits().images.astype(np.float32)[:, :, :, None] / 16.0 * 2e5
    tuned_on = [{"keras_tensor": digits[:8]}]
    held_out = [{"keras_tensor": digits[i:i + 8]} for i in (100, 300)]
    out = tmp_path / "tuned"
    result = tune(KERAS_EXPORT, out, feeds=tuned_on, holdout=held_out)
    assert result.ok and result.before == math.inf and result.trials <= 3
    assert result.holdout_before == math.inf and result.holdout_after <= TOL
    # the first convolution reads the input (through a cast, in the painted graph)
    assert any(k.node.endswith("/conv2d_1/convolution") for k in result.kept)
    assert result.lowp_after > 0
    # the written model holds on a held-out batch, run by TensorFlow itself
    x = tf.constant(held_out[1]["keras_tensor"])
    got = tf.saved_model.load(str(out)).signatures["serving_default"](keras_tensor=x)
    want = tf.saved_model.load(str(KERAS_EXPORT)).signatures["serving_default"](keras_tensor=x)
    got, want = got["output_0"].numpy(), want["output_0"].numpy()
    assert np.isfinite(got).all() and graphs.rel_l2(got, want) <= TOL


def test_a_model_verify_cannot_trace_is_tuned_without_the_margin_and_says_so(tmp_path):
    """A SavedModel whose signature writes a lookup table (the rows it has seen) cannot be
    replayed body by body (the insert would run twice, and a table, unlike variables, cannot be
    put back): tune still runs its trials, as it did before the margin, and says the margin
    was skipped and why."""
    class Counted(tf.Module):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.w = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32))
            self.seen = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def __call__(self, x):
            self.seen.insert(tf.range(tf.shape(x, out_type=tf.int64)[0]), tf.reduce_sum(x, 1))
            return {"y": tf.nn.relu(tf.matmul(x, self.w))}

    model = Counted()
    tf.saved_model.save(model, str(tmp_path / "counted"), signatures=model.__call__)
    feed = {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}
    result = tune(tmp_path / "counted", tmp_path / "tuned", feeds=[feed])
    assert result.ok and result.trials == 1 and (tmp_path / "tuned" / "saved_model.pb").is_file()
    assert result.message.startswith("range margin skipped: ")
    assert "writes a lookup table" in result.message
    assert "range margin skipped" in result.summary()


def test_an_error_margin_holds_the_tolerance_on_batches_the_tuning_passed_narrowly(
        tmp_path, capsys):
    """The precision analogue of the range margin: a softmax over scores near 48, where
    float16's step (1/32) costs about 0.01 of rel_l2, batch to batch a little over or under.
    The tuning batch passes at 0.0087, so tune keeps nothing and fails on held-out batches;
    with ``--error-margin 2`` a trial must reach 0.005 on the tuning batch, which keeps the
    scores float32 and passes every held-out batch, judged against the tolerance itself."""
    graph_def = tune_graphs.attention_softmax(bias=48.0)
    tuning = tune_graphs.inputs(32, n=16, seed=1)
    held = [tune_graphs.inputs(32, n=16, seed=s) for s in range(2, 12)]
    src, holdout = _files(tmp_path, "attention.pb", graph_def, tuning, held)

    def errors(converted, feeds):
        """rel_l2 of ``converted`` per feed, run here, not by tune."""
        return [graphs.rel_l2(graphs.run(converted, {"x:0": f["x"]}, ["out:0"])[0],
                              graphs.run(graph_def, {"x:0": f["x"]}, ["out:0"])[0])
                for f in feeds]

    # the premise: a precision loss, not a range one (every value is finite and far below
    # 65504), that the tuning batch passes just under the tolerance and held-out batches fail
    painted, _ = convert(graph_def)
    assert TOL / 2 < errors(painted, [tuning])[0] <= TOL
    assert sum(e > TOL for e in errors(painted, held)) >= 2

    out = tmp_path / "tuned.pb"
    argv = ["tune", src, "-o", out, "--inputs", tmp_path / "tune.npz", *holdout]
    code, stdout, err = run_cli(capsys, argv)
    assert code == 1 and "held-out samples: output 'out:0' rel_l2" in err
    assert "0 node(s) kept" in stdout and not out.exists()

    code, stdout, err = run_cli(capsys, argv + ["--error-margin", "2"])
    assert code == 0, err
    assert "tolerance 0.01 (tuned to 0.005: error margin 2)" in stdout
    assert "keep_fp32 biased (BiasAdd)" in stdout and "(ok)" in stdout
    written = tf.compat.v1.GraphDef.FromString(out.read_bytes())
    assert errors(written, [tuning])[0] <= TOL / 2
    assert max(errors(written, held)) <= TOL
    assert graphs.dtypes_of(written, name="scores")["scores"]["T"] == "float16"  # still low

    # a margin under 1 would loosen the tolerance, and inf would meet nothing: refused
    for bad in ("0.5", "inf", "nan"):
        code, _, err = run_cli(capsys, argv + ["--error-margin", bad, "--force"])
        assert code == 2 and f"--error-margin {bad}" in err, err
        assert len(err.strip().splitlines()) == 1


def _files(folder, name, graph_def, tuning, held) -> tuple:
    """The graph as ``folder/name``, the tuning sample as ``tune.npz`` and each held-out one as
    ``held{i}.npz``: the graph's path and the ``--holdout`` arguments naming them."""
    src = folder / name
    src.write_bytes(graph_def.SerializeToString())
    np.savez(folder / "tune.npz", **tuning)
    holdout = []
    for i, feed in enumerate(held):
        np.savez(folder / f"held{i}.npz", **feed)
        holdout += ["--holdout", folder / f"held{i}.npz"]
    return src, holdout
