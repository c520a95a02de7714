"""float16 emulation: a float16 graph's numbers, computed in float32 (grappler's
``auto_mixed_precision_cpu`` idea, applied to the saved graph).

:func:`emulate_float16` turns every float16 op of a converted graph back into a float32 op
whose float inputs arrive rounded to float16 and whose outputs are rounded to float16 and back
(``Cast`` to half and to float). What the float16 graph would store in 16 bits is stored with
float16's precision and range (values over 65504 become inf, those under 2^-24 become 0), while
the arithmetic inside each op runs in float32, as Tensor Cores accumulate. A user without a GPU
sees what float16 does to the model's numbers at float32 speed, with CPU kernels that exist for
every op (TensorFlow's float16 CPU kernels are few and slow).

Only a graph's own nodes are emulated; a graph whose library functions hold float16 ops is
refused (:class:`UnsupportedGraphError`), and so is one whose interface (a Placeholder, a graph
output) is float16, which emulation would retype.
"""

from __future__ import annotations

from tensorflow.core.framework import graph_pb2

from ..check import lint
from ..core.dtypes import FLOAT, HALF
from ..core.errors import UnsupportedGraphError
from ..core.ir import Graph, TensorRef
from ..core.ops import (
    ENTER_OPS,
    EXIT_OPS,
    MERGE_OPS,
    NEXT_ITERATION_OPS,
    PLACEHOLDER_OPS,
    SWITCH_OPS,
)
from ..schema.opdefs import get_dtype, invalidate, node_types, output_dtype, set_dtype
from ..schema.snapshot import Before
from .casts import cast_types, insert_cast

# v1 control flow only routes values: it keeps what it is given, already rounded
_ROUTING = ENTER_OPS | EXIT_OPS | MERGE_OPS | NEXT_ITERATION_OPS | SWITCH_OPS | {"Identity"}


def emulate_float16(graph_def: graph_pb2.GraphDef) -> tuple[graph_pb2.GraphDef, int]:
    """The float32 emulation of float16 ``graph_def`` (not changed), and how many ops it
    emulates. A graph with no float16 op comes back equal."""
    _refuse_half_functions(graph_def.library)
    graph = Graph.from_graph_def(graph_def)
    _refuse_half_interface(graph)
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
    lint.lint(graph, original=before)   # as every converted graph, before it is written
    return graph.to_graph_def(graph_def), emulated


def _refuse_half_functions(library) -> None:
    """Emulation covers a graph's own nodes: refuse a library function that holds float16 ops
    or passes float16 through its signature (a call of it would keep float16 at its border)."""
    for function in library.function:
        sig = function.signature
        if any(a.type == HALF for a in list(sig.input_arg) + list(sig.output_arg)):
            raise UnsupportedGraphError(f"function {sig.name!r} takes or returns float16; "
                                        "emulation covers a graph's own nodes only")
        for node in function.node_def:
            if any(v.type == HALF or HALF in v.list.type for v in node.attr.values()):
                raise UnsupportedGraphError(
                    f"function {sig.name!r} holds float16 ops ({node.name}); "
                    "emulation covers a graph's own nodes only")


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
