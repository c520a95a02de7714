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

A trained convolution carries a bias before its batch norm (``Conv2D -> BiasAdd -> Mul ->
AddV2``, Keras's ``use_bias=True``, ResNet50's): the scale folds into the filter and the bias
alike (``(x + b) * s = x * s + b * s``), and the offset joins the bias (``(x + b) + o``: one
``BiasAdd`` of ``b + o``), so the chain becomes one convolution and one ``BiasAdd``. An inference
``FusedBatchNorm``/``V2``/``V3`` (``is_training`` false, its statistics unread) of four Const
vectors after a convolution, with or without a bias, folds the same way: its scale ``gamma /
sqrt(var + epsilon)`` into the filter, its offset ``beta - mean * scale`` into the bias, and the
batch norm becomes that ``BiasAdd``.

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
#: inference batch norms of four vectors (``is_training`` false): tf.keras's, and frozen graphs'
FUSED_BATCH_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


@dataclass
class Fusion:
    """What :func:`fold_batch_norms` did: scales folded into filters, adds made BiasAdds;
    and ``pushed``, the scales TensorFlow's constant folding had already folded into a
    ``Conv2D``'s filter before it (:func:`~amp_rewrite.transforms.constfold.scales_pushed`),
    which the report counts with ours."""

    scales_folded: int = 0
    bias_adds: int = 0
    pushed: int = 0
    batch_norms: int = 0

    def __bool__(self) -> bool:
        return bool(self.scales_folded or self.bias_adds or self.pushed or self.batch_norms)

    def summary(self) -> dict:
        folded = self.scales_folded + self.pushed
        by_tf = f" ({self.pushed} by TensorFlow's constant folding)" if self.pushed else ""
        fused = (f", FusedBatchNorms folded into convolutions: {self.batch_norms}"
                 if self.batch_norms else "")
        return {"scales_folded": folded, "scales_folded_by_tensorflow": self.pushed,
                "bias_adds": self.bias_adds, "batch_norms": self.batch_norms,
                "summary": f"batch-norm scales folded into convolution filters: "
                           f"{folded}{by_tf}, per-channel adds made BiasAdd: "
                           f"{self.bias_adds}{fused} (so TensorFlow fuses them with the "
                           "convolution and its activation)"}


def fold_batch_norms(graph: Graph, keep: set[str]) -> Fusion:
    """Rewrite ``graph`` in place as the module doc says; returns the counts."""
    done = Fusion()
    for name in graph.names():
        if name not in graph or name in keep:
            continue
        node = graph.node(name)
        if node.op == "Mul" and _float(node):
            done.scales_folded += _fold_scale(graph, node, keep)
        elif node.op in FUSED_BATCH_NORMS and _float(node):
            done.batch_norms += _fold_fused(graph, node, keep)
    for name in graph.names():
        if name not in graph:   # a [1, 1, 1, C] offset replaced by its vector
            continue
        node = graph.node(name)
        if node.op in ("AddV2", "Add") and _float(node) and name not in keep:
            done.bias_adds += _to_bias_add(graph, node, keep)
    return done


@dataclass(frozen=True)
class _Behind:
    """A convolution a per-channel op reads, directly or through the ``BiasAdd`` of a trained
    bias: the convolution, its output channels, the ``BiasAdd`` (None: none) and the tensor
    the op reads (the convolution's output, or the BiasAdd's)."""

    conv: Node
    channels: int
    bias_add: Node | None
    ref: TensorRef


def _behind(graph: Graph, ref: TensorRef, reader: str, port: int,
            keep: set[str]) -> _Behind | None:
    """The convolution that input ``port`` of ``reader`` reads (see :class:`_Behind`), where
    that input is all that reads it (and the BiasAdd's all that reads the convolution), none
    of it kept and no control edge leaving it; else None."""
    node = graph.node(ref.node)
    bias_add = None
    if node.op == "BiasAdd" and ref.port == 0 and _float(node):
        if (_data_format(node) != b"NHWC" or node.name in keep
                or not _only_reader(graph, node.name, reader, port)):
            return None
        bias_add, reader, port = node, node.name, 0
        ref = graph.input(node.name, 0)
        node = graph.node(ref.node)
    channels = _channels(graph, node, ref)
    if channels is None or node.name in keep or not _only_reader(graph, node.name, reader, port):
        return None
    if bias_add is not None and _vector(graph, graph.input(bias_add.name, 1), channels) is None:
        return None
    return _Behind(node, channels, bias_add, TensorRef(bias_add.name) if bias_add else ref)


def _fold_scale(graph: Graph, mul: Node, keep: set[str]) -> int:
    if len(graph.inputs(mul.name)) != 2:
        return 0   # (a malformed node: the input check that follows names it)
    if not graph.is_read(mul.name) or graph.control_consumers(mul.name):
        return 0   # (an unread Mul is a graph output: its name must stay)
    for port in (0, 1):
        behind = _behind(graph, graph.input(mul.name, port), mul.name, port, keep)
        if behind is None:
            continue
        stored = _vector(graph, graph.input(mul.name, 1 - port), behind.channels)
        if stored is None:
            continue
        scale = const_values(stored).astype(np.float32).reshape(-1)   # [1, 1, 1, C] too
        _scale_filter(graph, behind, scale, keep)
        if behind.bias_add is not None:   # (x + b) * s = x * s + b * s
            _set_bias(graph, behind.bias_add, _bias(graph, behind) * scale, keep)
        graph.replace_uses(TensorRef(mul.name), behind.ref)
        _remove_unread(graph, mul.name, keep)
        return 1
    return 0


