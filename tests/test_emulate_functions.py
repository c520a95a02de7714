"""float16 emulation inside function bodies: a TF2 SavedModel (a Keras Conv/Dense/softmax
classifier and a tf.function with a while loop) and a graph file whose ops live in a function
library, emulated with their signatures kept float32; checked against a real float16 run on the
CPU (TensorFlow's float16 CPU kernels), against grappler's ``auto_mixed_precision_cpu`` pass run
on the same graph and library, and through ``verify --emulate``."""

import shutil
import tempfile

import graphs
import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow.python.grappler import tf_optimizer

from amp_rewrite import UnsupportedGraphError, cli, convert_file
from amp_rewrite.check.lint import lint_problems
from amp_rewrite.core.dtypes import FLOAT, HALF
from amp_rewrite.core.errors import INTERNAL_EXIT
from amp_rewrite.schema.functiondef import check_call_types, function_to_graph
from amp_rewrite.tools.verify import verify
from amp_rewrite.transforms import emulate
from amp_rewrite.transforms.constfold import grappler_alone

from machine import onednn_float16

v1 = tf.compat.v1
SIGNATURES = {"serving_default": ("images", "probabilities"), "iterate": ("x", "state")}


class Model(tf.Module):
    """A Keras classifier (Conv2D, Dense, softmax) and a tanh recurrence in a while loop."""

    def __init__(self):
        super().__init__()
        keras.utils.set_random_seed(0)
        inp = keras.Input((8, 8, 1))
        x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
        x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(x))
        self.model = keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x))
        self.w = tf.Variable(tf.random.stateless_normal([32, 32], seed=[1, 2]) * 0.2)

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 1], tf.float32)])
    def classify(self, images):
        return {"probabilities": self.model(images)}

    @tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
    def iterate(self, x):
        def body(i, h):
            return i + 1, tf.nn.tanh(tf.matmul(h, self.w))
        return {"state": tf.while_loop(lambda i, h: i < 5, body, [tf.constant(0), x])[1]}


def _meta(path):
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((path / "saved_model.pb").read_bytes())
    return saved


def _grappler_emulation(src, dst):
    """The SavedModel ``src`` with every function grappler's auto_mixed_precision_cpu pass
    optimized replaced by grappler's version (its own float16 emulation), at ``dst``."""
    saved = _meta(src)
    meta = saved.meta_graphs[0]
    theirs = tf_optimizer.OptimizeGraph(grappler_alone("auto_mixed_precision_cpu"), meta)
    optimized = {f.signature.name: f for f in theirs.library.function}
    for f in meta.graph_def.library.function:
        if f.signature.name in optimized:
            f.CopyFrom(optimized[f.signature.name])
    shutil.copytree(src, dst)
    (dst / "fingerprint.pb").unlink(missing_ok=True)   # it names the FP32 graph's hash
    (dst / "saved_model.pb").write_bytes(saved.SerializeToString())
    return meta.graph_def.library


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emulate_functions")
    module = Model()
    tf.saved_model.save(module, str(folder / "fp32"),
                        signatures={"serving_default": module.classify, "iterate": module.iterate})
    convert_file(folder / "fp32", folder / "f16", target="float16")
    report = convert_file(folder / "fp32", folder / "emu", target="float16", emulate=True)
    grappler = _grappler_emulation(folder / "fp32", folder / "grappler")
    feeds = {"images": (load_digits().data[:64] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1),
             "x": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)}
    for name, value in feeds.items():
        np.savez(folder / f"{name}.npz", **{name: value})
    outputs = {}
    for kind in ("fp32", "f16", "emu", "grappler"):
        loaded = tf.saved_model.load(str(folder / kind))
        for key, (arg, out) in SIGNATURES.items():
            result = loaded.signatures[key](**{arg: tf.constant(feeds[arg])})[out]
            outputs[kind, key] = result.numpy().astype(np.float64)
    return folder, report.to_dict(), grappler, outputs


def _ulps(a, b):
    """|a - b| in units of float16's last place at b."""
    return np.abs(a - b) / np.abs(np.spacing(b.astype(np.float16))).astype(np.float64)


