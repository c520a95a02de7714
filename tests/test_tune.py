"""``amp-rewrite tune``: models that fail in float16 out of the box are tuned into ones that
pass, checked on held-out samples (never the ones tuned on), keeping the fewest nodes float32.

Each model fails because of where its values lie, not because a rule list is wrong for its
ops in general: (a) a sum over many large activations overflows 65504, (b) a softmax over
scores sharing a large bias loses the differences that matter, (c) the test corpus's Keras
CNN+LSTM+attention export fed digits scaled to 1e5.
"""

import importlib
import json
from pathlib import Path

import graphs
import numpy as np
import pytest
import tensorflow as tf
import tune_graphs
from refusals import run_cli
from sklearn.datasets import load_digits
from tensorflow.core.protobuf import meta_graph_pb2

from amp_rewrite import cli, convert
from amp_rewrite.conversion.pipeline import convert_file
from amp_rewrite.core.errors import InputError
from amp_rewrite.io.load import Model, load
from amp_rewrite.rules.loader import load_rules
from amp_rewrite.tools.tuning import keep_rule, tune
from amp_rewrite.tools.verify import verify

v1 = tf.compat.v1
TOL = 1e-2
KERAS_EXPORT = Path(__file__).parent / "data" / "keras_export"


def _samples(width, seeds, scale=1.0):
    return [tune_graphs.inputs(width, seed=s, scale=scale) for s in seeds]


def _worst(original, converted, samples, fetch):
    """The worst relative L2 error of ``converted`` against ``original`` over ``samples``."""
    worst = 0.0
    for feed in samples:
        feed = {f"{k}:0": v for k, v in feed.items()}
        want, = graphs.run(original, feed, [fetch])
        got, = graphs.run(converted, feed, [fetch])
        worst = max(worst, np.inf if not np.isfinite(got).all() else graphs.rel_l2(got, want))
    return worst


def _minimal(graph_def, kept, samples, fetch):
    """Every kept node is needed: releasing any one alone fails the tolerance."""
    for node in kept:
        rules = load_rules("float16", [])
        rules.node_rules.extend(keep_rule(k) for k in kept if k != node)
        converted, _ = convert(graph_def, rules=rules)
        assert _worst(graph_def, converted, samples, fetch) > TOL, f"{node} is not needed"


@pytest.mark.parametrize("build, width, scale, fetch, expect", [
    (tune_graphs.large_sum, 64, 10.0, "logits:0", {"pool", "head"}),
    (tune_graphs.attention_softmax, 32, 1.0, "out:0", {"biased"}),
])
def test_failing_graph_is_tuned_to_pass_on_held_out_samples(build, width, scale, fetch, expect):
    graph_def = build()
    tuned_on, held_out = _samples(width, [0, 1, 2], scale), _samples(width, [10, 11, 12, 13], scale)
    painted, _ = convert(graph_def)
    assert _worst(graph_def, painted, held_out, fetch) > TOL   # fails out of the box

    result = tune(Model.of_graph_def(graph_def), feeds=tuned_on, tolerance=TOL,
                  holdout=held_out)
    assert result.ok and result.before > TOL and result.after <= TOL
    assert {k.node for k in result.kept} == expect
    assert _worst(graph_def, result.graph_def, held_out, fetch) <= TOL
    assert result.holdout_before > TOL >= result.holdout_after
    assert result.lowp_after > 0            # not everything went back to float32
    assert result.trials <= 8
    _minimal(graph_def, sorted(expect), tuned_on, fetch)


def test_cli_writes_graph_and_rules_that_reapply_to_the_same_graph(tmp_path, capsys):
    src = tmp_path / "attention.pb"
    src.write_bytes(tune_graphs.attention_softmax().SerializeToString())
    samples = []
    for i, feed in enumerate(_samples(32, [0, 1])):
        samples += ["--inputs", tmp_path / f"s{i}.npz"]
        np.savez(tmp_path / f"s{i}.npz", **feed)
    out = tmp_path / "tuned.pb"
    code, stdout, err = run_cli(capsys, ["tune", src, "-o", out, *samples, "--tolerance", TOL,
                                         "--keep", "mix", "--min-matrix-intensity", "0"])
    assert code == 0, err
    rules = tmp_path / "tuned.pb.tune.toml"
    assert "keep_fp32 biased (BiasAdd)" in stdout and "trials" in stdout
    text = rules.read_text()
    assert 'glob = "biased"' in text and "attention:0 added" in text
    # the command the file says reapplies it gives the same bytes
    reapply = next(line for line in text.splitlines() if line.startswith("# Reapply: "))
    flags = reapply.split()[6:]
    assert flags[-2:] == ["--rules", "THIS_FILE"] and "--keep" in flags
    again = tmp_path / "again.pb"
    code, _, err = run_cli(capsys, [src, "-o", again, *flags[:-1], rules])
    assert code == 0, err
    assert again.read_bytes() == out.read_bytes()
    # refused before any work: the output exists
    code, _, err = run_cli(capsys, ["tune", src, "-o", out, *samples])
    assert code == 2 and "already exists" in err and len(err.strip().splitlines()) == 1


