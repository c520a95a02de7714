"""verify's checks: a good float16 conversion of a trained Keras classifier passes the
defaults (relative L2 and top-1 agreement), the old per-element test is one check among
others, and every result says which check each output failed."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from test_html import _Dom

from amp_rewrite import cli, convert_file
from amp_rewrite.tools.verify import ErrorStats, verify


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A small CNN trained on digits, exported with ``model.export``; its float16 and bfloat16
    conversions; the 397 held-out digits as ``--inputs``."""
    folder = tmp_path_factory.mktemp("classifier")
    keras.utils.set_random_seed(0)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    inp = keras.Input((8, 8, 1), name="digits")
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.Dense(256, activation="relu")(keras.layers.Flatten()(h))
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:1400], y[:1400], epochs=8, batch_size=64, verbose=0)
    model.export(str(folder / "fp32"), verbose=False)
    convert_file(folder / "fp32", folder / "f16", target="float16")
    # painted whole: on a CPU the cost model, which now sees the variables' shapes, keeps
    # this small SavedModel float32, and this test is about verify's bfloat16 defaults
    convert_file(folder / "fp32", folder / "bf16", target="bfloat16", device="cpu",
                 min_matrix_intensity=0)
    np.savez(folder / "test.npz", digits=x[1400:])
    np.savez(folder / "four.npz", digits=x[1400:1404])
    return folder


def test_float16_classifier_passes_the_defaults_the_old_test_failed(classifier):
    """The user's finding: logits at relative L2 ~3e-4 with every argmax the same, yet some
    elements outside 0.001 + 0.01*|x| (logits near zero)."""
    f = classifier
    result = verify(f / "fp32", f / "f16", inputs=str(f / "test.npz"))
    assert result.ok and result.criteria.checks == ("rel_l2", "top1")
    assert result.criteria.dtype == "float16" and result.criteria.rel_l2 == 1e-2
    (out,) = result.outputs
    assert 0 < out.rel_l2 < 1e-3 and out.nonfinite == 0
    assert (out.top1, out.rows, out.top1_disagree) == (1.0, 397, 0)
    assert [(c.check, c.threshold, c.ok) for c in out.checks] == [("rel_l2", 1e-2, True),
                                                                  ("top1", 0.99, True)]
    # the old per-element test, now chosen by name: a few elements out, and it says so
    old = verify(f / "fp32", f / "f16", inputs=str(f / "test.npz"), checks=["allclose"])
    (out_old,) = old.outputs
    assert not old.ok and out_old.failed == ["allclose"] and old.failures() == {"output_0": ["allclose"]}
    assert 0 < out_old.out_of_tolerance < 0.01
    assert out_old.rel_l2 == out.rel_l2 and (old.rtol, old.atol) == (1e-2, 1e-3)
    bf16 = verify(f / "fp32", f / "bf16", inputs=str(f / "test.npz"))
    assert bf16.ok and bf16.criteria.rel_l2 == 5e-2
    assert out.rel_l2 < bf16.outputs[0].rel_l2 < 1e-2 and bf16.outputs[0].top1 >= 0.99


def test_check_flags_and_exit_codes(classifier, tmp_path):
    f = classifier
    base = ["verify", str(f / "fp32"), str(f / "f16"), "--inputs", str(f / "test.npz"), "-q"]
    assert cli.main(base) == 0
    assert cli.main(base + ["--check", "top1"]) == 0
    assert cli.main(base + ["--check", "allclose"]) == 1
    assert cli.main(base + ["--check", "rel_l2", "--rel-l2", "1e-5"]) == 1
    assert cli.main(base + ["--max-abs", "1e-6"]) == 1             # a threshold adds its check
    assert cli.main(base + ["--check", "max_abs", "--max-abs", "1"]) == 0
    assert cli.main(base + ["--rtol", "0.05", "--atol", "0.05"]) == 0
    # mistakes answer with exit 2: no default for max_abs, a threshold of a check not chosen,
    # a share over 1, an unknown check
    assert cli.main(base + ["--check", "max_abs"]) == 2
    assert cli.main(base + ["--check", "rel_l2", "--max-abs", "1"]) == 2
    assert cli.main(base + ["--top1", "1.5"]) == 2
    with pytest.raises(SystemExit) as usage:       # argparse's own refusal
        cli.main(base + ["--check", "argmax"])
    assert usage.value.code == 2
    # the JSON of the HTML report carries the checks and which failed; the page shows them
    page = tmp_path / "verify.html"
    assert cli.main(base + ["--check", "rel_l2", "--check", "allclose", "--html", str(page)]) == 1
    dom = _Dom()
    dom.feed(page.read_text())
    (row,) = dom.tables["verify"]
    assert row[0] == "output_0" and row[-2] == "allclose" and row[-1] == "NO"
    assert 0 < float(row[2]) < 1e-3 and float(row[3]) == 100.0
    result = verify(f / "fp32", f / "f16", inputs=str(f / "test.npz"), checks=["rel_l2", "allclose"])
    data = json.loads(json.dumps(result.to_dict()))
    assert data["failed"] == {"output_0": ["allclose"]} and data["ok"] is False
    assert [c["check"] for c in data["checks"]] == ["rel_l2", "allclose"]
    assert data["checks"][1] == {"check": "allclose", "rtol": 1e-2, "atol": 1e-3}
    assert [(c["check"], c["ok"]) for c in data["outputs"][0]["checks"]] == [("rel_l2", True),
                                                                             ("allclose", False)]


