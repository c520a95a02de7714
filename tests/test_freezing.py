"""A SavedModel's conversion says where freezing its variables and converting with
--fold-constants would gain, naming --freeze, which does both (the cost model's FreezeGain,
docs/savedmodels.md "When freezing gains"), and stays quiet where it would not."""

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


def _cnn(axis=-1):
    """Conv+BatchNorm+ReLU6 and a depthwise one, MobileNetV2-style: as a SavedModel the batch
    norms read variables, so the ReLU6 would run unfused in bfloat16. ``axis=3`` is how
    EfficientNetV2 and ResNet50 give it, which Keras computes on vectors reshaped to
    [1, 1, 1, C]."""
    x = keras.Input((16, 16, 16))
    bn = lambda: L.BatchNormalization(axis=axis)  # noqa: E731
    h = L.ReLU(6.0)(bn()(L.Conv2D(64, 3, padding="same", use_bias=False)(x)))
    h = L.ReLU(6.0)(bn()(L.DepthwiseConv2D(3, padding="same", use_bias=False)(h)))
    h = bn()(L.Conv2D(32, 1, use_bias=False)(h))
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
    for name, build in (("cnn", _cnn), ("gru", _gru), ("cnn_axis3", lambda: _cnn(axis=3))):
        paths[name] = root / name
        build().export(str(paths[name]), verbose=False)
    return paths


def _suggests(report) -> bool:
    """Whether the conversion suggests freezing: a SavedModel's with the command that does it
    (--freeze), a graph file's (whose variables --freeze does not take) by hand."""
    return any(w.startswith("convert with --freeze") or (
        w.startswith("freeze the variables to Consts") and "--fold-constants" in w)
        for w in report.warnings)


def test_batch_norms_on_variables_suggest_freezing(exported, tmp_path):
    report = convert_file(exported["cnn"], tmp_path / "out", target="bfloat16", device="cpu",
                          freeze=False)
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


def test_batch_norms_on_reshaped_vectors_suggest_freezing_as_much(exported, tmp_path):
    """Keras' batch norm with axis=3 (EfficientNetV2's, ResNet50's) reshapes its variables to
    [1, 1, 1, C]; frozen, constant folding takes the reshape with them and the batch norm
    folds into the convolution all the same: the estimate counts what it does for axis=-1."""
    plain = convert_file(exported["cnn"], tmp_path / "plain", target="bfloat16", device="cpu",
                         freeze=False)
    axis3 = convert_file(exported["cnn_axis3"], tmp_path / "axis3", target="bfloat16",
                         device="cpu", freeze=False)
    assert _suggests(axis3)
    assert axis3.extra["freezing"]["gain_us"] == pytest.approx(
        plain.extra["freezing"]["gain_us"], rel=1e-6)


def test_the_report_suggests_the_freeze_command_next(exported, tmp_path):
    """The HTML page's next command, where the freezing hint fires: the conversion again with
    --freeze, one the CLI parses; where it does not (the GRU), not."""
    from amp_rewrite.cli.run import parse
    from amp_rewrite.report.steps import Given, after_convert
    for name, hinted in (("cnn", True), ("gru", False)):
        report = convert_file(exported[name], tmp_path / name, target="bfloat16", device="cpu",
                              freeze=False)
        (first, *_) = after_convert(report.to_dict(), Given(str(exported[name]), str(tmp_path / name)))
        assert ("--freeze" in first.argv) == hinted, first.argv
        command, args = parse(list(first.argv))
        assert command == "convert" and args.freeze == hinted


def test_a_recurrent_classifier_gains_too_little_to_suggest_freezing(exported, tmp_path):
    report = convert_file(exported["gru"], tmp_path / "out", target="bfloat16", device="cpu",
                          freeze=False)
    gain = report.extra["freezing"]
    assert not _suggests(report) and "summary" not in gain
    # the estimate would paint its matrix ops frozen, but weighs one loop step: under 1 µs
    assert gain["matrix_ops"] > 0 and 0 <= gain["gain_us"] < FREEZE_HINT_US


def test_the_cli_prints_the_suggestion_once_in_its_summary(exported, tmp_path, capsys):
    from amp_rewrite.cli.run import main
    assert main([str(exported["cnn"]), "-o", str(tmp_path / "out"), "--target", "bfloat16",
                 "--device", "cpu", "--no-freeze"]) == 0
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("freezing: ")]
    assert len(lines) == 1 and "--freeze" in lines[0] and "µs a sample" in lines[0]
    assert "--freeze" not in out.err


def _tf1_conv_bn(train: bool, activation: bool = True):
    """A TF1 graph whose convolution and Keras-style batch norm read variables, then a Relu6
    (without ``activation``, none); with ``train``, a gradient-descent step too (of another
    variable, added to their mean)."""
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        var = lambda name, shape, lo, hi: tf.compat.v1.Variable(  # noqa: E731
            rng.uniform(lo, hi, shape).astype(np.float32), name=name)
        x = tf.compat.v1.placeholder(tf.float32, [None, 16, 16, 16], name="x")
        h = tf.nn.conv2d(x, var("w", (3, 3, 16, 64), -0.1, 0.1), 1, "SAME")
        gamma, beta, mean, variance = (var(n, 64, 0.5, 1.5) for n in ("gamma", "beta", "mean", "var"))
        scale = gamma * tf.math.rsqrt(variance + 1e-3)
        y = h * scale + (beta - mean * scale)
        y = tf.reduce_mean(tf.nn.relu6(y) if activation else y, name="y")
        if train:   # a step of a bias beside it: the forward pass's island is weighed as is
            b = var("b", (), 0.5, 1.5)
            tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
                y + b * b, var_list=[b], name="train")
    return g.as_graph_def(add_shapes=True)   # shapes through the variable reads, as exported