def test_relax_moves_what_only_the_lists_kept_float32_and_reapplies(tmp_path):
    """deep_cnn: conv4 and relu4 overflow; after keeping them and conv5, which reads relu4
    (the range margin), --relax tries the global average pool (Mean, on the deny list) in
    float16 next to its float16 neighbours, and the tolerance holds."""
    graph_def = tune_graphs.deep_cnn()
    src = tmp_path / "cnn.pb"
    src.write_bytes(graph_def.SerializeToString())
    held_out = [tune_graphs.images(seed=s) for s in (5, 6)]
    plain = tune(src, feeds=[tune_graphs.images()])
    result = tune(src, tmp_path / "out.pb", feeds=[tune_graphs.images()], relax=True)
    assert result.ok and {k.node for k in result.kept} == {"conv4", "relu4", "conv5"}
    assert result.forced == ["pool"] and result.lowp_after == plain.lowp_after + 1
    assert result.trials == plain.trials + 1
    assert _worst(graph_def, result.graph_def, held_out, "out:0") <= TOL
    text = (tmp_path / "out.pb.tune.toml").read_text()
    assert 'glob = "pool"\naction = "force_lowp"' in text
    convert_file(src, tmp_path / "again.pb", rules=[tmp_path / "out.pb.tune.toml"])
    assert (tmp_path / "again.pb").read_bytes() == (tmp_path / "out.pb").read_bytes()


def test_outputs_are_refused_before_the_search_and_inputs_never_written(tmp_path, capsys):
    src = tmp_path / "sum.pb"
    src.write_bytes(tune_graphs.large_sum().SerializeToString())
    sample = tmp_path / "s.npz"
    np.savez(sample, **tune_graphs.inputs(64, scale=10.0))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "adir").mkdir()
    for argv, message in [
            (["-o", tmp_path / "adir", "--force"], "is a directory"),
            (["-o", tmp_path / "o.pb", "--report", sample], "would overwrite"),
            (["-o", tmp_path / "o.pb", "--rules-out", src, "--force"], "would overwrite")]:
        code, _, err = run_cli(capsys, ["tune", src, "--inputs", sample, *argv])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    # a SavedModel output inside the input SavedModel: refused before any trial
    with pytest.raises(InputError, match="inside the input SavedModel"):
        tune(KERAS_EXPORT, KERAS_EXPORT / "sub", feeds=[{"keras_tensor": np.zeros((2, 8, 8, 1),
                                                                                  np.float32)}])
    assert not (KERAS_EXPORT / "sub").exists() and not (KERAS_EXPORT / "sub.tune.toml").exists()


def test_force_lowp_on_a_while_is_refused_with_a_warning(tmp_path):
    """A functional op takes its dtypes from its functions: forcing one would break its
    contract with them (found by tune --relax on the Keras export)."""
    rules = tmp_path / "while.toml"
    rules.write_text('[[override]]\nglob = "*/lstm_1/while"\naction = "force_lowp"\n')
    report = convert_file(KERAS_EXPORT, tmp_path / "out", rules=[rules])
    assert any("force_lowp refused" in w and "(While)" in w for w in report.warnings)
    assert all(n.code != "user_force" for n in report.nodes if n.op == "While")


def test_public_tune_is_the_function_whatever_was_imported_first():
    importlib.import_module("amp_rewrite.cli.commands")   # the CLI's module imports .tuning
    from amp_rewrite import tune as public
    assert callable(public) and public.__module__ == "amp_rewrite.tools.tuning"


