"""verify --per-node, tune, bench and kernels on the models users bring (issue 28): a TF2
recommender whose signature gathers from an embedding table (tf.nn.embedding_lookup: a
ResourceGather colocated with a variable handle its body receives under another name) and
whose train step applies sparse updates; SavedModels with lookup tables and string inputs, TF2
and TF1 (a vocabulary file among its assets). Our replay of a model TensorFlow runs must run it
too, a failure of it is our bug (exit 70), and every input name the user gives must name an
input."""

import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import cli, convert_file
from amp_rewrite.core.errors import InputError
from amp_rewrite.io.load import load
from amp_rewrite.tools import replay
from amp_rewrite.tools.bench import bench
from amp_rewrite.tools.kernels import misaligned_dims
from amp_rewrite.tools.runner import open_model
from amp_rewrite.tools.tuning import tune
from amp_rewrite.tools.verify import verify

WORDS = ["apple", "banana", "cherry", "date", "elder", "fig", "grape"]


class Recommender(tf.Module):
    """Scores of 8 items from the mean embedding of 5 ids; the gather sits in a nested
    tf.function (a PartitionedCall handed the table's resource handle). The train step's
    gradient of the table is IndexedSlices, applied by a Keras optimizer, followed by a sparse
    decay of the rows seen (``scatter_sub``)."""

    def __init__(self, rng):
        super().__init__()
        self.table = tf.Variable(rng.normal(0, 0.3, [64, 16]).astype(np.float32), name="table")
        self.w = tf.Variable(rng.normal(0, 0.3, [16, 8]).astype(np.float32), name="w")
        self.opt = keras.optimizers.SGD(0.1)
        self.opt.build([self.table, self.w])

    @tf.function
    def embed(self, ids):
        return tf.reduce_mean(tf.nn.embedding_lookup(self.table, ids), axis=1)

    def scores(self, ids):
        return tf.matmul(self.embed(ids), self.w)

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.int32)])
    def serve(self, ids):
        return {"scores": self.scores(ids)}

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.int32),
                                  tf.TensorSpec([None], tf.int32)])
    def train_step(self, ids, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels, self.scores(ids)))
        grads = tape.gradient(loss, [self.table, self.w])
        self.opt.apply_gradients(zip(grads, [self.table, self.w]))
        seen = tf.reshape(ids, [-1])
        self.table.scatter_sub(tf.IndexedSlices(0.01 * tf.gather(self.table, seen), seen))
        return {"loss": loss}


class Tables(tf.Module):
    """Words in, scores out, through a StaticHashTable and a Keras StringLookup."""

    def __init__(self, rng):
        super().__init__()
        self.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant(WORDS), tf.range(len(WORDS), dtype=tf.int64)), default_value=-1)
        self.lookup = keras.layers.StringLookup(vocabulary=WORDS)
        self.emb = tf.Variable(rng.normal(0, 0.3, [len(WORDS) + 2, 16]).astype(np.float32))
        self.w = tf.Variable(rng.normal(0, 0.3, [16, 4]).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.string)])
    def serve(self, words):
        e = tf.nn.embedding_lookup(self.emb, self.table.lookup(words) + 1)
        e += tf.gather(self.emb, self.lookup(words))
        return {"scores": tf.matmul(tf.reduce_sum(e, axis=1), self.w)}