def _fold_fused(graph: Graph, bn: Node, keep: set[str]) -> int:
    """An inference ``FusedBatchNorm*`` of four Const vectors after a convolution (and its
    bias): its scale folded into the filter, its offset into one bias, the batch norm made
    that ``BiasAdd``."""
    if (bn.attr["is_training"].b if "is_training" in bn.attr else True) \
            or _data_format(bn) != b"NHWC" or len(graph.inputs(bn.name)) != 5:
        return 0
    if any(graph.consumers(bn.name, port) for port in range(1, 6)) \
            or graph.control_consumers(bn.name) or not graph.is_read(bn.name):
        return 0   # its statistics are read (or it is an output): it must stay
    behind = _behind(graph, graph.input(bn.name, 0), bn.name, 0, keep)
    if behind is None:
        return 0
    params = [_vector(graph, graph.input(bn.name, port), behind.channels) for port in (1, 2, 3, 4)]
    if any(p is None for p in params):
        return 0
    gamma, beta, mean, var = (const_values(p).astype(np.float32).reshape(-1) for p in params)
    epsilon = bn.attr["epsilon"].f if "epsilon" in bn.attr else 1e-4   # the OpDef's default
    scale = gamma / np.sqrt(var + np.float32(epsilon))
    offset = beta - mean * scale
    _scale_filter(graph, behind, scale, keep)
    if behind.bias_add is not None:
        _set_bias(graph, behind.bias_add, _bias(graph, behind) * scale + offset, keep)
        out = behind.ref
    else:
        bias = _float_const_node(graph, bn.name + "/bias", offset, after=bn.name)
        out = TensorRef(graph.add_node(
            "BiasAdd", bn.name + "/folded", [behind.ref, bias], after=bn.name,
            attrs={"T": attr_value_pb2.AttrValue(type=FLOAT),
                   "data_format": attr_value_pb2.AttrValue(s=b"NHWC")}).name)
    graph.replace_uses(TensorRef(bn.name), out)
    _remove_unread(graph, bn.name, keep)
    return 1


def _scale_filter(graph: Graph, behind: _Behind, scale: np.ndarray, keep: set[str]) -> None:
    """Multiply ``scale`` (one value per output channel) into the convolution's Const filter,
    in float32, as a new Const (the old one goes once nothing reads it)."""
    conv = behind.conv
    filter_ref = graph.input(conv.name, 1)
    weights = const_values(_float_const(graph, filter_ref)[0]).astype(np.float32)
    if conv.op == "Conv2D":
        folded = weights * scale
    else:   # [kh, kw, in, mult]: output channel i * mult + m
        folded = (weights.reshape(weights.shape[:2] + (-1,)) * scale).reshape(weights.shape)
    graph.set_input(conv.name, 1, _float_const_node(graph, conv.name + "/folded_filter",
                                                    folded, after=conv.name))
    _remove_unread(graph, filter_ref.node, keep)


def _bias(graph: Graph, behind: _Behind) -> np.ndarray:
    """The values of the bias ``behind``'s BiasAdd adds, float32, one per channel."""
    stored = _vector(graph, graph.input(behind.bias_add.name, 1), behind.channels)
    return const_values(stored).astype(np.float32).reshape(-1)


def _set_bias(graph: Graph, bias_add: Node, values: np.ndarray, keep: set[str]) -> None:
    """Make ``bias_add`` add ``values`` (a new float32 Const; the old one goes if unread)."""
    old = graph.input(bias_add.name, 1)
    graph.set_input(bias_add.name, 1, _float_const_node(graph, bias_add.name + "/folded_bias",
                                                        values, after=bias_add.name))
    _remove_unread(graph, old.node, keep)


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
        behind = _behind(graph, graph.input(add.name, port), add.name, port, keep)
        if behind is None:
            continue
        offset_ref = graph.input(add.name, 1 - port)
        stored = _vector(graph, offset_ref, behind.channels)
        if stored is None:
            continue
        if behind.bias_add is not None:   # (x + b) + o: one bias, b + o; the add becomes it
            offset = _bias(graph, behind) + const_values(stored).astype(np.float32).reshape(-1)
            old, offset_ref = offset_ref, _float_const_node(graph, add.name + "/bias", offset,
                                                            after=add.name)
            graph.set_input(add.name, 1 - port, offset_ref)
            graph.set_input(add.name, port, graph.input(behind.bias_add.name, 0))
            _remove_unread(graph, behind.bias_add.name, keep)
            _remove_unread(graph, old.node, keep)
        elif len(stored.attr["value"].tensor.tensor_shape.dim) != 1:   # [1, 1, 1, C]: a bias
            bias = const_values(stored).astype(np.float32).reshape(-1)  # is a vector
            old, offset_ref = offset_ref, _float_const_node(graph, add.name + "/bias", bias,
                                                            after=add.name)
            graph.set_input(add.name, 1 - port, offset_ref)
            _remove_unread(graph, old.node, keep)
        conv_ref = graph.input(add.name, port)
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
    if _data_format(conv) != b"NHWC":
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


def _data_format(node: Node) -> bytes:
    """The node's ``data_format`` (NHWC, the OpDefs' default, where it has none)."""
    return node.attr["data_format"].s if "data_format" in node.attr else b"NHWC"


def _float(node: Node) -> bool:
    return "T" in node.attr and node.attr["T"].type == FLOAT


def _tensor(values: np.ndarray) -> tensor_pb2.TensorProto:
    return tensor_util.make_tensor_proto(values, dtype=np.float32, shape=values.shape)
