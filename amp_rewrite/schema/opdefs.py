"""The type model: which type attribute governs each port of a node, read from TensorFlow's registry.

Precision is decided per *(node, type attribute)*, as in grappler: ``FusedBatchNormV3`` can
run with ``T=half`` while ``U`` stays float. This module maps every input and output port of a
node to the attribute that sets its dtype (``type_attr``, ``number_attr`` repeats,
``type_list_attr`` elements) or to its fixed dtype, answers whether TensorFlow registers a
kernel for a node with some of its type attributes changed, on a given device type, and which
ops write a variable (:func:`is_variable_write`, read off the OpDef, not the op's name).

Dtypes are ``types_pb2.DataType`` enum values throughout, never strings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from tensorflow.core.framework import graph_pb2, op_def_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.framework import device_spec, kernels, op_def_registry

from ..core.dtypes import INVALID, RESOURCE, VARIANT, base_dtype
from ..core.ir import Graph, Node
from ..core.ops import NOT_VARIABLE_WRITES, is_tensorlist_op

_CACHE = "signatures.types"   # node.meta key of the cached port mapping (see invalidate)
_UNSET = object()


class TypeAttr(NamedTuple):
    """A type attribute of a node; ``index`` picks one element of a ``list(type)`` attr. A
    named tuple: hashed by the hundred thousand while painting, and ordered like the pair."""

    attr: str
    index: int = -1

    def __str__(self) -> str:
        return self.attr if self.index < 0 else f"{self.attr}[{self.index}]"


@dataclass(frozen=True)
class PortType:
    """What sets the dtype of one port: a type attribute, or a fixed dtype."""

    attr: TypeAttr | None
    fixed: int | None = None
    is_ref: bool = False


@dataclass(frozen=True)
class NodeTypes:
    """The port-to-type mapping of one node."""

    inputs: tuple[PortType, ...]
    outputs: tuple[PortType, ...]
    attrs: tuple[TypeAttr, ...]  # every type attribute of the node, ports or not


@functools.lru_cache(maxsize=None)
def op_def(op: str) -> op_def_pb2.OpDef | None:
    """The registered OpDef, or None for custom ops and function calls."""
    return op_def_registry.get(op)


@functools.lru_cache(maxsize=1)
def all_op_names() -> tuple[str, ...]:
    """Every op TensorFlow registers (used to validate rule files and suggest spellings)."""
    ops = op_def_pb2.OpList()
    buf = pywrap_tf_session.TF_GetAllOpList()
    try:
        ops.ParseFromString(pywrap_tf_session.TF_GetBuffer(buf))
    finally:
        pywrap_tf_session.TF_DeleteBuffer(buf)
    return tuple(sorted(o.name for o in ops.op))


@functools.lru_cache(maxsize=None)
def is_variable_write(op: str) -> bool:
    """Whether ``op`` writes a variable (a weight, an optimizer slot, a counter) in place, as
    its OpDef declares, whatever its name:

    - a reference variable's write takes ``Ref(T)`` and a plain input of the same ``T``, the
      value it writes into it (``Assign*``, ``Scatter*`` on a ref, ``Apply*``, ``SparseApply*``,
      ``StridedSliceAssign``); an op that only passes a ref on (``RefSwitch``, ``RefEnter`` ...)
      or reads it (``IsVariableInitialized``) takes no such value;
    - a resource variable's write is stateful, takes a resource and a value of a type
      attribute, and returns nothing: what it computes goes into the resource
      (``AssignVariableOp``, ``ResourceApply*``, ``ResourceSparseApply*``, ``ResourceScatter*``,
      ``ResourceStridedSliceAssign``); a read returns what it read. The OpDef does not say which
      kind of resource it takes, so the few ops writing a table, a summary file or an
      accumulator alike are named (:data:`~amp_rewrite.core.ops.NOT_VARIABLE_WRITES`).

    A stateless op writes nothing: ``ScatterNd`` (``top_k``'s gradient), ``TensorScatter*`` and
    ``ScatterNdNonAliasingAdd`` compute a new tensor. An op TensorFlow does not register (a
    custom op, a direct call of a library function) is not a write; writes inside called
    functions are their bodies' own."""
    od = op_def(op)
    if od is None or op in NOT_VARIABLE_WRITES:
        return False
    written = {a.type_attr for a in od.input_arg if not a.is_ref and a.type_attr}
    if any(a.is_ref and a.type_attr in written for a in od.input_arg):
        return True
    return (od.is_stateful and not od.output_arg and bool(written)
            and any(a.type == RESOURCE for a in od.input_arg))


def node_types(node: Node) -> NodeTypes | None:
    """The port-to-type mapping of ``node``, or None when its op is not registered.

    Port counts depend only on the op and its number/list attrs, so the mapping is cached per
    node, and shared by every node with the same op and counts; a pass that changes those
    attrs calls :func:`invalidate`.
    """
    cached = node.meta.get(_CACHE, _UNSET)
    if cached is not _UNSET:
        return cached
    od = op_def(node.op)
    result = None if od is None else _layout(node.op, _counts(node, od))
    node.meta[_CACHE] = result
    return result


def _counts(node: Node, od: op_def_pb2.OpDef) -> tuple[int, ...]:
    """The values of the attrs that decide ``node``'s port layout, in OpDef order."""
    return tuple(len(node.attr[a.name].list.type) if a.type == "list(type)" else node.attr[a.name].i
                 for a in od.attr if a.type == "list(type)" or a.name in _number_attrs(node.op))


@functools.lru_cache(maxsize=None)
def number_args(op: str) -> tuple[str, ...]:
    """The number attr of each of ``op``'s inputs and outputs that repeats (``N`` of ConcatV2),
    one entry per argument: two arguments may share one, and each declares that many ports."""
    od = op_def(op)
    return tuple(a.number_attr for a in (list(od.input_arg) + list(od.output_arg)
                                         if od is not None else ()) if a.number_attr)


@functools.lru_cache(maxsize=None)
def _number_attrs(op: str) -> frozenset[str]:
    return frozenset(number_args(op))


@functools.lru_cache(maxsize=None)
def _layout(op: str, counts: tuple[int, ...]) -> NodeTypes:
    od = op_def(op)
    sized = [a.name for a in od.attr if a.type == "list(type)" or a.name in _number_attrs(op)]
    count = dict(zip(sized, counts))

    def ports(arg) -> list[PortType]:
        if arg.type_list_attr:
            return [PortType(TypeAttr(arg.type_list_attr, i), is_ref=arg.is_ref)
                    for i in range(count[arg.type_list_attr])]
        n = count[arg.number_attr] if arg.number_attr else 1
        if arg.type_attr:
            return [PortType(TypeAttr(arg.type_attr), is_ref=arg.is_ref)] * n
        return [PortType(None, fixed=arg.type, is_ref=arg.is_ref)] * n

    attrs: list[TypeAttr] = []
    for a in od.attr:
        if a.type == "type":
            attrs.append(TypeAttr(a.name))
        elif a.type == "list(type)":
            attrs.extend(TypeAttr(a.name, i) for i in range(count[a.name]))
    return NodeTypes(tuple(p for a in od.input_arg for p in ports(a)),
                     tuple(p for a in od.output_arg for p in ports(a)), tuple(attrs))


_CALL = "signatures.call"   # node.meta key: the library function a direct call calls


def set_call_signature(node: Node, signature: op_def_pb2.OpDef) -> None:
    """Type ``node``, a direct call of a library function (its op is the function's name, so
    TensorFlow's registry does not know it), by the function's signature: every port has the
    fixed dtype of its argument, and the node has no type attribute to change. Casts then sit
    at the call, as grappler puts them."""
    ports = lambda args: tuple(PortType(None, fixed=a.type) for a in args)  # noqa: E731
    node.meta[_CACHE] = NodeTypes(ports(signature.input_arg), ports(signature.output_arg), ())
    node.meta[_CALL] = signature.name


def called_function(node: Node) -> str | None:
    """The library function a direct call node calls (see :func:`set_call_signature`), or None."""
    return node.meta.get(_CALL)


def invalidate(node: Node) -> None:
    """Forget the cached port mapping of ``node``: call after changing a number or list attr
    (``N``, ``dtypes`` ...) that decides how many ports it has."""
    node.meta.pop(_CACHE, None)


def get_dtype(node: Node, attr: TypeAttr) -> int:
    """The current dtype a type attribute holds (DT_INVALID when unset)."""
    name, index = attr
    attrs = node.attr
    if name not in attrs:
        return INVALID
    return attrs[name].type if index < 0 else attrs[name].list.type[index]


def set_dtype(node: Node, attr: TypeAttr, dtype: int) -> None:
    if attr.index < 0:
        node.attr[attr.attr].type = dtype
    else:
        node.attr[attr.attr].list.type[attr.index] = dtype


def port_dtype(node: Node, port: PortType) -> int:
    """The dtype a port carries now (references stripped)."""
    if port.attr is None:
        return base_dtype(port.fixed)
    return get_dtype(node, port.attr)


def output_dtype(node: Node, port: int) -> int | None:
    """The dtype of output ``port`` of ``node``, or None when unknown (unregistered op)."""
    types = node_types(node)
    if types is None or port >= len(types.outputs):
        return _output_shape_hint(node, port)
    return port_dtype(node, types.outputs[port])


def edge_dtype(src: Node, src_port: int, dst: Node, dst_port: int) -> int | None:
    """What an edge carries: its producer's output dtype, else (an op TensorFlow does not
    register, with no ``_output_types``) what its consumer's input expects; None if neither
    tells."""
    dtype = output_dtype(src, src_port)
    return input_dtype(dst, dst_port) if dtype is None else dtype


def tensorlist_groups(graph: Graph) -> list[list[str]]:
    """The nodes of ``graph`` joined by DT_VARIANT data edges, in groups that hold a TensorList
    op: the ops of one list (or of lists whose handles meet: Pack, ConcatLists, PushBackBatch)
    with every node their handles pass (Identity, Reshape, loop plumbing, calls ...), each
    group in the graph's listing order. Painting makes each group agree on one element dtype,
    and the lint holds it to that."""
    if not any(is_tensorlist_op(node.op) for node in graph.nodes()):
        return []   # no group to find: spare the pass over every edge
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for ref, dst, _ in graph.data_edges():
        if output_dtype(graph.node(ref.node), ref.port) == VARIANT:
            a, b = find(ref.node), find(dst)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[str, list[str]] = {}
    for name in graph.names():
        groups.setdefault(find(name), []).append(name)
    return [members for members in groups.values()
            if any(is_tensorlist_op(graph.node(m).op) for m in members)]


def input_dtype(node: Node, port: int) -> int | None:
    types = node_types(node)
    if types is None or port >= len(types.inputs):
        return None
    return port_dtype(node, types.inputs[port])


def _output_shape_hint(node: Node, port: int) -> int | None:
    # Custom ops often carry their output types in _output_types (set by the Python wrapper).
    if "_output_types" in node.attr and port < len(node.attr["_output_types"].list.type):
        return node.attr["_output_types"].list.type[port]
    return None


def device_type(node: Node, default: str) -> str:
    """``"GPU"`` or ``"CPU"`` (or another type) for the node; unplaced nodes get ``default``."""
    device = node.device
    return (_placed_type(device) if device else None) or default


@functools.lru_cache(maxsize=None)
def _placed_type(device: str) -> str | None:
    # a graph names a few devices on 1e5 nodes: each string parsed once
    try:
        spec = device_spec.DeviceSpecV2.from_string(device)
    except (ValueError, TypeError):
        return None
    return spec.device_type.upper() if spec.device_type else None


@functools.lru_cache(maxsize=None)
def _kernels(op: str):
    return tuple(kernels.get_registered_kernels_for_op(op).kernel)


def allowed_by_opdef(node: Node, attr: TypeAttr, dtype: int) -> bool:
    """Whether the OpDef's allowed_values for ``attr`` admit ``dtype``."""
    return _allowed(node.op, attr.attr, dtype)


@functools.lru_cache(maxsize=None)
def _allowed(op: str, attr: str, dtype: int) -> bool:
    # asked once per node and attr while painting: the OpDef's attr list is walked once per op
    od = op_def(op)
    if od is None:
        return False
    for a in od.attr:
        if a.name == attr:
            allowed = a.allowed_values.list.type
            return not allowed or dtype in allowed
    return False


def kernel_supports(node: Node, changes: dict[TypeAttr, int], device: str) -> bool:
    """Whether a kernel is registered for ``node`` on ``device`` with ``changes`` applied.

    This is grappler's ``SupportsF16`` check, done against the kernel registry of the full
    TensorFlow wheel, which holds the GPU kernels even on a machine without a GPU. The answer
    depends only on the op, the device and the dtypes of the attrs kernels constrain, so it is
    computed once per such combination.
    """
    for attr, dtype in changes.items():
        if not allowed_by_opdef(node, attr, dtype):
            return False
    dtypes = []
    for name in _constrained(node.op):
        if name not in node.attr:
            dtypes.append(None)
            continue
        av = node.attr[name]
        kind = av.WhichOneof("value")
        if kind == "type":
            dtypes.append((changes.get(TypeAttr(name), av.type),))
        elif kind == "list":
            dtypes.append(tuple(changes.get(TypeAttr(name, i), t) for i, t in enumerate(av.list.type)))
        else:
            dtypes.append(None)
    return _registered(node.op, device, tuple(dtypes))


@functools.lru_cache(maxsize=None)
def _constrained(op: str) -> tuple[str, ...]:
    """The attrs some kernel of ``op`` constrains, in a fixed order."""
    return tuple(sorted({c.name for k in _kernels(op) for c in k.constraint}))


@functools.lru_cache(maxsize=None)
def _registered(op: str, device: str, dtypes: tuple) -> bool:
    """Whether a kernel of ``op`` on ``device`` (or DEVICE_DEFAULT) admits ``dtypes``, the
    values of :func:`_constrained` attrs (None: attr absent, no constraint applies)."""
    values = dict(zip(_constrained(op), dtypes))
    for kernel in _kernels(op):
        # DEVICE_DEFAULT kernels (loop plumbing, Identity ...) serve every device type
        if kernel.device_type not in (device, "DEFAULT"):
            continue
        if all(values[c.name] is None or all(t in c.allowed_values.list.type for t in values[c.name])
               for c in kernel.constraint):
            return True
    return False


# ----------------------------------------------------------------- default attributes
def fill_defaults(node_def) -> list[str]:
    """Set the OpDef defaults of attrs ``node_def`` omits; returns their names.

    Graphs saved with ``strip_default_attrs`` (SavedModels) lack attrs, type attrs among them,
    that the type model reads.
    """
    added = []
    for name, default in _defaults(node_def.op):
        if name not in node_def.attr:
            node_def.attr[name].CopyFrom(default)
            added.append(name)
    return added


@functools.lru_cache(maxsize=None)
def _defaults(op: str) -> tuple:
    """``(attr name, default AttrValue)`` of every attr of ``op`` that has a default."""
    od = op_def(op)
    return tuple((a.name, a.default_value) for a in (od.attr if od is not None else ())
                 if a.HasField("default_value"))


def strip_defaults(node_def, names) -> None:
    """Remove the attrs :func:`fill_defaults` added that still hold their default."""
    od = op_def(node_def.op)
    defaults = {a.name: a.default_value for a in od.attr} if od is not None else {}
    for name in names:
        if name in node_def.attr and node_def.attr[name] == defaults.get(name):
            del node_def.attr[name]


def graph_with_defaults(graph_def: graph_pb2.GraphDef) -> tuple[Graph, dict[str, list[str]]]:
    """The IR of ``graph_def`` with default attrs filled in its nodes, and which ones each node
    got (:func:`strip_graph_defaults` takes them out of the output again)."""
    graph = Graph.from_graph_def(graph_def)
    added = {}
    for node in graph.nodes():
        names = fill_defaults(node.proto)
        if names:
            added[node.name] = names
    return graph, added


def strip_graph_defaults(graph_def: graph_pb2.GraphDef, added: dict[str, list[str]]) -> None:
    """Undo :func:`graph_with_defaults` on the nodes it filled, in place."""
    for nd in graph_def.node:
        if nd.name in added:
            strip_defaults(nd, added[nd.name])
