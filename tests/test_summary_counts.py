"""The conversion summary counts what the output holds, by dtype, and only the model's own ops.

A graph whose matrix ops already run in the other 16-bit dtype is widened to float32 first and
counted in the target, nothing left in the first dtype (it used to be refused: convert the FP32
original); a graph already in the target converts and is counted in it; 16-bit values at an FP32
graph's edges are counted in their own dtype, never as the target. A SavedModel's
saver functions (``__inference__traced_save/restore``) are reported node by node but left out of
the counts, the functions painted and the HTML page's tables, and the summary says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
from refusals import run_cli
from tensorflow.core.protobuf import saved_model_pb2

import graphs
from amp_rewrite import convert, convert_file
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.io.load import load
from amp_rewrite.report import html
from amp_rewrite.schema.functiondef import saver_functions

v1 = tf.compat.v1
OTHER = {"float16": "bfloat16", "bfloat16": "float16"}
OPTS = {"float16": {}, "bfloat16": {"device": "cpu", "min_matrix_intensity": 0}}


# ----------------------------------------------------------------- a 16-bit graph as input
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """An FP32 MLP and its conversion to each target, as files."""
    folder = tmp_path_factory.mktemp("lowp")
    src = folder / "mlp.pb"
    src.write_bytes(graphs.mlp()[0].SerializeToString())
    out = {}
    for target in OTHER:
        out[target] = folder / f"mlp_{target}.pb"
        convert_file(src, out[target], target=target, **OPTS[target])
    return folder, src, out


@pytest.mark.parametrize("target", ["bfloat16", "float16"])
def test_a_graph_converted_for_one_target_converts_to_the_other_and_counts_in_it(converted, capsys,
                                                                                 target):
    """Once refused ("convert the FP32 original"): now widened to float32 first, every matrix
    op in the target and none left in the first 16-bit dtype, the counts saying so."""
    folder, src, out = converted
    given, again = out[OTHER[target]], folder / f"again_{target}.pb"
    argv = [given, "-o", again, "--target", target, "--device", "cpu", "--force"] + (
        ["--min-matrix-intensity", "0"] if target == "bfloat16" else [])
    code, printed, err = run_cli(capsys, argv)
    assert code == 0, err
    held = sum(nd.op in MATRIX_OPS for nd in _graph_def(again).node)
    assert f"{held}/{held} MatMul/Conv-family ops in {target}\n" in printed
    other = OTHER[target]
    first = tf.as_dtype(other).as_datatype_enum
    assert not any(v.type == first for nd in _graph_def(again).node for v in nd.attr.values())
    assert f"widening: the input computes in {other}" in printed
    _, report = convert(_graph_def(given), target=target, **OPTS[target])
    s = report.summary()
    assert other not in s["matrix_by_dtype"] and other not in s["float_ops_by_dtype"]
    feeds, fetches = graphs.mlp()[1:]
    ref = graphs.run(_graph_def(src), feeds, fetches)[0]
    assert graphs.rel_l2(graphs.run(_graph_def(again), feeds, fetches)[0], ref) < 0.03


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_graph_converted_for_the_target_converts_and_counts_in_it(converted, tmp_path, capsys,
                                                                    target):
    _, _, out = converted
    again = tmp_path / "again.pb"
    argv = [out[target], "-o", again, "--target", target] + (
        ["--device", "cpu", "--min-matrix-intensity", "0"] if target == "bfloat16" else [])
    code, printed, _ = run_cli(capsys, argv)
    assert code == 0 and again.read_bytes() == out[target].read_bytes()
    held = sum(nd.op in MATRIX_OPS for nd in _graph_def(again).node)
    assert f"{held}/{held} MatMul/Conv-family ops in {target}\n" in printed


def _edges_in_float16():
    """An FP32 MLP whose input comes as float16 and is scaled in float16 before a cast to
    float32: 16-bit values at the edge of an FP32 graph, no 16-bit matrix op."""
    r = np.random.default_rng(1)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float16, [None, 32], name="x16")
        scaled = tf.multiply(x, tf.constant(0.5, tf.float16), name="scale16")
        h = tf.cast(scaled, tf.float32, name="to_float")
        w = tf.constant(r.normal(0, 0.2, (32, 32)).astype(np.float32), name="w")
        y = tf.nn.relu(tf.matmul(h, w, name="mm"), name="relu")
        tf.nn.relu(tf.matmul(y, w, name="mm2"), name="out")
    return g.as_graph_def()


def test_16bit_values_at_an_fp32_graphs_edges_are_counted_in_their_dtype_not_the_target():
    gd = _edges_in_float16()
    new, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert report.node("mm").precision == report.node("mm2").precision == "bfloat16"
    assert report.node("scale16").precision == "float16"   # the edge is left as it was
    floats = [n for n in report.nodes if n.op not in MATRIX_OPS and n.precision != "none"]
    held = [set(n.attrs.values()) - {"float"} for n in floats]
    half, bf16 = held.count({"half"}), held.count({"bfloat16"})
    both = held.count({"half", "bfloat16"})   # the input's Cast, now float16 -> bfloat16
    assert half >= 2 and bf16 >= 1 and both == 1
    s = report.summary()
    assert s["matrix_converted"] == s["matrix_total"] == 2
    assert s["matrix_by_dtype"] == {"bfloat16": 2}
    assert s["float_ops_converted"] == bf16
    assert s["float_ops_by_dtype"] == {"bfloat16": bf16, "float16": half, "mixed": both,
                                       "float32": len(floats) - half - bf16 - both}
    assert s["nodes_converted"] == bf16 + 2
    assert report.format_summary().splitlines()[1].startswith(
        f"other float ops: {bf16}/{len(floats)} in bfloat16; {half} in float16, 1 in both "
        "16-bit dtypes; ")
    feeds = {"x16:0": np.random.default_rng(2).normal(0, 1, (4, 32)).astype(np.float16)}
    ref, got = graphs.run(gd, feeds, ["out:0"])[0], graphs.run(new, feeds, ["out:0"])[0]
    assert graphs.rel_l2(got, ref) < 0.05


def _graph_def(path):
    gd = v1.GraphDef()
    gd.ParseFromString(path.read_bytes())
    return gd


# ----------------------------------------------------------------- a SavedModel's saver
class _Dense(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).normal(0, 0.2, (16, 16)).astype(np.float32))
        self.b = tf.Variable(np.zeros(16, np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    def __call__(self, x):
        return tf.nn.relu(tf.matmul(x, self.w) + self.b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tf.Module SavedModel (two variables, a signature), converted to float16 with a report."""
    folder = tmp_path_factory.mktemp("saver")
    src, dst = folder / "dense", folder / "dense_f16"
    module = _Dense()
    tf.saved_model.save(module, str(src), signatures=module.__call__)
    report = convert_file(src, dst, target="float16")
    return src, dst, report


