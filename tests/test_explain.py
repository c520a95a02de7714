"""explain: the recorded chain for allow, deny-propagated, user-kept and kernel-less nodes."""

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import convert
from amp_rewrite.cli.run import main
from amp_rewrite.rules.loader import load_rules

pytestmark = pytest.mark.fast  # conversions only: no TensorFlow session
v1 = tf.compat.v1


def _graph():
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        w1 = tf.constant(r.normal(0, 0.3, (8, 8)).astype(np.float32), name="w1")
        w2 = tf.constant(r.normal(0, 0.3, (8, 8)).astype(np.float32), name="w2")
        h = tf.matmul(x, w1, name="fc1")
        with tf.name_scope("loss"):
            e = tf.exp(h, name="Exp")
            a = tf.add(e, 1.0, name="add")
            m = tf.multiply(a, 0.5, name="mul")
        out = tf.matmul(m, w2, name="fc2")
        det = tf.linalg.det(tf.reshape(out[:, :4], [1, 4, 4]), name="det")
        tf.identity(det, name="out")
    return g.as_graph_def()


def test_allow_node():
    _, report = convert(_graph())
    text = report.explain("fc1")
    assert report.node("fc1").code == "allow_list"
    assert "runs in float16" in text and "allow op" in text


def test_deny_propagated_chain_names_the_root_and_the_path():
    _, report = convert(_graph())
    node = report.node("loss/mul")
    assert node.precision == "float32" and node.code == "deny_propagated"
    assert node.via == ["loss/Exp", "loss/add"]    # the deny op, and the neighbour deny came through
    assert "loss/Exp -> loss/add -> loss/mul" in report.explain("loss/mul")   # the data path


def test_user_rule_names_the_file_and_line(tmp_path):
    rules = tmp_path / "keep.toml"
    rules.write_text('# keep the first layer\n[[override]]\nglob = "fc1"\naction = "keep_fp32"\n')
    _, report = convert(_graph(), rules=load_rules("float16", [rules], env={}))
    assert report.node("fc1").code == "user_keep"
    assert f"{rules}:2" in report.explain("fc1")


def test_missing_kernel_is_explained():
    _, report = convert(_graph(), rules=load_rules("float16", env={
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD": "MatrixDeterminant"}))
    node = report.node("det")
    assert node.precision == "float32" and node.code == "no_kernel"
    assert "no float16 kernel for MatrixDeterminant on GPU" in report.explain("det")


def test_explain_and_rules_show_commands(tmp_path, capsys):
    path = tmp_path / "g.pb"
    path.write_bytes(_graph().SerializeToString())
    assert main(["explain", str(path), "loss/mul", "fc2"]) == 0
    out = capsys.readouterr().out
    assert "loss/mul (Mul): kept float32" in out and "fc2 (MatMul): runs in float16" in out
    assert main(["explain", str(path), "no/such/node"]) == 2
    assert "no node named" in capsys.readouterr().err
    assert main(["rules", "show", "--target", "bfloat16"]) == 0
    shown = capsys.readouterr().out
    assert "infer_follows_allow: true" in shown and " Tanh " in shown
