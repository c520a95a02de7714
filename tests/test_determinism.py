"""Determinism: the same input and options give byte-identical output, run after run.

The converter runs in two separate processes with different ``PYTHONHASHSEED`` values (so set
and dict iteration orders differ) on every kind of input, and every output byte is compared:
converted graphs, SavedModel directories and JSON reports.
"""

import json

import graphs
import numpy as np
import pytest
import random_graphs
import tensorflow as tf
import training_graphs
from refusals import run_batch, snapshot
from tensorflow.core.protobuf import fingerprint_pb2

from amp_rewrite import convert


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Model files of every container the CLI reads, named by what they hold."""
    d = tmp_path_factory.mktemp("inputs")
    for builder in (graphs.mlp, graphs.conv_bn, graphs.while_v1, graphs.tensorarray_lstm,
                    graphs.functional_while):
        (d / f"{builder.__name__}.pb").write_bytes(builder()[0].SerializeToString())
    (d / "attention.pbtxt").write_text(str(graphs.attention()[0]))
    meta = tf.compat.v1.MetaGraphDef(graph_def=graphs.conv_bias_relu_pool()[0])
    (d / "conv_pool.meta").write_bytes(meta.SerializeToString())
    # a training graph: float16 adds dynamic loss scaling (new variables, update ops)
    (d / "train_cnn.meta").write_bytes(training_graphs.build("cnn", "adam").SerializeToString())
    layers = ["matmul", "while", "concat", "exp", "add", "conv", "softmax", "mean", "transpose"]
    (d / "random.pb").write_bytes(random_graphs.build(layers, 2, 12, 3)[0].SerializeToString())

    class Dense(tf.Module):
        def __init__(self):
            self.w = tf.Variable(np.random.default_rng(0).normal(0, 0.3, (8, 4)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def __call__(self, x):
            return tf.nn.softmax(tf.matmul(x, self.w) + 1.0)

    tf.saved_model.save(Dense(), str(d / "saved_model"))
    # frozen by default for bfloat16 on a CPU: freezing a loop and a branch that read
    # variables leaves placeholders whose number changed from process to process
    from test_savedmodel import LoopAndBranch
    loop = LoopAndBranch()
    tf.saved_model.save(loop, str(d / "saved_loop"), signatures=loop.__call__)
    return d


def _commands(inputs, out):
    cmds = []
    for src in sorted(inputs.iterdir()):
        for target, device in (("float16", "gpu"), ("bfloat16", "cpu")):
            stem = f"{src.stem}.{target}"
            dst = out / (stem if src.is_dir() else stem + src.suffix)
            # (this SavedModel keeps its variables: the function bodies' order is what it
            # checks; frozen, bfloat16's default on a CPU, it has none. The loop's is frozen)
            keep = ["--no-freeze"] if src.name == "saved_model" and target == "bfloat16" else []
            cmds.append([src, "-o", dst, "--target", target, "--device", device, *keep,
                         "--report", out / f"{stem}.json", "-q"])
    return cmds


@pytest.fixture(scope="module")
def two_runs(inputs, tmp_path_factory):
    """Every input converted to both targets, with reports, in two processes whose
    PYTHONHASHSEED differ; returns the two output folders' snapshots."""
    runs = []
    for seed in ("1", "4242"):
        out = tmp_path_factory.mktemp(f"hashseed{seed}")
        codes = run_batch(_commands(inputs, out), env={"PYTHONHASHSEED": seed})
        assert [c for c, _ in codes] == [0] * len(codes), codes
        runs.append((out, snapshot(out)))
    return runs


def _split(snap):
    saved = {k: v for k, v in snap.items() if k.startswith(("saved_model.", "saved_loop."))}
    return {k: v for k, v in snap.items() if k not in saved}, saved


def test_graph_files_and_reports_are_byte_identical(two_runs):
    (_, first), (_, second) = two_runs
    graphs_first, _ = _split(first)
    graphs_second, _ = _split(second)
    assert len(graphs_first) == 2 * 2 * 9  # an output and a report per input and target
    assert graphs_first == graphs_second


def test_saved_model_files_are_byte_identical_but_the_fingerprint_uuid(two_runs):
    """TensorFlow puts a fresh random uuid in every fingerprint.pb it writes; all else matches."""
    (dir1, first), (dir2, second) = two_runs
    _, saved1 = _split(first)
    _, saved2 = _split(second)
    assert saved1.keys() == saved2.keys()
    fingerprints = [k for k in saved1 if k.endswith("fingerprint.pb")]
    assert len(fingerprints) == 4
    for k in saved1:
        if k in fingerprints:
            a, b = fingerprint_pb2.FingerprintDef(), fingerprint_pb2.FingerprintDef()
            a.ParseFromString((dir1 / k).read_bytes())
            b.ParseFromString((dir2 / k).read_bytes())
            a.ClearField("uuid")
            b.ClearField("uuid")
            assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
        elif not k.endswith(".json"):
            assert saved1[k] == saved2[k], k


def test_saved_model_reports_are_byte_identical(two_runs):
    """The reports too: function bodies are taken in sorted order, not the protobuf map's."""
    (dir1, first), (dir2, second) = two_runs
    reports = sorted(k for k in first if k.startswith(("saved_model.", "saved_loop."))
                     and k.endswith(".json"))
    assert len(reports) == 4
    for k in reports:
        assert first[k] == second[k], k
        assert len(json.loads((dir1 / k).read_text())["nodes"]) > 20


def test_repeated_conversions_in_one_process_are_identical():
    """Caches warmed and names used by earlier conversions change nothing."""
    gd, _, _ = graphs.tensorarray_lstm()
    first, _ = convert(gd, target="float16")
    for builder in (graphs.mlp, graphs.while_v1, graphs.attention):
        convert(builder()[0], target="bfloat16", device="cpu")
    again, _ = convert(gd, target="float16")
    assert first.SerializeToString(deterministic=True) == again.SerializeToString(deterministic=True)
    assert [n.name for n in first.node] == [n.name for n in again.node]
