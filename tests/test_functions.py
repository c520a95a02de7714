"""Function libraries in plain GraphDefs: bodies painted, boundaries lowered, callees specialized."""

import graphs
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import function as v1_function

from amp_rewrite import cli, convert, convert_file
from amp_rewrite.core.errors import INTERNAL_EXIT, IRError, LintError
from amp_rewrite.schema.functiondef import (
    check_call_types,
    function_to_graph,
    graph_to_function,
    reachable,
)
from amp_rewrite.transforms import casts

TOL = {"float16": 5e-3, "bfloat16": 2e-2}
DEVICE = {"float16": "gpu", "bfloat16": "cpu"}
LOWP = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}
CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _weights(seed=0, n=3):
    r = np.random.default_rng(seed)
    return [r.normal(0, 0.25, (16, 16)).astype(np.float32) for _ in range(n)]


def _feeds(seed=1):
    return {"x:0": np.random.default_rng(seed).normal(0, 1, (4, 16)).astype(np.float32)}


def _library(graph_def):
    return {f.signature.name: f for f in graph_def.library.function}


def _nodes(fdef, op):
    return [nd for nd in fdef.node_def if nd.op == op]


def control_flow_graph():
    """A tf.function with a while loop, a cond, a switch_case and a nested tf.function call."""
    w1, w2, w3 = _weights()

    @tf.function
    def layer(h):
        return tf.nn.relu(tf.matmul(h, tf.constant(w3)))

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32)])
    def f(x):
        _, h = tf.while_loop(lambda i, h: i < 3,
                             lambda i, h: (i + 1, tf.nn.relu(tf.matmul(h, tf.constant(w1)))),
                             [tf.constant(0), x])
        h = tf.cond(tf.reduce_sum(h) > 0, lambda: tf.matmul(h, tf.constant(w2)), lambda: h * 0.5)
        h = tf.switch_case(tf.constant(1), [lambda: tf.matmul(h, tf.constant(w1)),
                                            lambda: tf.matmul(h, tf.constant(w2))])
        return tf.identity(layer(h), name="out")

    return f.get_concrete_function().graph.as_graph_def()


@pytest.fixture(scope="module")
def control_flow():
    gd = control_flow_graph()
    return gd, graphs.run(gd, _feeds(), ["out:0"])


def test_functional_while_body_matmul_is_painted_and_casts_leave_the_loop():
    gd, feeds, fetches = graphs.functional_while()
    ref = graphs.run(gd, feeds, fetches)
    for target in ("float16", "bfloat16"):
        new, report = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)
        loop = [n for n in new.node if n.op in ("While", "StatelessWhile")][0]
        body = _library(new)[loop.attr["body"].func.name]
        assert [nd.attr["T"].type for nd in _nodes(body, "MatMul")] == [LOWP[target]]
        assert _nodes(body, "Cast") == []  # the loop-carried value itself is low precision
        carried = [a.type for a in body.signature.input_arg]
        assert carried == list(loop.attr["T"].list.type)
        assert carried == [a.type for a in _library(new)[loop.attr["cond"].func.name]
                           .signature.input_arg]
        assert LOWP[target] in carried
        assert check_call_types(new) == []
        assert graphs.rel_l2(graphs.run(new, feeds, fetches)[0], ref[0]) <= TOL[target]
        assert report.summary()["matrix_converted"] == report.summary()["matrix_total"] == 1


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_if_case_and_calls_bodies_are_painted(control_flow, target):
    gd, ref = control_flow
    new, report = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)
    lib = _library(new)
    matmuls = [nd for f in lib.values() for nd in _nodes(f, "MatMul")]
    assert len(matmuls) == 5 and {nd.attr["T"].type for nd in matmuls} == {LOWP[target]}
    assert {"StatelessWhile", "StatelessIf", "StatelessCase", "PartitionedCall"} <= {
        n.op for n in new.node}
    assert check_call_types(new) == []
    assert graphs.rel_l2(graphs.run(new, _feeds(), ["out:0"])[0], ref[0]) <= TOL[target]
    # the graph's own interface stays float32
    assert graphs.dtypes_of(new, name="out")["out"]["T"] == "float32"


def test_function_def_round_trip_through_the_ir_is_lossless(control_flow):
    gd, _ = control_flow
    lib = _library(gd)
    sigs = {name: f.signature for name, f in lib.items()}
    assert len(lib) >= 6
    for fdef in lib.values():
        assert graph_to_function(function_to_graph(fdef, sigs), sigs) == fdef


def test_only_reachable_functions_are_painted(control_flow):
    gd = tf.compat.v1.GraphDef()
    gd.CopyFrom(control_flow[0])
    assert sorted(reachable(gd.node, gd.library)) == sorted(_library(gd))
    layer = next(f for name, f in _library(gd).items() if name.startswith("__inference_layer_"))
    orphan = gd.library.function.add()
    orphan.CopyFrom(layer)
    orphan.signature.name = "orphan_layer"
    assert "orphan_layer" not in reachable(gd.node, gd.library)
    new, _ = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert _library(new)["orphan_layer"] == orphan  # left exactly as it was


