"""One graph, painted and cast: the core every graph and every function body goes through.

:func:`rewrite` takes an IR graph that nothing outside it calls into (a graph's own nodes, or a
function body with its arguments and results kept float32) and converts it in place:
:func:`~amp_rewrite.check.input.check_input`, then painting, casts, the
:class:`~amp_rewrite.report.decisions.Report` and the lint.
Function libraries, loss scaling and file formats are the callers' business.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import Mapping

from tensorflow.core.framework import op_def_pb2

from ..check import lint
from ..check.input import check_input
from ..core.dtypes import HEADROOM, TARGETS
from ..core.ir import Graph
from ..paint import paint, paint_float32
from ..report.decisions import Report, build_report
from ..rules.cost_table import CostTable
from ..rules.loader import RuleSet
from ..schema.opdefs import set_call_signature
from ..schema.snapshot import Before
from ..transforms import casts, upgrades

log = logging.getLogger(__name__)

#: the warnings logged so far in the conversion of one model (None: outside one)
_WARNED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "amp_rewrite_warned", default=None)


@contextlib.contextmanager
def warnings_once():
    """Within, :func:`warn` logs each text once: the conversion of one model, where a function
    traced twice (a SavedModel's twins, docs/report.md "Counted once") warns of its Const once."""
    token = _WARNED.set(set())
    try:
        yield
    finally:
        _WARNED.reset(token)


def warn(text: str) -> None:
    """Log ``text`` as a warning, unless :func:`warnings_once` has logged it already."""
    seen = _WARNED.get()
    if seen is not None:
        if text in seen:
            return
        seen.add(text)
    log.warning(text)


@dataclass(frozen=True)
class Target:
    """What a conversion aims at: the dtype (``"float16"``/``"bfloat16"``, or ``"float32"``:
    nothing painted, a 16-bit model widened back whole), the device type
    unplaced nodes run on (``"GPU"``/``"CPU"``), and the least matrix work per element of data
    moved (:func:`~amp_rewrite.paint.costs.matrix_intensity`) worth moving to 16 bits (0: any);
    for the cost model, the shapes the graph's placeholders are fed with (name, shape), the
    batch an open first dimension stands for (None: the cost model's default) and its rates
    (None: the shipped table; :func:`amp_rewrite.rules.cost_table.choose`)."""

    dtype: str
    device: str
    min_intensity: float = 0.0
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    batch: int | None = None
    costs: CostTable | None = None


def rewrite(graph: Graph, rules: RuleSet, target: Target, *,
            keep: Mapping[str, tuple[str, str]] | None = None, lowp_io: bool = False,
            calls: Mapping[str, op_def_pb2.OpDef] | None = None,
            ranges: Mapping[str, float] | None = None,
            headroom: float = HEADROOM) -> tuple[Report, Before]:
    """Convert ``graph`` for ``target``, in place; returns the report and the record of what
    the graph was (:class:`Before`, for later lints: the graph itself is not copied).

    ``calls`` maps library function names to their signatures: a node whose op is one of them
    (a direct call) is typed by the signature.

    ``keep`` maps nodes whose dtypes must not change to the ``(code, reason)`` they are kept
    for (see :func:`~amp_rewrite.paint.paint`). ``ranges`` maps the graph's tensors
    (``node:port``) to the largest magnitude calibration observed: a node within ``headroom``
    of the target's largest value stays float32 (code ``range``).
    Raises :class:`InputError` for a graph TensorFlow would not import (the graph is then not
    changed), :class:`LintError` if the result fails the lint (our bug).
    """
    for node in graph.nodes():
        if calls and node.op in calls:
            set_call_signature(node, calls[node.op])
    check_input(graph)
    before = Before(graph)
    upgraded = upgrades.upgrade(graph, target.device)
    if target.dtype == "float32":
        painting = paint_float32(graph, rules, device=target.device, keep=keep)
    else:
        painting = paint(graph, rules, target=TARGETS[target.dtype], device=target.device,
                         keep=keep, lowp_io=lowp_io, min_intensity=target.min_intensity,
                         ranges=ranges, headroom=headroom, input_shapes=dict(target.input_shapes),
                         batch=target.batch, costs=target.costs)
    stats = casts.apply_painting(graph, painting, before)
    upgrades.restore(graph, upgraded)
    report = build_report(graph, before, painting, target=target.dtype, device=target.device,
                          rules=rules)
    report.casts_added = stats.added
    report.casts_removed = stats.removed
    report.consts_converted = stats.consts
    if painting.unfused_kept:
        report.extra["unfused_kept"] = painting.unfused_kept
    if painting.batch_kept:
        report.extra["batch"] = {"ops": sum(n for n, _ in painting.batch_kept),
                                 "pays_from": max(b for _, b in painting.batch_kept)}
    if painting.freezing:
        report.extra["freezing"] = painting.freezing
    if painting.estimate:
        report.extra["estimate"] = painting.estimate
    if before.unregistered_ops:
        report.warnings.append("ops not registered with TensorFlow left as they are: "
                               + ", ".join(sorted(before.unregistered_ops)))
    # warned of once for the whole model, by the pipeline, once every graph and body is painted
    report.low_precision_input = list(before.low_precision)
    lint.lint(graph, original=before, rules=rules,
              only=stats.touched_and_readers(graph) | set(upgraded))
    for w in report.warnings:
        warn(w)
    return report, before
