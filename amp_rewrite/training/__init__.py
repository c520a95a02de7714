"""Training graphs: FP32 master weights and loss scaling inside the converted graph.

Runs on a graph already painted and cast (gradient MatMuls are low precision, each update reads
a float32 gradient). :func:`add_loss_scaling` finds the backward pass (:mod:`.detect`),
multiplies each backprop seed by the scale, divides each gradient by it in float32, checks all
gradients for finiteness at once and skips every update of a non-finite step (:mod:`.scaling`);
the scale and its counters are variables wired into the init op, the MetaGraph's ``variables``
collection and the Saver (:mod:`.state`). README "Training graphs and loss scaling" documents
the modes, the names users fetch and the skip semantics.
"""

from __future__ import annotations

import logging

from tensorflow.core.framework import function_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from ..errors import UnsupportedGraphError
from ..ir import Graph
from ..library import reachable
from ..report import Report
from . import nodes as nd
from ..loss_scale import DEFAULTS, HINTS, ScaleConfig, scale_config
from .detect import Backprop, find_backprop, training_functions, training_parts
from .scaling import Added, insert_loss_scaling
from .saved_step import add_saved_model_loss_scaling
from .state import SCOPE, add_to_collections, add_to_saver, has_saver, hook_init_ops

__all__ = ["DEFAULTS", "FETCH", "HINTS", "SCOPE", "ScaleConfig", "add_loss_scaling",
           "add_saved_model_loss_scaling", "scale_config", "training_parts"]

log = logging.getLogger(__name__)

#: tensors a user fetches to watch the loss scale (stable names, README)
FETCH = {
    "scale": f"{SCOPE}/scale/Read/ReadVariableOp:0",
    "skipped_steps": f"{SCOPE}/skipped_steps/Read/ReadVariableOp:0",
    "good_steps": f"{SCOPE}/good_steps/Read/ReadVariableOp:0",
    "all_finite": f"{SCOPE}/all_finite:0",
}


def add_loss_scaling(graph: Graph, meta_graph: meta_graph_pb2.MetaGraphDef | None,
                     library: function_pb2.FunctionDefLibrary, config: ScaleConfig,
                     hints: dict, report: Report) -> bool:
    """Add loss scaling to ``graph`` (in place) if it trains; returns whether it changed it.

    ``meta_graph`` (None for a bare GraphDef) gets the new variables in its ``variables``
    collection, in place; ``library`` is the graph's function library (a train step inside a
    function it calls is refused); ``hints`` may name the ``loss`` and the seeds (``grads``).
    What was found and done is recorded in ``report.extra["loss_scaling"]``. Raises
    :class:`UnsupportedGraphError` when the graph trains but its seed or updates cannot be
    identified without doubt.
    """
    _refuse_training_functions(graph, library)
    backprop = find_backprop(graph, loss=hints.get("loss"), grads=list(hints.get("grads") or ()))
    if backprop is None:
        return False
    added = insert_loss_scaling(graph, backprop, config)
    ours = nd.noop(graph, f"{SCOPE}/init", control=[v.initializer for v in added.variables])
    init_ops = hook_init_ops(graph, meta_graph, ours)
    in_collection = add_to_collections(meta_graph, added.variables)
    in_saver = add_to_saver(graph, meta_graph, added.variables)
    if not in_saver and has_saver(graph):
        _warn(report, "the graph's Saver is sharded or not V2: the loss-scale variables are not "
                      "in it, so checkpoints will not keep them")
    if not init_ops:
        _warn(report, f"no init op groups the initializers of all global variables: run "
                      f"{SCOPE}/init once before training")
    report.extra["loss_scaling"] = _record(graph, config, backprop, added, init_ops,
                                           in_collection, in_saver)
    log.info("loss scaling: %s", report.extra["loss_scaling"]["summary"])
    return True


def _refuse_training_functions(graph: Graph, library) -> None:
    """Refuse a train step inside a library function the graph calls (an outer tf.function
    calling an inner GradientTape step, exported as a graph): loss scaling is added to the
    graph's own nodes only, so the function's float16 backprop would run unscaled."""
    if not library.function:
        return
    train = training_functions(library, reachable((n.proto for n in graph.nodes()), library))
    if train:
        names = ", ".join(repr(name) for name in train)
        which = f"function {names} trains" if len(train) == 1 else f"functions {names} train"
        raise UnsupportedGraphError(
            f"{which} (gradients and variable updates inside a "
            "library function); amp-rewrite adds loss scaling only to a train step in the graph "
            "itself, so float16 gradients in the function would go unscaled and may underflow "
            "to zero. Convert with --target bfloat16 (no loss scaling needed), or with "
            "--loss-scale none (accepting unscaled float16 gradients)")


def _record(graph: Graph, config: ScaleConfig, backprop: Backprop, added: Added, init_ops,
            in_collection: bool, in_saver: bool) -> dict:
    """The report's ``loss_scaling`` section (README "Report schema")."""
    return {
        "mode": config.mode, "start": config.start,
        **({"interval": config.interval, "factor": config.factor} if config.mode == "dynamic" else {}),
        "seeds": backprop.seeds, "gradients": [str(g) for g in backprop.gradients],
        "after_all_reduce": backprop.all_reduced,
        "updates": [{"name": u, "op": graph.node(u).op} for u in backprop.updates],
        "gated_writes": added.gated_writes, "train_ops": added.train_ops, "init_ops": init_ops,
        "variables": [v.name for v in added.variables], "in_collection": in_collection,
        "in_saver": in_saver,
        "fetch": {k: v for k, v in FETCH.items() if k != "good_steps" or config.mode == "dynamic"},
        "summary": _summary(config, backprop, added),
    }


def _warn(report: Report, text: str) -> None:
    report.warnings.append(text)
    log.warning(text)


def _summary(config: ScaleConfig, backprop: Backprop, added: Added) -> str:
    how = (f"dynamic (start {config.start:g}, x{config.factor:g} after {config.interval} finite "
           f"steps)" if config.mode == "dynamic" else f"static {config.start:g}")
    return (f"{how}; seed {', '.join(backprop.seeds)}; {len(backprop.gradients)} gradients, "
            f"{len(backprop.updates)} updates gated; scale in {FETCH['scale']}")
