"""``--freeze``: a SavedModel's (or Keras file's) serving signatures frozen, folded, converted
and written as a SavedModel that serves the same signatures (amp_rewrite/io/frozen.py, driven
by amp_rewrite/conversion/pipeline.py).

The models are real: a Keras CNN trained on scikit-learn's digits and exported with
``model.export()`` (its ``serve`` and ``serving_default`` signatures), a ``tf.Module`` with two
signatures of different inputs and outputs, one that looks words up in two tables (a vocabulary
in the graph and one in an asset file), and SavedModels --freeze must refuse: a train
signature, one that writes a variable, none at all, and graph files.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from refusals import assert_refused, run_cli, snapshot
from sklearn.datasets import load_digits
from tensorflow.core.protobuf import saved_model_pb2

from amp_rewrite import InputError, convert_file
from amp_rewrite.core.ops import MATRIX_OPS, VARIABLE_OPS
from amp_rewrite.schema.functiondef import reachable

L = keras.layers
BF16 = ["--target", "bfloat16", "--device", "cpu"]


def _digits():
    data = load_digits()
    return (data.images[..., None] / 16.0).astype(np.float32), data.target.astype(np.int64)


def _cnn() -> keras.Model:
    """Conv + BatchNorm + ReLU6, depthwise the same, pooled into a Dense: MobileNet-style, the
    batch norms on variables in the SavedModel (so its conversion keeps them float32)."""
    x = keras.Input((8, 8, 1), name="digits")
    h = L.Conv2D(16, 3, padding="same", activation="relu")(L.UpSampling2D(2)(x))
    h = L.ReLU(6.0)(L.BatchNormalization(momentum=0.9)(L.Conv2D(64, 3, padding="same", use_bias=False)(h)))
    h = L.ReLU(6.0)(L.BatchNormalization(momentum=0.9)(L.DepthwiseConv2D(3, padding="same",
                                                              use_bias=False)(h)))
    h = L.ReLU(6.0)(L.BatchNormalization(momentum=0.9)(L.Conv2D(128, 1, use_bias=False)(h)))
    return keras.Model(x, L.Dense(10)(L.GlobalAveragePooling2D()(h)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every model of this file, saved once: name -> path; ``digits.npz``, a batch to feed."""
    keras.utils.set_random_seed(0)
    root = tmp_path_factory.mktemp("freeze")
    images, labels = _digits()
    cnn = _cnn()
    cnn.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cnn.fit(images, labels, epochs=3, batch_size=32, verbose=0)   # trained batch norms
    cnn.export(str(root / "cnn"), verbose=False)
    cnn.save(root / "cnn.keras")
    np.savez(root / "digits.npz", digits=images[:64])
    paths = {"cnn": root / "cnn", "cnn.keras": root / "cnn.keras",
             "digits": root / "digits.npz"}
    for name, build in (("two", _two_signatures), ("tables", _tables), ("train", _train),
                        ("counter", _counter), ("unsigned", _unsigned)):
        paths[name] = root / name
        build(paths[name], root)
    return paths


def _two_signatures(path, _):
    rng = np.random.default_rng(0)
    m = tf.Module()
    m.w1 = tf.Variable(rng.normal(0, 0.1, (64, 256)).astype(np.float32))
    m.w2 = tf.Variable(rng.normal(0, 0.1, (256, 10)).astype(np.float32))
    spec = tf.TensorSpec([None, 64], tf.float32, name="features")
    m.classify = tf.function(
        lambda features: {"logits": tf.matmul(tf.nn.relu(tf.matmul(features, m.w1)), m.w2)},
        input_signature=[spec])
    m.embed = tf.function(
        lambda features, scale: {"embedding": tf.matmul(features, m.w1) * scale,
                                 "norm": tf.norm(tf.matmul(features, m.w1), axis=1)},
        input_signature=[spec, tf.TensorSpec([], tf.float32, name="scale")])
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.classify,
                                                  "embed": m.embed})


