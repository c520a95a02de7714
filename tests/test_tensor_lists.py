"""TensorLists are painted whole or kept float32 whole, as grappler paints them: its own list
cases (auto_mixed_precision_test.cc: TensorListPushPop, TensorListPushBackBatchAndConcatLists,
TensorListThroughFunction), the same list through a ``tf.function`` call, and the
EmptyTensorList accumulators of a TF2 while loop's gradient, frozen with the loop lowered (as
grappler sees it at run time) and functional (the bodies are library functions). Every
converted graph runs. And float16 emulation leaves no float32-to-float32 Cast (grappler's
MixedFanout case)."""

import functools

import graphs
import grappler_graphs as gg
import numpy as np
import pytest
import tensorflow as tf
from machine import needs_onednn
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework.function_def_to_graph import function_def_to_graph
from tensorflow.python.grappler import tf_optimizer

from amp_rewrite import convert, convert_file
from amp_rewrite.transforms.constfold import grappler_alone

v1 = tf.compat.v1
FLOAT = types_pb2.DT_FLOAT
LOWP = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}
DEVICE = {"float16": "gpu", "bfloat16": "cpu"}
GRAPPLER = {"float16": gg.grappler_float16, "bfloat16": gg.grappler_bfloat16}
# relative L2 error against FP32 a low-precision run stays under (16x16 products of O(1) values)
TOL = {"float16": 5e-3, "bfloat16": 3e-2}

CASES = {
    "push_pop": gg.tensorlist_push_pop,
    "batch_concat": gg.tensorlist_batch_concat,
    "through_function": gg.tensorlist_through_function,
    "through_call": lambda: gg.tensorlist_through_function("partitioned"),
    "loop_gradient": gg.tensorlist_loop_gradient,
    "loop_gradient_functional": lambda: gg.tensorlist_loop_gradient(lower=False),
}
ALL, NONE = "every list op", "no list op"
# the graph's own list ops that run in low precision: grappler's tests say so for its three
# cases (tl1 through the function is not asserted there; grappler keeps it float32, as the
# parity test below checks); a lowered loop's accumulator is one list in one graph; a
# functional loop's crosses the While into the bodies and stays float32
PAINTED = {
    "push_pop": {"tl1", "tl1w1", "tl1w2", "tl1r1", "tl1w3", "tl1r2"},
    "batch_concat": {"tl1", "tl2", "tl12w1", "tl3", "tl3r1"},
    "through_function": {"tl2", "tl2w1", "tl2r1"},
    "through_call": {"tl2", "tl2w1", "tl2r1"},
    "loop_gradient": ALL,
    "loop_gradient_functional": NONE,
}
TARGETS = ["float16", "bfloat16"]


@functools.cache
def _case(case):
    graph_def, feeds = CASES[case]()
    fetches = [n.name for n in graph_def.node if n.name in ("output", "output2", "grad_output")]
    return graph_def, feeds, fetches


@functools.cache
def _converted(case, target):
    graph_def, _, fetches = _case(case)
    return convert(graph_def, target=target, device=DEVICE[target], keep=fetches,
                   min_matrix_intensity=0)   # 16x16 MatMuls: painted as grappler paints them


def _list_ops(graph_def):
    """``(function or "", node) -> element_dtype`` of every TensorList op with one."""
    out = {("", n.name): n.attr["element_dtype"].type for n in graph_def.node
           if "TensorList" in n.op and "element_dtype" in n.attr}
    for fdef in graph_def.library.function:
        out.update(((fdef.signature.name, n.name), n.attr["element_dtype"].type)
                   for n in fdef.node_def if "TensorList" in n.op and "element_dtype" in n.attr)
    return out


