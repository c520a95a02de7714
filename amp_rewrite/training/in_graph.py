"""Loss scaling of a training graph's own nodes, and the state a function train step needs.

Runs on a graph already painted and cast (gradient MatMuls are low precision, each update reads
a float32 gradient). :func:`add_loss_scaling` finds the backward pass (:mod:`.detect`),
multiplies each backprop seed by the scale, divides each gradient by it in float32, checks all
gradients for finiteness at once and skips every update of a non-finite step (:mod:`.scaling`);
the scale and its counters are variables wired into the init op, the MetaGraph's ``variables``
collection and the Saver (:mod:`.state`). For a graph whose train step is a library function,
:func:`add_function_state` adds those variables for :mod:`.in_functions` to pass into it. The
user guide's "Training graphs and loss scaling" documents the modes, the names users fetch and
the skip semantics.
"""

from __future__ import annotations

import logging

from tensorflow.core.framework import function_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from ..core.dtypes import FLOAT, INT64
from ..core.errors import UnsupportedGraphError
from ..core.ir import Graph
from ..report.decisions import Report
from ..schema.functiondef import reachable
from . import nodes as nd
from .config import ScaleConfig
from .detect import Backprop, find_backprop, training_functions
from .scaling import Added, insert_loss_scaling
from .state import (
    SCOPE,
    add_to_collections,
    add_to_saver,
    add_variable,
    has_saver,
    hook_init_ops,
    refuse_scaled,
)

__all__ = ["FETCH", "add_function_state", "add_loss_scaling", "function_train_steps"]

log = logging.getLogger(__name__)

#: tensors a user fetches to watch the loss scale (stable names, README)
FETCH = {
    "scale": f"{SCOPE}/scale/Read/ReadVariableOp:0",
    "skipped_steps": f"{SCOPE}/skipped_steps/Read/ReadVariableOp:0",
    "good_steps": f"{SCOPE}/good_steps/Read/ReadVariableOp:0",
    "all_finite": f"{SCOPE}/all_finite:0",
}


def add_loss_scaling(graph: Graph, meta_graph: meta_graph_pb2.MetaGraphDef | None,
                     config: ScaleConfig, hints: dict, report: Report) -> bool:
    """Add loss scaling to ``graph`` (in place) if it trains; returns whether it changed it.

    ``meta_graph`` (None for a bare GraphDef) gets the new variables in its ``variables``
    collection, in place (a train step inside a function the graph calls is
    :func:`add_function_state`'s and :func:`scale_train_functions`' case, which
    :func:`~amp_rewrite.conversion.graph.convert_graph` takes first); ``hints`` may name the ``loss`` and
    the seeds (``grads``).
    What was found and done is recorded in ``report.extra["loss_scaling"]``. Raises
    :class:`UnsupportedGraphError` when the graph trains but its seed or updates cannot be
    identified without doubt.
    """
    backprop = find_backprop(graph, loss=hints.get("loss"), grads=list(hints.get("grads") or ()))
    if backprop is None:
        return False
    added = insert_loss_scaling(graph, backprop, config)
    init_ops, in_collection, in_saver = _register(graph, meta_graph, added.variables, report)
    report.extra["loss_scaling"] = _record(graph, config, backprop, added, init_ops,
                                           in_collection, in_saver)
    log.info("loss scaling: %s", report.extra["loss_scaling"]["summary"])
    return True


def function_train_steps(graph: Graph, library: function_pb2.FunctionDefLibrary) -> list[str]:
    """The library functions ``graph`` calls (directly or not) whose bodies train."""
    if not library.function:
        return []
    return training_functions(library, reachable((n.proto for n in graph.nodes()), library))


def add_function_state(graph: Graph, meta_graph: meta_graph_pb2.MetaGraphDef | None,
                       train: list[str], config: ScaleConfig, hints: dict, report: Report) -> dict:
    """For a graph whose train step is a library function (``train``): the loss-scale variables
    in the graph (in place), initialized by its init op, in its ``variables`` collection and its
    Saver, for :func:`scale_train_functions` to pass into the step. Returns what the report's
    ``loss_scaling`` section adds about them."""
    names = ", ".join(repr(name) for name in train)
    if hints.get("loss") or hints.get("grads"):
        raise UnsupportedGraphError(f"--loss and --grad name nodes of the graph, but its train "
                                    f"step is in function {names}; drop them")
    if find_backprop(graph) is not None:
        raise UnsupportedGraphError(f"both the graph and function {names} train; amp-rewrite "
                                    "scales one train step: convert with --loss-scale none or "
                                    "--target bfloat16")
    refuse_scaled(graph)
    variables = [add_variable(graph, f"{SCOPE}/scale", config.start, FLOAT),
                 add_variable(graph, f"{SCOPE}/skipped_steps", 0, INT64),
                 add_variable(graph, f"{SCOPE}/good_steps", 0, INT64)]
    init_ops, in_collection, in_saver = _register(graph, meta_graph, variables, report)
    return {"init_ops": init_ops, "in_collection": in_collection, "in_saver": in_saver,
            "fetch": {k: v for k, v in FETCH.items() if k != "all_finite"}}


def _register(graph: Graph, meta_graph, variables, report: Report) -> tuple[list[str], bool, bool]:
    """The state variables run by the graph's init ops (and ``amp_loss_scale/init``), in its
    ``variables`` collection and its Saver; returns the init ops hooked and whether the
    collection and the Saver took them (the report warns where not)."""
    ours = nd.noop(graph, f"{SCOPE}/init", control=[v.initializer for v in variables])
    init_ops = hook_init_ops(graph, meta_graph, ours)
    in_collection = add_to_collections(meta_graph, variables)
    in_saver = add_to_saver(graph, meta_graph, variables)
    if not in_saver and has_saver(graph):
        _warn(report, "the graph's Saver is sharded or not V2: the loss-scale variables are not "
                      "in it, so checkpoints will not keep them")
    if not init_ops:
        _warn(report, f"no init op groups the initializers of all global variables: run "
                      f"{SCOPE}/init once before training")
    return init_ops, in_collection, in_saver


def _record(graph: Graph, config: ScaleConfig, backprop: Backprop, added: Added, init_ops,
            in_collection: bool, in_saver: bool) -> dict:
    """The report's ``loss_scaling`` section (docs/report.md "Report schema")."""
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
