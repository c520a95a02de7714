"""Step 8 of painting: what only feeds low precision follows it, so no run-time cast is needed.

An existing Cast whose readers are all painted casts to the target instead (``DstT``); a Const
read only in low precision is stored in the target (unless its values overflow float16), and so
is a variable ``--freeze`` keeps (its stand-in, :data:`~amp_rewrite.core.ops.STORED_VARIABLE`);
with ``lowp_io`` a Placeholder read only in low precision takes the target too.
"""

from __future__ import annotations

from ..core.dtypes import HALF, LARGEST
from ..core.ops import PLACEHOLDER_OPS, STORED_VARIABLE
from ..schema import consts
from ..schema.opdefs import node_types
from .decisions import Decision
from .state import PaintState


def paint_feeders(s: PaintState) -> None:
    allow, blocked, fanout = s.allow, s.blocked, s.tg.fanout
    stand_ins = {name for name, node in s.nodes.items()
                 if node.op == "Placeholder" and STORED_VARIABLE in node.attr}
    for idx, (name, attr) in enumerate(s.items):
        if idx in allow or idx in blocked:
            continue
        # all of a node's readers in low precision: then those of this item's outputs are
        # painted items it feeds (asked first: most items feed none)
        if not any(b in allow for b in fanout[idx]) or not all(
                _reader_lowp(s, r, p) for r, p in s.graph.consumers(name)):
            if name in stand_ins and attr.attr == "dtype":
                s.blocked[idx] = Decision(False, "variable", "variable --freeze keeps (too "
                                          "large for a Const), read in float32: stored as "
                                          "float32")
            continue
        node = s.nodes[name]
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
        elif STORED_VARIABLE in node.attr and attr.attr == "dtype" and s.kernel_ok(idx):
            _store_variable(s, idx, name)
        elif s.lowp_io and node.op in PLACEHOLDER_OPS and s.kernel_ok(idx):
            s.allow[idx] = Decision(True, "lowp_io", f"graph input read only in {s.tname} (--lowp-io)")


def _store_variable(s: PaintState, idx: int, name: str) -> None:
    """A variable --freeze keeps, read only in low precision: stored in it, as a Const would
    be, unless its values (their largest finite magnitude, negative where not measured) pass
    float16's range."""
    largest = s.nodes[name].attr[STORED_VARIABLE].f
    if s.target != HALF or 0 <= largest <= LARGEST[HALF]:
        s.allow[idx] = Decision(True, "variable_stored", f"variable --freeze keeps (too large "
                                f"for a Const) read only in {s.tname}: stored as {s.tname}, "
                                "no run-time cast")
        return
    msg = (f"variable `{name}` (kept by --freeze) holds values beyond float16's range (65504)"
           f"{'' if largest >= 0 else ' or was not measured'}: kept float32; its run-time cast "
           f"to {s.tname} overflows to inf")
    s.blocked[idx] = Decision(False, "const_overflow", msg)
    s.warnings.append(msg)


def _reader_lowp(s: PaintState, reader: str, port: int) -> bool:
    """Whether input ``port`` of ``reader`` is governed by a painted item."""
    types = node_types(s.graph.node(reader))
    if types is None or port >= len(types.inputs) or types.inputs[port].attr is None:
        return False
    return s.tg.item(reader, types.inputs[port].attr) in s.allow
