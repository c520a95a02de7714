"""One graph, painted and cast: the core every graph and every function body goes through.

:func:`rewrite` takes an IR graph that nothing outside it calls into (a graph's own nodes, or a
function body with its arguments and results kept float32) and converts it in place:
:func:`check_input`, then painting, casts, the :class:`~amp_rewrite.report.Report` and the lint.
Function libraries, loss scaling and file formats are the callers' business.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from tensorflow.core.framework import op_def_pb2

from . import casts, lint, upgrades
from .before import Before
from .dtypes import TARGETS
from .errors import InputError
from .ir import Graph
from .paint import paint
from .report import Report, build_report
from .rules import RuleSet
from .signatures import number_args, set_call_signature

log = logging.getLogger(__name__)

# Ports a graph may declare through number attrs (N of ConcatV2, num_split of Split ...) beyond
# one per data edge: the type model lists every port, so a forged N of 2**40 in a tiny file
# would otherwise exhaust memory.
_SPARE_PORTS = 1 << 20


@dataclass(frozen=True)
class Target:
    """What a conversion aims at: the dtype (``"float16"``/``"bfloat16"``), the device type
    unplaced nodes run on (``"GPU"``/``"CPU"``), and the least matrix work per element of data
    moved (:func:`~amp_rewrite.costs.matrix_intensity`) worth moving to 16 bits (0: any)."""

    dtype: str
    device: str
    min_intensity: float = 0.0


def rewrite(graph: Graph, rules: RuleSet, target: Target, *,
            keep: Mapping[str, tuple[str, str]] | None = None, lowp_io: bool = False,
            calls: Mapping[str, op_def_pb2.OpDef] | None = None) -> tuple[Report, Before]:
    """Convert ``graph`` for ``target``, in place; returns the report and the record of what
    the graph was (:class:`Before`, for later lints: the graph itself is not copied).

    ``calls`` maps library function names to their signatures: a node whose op is one of them
    (a direct call) is typed by the signature.

    ``keep`` maps nodes whose dtypes must not change to the ``(code, reason)`` they are kept
    for (see :func:`~amp_rewrite.paint.paint`).
    Raises :class:`InputError` for a graph TensorFlow would not import (the graph is then not
    changed), :class:`LintError` if the result fails the lint (our bug).
    """
    for node in graph.nodes():
        if calls and node.op in calls:
            set_call_signature(node, calls[node.op])
    check_input(graph)
    before = Before(graph)
    upgraded = upgrades.upgrade(graph, target.device)
    painting = paint(graph, rules, target=TARGETS[target.dtype], device=target.device, keep=keep,
                     lowp_io=lowp_io, min_intensity=target.min_intensity)
    stats = casts.apply_painting(graph, painting, before)
    upgrades.restore(graph, upgraded)
    report = build_report(graph, before, painting, target=target.dtype, device=target.device,
                          rules=rules)
    report.casts_added = stats.added
    report.casts_removed = stats.removed
    report.consts_converted = stats.consts
    if painting.unfused_kept:
        report.extra["unfused_kept"] = painting.unfused_kept
    if before.unregistered_ops:
        report.warnings.append("ops not registered with TensorFlow left as they are: "
                               + ", ".join(sorted(before.unregistered_ops)))
    if before.low_precision:
        report.warnings.append(f"the input already has {len(before.low_precision)} "
                               f"low-precision nodes (e.g. {before.low_precision[0]!r}); they are "
                               "left as they are")
    lint.lint(graph, original=before, rules=rules,
              only=stats.touched_and_readers(graph) | set(upgraded))
    for w in report.warnings:
        log.warning(w)
    return report, before


def check_input(graph: Graph) -> None:
    """Refuse, with an :class:`InputError` naming the node, a graph TensorFlow would not import.

    Port counts must be sane before anything lists ports; then the lint's checks (each input's
    arity and dtype matches its OpDef, type attrs hold allowed dtypes) run on the input, so a
    broken input is reported as the user's problem, not as a failed lint of our output.
    """
    declared = 0
    budget = None   # counted only once the ports declared pass the spare: edges cost a pass
    for node in graph.nodes():
        if node.op == "Const":
            _check_const(node)
        for name in number_args(node.op):
            n = node.attr[name].i if name in node.attr else -1
            declared += max(n, 0)
            if declared > _SPARE_PORTS and budget is None:
                budget = _SPARE_PORTS + sum(1 for _ in graph.data_edges())
            if n < 0 or (budget is not None and declared > budget):
                raise InputError(f"node {node.name!r} ({node.op}) has {name}={n}, "
                                 "not a usable port count")
    problems = lint.lint_problems(graph, imported=True)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"the input graph is not valid: {problems[0]}{more}")


def _check_const(node) -> None:
    # TensorFlow refuses a Const whose tensor is not of its dtype; converting its values would
    # silently reinterpret them
    have = node.attr["value"].tensor.dtype if "value" in node.attr else None
    want = node.attr["dtype"].type if "dtype" in node.attr else None
    if have is None or have != want:
        raise InputError(f"Const {node.name!r}: its value is missing or not a tensor of its dtype")