def _saved_meta(src):
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((src / "saved_model.pb").read_bytes())
    return proto.meta_graphs[0]


def _saver_callees(meta) -> list[str]:
    """The functions the nodes the saver_def names call, read off the proto."""
    named = {meta.saver_def.save_tensor_name.split(":")[0], meta.saver_def.restore_op_name}
    return sorted(_callee(nd) for nd in meta.graph_def.node if nd.name in named)


def _callee(node_def) -> str | None:
    return node_def.attr["f"].func.name if "f" in node_def.attr else None


def test_saver_functions_are_reported_apart_and_not_counted(saved):
    src, _, report = saved
    saver = _saver_callees(_saved_meta(src))
    assert len(saver) == 2 and all("_traced_" in f for f in saver)
    assert sorted(report.saver_functions) == saver
    assert not set(saver) & set(report.functions())
    s = report.summary()
    theirs = [n for n in report.nodes if n.name.split("/")[0] in saver]
    assert theirs and report.node(theirs[0].name) is theirs[0]   # still reported, explainable
    assert s["saver_functions"] == 2 and s["saver_nodes"] == len(theirs)
    assert s["nodes_total"] == len(report.nodes) - len(theirs)
    assert s["plumbing"] + s["float_ops_total"] + s["matrix_total"] == s["nodes_total"]
    ours = [n for n in report.nodes if n.name.split("/")[0] not in saver]
    kept = sum(1 for n in ours if n.precision == "float32")
    assert sum(s["kept_float32_by_reason"].values()) == kept
    text = report.format_summary()
    assert f"saver functions: 2 ({len(theirs)} nodes), not counted" in text
    painted = next(line for line in text.splitlines() if line.startswith("functions painted"))
    assert "_traced_" not in painted
    data = json.loads(report.to_json())
    assert sorted(data["saver_functions"]) == saver and not set(saver) & set(data["functions"])