def test_call_type_check_finds_a_while_that_disagrees_with_its_body():
    gd, _, _ = graphs.functional_while()
    new, _ = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert check_call_types(new) == []
    loop = [n for n in new.node if n.op in ("While", "StatelessWhile")][0]
    loop.attr["T"].list.type[-1] = types_pb2.DT_DOUBLE
    assert len(check_call_types(new)) == 2  # body and cond both disagree


def shared_callee_graph():
    """One tf.function called twice: once between MatMuls, once between float32-only Exps."""
    w1, w2, w3 = _weights(seed=2)

    @tf.function
    def inner(h):
        return tf.nn.relu(tf.matmul(h, tf.constant(w1)))

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32)])
    def outer(x):
        a = tf.matmul(inner(tf.matmul(x, tf.constant(w2))), tf.constant(w3))
        b = tf.exp(inner(tf.exp(x * 0.1)) * 0.1)
        return tf.identity(a + b, name="out")

    return outer.get_concrete_function().graph.as_graph_def()


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_callee_with_two_different_needs_is_specialized(target):
    gd = shared_callee_graph()
    ref = graphs.run(gd, _feeds(), ["out:0"])
    calls = [n for n in gd.node if n.op in CALLS]
    assert len(calls) == 2 and calls[0].attr["f"].func.name == calls[1].attr["f"].func.name
    new, report = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)
    lib = _library(new)
    by_input = {}
    for n in new.node:
        if n.op in CALLS:
            callee = lib[n.attr["f"].func.name]
            by_input[tf.dtypes.as_dtype(callee.signature.input_arg[0].type).name] = (n, callee)
    low = tf.dtypes.as_dtype(LOWP[target]).name
    assert set(by_input) == {low, "float32"}  # two copies, one per need
    node, callee = by_input[low]
    assert list(node.attr["Tin"].list.type) == list(node.attr["Tout"].list.type) == [LOWP[target]]
    assert _nodes(callee, "Cast") == []
    node, callee = by_input["float32"]
    assert [a.type for a in callee.signature.output_arg] == [types_pb2.DT_FLOAT]
    assert all(nd.attr["T"].type == LOWP[target]
               for f in lib.values() for nd in _nodes(f, "MatMul"))
    assert check_call_types(new) == []
    assert graphs.rel_l2(graphs.run(new, _feeds(), ["out:0"])[0], ref[0]) <= TOL[target]
    assert report.extra["boundaries"]["specialized"]
    # the report counts exactly the casts the output holds (the input had none)
    held = sum(nd.op == "Cast" for nd in new.node) + sum(len(_nodes(f, "Cast")) for f in lib.values())
    assert held == report.summary()["casts_added"] > 0
    again, second = convert(new, target=target, device=DEVICE[target], min_matrix_intensity=0)  # idempotent
    assert again.SerializeToString(deterministic=True) == new.SerializeToString(deterministic=True)
    assert second.summary()["casts_added"] == 0


def test_direct_function_calls_are_typed_by_their_signature_and_cast_at_the_call():
    """As grappler does: the call (its op is the function's name) keeps the dtypes its signature
    declares; its neighbours are painted, with a cast to float32 before it and back after."""
    w1, w2, _ = _weights(seed=3)
    g = tf.Graph()
    with g.as_default():
        @v1_function.Defun(tf.float32)
        def half_relu(h):
            return tf.nn.relu(h) * 0.5

        x = tf.compat.v1.placeholder(tf.float32, [4, 16], name="x")
        y = half_relu(tf.matmul(x, tf.constant(w1), name="mm1"))
        z = tf.matmul(y, tf.constant(w2), name="mm2")
        tf.matmul(z, tf.constant(w1), name="mm3")
        tf.identity(tf.nn.relu(z), name="out")
    gd = g.as_graph_def()
    call = next(n.name for n in gd.node if n.op == half_relu.name)
    ref = graphs.run(gd, _feeds(), ["out:0"])
    new, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    nodes = {n.name: n for n in new.node}
    assert nodes["mm1"].attr["T"].type == nodes["mm2"].attr["T"].type == types_pb2.DT_BFLOAT16
    assert report.node(call).code == "function_call" and nodes[call].op == half_relu.name
    feeder = nodes[nodes[call].input[0]]
    assert feeder.op == "Cast" and feeder.attr["DstT"].type == types_pb2.DT_FLOAT
    reader = nodes[nodes["mm2"].input[0]]
    assert reader.op == "Cast" and reader.input[0] == call
    assert graphs.rel_l2(graphs.run(new, _feeds(), ["out:0"])[0], ref[0]) <= TOL["bfloat16"]


