"""A graph that computes in a 16-bit dtype, moved back to float32 before it is painted.

A model trained under Keras's ``mixed_float16`` policy keeps its variables in float32 and reads
each through a Cast to float16; a model converted before holds its ops in 16 bits. To serve it
where that dtype does not pay (bfloat16 on a CPU, or float32: ``--target float32``), every type
attribute that holds one of the dtypes to widen moves to float32 first, so painting then starts
from a float32 graph as from an FP32 original (docs/convert.md "Converting a converted model").

Promises of :func:`widen`:

* every (node, type attribute) holding a widened dtype goes to float32, but those whose dtype
  is not the graph's to change, each recorded with why (:attr:`Widening.kept`): the interface
  (placeholders, signature tensors, function arguments and results, ``--keep`` names; a node
  nothing reads is a float32 output once widened, and painting keeps it so), variable ops and whatever holds state, calls and loops (their callees'
  signatures fix their dtypes; the caller widens those of functions it may change:
  :func:`~amp_rewrite.conversion.widening.widen_boundaries`), ops that reinterpret bytes, ops
  TensorFlow has no float32 kernel or does not register;
* TensorList ops widen like any other: every one of the model that holds a widened element
  dtype does, in every graph and function, so the ops of one list, whose handle may cross
  calls and loops, agree again;
* a Cast the model put between float32 and the widened dtype casts nothing once both its ends
  are float32: its readers read its input, so a float32 variable's value reaches them unrounded,
  and it is removed (kept, casting float32 to float32, only where a control edge leaves it);
  a Cast's source follows what feeds it, and its destination widens when any reader does;
* a Const stored in a widened dtype holds the same values in float32 (the input's rounding
  stays in them: :attr:`Widening.consts` names them);
* where a widened node meets one that keeps its 16-bit dtype, one Cast per (tensor, dtype)
  sits between them (:func:`~amp_rewrite.transforms.casts.cast_edges`), from the float32 value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

from ..core.dtypes import FLOAT
from ..core.ir import Graph, TensorRef
from ..core.ops import FUNCTIONAL_OPS
from ..paint.state import holds_state, interface_names
from ..schema import consts
from ..schema.opdefs import (
    TypeAttr,
    device_type,
    get_dtype,
    kernel_supports,
    node_types,
    set_dtype,
)
from ..schema.snapshot import Before
from .casts import CastStats, cast_edges

#: ops whose type attribute says how to read bytes: in float32 they would read other values
REINTERPRETING_OPS = frozenset({"Bitcast", "DecodeRaw", "DecodePaddedRaw", "ParseTensor"})
_SRC, _DST = TypeAttr("SrcT"), TypeAttr("DstT")


@dataclass
class Widening:
    """What :func:`widen` did to one graph: which (node, type attribute) it moved to float32
    and from which dtype, the input's Casts it removed (with the dtypes they held), the Consts
    whose values were stored in 16 bits, the nodes it left in 16 bits with what they are (the
    interface, state ...), the Casts it added, and what a lint of the result looks at."""

    lifted: dict[str, dict[TypeAttr, int]] = field(default_factory=dict)
    removed: dict[str, dict[TypeAttr, int]] = field(default_factory=dict)
    consts: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    casts_added: list[str] = field(default_factory=list)
    # the nodes retyped, added or rewired, and their readers: what the lint looks at
    touched: set[str] = field(default_factory=set)


def widen(graph: Graph, dtypes: Collection[int], *, keep: Mapping[str, tuple[str, str]],
          device: str, retyped: Mapping[str, Mapping[TypeAttr, int]] = {}) -> Widening:
    """Move ``graph``'s type attributes that hold one of ``dtypes`` to float32, in place (see
    the module doc); ``keep`` maps the nodes whose dtypes must not change to ``(code,
    reason)``, as painting takes it, and ``device`` is the device type unplaced nodes run on
    (which kernels exist). ``retyped``: the calls and loops whose types the caller widened
    with their callees' signatures (type attribute -> the dtype it held; empty for a direct
    call), recorded with the rest, their edges cast where they now disagree. The caller lints
    the result (:attr:`Widening.touched`) against the graph it was."""
    before = Before(graph)
    result = Widening()
    plan = _plan(graph, frozenset(dtypes), keep, device, result, retyped)
    stats = CastStats(touched=set(retyped))
    for name, attrs in plan.items():
        node = graph.node(name)
        for attr in attrs:
            set_dtype(node, attr, FLOAT)
        if node.op == "Const" and TypeAttr("dtype") in attrs:
            consts.widen(node)
            result.consts.append(name)
        stats.touched.add(name)
    result.lifted = plan
    _bypass_identity_casts(graph, plan, before, result, stats)
    cast_edges(graph, before, set(), stats)
    result.casts_added = list(stats.added)
    result.touched = stats.touched_and_readers(graph)
    return result


def _plan(graph: Graph, dtypes: frozenset[int], keep: Mapping[str, tuple[str, str]],
          device: str, result: Widening, retyped) -> dict[str, dict[TypeAttr, int]]:
    """Which type attributes go to float32, node by node, with the dtype each held (the calls
    ``retyped`` already did, with theirs); those that hold a widened dtype and stay are
    recorded in ``result.kept``. Casts are decided last: a Cast's destination once its readers
    are, its source once what feeds it is."""
    interface = interface_names(graph, keep, lowp_io=False)
    plan = {name: dict(attrs) for name, attrs in retyped.items() if attrs}
    casts = []
    for node in graph.nodes():
        types = node_types(node)
        held = {a: get_dtype(node, a) for a in (types.attrs if types else ())}
        held = {a: d for a, d in held.items() if d in dtypes}
        if not held:
            continue
        why = _fixed(node, interface, device, held)
        if why is not None:
            result.kept[node.name] = why
        elif node.op == "Cast":
            casts.append(node.name)
        else:
            plan[node.name] = held
    order = graph.topological_order(among=set(casts))
    for name in reversed(order):   # readers first: a Cast's destination follows them
        node = graph.node(name)
        if get_dtype(node, _DST) in dtypes and any(
                _widens(graph, plan, reader, port) for reader, port in graph.consumers(name)):
            plan.setdefault(name, {})[_DST] = get_dtype(node, _DST)
    for name in order:   # what feeds it first: a Cast's source follows it
        node = graph.node(name)
        if get_dtype(node, _SRC) in dtypes and _widened_output(graph, plan, graph.input(name, 0)):
            plan.setdefault(name, {})[_SRC] = get_dtype(node, _SRC)
        if name not in plan:
            result.kept[name] = "a Cast beside them"
    return plan


def _fixed(node, interface, device: str, held) -> str | None:
    """What ``node`` is, where its 16-bit type attributes ``held`` cannot go to float32."""
    if node.name in interface:
        return "the interface"
    if holds_state(node):
        return "state"
    if node.op in FUNCTIONAL_OPS:
        return "calls and loops"   # their callees' signatures fix their dtypes
    if node.op in REINTERPRETING_OPS:
        return "bytes read as 16 bits"   # in float32 they would read other values
    if not kernel_supports(node, {a: FLOAT for a in held}, device_type(node, device)):
        return "no float32 kernel"
    return None


def _widens(graph: Graph, plan, reader: str, port: int) -> bool:
    """Whether input ``port`` of ``reader`` reads float32 once the plan is applied: its type
    attribute is planned, it is a Cast's source (which follows what feeds it), or a fixed
    float32 port (a direct call whose callee's signature was widened)."""
    node = graph.node(reader)
    types = node_types(node)
    if types is None or port >= len(types.inputs):
        return False
    attr = types.inputs[port].attr
    if attr is None:
        return types.inputs[port].fixed == FLOAT
    return attr in plan.get(reader, {}) or (node.op == "Cast" and attr == _SRC)


def _widened_output(graph: Graph, plan, ref: TensorRef) -> bool:
    """Whether output ``ref`` is float32 once the plan is applied: its type attribute is
    planned, or it is a fixed float32 port (a direct call's, its callee widened)."""
    types = node_types(graph.node(ref.node))
    if types is None or ref.port >= len(types.outputs):
        return False
    attr = types.outputs[ref.port].attr
    return types.outputs[ref.port].fixed == FLOAT if attr is None else attr in plan.get(ref.node, {})


def _bypass_identity_casts(graph: Graph, plan, before: Before, result: Widening,
                           stats: CastStats) -> None:
    """The Casts the plan left casting float32 to float32: their readers read their input, and
    each is removed (a Cast a control edge leaves stays, reading its input)."""
    for name in [n for n in plan if graph.node(n).op == "Cast"]:
        node = graph.node(name)
        if get_dtype(node, _SRC) != get_dtype(node, _DST):
            continue
        source = graph.input(name, 0)
        stats.touched.update(reader for reader, _ in graph.consumers(name))
        graph.replace_uses(TensorRef(name, 0), source)
        if not graph.control_consumers(name):
            result.removed[name] = before.dtypes(name)
            del plan[name]
            graph.remove_node(name)
            stats.touched.discard(name)


