"""Small matrix ops stay float32 on a CPU: matrix intensity from weight shapes, and painting
that keeps an op float32 only where doing so saves casts."""

import json

import numpy as np
import pytest
import tensorflow as tf
import training_graphs
from machine import needs_onednn

from amp_rewrite import convert, convert_file
from amp_rewrite.core.ir import Graph
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.io.load import load
from amp_rewrite.paint.costs import DEFAULT_BATCH, matrix_intensity, runtime_estimate
from amp_rewrite.schema.shapes import Shapes

v1 = tf.compat.v1
BF16 = tf.bfloat16.as_datatype_enum


def chain(widths, batch=None, bias=False):
    """x -> MatMul(w0) -> relu -> MatMul(w1) -> ... with weights of the given widths (and with
    ``bias`` a BiasAdd before each relu, which TensorFlow fuses into the MatMul)."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        h = v1.placeholder(tf.float32, [batch, widths[0]], name="x")
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            w = tf.constant(r.normal(0, 0.1, (a, b)).astype(np.float32))
            h = tf.matmul(h, w, name=f"mm{i}")
            if bias:
                h = tf.nn.bias_add(h, tf.constant(r.normal(0, 0.1, b).astype(np.float32)))
            h = tf.nn.relu(h, name=f"relu{i}")
        tf.identity(h, name="out")
    return g.as_graph_def()


def test_matrix_intensity_from_weights_filters_and_updates():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, 4], name="x")
        tf.nn.conv2d(x, tf.constant(np.zeros([3, 3, 4, 32], np.float32)), 1, "SAME", name="conv")
        tf.nn.depthwise_conv2d(x, tf.constant(np.zeros([3, 3, 4, 1], np.float32)), [1, 1, 1, 1],
                               "SAME", name="dw")
        tf.matmul(v1.placeholder(tf.float32, [None, 64]),
                  tf.constant(np.zeros([64, 256], np.float32)), name="mm")
    graph = Graph.from_graph_def(g.as_graph_def())
    got = {n: matrix_intensity(graph, graph.node(n)) for n in ("conv", "mm")}
    assert got["mm"] == pytest.approx(2 * 64 * 256 / (64 + 256))
    assert got["conv"] == pytest.approx(2 * 9 * 4 * 32 / (4 + 32))
    dw = next(n for n in graph.nodes() if n.op == "DepthwiseConv2dNative")
    assert matrix_intensity(graph, dw) == pytest.approx(2 * 9 * 1 / 2)


def test_weight_gradients_take_the_intensity_of_the_weight_they_update():
    graph = Graph.from_graph_def(training_graphs.build("mlp", "adam").graph_def)
    forward = {n.name: matrix_intensity(graph, n) for n in graph.nodes()
               if n.op in MATRIX_OPS and not n.name.startswith("gradients")}
    grads = [n for n in graph.nodes() if n.op in MATRIX_OPS and n.name.startswith("gradients")]
    assert forward and grads and None not in forward.values()
    assert all(matrix_intensity(graph, n) in forward.values() for n in grads)


def test_small_matmuls_stay_float32_on_a_cpu_and_say_why():
    gd = chain([64, 64, 64, 64])
    _, report = convert(gd, target="bfloat16", device="cpu")
    mms = [report.node(f"mm{i}") for i in range(3)]
    assert all(n.precision == "float32" and n.code == "cost" for n in mms)
    assert report.summary()["casts_added"] == 0
    # the knob at 0 paints them as grappler would; float16 and GPUs do by default
    for kwargs in ({"target": "bfloat16", "device": "cpu", "min_matrix_intensity": 0},
                   {"target": "float16", "device": "cpu"}, {"target": "bfloat16", "device": "gpu"}):
        _, painted = convert(gd, **kwargs)
        assert all(painted.node(f"mm{i}").precision != "float32" for i in range(3))


def test_an_island_with_a_big_matmul_keeps_its_small_ones():
    _, report = convert(chain([16, 256, 256, 16]), target="bfloat16", device="cpu")
    # mm0 (16x256) and mm2 (256x16) are small, but share an island with mm1 (256x256): in
    # float32 they would add casts, not save them
    assert all(report.node(f"mm{i}").precision == "bfloat16" for i in range(3))
    _, small = convert(chain([32, 32]), target="bfloat16", device="cpu")
    assert small.node("mm0").code == "cost"


def test_a_small_training_graph_stays_float32_forward_and_backward(tmp_path):
    """The tests' MLP (widths 64 and 10, intensities 64 and 17): by default the forward
    MatMuls and their gradients alike stay float32, so no island of casts is left."""
    src = tmp_path / "train.meta"
    src.write_bytes(training_graphs.build("mlp", "adam").SerializeToString())
    report = convert_file(src, tmp_path / "bf16.meta", target="bfloat16", device="cpu")
    matrix = [n for n in report.nodes if n.op in MATRIX_OPS]
    assert matrix and all(n.precision == "float32" and n.code == "cost" for n in matrix)
    out = load(tmp_path / "bf16.meta").graph_def
    assert not any(n.op == "Cast" and n.name.endswith("amp_bfloat16") for n in out.node)


def test_cli_knob(tmp_path, capsys):
    from amp_rewrite.cli.run import main
    src = tmp_path / "m.pb"
    # with a bias the relu is fused into the MatMul: no activation to weigh, the knob decides
    src.write_bytes(chain([32, 32], bias=True).SerializeToString())
    assert main([str(src), "-o", str(tmp_path / "a.pb"), "--target", "bfloat16", "--device", "cpu",
                 "--min-matrix-intensity", "16"]) == 0
    mm = next(n for n in load(tmp_path / "a.pb").graph_def.node if n.op == "MatMul")
    assert mm.attr["T"].type == BF16
    assert main([str(src), "-o", str(tmp_path / "b.pb"), "--min-matrix-intensity", "-1"]) == 2


def test_cost_aware_on_a_cpu_without_a_bfloat16_unit_keeps_every_island_float32(
        tmp_path, monkeypatch, capsys):
    """--cost-aware as on an AVX2-only CPU (the detection answers None, as it does there): the
    big island that gains on AVX512-BF16 stays float32 too, code cost, and the graph computes
    what the input does; a forced node still goes to bfloat16."""
    from amp_rewrite.cli.run import main
    from amp_rewrite.core import hardware
    monkeypatch.setattr(hardware, "bf16_matrix_unit", lambda: None)
    src = tmp_path / "m.pb"
    src.write_bytes(chain([256, 256, 256]).SerializeToString())
    out, report = tmp_path / "out.pb", tmp_path / "r.json"
    assert main([str(src), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                 "--cost-aware", "--report", str(report)]) == 0
    gd = load(out).graph_def
    assert not any(BF16 in (a.type for a in n.attr.values()) for n in gd.node)
    decisions = {n["name"]: n for n in json.loads(report.read_text())["nodes"]}
    assert decisions["mm0"]["code"] == decisions["mm1"]["code"] == "cost"
    assert "--cost-aware: this CPU" in decisions["mm0"]["reason"]
    assert "--cost-aware kept every island float32" in capsys.readouterr().err
    x = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    runs = []
    for graph_def in (chain([256, 256, 256]), gd):
        with tf.Graph().as_default() as g:
            tf.graph_util.import_graph_def(graph_def, name="")
            with v1.Session(graph=g) as sess:
                runs.append(sess.run("out:0", {"x:0": x}))
    np.testing.assert_array_equal(runs[0], runs[1])
    # a user's force_lowp outranks the machine
    rules = tmp_path / "force.toml"
    rules.write_text('[[override]]\nregex = "^mm1$"\naction = "force_lowp"\n')
    _, forced = convert(chain([256, 256, 256]), target="bfloat16", device="cpu",
                        rules=[rules], cost_aware=True)
    assert forced.node("mm1").precision == "bfloat16" and forced.node("mm0").code == "cost"


def test_cost_aware_changes_nothing_where_the_cpu_has_a_bfloat16_unit(monkeypatch):
    from amp_rewrite.core import hardware
    monkeypatch.setattr(hardware, "bf16_matrix_unit", lambda: "avx512_bf16")
    gd = chain([256, 256, 256])
    plain, _ = convert(gd, target="bfloat16", device="cpu")
    aware, report = convert(gd, target="bfloat16", device="cpu", cost_aware=True)
    assert aware == plain and report.node("mm1").precision == "bfloat16"


def test_a_force_lowp_override_lifts_a_cost_decision(tmp_path):
    rules = tmp_path / "force.toml"
    rules.write_text('[[override]]\nregex = "^mm0$"\naction = "force_lowp"\n')
    _, report = convert(chain([32, 32]), target="bfloat16", device="cpu", rules=[rules])
    assert (report.node("mm0").precision, report.node("mm0").code) == ("bfloat16", "user_force")
    assert not [w for w in report.warnings if "force_lowp refused" in w]


def inverted_residual(bias=None, act=tf.nn.relu6, batch=None):
    """The first half of MobileNetV2's block at 14x14: a 1x1 expansion 128 -> 768, ``act``, a
    3x3 depthwise convolution, ``act``, then a mean over the pixels. ``bias``: None (no bias,
    as a frozen untrained batch norm leaves it), "random" (a BiasAdd TensorFlow fuses) or
    "zeros" (an add of zeros, which grappler's constant folding removes)."""
    r = np.random.default_rng(0)
    g = tf.Graph()

    def biased(h, n):
        if bias == "random":
            return tf.nn.bias_add(h, tf.constant(r.normal(0, 0.1, n).astype(np.float32)))
        if bias == "zeros":
            return h + tf.constant(np.zeros(n, np.float32))
        return h

    with g.as_default():
        x = v1.placeholder(tf.float32, [batch, 14, 14, 128], name="x")
        h = tf.nn.conv2d(x, tf.constant(r.normal(0, 0.1, (1, 1, 128, 768)).astype(np.float32)),
                         1, "SAME", name="expand")
        h = act(biased(h, 768), name="act1")
        h = tf.nn.depthwise_conv2d(h, tf.constant(r.normal(0, 0.1, (3, 3, 768, 1)).astype(
            np.float32)), [1, 1, 1, 1], "SAME", name="dw")
        h = act(biased(h, 768), name="act2")
        tf.identity(tf.reduce_mean(h, [1, 2]), name="out")
    return g.as_graph_def()


def test_unfused_slow_activations_keep_an_island_float32_on_a_cpu():
    """Per sample the block's convolutions do 41 MFLOPs (about 37 µs saved in bfloat16), its
    two unfused Relu6 write 301k elements (about 66 µs lost): float32, and the reason says so."""
    from amp_rewrite.paint.costs import runtime_estimate
    from amp_rewrite.schema.shapes import Shapes
    gd = inverted_residual()
    graph = Graph.from_graph_def(gd)
    est = runtime_estimate(graph, Shapes(graph), [n.name for n in graph.nodes()])
    assert est.flops == 196 * 768 * (2 * 128 + 18)
    assert est.slow == {"Relu6": 2} and est.slower
    _, report = convert(gd, target="bfloat16", device="cpu")
    for name in ("expand", "dw", "act1", "act2"):
        node = report.node(name)
        assert node.precision == "float32" and node.code == "cost", name
        assert "2 Relu6" in node.reason and "µs" in node.reason
    # an add of zeros is no bias: grappler removes it, so the Relu6 stays unfused
    _, zeros = convert(inverted_residual("zeros"), target="bfloat16", device="cpu")
    assert zeros.node("expand").code == "cost"


def test_fused_activations_cost_nothing_and_the_knob_at_zero_paints_anyway():
    for gd, kwargs in ((inverted_residual("random"), {}),   # BiasAdd + Relu6: one oneDNN op
                       (inverted_residual(act=tf.nn.relu), {}),   # Relu: 43 ps, not 218
                       (inverted_residual(), {"min_matrix_intensity": 0}),
                       (inverted_residual(), {"target": "float16", "device": "cpu"}),
                       (inverted_residual(), {"target": "bfloat16", "device": "gpu"})):
        _, report = convert(gd, **{"target": "bfloat16", "device": "cpu", **kwargs})
        assert all(report.node(n).precision != "float32" for n in ("expand", "dw"))


def _fusion_cases():
    """name -> whether TensorFlow's remapper leaves that activation unfused (slow in bfloat16)
    on a CPU; each checked against grappler's own output by the test below."""
    r = np.random.default_rng(0)
    c = lambda *shape: tf.constant(r.normal(0, 1, shape).astype(np.float32))  # noqa: E731
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        img = v1.placeholder(tf.float32, [None, 8, 8, 4], name="img")
        conv = lambda: tf.nn.conv2d(img, c(1, 1, 4, 4), 1, "SAME")  # noqa: E731
        dw = lambda: tf.nn.depthwise_conv2d(img, c(3, 3, 4, 1), [1, 1, 1, 1], "SAME")  # noqa: E731
        mm = lambda: tf.matmul(x, c(8, 8))  # noqa: E731
        s = tf.sigmoid(x, name="swish_sigmoid")
        tf.multiply(x, s, name="swish")
        tf.sigmoid(x, name="lone")
        s2 = tf.sigmoid(x, name="swish_read_twice")
        tf.identity(x * s2 + s2)
        # Keras' swish: h * sigmoid(beta * h), beta a Const 1 grappler simplifies away first
        # (h computed: a Mul of a fed placeholder by 1 is left as it is)
        h = tf.matmul(x, c(8, 8))
        s3 = tf.sigmoid(tf.multiply(tf.constant(1.0), h), name="keras_swish_sigmoid")
        tf.multiply(h, s3, name="keras_swish")
        s4 = tf.sigmoid(tf.multiply(tf.constant(2.0), h), name="swish_beta_2")
        tf.multiply(h, s4)
        tf.nn.relu(tf.nn.bias_add(mm(), c(8)), name="relu_matmul_bias")
        tf.tanh(tf.nn.bias_add(mm(), c(8)), name="tanh_matmul_bias")
        tf.tanh(tf.nn.bias_add(conv(), c(4)), name="tanh_conv_bias")
        tf.sigmoid(tf.nn.bias_add(conv(), c(4)), name="sigmoid_conv_bias")
        tf.nn.relu6(tf.nn.bias_add(conv(), c(4)), name="relu6_conv_bias")
        tf.nn.relu6(tf.nn.bias_add(dw(), c(4)), name="relu6_dw_bias")
        tf.nn.leaky_relu(tf.nn.bias_add(dw(), c(4)), name="leaky_dw_bias")
        tf.nn.relu6(conv() + c(4), name="relu6_conv_add_vector")
        tf.nn.relu6(conv() + tf.constant(3.0), name="relu6_conv_add_scalar")
        tf.nn.relu6(conv() + c(1), name="relu6_conv_add_one")
        tf.nn.relu(mm() + tf.constant(np.zeros(8, np.float32)), name="relu_after_zeros")
        tf.nn.relu6(tf.nn.bias_add(conv(), tf.constant(np.zeros(4, np.float32))),
                    name="relu6_conv_bias_zeros")
        tf.nn.relu6(conv() * c(4) + c(4), name="relu6_conv_scale_offset")
        tf.nn.relu(tf.nn.bias_add(mm() * c(8), c(8)), name="relu_matmul_scale_bias")
        y = tf.nn.bias_add(mm(), c(8))
        with tf.control_dependencies([x]):
            tf.nn.relu(y, name="relu_with_control_input")
        # a frozen Keras batch norm: scale and offset computed from its four Consts on every
        # run, which constant folding makes Consts before the remapper looks
        u = lambda n: tf.constant(r.uniform(0.5, 1.5, n).astype(np.float32))  # noqa: E731
        zeros = lambda n: tf.constant(np.zeros(n, np.float32))  # noqa: E731

        def keras_bn(h, beta, mean):
            scale = u(4) * tf.math.rsqrt(u(4) + 1e-3)
            return h * scale + (beta - mean * scale)

        tf.nn.relu6(keras_bn(conv(), c(4), c(4)), name="relu6_conv_trained_bn")
        tf.nn.relu6(keras_bn(dw(), c(4), c(4)), name="relu6_dw_trained_bn")
        tf.nn.relu6(keras_bn(conv(), zeros(4), zeros(4)), name="relu6_conv_untrained_bn")
        for name, op in (("conv", conv), ("dw", dw)):
            for act in ("relu6", "relu", "tanh"):
                y, _, _ = v1.nn.fused_batch_norm(op(), u(4), c(4), mean=c(4), variance=u(4),
                                                 is_training=False)
                getattr(tf.nn, act)(y, name=f"{act}_{name}_fused_bn")
        y, _, _ = v1.nn.fused_batch_norm(conv(), u(4), c(4), is_training=True)
        tf.nn.relu6(y, name="relu6_conv_training_bn")
    want = {"swish_sigmoid": False, "lone": True, "swish_read_twice": True,
            "keras_swish_sigmoid": False, "swish_beta_2": True,
            "relu_matmul_bias": False, "tanh_matmul_bias": False, "tanh_conv_bias": True,
            "sigmoid_conv_bias": True, "relu6_conv_bias": False, "relu6_dw_bias": False,
            "leaky_dw_bias": True, "relu6_conv_add_vector": False,
            "relu6_conv_add_scalar": True, "relu6_conv_add_one": True, "relu_after_zeros": True,
            "relu6_conv_bias_zeros": True, "relu6_conv_scale_offset": False,
            "relu_matmul_scale_bias": True, "relu_with_control_input": True,
            "relu6_conv_trained_bn": False, "relu6_dw_trained_bn": True,
            "relu6_conv_untrained_bn": True, "relu6_conv_fused_bn": False,
            "relu_conv_fused_bn": False, "tanh_conv_fused_bn": False, "relu6_dw_fused_bn": True,
            "relu_dw_fused_bn": False, "tanh_dw_fused_bn": True, "relu6_conv_training_bn": True}
    return g.as_graph_def(), want


@needs_onednn   # the remapper's CPU fusions are oneDNN's (conftest.py turns it on)
def test_what_counts_as_fused_is_what_grappler_fuses_on_a_cpu():
    """slow_unfused against grappler's own remapper: the graph placed on the CPU, through the
    session's passes; an activation is fused where no node of its name and op is
    left (a fused op takes the name of the pattern's last node)."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    from amp_rewrite.paint.costs import slow_unfused
    gd, want = _fusion_cases()
    graph = Graph.from_graph_def(gd)
    assert {n: slow_unfused(graph, graph.node(n)) for n in want} == want
    # grappler agrees, on the float32 graph placed on the CPU: the remapper's patterns are the
    # same in bfloat16, but it fuses bfloat16 only where oneDNN has a bfloat16 path on this CPU
    painted = tf.compat.v1.GraphDef()
    painted.CopyFrom(gd)
    for node in painted.node:
        node.device = "/device:CPU:0"
    meta = meta_graph_pb2.MetaGraphDef(graph_def=painted)
    read = {i.split(":")[0].lstrip("^") for m in painted.node for i in m.input}
    meta.collection_def["train_op"].node_list.value.extend(
        [n.name for n in painted.node if n.name not in read])   # fetched: nothing prunes them
    optimized = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta)
    left = {(n.name, n.op) for n in optimized.node}
    ops = {n.name: n.op for n in gd.node}
    for name, slow in want.items():
        assert ((name, ops[name]) in left) == slow, name


def test_a_frozen_graph_kept_float32_for_unfused_activations_hints_at_folding(tmp_path, capsys):
    from amp_rewrite.cli.run import main
    _, report = convert(inverted_residual(), target="bfloat16", device="cpu", fold_constants=False)
    assert report.extra["unfused_kept"] == 2   # the expansion and the depthwise convolution
    assert any("--fold-constants may" in w for w in report.warnings)
    # not where folding was asked for, and not where nothing was kept for that reason
    _, folded = convert(inverted_residual(), target="bfloat16", device="cpu", fold_constants=True)
    _, fused = convert(inverted_residual("random"), target="bfloat16", device="cpu",
                       fold_constants=False)
    assert not any("--fold-constants may" in w for w in folded.warnings + fused.warnings)
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual().SerializeToString())
    assert main([str(src), "-o", str(tmp_path / "out.pb"), "--target", "bfloat16",
                 "--device", "cpu", "--no-fold-constants"]) == 0
    assert "--fold-constants may" in capsys.readouterr().err


@pytest.fixture(scope="module")
def variable_mlp(tmp_path_factory):
    """A SavedModel whose weights are variables: two 32x32 layers (intensity 32, under the
    default 50), the second inside a tf.while_loop, so its variable reaches the loop body as
    an argument of an argument."""
    r = np.random.default_rng(0)
    module = tf.Module()
    module.w0 = tf.Variable(r.normal(0, 0.1, (32, 32)).astype(np.float32))
    module.w1 = tf.Variable(r.normal(0, 0.1, (32, 32)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
    def serve(x):
        h = tf.nn.relu(tf.matmul(x, module.w0))
        _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.nn.relu(tf.matmul(
            h, module.w1))), [tf.constant(0), h])
        return {"y": h}

    module.serve = serve
    path = tmp_path_factory.mktemp("sm") / "mlp"
    tf.saved_model.save(module, str(path), signatures={"serving_default": serve})
    return path


def test_variables_reach_function_bodies_with_their_shapes(variable_mlp):
    from amp_rewrite.schema.functiondef import function_to_graph, variable_argument_shapes
    gd = load(variable_mlp).graph_def
    shapes = variable_argument_shapes(gd)
    signatures = {f.signature.name: f.signature for f in gd.library.function}
    seen = []
    for fdef in gd.library.function:
        fg = function_to_graph(fdef, signatures, shapes.get(fdef.signature.name))
        seen += [matrix_intensity(fg.graph, n) for n in fg.graph.nodes() if n.op == "MatMul"]
    assert seen == [pytest.approx(32.0)] * 2   # one MatMul in the call, one in the loop body


def test_small_variable_matmuls_of_a_savedmodel_stay_float32_on_a_cpu(variable_mlp, tmp_path):
    report = convert_file(variable_mlp, tmp_path / "out", target="bfloat16", device="cpu")
    matrix = [n for n in report.nodes if n.op in MATRIX_OPS]
    assert len(matrix) == 2 and all(n.code == "cost" for n in matrix), [
        (n.name, n.code) for n in matrix]


def _variable_matmul(path, batch):
    """A SavedModel computing relu(x @ w), w a 256x256 variable (intensity 256: worth bfloat16
    by the knob), x of shape [batch, 256]."""
    module = tf.Module()
    module.w = tf.Variable(np.random.default_rng(0).normal(0, 0.1, (256, 256)).astype(np.float32))
    serve = tf.function(lambda x: {"y": tf.nn.relu(tf.matmul(x, module.w))},
                        input_signature=[tf.TensorSpec([batch, 256], tf.float32)])
    tf.saved_model.save(module, str(path), signatures={"serving_default": serve})
    return path


def test_casting_variable_weights_every_run_is_weighed_against_the_batch(tmp_path):
    """Cast on every run, the 65k weights cost about 9.8 µs a sample at the default batch of 1,
    eighty times what the MatMul saves: float32, and the reason says so. With 4096 samples a run
    (a batch the signature states) the cast is paid once for all of them: bfloat16."""
    small = convert_file(_variable_matmul(tmp_path / "open", None), tmp_path / "a",
                         target="bfloat16", device="cpu", freeze=False)
    mm = next(n for n in small.nodes if n.op == "MatMul")
    assert (mm.precision, mm.code) == ("float32", "cost") and "variable weights" in mm.reason
    big = convert_file(_variable_matmul(tmp_path / "big", 4096), tmp_path / "b",
                       target="bfloat16", device="cpu", freeze=False)
    assert next(n for n in big.nodes if n.op == "MatMul").precision == "bfloat16"
    # a stated batch is the run's: 64 samples save 7.5 µs, under the 9.8 µs of the cast
    mid = convert_file(_variable_matmul(tmp_path / "mid", 64), tmp_path / "c",
                       target="bfloat16", device="cpu", freeze=False)
    assert next(n for n in mid.nodes if n.op == "MatMul").code == "cost"
    # a Const weight is stored in bfloat16 once: the frozen twin stays bfloat16
    _, frozen = convert(chain([256, 256, 256]), target="bfloat16", device="cpu")
    assert frozen.node("mm0").precision == "bfloat16"


def test_the_batch_shape_gives_decides_what_an_open_batch_stands_for(tmp_path):
    """The open-batch SavedModel of the test above, told its batch with --shape (the signature's
    input key): 4096 samples a run pay for the cast (bfloat16, as where the signature states
    it), 64 do not; the reason names the batch it took. Converted without --shape (a batch of
    one), the summary says from which batch it would gain and how to say so, and that batch
    is where the decision turns."""
    model = _variable_matmul(tmp_path / "open", None)
    default = convert_file(model, tmp_path / "d", target="bfloat16", device="cpu", freeze=False)
    hint = [w for w in default.warnings if "--shape" in w]
    assert len(hint) == 1 and "for a batch of 1; from a batch of 92 on" in hint[0], hint
    assert hint[0].endswith("convert with --shape x=92,256")
    assert f"batch: {hint[0]}" in default.format_summary().splitlines()   # the CLI prints it
    for batch, precision in ((91, "float32"), (92, "bfloat16")):
        report = convert_file(model, tmp_path / f"t{batch}", target="bfloat16", device="cpu",
                              shapes={"x": (batch, 256)}, freeze=False)
        assert next(n for n in report.nodes if n.op == "MatMul").precision == precision, batch
    big = convert_file(model, tmp_path / "a", target="bfloat16", device="cpu",
                       shapes={"x": (4096, 256)}, freeze=False)
    assert next(n for n in big.nodes if n.op == "MatMul").precision == "bfloat16"
    small = convert_file(model, tmp_path / "b", target="bfloat16", device="cpu",
                         shapes={"x": (64, 256)}, freeze=False)
    mm = next(n for n in small.nodes if n.op == "MatMul")
    # --shape reaches the function body the signature calls: weighed per sample, its weight
    # casts shared by the 64 of a run, and says so; so does the report
    assert mm.code == "cost" and "µs a sample" in mm.reason
    assert "(a batch of 64: from a batch of 92 on it would gain" in mm.reason
    batch_of = lambda entry: {k: entry[k] for k in ("batch", "told")}   # noqa: E731
    assert batch_of(small.extra["cost_model"]) == {"batch": 64, "told": True}
    assert small.extra["cost_model"]["summary"].startswith(
        "islands weighed at a batch of 64 (--shape), with the shipped cost table")
    assert batch_of(default.extra["cost_model"]) == {"batch": DEFAULT_BATCH, "told": False}
    assert default.extra["cost_model"]["summary"].startswith(
        f"islands weighed at an open batch as {DEFAULT_BATCH}, with the shipped cost table")
    assert "(an open batch as 1: " in next(n for n in default.nodes if n.op == "MatMul").reason


def test_the_help_and_the_docs_say_the_default_batch_the_cost_model_takes():
    """--shape's help, the README and the docs name the batch an open one counts as (the
    reasons, the test above); it is DEFAULT_BATCH."""
    from pathlib import Path

    from amp_rewrite.cli import run as cli_run
    assert int(cli_run.BATCH_DEFAULT) == DEFAULT_BATCH
    for command in ([], ["explain"], ["tune"]):
        parser = cli_run._command_parser(command[0]) if command else cli_run._convert_parser()
        text = " ".join(parser.format_help().split())
        assert f"an open batch counts as a batch of {DEFAULT_BATCH}" in text, command
    word = {1: "one"}[DEFAULT_BATCH]
    root = Path(__file__).resolve().parent.parent
    for doc, words in (("README.md", f"an open batch is {word} sample unless"),
                       ("docs/convert.md", f"counts an open batch as {word} sample otherwise"),
                       ("docs/decisions.md", f"an open batch counts as {word} sample (`DEFAULT_BATCH`")):
        assert words in " ".join((root / doc).read_text().split()), doc


def test_shape_names_an_input_that_fits_and_only_where_a_cost_model_weighs(tmp_path, capsys):
    from amp_rewrite.cli.run import main
    model = _variable_matmul(tmp_path / "open", None)
    # the message every command gives a name that names no input (schema.inputs.match_inputs)
    cases = {"y=8,256": "--shape 'y' names no input of the model; its inputs: x (float32 [?,256])",
             "x=8,128": "--shape x=8,128 does not fit the input's shape [?,256]",
             "x=8": "--shape x=8 does not fit the input's shape [?,256]",
             "x=8,x": "expected NAME=D1,D2,..."}
    for flag, message in cases.items():
        assert main([str(model), "-o", str(tmp_path / "o"), "--target", "bfloat16",
                     "--device", "cpu", "--shape", flag]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main([str(model), "-o", str(tmp_path / "o"), "--shape", "x=8,256"]) == 2
    assert "has no such cost model: drop --shape" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_shape_fills_the_dimensions_a_graph_leaves_open():
    """The inverted residual with its pixels open: no element count, so no estimate, and the
    lists paint it; told the shape (by the placeholder's name), the estimate finds its Relu6
    unfused and keeps it float32, as where the graph states the pixels."""
    gd = inverted_residual()
    x = next(n for n in gd.node if n.name == "x")
    for d in x.attr["shape"].shape.dim[1:3]:
        d.size = -1
    _, open_ = convert(gd, target="bfloat16", device="cpu")
    assert open_.node("expand").precision == "bfloat16"
    _, told = convert(gd, target="bfloat16", device="cpu", shapes={"x:0": (8, 14, 14, 128)})
    assert told.node("expand").code == "cost" and "2 Relu6" in told.node("expand").reason


def test_tune_takes_the_batch_too(tmp_path, capsys):
    """tune's conversions weigh weight casts as convert's do: told a batch of 4096 with --shape,
    the open-batch SavedModel's MatMul is tuned in bfloat16 (at one sample it stays float32)."""
    from amp_rewrite.cli.run import main
    model = _variable_matmul(tmp_path / "open", None)
    data = tmp_path / "x.npz"
    np.savez(data, x=np.random.default_rng(0).normal(0, 1, (16, 256)).astype(np.float32))
    for shape, precision in ((None, "float32"), ("x=4096,256", "bfloat16")):
        out, report = tmp_path / f"t{precision}", tmp_path / f"r{precision}.json"
        flags = ["--shape", shape] if shape else []
        assert main(["tune", str(model), "-o", str(out), "--inputs", str(data), "--target",
                     "bfloat16", "--device", "cpu", "--report", str(report), *flags]) == 0
        nodes = json.loads(report.read_text())["nodes"]
        assert [n["precision"] for n in nodes if n["op"] == "MatMul"] == [precision], shape
    assert main(["tune", str(model), "-o", str(tmp_path / "f16"), "--inputs", str(data),
                 "--shape", "x=8,256"]) == 2
    assert "has no such cost model: drop --shape" in capsys.readouterr().err


def test_shape_reaches_the_function_bodies_a_signature_calls(tmp_path):
    """A Keras export whose signature leaves the image size open: its convolutions sit in the
    function the signature calls, where no shape is known, so without --shape nothing there is
    weighed. --shape's dimensions reach that body through the calls (its batch shared by the
    weight casts): the island is weighed, at the batch given, and the reasons and the report
    say 32."""
    import keras
    L = keras.layers
    keras.utils.set_random_seed(0)
    x = keras.Input((None, None, 16), name="images")
    h = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(64, 3, padding="same", use_bias=False)(x)))
    h = L.ReLU(6.0)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same",
                                                              use_bias=False)(h)))
    keras.Model(x, L.Dense(10)(L.GlobalAveragePooling2D()(h))).export(
        str(tmp_path / "open"), verbose=False)
    unweighed = convert_file(tmp_path / "open", tmp_path / "a", target="bfloat16", device="cpu")
    assert not any(n.code == "cost" for n in unweighed.nodes)
    assert (unweighed.extra["cost_model"]["batch"], unweighed.extra["cost_model"]["told"]) == (
        DEFAULT_BATCH, False)
    told = convert_file(tmp_path / "open", tmp_path / "b", target="bfloat16", device="cpu",
                        shapes={"images": (32, 16, 16, 16)})
    # (both signatures, serve and serving_default, pass the input to the body: the key names
    # the input of both, or their calls would disagree and leave the body's argument unknown)
    convs = [n for n in told.nodes if n.op in MATRIX_OPS and "Conv" in n.op]
    assert len(convs) == 2 and all(n.code == "cost" for n in convs)
    assert all("a batch of 32;" in n.reason for n in convs), convs[0].reason
    assert told.extra["cost_model"]["batch"] == 32 and told.extra["cost_model"]["told"]


