"""verify, tune and bench on TF1 graphs fed by tf.data iterators (no placeholders for the
batch): the iterator's outputs are inputs named by tensor (``IteratorGetNext:0``), fed from the
user's .npz or else from the original's own iterator, one batch per sample, to both models; the
graph's initializers (initializable iterators', lookup tables') run by themselves, ``--init-op``
names more.

The models: scikit-learn's bundled digits as in-memory arrays, through
``make_initializable_iterator`` and ``make_one_shot_iterator``, a small convnet, a train op,
saved with ``tf.compat.v1.train.Saver`` (.meta + checkpoint); inference MetaGraphs and frozen
GraphDefs of the same model (tune refuses training graphs); and a dataset built from
placeholders with two lookup tables, one filled by its initializer, one by an op the user names.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
from refusals import run_cli
from sklearn.datasets import load_digits

from amp_rewrite.io.load import load
from amp_rewrite.tools.analysis import Analysis
from amp_rewrite.tools.runner import open_model, open_pair
from amp_rewrite.tools.verify import compare_outputs, criteria, feed_sets

v1 = tf.compat.v1

_DIGITS = load_digits()
X = (_DIGITS.images / 16.0).astype("float32")[..., None]      # (1797, 8, 8, 1)
Y = _DIGITS.target.astype("int32")
N, BATCH = 256, 32                                            # the dataset: 8 batches


def _model(images, labels, train: bool):
    """conv -> relu -> dense: logits, and with ``train`` a loss and an SGD train op."""
    w = v1.get_variable("conv/w", [3, 3, 1, 8])
    h = tf.reshape(tf.nn.relu(tf.nn.conv2d(images, w, 1, "SAME")), [-1, 512])
    fw = v1.get_variable("fc/w", [512, 10])
    fb = v1.get_variable("fc/b", [10], initializer=v1.zeros_initializer())
    logits = tf.nn.bias_add(tf.matmul(h, fw), fb, name="logits")
    if train:
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return logits


def _digits_graph(folder, iterator: str, train: bool, freeze: tuple[str, ...] = ()):
    """The digits convnet fed by a ``iterator`` ("initializable" or "one_shot") iterator over
    the first N digits in batches of BATCH, one SGD step taken if ``train``; saved by a Saver
    to ``folder/model.meta`` + checkpoint ``folder/model``; with ``freeze``, also frozen to
    ``folder/frozen.pb`` keeping those ops. Returns the folder."""
    folder.mkdir()
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        ds = tf.data.Dataset.from_tensor_slices((X[:N], Y[:N])).batch(BATCH)
        it = (v1.data.make_one_shot_iterator(ds) if iterator == "one_shot"
              else v1.data.make_initializable_iterator(ds))
        _model(*it.get_next(), train)
        saver = v1.train.Saver()
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            if iterator != "one_shot":
                sess.run(it.initializer)
            if train:
                sess.run(g.get_operation_by_name("train"))
            saver.save(sess, str(folder / "model"))
            if freeze:
                frozen = v1.graph_util.convert_variables_to_constants(
                    sess, g.as_graph_def(), list(freeze))
                (folder / "frozen.pb").write_bytes(frozen.SerializeToString())
    return folder


def _tables_graph(folder):
    """A dataset built from placeholders ``features`` and ``labels`` (the classic initializable
    iterator: the data is fed when the initializer runs), a linear model whose logits are
    scaled by a StaticHashTable (filled by its own initializer, found by itself) and shifted by
    a MutableHashTable that only the op ``fill`` fills (named with --init-op). MetaGraph +
    checkpoint; returns the weights and both tables' values."""
    folder.mkdir()
    scale = np.linspace(0.5, 2.0, 10).astype("float32")
    shift = np.arange(10, dtype="float32") - 4.5
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        features = v1.placeholder(tf.float32, [None, 8, 8, 1], name="features")
        labels = v1.placeholder(tf.int32, [None], name="labels")
        ds = tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)
        images, batch_labels = v1.data.make_initializable_iterator(ds).get_next()
        keys = tf.constant(np.arange(10, dtype="int64"))
        static = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(keys, tf.constant(scale)), -1.0)
        mutable = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)
        tf.group(mutable.insert(keys, tf.constant(shift)), name="fill")
        ids = tf.cast(batch_labels, tf.int64)
        w = v1.get_variable("w", [64, 10])
        logits = tf.matmul(tf.reshape(images, [-1, 64]), w)
        tf.add(logits * static.lookup(ids)[:, None], mutable.lookup(ids)[:, None], name="scores")
        saver = v1.train.Saver()
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            saver.save(sess, str(folder / "model"))
            weights = sess.run(w)
    return weights, scale, shift


