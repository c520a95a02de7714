"""What bfloat16 for a CPU does without a flag: a SavedModel that only serves is frozen (its
weights stored once in bfloat16, its batch norms folded), a graph without variables is folded;
where freezing would lose something the model holds, its variables are kept and the summary
says why (docs/decisions.md "Frozen and folded by default")."""

import json

import graphs
import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.saved_model import loader_impl

from amp_rewrite import convert, convert_file
from amp_rewrite.conversion import pipeline
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.transforms import constfold

L = keras.layers
BF16 = dict(target="bfloat16", device="cpu")


def _cnn():
    """Conv (a trained bias) -> batch norm -> ReLU, twice, pooled into 10 logits."""
    keras.utils.set_random_seed(3)
    x = keras.Input((16, 16, 3), name="image")
    h = x
    for width in (32, 64):
        h = L.ReLU()(L.BatchNormalization()(L.Conv2D(width, 3, padding="same")(h)))
    model = keras.Model(x, L.Dense(10)(L.GlobalAveragePooling2D()(h)))
    rng = np.random.default_rng(0)
    model.set_weights([w + rng.normal(0, 0.1, w.shape).astype(np.float32) if w.ndim == 1 else w
                       for w in model.get_weights()])
    return model


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("default")
    model = _cnn()
    model.export(str(folder / "cnn"), verbose=False)
    x = np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype(np.float32)
    return folder / "cnn", x, model.predict(x, verbose=0)


def _matrix_dtypes(report):
    return {n.precision for n in report.nodes if n.op in MATRIX_OPS}


def _variables(folder) -> int:
    meta = loader_impl.parse_saved_model(str(folder)).meta_graphs[0]
    nodes = list(meta.graph_def.node) + [
        nd for f in meta.graph_def.library.function for nd in f.node_def]
    return sum(1 for nd in nodes if nd.op == "VarHandleOp")


def test_a_serving_savedmodel_is_frozen_and_folded_by_default(export, tmp_path):
    src, x, want = export
    report = convert_file(src, tmp_path / "out", **BF16)
    frozen = report.extra["freeze"]
    assert frozen["by_default"] and frozen["methods"] == ["serve"] and not frozen["dropped"]
    assert "frozen by default" in report.format_summary()
    assert report.extra["fusion"]["bias_adds"] == 2   # each trained bias and batch norm: one
    assert _matrix_dtypes(report) == {"bfloat16"}
    assert _variables(tmp_path / "out") == 0
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    assert sorted(loaded.signatures) == ["serve", "serving_default"]
    for got in (loaded.serve(tf.constant(x)),
                list(loaded.signatures["serving_default"](image=tf.constant(x)).values())[0]):
        assert graphs.rel_l2(got.numpy(), want) < 2e-2   # bfloat16 rounding


def test_no_freeze_keeps_the_variables_and_says_so(export, tmp_path):
    src, x, want = export
    report = convert_file(src, tmp_path / "out", freeze=False, **BF16)
    assert report.extra["freeze"]["frozen"] is False
    assert "the variables kept: asked (freeze=False)" in report.format_summary()
    assert _variables(tmp_path / "out") == _variables(src) > 0
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    assert graphs.rel_l2(loaded.serve(tf.constant(x)).numpy(), want) < 2e-2


def test_float16_for_a_gpu_is_not_frozen_by_default(export, tmp_path):
    src, _, _ = export
    report = convert_file(src, tmp_path / "out", target="float16")
    assert "freeze" not in report.extra
    assert _variables(tmp_path / "out") == _variables(src)


