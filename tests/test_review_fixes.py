"""Regressions from the code review: custom-op edges, force-all level, Cast clean-up scope,
splat Consts, reasons of index-typed ops, retargeted-cast chains, grappler's LOG_PATH,
commented text MetaGraphs, explain on training graphs."""

import graphs
import numpy as np
import tensorflow as tf
from google.protobuf import text_format

from amp_rewrite import convert
from amp_rewrite.cli.run import main
from amp_rewrite.io.load import load
from amp_rewrite.rules.loader import load_rules

v1 = tf.compat.v1
HALF = tf.float16.as_datatype_enum
FLOAT = tf.float32.as_datatype_enum


def _types(graph_def):
    return {n.name: {k: v.type for k, v in n.attr.items() if v.WhichOneof("value") == "type"}
            for n in graph_def.node}


def test_custom_op_keeps_its_dtypes_with_casts_around_it():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        mm = tf.matmul(x, tf.ones([4, 4]), name="mm")
        tf.identity(tf.matmul(tf.identity(mm, name="custom"), tf.ones([4, 4]), name="mm2"), name="out")
    gd = g.as_graph_def()
    custom = next(n for n in gd.node if n.name == "custom")
    custom.op = "MyCustomOp"
    custom.attr.clear()
    new, report = convert(gd)
    nodes = {n.name: n for n in new.node}
    types = _types(new)
    assert types["mm"]["T"] == HALF and types["mm2"]["T"] == HALF
    feeder = nodes[nodes["custom"].input[0]]
    assert feeder.op == "Cast" and feeder.attr["DstT"].type == FLOAT        # float in
    reader = nodes[nodes["mm2"].input[0]]
    assert reader.op == "Cast" and reader.input[0] == "custom" and reader.attr["SrcT"].type == FLOAT


def test_unsafe_force_all_paints_deny_ops_and_passes_the_lint(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        e = tf.exp(tf.matmul(x, tf.ones([4, 4])), name="e")
        tf.identity(tf.matmul(e, tf.ones([4, 4])), name="out")
    path = tmp_path / "all.toml"
    path.write_text('level = "unsafe_force_all"\n')
    new, report = convert(g.as_graph_def(), rules=load_rules("float16", [path], env={}))
    assert _types(new)["e"]["T"] == HALF
    feeds = {"x:0": np.full((2, 4), 0.1, np.float32)}
    np.testing.assert_allclose(graphs.run(new, feeds, ["out:0"])[0],
                               graphs.run(g.as_graph_def(), feeds, ["out:0"])[0], rtol=1e-2)


def test_untouched_float_to_float_cast_is_kept():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        feat = tf.raw_ops.Cast(x=x, DstT=tf.float32, name="feat")
        tf.nn.softmax(tf.exp(feat), name="out")
    new, report = convert(g.as_graph_def())
    assert "feat" in {n.name for n in new.node} and report.casts_removed == []


def test_splat_const_stays_a_splat():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 512], name="x")
        w = tf.constant(0.5, shape=[512, 512], name="w")
        tf.identity(tf.matmul(x, w), name="out")
    gd = g.as_graph_def()
    for target, device in (("float16", "gpu"), ("bfloat16", "cpu")):
        new, report = convert(gd, target=target, device=device, min_matrix_intensity=0)
        assert report.consts_converted == ["w"]
        assert new.ByteSize() < gd.ByteSize() + 1000   # not 512*512 values
        feeds = {"x:0": np.ones((2, 512), np.float32)}
        np.testing.assert_allclose(graphs.run(new, feeds, ["out:0"])[0], 256.0)


def test_index_typed_ops_report_their_real_reason():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 4], name="x")
        e = tf.exp(x, name="e")
        ss = tf.strided_slice(e, [0, 0], [2, 4], name="ss")
        tf.reduce_sum(ss, name="out")
    _, report = convert(g.as_graph_def())
    assert report.node("ss").code == "deny_propagated"


def test_retargeted_cast_reads_the_low_precision_tensor():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        m1 = tf.matmul(x, tf.ones([4, 4]), name="mm1")
        c = tf.raw_ops.Cast(x=m1, DstT=tf.float32, name="c")
        tf.identity(tf.matmul(tf.nn.relu(c), tf.ones([4, 4]), name="mm2"), name="out")
    new, report = convert(g.as_graph_def())
    casts = [n for n in new.node if n.op == "Cast"]
    chains = [n for n in casts if n.attr["SrcT"].type == HALF and n.attr["DstT"].type == FLOAT
              and any(m.op == "Cast" and m.input[0] == n.name for m in casts)]
    assert not chains
    assert "c" not in {n.name for n in new.node}   # half -> half after retargeting: bypassed


def test_grappler_log_path_variable_is_accepted(tmp_path):
    rules = load_rules("float16", env={"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH": str(tmp_path)})
    assert "MatMul" in rules.effective("allow") and rules.env == []


