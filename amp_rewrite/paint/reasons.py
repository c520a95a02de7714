"""The end of painting: a :class:`Decision` for every item, including those nothing painted.

An item no step decided gets the reason it stayed float32, most specific first: no kernel, a
deny op, reached by deny (with the chain), an infer or clear op with nothing to follow, or an
op on no list. Nodes without type attributes get a node-level code.
"""

from __future__ import annotations

import functools

from ..core.ops import MATRIX_OPS
from ..schema.opdefs import called_function, device_type, node_types
from .costs import graph_estimate, matrix_flops
from .decisions import Decision, Painting
from .state import PaintState


def record(s: PaintState) -> Painting:
    result = Painting(target=s.target, device=s.device, warnings=list(s.warnings),
                      unfused_kept=s.unfused_kept, batch_kept=list(s.batch_kept),
                      freezing=s.freezing.to_dict() if s.freezing.islands else {})
    for idx, key in enumerate(s.items):
        decided = s.allow.get(idx) or s.blocked.get(idx)
        result.decisions[key] = decided if decided is not None else why_not(s, idx)
    record_flops(s, result)
    for name, node in s.nodes.items():
        types = node_types(node)
        if called_function(node) is not None:
            result.node_codes[name] = _function_call(node.op)
        elif types is None:
            result.node_codes[name] = _unknown_op(node.op)
        elif not types.attrs:
            result.node_codes[name] = _NO_TYPE_ATTR
    return result


# The float32 reasons that name no node: one Decision (frozen, a value) per reason, shared by
# every item or node it is given to, rather than one made (and its text formatted) for each
# of the graph's 1e5 items.
_NO_TYPE_ATTR = Decision(False, "no_type_attr", "op has no type attribute to change")
_DENY_LIST = Decision(False, "deny_list", "deny op: unsafe in low precision")
_INFER_ALONE = Decision(False, "infer_alone", "infer op not on a path between allow ops")
_CLEAR_ALONE = Decision(False, "clear_alone", "clear op with no low-precision neighbour")


@functools.lru_cache(maxsize=None)
def _function_call(op: str) -> Decision:
    return Decision(False, "function_call", f"direct call of library function {op!r}: its "
                    "signature fixes its dtypes, so casts sit at the call")


@functools.lru_cache(maxsize=None)
def _unknown_op(op: str) -> Decision:
    return Decision(False, "unknown_op", f"op {op!r} is not registered with TensorFlow "
                    "(custom op or function): left as it is")


@functools.lru_cache(maxsize=None)
def _no_kernel(cat: str, tname: str, op: str, device: str) -> Decision:
    return Decision(False, "no_kernel", f"{cat} op, but TensorFlow has no {tname} kernel for "
                    f"{op} on {device}")


@functools.lru_cache(maxsize=None)
def _not_listed(op: str) -> Decision:
    return Decision(False, "not_listed", f"op {op} is on no list")


def record_flops(s: PaintState, result: Painting) -> None:
    """Each matrix op's FLOPs into ``result`` (what the report shows matrix work by, decided
    by nothing) and, where the cost model weighed islands, its estimate for the whole graph."""
    matrix = [name for name, node in s.nodes.items() if node.op in MATRIX_OPS]
    s.shapes.work_out(matrix)   # every shape they read, in one walk rather than one per op
    result.flops = {name: matrix_flops(s.graph, s.shapes, s.nodes[name]) for name in matrix}
    if s.weighed is not None:
        lowp = {name for name, _ in result.lowp}
        result.estimate = graph_estimate(result.flops, lowp, s.weighed, s.costs,
                                         {name: s.nodes[name].op for name in result.flops})


def why_not(s: PaintState, idx: int) -> Decision:
    """Why an item no step painted or blocked stays float32."""
    node = s.node_of(idx)
    cat = s.cat[idx]
    if cat in ("allow", "infer", "clear") and not s.kernel_ok(idx):
        return _no_kernel(cat, s.tname, node.op, device_type(node, s.device))
    if cat == "deny":
        return _DENY_LIST
    if idx in s.deny_parent:
        # the deny op and the neighbour deny came through; explain walks the path from there
        # (a chain per node would make the report quadratic in the depth of the graph)
        root, parent = s.items[s.deny_root[idx]][0], s.items[s.deny_parent[idx]][0]
        text = f"{cat} op, downstream of deny op {s.nodes[root].op} `{root}`"
        if parent != root:
            text += f", reached through `{parent}`"
        return Decision(False, "deny_propagated", text, (root,) if parent == root else (root, parent))
    if cat == "infer":
        return _INFER_ALONE
    if cat == "clear":
        return _CLEAR_ALONE
    return _not_listed(node.op)
