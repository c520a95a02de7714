"""Step 8 of painting: what only feeds low precision follows it, so no run-time cast is needed.

An existing Cast whose readers are all painted casts to the target instead (``DstT``); a Const
read only in low precision is stored in the target (unless its values overflow float16); with
``lowp_io`` a Placeholder read only in low precision takes the target too.
"""

from __future__ import annotations

from ..core.ops import PLACEHOLDER_OPS
from ..schema import consts
from ..schema.opdefs import node_types
from .decisions import Decision
from .state import PaintState


def paint_feeders(s: PaintState) -> None:
    allow, blocked, fanout = s.allow, s.blocked, s.tg.fanout
    for idx, (name, attr) in enumerate(s.items):
        # all of a node's readers in low precision: then those of this item's outputs are
        # painted items it feeds (asked first: most items feed none)
        if idx in allow or idx in blocked or not any(b in allow for b in fanout[idx]):
            continue
        node = s.nodes[name]
        if not all(_reader_lowp(s, r, p) for r, p in s.graph.consumers(name)):
            continue
        if node.op == "Cast" and attr.attr == "DstT" and s.kernel_ok(idx):
            s.allow[idx] = Decision(True, "cast_retargeted", f"existing Cast feeds only "
                                    f"{s.tname} ops: it casts to {s.tname} instead")
        elif node.op == "Const" and attr.attr == "dtype":
            if consts.fits(node, s.target):
                s.allow[idx] = Decision(True, "const_converted", f"Const read only in {s.tname}: "
                                        f"stored as {s.tname}, no run-time cast")
            else:
                msg = (f"Const `{name}` holds values beyond float16's range (65504): kept "
                       f"float32; its run-time cast to {s.tname} overflows to inf")
                s.blocked[idx] = Decision(False, "const_overflow", msg)
                s.warnings.append(msg)
        elif s.lowp_io and node.op in PLACEHOLDER_OPS and s.kernel_ok(idx):
            s.allow[idx] = Decision(True, "lowp_io", f"graph input read only in {s.tname} (--lowp-io)")


def _reader_lowp(s: PaintState, reader: str, port: int) -> bool:
    """Whether input ``port`` of ``reader`` is governed by a painted item."""
    types = node_types(s.graph.node(reader))
    if types is None or port >= len(types.inputs) or types.inputs[port].attr is None:
        return False
    return s.tg.item(reader, types.inputs[port].attr) in s.allow