def test_a_graph_with_variables_is_weighed_unless_it_trains():
    _, serving = convert(_tf1_conv_bn(False), target="bfloat16", device="cpu")
    assert serving.extra["freezing"]["gain_us"] > 0 and _suggests(serving)
    # a graph's variables are frozen by hand: --freeze takes SavedModels and Keras files
    assert serving.extra["freezing"]["summary"].startswith("freeze the variables to Consts")
    _, training = convert(_tf1_conv_bn(True), target="bfloat16", device="cpu")
    assert "freezing" not in training.extra and not _suggests(training)


def test_folding_a_batch_norm_on_variables_counts_its_elements_at_the_folded_rate():
    """Without an activation nothing fuses differently once frozen, so what freezing gains is
    exactly its two parts: the batch norm's Mul and AddV2 (16x16x64 elements a sample each)
    folded into the convolution at the shipped 120 ps an element (``folded_ps_per_element``)
    and the 3x3x16x64 filter's cast gone at 150 ps an element (``cast_ps_per_element``). A
    folded rate of 0 would leave the casts alone, which still pass the hint's floor."""
    _, report = convert(_tf1_conv_bn(False, activation=False), target="bfloat16", device="cpu")
    conv = next(n for n in report.nodes if n.op == "Conv2D")
    assert conv.precision == "bfloat16"   # painted as it is: the gain is the folds and casts
    folded_us, casts_us = 2 * 16 * 16 * 64 * 120e-6, 3 * 3 * 16 * 64 * 150e-6
    gain = report.extra["freezing"]
    assert gain["gain_us"] == pytest.approx(folded_us + casts_us, abs=2e-3)
    assert gain["frozen_us"] - gain["saved_us"] == pytest.approx(folded_us + casts_us, abs=2e-3)


def test_the_freezing_estimate_is_per_sample_whatever_batch_the_shapes_state():
    """Told its batch (--shape), a graph's islands are weighed per run of it; what freezing
    weighs is still said per sample: the float32 matrix time and what the frozen graph would
    save, the same as with the batch open (the gain over the conversion as it is, whose weight
    casts the batch shares, may differ)."""
    _, open_batch = convert(_tf1_conv_bn(False), target="bfloat16", device="cpu")
    _, told = convert(_tf1_conv_bn(False), target="bfloat16", device="cpu",
                      shapes={"x": (32, 16, 16, 16)})
    assert told.extra["cost_model"]["batch"] == 32
    for key in ("fp32_us", "frozen_us"):
        assert told.extra["freezing"][key] == pytest.approx(open_batch.extra["freezing"][key],
                                                            rel=0.01), key


def _module_conv_bn(path, train: bool):
    """A SavedModel serving conv + Keras-style batch norm on variables + Relu6; with ``train``,
    also a train step function (a tape, a variable written) whose forward pass is the same."""
    rng = np.random.default_rng(0)
    m = tf.Module()
    m.w = tf.Variable(rng.uniform(-0.1, 0.1, (3, 3, 16, 64)).astype(np.float32))
    m.bn = [tf.Variable(rng.uniform(0.5, 1.5, 64).astype(np.float32)) for _ in range(4)]
    m.b = tf.Variable(1.0)

    def forward(x):
        gamma, beta, mean, variance = m.bn
        scale = gamma * tf.math.rsqrt(variance + 1e-3)
        h = tf.nn.conv2d(x, m.w, 1, "SAME")
        return tf.reduce_mean(tf.nn.relu6(h * scale + (beta - mean * scale)))

    spec = [tf.TensorSpec([None, 16, 16, 16], tf.float32)]
    m.serve = tf.function(lambda x: {"y": forward(x)}, input_signature=spec)
    functions = {"serving_default": m.serve}
    if train:
        def step(x):
            with tf.GradientTape() as tape:   # only the bias beside it learns: the forward
                loss = forward(x) + m.b * m.b  # pass's island is weighed as it is
            m.b.assign_sub(0.1 * tape.gradient(loss, m.b))
            return {"loss": loss}
        m.train = tf.function(step, input_signature=spec)
        functions["train"] = m.train
    tf.saved_model.save(m, str(path), signatures=functions)
    return path


def test_a_train_step_of_a_savedmodel_is_not_counted(tmp_path):
    serving = convert_file(_module_conv_bn(tmp_path / "serve", False), tmp_path / "a",
                           target="bfloat16", device="cpu", freeze=False)
    both = convert_file(_module_conv_bn(tmp_path / "both", True), tmp_path / "b",
                        target="bfloat16", device="cpu")
    assert serving.extra["freezing"]["islands"] >= 1
    assert both.extra["freezing"] == serving.extra["freezing"]