def _tables(path, root):
    """Words to scores through two StaticHashTables: a vocabulary held in the graph, and one
    read from an asset file."""
    vocab = root / "vocab.txt"
    vocab.write_text("the\nquick\nbrown\nfox\n")
    rng = np.random.default_rng(1)
    m = tf.Module()
    m.ids = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(["fox", "brown", "quick", "the"]), tf.constant([0, 1, 2, 3], tf.int64)), -1)
    m.lines = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
        str(vocab), tf.string, tf.lookup.TextFileIndex.WHOLE_LINE, tf.int64,
        tf.lookup.TextFileIndex.LINE_NUMBER), -1)
    m.emb = tf.Variable(rng.normal(0, 1, (13, 32)).astype(np.float32))
    m.w = tf.Variable(rng.normal(0, 0.1, (32, 3)).astype(np.float32))

    def serve(words):
        ids = m.ids.lookup(words) * 2 + m.lines.lookup(words) + 3   # unknown words: 0
        return {"scores": tf.matmul(tf.gather(m.emb, ids), m.w)}

    m.serve = tf.function(serve, input_signature=[tf.TensorSpec([None], tf.string, name="words")])
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.serve})


def _train(path, _):
    m = tf.Module()
    m.w = tf.Variable(np.full((64, 10), 0.01, np.float32))
    spec = tf.TensorSpec([None, 64], tf.float32)
    m.serve = tf.function(lambda x: {"y": tf.matmul(x, m.w)}, input_signature=[spec])

    def train(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, m.w) - y))
        m.w.assign_sub(0.1 * tape.gradient(loss, m.w))
        return {"loss": loss}

    m.train = tf.function(train, input_signature=[spec, tf.TensorSpec([None, 10], tf.float32)])
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.serve, "train": m.train})


def _counter(path, _):
    m = tf.Module()
    m.calls = tf.Variable(0.0)

    def count(x):
        m.calls.assign_add(1.0)
        return {"y": x * m.calls}

    m.count = tf.function(count, input_signature=[tf.TensorSpec([None], tf.float32)])
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.count})


def _unsigned(path, _):
    m = tf.Module()
    m.w = tf.Variable(2.0)
    m.f = tf.function(lambda x: x * m.w, input_signature=[tf.TensorSpec([None], tf.float32)])
    tf.saved_model.save(m, str(path), signatures={})


def _freeze(capsys, src, out, *flags):
    code, stdout, err = run_cli(capsys, [src, "-o", out, "--freeze", *BF16, *flags])
    assert code == 0, err
    return stdout


def _interface(fn):
    """A signature's inputs and outputs: key -> (dtype, shape), as callers see them."""
    args, kwargs = fn.structured_input_signature
    assert not args
    return ({k: (s.dtype, s.shape.as_list()) for k, s in kwargs.items()},
            {k: (s.dtype, s.shape.as_list()) for k, s in fn.structured_outputs.items()})


def _signature_defs(path):
    """saved_model.pb's signature_defs as saved_model_cli shows them: key -> method, inputs
    and outputs (key -> dtype and shape), the tensor names left out."""
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((path / "saved_model.pb").read_bytes())
    (meta,) = saved.meta_graphs

    def io(infos):
        return {k: (i.dtype, str(i.tensor_shape)) for k, i in infos.items()}

    return {key: (s.method_name, io(s.inputs), io(s.outputs))
            for key, s in meta.signature_def.items()}, meta


def _assert_serves_the_same_signatures(src, out):
    """What TF Serving and tf.saved_model.load see: the same signature keys, each with the same
    input and output keys, dtypes and shapes; and no variable left in what they run."""
    original, converted = tf.saved_model.load(str(src)), tf.saved_model.load(str(out))
    assert set(converted.signatures) == set(original.signatures)
    for key in original.signatures:
        assert _interface(converted.signatures[key]) == _interface(original.signatures[key]), key
    defs, meta = _signature_defs(out)
    assert defs == _signature_defs(src)[0]
    graph = meta.graph_def
    nodes = {n.name: n for n in graph.node}
    bodies = {f.signature.name: f for f in graph.library.function}
    for key, sig in meta.signature_def.items():
        called = [nodes[i.name.split(":")[0]] for i in sig.outputs.values()]
        for name in reachable(called, graph.library):
            ops = {n.op for n in bodies[name].node_def}
            assert not ops & set(VARIABLE_OPS), (key, name, ops & set(VARIABLE_OPS))
    held = {name for name, _ in tf.train.list_variables(str(out / "variables" / "variables"))}
    assert held <= {"_CHECKPOINTABLE_OBJECT_GRAPH"}, held


