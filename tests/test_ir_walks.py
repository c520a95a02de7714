"""The IR's one graph walk: descendants and ancestors, with control edges and stop nodes."""

import pytest
from test_ir import graph_def

from amp_rewrite.core.errors import IRError
from amp_rewrite.core.ir import Graph, postorder

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


def test_past_decides_which_reached_nodes_are_walked_past():
    g = diamond()
    relu_only = lambda node: node.op == "Relu"   # noqa: E731
    # d (AddV2) is a root: it is reached, but past says no, so nothing above it
    assert g.ancestors(["d"], control=False, past=relu_only) == {"d"}
    assert g.ancestors(["b", "c"], control=False, past=relu_only) == {"b", "c", "a", "x"}
    assert g.descendants(["a"], past=relu_only) == {"a", "b", "d"}   # d reached, not passed
    assert g.descendants(["x"], past=lambda node: node.op != "Relu") == {
        "x", "a", "c", "m", "n"}


def test_depth_bounds_the_edges_from_the_nearest_root_on_every_path():
    g = diamond()
    assert g.ancestors(["d"], control=False, depth=0) == {"d"}
    assert g.ancestors(["d"], control=False, depth=1) == {"d", "b", "c"}
    # x is two edges up through c and three through b: reached at two
    assert g.ancestors(["d"], control=False, depth=2) == {"d", "b", "c", "a", "x"}
    assert g.descendants(["x"], depth=1) == {"x", "a", "c", "m"}
    # a long chain is walked to its bound and no further
    nodes = [("n0", "Placeholder", [])] + [(f"n{i}", "Relu", [f"n{i - 1}"]) for i in range(1, 30)]
    chain = Graph.from_graph_def(graph_def(*nodes))
    assert chain.ancestors(["n29"], depth=12) == {f"n{i}" for i in range(17, 30)}


def test_origin_follows_input_0_through_the_ops_given():
    g = Graph.from_graph_def(graph_def(
        ("w", "Const", []), ("r1", "Identity", ["w"]), ("r2", "Identity", ["r1"]),
        ("k", "Const", []), ("sum", "AddN", ["r2", "k"]), ("y", "Relu", ["sum"]),
        ("loop_a", "Identity", ["loop_b"]), ("loop_b", "Identity", ["loop_a"])))
    assert g.origin("r2", {"Identity"}) == "w"
    assert g.origin("sum", {"Identity", "AddN"}) == "w"   # input 0 only, not k
    assert g.origin("sum", {"Identity"}) == "sum"          # not an op to pass through
    assert g.origin("y", {"Identity"}) == "y"
    assert g.origin("loop_a", {"Identity"}) in ("loop_a", "loop_b")   # ends where it closes
    with pytest.raises(IRError):
        g.origin("nope", {"Identity"})


def test_topological_order_among_some_nodes_orders_the_edges_between_them():
    g = diamond()
    # listing order x a b c d e m n; b before d, c before d, whatever else
    assert g.topological_order(among={"d", "c", "b"}) == ["b", "c", "d"]
    assert g.topological_order(among={"n", "m", "x"}) == ["x", "m", "n"]   # no back edge
    assert g.topological_order(among=set()) == []
    backwards = Graph.from_graph_def(graph_def(("y", "Relu", ["b"]), ("b", "Relu", ["a"]),
                                               ("a", "Placeholder", []), ("z", "Const", [])))
    assert backwards.topological_order(among={"y", "b", "a", "z"}) == ["a", "b", "y", "z"]
    assert g.topological_order(among=g.names()) == g.topological_order()
    with pytest.raises(IRError):
        g.topological_order(among={"nope"})


def test_postorder_finishes_each_name_after_its_inputs_once():
    inputs = {"d": ["b", "c"], "b": ["a"], "c": ["a"], "a": [], "e": ["d", "a"]}
    order = postorder(["e"], inputs.__getitem__)
    assert order == ["a", "b", "c", "d", "e"]
    assert postorder(["b", "e"], inputs.__getitem__) == ["a", "b", "c", "d", "e"]


def test_postorder_does_not_wait_for_a_back_edge():
    # m reads n, n reads m (a loop's back edge): the name reached first finishes last
    inputs = {"m": ["x", "n"], "n": ["m"], "x": []}
    assert postorder(["m"], inputs.__getitem__) == ["x", "n", "m"]
    assert postorder(["n"], inputs.__getitem__) == ["x", "m", "n"]


def test_postorder_walks_a_long_chain_without_recursion():
    n = 200_000
    order = postorder([f"t{n}"], lambda name: [f"t{int(name[1:]) - 1}"] if name != "t0" else [])
    assert order[0] == "t0" and order[-1] == f"t{n}" and len(order) == n + 1
