"""Signatures that take a tf.RaggedTensor or a tf.SparseTensor: TensorFlow passes each as its
component tensors (``ids`` and ``ids_1`` for a RaggedTensor ``ids``). verify, bench, kernels
and tune name them as the parts they are, feed valid random ones without an ``.npz`` (row
splits rising from 0 to the number of values; sparse indices inside the dense shape, in
row-major order, each once), take them from an ``.npz`` by ``ids.values`` and
``ids.row_splits``, and pass TensorFlow's own words on when a run fails. Converting such models
keeps working (with --shape for the argument as a whole, and --freeze)."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import cli
from amp_rewrite.io.load import load
from amp_rewrite.schema.inputs import meta_graph_inputs
from amp_rewrite.tools.bench import bench
from amp_rewrite.tools.runner import input_feeds, open_model
from amp_rewrite.tools.traces import reason

BF16 = ["--target", "bfloat16", "--device", "cpu"]


class Words(tf.Module):
    """A RaggedTensor of word ids (ragged rank 1) and one of boxes (ragged rank 2, 3 numbers
    each): embedded and averaged per row, a MatMul, the boxes summed per row beside it. The
    RaggedTensor constructors check the row splits, as a model does."""

    def __init__(self):
        r = np.random.default_rng(0)
        self.emb = tf.Variable(r.normal(size=(16, 64)).astype(np.float32))
        self.w = tf.Variable(r.normal(size=(64, 64)).astype(np.float32) / 8)

    @tf.function(input_signature=[
        tf.RaggedTensorSpec([None, None], tf.int32, ragged_rank=1),
        tf.RaggedTensorSpec([None, None, None, 3], tf.float32, ragged_rank=2)])
    def serve(self, ids, boxes):
        words = tf.RaggedTensor.from_row_splits(tf.gather(self.emb, ids.values), ids.row_splits)
        boxes = tf.RaggedTensor.from_nested_row_splits(boxes.flat_values,
                                                       boxes.nested_row_splits)
        pooled = tf.matmul(tf.reduce_mean(words, axis=1), self.w)
        return {"out": tf.concat([pooled, tf.reduce_sum(boxes, axis=[1, 2])], axis=1)}


class Features(tf.Module):
    """A SparseTensor of 64 features per row, made dense (which checks that its indices are
    in bounds, in row-major order and each once) and multiplied by a weight."""

    def __init__(self):
        self.w = tf.Variable(np.random.default_rng(1).normal(size=(64, 32)).astype(np.float32))

    @tf.function(input_signature=[tf.SparseTensorSpec([None, 64], tf.float32)])
    def serve(self, feats):
        return {"out": tf.matmul(tf.sparse.to_dense(feats), self.w)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("composites")
    for name, module in (("words", Words()), ("feats", Features())):
        tf.saved_model.save(module, str(folder / name), signatures={"serving_default": module.serve})
        assert cli.main([str(folder / name), "-o", str(folder / f"{name}_bf16"), *BF16,
                         "--min-matrix-intensity", "0", "-q"]) == 0
    return folder


def test_the_components_are_named_as_the_parts_they_are(models):
    """The runner and the conversion read the same structure off the SavedModel."""
    want = {"ids": ("ids", "values"), "ids_1": ("ids", "row_splits"),
            "boxes": ("boxes", "flat_values"), "boxes_1": ("boxes", "nested_row_splits.0"),
            "boxes_2": ("boxes", "nested_row_splits.1"), "feats": ("feats", "indices"),
            "feats_1": ("feats", "values"), "feats_2": ("feats", "dense_shape")}
    for name in ("words", "feats"):
        with open_model(models / name) as runner:
            found = {s.name: (s.composite.name, s.part) for s in runner.inputs}
        model = load(models / name)
        read = {s.name: (s.composite.name, s.part)
                for s in meta_graph_inputs(model.meta_graphs[0], None)}
        assert found == read == {k: v for k, v in want.items() if k in found} and found
    assert {s.composite.kind for s in runner.inputs} == {"SparseTensor"}


def test_random_composites_are_valid(models):
    """Without an .npz: every sample's row splits start at 0, rise (no empty row) to the
    number of values, as many rows as --shape gives and none longer than its longest; the
    inner ragged dimension's splits end at its values' count, the values keep their own
    dimension; sparse indices lie inside the dense shape --shape gives, in row-major order,
    each once."""
    with open_model(models / "words") as words, open_model(models / "feats") as feats:
        samples = input_feeds(words.inputs, None, 3, {"ids": (4, 8), "boxes": (4, 5, 6, 3)})
        sparse = input_feeds(feats.inputs, None, 3, {"feats": (16, 64)})
    for feed in samples:
        splits, values = feed["ids_1"], feed["ids"]
        assert splits[0] == 0 and splits[-1] == len(values) and len(splits) == 5
        assert np.all(np.diff(splits) >= 1) and np.diff(splits).max() <= 8
        outer, inner, flat = feed["boxes_1"], feed["boxes_2"], feed["boxes"]
        assert len(outer) == 5 and outer[0] == 0 and np.all(np.diff(outer) >= 1)
        assert np.diff(outer).max() <= 5 and len(inner) == outer[-1] + 1
        assert inner[0] == 0 and np.all(np.diff(inner) >= 1) and np.diff(inner).max() <= 6
        assert flat.shape == (inner[-1], 3) and flat.dtype == np.float32
        assert splits.dtype == np.int64 and values.dtype == np.int32
    assert any(not np.array_equal(a["ids_1"], b["ids_1"]) for a, b in zip(samples, samples[1:]))
    for feed in sparse:
        indices, dense = feed["feats"], feed["feats_2"]
        assert list(dense) == [16, 64] and len(feed["feats_1"]) == len(indices) > 0
        assert np.all(indices >= 0) and np.all(indices < dense)
        flat = np.ravel_multi_index(indices.T, dense)
        assert np.all(np.diff(flat) > 0)    # row-major order, no entry twice


def test_verify_kernels_and_bench_run_them_without_data(models, capsys):
    """The whole commands, fed random data: verify passes and says how it fed each argument;
    bench's batch is the RaggedTensor's rows, not its values' count."""
    code = cli.main(["verify", str(models / "words"), str(models / "words_bf16"),
                     "--samples", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "input ids (a RaggedTensor) has shape [?,?]: fed as [1,1] (pass --shape ids=...)" \
        in captured.err
    assert "input ids has shape" not in captured.err
    assert cli.main(["verify", str(models / "feats"), str(models / "feats_bf16"),
                     "--shape", "feats=8,64"]) == 0
    assert cli.main(["kernels", str(models / "words_bf16"), "--shape", "ids=4,8"]) == 0
    result = bench(models / "words", models / "words_bf16", runs=1, warmup=0,
                   shapes={"ids": (4, 8)})
    assert result.batch == 4


def test_an_npz_gives_them_by_the_arguments_name(models, tmp_path, capsys):
    """``ids.values`` and ``ids.row_splits`` (the signature's flat keys still work too); one
    missing is an error that names the argument and the keys that give it."""
    data = {"ids.values": np.array([1, 2, 3, 0], np.int32),
            "ids.row_splits": np.array([0, 3, 4], np.int64),
            "boxes.flat_values": np.ones((3, 3), np.float32),
            "boxes.nested_row_splits.0": np.array([0, 1, 2], np.int64),
            "boxes.nested_row_splits.1": np.array([0, 2, 3], np.int64)}
    np.savez(tmp_path / "words.npz", **data)
    assert cli.main(["verify", str(models / "words"), str(models / "words_bf16"),
                     "--inputs", str(tmp_path / "words.npz"), "--shape", "ids=2,3"]) == 0
    flat = dict(data, ids_1=data.pop("ids.row_splits"))
    np.savez(tmp_path / "flat.npz", **flat)
    assert cli.main(["verify", str(models / "words"), str(models / "words_bf16"),
                     "--inputs", str(tmp_path / "flat.npz")]) == 0
    del flat["ids_1"]
    np.savez(tmp_path / "missing.npz", **flat)
    capsys.readouterr()
    assert cli.main(["verify", str(models / "words"), str(models / "words_bf16"),
                     "--inputs", str(tmp_path / "missing.npz")]) == 2
    err = capsys.readouterr().err
    assert ("no array for input 'ids.row_splits' (signature key 'ids_1'); give RaggedTensor "
            "ids (int32 [?,?]) as ids.values and ids.row_splits") in err
    assert err.count("\n") == 1


def test_tensorflows_own_message_reaches_the_user(models, tmp_path, capsys):
    """Row splits that end past the values: TensorFlow's assertion, in its words, not the
    "<stack traces unavailable>" that stands in a loaded function's traceback."""
    np.savez(tmp_path / "bad.npz", **{"ids.values": np.array([1, 2, 3], np.int32),
                                      "ids.row_splits": np.array([0, 2, 5], np.int64),
                                      "boxes.flat_values": np.ones((1, 3), np.float32),
                                      "boxes.nested_row_splits.0": np.array([0, 1, 1]),
                                      "boxes.nested_row_splits.1": np.array([0, 1])})
    assert cli.main(["verify", str(models / "words"), str(models / "words_bf16"),
                     "--inputs", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert "do not form a valid RaggedTensor" in err and "stack traces" not in err
    loaded = tf.saved_model.load(str(models / "feats"))
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        loaded.signatures["serving_default"](feats=tf.constant([[0, 70]], tf.int64),
                                             feats_1=tf.constant([1.0]),
                                             feats_2=tf.constant([2, 64], tf.int64))
    assert "<stack traces unavailable>" in str(raised.value)
    assert "out of bounds" in reason(raised.value)


def test_a_shape_for_a_part_alone_is_refused_where_data_is_made(models, capsys):
    assert cli.main(["verify", str(models / "feats"), str(models / "feats_bf16"),
                     "--shape", "feats_1=8"]) == 2
    err = capsys.readouterr().err
    assert "input 'feats.values' (signature key 'feats_1') is part of SparseTensor feats " \
           "(float32 [?,64])" in err and "--shape feats=D1,D2,..." in err
    assert cli.main(["verify", str(models / "feats"), str(models / "feats_bf16"),
                     "--shape", "feats=8,65"]) == 2
    assert "does not fit SparseTensor feats (float32 [?,64])" in capsys.readouterr().err


def test_converting_them_keeps_working(models, tmp_path):
    """--shape for the argument as a whole tells the cost model the batch; --freeze
    freezes the signature (flat keys, fed by the original's structure); a Keras model with
    a ragged input (Keras's export serves it dense) converts and verifies."""
    assert cli.main([str(models / "words"), "-o", str(tmp_path / "told"), *BF16, "--shape",
                     "ids=4,8", "--report", str(tmp_path / "r.json"), "-q"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["cost_model"]["batch"] == 4
    assert cli.main([str(models / "feats"), "-o", str(tmp_path / "frozen"), *BF16,
                     "--freeze", "--min-matrix-intensity", "0", "-q"]) == 0
    assert cli.main(["verify", str(models / "feats"), str(tmp_path / "frozen"),
                     "--shape", "feats=8,64"]) == 0
    inp = keras.Input(shape=(None,), ragged=True, dtype="int32", name="ids")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(16, 8)(inp))
    keras.Model(inp, keras.layers.Dense(4)(h)).save(tmp_path / "ragged.keras")
    assert cli.main([str(tmp_path / "ragged.keras"), "-o", str(tmp_path / "keras_bf16"),
                     *BF16, "--min-matrix-intensity", "0", "-q"]) == 0
    assert cli.main(["verify", str(tmp_path / "ragged.keras"), str(tmp_path / "keras_bf16"),
                     "--shape", "ids=2,5"]) == 0


def test_tune_takes_them_by_the_arguments_name(models, tmp_path):
    np.savez(tmp_path / "feats.npz", **{"feats.indices": np.array([[0, 1], [1, 3]], np.int64),
                                        "feats.values": np.array([1.0, 2.0], np.float32),
                                        "feats.dense_shape": np.array([2, 64], np.int64)})
    assert cli.main(["tune", str(models / "feats"), "-o", str(tmp_path / "tuned"), *BF16,
                     "--inputs", str(tmp_path / "feats.npz"), "--tolerance", "0.1",
                     "--max-trials", "2", "-q"]) == 0
