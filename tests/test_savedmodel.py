"""SavedModel directories in and out: Keras exports, tf.Modules with control flow, train steps."""

import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import graphs
import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from tensorflow.core.framework import types_pb2
from tensorflow.python.saved_model import loader_impl

from amp_rewrite import UnsupportedGraphError, convert_file
from amp_rewrite.cli.run import main
from amp_rewrite.core.errors import InputError
from amp_rewrite.schema.functiondef import function_to_graph, graph_to_function

TOL = {"float16": 5e-3, "bfloat16": 2e-2}
DEVICE = {"float16": "gpu", "bfloat16": "cpu"}
LOWP = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}
MATRIX_OPS = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D")


def functions_of(path):
    """{function name: FunctionDef} of the first MetaGraph of the SavedModel at ``path``."""
    saved = loader_impl.parse_saved_model(str(path))
    return {f.signature.name: f for f in saved.meta_graphs[0].graph_def.library.function}


def matrix_dtypes(path):
    """The T of every MatMul-family node in every function of the SavedModel."""
    return [nd.attr["T"].type for f in functions_of(path).values() for nd in f.node_def
            if nd.op in MATRIX_OPS]


def same_tree(a: Path, b: Path, subdir: str) -> bool:
    names = sorted(p.relative_to(a / subdir) for p in (a / subdir).rglob("*") if p.is_file())
    other = sorted(p.relative_to(b / subdir) for p in (b / subdir).rglob("*") if p.is_file())
    return names == other and all(filecmp.cmp(a / subdir / n, b / subdir / n, shallow=False)
                                  for n in names)


