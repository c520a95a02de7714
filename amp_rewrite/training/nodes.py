"""Small builders for the nodes the training pass adds, on top of :meth:`Graph.add_node`.

Every builder returns the new node's output 0 as a :class:`TensorRef` and marks the node
``meta["amp_inserted"]``; names go through :meth:`Graph.unique_name`, so they are deterministic.
"""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2
from tensorflow.python.framework import tensor_util

from ..core.dtypes import BOOL, INT32
from ..core.ir import Graph, TensorRef


def type_attr(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def add(graph: Graph, kind: str, name: str, inputs=(), attrs=None, control=()) -> TensorRef:
    """Add one node with ready-made ``AttrValue`` attrs."""
    node = graph.add_node(kind, name, inputs, attrs, control_inputs=control)
    node.meta["amp_inserted"] = True
    return TensorRef(node.name)


def op(graph: Graph, kind: str, name: str, inputs=(), control=(), **types) -> TensorRef:
    """Add ``kind`` named ``name`` reading ``inputs``; keyword arguments are type attributes."""
    return add(graph, kind, name, inputs, {key: type_attr(value) for key, value in types.items()},
               control)


def const(graph: Graph, name: str, value, dtype: int) -> TensorRef:
    array = np.asarray(value)
    proto = tensor_util.make_tensor_proto(array, dtype=dtype, shape=array.shape)
    return add(graph, "Const", name, (), {"dtype": type_attr(dtype),
                                           "value": attr_value_pb2.AttrValue(tensor=proto)})


def cast(graph: Graph, name: str, ref: TensorRef, src: int, dst: int) -> TensorRef:
    """``ref`` as ``dst``; ``ref`` itself when it already is."""
    if src == dst:
        return ref
    return add(graph, "Cast", name, [ref], {"SrcT": type_attr(src), "DstT": type_attr(dst),
                                             "Truncate": attr_value_pb2.AttrValue(b=False)})


def binary(graph: Graph, kind: str, name: str, a: TensorRef, b: TensorRef, dtype: int) -> TensorRef:
    return op(graph, kind, name, [a, b], T=dtype)


def select(graph: Graph, name: str, pred: TensorRef, a: TensorRef, b: TensorRef, dtype: int) -> TensorRef:
    return op(graph, "SelectV2", name, [pred, a, b], T=dtype)


def reduce_all(graph: Graph, name: str, flags: TensorRef) -> TensorRef:
    """``All`` over every axis of a bool tensor (a scalar, rank 0 included)."""
    rank = op(graph, "Rank", f"{name}/rank", [flags], T=BOOL)
    axes = op(graph, "Range", f"{name}/axes", [const(graph, f"{name}/start", 0, INT32), rank,
                                                const(graph, f"{name}/delta", 1, INT32)], Tidx=INT32)
    return add(graph, "All", name, [flags, axes], {"Tidx": type_attr(INT32),
                                                   "keep_dims": attr_value_pb2.AttrValue(b=False)})


def pack(graph: Graph, name: str, values: list[TensorRef], dtype: int) -> TensorRef:
    """Stack same-shaped tensors along a new first axis."""
    return add(graph, "Pack", name, values, {"N": attr_value_pb2.AttrValue(i=len(values)),
                                             "T": type_attr(dtype), "axis": attr_value_pb2.AttrValue(i=0)})


def noop(graph: Graph, name: str, control=()) -> str:
    return add(graph, "NoOp", name, control=control).node


def scalar_shape() -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto())
