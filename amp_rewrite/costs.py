"""How much matrix work an op does per element of data it moves, from the shapes of its weights.

A MatMul with a weight of shape (p, q) does 2·p·q FLOPs for every row it reads (p elements)
and writes (q elements); a convolution with a kh×kw×cin×cout filter does 2·kh·kw·cin·cout
FLOPs per output pixel, for about cin elements read and cout written. Their ratio, FLOPs per
element moved (:func:`matrix_intensity`), does not depend on the batch, so it is known before
running. Where it is small the op is memory-bound: the casts around it and its low-precision
neighbours cost more than the 16-bit matrix unit saves (measured on an AVX512-BF16 CPU, an
isolated bfloat16 MatMul between casts breaks even near 50; see BENCHMARKS.md "Small matrix
ops").

A weight is a Const, a variable read, or what an op's output updates (a weight gradient
feeds the variable's update); other shapes are not inferred (None: unknown).
"""

from __future__ import annotations

import math

from .ir import Graph, Node
from .ops import ENTER_OPS, is_variable_write

# ops a weight passes through unchanged on its way to a matrix op (or its gradient to an update)
_PASS_THROUGH = frozenset({"Identity", "Cast", "ReadVariableOp", "Snapshot", "StopGradient",
                           "AddN", "CollectiveReduce", "CollectiveReduceV2", "NcclAllReduce",
                           "HorovodAllreduce"}) | ENTER_OPS
_FILTER = {"Conv2D": 1, "Conv2DBackpropInput": 1, "Conv2DBackpropFilter": 1, "Conv3D": 1,
           "Conv3DBackpropInputV2": 1, "Conv3DBackpropFilterV2": 1, "DepthwiseConv2dNative": 1,
           "DepthwiseConv2dNativeBackpropInput": 1, "DepthwiseConv2dNativeBackpropFilter": 1}
# ops whose filter input is the filter's shape (a Const of ints), not the filter
_FILTER_SIZES = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                           "DepthwiseConv2dNativeBackpropFilter"})


def matrix_intensity(graph: Graph, node: Node) -> float | None:
    """FLOPs per element of activations read and written, or None when not known."""
    if node.op == "MatMul":
        shape = _weight_shape(graph, node)
        if shape is None or len(shape) != 2:
            return None
        p, q = shape
        return 2.0 * p * q / (p + q) if p + q else None
    if node.op in _FILTER:
        shape = _filter_shape(graph, node)
        if shape is None or len(shape) < 4:
            return None
        window, cin, cout = math.prod(shape[:-2]), shape[-2], shape[-1]
        if node.op.startswith("Depthwise"):   # cout is a channel multiplier
            return 2.0 * window * cout / (1 + cout)
        return 2.0 * window * cin * cout / (cin + cout) if cin + cout else None
    return None


def _weight_shape(graph: Graph, node: Node) -> list[int] | None:
    for ref in graph.inputs(node.name):
        shape = _stored_shape(graph, ref.node)
        if shape is not None:
            return shape
    return _updated_shape(graph, node.name)   # a weight gradient: the shape of what it updates


def _filter_shape(graph: Graph, node: Node) -> list[int] | None:
    ref = graph.inputs(node.name)[_FILTER[node.op]]
    if node.op in _FILTER_SIZES:
        src = graph.node(ref.node)
        if src.op == "Const" and src.attr["value"].tensor.int_val:
            return list(src.attr["value"].tensor.int_val)
        return _updated_shape(graph, node.name)
    return _stored_shape(graph, ref.node)


def _stored_shape(graph: Graph, name: str, depth: int = 8) -> list[int] | None:
    """The static shape of a stored value (Const, variable) reaching ``name`` unchanged."""
    node = graph.node(name)
    if node.op == "Const":
        dims = [d.size for d in node.attr["value"].tensor.tensor_shape.dim]
        return dims if all(d >= 0 for d in dims) else None
    if node.op in ("VarHandleOp", "VariableV2", "Variable"):
        dims = [d.size for d in node.attr["shape"].shape.dim] if "shape" in node.attr else []
        return dims if dims and all(d >= 0 for d in dims) else None
    if node.op in _PASS_THROUGH and depth:
        inputs = graph.inputs(name)
        if inputs:
            return _stored_shape(graph, inputs[0].node, depth - 1)
    return None


def _updated_shape(graph: Graph, name: str, depth: int = 8) -> list[int] | None:
    """The shape of the variable a value updates (through pass-through ops), if it does."""
    for reader, port in graph.consumers(name):
        node = graph.node(reader)
        if is_variable_write(node.op) and port > 0:
            shape = _stored_shape(graph, graph.inputs(reader)[0].node)
            if shape is not None:
                return shape
        if node.op in _PASS_THROUGH and depth:
            shape = _updated_shape(graph, reader, depth - 1)
            if shape is not None:
                return shape
    return None