def _tf1_tables(folder, vocab):
    """A TF1 SavedModel: words looked up in a key-value table and in a vocabulary file (an
    asset), then embedded and scored."""
    tf1 = tf.compat.v1
    with tf.Graph().as_default():
        words = tf1.placeholder(tf.string, [None, 3], name="words")
        fixed = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant(WORDS[:4]), tf.range(4, dtype=tf.int64)), -1)
        from_file = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
            str(vocab), tf.string, tf.lookup.TextFileIndex.WHOLE_LINE, tf.int64,
            tf.lookup.TextFileIndex.LINE_NUMBER), -1)
        emb = tf1.get_variable("emb", [len(WORDS) + 1, 8],
                               initializer=tf1.random_normal_initializer(seed=1))
        w = tf1.get_variable("w", [8, 4], initializer=tf1.random_normal_initializer(seed=2))
        e = (tf.nn.embedding_lookup(emb, fixed.lookup(words) + 1)
             + tf.nn.embedding_lookup(emb, from_file.lookup(words) + 1))
        scores = tf.matmul(tf.reduce_sum(e, 1), w, name="scores")
        with tf1.Session() as session:
            session.run([tf1.global_variables_initializer(), tf1.tables_initializer()])
            builder = tf1.saved_model.Builder(str(folder))
            builder.add_meta_graph_and_variables(
                session, ["serve"], main_op=tf1.tables_initializer(),
                assets_collection=tf1.get_collection(tf1.GraphKeys.ASSET_FILEPATHS),
                signature_def_map={"serving_default": tf1.saved_model.predict_signature_def(
                    {"words": words}, {"scores": scores})})
            builder.save()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The three models, each converted to bfloat16 for the CPU, and their data."""
    root = tmp_path_factory.mktemp("user_models")
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    rec = Recommender(rng)
    tf.saved_model.save(rec, str(root / "rec"),
                        signatures={"serving_default": rec.serve, "train_step": rec.train_step})
    np.savez(root / "rec.npz", ids=rng.integers(0, 64, (4, 5)).astype(np.int32))
    np.savez(root / "rec_train.npz", ids=rng.integers(0, 64, (4, 5)).astype(np.int32),
             labels=rng.integers(0, 8, (4,)).astype(np.int32))
    tables = Tables(rng)
    tf.saved_model.save(tables, str(root / "tables"), signatures={"serving_default": tables.serve})
    text = np.array([["apple", "fig", "kiwi"], ["date", "date", "grape"], ["elder", "", "cherry"]])
    np.savez(root / "tables.npz", words=text)
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(reversed(WORDS)) + "\n")
    _tf1_tables(root / "tf1", vocab)
    vocab.unlink()   # the model must read its own copy, in its assets/
    # painted whole (the knob at 0): these small models' variable weights, cast on every run,
    # would keep them float32 on a CPU by default (test_costs.py); the tests replay bfloat16
    # function bodies reading variables (kept: a model that only serves is frozen by default)
    for name in ("rec", "tables", "tf1"):
        convert_file(root / name, root / f"{name}_bf16", target="bfloat16", device="cpu",
                     min_matrix_intensity=0, freeze=False)
    return root


def test_per_node_replays_an_embedding_lookup_colocated_with_its_variable(models):
    """The gather's ``_class`` names the variable's handle as the traced graph called it
    (``loc:@embedding_lookup/N``), which the body receives as ``embedding_lookup_N``: the
    replay runs the body as TensorFlow does, and compares the gather inside the nested call."""
    result = verify(models / "rec", models / "rec_bf16", inputs=str(models / "rec.npz"), nodes=True)
    assert result.ok and result.per_node
    by_op = {n.op: n for n in result.nodes}
    assert by_op["ResourceGather"].tensor.split("/", 1)[0].startswith("__inference_embed")
    assert by_op["ResourceGather"].rel_l2 == 0.0        # the table stays float32
    assert by_op["MatMul"].dtype == "bfloat16" and 0 < by_op["MatMul"].rel_l2 < 5e-2
    # the train step is what the fixture claims: the optimizer applies the table's
    # IndexedSlices gradient as a scatter, and the step's own scatter_sub follows
    library = load(models / "rec").meta_graphs[0].graph_def.library
    # (the optimizer's name scope is sgd, sgd_1 ... by how many optimizers this process made)
    scatters = sorted(re.sub(r"^sgd(_\d+)?/", "sgd/", nd.name)
                      for f in library.function if "train_step" in f.signature.name
                      for nd in f.node_def if nd.op == "ResourceScatterSub")
    assert scatters == ["ResourceScatterSub", "sgd/ResourceScatterSub"]


def test_tune_attributes_error_inside_the_recommender(models, tmp_path):
    """A tolerance the painted graph misses makes tune trace both models (the replay): the
    matrix multiply that adds the error is kept in float32, and the tuned model passes."""
    result = tune(models / "rec", tmp_path / "tuned", feeds=str(models / "rec.npz"),
                  tolerance=1e-6, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert result.ok and result.before > 1e-6 and result.after <= 1e-6
    assert [k.op for k in result.kept] == ["MatMul"]
    assert verify(models / "rec", tmp_path / "tuned", inputs=str(models / "rec.npz"),
                  rel_l2=1e-6).ok


def test_the_train_step_signature_replays_its_sparse_updates_from_the_saved_table(models):
    """verify runs the train step as TensorFlow does, and --per-node replays it: the sparse
    updates run again, each run from the state saved. The nested gather reads the table as it
    was when the call ran (as saved: no error), the step's own gather reads it back after the
    optimizer's scatter, so its error is the update's, not one it adds (bfloat16: no loss
    scaling)."""
    data = str(models / "rec_train.npz")
    result = verify(models / "rec", models / "rec_bf16", inputs=data, signature="train_step",
                    nodes=True)
    assert result.ok and [o.name for o in result.outputs] == ["loss"]
    gathers = {"embed" if "_embed_" in n.tensor.split("/")[0] else "step": n
               for n in result.nodes if n.op == "ResourceGather"}
    assert len(gathers) == 2 and gathers["embed"].rel_l2 == 0.0
    assert gathers["step"].rel_l2 > 0 and gathers["step"].added == 0.0
    assert any(n.dtype == "bfloat16" and "gradient_tape" in n.tensor for n in result.nodes)
    assert [u.reason for u in result.uncompared] == ["only_converted"]


def test_lookup_tables_and_string_inputs_replay_bench_and_tune(models, tmp_path):
    data = str(models / "tables.npz")
    result = verify(models / "tables", models / "tables_bf16", inputs=data, nodes=True)
    assert result.ok
    ops = [n.op for n in result.nodes]
    assert ops.count("ResourceGather") == 2 and "MatMul" in ops   # a gather after each table
    timing = bench(models / "tables", models / "tables_bf16", inputs=data, runs=2, warmup=0)
    assert timing.batch == 3
    tuned = tune(models / "tables", tmp_path / "tuned", feeds=data, tolerance=1e-6,
                 target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert tuned.ok and tuned.before > 1e-6 and [k.op for k in tuned.kept] == ["MatMul"]


def test_tf1_savedmodel_tables_are_filled_from_its_assets(models):
    """A TF1 signature is traced as a graph: its tables must be filled (a key-value table, and a
    vocabulary file fed from assets/, the file it was built from being gone) or nothing after
    the lookups can be fetched."""
    feed = dict(np.load(models / "tables.npz"))
    with open_model(models / "tf1") as runner:
        want = runner.callable()(feed)[0]
        trace = runner.trace(feed)
        assert runner.uncomparable() == {}
    sums = [n for n in trace.values if trace.info[n].op == "Sum"]
    assert len(sums) == 1 and trace.values["scores:0"][0].shape == (3, 4)
    assert np.array_equal(trace.values["scores:0"][0], want)
    result = verify(models / "tf1", models / "tf1_bf16", inputs=str(models / "tables.npz"),
                    nodes=True)
    assert result.ok and {"ResourceGather", "Sum", "MatMul"} <= {n.op for n in result.nodes}
    assert not result.uncompared


def test_a_failure_of_our_replay_is_an_internal_error(models, monkeypatch, capsys):
    """With the colocation repair undone, the replay fails where TensorFlow runs the model:
    exit 70, naming the cause; a wrong shape in the user's data is still the user's (exit 2)."""
    args = ["verify", str(models / "rec"), str(models / "rec_bf16"), "--per-node", "-q"]
    np.savez(models / "flat.npz", ids=np.zeros(4, np.int32))     # rank 1: the Mean refuses it
    assert cli.main(args + ["--inputs", str(models / "flat.npz")]) == 2
    assert "check --shape / --inputs" in capsys.readouterr().err
    monkeypatch.setattr(replay, "drop_foreign_colocation", lambda graph_def: None)
    assert cli.main(args + ["--inputs", str(models / "rec.npz")]) == 70
    err = capsys.readouterr().err
    assert "internal error" in err and "our replay" in err and "colocated" in err
    assert "check --shape" not in err


@pytest.mark.parametrize("flags, message", [
    (["--shape", "tokens=8,5"], (r"--shape 'tokens' names no input of the model; its inputs: "
                                 r"ids \(int32 \[\?,5\]\)")),
    (["--shape", "id=8,5"], r"--shape 'id' names no input of the model \(did you mean 'ids'\?\)"),
    (["--inputs", "EXTRA"], r"array 'idz' names no input of the model \(did you mean 'ids'\?\)"),
])
def test_every_input_name_must_name_an_input(models, capsys, flags, message):
    extra = models / "extra.npz"
    np.savez(extra, ids=np.zeros((4, 5), np.int32), idz=np.zeros((4, 5), np.int32))
    flags = [str(extra) if f == "EXTRA" else f for f in flags]
    for command in (["verify", str(models / "rec"), str(models / "rec_bf16")],
                    ["bench", str(models / "rec"), str(models / "rec_bf16"), "--runs", "1"]):
        assert cli.main(command + flags + ["-q"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1
        assert re.search(message, err), err


def test_tune_feeds_and_shapes_with_inputs_are_checked(models, tmp_path):
    with pytest.raises(InputError, match=r"feed dict's key 'labels' names no input"):
        tune(models / "rec", tmp_path / "t", feeds=[{"ids": np.zeros((4, 5), np.int32),
                                                     "labels": np.zeros(4, np.int32)}])
    with pytest.raises(InputError, match=r"--shape ids=8,5: .* holds ids with shape \[4,5\]"):
        verify(models / "rec", models / "rec_bf16", inputs=str(models / "rec.npz"),
               shapes={"ids": (8, 5)})


def test_an_input_fed_from_the_npz_is_reported_with_its_shape(tmp_path, caplog):
    """kernels' alignment check runs on the npz's batch, not a made-up batch of 1."""
    with tf.Graph().as_default() as g:
        inp = tf.compat.v1.placeholder(tf.float16, [None, 16], name="x")
        w = tf.constant(np.ones((16, 12), np.float16))
        tf.matmul(inp, w, name="y")
    (tmp_path / "m.pb").write_bytes(g.as_graph_def().SerializeToString())
    np.savez(tmp_path / "x.npz", x=np.ones((4, 16), np.float16))
    with caplog.at_level(logging.INFO, logger="amp_rewrite"):
        found = misaligned_dims(tmp_path / "m.pb", inputs=str(tmp_path / "x.npz"))
    assert [(m["node"], m["not_multiple_of_8"]) for m in found] == [("y", {"N": 12})]
    messages = [r.getMessage() for r in caplog.records]
    assert f"input x: float16 [4,16] from {tmp_path / 'x.npz'}" in messages
    assert not any("fed as" in m for m in messages)


def test_string_inputs_saved_as_python_objects_are_refused_with_how_to_save_them(models):
    """np.load never unpickles: strings saved as an object array get the way to save them."""
    np.savez(models / "objects.npz", words=np.array([["apple", "fig", "date"]], dtype=object))
    with pytest.raises(InputError, match=r"array 'words' holds Python objects.*dtype=str"):
        verify(models / "tables", models / "tables_bf16", inputs=str(models / "objects.npz"))