@pytest.mark.parametrize("signature", sorted(SIGNATURES))
def test_emulated_savedmodel_tracks_real_float16_on_the_cpu(models, signature):
    """The emulation against the float16 conversion run with TensorFlow's float16 CPU kernels.

    Both keep every float16 tensor at float16's 11 significant bits (one unit in the last place
    is 2^-11 to 2^-10 of a value); they differ inside an op: some float16 CPU kernels compute in
    float16 (Softmax's exponentials and their sum), the emulation computes in float32 and
    rounds once, as GPU kernels do. Here the probabilities differ by up to 2 units, the loop's
    state (MatMul and Tanh round once either way) by none; 4 units per element and a relative
    L2 of 2e-3 leave room for other CPUs' float16 kernels. A float32 run would be about 1e-7
    from FP32: the emulation's error is float16's."""
    _, _, _, outputs = models
    fp32, half, emu = (outputs[kind, signature] for kind in ("fp32", "f16", "emu"))
    assert graphs.rel_l2(emu, half) <= 2e-3
    assert _ulps(emu, half).max() <= 4
    assert 1e-5 < graphs.rel_l2(emu, fp32) < 1e-2


@pytest.mark.parametrize("signature", sorted(SIGNATURES))
def test_emulated_savedmodel_matches_grapplers_cpu_emulation(models, signature):
    """grappler optimizes a MetaGraph's library functions with its auto_mixed_precision_cpu
    pass (its own float16 emulation) too: the same numbers, to within the relative L2 of
    tests/test_emulate.py's graphs."""
    _, _, grappler, outputs = models
    painted = {f.signature.name: sum(n.op == "Cast" and n.attr["DstT"].type == HALF
                                     for n in f.node_def) for f in grappler.function}
    assert any(count and "while_body" in name for name, count in painted.items())
    assert any(count and "classify" in name for name, count in painted.items())
    assert graphs.rel_l2(outputs["emu", signature], outputs["grappler", signature]) <= 1e-6


def test_emulated_savedmodel_keeps_float32_signatures_and_passes_the_lint(models):
    folder, report, _, _ = models
    loaded = tf.saved_model.load(str(folder / "emu"))
    for key, (arg, out) in SIGNATURES.items():
        fn = loaded.signatures[key]
        assert fn.structured_input_signature[1][arg].dtype == tf.float32
        assert fn.structured_outputs[out].dtype == tf.float32
    meta = _meta(folder / "emu").meta_graphs[0]
    library = meta.graph_def.library
    signatures = {f.signature.name: f.signature for f in library.function}
    bodies = {f.signature.name: f for f in library.function}
    emulated = report["emulation"]["functions"]
    assert any("while_body" in n for n in emulated) and any("classify" in n for n in emulated)
    for name in emulated:
        fdef = bodies[name]
        args = list(fdef.signature.input_arg) + list(fdef.signature.output_arg)
        assert all(a.type != HALF for a in args), name
        # float16 is left only in the casts that round to it and back
        assert all(n.op == "Cast" and {n.attr["SrcT"].type, n.attr["DstT"].type} == {FLOAT, HALF}
                   for n in fdef.node_def
                   if any(v.type == HALF or HALF in v.list.type for v in n.attr.values())), name
        assert lint_problems(function_to_graph(fdef, signatures).graph) == [], name
    assert check_call_types(meta.graph_def) == []
    # the loop variable the conversion lowered to float16 is float32 now, and arrives rounded
    # by the body that made it: the body's MatMul reads the argument itself, no cast between
    body = next(bodies[n] for n in emulated if "while_body" in n)
    matmul = next(n for n in body.node_def if n.op == "MatMul")
    assert matmul.attr["T"].type == FLOAT
    assert matmul.input[0] in {a.name for a in body.signature.input_arg}


def test_verify_emulates_a_float16_savedmodel(models, tmp_path, monkeypatch, capsys):
    folder, _, _, _ = models
    images = str(folder / "images.npz")
    emulated = verify(folder / "fp32", folder / "f16", inputs=images, emulate=True)
    written = verify(folder / "fp32", folder / "emu", inputs=images)
    real = verify(folder / "fp32", folder / "f16", inputs=images)
    assert emulated.ok and emulated.criteria.dtype == "float16"
    # verify --emulate runs what convert --emulate writes, not the float16 kernels
    assert emulated.outputs[0].rel_l2 == pytest.approx(written.outputs[0].rel_l2, rel=1e-6)
    if not onednn_float16:   # oneDNN's float16 kernels may round as the emulation does
        assert emulated.outputs[0].rel_l2 != pytest.approx(real.outputs[0].rel_l2, rel=1e-3)
    # --per-node replays the emulated bodies: the loop body's MatMul computes in float32
    looped = verify(folder / "fp32", folder / "f16", inputs=str(folder / "x.npz"),
                    signature="iterate", nodes=True, emulate=True)
    assert looped.ok
    matmuls = [n for n in looped.nodes if "while_body" in n.tensor and n.op == "MatMul"]
    assert matmuls and all(n.dtype == "float32" and n.rel_l2 > 0 for n in matmuls)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    capsys.readouterr()
    assert cli.main(["verify", str(folder / "fp32"), str(folder / "f16"), "--inputs", images,
                     "--emulate", "-q"]) == 0
    assert list(scratch.iterdir()) == []   # the emulated copy is gone with the run