class _Served(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).normal(0, 0.1, (64, 64)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def serve(self, x):
        return {"y": tf.nn.relu(tf.matmul(x, self.w))}


def test_what_freezing_would_lose_keeps_the_variables(tmp_path):
    """A train method (no signature reaches it) and a method that serves no signature would be
    lost frozen: such a SavedModel keeps its variables, and the summary names why; --freeze
    still freezes the second, naming the method it drops."""
    trains = _Served()
    trains.train = tf.function(
        lambda x: trains.w.assign_sub(0.1 * tf.reduce_mean(x) * tf.ones_like(trains.w)),
        input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    tf.saved_model.save(trains, str(tmp_path / "trains"), signatures={"serving_default": trains.serve})
    report = convert_file(tmp_path / "trains", tmp_path / "a", **BF16)
    assert report.extra["freeze"]["frozen"] is False
    assert "writes a variable (a train step)" in report.extra["freeze"]["reason"]
    assert _variables(tmp_path / "a") == 1

    other = _Served()
    other.double = tf.function(lambda x: {"z": 2.0 * tf.matmul(x, other.w)},
                               input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    tf.saved_model.save(other, str(tmp_path / "other"), signatures={"serving_default": other.serve})
    report = convert_file(tmp_path / "other", tmp_path / "b", **BF16)
    assert report.extra["freeze"]["frozen"] is False
    assert "would not carry its method double" in report.extra["freeze"]["reason"]
    asked = convert_file(tmp_path / "other", tmp_path / "c", freeze=True, **BF16)
    assert asked.extra["freeze"]["dropped"] == ["double"] and asked.extra["freeze"]["methods"] == ["serve"]
    assert "NOT carried into the output: method double" in asked.format_summary()
    loaded = tf.saved_model.load(str(tmp_path / "c"))
    assert hasattr(loaded, "serve") and not hasattr(loaded, "double")


def test_variables_too_big_to_freeze_by_default_are_kept(export, tmp_path, monkeypatch):
    src, _, _ = export
    monkeypatch.setattr(pipeline, "FREEZE_BY_DEFAULT_BYTES", 1000)
    report = convert_file(src, tmp_path / "out", **BF16)
    assert report.extra["freeze"]["frozen"] is False
    assert "more than freezing by default takes" in report.extra["freeze"]["reason"]


def _frozen_block():
    """A frozen Conv -> batch norm (four Consts) -> ReLU6 block, as a frozen Keras graph."""
    r = np.random.default_rng(2)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16, 16, 8], name="x")
        k = tf.constant(r.normal(0, 0.3, (3, 3, 8, 64)).astype(np.float32))
        y = tf.nn.conv2d(x, k, 1, "SAME")
        gamma, var = (tf.constant(r.uniform(0.5, 1.5, 64).astype(np.float32)) for _ in range(2))
        beta, mean = (tf.constant(r.normal(0, 0.1, 64).astype(np.float32)) for _ in range(2))
        scale = gamma * tf.math.rsqrt(var + 1e-3)
        tf.identity(tf.nn.relu6(y * scale + (beta - mean * scale)), name="out")
    return g.as_graph_def()


def test_a_graph_without_variables_is_folded_by_default_for_bfloat16_on_a_cpu():
    gd = _frozen_block()
    _, report = convert(gd, **BF16)
    assert report.extra["fusion"]["bias_adds"] == 1
    _, asked_not = convert(gd, fold_constants=False, **BF16)
    _, gpu = convert(gd, target="float16")
    assert "fusion" not in asked_not.extra and "fusion" not in gpu.extra


def test_grappler_folds_only_where_a_node_computes_from_consts_alone(monkeypatch):
    """Its pass takes seconds on a large graph that holds nothing to fold: a graph whose every
    op reads a placeholder's value is converted without it (and still has its batch norms'
    Consts folded into the convolution by amp-rewrite's own rewrite)."""
    assert constfold.foldable(_frozen_block())

    def refuse(*args, **kwargs):
        raise AssertionError("grappler's constant folding ran on a graph with nothing to fold")

    r = np.random.default_rng(3)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16, 16, 8], name="x")
        k = tf.constant(r.normal(0, 0.3, (3, 3, 8, 64)).astype(np.float32))
        y = tf.nn.conv2d(x, k, 1, "SAME") * tf.constant(r.uniform(0.5, 1.5, 64).astype(np.float32))
        tf.identity(tf.nn.relu6(y + tf.constant(r.normal(0, 0.1, 64).astype(np.float32))), name="out")
    gd = g.as_graph_def()
    assert not constfold.foldable(gd)
    monkeypatch.setattr(constfold, "fold_constants", refuse)
    _, report = convert(gd, **BF16)
    assert report.extra["fusion"]["scales_folded"] == 1 and report.extra["fusion"]["bias_adds"] == 1
    with pytest.raises(AssertionError, match="nothing to fold"):
        convert(_frozen_block(), **BF16)


def test_the_cli_freezes_by_default_and_no_freeze_keeps_the_variables(export, tmp_path, capsys):
    from amp_rewrite.cli.run import main
    src, _, _ = export
    assert main([str(src), "-o", str(tmp_path / "a"), "--target", "bfloat16", "--device", "cpu",
                 "--report", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["freeze"]["by_default"] is True
    assert "frozen by default" in capsys.readouterr().out
    assert main([str(src), "-o", str(tmp_path / "b"), "--target", "bfloat16", "--device", "cpu",
                 "--no-freeze"]) == 0
    assert "the variables kept: asked (--no-freeze)" in capsys.readouterr().out
    assert _variables(tmp_path / "b") == _variables(src)
