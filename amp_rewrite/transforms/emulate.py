"""float16 emulation: a float16 graph's numbers, computed in float32 (grappler's
``auto_mixed_precision_cpu`` idea, applied to the saved graph).

:func:`emulate_float16` turns every float16 op of a converted graph back into a float32 op
whose float inputs arrive rounded to float16 and whose outputs are rounded to float16 and back
(``Cast`` to half and to float). What the float16 graph would store in 16 bits is stored with
float16's precision and range (values over 65504 become inf, those under 2^-24 become 0), while
the arithmetic inside each op runs in float32, as Tensor Cores accumulate. A user without a GPU
sees what float16 does to the model's numbers at float32 speed, with CPU kernels that exist for
every op (TensorFlow's float16 CPU kernels are few and slow).

A graph's own nodes are emulated, and so is the body of every library function that holds
float16 (a TF2 SavedModel's ops all live in functions): each body goes through the IR
(:func:`~amp_rewrite.schema.functiondef.function_to_graph`), is emulated and linted, and is
written back. A boundary the conversion lowered to float16 (a While body's loop variable, an
argument between two painted functions) becomes float32 on both sides, the function's signature
and every call site, and carries values already rounded where they were made, so no cast is
added there. The model's interface stays float32: a graph whose Placeholder or output is
float16 is refused (:class:`UnsupportedGraphError`), and so is one where a function the
SavedModel restores (its signatures and concrete functions) or the gradient tables name takes
or returns float16, or a polymorphic function holds float16: emulation would retype what a
caller outside the graph relies on.
"""

from __future__ import annotations

from typing import Collection, NamedTuple

from tensorflow.core.framework import graph_pb2, op_def_pb2

from ..check import lint
from ..core.dtypes import FLOAT, HALF
from ..core.errors import LintError, UnsupportedGraphError
from ..core.ir import Graph, TensorRef
from ..core.ops import (
    ENTER_OPS,
    EXIT_OPS,
    FUNCTIONAL_OPS,
    MERGE_OPS,
    NEXT_ITERATION_OPS,
    PLACEHOLDER_OPS,
    SWITCH_OPS,
)
from ..schema.functiondef import (
    check_call_types,
    function_to_graph,
    gradient_linked,
    graph_to_function,
    is_concrete,
)
from ..schema.opdefs import (
    called_function,
    get_dtype,
    invalidate,
    node_types,
    output_dtype,
    set_call_signature,
    set_dtype,
)
from ..schema.snapshot import Before
from .casts import cast_types, insert_cast

# v1 control flow only routes values: it keeps what it is given, already rounded. So do a
# function's arguments (Placeholders in its IR: the caller rounded what it passes) and the
# functional ops (While, If, calls: the callee rounded what it returns, and a While that runs
# no iteration returns its inputs)
_ROUTING = (ENTER_OPS | EXIT_OPS | MERGE_OPS | NEXT_ITERATION_OPS | SWITCH_OPS | {"Identity"}
            | PLACEHOLDER_OPS | frozenset(FUNCTIONAL_OPS))


class Emulated(NamedTuple):
    """What :func:`emulate_float16` made: the graph, how many ops it emulates, and the library
    functions whose bodies it emulated (by name, in library order)."""

    graph_def: graph_pb2.GraphDef
    ops: int
    functions: list[str]