def test_graph_file_with_a_function_library(tmp_path):
    """A GraphDef whose loop lives in library functions (a tf.function called in a v1 graph):
    emulated like a SavedModel's, and against the real float16 run and grappler."""
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [16, 32], name="x")
        w = tf.constant(rng.standard_normal((32, 32)).astype(np.float32) * 0.2, name="w")
        head = tf.constant(rng.standard_normal((32, 10)).astype(np.float32), name="head")

        @tf.function
        def iterate(h):
            def body(i, h):
                return i + 1, tf.nn.tanh(tf.matmul(h, w))
            return tf.while_loop(lambda i, h: i < 5, body, [tf.constant(0), h])[1]
        tf.nn.softmax(tf.matmul(iterate(x), head), name="out")
    gd = g.as_graph_def()
    (tmp_path / "in.pb").write_bytes(gd.SerializeToString())
    convert_file(tmp_path / "in.pb", tmp_path / "f16.pb", target="float16")
    report = convert_file(tmp_path / "in.pb", tmp_path / "emu.pb", target="float16", emulate=True)
    assert any("while_body" in name for name in report.to_dict()["emulation"]["functions"])
    emulated = v1.GraphDef()
    emulated.ParseFromString((tmp_path / "emu.pb").read_bytes())
    half = v1.GraphDef()
    half.ParseFromString((tmp_path / "f16.pb").read_bytes())
    meta = meta_graph_pb2.MetaGraphDef(graph_def=gd)
    meta.collection_def["train_op"].node_list.value.append("out")
    theirs = tf_optimizer.OptimizeGraph(grappler_alone("auto_mixed_precision_cpu"), meta)
    feeds = {"x:0": rng.standard_normal((16, 32)).astype(np.float32)}
    ref, real, ours, grappler = (graphs.run(d, feeds, ["out:0"])[0]
                                 for d in (gd, half, emulated, theirs))
    assert 1e-5 < graphs.rel_l2(ours, ref) < 1e-2
    assert graphs.rel_l2(ours, real) <= 2e-3 and _ulps(ours, real).max() <= 4
    assert graphs.rel_l2(ours, grappler) <= 1e-6


def test_a_float16_signature_is_refused(tmp_path, capsys):
    """A model whose own signature takes float16 (built so): emulation would retype what the
    SavedModel's callers pass. One line, exit 2, nothing written."""
    module = tf.Module()
    module.f = tf.function(lambda x: {"y": tf.matmul(x, x)},
                           input_signature=[tf.TensorSpec([4, 4], tf.float16)])
    tf.saved_model.save(module, str(tmp_path / "half"), signatures=module.f)
    with pytest.raises(UnsupportedGraphError, match="takes or returns float16"):
        convert_file(tmp_path / "half", tmp_path / "emu", target="float16", emulate=True)
    capsys.readouterr()
    assert cli.main([str(tmp_path / "half"), "-o", str(tmp_path / "emu"), "--emulate"]) == 2
    err = capsys.readouterr().err   # a warning that the input holds float16, then the error
    assert "Traceback" not in err and "takes or returns float16" in err.strip().splitlines()[-1]
    assert not (tmp_path / "emu").exists()


def test_a_broken_emulation_of_a_body_is_our_bug_and_nothing_is_written(models, tmp_path,
                                                                        monkeypatch):
    """Each emulated body is linted before it is written back (the SavedModel's own graph holds
    no float16 op: only the bodies are edited): readers of an op emulated in float32 left
    reading it as float16 is exit 70, with no output."""
    folder, _, _, _ = models
    monkeypatch.setattr(emulate, "_widen_outputs", lambda *args, **kwargs: None)
    assert cli.main([str(folder / "fp32"), "-o", str(tmp_path / "emu"), "--emulate"]) \
        == INTERNAL_EXIT
    assert not (tmp_path / "emu").exists()