def test_a_keras_export_freezes_to_a_savedmodel_serving_its_signatures(models, tmp_path, capsys):
    src, out = models["cnn"], tmp_path / "cnn_bf16"
    before = snapshot(src)
    stdout = _freeze(capsys, src, out, "--report", tmp_path / "r.json")
    assert snapshot(src) == before   # the input is not changed
    _assert_serves_the_same_signatures(src, out)
    report = json.loads((tmp_path / "r.json").read_text())
    # serve and serving_default froze to one graph, converted once; its convolutions, which
    # the SavedModel's conversion keeps float32 for their batch norms on variables, in bf16
    assert report["freeze"]["graphs"] == [["serving_default", "serve"]]
    assert report["freeze"]["variables"] == len(keras.models.load_model(models["cnn.keras"]).weights)
    assert report["summary"]["matrix_converted"] == report["summary"]["matrix_total"] == 5
    assert "fusion" in report and "freeze: 2 signatures frozen" in stdout
    for signature in ("serving_default", "serve"):
        code, _, err = run_cli(capsys, ["verify", src, out, "--inputs", models["digits"],
                                        "--signature", signature])
        assert code == 0, err
    # what the converted SavedModel serves is what the FP32 one does, to bfloat16's precision
    x = tf.constant(np.load(models["digits"])["digits"])
    original, converted = tf.saved_model.load(str(src)), tf.saved_model.load(str(out))
    want = original.serve(x).numpy()
    got = converted.signatures["serve"](digits=x)["output_0"].numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.95


def test_the_tools_take_the_frozen_savedmodel(models, tmp_path, capsys):
    src, out = models["cnn"], tmp_path / "cnn_bf16"
    _freeze(capsys, src, out, "--report", tmp_path / "r.json")
    # the Dense's MatMul, as the frozen graph names it (Keras numbers its layers per process)
    dense = next(n["name"] for n in json.loads((tmp_path / "r.json").read_text())["nodes"]
                 if n["op"] == "MatMul")
    feed = ["--inputs", models["digits"]]
    for argv in (["bench", src, out, "--runs", "3", "--warmup", "1", *feed],
                 ["kernels", out, *feed],
                 ["explain", out, dense, *BF16],
                 ["tune", out, "-o", tmp_path / "tuned", *feed, *BF16]):
        code, stdout, err = run_cli(capsys, argv)
        assert code == 0, (argv[0], err)
    assert "bfloat16" in run_cli(capsys, ["kernels", out, *feed])[1]


def test_a_keras_file_freezes_too(models, tmp_path, capsys):
    out = tmp_path / "from_file"
    _freeze(capsys, models["cnn.keras"], out)
    _assert_serves_the_same_signatures(models["cnn"], out)
    code, _, err = run_cli(capsys, ["verify", models["cnn.keras"], out,
                                    "--inputs", models["digits"]])
    assert code == 0, err


