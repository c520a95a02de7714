"""The lint's comparisons with the graph before conversion (a :class:`Before` record): each
catches the fault it names, and a graph left as it was passes."""

import pytest
from tensorflow.core.framework import attr_value_pb2, graph_pb2, types_pb2

from amp_rewrite.check import lint
from amp_rewrite.core.ir import Graph, TensorRef
from amp_rewrite.paint import Painting
from amp_rewrite.report.decisions import build_report
from amp_rewrite.rules.loader import load_rules
from amp_rewrite.schema.opdefs import TypeAttr
from amp_rewrite.schema.snapshot import Before

pytestmark = pytest.mark.fast

FLOAT, HALF = types_pb2.DT_FLOAT, types_pb2.DT_HALF


def typed(dtype) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def graph() -> Graph:
    gd = graph_pb2.GraphDef()
    gd.node.add(name="x", op="Placeholder").attr["dtype"].CopyFrom(typed(FLOAT))
    gd.node.add(name="w", op="VarHandleOp").attr["dtype"].CopyFrom(typed(FLOAT))
    gd.node.add(name="e", op="Exp", input=["x"]).attr["T"].CopyFrom(typed(FLOAT))
    gd.node.add(name="custom", op="NotARegisteredOp", input=["e"])
    return Graph.from_graph_def(gd)


def test_an_unchanged_graph_passes():
    g = graph()
    assert lint.lint_problems(g, original=Before(g), rules=load_rules("float16")) == []


def test_a_variable_whose_dtype_changed_is_caught():
    g = graph()
    before = Before(g)
    g.node("w").attr["dtype"].type = HALF
    assert lint.lint_problems(g, original=before) == [
        "variable op 'w' (VarHandleOp) changed dtype from float to half"]


def test_a_deny_op_moved_to_low_precision_is_caught_unless_it_was_already():
    g = graph()
    before = Before(g)
    g.node("e").attr["T"].type = HALF
    g.node("x").attr["dtype"].type = HALF
    rules = load_rules("float16")
    assert "deny op 'e' (Exp) runs in half" in lint.lint_problems(g, original=before, rules=rules)
    assert lint.lint_problems(g, original=Before(g), rules=rules) == []   # it was float16 before


def test_an_unregistered_op_fed_another_dtype_is_caught():
    g = graph()
    before = Before(g)
    attrs = {"SrcT": typed(FLOAT), "DstT": typed(HALF)}
    g.add_node("Cast", "to_half", [TensorRef("e")], attrs=attrs)
    g.set_input("custom", 0, TensorRef("to_half"))
    assert lint.lint_problems(g, original=before) == [
        "edge to_half -> 'custom':0 of an unregistered op carried float and now carries half"]


def test_the_report_shows_a_removed_node_as_it_was():
    g = graph()
    before = Before(g)
    g.remove_node("custom")
    g.remove_node("e")
    report = build_report(g, before, Painting(target=HALF, device="GPU"), target="float16",
                          device="GPU", rules=load_rules("float16"))
    e = next(n for n in report.nodes if n.name == "e")
    assert (e.op, e.precision, e.attrs) == ("Exp", "float32", {"T": "float"})
    assert before.dtype("e", TypeAttr("T")) == FLOAT and "e" in before and "gone" not in before


def test_the_report_warns_of_unregistered_ops_and_of_an_input_already_16bit():
    from amp_rewrite import convert
    gd = graph_pb2.GraphDef()
    gd.node.add(name="x", op="Placeholder").attr["dtype"].CopyFrom(typed(FLOAT))
    cast = gd.node.add(name="h", op="Cast", input=["x"])
    cast.attr["SrcT"].CopyFrom(typed(FLOAT))
    cast.attr["DstT"].CopyFrom(typed(HALF))
    gd.node.add(name="custom", op="NotARegisteredOp", input=["h"])
    _, report = convert(gd)
    assert "ops not registered with TensorFlow left as they are: NotARegisteredOp" in report.warnings
    assert ("the input already has 1 low-precision nodes (e.g. 'h'); they are left as they are"
            in report.warnings)


def test_a_cast_on_a_loop_back_edge_is_caught(monkeypatch):
    """Painting's loop agreement keeps a NextIteration and its Merges in one dtype; without it
    a cast lands on the back edge, which the lint must refuse as our bug."""
    import grappler_graphs as gg

    from amp_rewrite import convert, paint
    from amp_rewrite.core.errors import LintError
    graph_def, _ = gg.simple_loop("b", "gwc", "c")
    _, report = convert(graph_def, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert any(n.code == "loop_match" for n in report.nodes)   # agreement is what it takes
    monkeypatch.setattr(paint, "agree_loops", lambda state: None)
    with pytest.raises(LintError, match="loop back edge"):
        convert(graph_def, target="bfloat16", device="cpu", min_matrix_intensity=0)
