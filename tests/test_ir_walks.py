"""The IR's one graph walk: descendants and ancestors, with control edges and stop nodes."""

import pytest
from test_ir import graph_def

from amp_rewrite.core.errors import IRError
from amp_rewrite.core.ir import Graph

pytestmark = pytest.mark.fast


def diamond() -> Graph:
    #   x -> a -> b -> d ; x -> c -> d ; ^a -> e ; NextIteration n -> m (a back edge) -> n
    return Graph.from_graph_def(graph_def(
        ("x", "Placeholder", []), ("a", "Relu", ["x"]), ("b", "Relu", ["a"]),
        ("c", "Relu", ["x"]), ("d", "AddV2", ["b", "c"]), ("e", "NoOp", ["^a"]),
        ("m", "Merge", ["x", "n"]), ("n", "NextIteration", ["m"])))


def test_descendants_follow_data_edges_and_control_edges_when_asked():
    g = diamond()
    assert g.descendants(["a"]) == {"a", "b", "d"}
    assert g.descendants(["a"], control=True) == {"a", "b", "d", "e"}
    assert g.descendants(["x"]) == {"x", "a", "b", "c", "d", "m", "n"}


def test_ancestors_follow_control_edges_unless_told_not_to():
    g = diamond()
    assert g.ancestors(["e"]) == {"e", "a", "x"}
    assert g.ancestors(["e"], control=False) == {"e"}
    assert g.ancestors(["d"]) == {"d", "b", "c", "a", "x"}


def test_a_stop_node_is_reached_but_not_walked_past():
    g = diamond()
    assert g.descendants(["x"], stop={"a"}) == {"x", "a", "c", "d", "m", "n"}
    assert g.ancestors(["d"], stop={"b", "c"}) == {"d", "b", "c"}


def test_walks_end_on_cycles_and_take_several_roots():
    g = diamond()
    assert g.descendants(["n"]) == {"n", "m"}      # the loop's back edge, walked once
    assert g.ancestors(["b", "c"]) == {"b", "c", "a", "x"}
    assert g.descendants([]) == set()


def test_walking_from_a_missing_node_is_our_bug():
    with pytest.raises(IRError):
        diamond().descendants(["nope"])


def test_a_long_chain_walks_without_recursion():
    n = 5_000   # far past Python's recursion limit
    nodes = [("n0", "Placeholder", [])] + [(f"n{i}", "Relu", [f"n{i - 1}"]) for i in range(1, n)]
    g = Graph.from_graph_def(graph_def(*nodes))
    assert len(g.descendants(["n0"])) == n and len(g.ancestors([f"n{n - 1}"])) == n


def test_only_feeding_takes_the_nodes_whose_every_reader_is_taken():
    #   v -> init (a root) ; v -> read -> out ; c -> init ; c2 -> init, ^c2 -> out
    g = Graph.from_graph_def(graph_def(
        ("v", "VariableV2", []), ("c", "Const", []), ("c2", "Const", []),
        ("init", "Assign", ["v", "c", "c2"]), ("read", "Identity", ["v"]),
        ("out", "Relu", ["read", "^c2"]), ("lone", "Const", [])))
    # v is read by the model too; c2 waits on a control reader outside; lone is read by nothing
    assert g.only_feeding(["init"]) == {"init", "c"}
    assert g.only_feeding(["init", "out"]) == {"init", "out", "c", "c2", "read", "v"}
    assert g.only_feeding([]) == set()


def test_only_feeding_ends_on_a_loop_that_feeds_only_itself():
    g = diamond()
    # m and n read each other: neither joins unless a root sits inside the loop
    assert g.only_feeding(["d", "e"]) == {"d", "e", "b", "c", "a"}
    assert g.only_feeding(["n"]) == {"n", "m"}
    assert g.only_feeding(["n", "d", "e"]) == {"n", "d", "e", "b", "c", "a", "m", "x"}
    with pytest.raises(IRError):
        g.only_feeding(["nope"])
