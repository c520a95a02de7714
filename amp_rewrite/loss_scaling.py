"""Training graphs: FP32 master weights and loss scaling inside the converted graph.

Runs after painting and casts (so gradient MatMuls are already low precision and each update
already reads a float32 gradient). :func:`apply` finds the backward pass
(:mod:`amp_rewrite.training.detect`), multiplies each backprop seed by the scale, divides each
gradient by it in float32, checks all gradients for finiteness at once and skips every update
of a non-finite step (:mod:`amp_rewrite.training.scaling`); the scale and its counters are
variables (:mod:`amp_rewrite.training.state`). README "Training graphs and loss scaling"
documents the modes, the names users fetch and the skip semantics.

Also the convert command's flags for it (``add_convert_arguments`` / ``convert_options``).
"""

from __future__ import annotations

import logging
import math

from . import functions
from .errors import InputError, UnsupportedGraphError
from .training.detect import find_backprop, training_functions
from .training.scaling import SCOPE, ScaleConfig, insert_loss_scaling
from .training.state import add_to_collections, add_to_saver, has_saver, hook_init_ops

log = logging.getLogger(__name__)

DEFAULTS = {"start": 2.0 ** 15, "interval": 2000, "factor": 2.0}
#: tensors a user fetches to watch the loss scale (stable names, README)
FETCH = {
    "scale": f"{SCOPE}/scale/Read/ReadVariableOp:0",
    "skipped_steps": f"{SCOPE}/skipped_steps/Read/ReadVariableOp:0",
    "good_steps": f"{SCOPE}/good_steps/Read/ReadVariableOp:0",
    "all_finite": f"{SCOPE}/all_finite:0",
}


def scale_config(loss_scale, target: str, options: dict) -> ScaleConfig | None:
    """The requested scaling, or None for ``none`` (the default for bfloat16)."""
    if loss_scale is None:
        loss_scale = "dynamic" if target == "float16" else "none"
    text = str(loss_scale).strip().lower()
    unknown = set(options) - set(DEFAULTS) - {"loss", "grads"}
    if unknown:
        raise InputError(f"unknown loss-scale option {sorted(unknown)[0]!r}")
    start = _number(options.get("start", DEFAULTS["start"]), "--loss-scale-start", minimum=0.0)
    interval = options.get("interval", DEFAULTS["interval"])
    factor = _number(options.get("factor", DEFAULTS["factor"]), "--loss-scale-factor", minimum=1.0)
    if not isinstance(interval, int) or interval < 1:
        raise InputError(f"--loss-scale-interval must be a whole number of steps >= 1, not {interval!r}")
    if text == "none":
        return None
    if text == "dynamic":
        return ScaleConfig("dynamic", start, interval, factor)
    return ScaleConfig("static", _number(text, "--loss-scale", minimum=0.0))


def _number(value, flag: str, minimum: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{flag} must be 'dynamic', 'none' or a number, not {value!r}"
                         if flag == "--loss-scale" else f"{flag} must be a number, not {value!r}") from None
    if not math.isfinite(number) or number <= minimum:
        raise InputError(f"{flag} must be a finite number above {minimum:g}, not {value!r}")
    if number > _FLOAT32_MAX:  # the scale is a float32 variable: it would be inf, every step skipped
        raise InputError(f"{flag} must fit in float32 (at most {_FLOAT32_MAX:.4g}), not {value!r}")
    return number


_FLOAT32_MAX = 3.4028234663852886e38