def _list_groups(graph_def):
    """The TensorList ops grouped by where their handles flow, read from TensorFlow's own
    import of the graph and of each library function: DT_VARIANT tensors are joined through
    each op that reads and makes them, through a call into its callee's arguments and out of
    its results, and through a While (input k, cond and body argument k, body result k,
    output k). Each group: ``{(function or "", node): element_dtype}``."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    bodies = {f.signature.name: function_def_to_graph(f) for f in graph_def.library.function}
    parent = {}

    def find(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    def union(a, b):
        parent[find(a)] = find(b)

    lists = {}
    for where, graph in [("", g)] + list(bodies.items()):
        for op in graph.get_operations():
            def key(t, where=where):
                return (where, t.name)

            variants = [t for t in list(op.inputs) + op.outputs if t.dtype == tf.variant]
            if "TensorList" in op.type and "element_dtype" in op.node_def.attr:
                lists[(where, op.name)] = (op.get_attr("element_dtype"), key(variants[0]))
            if op.type in ("While", "StatelessWhile"):
                body, cond = op.get_attr("body").name, op.get_attr("cond").name
                for k, t in enumerate(op.inputs):
                    if t.dtype == tf.variant:
                        for other in [key(op.outputs[k]), (body, bodies[body].inputs[k].name),
                                      (body, bodies[body].outputs[k].name),
                                      (cond, bodies[cond].inputs[k].name)]:
                            union(key(t), other)
                continue
            callee = op.get_attr("f").name if op.type.endswith("PartitionedCall") else op.type
            if callee in bodies:
                for mine, theirs in [(op.inputs, bodies[callee].inputs),
                                     (op.outputs, bodies[callee].outputs)]:
                    for t, arg in zip(mine, theirs):
                        if t.dtype == tf.variant:
                            union(key(t), (callee, arg.name))
                continue
            for t in variants:   # every other op passes its handles on (If/Case: none here)
                union(key(variants[0]), key(t))
    groups = {}
    for name, (dtype, handle) in lists.items():
        groups.setdefault(find(handle), {})[name] = dtype.as_datatype_enum
    return list(groups.values())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_lists_are_painted_as_grapplers_tests_expect(case, target):
    ours = _list_ops(_converted(case, target)[0])
    graph_ops = {node: dtype for (where, node), dtype in ours.items() if where == ""}
    assert graph_ops
    painted = PAINTED[case]
    want = set(graph_ops) if painted is ALL else set() if painted is NONE else painted
    assert {n for n, d in graph_ops.items() if d == LOWP[target]} == want
    assert {n for n, d in graph_ops.items() if d == FLOAT} == set(graph_ops) - want
    # inside a function the list came in as an argument: float32, as the caller's side
    assert all(d == FLOAT for (where, _), d in ours.items() if where)


@pytest.mark.parametrize("target", [pytest.param("bfloat16", marks=needs_onednn), "float16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_list_ops_hold_the_element_dtype_grappler_gives_them(case, target):
    """grappler's pass on the same graph (its function bodies included): the same dtypes."""
    graph_def, _, fetches = _case(case)
    theirs = _list_ops(GRAPPLER[target](graph_def, fetches))
    ours = _list_ops(_converted(case, target)[0])
    shared = set(theirs) & set(ours)
    assert {n for n in ours if n[0] == ""} <= shared   # the graph's own ops, at least
    assert {n: ours[n] for n in shared} == {n: theirs[n] for n in shared}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_list_keeps_one_element_dtype_across_functions_and_loops(case, target):
    converted, _ = _converted(case, target)
    groups = _list_groups(converted)
    assert groups
    for group in groups:
        assert len(set(group.values())) == 1, group
    if case.startswith("through") or case == "loop_gradient_functional":
        # the handle flow was followed into the callee: a group spans the graph and a function
        assert any(len({where for where, _ in group}) > 1 for group in groups)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_lists_run_close_to_fp32(case, target):
    graph_def, feeds, fetches = _case(case)
    tensors = [f + ":0" for f in fetches]
    ref = graphs.run(graph_def, feeds, tensors)
    out = graphs.run(_converted(case, target)[0], feeds, tensors)
    errors = [graphs.rel_l2(o, r) for o, r in zip(out, ref)]
    assert all(e < TOL[target] for e in errors), errors
    assert errors[0] > 0   # the first output is computed in low precision, not left float32


@pytest.mark.parametrize("keep", ["tl1r1", "tl1"])
def test_a_list_op_kept_float32_keeps_its_whole_list_float32(keep):
    """A pop, or the creator itself, kept float32 (--keep): every op of that list follows,
    the MatMuls around it are still painted, and the graph runs."""
    graph_def, feeds, fetches = _case("push_pop")
    converted, report = convert(graph_def, target="float16", device="gpu",
                                keep=fetches + [keep], min_matrix_intensity=0)
    ops = {node: d for (where, node), d in _list_ops(converted).items()}
    assert all(d == FLOAT for d in ops.values())
    others = PAINTED["push_pop"] - {keep}
    assert {report.node(n).code for n in others} == {"tensorlist_float32"}
    assert all(keep in report.node(n).reason for n in others)
    nodes = {n.name: n for n in converted.node}
    assert nodes["allow1"].attr["T"].type == nodes["allow2"].attr["T"].type == LOWP["float16"]
    ref, out = (graphs.run(g, feeds, ["output:0"])[0] for g in (graph_def, converted))
    assert 0 < graphs.rel_l2(out, ref) < TOL["float16"]


