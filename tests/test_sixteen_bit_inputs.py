"""Models that compute in 16 bits convert: widened to float32 first, then painted for the
target, or written back whole with ``--target float32`` (docs/convert.md "Converting a
converted model").

A Keras ``mixed_float16`` model keeps its variables in float32 and casts each read to float16;
a graph built in float16 casts its float32 weights before each matrix op; a model converted
before holds its ops (and maybe its Consts) in 16 bits. Widened, each computes from its float32
values, not from their 16-bit roundings: in float32 it is its float32 twin bit for bit, and its
bfloat16 conversion is the twin's. The model's own casts are removed, never stacked under ours.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from refusals import assert_refused, run_cli, snapshot
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2

import graphs
from amp_rewrite import InputError, convert, convert_file
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.io.load import load

v1 = tf.compat.v1
HALF, BF16 = types_pb2.DT_HALF, types_pb2.DT_BFLOAT16
BF16_ALL = {"target": "bfloat16", "device": "cpu", "min_matrix_intensity": 0}


def sixteen_bit(nodes) -> list[str]:
    """The nodes holding a 16-bit dtype in a type attribute."""
    return [nd.name for nd in nodes if any(
        v.type in (HALF, BF16) or set(v.list.type) & {HALF, BF16} for v in nd.attr.values())]


def all_nodes(graph_def):
    return list(graph_def.node) + [nd for f in graph_def.library.function for nd in f.node_def]


def stacked_casts(graph_def) -> list[str]:
    """Casts that read another Cast: a 16-bit rounding under a cast of ours."""
    out = []
    for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
        ops = {nd.name: nd.op for nd in nodes}
        out += [nd.name for nd in nodes if nd.op == "Cast"
                and ops.get(nd.input[0].lstrip("^").split(":")[0]) == "Cast"]
    return out


# ----------------------------------------------------------------- a GraphDef built in float16
def mlp(dtype, splat=True):
    """An MLP whose float32 weights (Consts) are cast to ``dtype`` before each matrix op, its
    logits cast back to float32 for the softmax; float32: its twin."""
    g, r = tf.Graph(), np.random.default_rng(0)
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 32], name="x")
        w1 = tf.constant(r.normal(0, 0.2, (32, 64)).astype(np.float32), name="w1")
        b1 = tf.constant(r.normal(0, 0.1, 64).astype(np.float32), name="b1")
        h = tf.matmul(tf.cast(x, dtype), tf.cast(w1, dtype), name="mm1")
        h = tf.nn.relu(tf.nn.bias_add(h, tf.cast(b1, dtype)), name="h")
        if splat:   # a stored 16-bit Const, listed once for all its values
            h = tf.multiply(h, tf.constant(0.75, dtype, shape=[64], name="scale"), name="scaled")
        w2 = tf.constant(r.normal(0, 0.2, (64, 10)).astype(np.float32), name="w2")
        logits = tf.matmul(h, tf.cast(w2, dtype), name="logits")
        tf.nn.softmax(tf.cast(logits, tf.float32), name="probs")
    return g.as_graph_def(), {"x:0": r.normal(0, 1, (16, 32)).astype(np.float32)}, ["probs:0"]


def test_a_float16_graph_converted_to_float32_is_its_float32_twin():
    gd, feeds, fetches = mlp(tf.float16)
    new, report = convert(gd, target="float32")
    assert sixteen_bit(new.node) == []
    twin = graphs.run(mlp(tf.float32)[0], feeds, fetches)[0]
    assert np.array_equal(graphs.run(new, feeds, fetches)[0], twin)
    # the model's casts are gone, each reported; every widened node says what it was
    assert report.node("Cast_1").code == "cast_removed"   # w1's cast to float16
    assert "Cast_1" in report.casts_removed and "Cast_1" not in {n.name for n in new.node}
    mm = report.node("mm1")
    assert (mm.code, mm.precision) == ("target_float32", "float32")
    assert mm.reason.startswith("float16 in the input, float32 now")
    assert report.explain("Cast_1").startswith("Cast_1 (Cast): removed: ")
    assert report.explain("mm1").startswith("mm1 (MatMul): runs in float32: float16 in the input")
    assert report.float32_model() is None   # what was asked, not a warning
    widening = report.extra["widening"]
    assert widening["from"] == ["float16"] and widening["casts_removed"] == 5
    summary = report.format_summary()
    assert summary.startswith("target float32: 2/2 MatMul/Conv-family ops in float32\n")
    assert "widening: the input computes in float16: " in summary


def test_a_float16_graph_converted_to_bfloat16_is_its_twins_conversion():
    gd, feeds, fetches = mlp(tf.float16)
    new, report = convert(gd, **BF16_ALL)
    direct, _ = convert(mlp(tf.float32)[0], **BF16_ALL)
    assert not [n for n in all_nodes(new) if any(v.type == HALF for v in n.attr.values())]
    assert stacked_casts(new) == []
    assert np.array_equal(graphs.run(new, feeds, fetches)[0], graphs.run(direct, feeds, fetches)[0])
    # the weights are stored in bfloat16 from their float32 values, not from float16's
    w1 = next(n for n in new.node if n.name == "w1")
    want = mlp(tf.float32)[0]
    stored = tf.make_ndarray(w1.attr["value"].tensor)
    float32 = tf.make_ndarray(next(n for n in want.node if n.name == "w1").attr["value"].tensor)
    assert np.array_equal(stored, float32.astype(tf.bfloat16.as_numpy_dtype))
    mm = report.node("mm1")
    assert (mm.code, mm.precision) == ("retyped", "bfloat16")
    assert mm.reason.startswith("float16 in the input, bfloat16 now: allow op")
    assert report.summary()["matrix_by_dtype"] == {"bfloat16": 2}


def test_a_stored_float16_const_widens_to_the_same_values_and_stays_a_splat():
    gd, feeds, fetches = mlp(tf.float16)
    new, report = convert(gd, target="float32")
    scale = next(n for n in new.node if n.name == "scale").attr["value"].tensor
    assert scale.dtype == types_pb2.DT_FLOAT and list(scale.float_val) == [0.75]
    assert [d.size for d in scale.tensor_shape.dim] == [64] and not scale.tensor_content
    assert report.extra["widening"]["consts"] == 1
    assert "keep float16's rounding" in report.extra["widening"]["summary"]


def test_the_interface_keeps_its_16bit_dtype_and_is_cast_once_from_float32():
    """A float16 input stays float16 with one cast after it, a --keep name keeps its float16;
    a model's Cast that feeds a widened op and a kept float16 node gives the kept node a Cast
    of the float32 value (one rounding), the op the value itself. A graph output nothing reads
    (a GraphDef declares none) comes out in float32."""
    g, r = tf.Graph(), np.random.default_rng(1)
    with g.as_default():
        x = v1.placeholder(tf.float16, [None, 8], name="x16")
        w = tf.constant(r.normal(0, 0.3, (8, 8)).astype(np.float32), name="w")
        w16 = tf.cast(w, tf.float16, name="w16")
        tf.identity(w16, name="w_out")
        tf.nn.relu(tf.matmul(x * tf.constant(2.0, tf.float16), w16, name="mm"), name="out")
    new, report = convert(g.as_graph_def(), target="float32", keep=["w_out"])
    nodes = {n.name: n for n in new.node}
    assert nodes["x16"].attr["dtype"].type == HALF and nodes["w_out"].attr["T"].type == HALF
    for name, why in (("x16", "the interface"), ("w_out", "the interface")):
        node = report.node(name)
        assert node.precision == "float16" and f"keeps float16 ({why})" in node.reason
    assert nodes["mm"].attr["T"].type == nodes["out"].attr["T"].type == types_pb2.DT_FLOAT
    assert nodes["mm"].input[1] == "w"                       # the float32 weight itself
    feed = nodes[nodes["w_out"].input[0]]
    assert (feed.op, feed.input[0], feed.attr["DstT"].type) == ("Cast", "w", HALF)
    assert stacked_casts(new) == []
    assert len([n for n in new.node if n.op == "Cast" and n.input[0] == "x16"]) == 1
    assert report.extra["widening"]["kept"] == {"the interface": 2}
    xs = {"x16:0": r.normal(0, 1, (4, 8)).astype(np.float16)}
    ref = graphs.run(g.as_graph_def(), xs, ["out:0"])[0]
    assert graphs.rel_l2(graphs.run(new, xs, ["out:0"])[0], ref) < 1e-3


def test_amp_rewrites_own_float16_conversion_goes_back_to_float32_keeping_const_rounding():
    gd, feeds, fetches = graphs.mlp()
    half, _ = convert(gd, target="float16")
    assert any(n.op == "Const" and n.attr["dtype"].type == HALF for n in half.node)
    back, report = convert(half, target="float32")
    assert sixteen_bit(back.node) == []
    rounded = type(gd)()   # the FP32 original with its weights rounded as the Consts were
    rounded.CopyFrom(gd)
    for n in rounded.node:
        if n.op == "Const" and n.attr["dtype"].type == types_pb2.DT_FLOAT:
            values = tf.make_ndarray(n.attr["value"].tensor).astype(np.float16).astype(np.float32)
            n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values))
    got = graphs.run(back, feeds, fetches)[0]
    assert np.array_equal(got, graphs.run(rounded, feeds, fetches)[0])
    assert report.extra["widening"]["consts"] >= 2
    assert "so they keep float16's rounding" in report.format_summary()


# ----------------------------------------------------------------- Keras mixed_float16
def keras_model(kind, policy, weights=None):
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(7)
        if kind == "mlp":   # the acceptance scenario's: GELU, LayerNorm, a float32 head
            inp = keras.Input((64,), name="pixels")
            h = keras.layers.Dense(128, activation="gelu")(inp)
            h = keras.layers.LayerNormalization()(h)
            h = keras.layers.Dense(64, activation="relu")(h)
        elif kind == "cnn":
            inp = keras.Input((12, 12, 3), name="pixels")
            h = keras.layers.Conv2D(16, 3, padding="same")(inp)
            h = keras.layers.BatchNormalization()(h)
            h = keras.layers.Conv2D(16, 3, strides=2, activation="relu")(keras.layers.ReLU()(h))
            h = keras.layers.GlobalAveragePooling2D()(h)
        else:   # an LSTM: a While loop, TensorLists
            inp = keras.Input((6, 8), name="pixels")
            h = keras.layers.LSTM(16)(inp)
        out = keras.layers.Dense(10, activation="softmax", dtype="float32", name="probs")(h)
        model = keras.Model(inp, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if weights is not None:
        model.set_weights(weights)
    return model


SHAPES = {"mlp": (64,), "cnn": (12, 12, 3), "lstm": (6, 8)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per kind: the mixed_float16 export, its float32 twin (the same weights, moved off their
    initial values), a batch and the twin's outputs; the CNN also as a .keras file."""
    folder = tmp_path_factory.mktemp("mixed")
    out = {}
    for kind in SHAPES:
        mixed = keras_model(kind, "mixed_float16")
        rng = np.random.default_rng(0)
        mixed.set_weights([w + rng.normal(0, 0.05, w.shape).astype(w.dtype)
                           for w in mixed.get_weights()])
        twin = keras_model(kind, "float32", mixed.get_weights())
        mixed.export(str(folder / f"{kind}_mixed"), verbose=False)
        twin.export(str(folder / f"{kind}_twin"), verbose=False)
        if kind == "cnn":
            mixed.save(folder / "cnn_mixed.keras")
        x = np.random.default_rng(1).normal(0, 1, (16, *SHAPES[kind])).astype(np.float32)
        out[kind] = (folder, x, serve(folder / f"{kind}_twin", x))
    return out