def test_top1_counts_near_ties_as_agreeing_and_judges_small_batches(classifier):
    """On the real logits of the two models: a row whose two classes the original separates by
    less than the rel_l2 bound times the row's norm may swap; one that is clearly decided may
    not, and in a batch of four one such row fails the check."""
    f = classifier
    x = np.load(f / "four.npz")["digits"]
    models = [tf.saved_model.load(str(f / name)) for name in ("fp32", "f16")]
    logits = [m.serve(tf.constant(x)).numpy().astype(np.float64) for m in models]
    small = verify(f / "fp32", f / "f16", inputs=str(f / "four.npz"))
    assert small.ok and (small.outputs[0].rows, small.outputs[0].top1) == (4, 1.0)
    orig, conv = logits
    a, b = np.argsort(orig[0])[-1], np.argsort(orig[0])[-2]
    margin = 1e-2 * np.linalg.norm(orig[0])
    for gap, tie in ((0.5 * margin, True), (2.0 * margin, False)):
        ref, out = orig.copy(), conv.copy()
        ref[0, b] = ref[0, a] - gap            # the original barely (or clearly) prefers a
        out[0, b] = out[0, a] + 1e-3           # the conversion prefers b
        stats = ErrorStats(1e-2, 1e-3, tie=1e-2)
        stats.update(ref, out)
        assert (stats.rows, stats.ties, stats.agree) == (4, int(tie), 3)
        assert stats.top1 == (1.0 if tie else 0.75)
    # a row that turned non-finite never agrees
    out = conv.copy()
    out[1, 0] = np.inf
    stats = ErrorStats(1e-2, 1e-3, tie=1e-2)
    stats.update(orig, out)
    assert stats.top1 == 0.75 and stats.nonfinite == 1 and stats.rel_l2 == np.inf


def _accuracy_graph(path, weights, shift):
    """A linear classifier of 200 digits, ``weights`` and a per-sample ``shift`` of its scores
    as constants, and its accuracy as the one output: the mean of a cast
    ``Equal(ArgMax(scores), labels)``."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [200, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [200], name="y")
        scores = tf.matmul(x, tf.constant(weights)) + tf.constant(shift)
        hits = tf.equal(tf.argmax(scores, 1, output_type=tf.int32), y)
        tf.identity(tf.reduce_mean(tf.cast(hits, tf.float32)), name="accuracy")
    path.write_bytes(g.as_graph_def().SerializeToString())


def test_an_accuracy_is_judged_by_the_decisions_that_moved(tmp_path):
    """An accuracy moves by whole samples: one digit of 200 flipping moves a ~0.1 accuracy by
    ~5% relative (over the rel_l2 bound) but by half a point, within top1's one-point
    allowance: it passes; weights that move the accuracy further fail top1."""
    x, y = load_digits(return_X_y=True)
    x, y = (x[:200] / 16.0).astype(np.float32), y[:200].astype(np.int32)
    np.savez(tmp_path / "in.npz", x=x, y=y)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 10)).astype(np.float32)
    none = np.zeros((200, 10), np.float32)
    right = int(np.flatnonzero(np.argmax(x @ w, 1) == y)[0])
    one_wrong = none.copy()
    one_wrong[right, y[right]] = -1e4        # that sample's right class falls last
    _accuracy_graph(tmp_path / "a.pb", w, none)
    _accuracy_graph(tmp_path / "b.pb", w, one_wrong)
    one = verify(tmp_path / "a.pb", tmp_path / "b.pb", inputs=str(tmp_path / "in.npz"))
    (out,) = one.outputs
    assert out.name == "accuracy:0" and out.rel_l2 > 1e-2 and out.decisions and out.top1 is None
    assert out.max_abs == pytest.approx(1 / 200)
    assert one.ok and [(c.check, c.threshold) for c in out.checks] == [("top1", pytest.approx(0.01))]
    assert out.checks[0].value == pytest.approx(0.005)
    _accuracy_graph(tmp_path / "c.pb", rng.normal(size=(64, 10)).astype(np.float32), none)
    many = verify(tmp_path / "a.pb", tmp_path / "c.pb", inputs=str(tmp_path / "in.npz"))
    assert not many.ok and many.failures() == {"accuracy:0": ["top1"]}
    # rel_l2 chosen by name judges it as asked
    asked = verify(tmp_path / "a.pb", tmp_path / "b.pb", inputs=str(tmp_path / "in.npz"),
                   checks=["rel_l2"])
    assert asked.failures() == {"accuracy:0": ["rel_l2"]}