def _convert(capsys, src, dst, *flags):
    code, _, err = run_cli(capsys, [src, "-o", dst, "-q", *flags])
    assert code == 0, err
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every model of this file, converted to float16 by the CLI (in-process)."""
    root = tmp_path_factory.mktemp("iterators")
    capsys = _NoCapture()
    found = {
        "train_init": _digits_graph(root / "train_init", "initializable", True,
                                    freeze=("logits",)),
        "train_one_shot": _digits_graph(root / "train_one_shot", "one_shot", True,
                                        freeze=("logits",)),
        "infer_init": _digits_graph(root / "infer_init", "initializable", False),
    }
    found["tables"] = root / "tables"
    found["tables_values"] = _tables_graph(found["tables"])
    for key in ("train_init", "train_one_shot", "infer_init", "tables"):
        _convert(capsys, found[key] / "model.meta", found[key] / "f16.meta")
    for key in ("train_init", "train_one_shot"):
        _convert(capsys, found[key] / "frozen.pb", found[key] / "frozen_f16.pb")
    # digits the dataset does not hold, by tensor name: images and labels for the training
    # graphs, images alone for the frozen inference graphs (which read no labels)
    found["npz"] = root / "batch.npz"
    np.savez(found["npz"], **{"IteratorGetNext:0": X[1000:1064], "IteratorGetNext:1": Y[1000:1064]})
    found["images_npz"] = root / "images.npz"
    np.savez(found["images_npz"], **{"IteratorGetNext:0": X[1000:1064]})
    return found


class _NoCapture:
    """What :func:`run_cli` needs of capsys, for a module-scoped fixture (which cannot take the
    function-scoped capsys): output goes to the terminal, which pytest captures anyway."""

    @staticmethod
    def readouterr():
        return "", ""


def _batch(i: int):
    return X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH]


# ----------------------------------------------------------------- the analysis
def test_iterator_outputs_are_inputs_and_the_initializer_is_found(models):
    a = Analysis(load(models["train_init"] / "model.meta"))
    # named by the iterator's tensors, fed through placeholders: a run never draws a batch
    assert a.inputs == [("IteratorGetNext:0", "IteratorGetNext/amp_feed_0:0"),
                        ("IteratorGetNext:1", "IteratorGetNext/amp_feed_1:0")]
    assert a.initializers == ["MakeIterator"]
    # the dataset is data, not the model: set up, never compared nor an output
    assert "TensorSliceDataset" in a.setup and "MakeIterator" in a.setup
    assert not any(t.startswith(("TensorSliceDataset", "normalize_element"))
                   for t in a.comparable())
    one_shot = Analysis(load(models["train_one_shot"] / "model.meta"))
    assert one_shot.initializers == [] and one_shot.iterator_inputs == a.iterator_inputs
    # a frozen inference graph reads only the images: the labels are no input
    frozen = Analysis(load(models["train_one_shot"] / "frozen.pb"))
    assert [n for n, _ in frozen.inputs] == ["IteratorGetNext:0"]
    tables = Analysis(load(models["tables"] / "model.meta"))
    assert [n for n, _ in tables.inputs] == ["IteratorGetNext:0", "IteratorGetNext:1",
                                             "features", "labels"]   # a batch first
    assert tables.initializers == ["MakeIterator"]   # the tables are filled with the variables


# ----------------------------------------------------------------- verify
@pytest.mark.parametrize("kind", ["train_init", "train_one_shot"])
def test_verify_compares_both_models_on_the_iterators_batches(models, kind, capsys):
    folder = models[kind]
    code, out, err = run_cli(capsys, ["verify", folder / "model.meta", folder / "f16.meta",
                                      "--checkpoint", folder / "model", "--samples", "3",
                                      "--per-node"])
    assert code == 0, err
    assert "3 sample(s)" in out and "loss:0" in out and "(unscaled)" in out
    assert "verdict: within tolerance" in out
    with open_pair(folder / "model.meta", folder / "f16.meta",
                   checkpoint=str(folder / "model")) as (a, b):
        feeds = feed_sets(a, None, 3, {})
        for i, feed in enumerate(feeds):   # sample i is the dataset's batch i, for both
            images, labels = _batch(i)
            np.testing.assert_array_equal(feed["IteratorGetNext:0"], images)
            np.testing.assert_array_equal(feed["IteratorGetNext:1"], labels)
        outs = compare_outputs(a, b, feeds, criteria(checks=("rel_l2",), rel_l2=0.01,
                                                     grad_rel_l2=0.1))
        assert all(o.ok for o in outs) and outs[0].name == "loss:0"
        # the loss the original gives on sample 2 is its loss on batch 2, computed apart
        loss = a.callable()(feeds[2])[0]
    assert loss == pytest.approx(_loss_on_batch(folder, 2), rel=1e-6)


def _loss_on_batch(folder, i: int) -> float:
    """The checkpoint's loss on the dataset's batch ``i``, by TensorFlow alone: the MetaGraph
    imported, restored, its iterator read ``i + 1`` times (fetching the loss does not train)."""
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        saver = v1.train.import_meta_graph(str(folder / "model.meta"))
        saver.restore(sess, str(folder / "model"))
        if "MakeIterator" in [op.name for op in g.get_operations()]:
            sess.run("MakeIterator")
        return [sess.run("loss:0") for _ in range(i + 1)][-1]


def test_verify_feeds_the_iterators_outputs_by_name_from_the_npz(models, capsys):
    folder = models["train_one_shot"]
    with open_pair(folder / "model.meta", folder / "f16.meta",
                   checkpoint=str(folder / "model")) as (a, _):
        feed = feed_sets(a, str(models["npz"]), 1, {})[0]
    np.testing.assert_array_equal(feed["IteratorGetNext:0"], X[1000:1064])
    # a frozen initializable iterator whose initializer the freeze dropped: only the npz works
    frozen = models["train_init"]
    code, out, err = run_cli(capsys, ["verify", frozen / "frozen.pb", frozen / "frozen_f16.pb",
                                      "--inputs", models["images_npz"]])
    assert code == 0, err
    assert "of 64 rows" in out                  # the npz's 64 digits, not a batch of 32
    code, _, err = run_cli(capsys, ["verify", frozen / "frozen.pb", frozen / "frozen_f16.pb"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not been initialized" in err and "--init-op" in err and "IteratorGetNext:0" in err


def test_bad_iterator_requests_are_one_line_refusals(models, tmp_path, capsys):
    folder = models["train_init"]
    pair = [folder / "model.meta", folder / "f16.meta"]
    half = tmp_path / "half.npz"
    np.savez(half, **{"IteratorGetNext:0": X[:32]})
    cases = [(["--samples", "9"], "ran out after 8 batch(es)"),
             (["--inputs", half], "IteratorGetNext:0 but not IteratorGetNext:1"),
             (["--init-op", "no_such_op"], "no op of that name"),
             (["--init-op", "init"], "runs variable writes"),
             (["--shape", "IteratorGetNext:0=4,8,8,1"], "batches come from the model's iterator"),
             (["--inputs", models["images_npz"], "--shape", "IteratorGetNext:1=4"],
              "batches come from the model's iterator")]
    for flags, message in cases:
        code, _, err = run_cli(capsys, ["verify", *pair, *flags])
        assert code == 2 and len(err.strip().splitlines()) == 1, (flags, err)
        assert message in err and "Traceback" not in err, (flags, err)


# ----------------------------------------------------------------- tables and --init-op
def test_initializers_run_with_the_first_samples_inputs_and_init_op_runs_more(models, tmp_path,
                                                                              capsys):
    folder = models["tables"]
    weights, scale, shift = models["tables_values"]
    data = tmp_path / "data.npz"
    np.savez(data, features=X[:N], labels=Y[:N])
    with open_model(folder / "model.meta", checkpoint=str(folder / "model"),
                    init_ops=["fill"]) as runner:
        feeds = feed_sets(runner, str(data), 1, {})
        scores = runner.callable()(feeds[0])[0]
    images, labels = _batch(0)          # the dataset the initializer made of the npz's arrays
    expected = (images.reshape(-1, 64) @ weights) * scale[labels][:, None] + shift[labels][:, None]
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)
    # without --init-op the mutable table stays empty: its lookups give the default, 0
    with open_model(folder / "model.meta", checkpoint=str(folder / "model")) as runner:
        unfilled = runner.callable()(feed_sets(runner, str(data), 1, {})[0])[0]
    np.testing.assert_allclose(unfilled, expected - shift[labels][:, None], rtol=1e-5, atol=1e-5)
    code, out, err = run_cli(capsys, ["verify", folder / "model.meta", folder / "f16.meta",
                                      "--checkpoint", folder / "model", "--inputs", data,
                                      "--init-op", "fill"])
    assert code == 0 and "scores:0" in out, err
    # bench's batch is the iterator's, not the 256 rows the initializer reads
    report = tmp_path / "bench.json"
    code, _, err = run_cli(capsys, ["bench", folder / "model.meta", folder / "f16.meta",
                                    "--inputs", data, "--init-op", "fill", "--runs", "2",
                                    "--warmup", "1", "--json", report, "-q"])
    assert code == 0, err
    assert json.loads(report.read_text())["batch"] == BATCH


# ----------------------------------------------------------------- bench and tune
def test_bench_times_both_models_on_one_batch_of_the_iterator(models, tmp_path, capsys):
    folder = models["train_init"]
    report = tmp_path / "bench.json"
    code, out, err = run_cli(capsys, ["bench", folder / "model.meta", folder / "f16.meta",
                                      "--checkpoint", folder / "model", "--runs", "12",
                                      "--warmup", "2", "--json", report])
    assert code == 0, err   # 14 runs of each from 8 batches: every run takes the same one
    found = json.loads(report.read_text())
    assert found["batch"] == BATCH and found["runs"] == 12


def test_tune_runs_on_iterator_graphs_with_and_without_inputs(models, tmp_path, capsys):
    src = models["infer_init"] / "model.meta"
    out = tmp_path / "tuned.meta"
    code, stdout, err = run_cli(capsys, ["tune", src, "-o", out])   # no --inputs: batch 0
    assert code == 0, err
    assert out.exists() and "worst of 1 sample(s)" in stdout
    frozen = models["train_one_shot"] / "frozen.pb"
    out = tmp_path / "tuned.pb"
    code, stdout, err = run_cli(capsys, ["tune", frozen, "-o", out, "--inputs",
                                         models["images_npz"], "--holdout", models["images_npz"]])
    assert code == 0, err
    assert out.exists() and "held-out samples" in stdout
    # --init-op reaches tune's models: an op the graph lacks is refused, one it has runs
    data = tmp_path / "data.npz"
    np.savez(data, features=X[:N], labels=Y[:N])
    tables = models["tables"] / "model.meta"
    code, _, err = run_cli(capsys, ["tune", tables, "-o", tmp_path / "t1.meta", "--inputs", data,
                                    "--init-op", "no_such_op"])
    assert code == 2 and "no op of that name" in err
    code, _, err = run_cli(capsys, ["tune", tables, "-o", tmp_path / "t2.meta", "--inputs", data,
                                    "--init-op", "fill"])
    assert code == 0, err
    # a training graph is still refused: tune compares inference outputs
    code, _, err = run_cli(capsys, ["tune", models["train_init"] / "model.meta",
                                    "-o", tmp_path / "t.meta"])
    assert code == 2 and "the graph trains" in err