def emulate_float16(graph_def: graph_pb2.GraphDef, roots: Collection[str] = ()) -> Emulated:
    """The float32 emulation of float16 ``graph_def`` (not changed): its own nodes and every
    library function that holds float16. ``roots`` are the functions a SavedModel restores
    (``object_graph_def.concrete_functions``): they, like the functions the gradient tables
    name, keep their float32 signatures. A graph with no float16 op comes back equal."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    library = out.library
    held = [f for f in library.function if _holds_half(f)]
    _refuse_half_signatures(held, set(roots) | gradient_linked(library))
    before_calls = {f.signature.name: f.signature for f in library.function}
    graph = Graph.from_graph_def(out)
    for node in graph.nodes():    # a direct call is typed by its callee's signature
        if node.op in before_calls:
            set_call_signature(node, before_calls[node.op])
    _refuse_half_interface(graph)
    calls = dict(before_calls)
    calls.update((f.signature.name, _float_signature(f.signature)) for f in held)
    emulated = 0
    for fdef in held:   # each body as IR, emulated and linted, then written back
        body = function_to_graph(fdef, before_calls)
        emulated += _emulate_nodes(body.graph, calls)
        fdef.CopyFrom(graph_to_function(body, calls))
    emulated += _emulate_nodes(graph, calls)
    result = graph.to_graph_def(out)
    problems = check_call_types(result)   # every call site agrees with its callee, as converted
    if problems:
        raise LintError(problems)
    return Emulated(result, emulated, [f.signature.name for f in held])


def _emulate_nodes(graph: Graph, calls: dict[str, op_def_pb2.OpDef]) -> int:
    """Emulate ``graph``'s float16 ops in place (a graph's own nodes or a function body), type
    its direct calls by ``calls`` (the signatures once emulated) and lint the result; returns
    how many ops it emulates."""
    before = Before(graph)
    emulated = 0
    for node in list(graph.nodes()):   # the casts added on the way are not visited
        types = node_types(node)
        if types is None:
            continue
        ports = [p for p in range(len(types.outputs)) if output_dtype(node, p) == HALF]
        casts = cast_types(node)
        if casts == (HALF, FLOAT):
            _to_identity(node)      # its input is now float32, rounded already
            continue
        if casts is not None and casts[0] == HALF:
            node.attr["SrcT"].type = FLOAT      # its input is now float32, rounded already
            invalidate(node)
            if casts[1] != HALF:
                continue
        if node.op == "Const" or (casts is not None and casts[1] == HALF):
            # the 16-bit value itself (a stored weight, a value rounded on entry): widen it
            _widen_outputs(graph, node.name, ports, round_first=False)
            continue
        half = [a for a in types.attrs if get_dtype(node, a) == HALF]
        if not half:
            continue
        for attr in half:
            set_dtype(node, attr, FLOAT)
        if node.op in _ROUTING:
            continue    # passes values on unchanged (and a loop's Merge must read NextIteration)
        _widen_outputs(graph, node.name, ports, round_first=True)
        emulated += 1
    for node in graph.nodes():   # its callee's float16 arguments and results are float32 now
        callee = called_function(node)
        if callee in calls:
            set_call_signature(node, calls[callee])
    lint.lint(graph, original=before)   # as every converted graph, before it is written
    return emulated


def _has_half(attrs) -> bool:
    return any(v.type == HALF or HALF in v.list.type for v in attrs.values())


def _holds_half(function) -> bool:
    """Whether a library function has a float16 op, or float16 in its signature."""
    sig = function.signature
    return (any(a.type == HALF for a in list(sig.input_arg) + list(sig.output_arg))
            or any(_has_half(node.attr) for node in function.node_def))


def _float_signature(signature: op_def_pb2.OpDef) -> op_def_pb2.OpDef:
    """``signature`` with its float16 arguments and results float32, as its body will be."""
    out = op_def_pb2.OpDef()
    out.CopyFrom(signature)
    for arg in list(out.input_arg) + list(out.output_arg):
        if arg.type == HALF:
            arg.type = FLOAT
    return out


def _refuse_half_signatures(held, kept: set[str]) -> None:
    """Refuse what emulation cannot retype: a float16 argument or result of a function whose
    callers are outside the graph (``kept``: a SavedModel's restored functions, the gradient
    tables' entries), and a polymorphic function holding float16 (its types are its callers')."""
    for function in held:
        sig = function.signature
        if not is_concrete(function):
            raise UnsupportedGraphError(f"function {sig.name!r} is polymorphic and holds float16: "
                                        "emulation retypes concrete functions only")
        if sig.name in kept and any(a.type == HALF for a in list(sig.input_arg) + list(sig.output_arg)):
            raise UnsupportedGraphError(f"function {sig.name!r} takes or returns float16, and the "
                                        "SavedModel or its gradients call it by that signature: "
                                        "emulation keeps the model's interface float32")


def _to_identity(node) -> None:
    """An existing half-to-float Cast (one the conversion put at a boundary, or the model's
    own) now reads float32 values already rounded to float16: it becomes an Identity, not a
    float32-to-float32 Cast. The node stays, under its name, because a fetch, a control edge
    or ``verify --per-node`` may name it."""
    for key in ("SrcT", "DstT", "Truncate"):
        if key in node.attr:
            del node.attr[key]
    node.set_op("Identity")
    node.attr["T"].type = FLOAT
    invalidate(node)


def _widen_outputs(graph: Graph, name: str, ports: list[int], round_first: bool) -> None:
    """Readers of each port get it as float32: through ``Cast(half)`` then ``Cast(float)``
    when the port now computes float32 (``round_first``), through ``Cast(float)`` when it holds
    float16 values."""
    for port in ports:
        ref = TensorRef(name, port)
        readers = graph.consumers(name, port)
        if not readers:
            continue
        rounded = insert_cast(graph, ref, FLOAT, HALF) if round_first else ref
        wide = insert_cast(graph, rounded, HALF, FLOAT)
        for reader, index in readers:
            graph.set_input(reader, index, wide)


def _refuse_half_interface(graph: Graph) -> None:
    for node in graph.nodes():
        types = node_types(node)
        if types is None:
            continue
        outputs = range(len(types.outputs))
        if node.op in PLACEHOLDER_OPS and any(output_dtype(node, p) == HALF for p in outputs):
            raise UnsupportedGraphError(f"input {node.name!r} is float16 (--lowp-io?): emulation "
                                        "keeps a graph's interface float32; convert without --lowp-io")
        if not graph.consumers(node.name) and any(output_dtype(node, p) == HALF for p in outputs) \
                and node.op != "Const":
            raise UnsupportedGraphError(f"output {node.name!r} is float16 (--lowp-io?): emulation "
                                        "keeps a graph's interface float32; convert without --lowp-io")