# ----------------------------------------------------------------- Keras export
def keras_model():
    """Conv, batch norm, LSTM, attention, dense: the Keras model the SavedModel tests export
    (tests/data/keras_export is its export, see tests/golden.py)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Reshape((8, 64))(x)
    x = keras.layers.LSTM(16, return_sequences=True)(x)
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(10)(x)
    model = keras.Model(inp, out)
    # BatchNormalization statistics that are not the identity, so the layer does something
    model.layers[2].set_weights([w + np.linspace(0.1, 0.5, w.shape[0]).astype(np.float32)
                                 for w in model.layers[2].get_weights()])
    return model


@pytest.fixture(scope="module")
def keras_export(tmp_path_factory):
    model = keras_model()
    path = tmp_path_factory.mktemp("keras") / "model"
    model.export(str(path), verbose=False)
    x = load_digits().images[:6, :, :, None].astype(np.float32) / 16.0
    return path, x, model(x).numpy()


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_keras_export_converts_serves_and_keeps_weights(keras_export, target, tmp_path):
    src, x, want = keras_export
    out = tmp_path / "amp"
    # (bfloat16 on a CPU freezes such a model by default: this is the conversion that keeps
    # its variables, byte for byte)
    report = convert_file(src, out, target=target, device=DEVICE[target], min_matrix_intensity=0,
                          freeze=False)
    loaded = tf.saved_model.load(str(out))
    served = loaded.serve(tf.constant(x)).numpy()
    signed = list(loaded.signatures["serving_default"](tf.constant(x)).values())[0].numpy()
    assert graphs.rel_l2(served, want) <= TOL[target]
    assert graphs.rel_l2(signed, want) <= TOL[target]
    assert served.dtype == signed.dtype == np.float32
    # every matrix op of every layer (Conv2D, LSTM's MatMuls, attention's Einsums, Dense) is low precision
    dtypes = matrix_dtypes(out)
    assert len(dtypes) >= 4 and set(dtypes) == {LOWP[target]}
    assert same_tree(src, out, "variables") and same_tree(src, out, "assets")
    # the signatures (float32 inputs and outputs) are the input's, unchanged
    before = loader_impl.parse_saved_model(str(src)).meta_graphs[0]
    after = loader_impl.parse_saved_model(str(out)).meta_graphs[0]
    assert after.signature_def == before.signature_def
    assert {info.dtype for info in after.signature_def["serving_default"].inputs.values()} == {
        types_pb2.DT_FLOAT}
    s = report.summary()
    assert s["matrix_converted"] == s["matrix_total"] >= 4


def test_keras_functions_round_trip_through_the_ir_losslessly(keras_export):
    src, _, _ = keras_export
    lib = functions_of(src)
    sigs = {name: f.signature for name, f in lib.items()}
    assert len(lib) >= 5
    for fdef in lib.values():  # LSTM loops, TensorLists, Split/Unpack list outputs ...
        fg = function_to_graph(fdef, sigs)
        assert graph_to_function(fg, sigs) == fdef


def test_saved_model_cli_reads_and_runs_the_output(keras_export, tmp_path):
    """TensorFlow's own tool, through its TF1 session loader: ``show`` lists the serving
    signature with its float32 input and output and the Casts the conversion added; ``run``
    computes Keras' outputs within bfloat16's tolerance."""
    src, x, want = keras_export
    out = tmp_path / "amp"
    convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0)
    cli = Path(sys.executable).with_name("saved_model_cli")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}

    def saved_model_cli(*args):
        done = subprocess.run([str(cli), *args], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    shown = saved_model_cli("show", "--dir", str(out), "--all")
    serving = shown[shown.index("signature_def['serving_default']"):].split("Method name")[0]
    assert re.search(r"inputs\['\w+'\] tensor_info:\s+dtype: DT_FLOAT\s+shape: \(-1, 8, 8, 1\)", serving)
    assert re.search(r"outputs\['\w+'\] tensor_info:\s+dtype: DT_FLOAT\s+shape: \(-1, 10\)", serving)
    ops = set(re.findall(r"'(\w+)'", shown[shown.index("contains the following ops"):].splitlines()[0]))
    assert {"Cast", "MatMul", "Conv2D"} <= ops
    np.save(tmp_path / "x.npy", x)
    name = re.search(r"inputs\['(\w+)'\]", serving).group(1)
    saved_model_cli("run", "--dir", str(out), "--tag_set", "serve", "--signature_def",
                    "serving_default", "--inputs", f"{name}={tmp_path / 'x.npy'}",
                    "--outdir", str(tmp_path / "ran"))
    (result,) = (tmp_path / "ran").glob("*.npy")
    assert graphs.rel_l2(np.load(result), want) <= TOL["bfloat16"]


# ----------------------------------------------------------------- tf.Module with control flow
class LoopAndBranch(tf.Module):
    def __init__(self):
        r = np.random.default_rng(0)
        self.w = tf.Variable(r.normal(0, 0.25, (16, 16)).astype(np.float32))
        self.v = tf.Variable(r.normal(0, 0.25, (16, 16)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    def __call__(self, x):
        _, h = tf.while_loop(lambda i, h: i < 3,
                             lambda i, h: (i + 1, tf.nn.relu(tf.matmul(h, self.w))),
                             [tf.constant(0), x])
        y = tf.cond(tf.reduce_sum(h) > 0, lambda: tf.matmul(h, self.v), lambda: h * 2.0)
        return {"y": y}


@pytest.fixture(scope="module")
def loop_module(tmp_path_factory):
    module = LoopAndBranch()
    path = tmp_path_factory.mktemp("loop") / "model"
    tf.saved_model.save(module, str(path), signatures=module.__call__)
    x = np.random.default_rng(1).normal(0, 1, (4, 16)).astype(np.float32)
    return path, x, module(tf.constant(x))["y"].numpy()


def _bodies(path, op, attrs):
    """FunctionDefs that ``op`` nodes of any function call through ``attrs``."""
    funcs = functions_of(path)
    return [funcs[nd.attr[a].func.name] for f in funcs.values() for nd in f.node_def
            if nd.op == op for a in attrs]


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_module_while_and_cond_bodies_are_painted(loop_module, target, tmp_path):
    src, x, want = loop_module
    out = tmp_path / "amp"
    # (the conversion that keeps the variables: freezing, bfloat16's default on a CPU, inlines
    # the bodies)
    convert_file(src, out, target=target, device=DEVICE[target], min_matrix_intensity=0,
                 freeze=False)
    loop_bodies = _bodies(out, "While", ["body"])
    branches = _bodies(out, "If", ["then_branch"])
    assert loop_bodies and branches
    for fdef in loop_bodies + branches:
        matmuls = [nd for nd in fdef.node_def if nd.op == "MatMul"]
        assert matmuls and all(nd.attr["T"].type == LOWP[target] for nd in matmuls)
    loaded = tf.saved_model.load(str(out))
    got = loaded.signatures["serving_default"](x=tf.constant(x))["y"].numpy()
    assert graphs.rel_l2(got, want) <= TOL[target]
    assert graphs.rel_l2(loaded(tf.constant(x))["y"].numpy(), want) <= TOL[target]


def test_overrides_name_function_nodes_as_the_report_does(loop_module, tmp_path):
    src, x, want = loop_module
    rules = tmp_path / "keep.toml"
    rules.write_text('[[override]]\nglob = "while_body*/while/MatMul"\naction = "keep_fp32"\n\n'
                     '[[override]]\nglob = "no/such/node"\naction = "keep_fp32"\n')
    out = tmp_path / "amp"
    report = convert_file(src, out, target="float16", rules=[rules])
    kept = [n for n in report.nodes if n.op == "MatMul" and n.code == "user_keep"]
    assert len(kept) == 1 and kept[0].precision == "float32"
    assert [nd.attr["T"].type for f in _bodies(out, "While", ["body"]) for nd in _nodes(f, "MatMul")
            ] == [types_pb2.DT_FLOAT]
    assert [nd.attr["T"].type for f in _bodies(out, "If", ["then_branch"])
            for nd in _nodes(f, "MatMul")] == [types_pb2.DT_HALF]
    assert len(report.warnings) == 1  # only the override that matches nothing anywhere
    got = tf.saved_model.load(str(out)).signatures["serving_default"](x=tf.constant(x))["y"]
    assert graphs.rel_l2(got.numpy(), want) <= TOL["float16"]


def test_keep_names_a_function_node_as_the_report_does(loop_module, tmp_path):
    src, x, want = loop_module
    report = convert_file(src, tmp_path / "amp", target="float16")
    matmul = next(n.name for n in report.nodes if n.op == "MatMul" and n.name.startswith("while_body"))
    kept = convert_file(src, tmp_path / "kept", target="float16", keep=[matmul])
    assert kept.node(matmul).code == "user_keep" and kept.node(matmul).precision == "float32"
    assert [nd.attr["T"].type for f in _bodies(tmp_path / "kept", "While", ["body"])
            for nd in _nodes(f, "MatMul")] == [types_pb2.DT_FLOAT]
    with pytest.raises(InputError):
        convert_file(src, tmp_path / "bad", target="float16", keep=[matmul + "_missing"])
    assert not (tmp_path / "bad").exists()


def _nodes(fdef, op):
    return [nd for nd in fdef.node_def if nd.op == op]


# ----------------------------------------------------------------- writing
def test_existing_output_needs_force_and_is_replaced_whole(loop_module, tmp_path):
    src, x, want = loop_module
    out = tmp_path / "amp"
    out.mkdir()  # an older SavedModel, with a file the new one does not have
    (out / "saved_model.pb").write_bytes(b"old")
    (out / "stale.txt").write_text("left from before")
    with pytest.raises(InputError):
        convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert sorted(p.name for p in out.iterdir()) == ["saved_model.pb", "stale.txt"]
    convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0, force=True)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["amp"]  # no temporary folders left
    got = tf.saved_model.load(str(out)).signatures["serving_default"](x=tf.constant(x))["y"]
    assert graphs.rel_l2(got.numpy(), want) <= TOL["bfloat16"]


def test_bad_saved_models_exit_2_and_write_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "saved_model.pb").write_bytes(b"\x0a\xff\xff\xff\x0fnot a protobuf")
    for src in (empty, broken):
        out = tmp_path / f"{src.name}_amp"
        assert main([str(src), "-o", str(out)]) == 2
        assert not out.exists()
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "empty"]


def test_output_inside_the_input_is_refused(loop_module):
    src, _, _ = loop_module
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(InputError):
        convert_file(src, src / "amp", target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert sorted(p.name for p in src.iterdir()) == before


# ----------------------------------------------------------------- training functions
class Trainer(tf.Module):
    """A two-layer classifier whose train step is a tf.function with a GradientTape."""

    def __init__(self):
        r = np.random.default_rng(0)
        self.w1 = tf.Variable(r.normal(0, 0.25, (64, 32)).astype(np.float32))
        self.b1 = tf.Variable(np.zeros(32, np.float32))
        self.w2 = tf.Variable(r.normal(0, 0.25, (32, 10)).astype(np.float32))
        self.b2 = tf.Variable(np.zeros(10, np.float32))

    def logits(self, x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, self.w1) + self.b1), self.w2) + self.b2

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def train(self, x, y):
        params = [self.w1, self.b1, self.w2, self.b2]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=self.logits(x)))
        for var, grad in zip(params, tape.gradient(loss, params)):
            var.assign_sub(0.5 * grad)
        return {"loss": loss}

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def predict(self, x):
        return {"logits": self.logits(x)}


@pytest.fixture(scope="module")
def train_module(tmp_path_factory):
    module = Trainer()
    path = tmp_path_factory.mktemp("train") / "model"
    tf.saved_model.save(module, str(path), signatures={"train": module.train,
                                                        "predict": module.predict})
    digits = load_digits()
    return path, (digits.data[:256] / 16.0).astype(np.float32), digits.target[:256].astype(np.int32)


def _train(loaded, x, y, steps):
    step = loaded.signatures["train"]
    return [float(step(x=tf.constant(x), y=tf.constant(y))["loss"]) for _ in range(steps)]


def test_train_step_round_trip_in_bfloat16_trains(train_module, tmp_path):
    src, x, y = train_module
    out = tmp_path / "amp"
    convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0)
    train_fn = [f for name, f in functions_of(out).items() if "train" in name and
                any(nd.name.startswith("gradient_tape/") for nd in f.node_def)]
    assert train_fn
    matmuls = [nd for nd in train_fn[0].node_def if nd.op == "MatMul"]
    assert len(matmuls) >= 5 and all(nd.attr["T"].type == types_pb2.DT_BFLOAT16 for nd in matmuls)
    loaded = tf.saved_model.load(str(out))
    losses = _train(loaded, x, y, steps=10)
    reference = _train(tf.saved_model.load(str(src)), x, y, steps=10)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0]
    assert abs(losses[-1] - reference[-1]) <= 0.05 * reference[-1]  # the FP32 run's curve
    assert all(v.dtype == tf.float32 for v in (loaded.w1, loaded.b1, loaded.w2, loaded.b2))
    assert same_tree(src, out, "variables")


def test_train_step_in_float16_gets_loss_scaling(train_module, tmp_path):
    """Plain assign_sub updates are gated like an optimizer's (tests/test_saved_training.py
    covers Keras optimizers, skipped steps and checkpoints)."""
    src, x, y = train_module
    out = tmp_path / "amp"
    report = convert_file(src, out, target="float16")
    assert report.to_dict()["loss_scaling"]["gated_writes"] == 4
    loaded = tf.saved_model.load(str(out))
    losses = _train(loaded, x, y, steps=10)
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0]
    assert int(loaded.amp_loss_scale.skipped_steps.numpy()) == 0
    assert int(loaded.amp_loss_scale.good_steps.numpy()) == 10


def test_train_step_in_float16_without_loss_scaling_when_asked(train_module, tmp_path):
    src, x, y = train_module
    out = tmp_path / "amp"
    convert_file(src, out, target="float16", loss_scale="none")
    assert set(matrix_dtypes(out)) == {types_pb2.DT_HALF}
    losses = _train(tf.saved_model.load(str(out)), x, y, steps=5)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


# ----------------------------------------------------------------- weights over 2 GiB
class Big(tf.Module):
    """2.3 GB of float32 weights in three variables: more than one protobuf message may hold."""

    def __init__(self):
        self.tables = [tf.Variable(tf.fill([190_000_000], (i + 1) / 8)) for i in range(3)]
        self.w = tf.Variable(np.random.default_rng(0).normal(0, 0.25, (16, 16)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32)])
    def __call__(self, x):
        return {"y": tf.matmul(x, self.w) + tf.add_n([t[:16] for t in self.tables])}


@pytest.fixture
def big_dirs(tmp_path):
    """Two folders for 2.3 GB models, removed afterwards (pytest keeps its last temp folders)."""
    yield tmp_path / "big", tmp_path / "big_amp"
    for folder in (tmp_path / "big", tmp_path / "big_amp"):
        shutil.rmtree(folder, ignore_errors=True)


def test_weights_over_2_gib_convert_load_and_run(big_dirs):
    src, out = big_dirs
    module = Big()
    tf.saved_model.save(module, str(src), signatures=module.__call__)
    w = module.w.numpy().astype(np.float64)
    del module
    weights = sum(p.stat().st_size for p in (src / "variables").iterdir())
    assert weights > 2**31
    report = convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert report.summary()["matrix_converted"] == 1
    assert (out / "saved_model.pb").stat().st_size < 2**20
    assert sum(p.stat().st_size for p in (out / "variables").iterdir()) == weights
    x = np.random.default_rng(1).normal(0, 1, (4, 16)).astype(np.float32)
    got = tf.saved_model.load(str(out)).signatures["serving_default"](x=tf.constant(x))["y"]
    assert graphs.rel_l2(got.numpy(), x.astype(np.float64) @ w + 0.75) <= TOL["bfloat16"]


# ----------------------------------------------------------------- TF1 SavedModels
def test_tf1_saved_model_main_graph_is_painted_and_serves(tmp_path):
    v1 = tf.compat.v1
    r = np.random.default_rng(4)
    src, out = tmp_path / "tf1", tmp_path / "tf1_amp"
    x_val = r.normal(0, 1, (4, 16)).astype(np.float32)
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        w = v1.get_variable("w", initializer=r.normal(0, 0.25, (16, 8)).astype(np.float32))
        y = tf.nn.softmax(tf.matmul(tf.nn.relu(tf.matmul(x, tf.ones([16, 16]) * 0.1)), w), name="y")
        sess.run(v1.global_variables_initializer())
        want = sess.run(y, {x: x_val})
        v1.saved_model.simple_save(sess, str(src), inputs={"x": x}, outputs={"y": y})
    convert_file(src, out, target="float16")
    saved = loader_impl.parse_saved_model(str(out)).meta_graphs[0]
    matmuls = [n for n in saved.graph_def.node if n.op == "MatMul"]
    assert len(matmuls) == 2 and all(n.attr["T"].type == types_pb2.DT_HALF for n in matmuls)
    assert same_tree(src, out, "variables")
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        meta = v1.saved_model.loader.load(sess, ["serve"], str(out))
        sig = meta.signature_def["serving_default"]
        got = sess.run(sig.outputs["y"].name, {sig.inputs["x"].name: x_val})
    assert got.dtype == np.float32 and graphs.rel_l2(got, want) <= TOL["float16"]


def _tf1_train_and_serve(path):
    """A TF1 SavedModel with two MetaGraphs: "train" (a GradientDescent step) and "serve"."""
    v1 = tf.compat.v1
    digits = load_digits()
    r = np.random.default_rng(5)
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w1 = v1.get_variable("w1", initializer=r.normal(0, 0.25, (64, 32)).astype(np.float32))
        w2 = v1.get_variable("w2", initializer=r.normal(0, 0.25, (32, 10)).astype(np.float32))
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        train = v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        sess.run(v1.global_variables_initializer())
        info = v1.saved_model.utils.build_tensor_info
        builder = v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["train"], signature_def_map={
            "train": v1.saved_model.signature_def_utils.build_signature_def(
                {"x": info(x), "y": info(y)}, {"loss": info(loss)})})
        builder.add_meta_graph(["serve"], signature_def_map={
            "serving_default": v1.saved_model.signature_def_utils.predict_signature_def(
                {"x": x}, {"logits": logits})})
        builder.save()
    return (digits.data[:256] / 16.0).astype(np.float32), digits.target[:256].astype(np.int32)


def test_tf1_saved_model_with_train_and_serve_meta_graphs(tmp_path):
    v1 = tf.compat.v1
    src, out = tmp_path / "tf1", tmp_path / "tf1_amp"
    x, y = _tf1_train_and_serve(src)
    with pytest.raises(UnsupportedGraphError):  # float16 training needs loss scaling
        convert_file(src, out, target="float16")
    assert not out.exists()
    report = convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0)
    saved = loader_impl.parse_saved_model(str(out))
    assert len(saved.meta_graphs) == 2
    for meta in saved.meta_graphs:
        # a signature's tensors keep float32 (logits is one in "serve" only); the rest is bfloat16
        dtypes = {n.name: n.attr["T"].type for n in meta.graph_def.node if n.op == "MatMul"}
        logits = dtypes.pop("logits")
        assert logits == (types_pb2.DT_FLOAT if "serve" in meta.meta_info_def.tags
                          else types_pb2.DT_BFLOAT16)
        assert len(dtypes) >= 1 and set(dtypes.values()) == {types_pb2.DT_BFLOAT16}
    assert any(n.name.startswith("gradients/") and n.precision == "bfloat16" for n in report.nodes)
    losses = []
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        v1.saved_model.loader.load(sess, ["train"], str(out))
        for _ in range(8):
            losses.append(sess.run(["loss:0", "train"], {"x:0": x, "y:0": y})[0])
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0]
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        v1.saved_model.loader.load(sess, ["serve"], str(out))
        assert sess.run("logits:0", {"x:0": x}).dtype == np.float32


# ----------------------------------------------------------------- restored functions stay callable
class SharedInner(tf.Module):
    """``inner`` is both a restored method (float32 signature) and called twice by ``__call__``."""

    def __init__(self):
        self.w = tf.Variable(np.random.default_rng(6).normal(0, 0.25, (16, 16)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32)])
    def inner(self, h):
        return tf.nn.relu(tf.matmul(h, self.w))

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32)])
    def __call__(self, x):
        a = tf.matmul(self.inner(tf.matmul(x, self.w)), self.w)
        return {"y": a + tf.exp(self.inner(tf.exp(x * 0.1)) * 0.1)}


def test_restored_function_keeps_its_signature_when_a_copy_is_specialized(tmp_path):
    module = SharedInner()
    src, out = tmp_path / "shared", tmp_path / "shared_amp"
    tf.saved_model.save(module, str(src), signatures=module.__call__)
    x = tf.constant(np.random.default_rng(7).normal(0, 1, (4, 16)).astype(np.float32))
    report = convert_file(src, out, target="float16")
    assert report.extra["boundaries"]["specialized"]
    loaded = tf.saved_model.load(str(out))
    assert graphs.rel_l2(loaded(x)["y"].numpy(), module(x)["y"].numpy()) <= TOL["float16"]
    inner = loaded.inner(x)  # the restored method still takes and returns float32
    assert inner.dtype == tf.float32
    assert graphs.rel_l2(inner.numpy(), module.inner(x).numpy()) <= TOL["float16"]