def serve(folder, x):
    f = tf.saved_model.load(str(folder)).signatures["serving_default"]
    return f(pixels=tf.constant(x))["output_0"].numpy()


def saved_nodes(folder):
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((folder / "saved_model.pb").read_bytes())
    return all_nodes(proto.meta_graphs[0].graph_def)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_a_mixed_float16_export_converted_to_float32_is_its_twin(exported, kind):
    folder, x, twin = exported[kind]
    report = convert_file(folder / f"{kind}_mixed", folder / f"{kind}_fp32", target="float32")
    nodes = saved_nodes(folder / f"{kind}_fp32")
    assert sixteen_bit([n for n in nodes if n.op not in ("Placeholder",)]) == []
    assert np.array_equal(serve(folder / f"{kind}_fp32", x), twin)
    assert report.summary()["matrix_by_dtype"] == {"float32": report.summary()["matrix_total"]}
    if kind == "cnn":
        model = tf.lite.TFLiteConverter.from_saved_model(str(folder / "cnn_fp32")).convert()
        assert len(model) > 0


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_mixed_float16_export_converted_to_bfloat16_is_its_twins_conversion(exported, kind):
    folder, x, _ = exported[kind]
    # (the variables kept, so each read's cast can be looked at: frozen by default, they are
    # Consts stored in bfloat16, test_the_default_bfloat16_conversion_leaves_no_float16)
    report = convert_file(folder / f"{kind}_mixed", folder / f"{kind}_bf16", **BF16_ALL,
                          freeze=False)
    convert_file(folder / f"{kind}_twin", folder / f"{kind}_twin_bf16", **BF16_ALL, freeze=False)
    nodes = saved_nodes(folder / f"{kind}_bf16")
    assert not [n for n in nodes if any(v.type == HALF for v in n.attr.values())]
    assert np.array_equal(serve(folder / f"{kind}_bf16", x), serve(folder / f"{kind}_twin_bf16", x))
    # each variable's read reaches its matrix op through one cast, ours, to bfloat16
    by_name = {n.name: n for n in nodes}
    for mm in (n for n in nodes if n.op in MATRIX_OPS):
        cast = by_name[mm.input[1].split(":")[0]]
        assert (cast.op, cast.attr["DstT"].type) == ("Cast", BF16)
        assert by_name[cast.input[0].split(":")[0]].op == "ReadVariableOp"
    codes = {n.name: n.code for n in report.nodes if n.op in MATRIX_OPS}
    # the float32 head was float32 in the input: painted as any float32 op
    assert {c for name, c in codes.items() if "probs" not in name} == {"retyped"}
    assert any(n.code == "cast_removed" for n in report.nodes)


