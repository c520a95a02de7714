"""A SavedModel's conversion says where freezing its variables and converting with
--fold-constants would gain (the cost model's FreezeGain, docs/savedmodels.md "When freezing
gains"), and stays quiet where it would not."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

from amp_rewrite import convert, convert_file
from amp_rewrite.conversion.graph import FREEZE_HINT_SHARE, FREEZE_HINT_US
from amp_rewrite.core.ops import MATRIX_OPS

L = keras.layers


def _trained(model):
    """``model`` with its batch norms' statistics and affine parameters drawn as a trained
    network's look (an untrained one folds away to nothing, leaving no bias to fuse)."""
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.get_weights()[0].shape
            layer.set_weights([rng.uniform(0.5, 1.5, n).astype(np.float32),
                               rng.normal(0, 0.1, n).astype(np.float32),
                               rng.normal(0, 0.1, n).astype(np.float32),
                               rng.uniform(0.5, 1.5, n).astype(np.float32)])
    return model


def _cnn():
    """Conv+BatchNorm+ReLU6 and a depthwise one, MobileNetV2-style: as a SavedModel the batch
    norms read variables, so the ReLU6 would run unfused in bfloat16."""
    x = keras.Input((16, 16, 16))
    h = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(64, 3, padding="same", use_bias=False)(x)))
    h = L.ReLU(6.0)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same",
                                                              use_bias=False)(h)))
    h = L.BatchNormalization()(L.Conv2D(32, 1, use_bias=False)(h))
    return _trained(keras.Model(x, L.Dense(10)(L.GlobalAveragePooling2D()(h))))


def _gru():
    """The benchmark's GRU text classifier, shorter: 128 units, weighed by the cost model."""
    ids = keras.Input((8,), dtype="int32")
    return keras.Model(ids, L.Dense(2)(L.GRU(128)(L.Embedding(500, 128)(ids))))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    keras.utils.set_random_seed(0)
    root = tmp_path_factory.mktemp("freezing")
    paths = {}
    for name, build in (("cnn", _cnn), ("gru", _gru)):
        paths[name] = root / name
        build().export(str(paths[name]), verbose=False)
    return paths


def _suggests(report) -> bool:
    return any(w.startswith("freeze the signature") and "--fold-constants" in w
               for w in report.warnings)


def test_batch_norms_on_variables_suggest_freezing(exported, tmp_path):
    report = convert_file(exported["cnn"], tmp_path / "out", target="bfloat16", device="cpu")
    gain = report.extra["freezing"]
    convs = [n for n in report.nodes if n.op in MATRIX_OPS and "Conv" in n.op]
    # as it is, the unfused ReLU6s keep the convolutions float32; frozen they would fuse
    assert convs and all(n.code == "cost" for n in convs), [(n.name, n.code) for n in convs]
    assert gain["matrix_ops"] >= len(convs)
    assert gain["gain_us"] >= max(FREEZE_HINT_US, FREEZE_HINT_SHARE * gain["fp32_us"])
    assert _suggests(report)
    assert gain["summary"] in report.warnings and "freezing: " + gain["summary"] in (
        report.format_summary().splitlines())
    # and the cost model means it: the frozen graph converted with --fold-constants paints them
    loaded = tf.saved_model.load(str(exported["cnn"]))
    frozen = convert_variables_to_constants_v2(loaded.signatures["serving_default"])
    _, folded = convert(frozen.graph.as_graph_def(), target="bfloat16", device="cpu",
                        fold_constants=True)
    frozen_convs = [n for n in folded.nodes if n.op in MATRIX_OPS and "Conv" in n.op]
    assert len(frozen_convs) == len(convs)
    assert all(n.precision == "bfloat16" for n in frozen_convs), [
        (n.name, n.code) for n in frozen_convs]


def test_a_recurrent_classifier_gains_too_little_to_suggest_freezing(exported, tmp_path):
    report = convert_file(exported["gru"], tmp_path / "out", target="bfloat16", device="cpu")
    gain = report.extra["freezing"]
    assert not _suggests(report) and "summary" not in gain
    # the estimate would paint its matrix ops frozen, but weighs one loop step: under 1 µs
    assert gain["matrix_ops"] > 0 and 0 <= gain["gain_us"] < FREEZE_HINT_US


def test_the_cli_prints_the_suggestion_once_in_its_summary(exported, tmp_path, capsys):
    from amp_rewrite.cli.run import main
    assert main([str(exported["cnn"]), "-o", str(tmp_path / "out"), "--target", "bfloat16",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("freezing: ")]
    assert len(lines) == 1 and "--fold-constants" in lines[0] and "µs a sample" in lines[0]
    assert "--fold-constants" not in out.err
