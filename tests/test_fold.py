"""--fold-constants: Const-only float32 subgraphs folded before painting."""

import graphs
import numpy as np
import tensorflow as tf

from amp_rewrite import convert
from amp_rewrite.cli.run import main

v1 = tf.compat.v1


def _bn_net():
    """conv -> batch norm written out as Keras 3 does (scale and offset computed from Consts)."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 8, 8, 4], name="x")
        y = x
        for i in range(3):
            k = tf.constant(r.normal(0, 0.4, (3, 3, 4, 4)).astype(np.float32))
            y = tf.nn.conv2d(y, k, 1, "SAME", name=f"conv{i}")
            gamma, beta = (tf.constant(r.uniform(0.5, 1.5, 4).astype(np.float32)) for _ in range(2))
            mean, var = tf.constant(r.normal(0, 0.1, 4).astype(np.float32)), tf.constant(
                r.uniform(0.5, 2.0, 4).astype(np.float32))
            scale = gamma * tf.math.rsqrt(var + 1e-3)
            y = tf.nn.relu(y * scale + (beta - mean * scale), name=f"bn{i}")
        tf.identity(tf.reduce_mean(y, axis=[1, 2]), name="out")
    return g.as_graph_def(), {"x:0": r.normal(0, 1, (2, 8, 8, 4)).astype(np.float32)}


def test_folding_removes_the_casts_of_constant_islands():
    gd, feeds = _bn_net()
    ref = graphs.run(gd, feeds, ["out:0"])[0]
    plain, plain_report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0,
                                  fold_constants=False)   # (on by default for bfloat16 on cpu)
    folded, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0, fold_constants=True)
    assert report.summary()["casts_added"] < plain_report.summary()["casts_added"] - 4
    assert not [n for n in folded.node if n.op == "Rsqrt"]        # computed offline, in float32
    assert {"x", "out"} <= {n.name for n in folded.node}  # the interface keeps its names
    err_plain = graphs.rel_l2(graphs.run(plain, feeds, ["out:0"])[0], ref)
    err_folded = graphs.rel_l2(graphs.run(folded, feeds, ["out:0"])[0], ref)
    assert err_folded <= err_plain * 1.05 + 1e-4 and err_folded < 2e-2
    again, _ = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0, fold_constants=True)
    assert again.SerializeToString(deterministic=True) == folded.SerializeToString(deterministic=True)


def test_kept_nodes_survive_folding():
    gd, feeds = _bn_net()
    folded, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0,
                             fold_constants=True, keep=["conv1"])
    node = next(n for n in folded.node if n.name == "conv1")
    assert node.op == "Conv2D" and node.attr["T"].type == tf.float32.as_datatype_enum


def test_graphs_with_variables_are_not_folded(caplog):
    gd, feeds, fetches = graphs.training_mlp()
    folded, _ = convert(gd, fold_constants=True)
    plain, _ = convert(gd)
    assert folded.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    assert any("has variables" in r.getMessage() for r in caplog.records)


def test_cli_flag(tmp_path, capsys):
    gd, _ = _bn_net()
    src = tmp_path / "bn.pb"
    src.write_bytes(gd.SerializeToString())
    assert main([str(src), "-o", str(tmp_path / "plain.pb"), "--target", "bfloat16", "--device", "cpu",
                 "--min-matrix-intensity", "0", "--no-fold-constants"]) == 0
    plain = capsys.readouterr().out
    assert main([str(src), "-o", str(tmp_path / "folded.pb"), "--target", "bfloat16", "--device",
                 "cpu", "--fold-constants"]) == 0
    folded = capsys.readouterr().out
    casts = lambda text: int(text.split("casts added: ")[1].split()[0].rstrip(","))  # noqa: E731
    assert casts(folded) < casts(plain)
    assert (tmp_path / "folded.pb").stat().st_size < (tmp_path / "plain.pb").stat().st_size


def test_folding_leaves_no_orphan_consts_behind():
    """A Fill of Consts folds into one Const; the value it was filled from, read by nothing
    after folding, goes too: left, it would count as a graph output kept float32 by name."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        w = tf.fill([16, 16], tf.constant(0.5, name="half"), name="filled")
        tf.identity(tf.matmul(x, w), name="out")
    folded, report = convert(g.as_graph_def(), target="bfloat16", device="cpu",
                             min_matrix_intensity=0, fold_constants=True)
    assert "half" not in {n.name for n in folded.node}
    assert [n.name for n in report.nodes if n.code == "interface"] == ["x", "out"]