def test_the_html_pages_leave_the_saver_functions_out(saved):
    src, dst, report = saved
    page = html.convert_page(report.to_dict())
    assert "saver functions (not counted)" in page and "_traced_" not in page
    names = {n["name"].split("/")[0] for n in html.graph_precision(dst)}
    assert not names & set(_saver_callees(_saved_meta(src)))
    assert any(n.startswith("__inference___call__") for n in names)


def test_saver_functions_are_found_by_the_saver_def_and_by_name_without_it(saved):
    src, _, _ = saved
    meta = _saved_meta(src)
    saver = _saver_callees(meta)
    assert sorted(saver_functions(meta)) == saver
    # renamed: found through the nodes the saver_def names, not by the name
    renamed = type(meta)()
    renamed.CopyFrom(meta)
    new_names = {}
    for f in renamed.graph_def.library.function:
        if f.signature.name in saver:
            new_names[f.signature.name] = f.signature.name.replace("_traced_", "_mine_")
            f.signature.name = new_names[f.signature.name]
    for nd in renamed.graph_def.node:
        if _callee(nd) in new_names:
            nd.attr["f"].func.name = new_names[_callee(nd)]
    assert sorted(saver_functions(renamed)) == sorted(new_names.values())
    # no saver_def: by tf.saved_model.save's names
    unnamed = type(meta)()
    unnamed.CopyFrom(meta)
    unnamed.ClearField("saver_def")
    assert sorted(saver_functions(unnamed)) == saver
    # a function the model also runs is not the saver's
    shared = type(meta)()
    shared.CopyFrom(meta)
    calls = next(nd for nd in shared.graph_def.node if _callee(nd) == saver[0])
    also = shared.graph_def.node.add()
    also.CopyFrom(calls)
    also.name = "also_runs_it"
    assert saver_functions(shared) == [saver[1]]


