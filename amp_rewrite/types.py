"""The type model: which type attribute governs each port of a node, read from TensorFlow's registry.

Precision is decided per *(node, type attribute)*, as in grappler: ``FusedBatchNormV3`` can
run with ``T=half`` while ``U`` stays float. This module maps every input and output port of a
node to the attribute that sets its dtype (``type_attr``, ``number_attr`` repeats,
``type_list_attr`` elements) or to its fixed dtype, and answers whether TensorFlow registers a
kernel for a node with some of its type attributes changed, on a given device type.

Dtypes are ``types_pb2.DataType`` enum values throughout, never strings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tensorflow.core.framework import op_def_pb2, types_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.framework import device_spec, kernels, op_def_registry

from .ir import Node

FLOAT = types_pb2.DT_FLOAT
HALF = types_pb2.DT_HALF
BFLOAT16 = types_pb2.DT_BFLOAT16
LOW_PRECISION = (HALF, BFLOAT16)
_REF_OFFSET = 100  # DT_FLOAT_REF == DT_FLOAT + 100 in types.proto

TARGETS = {"float16": HALF, "bfloat16": BFLOAT16}
TARGET_NAMES = {dtype: name for name, dtype in TARGETS.items()}


def dtype_name(dtype: int) -> str:
    """``DT_HALF`` -> ``"half"``: the short name TensorFlow prints."""
    return types_pb2.DataType.Name(dtype)[3:].lower()


def base_dtype(dtype: int) -> int:
    """Strip the reference flag: ``DT_FLOAT_REF`` -> ``DT_FLOAT``."""
    return dtype - _REF_OFFSET if dtype > _REF_OFFSET else dtype


@dataclass(frozen=True, order=True)
class TypeAttr:
    """A type attribute of a node; ``index`` picks one element of a ``list(type)`` attr."""

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


def _arg_ports(node: Node, arg: op_def_pb2.OpDef.ArgDef) -> list[PortType]:
    if arg.type_list_attr:
        n = len(node.attr[arg.type_list_attr].list.type)
        return [PortType(TypeAttr(arg.type_list_attr, i), is_ref=arg.is_ref) for i in range(n)]
    n = node.attr[arg.number_attr].i if arg.number_attr else 1
    if arg.type_attr:
        port = PortType(TypeAttr(arg.type_attr), is_ref=arg.is_ref)
    else:
        port = PortType(None, fixed=arg.type, is_ref=arg.is_ref)
    return [port] * n


def node_types(node: Node) -> NodeTypes | None:
    """The port-to-type mapping of ``node``, or None when its op is not registered."""
    # Port counts depend only on the op and its number/list attrs, which no pass changes,
    # so the mapping is computed once per node.
    if "_types" in node.meta:
        return node.meta["_types"]
    od = op_def(node.op)
    if od is None:
        result = None
    else:
        inputs = [p for a in od.input_arg for p in _arg_ports(node, a)]
        outputs = [p for a in od.output_arg for p in _arg_ports(node, a)]
        attrs: list[TypeAttr] = []
        for a in od.attr:
            if a.type == "type":
                attrs.append(TypeAttr(a.name))
            elif a.type == "list(type)":
                attrs.extend(TypeAttr(a.name, i) for i in range(len(node.attr[a.name].list.type)))
        result = NodeTypes(tuple(inputs), tuple(outputs), tuple(attrs))
    node.meta["_types"] = result
    return result


def get_dtype(node: Node, attr: TypeAttr) -> int:
    """The current dtype a type attribute holds (DT_INVALID when unset)."""
    value = node.attr[attr.attr] if attr.attr in node.attr else None
    if value is None:
        return types_pb2.DT_INVALID
    if attr.index < 0:
        return value.type
    return value.list.type[attr.index]


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
    if node.device:
        try:
            spec = device_spec.DeviceSpecV2.from_string(node.device)
        except (ValueError, TypeError):
            return default
        if spec.device_type:
            return spec.device_type.upper()
    return default


@functools.lru_cache(maxsize=None)
def _kernels(op: str):
    return tuple(kernels.get_registered_kernels_for_op(op).kernel)


def allowed_by_opdef(node: Node, attr: TypeAttr, dtype: int) -> bool:
    """Whether the OpDef's allowed_values for ``attr`` admit ``dtype``."""
    od = op_def(node.op)
    if od is None:
        return False
    for a in od.attr:
        if a.name == attr.attr:
            allowed = a.allowed_values.list.type
            return not allowed or dtype in allowed
    return False


def kernel_supports(node: Node, changes: dict[TypeAttr, int], device: str) -> bool:
    """Whether a kernel is registered for ``node`` on ``device`` with ``changes`` applied.

    This is grappler's ``SupportsF16`` check, done against the kernel registry of the full
    TensorFlow wheel, which holds the GPU kernels even on a machine without a GPU.
    """
    for attr, dtype in changes.items():
        if not allowed_by_opdef(node, attr, dtype):
            return False

    def value(name: str) -> list[int] | None:
        if name not in node.attr:
            return None
        av = node.attr[name]
        if av.WhichOneof("value") == "type":
            return [changes.get(TypeAttr(name), av.type)]
        if av.WhichOneof("value") == "list":
            return [changes.get(TypeAttr(name, i), t) for i, t in enumerate(av.list.type)]
        return None

    for kernel in _kernels(node.op):
        # DEVICE_DEFAULT kernels (loop plumbing, Identity ...) serve every device type
        if kernel.device_type not in (device, "DEFAULT"):
            continue
        ok = True
        for constraint in kernel.constraint:
            allowed = set(constraint.allowed_values.list.type)
            current = value(constraint.name)
            if current is not None and not all(t in allowed for t in current):
                ok = False
                break
        if ok:
            return True
    return False
