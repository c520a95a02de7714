"""verify: output errors on real converted graphs, the per-node ranking, and the container formats."""

import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import cli, convert_file
from amp_rewrite.tools.runner import open_pair
from amp_rewrite.tools.verify import verify

v1 = tf.compat.v1
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"


@pytest.fixture(scope="module")
def cnn_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "cnn_bf16.pb"
    # (unfolded: the counts below are the example's own nodes)
    convert_file(EXAMPLE, out, target="bfloat16", device="cpu", min_matrix_intensity=0,
                 fold_constants=False)
    return out


def test_bfloat16_cnn_within_tolerance_and_ranked(cnn_bf16):
    result = verify(EXAMPLE, cnn_bf16, samples=2, shapes={"images": (16, 8, 8, 1)}, nodes=True)
    assert result.ok
    (out,) = result.outputs
    assert out.elements == 2 * 16 * 10
    assert 0 < out.rel_l2 < 2e-2 and 0 < out.max_abs < 1e-2
    assert out.nonfinite == 0 and out.out_of_tolerance == 0
    # every float tensor of the graph exists in both: 24 of the 25 nodes (one Const is int32)
    assert result.nodes_compared == 24
    added = [n.added for n in result.nodes]
    assert added == sorted(added, reverse=True) and added[0] > 0
    convs = [n for n in result.nodes if n.op == "Conv2D"]
    assert len(convs) == 2 and all(n.dtype == "bfloat16" and n.added > 0 for n in convs)
    # a tensor's total error is at least what it adds over its inputs
    assert all(n.rel_l2 >= n.added for n in result.nodes)
    # the float tensors not ranked are counted, by reason: those the conversion added, and
    # any TensorFlow refuses to fetch (the batch norm's statistics, where grappler fused it
    # into the convolution)
    with open_pair(EXAMPLE, cnn_bf16) as (a, b):
        floats = {t.name for r in (a, b) for op in r.graph.get_operations() for t in op.outputs
                  if t.dtype.is_floating}
    skipped = {u.reason: u.count for u in result.uncompared}
    assert result.nodes_compared + sum(skipped.values()) == len(floats)
    assert skipped["only_converted"] == 2 and set(skipped) <= {"only_converted", "fetch_failed"}


