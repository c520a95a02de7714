"""One signature frozen: TensorFlow's ``convert_variables_to_constants_v2``, step by step, with
the variables too large to be Consts kept.

TensorFlow's function (the one TF-TRT runs) inlines the signature's functions with grappler,
reads every variable the signature captures into a numpy array, writes each as a Const and
imports the graph again. A Const is a protobuf message, and protobuf holds at most 2 GB in one:
a tensor past it, or weights whose Consts pass it together, fail there, after minutes and
several copies of the weights in memory. :func:`freeze_function` runs the same steps with the
variables ``kept`` left out of the reading: each becomes a Placeholder of its dtype and shape
marked :data:`~amp_rewrite.core.ops.STORED_VARIABLE`, which every op that read the variable now
reads as it would the Const (TensorFlow's own rewiring: a ``ReadVariableOp`` becomes an
``Identity``, a ``ResourceGather`` a ``GatherV2``, a function argument takes its dtype), so
painting weighs it as a stored weight and picks the dtype it is stored in, and
:func:`amp_rewrite.io.frozen.write` makes it a variable of that dtype again. With nothing kept,
the result is ``convert_variables_to_constants_v2``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context, wrap_function
from tensorflow.python.framework import convert_to_constants as tf_freezing
from tensorflow.python.util import object_identity

from ..core.ops import STORED_VARIABLE


#: the attr of a stand-in naming the variable it stands for (an index into the caller's list)
KEPT_INDEX = "_amp_kept_index"


@dataclass(frozen=True)
class StandIn:
    """What the Placeholder standing for a kept variable says of it: which variable (an index
    into the caller's list), its dtype (an enum), its shape and the largest finite magnitude it
    holds (negative: not measured)."""

    index: int
    dtype: int
    shape: tuple[int, ...]
    largest: float = -1.0


def freeze_function(fn, kept: Mapping[str, StandIn], out) -> tuple[list[str], list[str]]:
    """``fn`` (a signature's concrete function) frozen as ``convert_variables_to_constants_v2``
    freezes it, except the captured variables ``kept`` (their placeholders' node names in
    ``fn.graph``), which become stand-ins (the module doc), into the empty GraphDef ``out``;
    returns its input tensors' names (``fn``'s data inputs, then its captures not made
    Consts, stand-ins included) and its outputs'. Raises what TensorFlow's function raises."""
    data = tf_freezing._FunctionConverterDataInEager(   # pylint: disable=protected-access
        func=fn, lower_control_flow=True, aggressive_inlining=False,
        variable_names_denylist=set(kept))
    graph = tf_freezing._GraphDef(data.graph_def)   # pylint: disable=protected-access
    for name, tensor in data.tensor_data.items():
        graph.nodes[name].convert_variable_to_constant(None, tensor)
    for name, spec in sorted(kept.items()):
        if name in graph.nodes:   # (a capture the signature does not read is pruned)
            _stand_in(graph, name, spec)
    converted = graph.converted_self().graph_def
    made_consts = {t.index for t in data.tensor_data.values() if t.index is not None}
    del data, graph   # the variables' values, read: the Consts hold them now
    hollow, held = hollowed(converted)
    new = _imported(fn, hollow, made_consts, set(kept))
    out.CopyFrom(new.graph.as_graph_def())
    names = [t.name for t in new.inputs], [t.name for t in new.outputs]
    del new, hollow
    for node in out.node:
        if node.name in held and node.op == "Const":
            node.attr["value"].tensor.CopyFrom(held.pop(node.name).attr["value"].tensor)
        elif node.name in kept and node.op == "Placeholder":   # (importing drops the marks)
            _mark(node, kept[node.name])
    return names


#: the packed bytes past which a Const is imported without them (:func:`hollowed`)
_HOLLOW_BYTES = 1 << 16


def hollowed(graph_def):
    """A copy of ``graph_def`` with each large Const's packed values left out (its dtype and
    shape kept), and those Consts of ``graph_def`` by name, to import the graph without its
    weights and put them back once: TensorFlow's import holds them three or four times (the
    serialized graph, the imported one, its pruned copy, its GraphDef again) and took seconds
    a hundred megabytes, where pruning and completing the graph need no Const's values."""
    hollow, held = type(graph_def)(), {}
    for field, value in graph_def.ListFields():
        if field.name != "node":
            getattr(hollow, field.name).CopyFrom(value)
    for node in graph_def.node:
        tensor = node.attr["value"].tensor if node.op == "Const" else None
        if tensor is None or len(tensor.tensor_content) < _HOLLOW_BYTES:
            hollow.node.add().CopyFrom(node)
            continue
        held[node.name] = node
        copy = hollow.node.add(name=node.name, op=node.op, input=node.input, device=node.device)
        for key, attr in node.attr.items():
            if key != "value":
                copy.attr[key].CopyFrom(attr)
        copy.attr["value"].tensor.dtype = tensor.dtype
        copy.attr["value"].tensor.tensor_shape.CopyFrom(tensor.tensor_shape)
    return hollow, held


def _stand_in(graph, name: str, spec: StandIn) -> None:
    """Make the captured variable's placeholder ``name`` the stand-in ``spec``, and let every
    op that read the variable read it as TensorFlow lets them read a Const: its zeros are a
    broadcast view, never allocated (TensorFlow reads only their shape: a While's)."""
    convertible = graph.nodes[name]
    node = convertible.converted_self().node
    node.Clear()
    node.name, node.op = name, "Placeholder"
    node.attr["dtype"].type = spec.dtype
    node.attr["shape"].shape.CopyFrom(tf.TensorShape(spec.shape).as_proto())
    _mark(node, spec)
    zeros = np.broadcast_to(np.zeros((), tf.as_dtype(spec.dtype).as_numpy_dtype), spec.shape)
    tensor = tf_freezing._TensorData(numpy=zeros, dtype=spec.dtype, index=None)  # pylint: disable=protected-access
    for edge in convertible.outgoing_edges:
        edge.destination.convertible.convert_variable_to_constant(edge, tensor)


def _mark(node, spec: StandIn) -> None:
    node.attr[STORED_VARIABLE].f = spec.largest
    node.attr[KEPT_INDEX].i = spec.index


def _imported(fn, graph_def, made_consts: set[int], kept: set[str]):
    """The frozen ``graph_def`` as a concrete function, as TensorFlow's
    ``_construct_concrete_function`` makes it: its inputs ``fn``'s not made Consts, their
    static shapes set again (a stand-in has its own: the variable's, not its handle's)."""
    captures = fn.graph.internal_captures
    consts = object_identity.ObjectIdentitySet([captures[i] for i in made_consts])
    inputs = [t for t in fn.inputs if t not in consts]
    for f in graph_def.library.function:   # TensorFlow's: no stale function of the same name
        if context.context().has_function(f.signature.name):
            context.context().remove_function(f.signature.name)
    new = wrap_function.function_from_graph_def(graph_def, [t.name for t in inputs],
                                                [t.name for t in fn.outputs])
    shapes = {t.name: t.shape for t in inputs if t.name.split(":")[0] not in kept}
    for tensor in new.inputs:
        if tensor.name in shapes:
            tensor.set_shape(shapes[tensor.name])
    return new