def test_text_metagraph_with_a_comment_header(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        tf.matmul(x, tf.ones([4, 4]), name="y")
        meta = v1.train.export_meta_graph(graph=g)
    path = tmp_path / "m.pbtxt"
    path.write_text("# proto-file: tensorflow/core/protobuf/meta_graph.proto\n# proto-message: MetaGraphDef\n\n"
                    + text_format.MessageToString(meta))
    assert load(path).kind == "metagraph"


def test_explain_works_on_a_training_graph_that_loss_scaling_would_refuse(tmp_path, capsys):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        w1 = v1.get_variable("w1", initializer=np.ones((8, 8), np.float32))
        w2 = v1.get_variable("w2", initializer=np.ones((8, 8), np.float32))
        l1 = tf.reduce_mean(tf.matmul(x, w1), name="l1")
        l2 = tf.reduce_mean(tf.matmul(x, w2), name="l2")
        v1.train.GradientDescentOptimizer(0.1).minimize(l1, var_list=[w1], name="t1")
        v1.train.GradientDescentOptimizer(0.1).minimize(l2, var_list=[w2], name="t2")
        meta = v1.train.export_meta_graph(graph=g)
    path = tmp_path / "two.meta"
    path.write_bytes(meta.SerializeToString())
    assert main([str(path), "-o", str(tmp_path / "out.meta")]) == 2   # two seeds: needs --loss
    capsys.readouterr()
    assert main(["explain", str(path), "MatMul"]) == 0
    assert "runs in float16" in capsys.readouterr().out


def test_force_lowp_on_an_interface_node_is_refused_with_a_warning(tmp_path):
    gd, _, _ = graphs.mlp()
    path = tmp_path / "r.toml"
    path.write_text('[[override]]\nglob = "probs"\naction = "force_lowp"\n')
    new, report = convert(gd, rules=load_rules("float16", [path], env={}))
    assert _types(new)["probs"]["T"] == FLOAT
    assert sum("force_lowp refused for `probs`" in w for w in report.warnings) == 1


def test_misspelled_command_is_named(capsys):
    import pytest
    with pytest.raises(SystemExit) as exit_:
        main(["verfy", "a.pb", "b.pb"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean 'amp-rewrite verify'" in err and len(err.strip().splitlines()) == 1


def test_truncated_pbtxt_error_is_short(tmp_path, capsys):
    gd, _, _ = graphs.mlp()
    text = text_format.MessageToString(gd)
    path = tmp_path / "trunc.pbtxt"
    path.write_text(text[: text.index("tensor_content") + 400])
    assert main([str(path), "-o", str(tmp_path / "o.pb")]) == 2
    err = capsys.readouterr().err
    assert len(err) < 600 and len(err.strip().splitlines()) == 1 and "not a valid text GraphDef" in err


def test_force_never_replaces_a_folder_that_is_not_a_saved_model(tmp_path):
    import tensorflow as tf

    class M(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.ones([4, 4]))

        @tf.function(input_signature=[tf.TensorSpec([2, 4], tf.float32)])
        def __call__(self, x):
            return tf.matmul(x, self.w)

    tf.saved_model.save(M(), str(tmp_path / "sm"))
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("code")
    assert main([str(tmp_path / "sm"), "-o", str(project), "--force"]) == 2
    assert (project / "src" / "train.py").read_text() == "code"
    # a SavedModel output is still replaced with --force: whole, not merged into
    out = tmp_path / "out"
    assert main([str(tmp_path / "sm"), "-o", str(out)]) == 0
    (out / "stale.txt").write_text("from before")
    assert main([str(tmp_path / "sm"), "-o", str(out), "--force"]) == 0
    assert not (out / "stale.txt").exists()
    assert tf.saved_model.load(str(out))(tf.ones([2, 4])).numpy().tolist() == [[4.0] * 4] * 2


def test_loss_scale_beyond_float32_is_refused(tmp_path, capsys):
    gd, _, _ = graphs.training_mlp()
    src = tmp_path / "t.pb"
    src.write_bytes(gd.SerializeToString())
    for flags in (["--loss-scale", "1e39"], ["--loss-scale-start", "1e39"]):
        assert main([str(src), "-o", str(tmp_path / "o.pb")] + flags) == 2
        assert "fit in float32" in capsys.readouterr().err
        assert not (tmp_path / "o.pb").exists()


def test_splat_listing_several_values_is_not_expanded():
    """A splat lists fewer values than its shape holds (the last repeats); converting it keeps
    the listed values only, in the target's bits."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        w = tf.constant(0.25, shape=[4, 4], name="w")
        tf.identity(tf.matmul(x, w), name="out")
    gd = g.as_graph_def()
    w = next(n for n in gd.node if n.name == "w")
    w.attr["value"].tensor.float_val[:] = [1.0, 0.25]    # first element 1, the rest 0.25
    feeds = {"x:0": np.ones((2, 4), np.float32)}
    ref = graphs.run(gd, feeds, ["out:0"])[0]
    for target, device in (("float16", "gpu"), ("bfloat16", "cpu")):
        new, report = convert(gd, target=target, device=device, min_matrix_intensity=0)
        w_new = next(n for n in new.node if n.name == "w").attr["value"].tensor
        assert not w_new.tensor_content and len(w_new.half_val) == 2
        np.testing.assert_allclose(graphs.run(new, feeds, ["out:0"])[0], ref)