def _overflow_graph(path: Path) -> None:
    """fc1 -> *400 -> Square (named energy) -> log1p -> logits: Square's output passes 65504."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 32], name="x")
        h = tf.matmul(x, tf.constant(r.normal(0, 0.2, (32, 64)).astype(np.float32)), name="fc1")
        sq = tf.square(tf.multiply(h, 400.0, name="scale"), name="energy")
        y = tf.math.log1p(sq, name="logenergy")
        tf.matmul(y, tf.constant(r.normal(0, 0.2, (64, 10)).astype(np.float32)), name="logits")
    path.write_bytes(g.as_graph_def().SerializeToString())


def test_per_node_names_the_planted_float16_overflow(tmp_path):
    orig, conv, rules = tmp_path / "m.pb", tmp_path / "m16.pb", tmp_path / "force.toml"
    _overflow_graph(orig)
    rules.write_text('[[override]]\nglob = "energy"\naction = "force_lowp"\n')
    convert_file(orig, conv, target="float16", rules=[str(rules)])
    result = verify(orig, conv, shapes={"x": (8, 32)}, nodes=True)
    assert not result.ok
    assert result.outputs[0].nonfinite > 0 and math.isinf(result.outputs[0].rel_l2)
    first = result.nodes[0]
    assert (first.tensor, first.op, first.dtype) == ("energy:0", "Square", "float16")
    assert math.isinf(first.added)
    # everything downstream inherits the overflow and adds nothing of its own
    assert [n.tensor for n in result.nodes if math.isinf(n.added)] == ["energy:0"]
    code = cli.main(["verify", str(orig), str(conv), "--shape", "x=8,32", "--per-node", "-q"])
    assert code == 1


def test_npz_inputs_and_explicit_tolerance(cnn_bf16, tmp_path):
    data = np.random.default_rng(3).normal(size=(4, 8, 8, 1)).astype(np.float32)
    np.savez(tmp_path / "in.npz", images=data)
    loose = verify(EXAMPLE, cnn_bf16, inputs=str(tmp_path / "in.npz"))
    assert loose.ok and loose.samples == 1 and loose.outputs[0].elements == 40
    strict = verify(EXAMPLE, cnn_bf16, inputs=str(tmp_path / "in.npz"), rtol=0.0, atol=0.0)
    assert not strict.ok and strict.outputs[0].out_of_tolerance > 0.5
    # the same data as run by hand: the reported error is the real one
    a, b = (_run_pb(p, data) for p in (EXAMPLE, cnn_bf16))
    assert strict.outputs[0].max_abs == pytest.approx(np.abs(a - b).max(), rel=1e-6)
    assert cli.main(["verify", str(EXAMPLE), str(cnn_bf16), "--inputs", str(tmp_path / "in.npz"),
                     "--rtol", "0", "--atol", "0", "-q"]) == 1


def _run_pb(path, images):
    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString(Path(path).read_bytes())
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with v1.Session(graph=g) as s:
        return s.run("probabilities:0", {"images:0": images}).astype(np.float64)


def test_metagraph_with_variables_shares_the_weights(tmp_path):
    """Unseeded initializers: the converted graph must get the original's values, not its own."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 16], name="x")
        w = v1.get_variable("w", [16, 32], initializer=v1.random_normal_initializer(0, 0.3))
        y = tf.nn.relu(tf.matmul(x, w), name="y")
        sig = v1.saved_model.predict_signature_def({"x": x}, {"y": y})
        saver = v1.train.Saver()
        meta = v1.train.export_meta_graph(graph=g)
        with v1.Session(graph=g) as sess:
            sess.run(w.initializer)
            ckpt = saver.save(sess, str(tmp_path / "ckpt"))
    meta.signature_def["serving_default"].CopyFrom(sig)
    (tmp_path / "m.meta").write_bytes(meta.SerializeToString())
    convert_file(tmp_path / "m.meta", tmp_path / "m16.meta", target="float16")
    result = verify(tmp_path / "m.meta", tmp_path / "m16.meta", samples=2, nodes=True)
    assert result.ok and result.outputs[0].name == "y:0"
    assert 0 < result.outputs[0].rel_l2 < 5e-3
    assert any(n.op == "MatMul" and n.dtype == "float16" for n in result.nodes)
    restored = verify(tmp_path / "m.meta", tmp_path / "m16.meta", checkpoint=ckpt)
    assert restored.ok and 0 < restored.outputs[0].rel_l2 < 5e-3
    assert cli.main(["verify", str(tmp_path / "m.meta"), str(tmp_path / "m16.meta"),
                     "--checkpoint", str(tmp_path / "nothing")]) == 2


def test_savedmodel_signatures(tmp_path):
    r = np.random.default_rng(0)

    class Net(tf.Module):
        def __init__(self):
            self.w = tf.Variable(r.normal(0, 0.3, (16, 8)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="features")])
        def __call__(self, features):
            return {"scores": tf.nn.softmax(tf.matmul(features, self.w))}

    net = Net()
    tf.saved_model.save(net, str(tmp_path / "fp32"), signatures=net.__call__)
    # (variables kept: --per-node below reads the function bodies, which freezing inlines)
    convert_file(tmp_path / "fp32", tmp_path / "bf16", target="bfloat16", device="cpu",
                 min_matrix_intensity=0, freeze=False)
    result = verify(tmp_path / "fp32", tmp_path / "bf16", samples=2, shapes={"features": (5, 16)})
    assert result.ok and result.outputs[0].name == "scores" and result.outputs[0].elements == 80
    assert result.outputs[0].rel_l2 > 0  # the bfloat16 MatMul really ran
    # --per-node reads the function bodies, named function/node as the conversion report names them
    nodes = verify(tmp_path / "fp32", tmp_path / "bf16", shapes={"features": (5, 16)}, nodes=True).nodes
    (matmul,) = [n for n in nodes if n.op == "MatMul"]
    assert re.fullmatch(r"__inference___call___\d+/MatMul:0", matmul.tensor)
    assert matmul.dtype == "bfloat16" and matmul.added > 0


