"""The IR primitives, one by one: what each promises, and IRError (never InputError) on misuse."""

import pytest
from tensorflow.core.framework import attr_value_pb2, graph_pb2, types_pb2

from amp_rewrite.core.errors import InputError, IRError
from amp_rewrite.core.ir import Graph, TensorRef

pytestmark = pytest.mark.fast

T = {"T": attr_value_pb2.AttrValue(type=types_pb2.DT_FLOAT)}


def graph_def(*nodes) -> graph_pb2.GraphDef:
    """``("name", "Op", ["input", ...])`` triples as a GraphDef."""
    gd = graph_pb2.GraphDef()
    for name, op, inputs in nodes:
        gd.node.add(name=name, op=op, input=inputs)
    return gd


def chain() -> Graph:
    #   x -> a -> b ;  x -> b:1 ; ^a -> c ; split:1 -> c
    return Graph.from_graph_def(graph_def(
        ("x", "Placeholder", []), ("split", "Split", []), ("a", "Relu", ["x"]),
        ("b", "AddV2", ["a", "x"]), ("c", "Identity", ["split:1", "^a"])))


# ----------------------------------------------------------------- import / export
def test_from_and_to_graph_def_round_trip_keeps_order_ports_and_control_inputs():
    gd = graph_def(("x", "Placeholder", []), ("s", "Split", []),
                   ("y", "AddV2", ["s:1", "x", "^x"]))
    assert Graph.from_graph_def(gd).to_graph_def() == gd


def test_to_graph_def_takes_versions_and_library_from_the_template():
    gd = graph_def(("x", "Placeholder", []))
    gd.versions.producer = 1234
    gd.library.function.add().signature.name = "f"
    out = Graph.from_graph_def(graph_def(("y", "Placeholder", []))).to_graph_def(gd)
    assert out.versions.producer == 1234 and out.library.function[0].signature.name == "f"
    assert [n.name for n in out.node] == ["y"]


@pytest.mark.parametrize("nodes", [
    [("x", "Placeholder", []), ("x", "Relu", [])],                 # a name used twice
    [("y", "Relu", ["missing"])],                                  # a dangling data input
    [("y", "NoOp", ["^missing"])],                                 # a dangling control input
    [("", "Relu", [])],                                            # no name
])
def test_a_graph_tensorflow_would_refuse_is_an_input_error(nodes):
    with pytest.raises(InputError):
        Graph.from_graph_def(graph_def(*nodes))


def test_tensor_ref_parses_ports_and_prints_port_zero_bare():
    assert TensorRef.parse("a/b:3") == TensorRef("a/b", 3)
    assert TensorRef.parse("a/b") == TensorRef("a/b", 0)
    assert str(TensorRef("a", 0)) == "a" and str(TensorRef("a", 2)) == "a:2"


# ----------------------------------------------------------------- queries
def test_queries_report_edges_by_port():
    g = chain()
    assert g.inputs("b") == [TensorRef("a"), TensorRef("x")]
    assert g.input("c", 0) == TensorRef("split", 1)
    assert g.control_inputs("c") == ["a"] and g.control_consumers("a") == ["c"]
    assert g.consumers("x") == [("a", 0), ("b", 1)]
    assert g.consumers("split", port=0) == [] and g.consumers("split", port=1) == [("c", 0)]
    assert g.out_edges("x") == [(0, "a", 0), (0, "b", 1)]
    assert list(g.data_edges()) == [(TensorRef("x"), "a", 0), (TensorRef("a"), "b", 0),
                                    (TensorRef("x"), "b", 1), (TensorRef("split", 1), "c", 0)]
    assert g.names() == ["x", "split", "a", "b", "c"] and len(g) == 5 and "a" in g


@pytest.mark.parametrize("query", [
    lambda g: g.node("nope"), lambda g: g.inputs("nope"), lambda g: g.input("b", 7),
    lambda g: g.input("nope", 0), lambda g: g.consumers("nope"), lambda g: g.control_inputs("nope"),
    lambda g: g.control_consumers("nope"), lambda g: g.out_edges("nope"),
])
def test_asking_for_what_is_not_there_is_an_ir_error(query):
    with pytest.raises(IRError):
        query(chain())


def test_topological_order_breaks_ties_by_file_order_and_skips_loop_back_edges():
    g = Graph.from_graph_def(graph_def(
        ("z", "Placeholder", []), ("a", "Placeholder", []),
        ("merge", "Merge", ["z", "next"]), ("body", "Relu", ["merge"]),
        ("next", "NextIteration", ["body"])))
    assert g.topological_order() == ["z", "a", "merge", "body", "next"]


@pytest.mark.parametrize("seed", range(20))
def test_topological_order_is_the_least_by_file_order_whether_or_not_the_file_is_sorted(seed):
    """Kahn's sort taking the earliest listed ready node, networkx's lexicographical sort
    keyed by file position, on random DAGs listed sorted (the listing is then the answer)
    and shuffled, with control edges and a loop back edge among them."""
    import random

    import networkx as nx

    rng = random.Random(seed)
    n = 40
    nodes = [(f"n{i}", "NextIteration" if i == n - 1 else "AddN",
              [f"n{j}" if rng.random() < 0.7 else f"^n{j}"
               for j in sorted(rng.sample(range(i), min(i, rng.randint(0, 3))))])
             for i in range(n)]
    nodes[0] = ("n0", "Placeholder", [])
    nodes[1] = ("n1", "Merge", ["n0", f"n{n - 1}"])   # the loop's back edge
    # sorted: every edge but the back edge runs forward; then the same nodes shuffled
    for listing in (nodes, rng.sample(nodes, n)):
        g = Graph.from_graph_def(graph_def(*listing))
        position = {name: i for i, (name, _, _) in enumerate(listing)}
        dag = nx.DiGraph()
        dag.add_nodes_from(position)
        dag.add_edges_from((src.lstrip("^"), name) for name, _, inputs in listing for src in inputs
                           if (src, name) != (f"n{n - 1}", "n1"))
        assert g.topological_order() == list(nx.lexicographical_topological_sort(dag, key=position.get))


