"""Batch norms folded into the convolutions they follow (with ``--fold-constants``).

Once constant folding has run, a frozen Keras batch norm after a convolution is ``conv * scale
+ offset`` with two Const vectors. TensorFlow fuses a convolution with a following ``BiasAdd``
and activation into one kernel (grappler's remapper: oneDNN's ``_FusedConv2D`` and
``_FusedDepthwiseConv2dNative`` on a CPU, cuDNN's on a GPU), which runs the activation on the
convolution's output while it is still in cache; it does not fuse through a ``Mul`` or an
``AddV2``. So, on MobileNetV2 in bfloat16 on a CPU, 35 unfused Relu6 ran 4x slower than in
float32 and cancelled what the convolutions gained (BENCHMARKS.md "Keras models").

:func:`fold_batch_norms` makes the graph fusable, with the same values:

* ``Mul(conv, scale)``, where ``scale`` is a Const vector of one value per output channel and
  the Mul is the convolution's only reader, becomes the convolution itself with ``scale``
  multiplied into its Const filter, in float32 (for a depthwise filter ``[kh, kw, in, mult]``,
  output channel ``i * mult + m``);
* ``AddV2(conv, offset)`` (either order), with ``offset`` a Const vector of one value per
  output channel, becomes ``BiasAdd(conv, offset)``: the same broadcast over the channels of an
  NHWC tensor.

A per-channel Const is a vector ``[C]`` or the same values shaped ``[1, 1, 1, C]`` (any rank up
to the convolution's 4, every dimension but the last 1): a Keras batch norm with ``axis=3``
(ResNet50's, EfficientNet's, where ``axis=-1`` gives vectors) reshapes its statistics so. Its
values broadcast over the NHWC output exactly as the vector's do; a ``BiasAdd`` takes them as a
new ``[C]`` Const.

Only NHWC convolutions whose filter is a Const (through Identity) are touched, and only in
graphs without variables (inference graphs): folding into a trained filter would break its
gradient. Nodes the graph's interface names, or ``keep``, are left alone. Every rewrite is
counted for the report (``fusion``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import attr_value_pb2, tensor_pb2
from tensorflow.python.framework import tensor_util

from ..core.dtypes import FLOAT
from ..core.ir import Graph, Node, TensorRef
from ..schema.consts import const_values
from ..schema.shapes import const_behind

CONVOLUTIONS = ("Conv2D", "DepthwiseConv2dNative")


@dataclass
class Fusion:
    """What :func:`fold_batch_norms` did: scales folded into filters, adds made BiasAdds;
    and ``pushed``, the scales TensorFlow's constant folding had already folded into a
    ``Conv2D``'s filter before it (:func:`~amp_rewrite.transforms.constfold.scales_pushed`),
    which the report counts with ours."""

    scales_folded: int = 0
    bias_adds: int = 0
    pushed: int = 0

    def summary(self) -> dict:
        folded = self.scales_folded + self.pushed
        by_tf = f" ({self.pushed} by TensorFlow's constant folding)" if self.pushed else ""
        return {"scales_folded": folded, "scales_folded_by_tensorflow": self.pushed,
                "bias_adds": self.bias_adds,
                "summary": f"batch-norm scales folded into convolution filters: "
                           f"{folded}{by_tf}, per-channel adds made BiasAdd: "
                           f"{self.bias_adds} (so TensorFlow fuses them with the convolution "
                           "and its activation)"}


def fold_batch_norms(graph: Graph, keep: set[str]) -> Fusion:
    """Rewrite ``graph`` in place as the module doc says; returns the counts."""
    done = Fusion()
    for name in graph.names():
        if name not in graph or name in keep:
            continue
        node = graph.node(name)
        if node.op == "Mul" and _float(node):
            done.scales_folded += _fold_scale(graph, node, keep)
    for name in graph.names():
        if name not in graph:   # a [1, 1, 1, C] offset replaced by its vector
            continue
        node = graph.node(name)
        if node.op in ("AddV2", "Add") and _float(node) and name not in keep:
            done.bias_adds += _to_bias_add(graph, node, keep)
    return done


def _fold_scale(graph: Graph, mul: Node, keep: set[str]) -> int:
    if len(graph.inputs(mul.name)) != 2:
        return 0   # (a malformed node: the input check that follows names it)
    for port in (0, 1):
        conv_ref, scale_ref = graph.input(mul.name, port), graph.input(mul.name, 1 - port)
        conv = graph.node(conv_ref.node)
        stored = _vector(graph, scale_ref, _channels(graph, conv, conv_ref))
        if (stored is None or conv.name in keep
                or not _only_reader(graph, conv.name, mul.name, port)
                or not graph.is_read(mul.name) or graph.control_consumers(mul.name)):
            continue   # (an unread Mul is a graph output: its name must stay)
        filter_ref = graph.input(conv.name, 1)
        weights = const_values(_float_const(graph, filter_ref)[0]).astype(np.float32)
        scale = const_values(stored).astype(np.float32).reshape(-1)   # [1, 1, 1, C] too
        if conv.op == "Conv2D":
            folded = weights * scale
        else:   # [kh, kw, in, mult]: output channel i * mult + m
            folded = (weights.reshape(weights.shape[:2] + (-1,)) * scale).reshape(weights.shape)
        graph.set_input(conv.name, 1, _float_const_node(graph, conv.name + "/folded_filter",
                                                        folded, after=conv.name))
        graph.replace_uses(TensorRef(mul.name), conv_ref)
        _remove_unread(graph, mul.name, keep)
        _remove_unread(graph, filter_ref.node, keep)
        return 1
    return 0


def _float_const_node(graph: Graph, name: str, values: np.ndarray, *, after: str) -> TensorRef:
    """A float32 Const of ``values`` added to ``graph`` beside ``after``; its output."""
    new = graph.add_node("Const", name, attrs={
        "dtype": attr_value_pb2.AttrValue(type=FLOAT),
        "value": attr_value_pb2.AttrValue(tensor=_tensor(values))}, after=after)
    return TensorRef(new.name)


def _to_bias_add(graph: Graph, add: Node, keep: set[str]) -> int:
    if len(graph.inputs(add.name)) != 2:
        return 0
    for port in (0, 1):
        conv_ref, offset_ref = graph.input(add.name, port), graph.input(add.name, 1 - port)
        conv = graph.node(conv_ref.node)
        stored = _vector(graph, offset_ref, _channels(graph, conv, conv_ref))
        if stored is None:
            continue
        if len(stored.attr["value"].tensor.tensor_shape.dim) != 1:   # [1, 1, 1, C]: a bias
            bias = const_values(stored).astype(np.float32).reshape(-1)  # is a vector
            old, offset_ref = offset_ref, _float_const_node(graph, add.name + "/bias", bias,
                                                            after=add.name)
            graph.set_input(add.name, 1 - port, offset_ref)
            _remove_unread(graph, old.node, keep)
        if port == 1:   # BiasAdd reads the value first, the bias second
            graph.set_input(add.name, 0, conv_ref)
            graph.set_input(add.name, 1, offset_ref)
        add.set_op("BiasAdd")
        add.attr["data_format"].s = b"NHWC"
        return 1
    return 0


def _channels(graph: Graph, conv: Node, ref: TensorRef) -> int | None:
    """The output channels of an NHWC float32 convolution with a Const filter, else None."""
    if conv.op not in CONVOLUTIONS or ref.port != 0 or not _float(conv):
        return None
    if "data_format" in conv.attr and conv.attr["data_format"].s != b"NHWC":
        return None
    inputs = graph.inputs(conv.name)
    found = _float_const(graph, inputs[1]) if len(inputs) == 2 else None
    if found is None or len(found[1]) != 4:
        return None
    dims = found[1]
    return dims[3] if conv.op == "Conv2D" else dims[2] * dims[3]


def _vector(graph: Graph, ref: TensorRef, length: int | None) -> Node | None:
    """The float32 Const of one value per channel, ``length`` of them, that ``ref`` reads
    (through Identity): shaped ``[length]``, or ``[1, ..., 1, length]`` of rank 4 at most (as
    it broadcasts over an NHWC tensor); else None."""
    found = _float_const(graph, ref) if length is not None else None
    if found is None:
        return None
    dims = found[1]
    per_channel = 1 <= len(dims) <= 4 and dims[-1] == length and all(d == 1 for d in dims[:-1])
    return found[0] if per_channel else None


def _float_const(graph: Graph, ref: TensorRef) -> tuple[Node, list[int]] | None:
    """The float32 Const ``ref`` reads (through Identity) and its shape, or None."""
    source = const_behind(graph, ref)
    if source is None or source.attr["dtype"].type != FLOAT:
        return None
    return source, [d.size for d in source.attr["value"].tensor.tensor_shape.dim]


def _only_reader(graph: Graph, name: str, reader: str, port: int) -> bool:
    """Whether input ``port`` of ``reader`` is all that reads ``name`` (data or control)."""
    return not graph.control_consumers(name) and graph.consumers(name) == [(reader, port)]


def _remove_unread(graph: Graph, name: str, keep: set[str]) -> None:
    """Remove ``name`` and, in turn, what only it read, once nothing reads it (and it is not
    kept)."""
    stack = [name]
    while stack:
        current = stack.pop()
        if current not in graph or current in keep or graph.is_read(current):
            continue
        sources = [ref.node for ref in graph.inputs(current)] + graph.control_inputs(current)
        graph.remove_node(current)
        stack.extend(sources)


def _float(node: Node) -> bool:
    return "T" in node.attr and node.attr["T"].type == FLOAT


def _tensor(values: np.ndarray) -> tensor_pb2.TensorProto:
    return tensor_util.make_tensor_proto(values, dtype=np.float32, shape=values.shape)
