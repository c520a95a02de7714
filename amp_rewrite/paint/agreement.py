"""Step 7 of painting: items that must share one dtype are made to agree.

* A v1 loop's NextIteration and the Merges it feeds: a Cast cannot sit on a back edge.
* All TensorList ops of one list share an element dtype; list creators follow the others.
"""

from __future__ import annotations

from ..core.ops import FUNCTIONAL_OPS, MERGE_OPS, NEXT_ITERATION_OPS, PLACEHOLDER_OPS
from ..schema.opdefs import TypeAttr, called_function
from .decisions import Decision
from .state import PaintState
from .typegraph import ELEMENT_DTYPE

_T = TypeAttr("T")


def agree_loops(s: PaintState) -> None:
    """Where a NextIteration and its Merges disagree, all of them stay float32."""
    graph, tg = s.graph, s.tg
    for name in graph.names():
        if graph.node(name).op not in NEXT_ITERATION_OPS:
            continue
        group = [(name, _T)] + [(m, _T) for m, _ in graph.consumers(name)
                                if graph.node(m).op in MERGE_OPS]
        idxs = [i for i in (tg.item(*t) for t in group) if i is not None]
        outside = [i for i in idxs if i not in s.allow]
        if not outside or len(outside) == len(idxs):
            continue
        culprit = tg.items[outside[0]][0]
        for i in idxs:
            if i in s.allow:
                s.allow.pop(i)
                s.blocked[i] = Decision(False, "loop_match",
                                        f"loop back edge: NextIteration `{name}` and the Merge it "
                                        f"feeds share one dtype, and `{culprit}` stays float32",
                                        (culprit,))


def agree_tensorlists(s: PaintState) -> None:
    """All ops of one list share its element dtype, as grappler forces them: if one is painted
    and none is reached by deny or cannot be painted, and no handle crosses the graph's
    boundary, the whole list is painted; if one is painted but the list cannot follow, none is."""
    tg = s.tg
    for members, passed in tg.clusters:
        idxs = [i for i in (tg.item(m, ELEMENT_DTYPE) for m in members) if i is not None]
        painted = [i for i in idxs if i in s.allow]
        if not painted:
            continue   # nothing to agree on: each op keeps its own reason
        escape = next((n for n in passed if _boundary(s, n)), None)
        unsafe = next((i for i in idxs if i in s.deny_parent or s.cat[i] == "deny"
                       or (i not in s.allow and not s.free(i))), None)
        if escape is None and unsafe is None:
            source = tg.items[painted[0]][0]
            for i in idxs:
                if i not in s.allow:
                    s.allow[i] = Decision(True, "tensorlist_match", f"op of a TensorList whose "
                                          f"ops run in {s.tname}", (source,))
            continue
        if escape is not None:
            why = (f"the TensorList handle crosses the graph's boundary at `{escape}` "
                   f"({s.graph.node(escape).op})")
            via = (escape,)
        else:
            culprit = tg.items[unsafe][0]
            why = f"TensorList op `{culprit}` of the same list stays float32"
            via = (culprit,)
        for i in idxs:
            s.allow.pop(i, None)
            s.blocked[i] = Decision(False, "tensorlist_float32", why, via)


# where a TensorList handle leaves what this graph decides: other graphs' code reads the list
_SOURCE_SINK = frozenset({"_Arg", "_Retval", "OptionalFromValue", "OptionalGetValue"}) | PLACEHOLDER_OPS


def _boundary(s: PaintState, name: str) -> bool:
    """Whether a handle passing ``name`` leaves the graph: an input or output of the graph or a
    function, a call or functional control flow (grappler does not stop at While/If, whose
    bodies it paints apart: a list painted outside and not inside fails at run time)."""
    node = s.graph.node(name)
    return (node.op in _SOURCE_SINK or node.op in FUNCTIONAL_OPS or name in s.interface
            or called_function(node) is not None or not s.graph.consumers(name))