def test_a_keras_file_saved_under_the_policy_converts_to_float32(exported):
    folder, x, twin = exported["cnn"]
    convert_file(folder / "cnn_mixed.keras", folder / "cnn_keras_fp32", target="float32")
    assert sixteen_bit([n for n in saved_nodes(folder / "cnn_keras_fp32")]) == []
    assert np.array_equal(serve(folder / "cnn_keras_fp32", x), twin)


def test_the_default_bfloat16_conversion_leaves_no_float16(exported, capsys):
    folder, x, twin = exported["mlp"]
    code, out, err = run_cli(capsys, [folder / "mlp_mixed", "-o", folder / "mlp_default",
                                      "--target", "bfloat16", "--device", "cpu", "--force"])
    assert code == 0, err
    assert not [n for n in saved_nodes(folder / "mlp_default")
                if any(v.type == HALF for v in n.attr.values())]
    assert "widening: the input computes in float16" in out
    assert graphs.rel_l2(serve(folder / "mlp_default", x), twin) < 0.02


# ----------------------------------------------------------------- options, and what is refused
@pytest.mark.parametrize("flags", [["--rules", "rules/examples/conservative.toml"],
                                   ["--lowp-io"], ["--loss-scale", "dynamic"],
                                   ["--min-matrix-intensity", "0"], ["--cost-aware"]])