def test_two_signatures_freeze_to_two_graphs_each_served_as_before(models, tmp_path, capsys):
    src, out = models["two"], tmp_path / "two_bf16"
    _freeze(capsys, src, out, "--min-matrix-intensity", "0", "--report", tmp_path / "r.json")
    _assert_serves_the_same_signatures(src, out)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["freeze"]["graphs"] == [["serving_default"], ["embed"]]
    assert report["summary"]["matrix_converted"] == report["summary"]["matrix_total"] == 4
    # the second graph's nodes are named by its signature, as a second MetaGraph's by its tags
    assert any(n["name"].startswith("[embed]/") for n in report["nodes"])
    for signature in ("serving_default", "embed"):
        code, _, err = run_cli(capsys, ["verify", src, out, "--signature", signature,
                                        "--shape", "features=16,64"])
        assert code == 0, err
    # --shape and --keep name a signature's input key and a frozen graph's node
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "kept", "--freeze", *BF16,
                                    "--shape", "features=32,64", "--min-matrix-intensity", "0",
                                    "--keep", "StatefulPartitionedCall/MatMul_1",
                                    "--report", tmp_path / "k.json"])
    assert code == 0, err
    kept = json.loads((tmp_path / "k.json").read_text())
    assert kept["cost_model"]["batch"] == 32
    assert {n["code"] for n in kept["nodes"] if n["name"].endswith("StatefulPartitionedCall/MatMul_1")} == {"user_keep"}


def test_lookup_tables_keep_working(models, tmp_path, capsys):
    src, out = models["tables"], tmp_path / "tables_bf16"
    stdout = _freeze(capsys, src, out, "--min-matrix-intensity", "0")
    assert "2 lookup tables kept" in stdout
    _assert_serves_the_same_signatures(src, out)
    assert (out / "assets" / "vocab.txt").read_text() == "the\nquick\nbrown\nfox\n"
    words = tf.constant(["fox", "the", "quick", "unknown", "brown"])
    original = tf.saved_model.load(str(src))
    want = original.signatures["serving_default"](words=words)["scores"]
    served = tf.saved_model.load(str(out))
    got = served.signatures["serving_default"](words=words)["scores"]
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0.05, atol=0.02)
    # ... its rows by the words' ids: a table lost would give every word the unknown row
    assert len({tuple(np.round(row, 3)) for row in got.numpy()}) == 5


@pytest.mark.parametrize("name, message", [
    ("train", "signature 'train' trains (function '__inference_train_"),
    ("counter", "signature 'serving_default' writes a variable (AssignAddVariableOp"),
    ("unsigned", "--freeze freezes a SavedModel's signatures, and it has none"),
])
def test_what_cannot_be_frozen_is_refused_in_one_line(models, tmp_path, capsys, name, message):
    src = models[name]
    before, around = snapshot(src), snapshot(tmp_path)
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "out", "--freeze", *BF16])
    assert_refused(code, err, str(src), src, before)
    assert message in err and snapshot(tmp_path) == around   # nothing written, nothing left


def test_freeze_is_refused_for_a_graph_file_and_with_options_it_cannot_keep(models, tmp_path,
                                                                            capsys):
    graph = tmp_path / "graph.pb"
    graph.write_bytes(tf.function(lambda x: tf.nn.relu(x)).get_concrete_function(
        tf.TensorSpec([None, 4])).graph.as_graph_def().SerializeToString())
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [graph, "-o", tmp_path / "out.pb", "--freeze", *BF16])
    assert_refused(code, err, str(graph), tmp_path, before)
    assert "drop --freeze" in err
    with pytest.raises(InputError, match=r"drop freeze=True"):   # the API's own word
        convert_file(graph, tmp_path / "out.pb", freeze=True)
    # ... refused by the command line before TensorFlow is imported, as by the library
    from amp_rewrite.cli import run as cli_run
    command, args = cli_run.parse([str(graph), "-o", str(tmp_path / "out.pb"), "--freeze"])
    with pytest.raises(InputError, match="drop --freeze"), cli_run.flags_in_messages():
        cli_run._check_paths(command, args)
    src = models["cnn"]
    for flags, message in ((["--lowp-io"], "--lowp-io and --freeze"),
                           (["--calibration", models["digits"]], "--calibration and --freeze")):
        code, _, err = run_cli(capsys, [src, "-o", tmp_path / "out", "--freeze", *BF16, *flags])
        assert code == 2 and message in err, err
    # --fold-constants, refused for a SavedModel, is what --freeze does: taken
    _freeze(capsys, src, tmp_path / "folded", "--fold-constants")


