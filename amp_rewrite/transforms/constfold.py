"""Optional float32 constant folding before painting (``--fold-constants``).

A frozen inference graph often computes from Consts alone: Keras' batch norm, for one, turns
its four vectors into a scale and an offset on every run. Painted as they are, those float32
islands feed low-precision ops through a cast each, on every run. Folding them first, in
float32, with TensorFlow's own constant folding (grappler's ``constant_folding`` pass, nothing
else), leaves Consts that painting stores in the target dtype: fewer casts, and one rounding of
the folded value instead of a rounding of each operand. Grappler does the same at run time
before it paints; this makes the saved file carry the result.

Only graphs without variables are folded: in a training graph folding would rewrite the
backprop scope that loss scaling reads.
"""

from __future__ import annotations

import logging

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
from tensorflow.python.framework import errors as tf_errors
from tensorflow.python.grappler import tf_optimizer

from ..core.errors import InputError
from ..core.ir import Graph, copy_except
from ..core.ops import VARIABLE_OPS
from ..paint import interface_names

log = logging.getLogger(__name__)

#: grappler's passes that a default session config runs (and those that paint)
GRAPPLER_PASSES = (
    "constant_folding", "layout_optimizer", "arithmetic_optimization", "remapping",
    "dependency_optimization", "loop_optimization", "function_optimization", "shape_optimization",
    "memory_optimization", "debug_stripper", "pin_to_host_optimization",
    "implementation_selector", "common_subgraph_elimination", "auto_mixed_precision",
    "auto_mixed_precision_onednn_bfloat16",
)


def grappler_alone(pass_name: str) -> config_pb2.ConfigProto:
    """A session config that runs grappler's ``pass_name`` and no other pass, on graphs of any
    size, keeping Identity nodes (so both sides of a comparison name the same nodes)."""
    config = config_pb2.ConfigProto()
    rw = config.graph_options.rewrite_options
    for name in GRAPPLER_PASSES:
        setattr(rw, name, rewriter_config_pb2.RewriterConfig.OFF)
    setattr(rw, pass_name, rewriter_config_pb2.RewriterConfig.ON)
    rw.min_graph_nodes = -1
    rw.disable_model_pruning = True
    return config


def has_variables(graph_def: graph_pb2.GraphDef) -> bool:
    return any(n.op in VARIABLE_OPS for n in graph_def.node)


#: ops that pass a value on as it is: a Const read through them is still a Const
_PASS_ON = frozenset({"Identity", "Snapshot"})
#: ops folding cannot compute from their inputs (they make values or hold state)
_NOT_FOLDED = frozenset({"Const", "NoOp", "Placeholder", "PlaceholderWithDefault",
                         "PlaceholderV2"}) | _PASS_ON | VARIABLE_OPS


def foldable(graph_def: graph_pb2.GraphDef) -> bool:
    """Whether any node of ``graph_def`` computes from Consts alone (through Identity), so
    constant folding has something to fold: grappler's pass costs seconds on a large graph
    (18 s on 77k nodes) even where it folds nothing, and batch norms frozen from Keras always
    have such nodes (their scale from four Consts)."""
    nodes = {n.name: n for n in graph_def.node}

    def const(name: str) -> bool:
        seen = set()
        node = nodes.get(name)
        while node is not None and node.op in _PASS_ON and node.name not in seen:
            seen.add(node.name)
            data = [i for i in node.input if not i.startswith("^")]
            node = nodes.get(data[0].split(":")[0]) if data else None
        return node is not None and node.op == "Const"

    for node in graph_def.node:
        if node.op in _NOT_FOLDED or any(i.startswith("^") for i in node.input):
            continue
        if node.input and all(const(i.split(":")[0]) for i in node.input):
            return True
    return False


def fold_constants(graph_def: graph_pb2.GraphDef, keep: set[str]) -> graph_pb2.GraphDef:
    """``graph_def`` with its Const-only float32 subgraphs folded; interface nodes kept by name.

    Graph inputs, outputs and ``keep`` survive under their names (grappler preserves the fetch
    nodes it is given). A graph with variables comes back unchanged.
    """
    if has_variables(graph_def):
        log.warning("--fold-constants: the graph has variables, so nothing was folded")
        return graph_def
    graph = Graph.from_graph_def(graph_def)
    preserve = sorted(set(interface_names(graph, {}, lowp_io=False)) | (keep & set(graph.names())))
    meta = meta_graph_pb2.MetaGraphDef(graph_def=graph_def)
    fetches = meta.collection_def["train_op"].node_list.value
    fetches.extend(preserve)
    config = grappler_alone("constant_folding")
    try:
        folded = tf_optimizer.OptimizeGraph(config, meta)
    except (tf_errors.OpError, ValueError) as exc:
        # grappler's refusal of the graph: a C++ status error, or "Failed to import
        # metagraph" (a ValueError); anything else (a TypeError for a config that is no
        # ConfigProto ...) is ours, an internal error
        raise InputError(f"constant folding failed: {str(exc).splitlines()[0]}") from None
    names = {n.name for n in folded.node}
    lost = [n for n in preserve if n not in names]
    if lost:  # never trade the interface for a smaller graph
        log.warning("--fold-constants: folding would drop %r, so nothing was folded", lost[0])
        return graph_def
    out = graph_pb2.GraphDef()
    copy_except(graph_def, out, "node")
    out.node.extend(_without_orphans(folded.node, graph_def.node))
    return out


def _without_orphans(folded, original):
    """``folded``'s nodes less the Consts folding left unread that something read before (the
    value a folded ``Fill`` was filled from, say): grappler keeps them when it does not prune,
    tied to the Const it folded them into by a control edge, and a frozen signature's output
    NoOp waits on every variable read it made a Const. Waiting on a Const that waits on nothing
    itself (no input, so outside any loop frame) is waiting on nothing: those edges go. An
    unread node would count as a graph output, kept float32 by name."""
    free = {n.name for n in folded if n.op == "Const" and not n.input}
    for node in folded:
        if any(i.startswith("^") and i[1:] in free for i in node.input):
            kept = [i for i in node.input if not (i.startswith("^") and i[1:] in free)]
            del node.input[:]
            node.input.extend(kept)
    read_before = {i.lstrip("^").split(":")[0] for n in original for i in n.input}
    read_now = {i.lstrip("^").split(":")[0] for n in folded for i in n.input}
    return [n for n in folded
            if not (n.op == "Const" and n.name in read_before and n.name not in read_now)]


def scales_pushed(before: graph_pb2.GraphDef, after: graph_pb2.GraphDef) -> int:
    """How many ``Mul(convolution, Const)`` TensorFlow's constant folding turned into the
    convolution with the Const multiplied into its filter (grappler's ``MulConvPushDown``, for
    ``Conv2D`` and ``Conv3D``): the convolution takes the Mul's name, so each is a node that was
    a Mul in ``before`` and is a convolution in ``after``."""
    muls = {n.name for n in before.node if n.op == "Mul"}
    return sum(1 for n in after.node if n.name in muls and n.op in _PUSHED_INTO)


#: the convolutions grappler's constant folding pushes a Mul by a Const into
_PUSHED_INTO = ("Conv2D", "Conv3D")