def test_bad_input_is_exit_2(cnn_bf16, tmp_path):
    other = tmp_path / "mlp.pb"
    g = tf.Graph()
    with g.as_default():
        tf.identity(v1.placeholder(tf.float32, [2, 3], name="features") * 2.0, name="out")
    other.write_bytes(g.as_graph_def().SerializeToString())
    assert cli.main(["verify", str(EXAMPLE), str(other)]) == 2          # different inputs
    assert cli.main(["verify", str(EXAMPLE), str(cnn_bf16), "--shape", "images=8x8"]) == 2
    assert cli.main(["verify", str(EXAMPLE), str(cnn_bf16), "--shape", "images=2,9,9,1"]) == 2
    assert cli.main(["verify", str(EXAMPLE), str(tmp_path / "missing.pb")]) == 2


def test_readme_section_commands_run(tmp_path, monkeypatch):
    """The commands of the README's "Verify, kernels, bench, HTML report" block, as written."""
    readme = (EXAMPLE.parent.parent / "README.md").read_text()
    section = readme.split("## Verify, kernels, bench, HTML report", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    monkeypatch.chdir(EXAMPLE.parent.parent)
    commands = [shlex.split(line.split("#")[0].replace("/tmp/", f"{tmp_path}/"))
                for line in block.splitlines() if line.strip()]
    assert [c[0] for c in commands] == ["amp-rewrite"] * 4
    for command in commands:
        assert cli.main(command[1:] + ["-q"]) == 0, command
    assert (tmp_path / "report.html").stat().st_size > 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_training_metagraph_forward_pass_compared_without_training(tmp_path):
    """A float16 training graph (loss scaling added): the loss matches, --per-node compares the
    backward pass unscaled, and never runs a variable write (Apply*, Assign*), so comparing
    does not train either graph (tests/test_verify_training.py checks the variables' bits)."""
    import training_graphs
    (tmp_path / "t.meta").write_bytes(training_graphs.build("cnn", "momentum").SerializeToString())
    convert_file(tmp_path / "t.meta", tmp_path / "t16.meta", target="float16", device="cpu", min_matrix_intensity=0)
    result = verify(tmp_path / "t.meta", tmp_path / "t16.meta", shapes={"x": (32, 64)},
                    outputs=["loss", "accuracy"], nodes=True, samples=2)
    assert result.ok and [o.elements for o in result.outputs] == [2, 2]
    ops = {n.op for n in result.nodes}
    assert {"Conv2D", "MatMul", "Conv2DBackpropFilter"} <= ops
    assert not {op for op in ops if "Apply" in op or op.startswith("Assign")}
    # the backward pass holds gradients times 2^15 in the converted graph: compared unscaled
    backward = [n for n in result.nodes if n.tensor.startswith("gradients/")]
    assert backward and max(n.rel_l2 for n in backward) < 0.1
    # labels that do not fit the logits: TensorFlow's reason in one line, exit 2
    assert cli.main(["verify", str(tmp_path / "t.meta"), str(tmp_path / "t16.meta"),
                     "--shape", "x=32,64", "--shape", "y=3", "--output", "loss"]) == 2


def _rounded(path: Path, dtype) -> None:
    """x -> dense -> ``levels`` (rounded, held as ``dtype``) -> back to float32 -> out."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        h = tf.matmul(x, np.full((4, 4), 0.5, np.float32), name="dense")
        levels = tf.identity(tf.cast(tf.round(h), dtype), name="levels")
        tf.identity(tf.cast(levels, tf.float32) + h, name="out")
    path.write_bytes(g.as_graph_def().SerializeToString())


def test_per_node_counts_a_tensor_whose_dtype_is_not_float_in_the_other_model(tmp_path):
    """Two models that differ in one tensor's dtype (float32 in one, int32 in the other):
    that tensor is counted as not compared, not dropped."""
    _rounded(tmp_path / "a.pb", tf.float32)
    _rounded(tmp_path / "b.pb", tf.int32)
    result = verify(tmp_path / "a.pb", tmp_path / "b.pb", shapes={"x": (3, 4)}, nodes=True)
    assert result.ok and "dense:0" in {n.tensor for n in result.nodes}
    (group,) = [u for u in result.uncompared if u.reason == "not_float"]
    assert group.tensors == ["levels:0"] and group.count == 1