def test_the_freezing_hint_names_freeze_and_freeze_paints_what_it_said(models, tmp_path, capsys):
    """The SavedModel's conversion keeps the convolutions float32 (their batch norms read
    variables, so the ReLU6 would run unfused) and says --freeze would gain; --freeze paints
    them."""
    src = models["cnn"]
    code, stdout, _ = run_cli(capsys, [src, "-o", tmp_path / "as_is", *BF16, "--no-freeze",
                                       "--report", tmp_path / "as_is.json"])
    assert code == 0
    hint = [line for line in stdout.splitlines() if line.startswith("freezing: ")]
    assert len(hint) == 1 and hint[0].startswith("freezing: convert with --freeze"), hint
    as_is = json.loads((tmp_path / "as_is.json").read_text())
    convs = [n for n in as_is["nodes"] if n["op"] in MATRIX_OPS and "Conv" in n["op"]]
    assert convs and all(n["precision"] == "float32" for n in convs)
    _freeze(capsys, src, tmp_path / "frozen", "--report", tmp_path / "frozen.json")
    frozen = json.loads((tmp_path / "frozen.json").read_text())
    assert [n["precision"] for n in frozen["nodes"] if n["op"] in MATRIX_OPS and "Conv" in n["op"]] == [
        "bfloat16"] * len(convs)


def test_measure_times_the_frozen_conversion_and_hints_where_it_ran_faster(models, tmp_path,
                                                                           capsys, monkeypatch):
    """--measure on a SavedModel also times its --freeze conversion against the one it writes;
    where frozen ran at least FREEZE_HINT_SHARE faster, the freezing hint says so, naming
    --freeze (a measurement that it gains, where the estimate may not see it)."""
    from amp_rewrite.conversion.graph import FREEZE_HINT_SHARE
    from amp_rewrite.tools import measured as measured_mod
    code, stdout, err = run_cli(capsys, [models["cnn"], "-o", tmp_path / "m", *BF16, "--measure",
                                         "--no-freeze", "--shape", "digits=64,8,8,1",
                                         "--report", tmp_path / "m.json"])
    assert code == 0, err
    report = json.loads((tmp_path / "m.json").read_text())
    measured = report["measured"]
    assert measured["frozen_ms"] > 0 and "frozen (--freeze)" in measured["summary"]
    hint = report.get("freezing", {}).get("summary", "")
    faster = measured["frozen_ratio"] >= 1 + FREEZE_HINT_SHARE
    assert ("timed here" in hint) == faster, (measured, hint)
    if faster:
        assert hint.startswith("convert with --freeze") and f"freezing: {hint}" in stdout
    # where frozen did not run FREEZE_HINT_SHARE faster (here: a share no model can meet),
    # the measurement names nothing
    monkeypatch.setattr(measured_mod, "FREEZE_HINT_SHARE", 1e9)
    code, _, err = run_cli(capsys, [models["cnn"], "-o", tmp_path / "m2", *BF16, "--measure",
                                    "--no-freeze", "--report", tmp_path / "m2.json"])
    assert code == 0, err
    report = json.loads((tmp_path / "m2.json").read_text())
    assert report["measured"]["frozen_ratio"] > 0
    assert "timed here" not in report.get("freezing", {}).get("summary", "")


def test_a_custom_gradient_loads_without_a_warning(models, tmp_path, capsys, caplog):
    """Keras' swish carries a custom gradient; a frozen graph serves, and TensorFlow loads it
    without saying that the gradient was not saved."""
    keras.utils.set_random_seed(0)
    x = keras.Input((64,), name="pixels")
    model = keras.Model(x, L.Dense(10)(L.Dense(128, activation="swish")(x)))
    model.export(str(tmp_path / "swish"), verbose=False)
    _freeze(capsys, tmp_path / "swish", tmp_path / "out")
    with caplog.at_level("WARNING"):
        served = tf.saved_model.load(str(tmp_path / "out"))
    assert not [r for r in caplog.records if "custom gradient" in r.getMessage()]
    pixels = tf.constant(_digits()[0][:8].reshape(8, 64))
    want = model(pixels).numpy()
    got = served.signatures["serving_default"](pixels=pixels)["output_0"].numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