def apply(graph, model, options, report) -> bool:
    """Add loss scaling to ``graph`` (in place) if it trains; returns whether it changed the graph.

    What was found and done is recorded in ``report.extra["loss_scaling"]``.
    ``model`` is the loaded :class:`~amp_rewrite.load.Model`; its MetaGraph (if any) gets the
    new variables in its ``variables`` collection. Raises
    :class:`~amp_rewrite.errors.UnsupportedGraphError` when the graph trains but its seed or
    updates cannot be identified without doubt, or when a library function it calls trains.
    """
    extra = dict(options.loss_scale_options or {})
    config = scale_config(options.loss_scale, options.target, extra)
    if config is None:
        return False
    _refuse_training_functions(model)
    backprop = find_backprop(graph, loss=extra.get("loss"), grads=list(extra.get("grads") or ()))
    if backprop is None:
        return False
    meta_graph = getattr(model, "meta_graph", None)
    added = insert_loss_scaling(graph, backprop, config)
    init_ops = hook_init_ops(graph, meta_graph, _init_group(graph, added))
    in_collection = add_to_collections(meta_graph, added.variables)
    in_saver = add_to_saver(graph, meta_graph, added.variables)
    if not in_saver and has_saver(graph):
        _warn(report, "the graph's Saver is sharded or not V2: the loss-scale variables are not "
                      "in it, so checkpoints will not keep them")
    if not init_ops:
        _warn(report, f"no init op groups the initializers of all global variables: run "
                      f"{SCOPE}/init once before training")
    report.extra["loss_scaling"] = {
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
    log.info("loss scaling: %s", report.extra["loss_scaling"]["summary"])
    return True


def _refuse_training_functions(model) -> None:
    """Refuse a train step inside a library function the graph calls (an outer tf.function
    calling an inner GradientTape step, exported as a graph): loss scaling is added to the
    graph's own nodes only, so the function's float16 backprop would run unscaled."""
    graph_def = getattr(model, "graph_def", None)
    if graph_def is None or not graph_def.library.function:
        return
    train = training_functions(graph_def.library, functions.reachable(graph_def.node, graph_def.library))
    if train:
        names = ", ".join(repr(name) for name in train)
        which = f"function {names} trains" if len(train) == 1 else f"functions {names} train"
        raise UnsupportedGraphError(
            f"{model.path}: {which} (gradients and variable updates inside a "
            "library function); amp-rewrite adds loss scaling only to a train step in the graph "
            "itself, so float16 gradients in the function would go unscaled and may underflow "
            "to zero. Convert with --target bfloat16 (no loss scaling needed), or with "
            "--loss-scale none (accepting unscaled float16 gradients)")


def _warn(report, text: str) -> None:
    report.warnings.append(text)
    log.warning(text)


def _init_group(graph, added) -> str:
    from .training.nodes import noop
    return noop(graph, f"{SCOPE}/init", control=[v.initializer for v in added.variables])


def _summary(config: ScaleConfig, backprop, added) -> str:
    how = (f"dynamic (start {config.start:g}, x{config.factor:g} after {config.interval} finite "
           f"steps)" if config.mode == "dynamic" else f"static {config.start:g}")
    return (f"{how}; seed {', '.join(backprop.seeds)}; {len(backprop.gradients)} gradients, "
            f"{len(backprop.updates)} updates gated; scale in {FETCH['scale']}")


# ----------------------------------------------------------------- convert command hooks
def add_convert_arguments(parser) -> None:
    group = parser.add_argument_group("training graphs")
    group.add_argument("--loss-scale", metavar="dynamic|none|N",
                       help="loss scaling for training graphs (default: dynamic for float16, "
                            "none for bfloat16; a number is a static scale)")
    group.add_argument("--loss-scale-start", type=float, metavar="S",
                       help=f"first dynamic scale (default {DEFAULTS['start']:g})")
    group.add_argument("--loss-scale-interval", type=int, metavar="STEPS",
                       help=f"finite steps before the scale grows (default {DEFAULTS['interval']})")
    group.add_argument("--loss-scale-factor", type=float, metavar="F",
                       help=f"growth and shrink factor (default {DEFAULTS['factor']:g})")
    group.add_argument("--loss", metavar="NAME", help="the loss tensor whose backprop seed to scale")
    group.add_argument("--grad", action="append", default=[], metavar="NAME",
                       help="a backprop seed (the gradient fed to tf.gradients / the tape), repeatable")


def convert_options(args) -> dict:
    extra = {key: value for key, value in (("start", args.loss_scale_start),
                                            ("interval", args.loss_scale_interval),
                                            ("factor", args.loss_scale_factor),
                                            ("loss", args.loss)) if value is not None}
    if args.grad:
        extra["grads"] = list(args.grad)
    return {"loss_scale": args.loss_scale, "loss_scale_options": extra}