def test_budget_and_unmeetable_tolerance_end_with_a_message_and_nothing_written(tmp_path, capsys):
    src = tmp_path / "sum.pb"
    src.write_bytes(tune_graphs.large_sum().SerializeToString())
    np.savez(tmp_path / "s.npz", **tune_graphs.inputs(64, scale=10.0))
    out = tmp_path / "out.pb"
    # the painted graph fails, and the range margin (which would pass) needs a second trial
    code, _, err = run_cli(capsys, ["tune", src, "-o", out, "--inputs", tmp_path / "s.npz",
                                    "--max-trials", "1"])
    assert code == 1 and "not met within --max-trials 1" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz", "sum.pb"]

    # a metric that no conversion can satisfy (it calls every converted output wrong) ends
    # once every node is back in float32, after a bounded number of trials
    calls = []

    def stubborn(ref, out):
        calls.append(1)
        return 0.0 if len(calls) <= 1 else 1.0

    result = tune(src, out, feeds=[tune_graphs.inputs(64, scale=10.0)], metric=stubborn,
                  tolerance=0.5)
    assert not result.ok and "cannot be met" in result.message
    assert result.trials <= 4 and not out.exists()


def test_metric_failing_on_the_float32_model_itself_is_refused():
    with pytest.raises(InputError, match="float32 model scored against itself"):
        tune(Model.of_graph_def(tune_graphs.large_sum()), feeds=[tune_graphs.inputs(64)],
             metric=lambda ref, out: 1.0, tolerance=0.1)


def test_custom_metric_sees_outputs_by_name_and_feeds_may_be_a_generator():
    seen = []

    def worst_probability(ref, out):
        seen.append(sorted(ref))
        return float(np.max(np.abs(ref["out:0"] - out["out:0"])))

    feeds = (tune_graphs.inputs(32, seed=s) for s in range(2))
    result = tune(Model.of_graph_def(tune_graphs.attention_softmax()), feeds=feeds,
                  metric=worst_probability, tolerance=0.05)
    assert result.ok and result.metric == "worst_probability"
    assert seen[0] == ["out:0"] and result.after <= 0.05 < result.before


def test_top1_metric_on_a_classifier():
    graph_def = tune_graphs.large_sum()
    result = tune(Model.of_graph_def(graph_def), feeds=_samples(64, [0, 1], 10.0), metric="top1")
    assert result.ok and result.tolerance == pytest.approx(0.01)
    assert result.before == 1.0 and result.after == 0.0    # inf rows never agree


def test_inference_metagraph_with_variables(tmp_path):
    """A MetaGraph's variables are run through their initializers once and shared with each
    trial, as verify does."""
    g = tf.Graph()
    rng = np.random.default_rng(0)
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        w1 = v1.get_variable("w1", initializer=rng.standard_normal((64, 256)).astype(np.float32))
        w2 = v1.get_variable("w2", initializer=rng.uniform(0.5, 1.5, (256, 16)).astype(np.float32))
        sq = tf.square(tf.nn.relu(tf.matmul(x, w1)), name="square")
        tf.identity(tf.matmul(sq, w2, name="pool") * 1e-6, name="out")
        meta = v1.train.export_meta_graph(graph=g)
    path = tmp_path / "model.meta"
    path.write_bytes(meta.SerializeToString())
    result = tune(path, tmp_path / "out.meta", feeds=_samples(64, [0, 1], 10.0))
    assert result.ok and [k.node for k in result.kept] == ["pool"]
    written = meta_graph_pb2.MetaGraphDef()
    written.ParseFromString((tmp_path / "out.meta").read_bytes())
    pool = next(n for n in written.graph_def.node if n.name == "pool")
    assert pool.attr["T"].type == tf.float32.as_datatype_enum


def test_keras_export_with_extreme_inputs_is_tuned_through_function_bodies(tmp_path):
    """(c): the Keras CNN+LSTM+attention SavedModel fed digits scaled to 1e5: the input no
    longer fits float16. Overrides name function-body nodes ``function/node``."""
    src = KERAS_EXPORT
    digits = load_digits().images.astype(np.float32)[:, :, :, None] / 16.0 * 1e5
    tuned_on = [{"keras_tensor": digits[i:i + 8]} for i in (0, 8)]
    held_out = [{"keras_tensor": digits[i:i + 8]} for i in (100, 200, 300)]
    out = tmp_path / "tuned"
    result = tune(src, out, feeds=tuned_on, holdout=held_out)
    assert result.ok and result.before == np.inf and result.holdout_before == np.inf
    assert result.holdout_after <= TOL
    assert result.kept and all("/" in k.node and k.node.startswith(("__inference", "functional"))
                               for k in result.kept)
    model = tf.saved_model.load(str(out))
    fp32 = tf.saved_model.load(str(src))
    for feed in held_out:
        x = tf.constant(feed["keras_tensor"])
        got = model.signatures["serving_default"](keras_tensor=x)["output_0"].numpy()
        want = fp32.signatures["serving_default"](keras_tensor=x)["output_0"].numpy()
        assert np.isfinite(got).all() and graphs.rel_l2(got, want) <= TOL
    # the rules file reapplies to the same decisions
    again = tmp_path / "again"
    report = convert_file(src, again, rules=[str(out) + ".tune.toml"])
    assert {n.name for n in report.nodes if n.code == "user_keep"} == {k.node for k in result.kept}
    assert load(again).meta_graphs[0].graph_def == load(out).meta_graphs[0].graph_def


