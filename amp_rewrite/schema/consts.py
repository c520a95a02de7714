"""Reading and converting the values of ``Const`` nodes.

A Const's tensor is read only as far as needed: a splat (as ``tf.fill`` constants are stored)
lists fewer values than its shape holds and means the last one repeated, so it is read and
converted as listed, never expanded (a few bytes can stand for terabytes).
"""

from __future__ import annotations

import math

import ml_dtypes  # shipped with TensorFlow; numpy has no bfloat16 of its own
import numpy as np
from tensorflow.core.framework import tensor_pb2
from tensorflow.python.framework import tensor_util

from ..core.dtypes import BFLOAT16, DOUBLE, FLOAT, HALF, LARGEST
from ..core.errors import InputError
from ..core.ir import Node

# where a Const lists its values when they are not in tensor_content (half: as bits)
_LISTED = {FLOAT: "float_val", HALF: "half_val", DOUBLE: "double_val"}


def const_values(node: Node) -> np.ndarray:
    """A Const's values; :class:`InputError` when its tensor is malformed."""
    try:
        return tensor_util.MakeNdarray(node.attr["value"].tensor)
    except (TypeError, ValueError) as exc:
        raise InputError(f"Const {node.name!r} holds a malformed tensor: {exc}") from None


def listed_values(node: Node) -> np.ndarray | None:
    """The values a splat Const lists, not expanded; None for any other Const."""
    tensor = node.attr["value"].tensor
    listed_in = _LISTED.get(tensor.dtype)
    if listed_in is None or tensor.tensor_content:
        return None
    dims = [d.size for d in tensor.tensor_shape.dim]
    listed = len(getattr(tensor, listed_in))
    if any(d < 0 for d in dims) or listed >= math.prod(dims):
        return None
    if listed == 0:  # no value listed: all zeros
        return np.zeros(1, np.float64)
    return _as_listed(tensor)


def _as_listed(tensor: tensor_pb2.TensorProto) -> np.ndarray:
    # what MakeNdarray reads from a TensorProto's list of values, without its 20 µs of checks
    if tensor.dtype == HALF:   # half_val holds the bit patterns
        return np.array(tensor.half_val, np.uint16).view(np.float16)
    return np.array(getattr(tensor, _LISTED[tensor.dtype]),
                    np.float32 if tensor.dtype == FLOAT else np.float64)


def values_or_listed(node: Node) -> np.ndarray:
    """The listed values of a splat, else all values: enough to test a property of each."""
    values = listed_values(node)
    return const_values(node) if values is None else values


def fits(node: Node, target: int) -> bool:
    """Whether a float32 Const's values stay finite in ``target`` (float16 tops out at 65504)."""
    if target != HALF:
        return True
    values = values_or_listed(node)
    finite = np.isfinite(values)
    return not np.any(np.abs(values[finite]) > LARGEST[HALF])


def is_all_ones(node: Node) -> bool:
    """Whether a float Const holds ones only (a backprop seed)."""
    if node.op != "Const" or "value" not in node.attr:
        return False
    if node.attr["value"].tensor.dtype not in (FLOAT, HALF, DOUBLE):
        return False
    values = values_or_listed(node)   # InputError naming the node when the tensor is malformed
    return values.size > 0 and bool(np.all(values == 1))


def convert(node: Node, target: int) -> None:
    """Store a float32 Const's values in ``target``, in place; a splat stays a splat."""
    tensor = node.attr["value"].tensor
    listed = listed_values(node)
    if listed is None and len(tensor.float_val) == 1 and _size(tensor) == 1:
        listed = _as_listed(tensor)   # one value: listed, as make_tensor_proto writes one
    if listed is not None:  # keep a splat a splat: its listed values and the shape
        del tensor.float_val[:]
        tensor.dtype = target
        tensor.half_val[:] = _bits(listed, target).tolist()
        node.attr["dtype"].type = target
        return
    if tensor.dtype == FLOAT and _packed_only(tensor):
        # most weights: packed bytes, rewritten in place. TensorFlow's generic path
        # (MakeNdarray, make_tensor_proto) costs 60 µs a Const, 1.5 s on a 100k-node graph,
        # and writes the same message for more than one value: dtype, shape, packed bytes
        content, size = tensor.tensor_content, _size(tensor)
        if size > 1 and len(content) == 4 * size:   # else malformed: const_values says how
            tensor.dtype = target
            tensor.tensor_content = _lowp(np.frombuffer(content, np.float32), target).tobytes()
            node.attr["dtype"].type = target
            return
    values = const_values(node)
    proto = tensor_util.make_tensor_proto(_lowp(values, target), dtype=target, shape=list(values.shape))
    node.attr["value"].tensor.CopyFrom(proto)
    node.attr["dtype"].type = target


def widen(node: Node) -> None:
    """Store a float16 or bfloat16 Const's values in float32, in place: the same values (every
    16-bit value is one of float32's); a splat stays a splat."""
    tensor = node.attr["value"].tensor
    dims = [d.size for d in tensor.tensor_shape.dim]
    if (tensor.dtype in (HALF, BFLOAT16) and not tensor.tensor_content
            and all(d >= 0 for d in dims) and len(tensor.half_val) < max(1, math.prod(dims))):
        # a splat (or one value) lists 16-bit patterns in half_val: widen what it lists
        low = np.float16 if tensor.dtype == HALF else ml_dtypes.bfloat16
        listed = np.array(tensor.half_val, np.uint16).view(low).astype(np.float32)
        del tensor.half_val[:]
        tensor.dtype = FLOAT
        tensor.float_val[:] = listed.tolist()
        node.attr["dtype"].type = FLOAT
        return
    values = const_values(node).astype(np.float32)
    node.attr["value"].tensor.CopyFrom(
        tensor_util.make_tensor_proto(values, dtype=FLOAT, shape=list(values.shape)))
    node.attr["dtype"].type = FLOAT


def _size(tensor: tensor_pb2.TensorProto) -> int:
    """How many values the tensor's shape holds (negative for an unknown dimension)."""
    return math.prod(d.size for d in tensor.tensor_shape.dim)


def _packed_only(tensor: tensor_pb2.TensorProto) -> bool:
    """Whether the tensor holds its dtype, its shape and packed bytes, and nothing else."""
    return len(tensor.ListFields()) == 3 and bool(tensor.tensor_content)


def _lowp(values: np.ndarray, target: int) -> np.ndarray:
    # NaN stays NaN and what float16 cannot hold becomes inf, as TensorFlow's Cast does
    with np.errstate(invalid="ignore", over="ignore"):
        return values.astype(np.float16 if target == HALF else ml_dtypes.bfloat16)


def _bits(values: np.ndarray, target: int) -> np.ndarray:
    """The 16-bit patterns TensorProto's half_val holds for float16 and bfloat16 alike."""
    return _lowp(values, target).view(np.uint16).astype(np.int32)