def test_options_that_only_say_how_to_paint_are_refused_with_float32(tmp_path, capsys, flags):
    src = tmp_path / "mlp16.pb"
    src.write_bytes(mlp(tf.float16)[0].SerializeToString())
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "out.pb", "--target", "float32", *flags])
    assert code == 2 and len(err.strip().splitlines()) == 1 and snapshot(tmp_path) == before
    assert f"{flags[0]} says how to paint in 16 bits, and --target float32 paints nothing" in err


def test_the_python_api_takes_float32_and_names_its_keywords():
    with pytest.raises(InputError, match="^lowp_io says how to paint .* target='float32'"):
        convert(mlp(tf.float16)[0], target="float32", lowp_io=True)
    with pytest.raises(InputError, match="choose float16, bfloat16 or float32"):
        convert(mlp(tf.float16)[0], target="float64")


def test_tune_has_no_float32_target(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(capsys, ["tune", "model.pb", "-o", "out.pb", "--inputs", "x.npz",
                         "--target", "float32"])
    assert exit_.value.code == 2 and "invalid choice: 'float32'" in capsys.readouterr().err


# ----------------------------------------------------------------- training graphs
def train_graph(dtype, variables=tf.float32):
    """A TF1 training MetaGraph computing in ``dtype`` from variables stored in ``variables``."""
    g, r = tf.Graph(), np.random.default_rng(0)
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w1 = v1.get_variable("w1", initializer=r.normal(0, 0.3, (16, 32)).astype(
            variables.as_numpy_dtype), use_resource=True)
        w2 = v1.get_variable("w2", initializer=r.normal(0, 0.3, (32, 4)).astype(
            variables.as_numpy_dtype), use_resource=True)
        h = tf.nn.relu(tf.matmul(tf.cast(x, dtype), tf.cast(w1, dtype)))
        logits = tf.cast(tf.matmul(h, tf.cast(w2, dtype)), tf.float32, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        init = v1.global_variables_initializer()
        meta = v1.train.Saver().export_meta_graph()
    feeds = {"x:0": r.normal(0, 1, (32, 16)).astype(np.float32),
             "y:0": r.integers(0, 4, 32).astype(np.int32), "__init__": init.name}
    return meta, feeds, ["loss:0", train.name]


def test_a_training_graph_built_in_float16_trains_in_float32_and_bfloat16(tmp_path):
    meta, feeds, fetches = train_graph(tf.float16)
    (tmp_path / "train16.meta").write_bytes(meta.SerializeToString())
    twin = graphs.train_losses(train_graph(tf.float32)[0].graph_def, feeds, fetches, 15)
    for target, options in (("float32", {}), ("bfloat16", BF16_ALL)):
        out = tmp_path / f"{target}.meta"
        convert_file(tmp_path / "train16.meta", out, **{"target": target, **options})
        converted = load(out).meta_graphs[0].graph_def
        losses = graphs.train_losses(converted, feeds, fetches, 15)
        if target == "float32":
            assert sixteen_bit(converted.node) == [] and losses == twin
        else:
            assert stacked_casts(converted) == []
            assert max(abs(a - b) for a, b in zip(losses, twin)) < 0.01
            assert losses[-1] < losses[0] - 0.3


def test_a_train_step_saved_model_built_in_float16_trains_in_float32(tmp_path):
    class Step(tf.Module):
        def __init__(self, dtype):
            rng = np.random.default_rng(0)
            self.dtype16 = dtype
            self.w = tf.Variable(rng.normal(0, 0.3, (16, 4)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 16]), tf.TensorSpec([None], tf.int32)])
        def train_step(self, x, y):
            with tf.GradientTape() as tape:
                logits = tf.cast(tf.matmul(tf.cast(x, self.dtype16), tf.cast(self.w, self.dtype16)),
                                 tf.float32)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            self.w.assign_sub(0.1 * tape.gradient(loss, self.w))
            return {"loss": loss}

    for dtype, name in ((tf.float16, "step16"), (tf.float32, "twin")):
        module = Step(dtype)
        tf.saved_model.save(module, str(tmp_path / name), signatures={"train": module.train_step})
    convert_file(tmp_path / "step16", tmp_path / "step32", target="float32")
    rng = np.random.default_rng(1)
    x, y = rng.normal(0, 1, (32, 16)).astype(np.float32), rng.integers(0, 4, 32).astype(np.int32)

    def losses(name):
        step = tf.saved_model.load(str(tmp_path / name)).signatures["train"]
        return [float(step(x=tf.constant(x), y=tf.constant(y))["loss"]) for _ in range(10)]

    assert losses("step32") == losses("twin")
    assert sixteen_bit(n for n in saved_nodes(tmp_path / "step32") if n.op != "Placeholder") == []


@pytest.mark.parametrize("target", ["float32", "bfloat16"])
def test_a_graph_that_trains_float16_variables_is_refused(tmp_path, capsys, target):
    meta, _, _ = train_graph(tf.float16, variables=tf.float16)
    src = tmp_path / "var16.meta"
    src.write_bytes(meta.SerializeToString())
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "out.meta", "--target", target,
                                    "--device", "cpu"])
    assert_refused(code, err, str(src), tmp_path, before)
    assert ("the graph trains variables stored in float16 (ResourceApplyGradientDescent "
            "'train/update_w1/ResourceApplyGradientDescent' writes one)") in err
    # left as it is, it converts for float16 as before
    assert run_cli(capsys, [src, "-o", tmp_path / "out.meta", "--loss-scale", "none"])[0] == 0


def test_the_json_report_holds_the_widening(tmp_path, capsys):
    src = tmp_path / "mlp16.pb"
    src.write_bytes(mlp(tf.float16)[0].SerializeToString())
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "out.pb", "--target", "float32",
                                    "--report", tmp_path / "r.json"])
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["target"] == "float32" and data["widening"]["nodes"] > 0
    assert {n["code"] for n in data["nodes"]} >= {"target_float32", "cast_removed"}