# ------------------------------------------------------------------ float16 emulation
def _mixed_fanout():
    """grappler's MixedFanout: allow1 feeds an allow op (allow2) and a deny op (Exp). Here
    input2 comes from a Cast of int32 values, so an existing Cast is retargeted too."""
    g = tf.Graph()
    with g.as_default():
        input1 = tf.constant(np.full((32, 32), 1 / 32, np.float32), name="input1")
        input2 = tf.cast(tf.constant(np.full((32, 32), 2, np.int32)), tf.float32,
                         name="input2") / 32
        allow1 = tf.matmul(input1, input2, name="allow1")
        allow2 = tf.matmul(allow1, input2, name="allow2")
        deny = tf.exp(allow1, name="deny")
        tf.identity(tf.add(deny, allow2, name="infer"), name="fetch")
    return g.as_graph_def()


def _graph_def(path):
    gd = v1.GraphDef()
    gd.ParseFromString(path.read_bytes())
    return gd


def _same_type_casts(graph_def):
    """The Casts from a dtype to itself, in the graph and in its functions."""
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return [n.name for n in nodes if n.op == "Cast" and n.attr["SrcT"].type == n.attr["DstT"].type]


def _half_to_float_casts(graph_def):
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return [n.name for n in nodes if n.op == "Cast"
            and (n.attr["SrcT"].type, n.attr["DstT"].type) == (types_pb2.DT_HALF, FLOAT)]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lists_emulated")
    out = {}
    for name, graph_def in [("mixed_fanout", _mixed_fanout()),
                            ("push_pop", _case("push_pop")[0]),
                            ("loop_gradient_functional", _case("loop_gradient_functional")[0])]:
        (folder / f"{name}.pb").write_bytes(graph_def.SerializeToString())
        convert_file(folder / f"{name}.pb", folder / f"{name}_f16.pb", target="float16",
                     min_matrix_intensity=0)
        convert_file(folder / f"{name}.pb", folder / f"{name}_emu.pb", target="float16",
                     min_matrix_intensity=0, emulate=True)
        out[name] = (graph_def, _graph_def(folder / f"{name}_f16.pb"),
                     _graph_def(folder / f"{name}_emu.pb"))
    return out


def test_emulation_leaves_no_float32_to_float32_cast(emulated):
    graph_def, half, emu = emulated["mixed_fanout"]
    # the float16 file has half-to-float Casts (deny and infer read allow1 and allow2 through
    # them), and a retargeted int32-to-half one: emulation keeps none of them float-to-float
    assert _half_to_float_casts(half)
    assert not _same_type_casts(emu)
    nodes = {n.name: n for n in emu.node}
    for name in ("allow1", "allow2"):   # float32 MatMuls on values rounded to float16
        assert nodes[name].attr["T"].type == FLOAT
        for src in (i.split(":")[0] for i in nodes[name].input):
            assert nodes[src].op == "Cast"
            src_dst = (nodes[src].attr["SrcT"].type, nodes[src].attr["DstT"].type)
            assert src_dst == (types_pb2.DT_HALF, FLOAT)
    # the numbers of grappler's own float16 emulation (auto_mixed_precision_cpu)
    meta = meta_graph_pb2.MetaGraphDef(graph_def=graph_def)
    meta.collection_def["train_op"].node_list.value.append("fetch")
    theirs = tf_optimizer.OptimizeGraph(grappler_alone("auto_mixed_precision_cpu"), meta)
    ours, ref = (graphs.run(g, {}, ["fetch:0"])[0] for g in (emu, theirs))
    assert graphs.rel_l2(ours, ref) <= 1e-6


@pytest.mark.parametrize("case", ["push_pop", "loop_gradient_functional"])
def test_emulated_lists_compute_in_float32_whole_and_run(emulated, case):
    """A list in the graph, and the accumulators a functional loop's bodies push and pop
    (emulated in the function bodies, whose half-to-float Casts go too)."""
    graph_def, half, emu = emulated[case]
    assert _half_to_float_casts(half) and not _same_type_casts(emu)
    if case == "push_pop":   # the float16 file's list is float16, the emulation's float32
        assert LOWP["float16"] in _list_ops(half).values()
    assert all(d == FLOAT for d in _list_ops(emu).values())
    _, feeds, fetches = _case(case)
    tensors = [f + ":0" for f in fetches]
    ref, real, ours = (graphs.run(g, feeds, tensors)[0] for g in (graph_def, half, emu))
    assert 0 < graphs.rel_l2(real, ref) < TOL["float16"]
    assert graphs.rel_l2(ours, real) <= max(graphs.rel_l2(real, ref), 1e-6)