def test_a_cycle_that_is_not_a_loop_is_an_input_error():
    g = Graph.from_graph_def(graph_def(("a", "Relu", ["b"]), ("b", "Relu", ["a"])))
    with pytest.raises(InputError):
        g.topological_order()


# ----------------------------------------------------------------- edits
def test_unique_name_counts_up_deterministically():
    g = chain()
    assert g.unique_name("new") == "new" and g.unique_name("a") == "a_1"
    g.add_node("Relu", "a", [TensorRef("x")])
    assert g.unique_name("a") == "a_2"


def test_add_node_wires_inputs_attrs_device_and_lists_it_after_a_node():
    g = chain()
    node = g.add_node("Relu", "a", [TensorRef("split", 1)], T, device="/CPU:0", after="x",
                      control_inputs=["b"])
    assert node.name == "a_1" and g.names()[:2] == ["x", "a_1"]
    assert g.inputs("a_1") == [TensorRef("split", 1)] and g.control_inputs("a_1") == ["b"]
    assert node.attr["T"].type == types_pb2.DT_FLOAT and node.device == "/CPU:0"


@pytest.mark.parametrize("kwargs", [
    {"inputs": [TensorRef("nope")]}, {"control_inputs": ["nope"]}, {"after": "nope"}])
def test_add_node_with_a_missing_neighbour_is_an_ir_error_and_changes_nothing(kwargs):
    g = chain()
    before = g.to_graph_def()
    with pytest.raises(IRError):
        g.add_node("Relu", "new", **kwargs)
    assert g.to_graph_def() == before


def test_control_edges_are_added_once_and_removed():
    g = chain()
    g.add_control_edge("x", "c")
    g.add_control_edge("x", "c")
    assert g.control_inputs("c") == ["a", "x"]
    g.remove_control_edge("x", "c")
    assert g.control_inputs("c") == ["a"]
    for src, dst in (("nope", "c"), ("x", "nope")):
        with pytest.raises(IRError):
            g.add_control_edge(src, dst)
    with pytest.raises(IRError):
        g.remove_control_edge("x", "c")


def test_set_input_append_input_and_replace_uses():
    g = chain()
    g.set_input("b", 1, TensorRef("split", 1))
    assert g.inputs("b") == [TensorRef("a"), TensorRef("split", 1)]
    assert g.append_input("b", TensorRef("x")) == 2 and g.inputs("b")[2] == TensorRef("x")
    assert g.replace_uses(TensorRef("x"), TensorRef("split", 0), exclude=["a"]) == 1
    assert g.consumers("x") == [("a", 0)] and ("b", 2) in g.consumers("split", 0)
    for edit in (lambda: g.set_input("b", 0, TensorRef("nope")),
                 lambda: g.set_input("b", 9, TensorRef("x")),
                 lambda: g.append_input("b", TensorRef("nope"))):
        with pytest.raises(IRError):
            edit()


def test_remove_node_only_when_nothing_reads_it():
    g = chain()
    with pytest.raises(IRError):
        g.remove_node("a")            # b reads it, c waits on it
    g.remove_node("c")
    g.remove_node("b")
    g.remove_node("a")
    assert g.names() == ["x", "split"] and g.consumers("x") == []
    with pytest.raises(IRError):
        g.remove_node("a")


def test_copy_is_independent_of_the_original():
    g = chain()
    g.node("a").meta["mark"] = 1
    c = g.copy()
    c.node("a").meta["mark"] = 2
    c.node("a").attr["T"].type = types_pb2.DT_HALF
    c.set_input("b", 0, TensorRef("x"))
    c.add_node("Relu", "new", [TensorRef("x")])
    assert g.node("a").meta["mark"] == 1 and "T" not in g.node("a").attr
    assert g.inputs("b")[0] == TensorRef("a") and "new" not in g
    assert c.to_graph_def() != g.to_graph_def()


def test_a_name_freed_by_remove_node_is_a_new_node_in_the_graph_and_its_copies():
    # every NodeDef lives in the graph's one store, a removed one too: a later node of the same
    # name must be the new NodeDef, in the graph and in a copy
    g = chain()
    g.remove_node("c")
    g.add_node("Relu", "c", [TensorRef("b")], attrs=T)
    for graph in (g, g.copy()):
        assert graph.node("c").op == "Relu" and graph.inputs("c") == [TensorRef("b")]
        assert [(n.name, n.op) for n in graph.to_graph_def().node][-1] == ("c", "Relu")


def test_to_graph_def_into_replaces_what_it_held_and_the_input_is_not_changed():
    gd = graph_def(("x", "Placeholder", []), ("y", "Relu", ["x"]))
    gd.version = 7
    before = gd.SerializeToString()
    g = Graph.from_graph_def(gd)
    g.node("y").attr["T"].type = types_pb2.DT_HALF
    into = graph_def(("old", "NoOp", []))
    out = g.to_graph_def(gd, into=into)
    assert out is into and [n.name for n in out.node] == ["x", "y"] and out.version == 7
    assert gd.SerializeToString() == before