def test_a_graph_saved_with_a_tf1_saver_has_no_saver_functions(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        w = v1.get_variable("w", [8, 8], initializer=v1.ones_initializer())
        tf.nn.relu(tf.matmul(x, w), name="y")
        meta = v1.train.Saver().export_meta_graph()
    assert meta.saver_def.restore_op_name and saver_functions(meta) == []
    path = tmp_path / "tf1.meta"
    path.write_bytes(meta.SerializeToString())
    report = convert_file(path, tmp_path / "tf1_f16.meta", target="float16")
    s = report.summary()
    assert report.saver_functions == [] and s["saver_nodes"] == 0
    assert s["nodes_total"] == len(report.nodes)
    assert "saver functions" not in report.format_summary()


def test_a_saved_model_converted_for_one_target_converts_to_the_other(saved, capsys):
    """Its variables stayed float32 (the master weights): widened back, the bfloat16 conversion
    computes what the FP32 original's does, byte for byte in its outputs."""
    src, dst, _ = saved
    again, direct = dst.parent / "again", dst.parent / "direct"
    for given, out in ((dst, again), (src, direct)):
        code, _, err = run_cli(capsys, [given, "-o", out, "--target", "bfloat16", "--device",
                                        "cpu", "--min-matrix-intensity", "0", "--force"])
        assert code == 0, err
    matmuls = [nd.attr["T"].type for f in load(again).graph_def.library.function
               for nd in f.node_def if nd.op in MATRIX_OPS]
    assert matmuls == [tf.bfloat16.as_datatype_enum]
    x = tf.constant(np.random.default_rng(3).normal(0, 1, (4, 16)).astype(np.float32))
    got, want = (tf.saved_model.load(str(p)).signatures["serving_default"](x=x)
                 for p in (again, direct))
    assert [np.array_equal(got[k].numpy(), want[k].numpy()) for k in want] == [True]


# ----------------------------------------------------------------- a function traced twice
class _Twice(tf.Module):
    """Two MatMuls, one reading a Const past float16's range; saved with the method as two
    signatures, so TensorFlow traces its body twice (``__inference_serve_N`` and ``_M``)."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(1).normal(0, 0.2, (8, 8)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
    def serve(self, x):
        loud = tf.constant(np.full((8, 8), 1e5, np.float32), name="loud")
        return {"y": tf.matmul(tf.matmul(x, self.w), loud)}


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    folder = tmp_path_factory.mktemp("twice")
    module = _Twice()
    tf.saved_model.save(module, str(folder / "model"),
                        signatures={"serving_default": module.serve,
                                    "other": module.serve.get_concrete_function()})
    return folder


def test_a_body_traced_twice_is_counted_once_and_warns_once(twice, capsys):
    meta = _saved_meta(twice / "model")
    bodies = [f.signature.name for f in meta.graph_def.library.function
              if sum(nd.op == "MatMul" for nd in f.node_def) == 2]
    assert len(bodies) == 2, "the case is void: TensorFlow traced the method once"
    code, out, err = run_cli(capsys, [twice / "model", "-o", twice / "f16", "--report",
                                      twice / "f16.json"])
    assert code == 0, err
    assert "target float16 on gpu: 2/2 MatMul/Conv-family ops in float16" in out
    painted = next(ln for ln in out.splitlines() if ln.startswith("functions painted: "))
    assert all(b in painted for b in bodies)
    first, second = sorted(bodies, key=painted.index)
    assert (f"of them, 1 repeat another's trace, painted the same (counted once above: "
            f"{second} as {first})") in out
    assert err.count("holds values beyond float16's range") == 1, err
    data = json.loads((twice / "f16.json").read_text())
    assert data["repeated_functions"] == {second: first}
    assert data["summary"]["matrix_total"] == 2 and data["summary"]["functions_repeated"] == 1
    # both bodies are still reported, node by node
    assert sum(n["op"] == "MatMul" for n in data["nodes"]) == 4
    # the page counts as the summary does
    assert "2 of 2" in html.convert_page(data)
    # as --freeze counts the one graph it makes
    code, out, _ = run_cli(capsys, [twice / "model", "-o", twice / "frozen", "--freeze"])
    assert code == 0 and "2/2 MatMul/Conv-family ops in float16" in out


def test_bodies_repeat_only_when_named_and_painted_alike():
    """The definition of docs/report.md "Counted once", on reports made by hand: the trace
    number and a call-site copy's _ampN set aside, the same nodes with the same dtypes."""
    from amp_rewrite.report.decisions import NodeReport, Report

    def body(scope, precision="float16"):
        return [NodeReport(f"{scope}/mm", "MatMul", precision, "allow_list", "", [],
                           {"T": "half" if precision == "float16" else "float"}),
                NodeReport(f"{scope}/x", "_Arg", "float32", "interface", "")]
    scopes = ["__inference_serve_1", "__inference_serve_2", "__inference_serve_1_amp1",
              "__inference_serve_3", "__inference_other_4", "__inference_serve_5"]
    nodes = (body(scopes[0]) + body(scopes[1]) + body(scopes[2])
             + body(scopes[3], "float32")       # the same function, painted otherwise
             + body(scopes[4]) + body(scopes[5]))
    nodes[-2].name = f"{scopes[5]}/mm_2"        # other nodes
    report = Report("float16", "GPU", [], [], "default", nodes, scopes=scopes)
    assert report.repeats() == {scopes[1]: scopes[0], scopes[2]: scopes[0]}
    s = report.summary()
    assert s["matrix_total"] == 4 and s["matrix_converted"] == 3 and s["functions"] == 6
    assert s["functions_repeated"] == 2 and s["nodes_total"] == 8