# -- a tuned graph file passes verify ---------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"


def _two_outputs(path):
    """A GraphDef with two outputs: ``embedding`` is fine in float16, ``logits`` (a large
    sum, as :func:`tune_graphs.large_sum`) overflows; tune must score both, as verify does."""
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        h = tf.nn.relu(tf.matmul(x, rng.standard_normal((64, 256)).astype(np.float32),
                                 name="dense1"), name="relu")
        tf.tanh(tf.matmul(h, rng.standard_normal((256, 8)).astype(np.float32) * 0.01),
                name="embedding")
        pooled = tf.matmul(tf.square(h), rng.uniform(0.5, 1.5, (256, 16)).astype(np.float32),
                           name="pool")
        tf.matmul(pooled, rng.standard_normal((16, 10)).astype(np.float32) * 1e-4, name="logits")
    path.write_bytes(g.as_graph_def().SerializeToString())


def _with_variables(path):
    """An inference MetaGraph whose weights are variables with unseeded random initializers:
    tune and verify must run them with the same values."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        w1 = v1.get_variable("w1", [64, 256], initializer=v1.random_normal_initializer())
        w2 = v1.get_variable("w2", [256, 16], initializer=v1.random_uniform_initializer(0.5, 1.5))
        sq = tf.square(tf.nn.relu(tf.matmul(x, w1)), name="square")
        tf.identity(tf.matmul(sq, w2, name="pool") * 1e-6, name="out")
        path.write_bytes(v1.train.export_meta_graph(graph=g).SerializeToString())


def _digits(path):
    images = load_digits().images.astype(np.float32)[:64, :, :, None] / 16.0
    np.savez(path, images=images)


@pytest.mark.parametrize("model, options, tolerance", [
    # the bundled CNN on digits in bfloat16 (1e-3 out of the box), held to 5e-4
    ("cnn.pb", dict(target="bfloat16", device="cpu", min_matrix_intensity=0), 5e-4),
    ("two_outputs.pb", {}, TOL),
    ("variables.meta", {}, TOL),
])
def test_a_tuned_graph_file_passes_verify_on_the_same_inputs_and_tolerance(
        model, options, tolerance, tmp_path):
    src, data = tmp_path / model, tmp_path / "data.npz"
    if model == "cnn.pb":
        src.write_bytes(EXAMPLE.read_bytes())
        _digits(data)
    else:
        (_two_outputs if model == "two_outputs.pb" else _with_variables)(src)
        np.savez(data, x=tune_graphs.inputs(64, scale=10.0)["x"])
    painted, out = tmp_path / f"painted{src.suffix}", tmp_path / f"tuned{src.suffix}"
    convert_file(src, painted, **options)
    before = verify(src, painted, inputs=str(data), rel_l2=tolerance)
    assert not before.ok    # out of the box it fails: tune has work to do

    result = tune(src, out, feeds=[data], tolerance=tolerance, **options)
    assert result.ok and result.kept
    after = verify(src, out, inputs=str(data), rel_l2=tolerance)
    assert after.ok, after.failures()
    assert cli.main(["verify", str(src), str(out), "--inputs", str(data), "--rel-l2",
                     str(tolerance), "-q"]) == 0
    # tune measured what verify measures: the same outputs, run the same way, the same numbers
    for mine, theirs in ((result.before, before), (result.after, after)):
        assert mine == pytest.approx(max(o.rel_l2 for o in theirs.outputs), rel=1e-6)


def _near_tied_scores(folder: Path):
    """A classifier of two scores whose float16 MatMul keeps the logits' relative L2 error far
    under float16's 1e-2 while moving the argmax of several percent of the rows: in 8% of them
    two large inputs cancel (float16's rounding of them survives the cancellation) and the two
    scores differ by 2% (more than verify's near-tie margin). Returns the graph and inputs."""
    v1 = tf.compat.v1
    r = np.random.default_rng(1)
    v, eps = r.normal(0, 1, 2).astype(np.float32), np.float32(0.01)
    weights = np.stack([v, -v * (1 + eps), r.normal(0, 1, 2), r.normal(0, 1, 2)]).astype(np.float32)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        tf.identity(tf.matmul(x, weights), name="scores")
    inputs = np.zeros((400, 4), np.float32)
    inputs[:, 2:] = r.normal(0, 1, (400, 2))
    cancel = r.random(400) < 0.08
    inputs[cancel, :2] = [100.0, 100.0 / (1 + eps)]
    inputs[cancel, 2:] = np.linalg.solve(weights[2:].T, [0.1, 0.102])
    (folder / "model.pb").write_bytes(g.as_graph_def().SerializeToString())
    np.savez(folder / "x.npz", x=inputs)
    return folder / "model.pb", folder / "x.npz"


def test_tune_accepts_only_what_verify_accepts_top1_included(tmp_path):
    """tune's default metric is the relative L2 error; verify by default also holds batches of
    scores to 99% top-1 agreement. A conversion that passes the first and not the second must
    not be tune's answer: a tuned model passes verify on the same inputs."""
    model, data = _near_tied_scores(tmp_path)
    convert_file(model, tmp_path / "plain.pb", target="float16")
    plain = verify(model, tmp_path / "plain.pb", inputs=data)
    assert plain.outputs[0].rel_l2 < 1e-2 and plain.outputs[0].failed == ["top1"]
    result = tune(model, tmp_path / "tuned.pb", feeds=[data], target="float16")
    assert result.ok and result.before < result.tolerance   # the metric alone passed trial 0
    assert [k.op for k in result.kept] == ["MatMul"]
    assert verify(model, tmp_path / "tuned.pb", inputs=data).ok


def test_a_result_tune_kept_all_float32_says_it_is_a_float32_model(tmp_path, capsys):
    """A tolerance float16 cannot meet on any matrix op: tune keeps them all float32 and
    passes, but its output is a float32 model. It says so as convert does of such an output,
    with why (the tolerance), even with -q; the summary, the report and the page are no plain
    success; the rules file it wrote converts to the same warning."""
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        h = tf.nn.relu(tf.matmul(x, rng.normal(0, 0.2, (64, 32)).astype(np.float32)), name="h")
        tf.identity(tf.matmul(h, rng.normal(0, 0.2, (32, 10)).astype(np.float32)), name="y")
    src = tmp_path / "digits.pb"
    src.write_bytes(g.as_graph_def().SerializeToString())
    digits = (load_digits().data / 16).astype(np.float32)
    np.savez(tmp_path / "a.npz", x=digits[:32])
    np.savez(tmp_path / "b.npz", x=digits[32:64])
    out = tmp_path / "tuned.pb"
    code, stdout, err = run_cli(capsys, [
        "tune", src, "-o", out, "--inputs", tmp_path / "a.npz", "--holdout", tmp_path / "b.npz",
        "--tolerance", "1e-9", "--report", tmp_path / "r.json", "--html", tmp_path / "r.html",
        "-q"])
    assert code == 0, err
    said = ("the output is a float32 model: none of its 2 MatMul/Conv-family ops computes in "
            "float16")
    (warning,) = [ln for ln in err.splitlines() if said in ln]
    assert warning.startswith("amp-rewrite: warning: ")
    assert ("why: the tolerance: tune kept float32 the 2 matrix op(s) the painted graph ran "
            "in float16 to meet rel_l2 <= 1e-09 on its 1 sample(s)") in warning
    code, stdout, err = run_cli(capsys, [
        "tune", src, "-o", out, "--inputs", tmp_path / "a.npz", "--tolerance", "1e-9",
        "--force"])
    assert code == 0 and said in err
    assert stdout.splitlines()[1].startswith(f"tuned to a float32 model, no plain success: {said}")
    report = json.loads((tmp_path / "r.json").read_text())
    assert any(said in w for w in report["warnings"])
    page = (tmp_path / "r.html").read_text()
    assert "a float32 model" in page and "within tolerance" not in page.split("verdict")[1][:200]
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "again.pb", "--rules",
                                    tmp_path / "tuned.pb.tune.toml"])
    assert code == 0 and said in err