def test_graph_def_file_with_a_library_converts_through_convert_file(tmp_path):
    gd, feeds, fetches = graphs.functional_while()
    src = tmp_path / "loop.pb"
    src.write_bytes(gd.SerializeToString())
    out = tmp_path / "loop_amp.pb"
    convert_file(src, out, target="bfloat16", device="cpu", min_matrix_intensity=0)
    new = tf.compat.v1.GraphDef()
    new.ParseFromString(out.read_bytes())
    matmuls = [nd for f in new.library.function for nd in _nodes(f, "MatMul")]
    assert matmuls and all(nd.attr["T"].type == types_pb2.DT_BFLOAT16 for nd in matmuls)
    ref = graphs.run(gd, feeds, fetches)
    assert graphs.rel_l2(graphs.run(new, feeds, fetches)[0], ref[0]) <= TOL["bfloat16"]


def test_a_while_output_nothing_reads_keeps_float32():
    """In a TF1 graph with control flow v2 the While sits in the graph; an output nothing
    reads may be fetched by name, so its dtype must not change."""
    w1, _, _ = _weights(seed=4)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 16], name="x")
        _, h = tf.while_loop(lambda i, h: i < 3,
                             lambda i, h: (i + 1, tf.nn.relu(tf.matmul(h, tf.constant(w1)))),
                             [tf.constant(0), x], name="loop")
    gd = g.as_graph_def()
    # fetch the loop's output itself: drop the Identity TensorFlow put after it
    reader = next(n for n in gd.node if n.name == h.op.name)
    fetch = reader.input[0]
    gd.node.remove(reader)
    ref = graphs.run(gd, _feeds(), [fetch])
    new, _ = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    loop = next(n for n in new.node if n.op in ("While", "StatelessWhile"))
    assert loop.attr["T"].list.type[int(fetch.split(":")[1])] == types_pb2.DT_FLOAT
    body = _library(new)[loop.attr["body"].func.name]
    assert [nd.attr["T"].type for nd in _nodes(body, "MatMul")] == [types_pb2.DT_BFLOAT16]
    out = graphs.run(new, _feeds(), [fetch])[0]
    assert graphs.rel_l2(out, ref[0]) <= TOL["bfloat16"]


def _in_bodies(monkeypatch, mistake):
    """Make our own cast pass commit ``mistake(graph)`` after its work, in function bodies
    only (a body's results are ``<name>/amp_ret`` sentinels): a bug inside function painting."""
    real = casts.apply_painting

    def apply_painting(graph, painting, before):
        stats = real(graph, painting, before)
        if any(name.endswith("/amp_ret") for name in graph.names()):
            mistake(graph)
        return stats
    monkeypatch.setattr(casts, "apply_painting", apply_painting)


def _remove_a_node_still_read(graph):
    name = next(n.name for n in graph.nodes() if n.op == "MatMul")
    graph.remove_node(name)             # the IR refuses: IRError


def _uncast_a_lowp_matmul(graph):
    node = next(n for n in graph.nodes() if n.op == "MatMul")
    node.attr["T"].type = types_pb2.DT_FLOAT     # its inputs stay 16-bit: the lint finds it


@pytest.mark.parametrize("mistake, error", [(_remove_a_node_still_read, IRError),
                                            (_uncast_a_lowp_matmul, LintError)])
def test_our_bug_inside_a_function_body_is_an_internal_error_not_a_warning(
        mistake, error, monkeypatch, tmp_path, capsys):
    gd, _, _ = graphs.functional_while()
    src, out = tmp_path / "loop.pb", tmp_path / "loop_amp.pb"
    src.write_bytes(gd.SerializeToString())
    _in_bodies(monkeypatch, mistake)
    with pytest.raises(error):
        convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    code = cli.main([str(src), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--min-matrix-intensity", "0"])
    err = capsys.readouterr().err
    assert code == INTERNAL_EXIT and "bug in amp-rewrite" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_an_unusable_body_in_the_users_file_is_left_float32_with_a_warning():
    """The same path with the user's damage, one TensorFlow's importer lets through (it checks
    a body only when the function runs): an input naming an output its node does not have.
    The function is left as it was, the graph around it converted. (Damage the importer
    refuses, such as a Const whose tensor is not of its dtype, is refused at load.)"""
    gd, _, _ = graphs.functional_while()
    loop = next(n for n in gd.node if n.op in ("While", "StatelessWhile"))
    name = loop.attr["body"].func.name
    body = _library(gd)[name]
    reader = next(nd for nd in body.node_def if nd.input and ":" in nd.input[0]
                  and not nd.input[0].startswith("^"))
    reader.input[0] = reader.input[0].split(":")[0] + ":no_such_output:0"
    new, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert any(name in w and "left as it is" in w for w in report.warnings)
    assert _library(new)[name] == body