def test_rows_no_rule_knows_take_the_one_number_of_rows_the_island_states_or_none():
    """A MatMul whose left operand's shape is unknown has (ROWS, columns): its counts are per
    row. In an island whose other counts state one number of rows (4), they take that number;
    where they state two (4 and 8), which one the unknown rows are is not known, so nothing is
    estimated (the island is painted as before), rather than one of them picked."""
    g = tf.Graph()
    with g.as_default():
        w = tf.constant(np.full((128, 128), 0.01, np.float32))
        for name, shape in (("a", [4, 128]), ("b", [8, 128]), ("u", None)):
            x = v1.placeholder(tf.float32, shape, name=name)
            tf.tanh(tf.raw_ops.MatMul(a=x, b=w, name=f"mm_{name}"), name=f"tanh_{name}")
    graph = Graph.from_graph_def(g.as_graph_def())
    one = runtime_estimate(graph, Shapes(graph), ["mm_a", "tanh_a", "mm_u", "tanh_u"])
    # each MatMul does 2·128 FLOPs an output element, 4 rows of 128: the unknown rows taken as 4
    assert one is not None and one.rows == (4,) and not one.per_row
    assert one.flops == 2 * (2 * 128 * 4 * 128) and one.slow == {"Tanh": 2}
    two = ["mm_a", "tanh_a", "mm_b", "tanh_b", "mm_u", "tanh_u"]
    assert runtime_estimate(graph, Shapes(graph), two) is None


def test_a_call_of_a_function_the_library_lacks_orders_no_body():
    """variable_argument_shapes orders the bodies callers first; a call naming a function the
    library does not hold (a corrupted file, which the importer refuses later) is no caller
    of any body, not a crash (tests/test_fuzz_input.py found it)."""
    from tensorflow.core.framework import graph_pb2

    from amp_rewrite.schema.functiondef import variable_argument_shapes
    gd = graph_pb2.GraphDef()
    f = gd.library.function.add()
    f.signature.name = "f"
    call = f.node_def.add(name="c", op="PartitionedCall")
    call.attr["f"].func.name = ""
    assert variable_argument_shapes(gd) == {}
