"""Step 7 of painting: items that must share one dtype are made to agree.

* A v1 loop's NextIteration and the Merges it feeds: a Cast cannot sit on a back edge.
* All TensorList ops of one list share an element dtype; list creators follow the others.
"""

from __future__ import annotations

from ..ops import MERGE_OPS, NEXT_ITERATION_OPS
from ..signatures import TypeAttr, node_types
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
        idxs = [tg.index[t] for t in group if t in tg.index]
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
    """A list whose ops are all painted (and whose handle does not escape) paints its
    creators too; any other list keeps every op float32."""
    tg = s.tg
    for members, escapes in tg.clusters:
        idxs = [tg.index[(m, ELEMENT_DTYPE)] for m in members if (m, ELEMENT_DTYPE) in tg.index]
        if not idxs:
            continue
        creators = [i for i in idxs if not _has_element_port(s, i)]
        others = [i for i in idxs if i not in creators]
        if (not escapes and others and all(i in s.allow for i in others)
                and all(s.free(i) for i in creators)):
            for i in creators:
                s.allow[i] = Decision(True, "tensorlist_match",
                                      f"creates a TensorList whose elements are {s.tname}",
                                      (tg.items[others[0]][0],))
            continue
        if escapes:
            why = "the TensorList handle leaves through an op that is not a TensorList op"
        else:
            out = [tg.items[i][0] for i in others if i not in s.allow] or [tg.items[idxs[0]][0]]
            why = f"TensorList op `{out[0]}` of the same list stays float32"
        for i in idxs:
            s.allow.pop(i, None)
            s.blocked[i] = Decision(False, "tensorlist_float32", why)


def _has_element_port(s: PaintState, idx: int) -> bool:
    types = node_types(s.node_of(idx))
    return any(p.attr == ELEMENT_DTYPE for p in types.inputs + types.outputs)
