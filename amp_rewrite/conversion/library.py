"""Painting a function library: every function a graph reaches, and the boundaries between them.

Each reachable body is converted like a graph (:func:`~amp_rewrite.conversion.rewrite.rewrite`)
with its arguments and results kept float32, so casts first sit just inside the boundary; then
:class:`~amp_rewrite.transforms.boundaries.BoundaryLowering` moves boundaries that only carry
casts into low precision, in the functions and at the graph's own call sites. Functions a SavedModel
restores (the roots) and those the gradient tables name keep their signatures. The report names
each body's nodes ``function/node``; rule-file overrides and ``--keep`` take the same names.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Collection, Mapping

from tensorflow.core.framework import graph_pb2

from ..check import lint
from ..core.dtypes import FLOAT, HEADROOM, TARGETS
from ..core.errors import InputError, LintError
from ..core.ir import Graph
from ..report.decisions import Report, did_you_mean
from ..rules.loader import RuleSet
from ..schema.functiondef import (
    FunctionGraph,
    argument_shapes,
    check_call_types,
    drop_unreachable,
    function_to_graph,
    gradient_linked,
    graph_to_function,
    is_concrete,
    reachable,
    variable_argument_shapes,
)
from ..schema.opdefs import graph_with_defaults, strip_graph_defaults
from ..training.detect import trains
from ..transforms.boundaries import BoundaryLowering
from .rewrite import Target, rewrite

log = logging.getLogger(__name__)


def paint_library(graph_def: graph_pb2.GraphDef, rules: RuleSet, report: Report, target: Target,
                  *, keep: Collection[str] = (), roots: Collection[str] = (),
                  interface: Collection[str] = (), lower: bool = True,
                  ranges: Mapping[str, float] | None = None, headroom: float = HEADROOM,
                  leave: Collection[str] = ()) -> None:
    """Paint, in place, every library function reachable from ``graph_def``'s nodes or ``roots``.

    ``roots`` (a SavedModel's concrete functions) keep their signatures; ``leave`` names
    functions kept as they are, unpainted (train methods no signature reaches that loss
    scaling would refuse: docs/training.md): a function they call is painted only where something else
    reaches it, and keeps its signature, so their calls still fit; ``interface`` names the
    graph's nodes whose outputs are fetched (signature tensors), and ``keep`` the ``--keep``
    names: their dtypes never change, nor those of graph outputs nothing reads. Function nodes
    are added to ``report`` as ``function/node``. ``lower=False`` keeps every boundary float32
    (for comparison: benchmarks/functions.py). ``ranges`` is the calibration, its tensors
    inside functions named ``function/node:port`` (see :func:`scoped_ranges`). Raises
    :class:`LintError` if a call site's types and its callee's signature disagree afterwards.
    """
    library = graph_def.library
    names = reachable(graph_def.node, library, set(roots) - set(leave))
    if not names:
        return
    signatures = {f.signature.name: f.signature for f in library.function}
    by_name = {f.signature.name: f for f in library.function}
    graphs: dict[str, FunctionGraph] = {}
    calibrated = retraced(scoped_ranges(ranges or {}, names), [by_name[n] for n in names])
    handles = variable_argument_shapes(graph_def)   # the cost model's weight shapes in bodies
    # --shape's inputs, through the calls that pass them on, their batch left open: a body is
    # weighed per sample, the weight casts shared by the batch (target.batch), as in the graph
    fed = argument_shapes(graph_def, {name: (-1, *dims[1:]) if dims else dims
                                      for name, dims in target.input_shapes})
    for name in names:
        shapes = tuple(sorted(fed.get(name, {}).items()))
        body_target = dataclasses.replace(target, input_shapes=shapes)
        fg = _convert_function(by_name[name], library, signatures, rules, report, body_target,
                               keep, calibrated.get(name), headroom, handles.get(name))
        if fg is not None:
            graphs[name] = fg
    kept_signatures = set(roots) | gradient_linked(library) | set(reachable((), library, leave))
    # float32: no cast to a 16-bit dtype was painted, so no boundary carries one
    lowering = _lower(graph_def, graphs, kept_signatures, signatures,
                      TARGETS.get(target.dtype, FLOAT), report, set(interface) | set(keep),
                      rounds=8 if lower and target.dtype in TARGETS else 0)
    for name in names:
        if name in graphs:
            by_name[name].CopyFrom(graph_to_function(graphs[name], signatures))
    for name in lowering.callees.specialized:
        library.function.add().CopyFrom(graph_to_function(graphs[name], signatures))
    drop_unreachable(graph_def, set(names) - kept_signatures, roots)
    problems = check_call_types(graph_def)
    if problems:
        raise LintError(problems)


def _lower(graph_def, graphs, roots, signatures, target, report, protected,
           rounds) -> BoundaryLowering:
    """Run :class:`BoundaryLowering` over the functions and ``graph_def``'s own nodes, lint
    what changed, write the graph's nodes back and record the result in ``report``."""
    main, added = graph_with_defaults(graph_def)
    lowering = BoundaryLowering(graphs, main, roots, signatures, target,
                                inserted=set(report.casts_added), protected=protected)
    lowering.run(rounds)
    changed = lowering.callees.changed
    for owner in sorted(changed, key=str):
        lint.lint(main if owner is None else graphs[owner].graph)
    if None in changed:
        out = main.to_graph_def()
        strip_graph_defaults(out, added)
        del graph_def.node[:]
        graph_def.node.extend(out.node)
    if lowering.lowered:
        report.extra["boundaries"] = lowering.summary()
        # casts we inserted and then moved are simply not there; only the input's own count
        # as removed
        casts = lowering.casts
        gone = set(casts.removed)
        report.casts_added[:] = [n for n in report.casts_added + casts.added
                                 + lowering.callees.copied_casts if n not in gone]
        report.casts_removed.extend(casts.input_removed)
    return lowering


def scoped_ranges(ranges: Mapping[str, float], functions: Collection[str]
                  ) -> dict[str, dict[str, float]]:
    """The calibration of each of ``functions``: its tensors ``function/node:port`` as the body
    names them, ``node:port`` (the names the replay records, a function's arguments included)."""
    wanted = set(functions)
    out: dict[str, dict[str, float]] = {}
    for tensor, value in ranges.items():
        head, sep, rest = tensor.partition("/")
        while sep and head not in wanted:    # a function whose name holds a slash
            more, sep, rest = rest.partition("/")
            head = f"{head}/{more}"
        if sep:
            out.setdefault(head, {})[rest] = value
    return out


_TRACE_NUMBER = re.compile(r"_\d+$")


def retraced(calibrated: dict[str, dict[str, float]], fdefs) -> dict[str, dict[str, float]]:
    """``calibrated`` with, for each function of ``fdefs`` the calibration did not run, the
    calibration of one it ran that is the same Python function traced again: the same name
    but for TensorFlow's trace number (``__inference_block_81`` and ``__inference_block_47``)
    and the same nodes, by name and op. A SavedModel holds such twins (its signature's trace
    of a method, and the restored object's), and a calibration runs one signature's."""
    shape = {f.signature.name: sorted((nd.name, nd.op) for nd in f.node_def) for f in fdefs}
    runs: dict[str, list[str]] = {}
    for name in calibrated:
        if name in shape:
            runs.setdefault(_TRACE_NUMBER.sub("", name), []).append(name)
    out = dict(calibrated)
    for name in shape:
        if name in out:
            continue
        twin = next((run for run in runs.get(_TRACE_NUMBER.sub("", name), ())
                     if shape[run] == shape[name]), None)
        if twin is not None:
            out[name] = calibrated[twin]
    return out


def _convert_function(fdef, library, signatures, rules, report, target: Target,
                      keep, ranges: Mapping[str, float] | None = None,
                      headroom: float = HEADROOM, handle_shapes=None) -> FunctionGraph | None:
    """Paint one function body; None (with a warning) when the user's body cannot be painted
    (an :class:`InputError`: a body our IR or TensorFlow would not take). Our own bugs on the
    way, :class:`~amp_rewrite.core.errors.IRError` and :class:`LintError` (neither is an
    InputError) or anything unexpected, propagate: they stop the conversion as internal
    errors, never leave a function float32 behind a warning."""
    name = fdef.signature.name
    if not is_concrete(fdef):
        report.warnings.append(f"function {name!r} is polymorphic (type attributes in its "
                               "signature): left as it is")
        return None
    try:
        fg = function_to_graph(fdef, signatures, handle_shapes)
        body_keep = kept(boundary=fg.boundary(),
                         user=[k[len(name) + 1:] for k in keep if k.startswith(name + "/")])
        body_rules = rules_for(rules, fg.graph.names(), prefix=name)
        # ``target.input_shapes``: the body's arguments the graph's --shape inputs reach
        sub, _ = rewrite(fg.graph, body_rules, target, keep=body_keep, calls=signatures,
                         ranges=ranges, headroom=headroom)
    except InputError as exc:   # only the user's: never AmpRewriteError, which holds our bugs
        # TensorFlow ran this body; if it is not a graph we can take, it stays as it was
        report.warnings.append(f"function {name!r} left as it is: {exc}")
        log.warning("function %r left as it is: %s", name, exc)
        return None
    if trains(fdef.node_def):   # a train step's weights change: freezing them is no option
        sub.extra.pop("freezing", None)
    merge_report(report, name, sub, exclude=fg.boundary())
    return fg


def kept(*, boundary=(), interface=(), user=()) -> dict[str, tuple[str, str]]:
    """The nodes whose dtypes must not change, with the ``(code, reason)`` each is kept for
    (a node named twice takes the later reason: the user's ``--keep`` last)."""
    out = {name: ("interface", "function argument or result: the function's signature")
           for name in boundary}
    out.update({name: ("interface", "signature tensor: the model's interface keeps its dtype")
                for name in interface})
    out.update({name: ("user_keep", "kept with --keep") for name in user})
    return out


@dataclass(frozen=True)
class _ScopedRule:
    """A rule-file override as a function body sees it: it matches ``function/node`` names,
    the names the report and ``explain`` use."""

    rule: object
    prefix: str

    action = property(lambda self: self.rule.action)
    pattern = property(lambda self: self.rule.pattern)
    source = property(lambda self: self.rule.source)

    def matches(self, name: str) -> bool:
        return self.rule.matches(f"{self.prefix}/{name}")


def rules_for(rules: RuleSet, names, prefix: str | None = None) -> RuleSet:
    """``rules`` with only the overrides that match one of ``names`` (``prefix/name`` inside
    function ``prefix``): painting one graph of many must not warn about overrides meant for
    another."""
    scoped = [r if prefix is None else _ScopedRule(r, prefix) for r in rules.node_rules]
    return dataclasses.replace(rules, node_rules=[r for r in scoped
                                                  if any(r.matches(n) for n in names)])


def split_keep(keep: Collection[str], graph: Graph, library) -> tuple[str, ...]:
    """The ``--keep`` names of nodes of ``graph`` itself; names of function nodes
    (``function/node``, as the report names them) are checked here and left to the bodies.
    A name that is neither is an :class:`InputError`."""
    bodies = {f.signature.name: {nd.name for nd in f.node_def} for f in library.function}
    mine = []
    for name in keep:
        if name in graph:
            mine.append(name)
            continue
        function, _, node = name.partition("/")
        while function not in bodies and node:
            head, _, node = node.partition("/")
            function = f"{function}/{head}"
        if node not in bodies.get(function, ()):
            names = graph.names() + [f"{f}/{n}" for f, body in bodies.items() for n in body]
            raise InputError(f"--keep names no node {name!r}"
                             + did_you_mean(name, names, list(bodies)))
    return tuple(mine)


def warn_unmatched(rules: RuleSet, report: Report) -> None:
    """Warn about each override that matches no node of the report (graph or function): each
    graph was painted with only the overrides that match in it (:func:`rules_for`)."""
    names = [n.name for n in report.nodes]
    for rule in rules.node_rules:
        if not any(rule.matches(n) for n in names):
            msg = f"override {rule.pattern} ({rule.source}) matches no node"
            report.warnings.append(msg)
            log.warning(msg)


def merge_report(report: Report, prefix: str, sub: Report, exclude=()) -> None:
    """Append ``sub``'s nodes, casts and warnings to ``report``, named ``prefix/name``."""
    skip = set(exclude)
    for node in sub.nodes:
        if node.name not in skip:
            report.nodes.append(dataclasses.replace(node, name=f"{prefix}/{node.name}",
                                                    via=[f"{prefix}/{v}" for v in node.via]))
    report.casts_added.extend(f"{prefix}/{n}" for n in sub.casts_added)
    report.casts_removed.extend(f"{prefix}/{n}" for n in sub.casts_removed)
    report.consts_converted.extend(f"{prefix}/{n}" for n in sub.consts_converted)
    report.warnings.extend(f"function {prefix!r}: {w}" for w in sub.warnings)
    report.low_precision_input.extend(f"{prefix}/{n}" for n in sub.low_precision_input)
    report.scopes.append(prefix)
    report.scopes.extend(f"{prefix}/{s}" for s in sub.scopes)
    report.saver_functions.extend(f"{prefix}/{s}" for s in sub.saver_functions)
    if "batch" in sub.extra:   # one hint for the model: its ops, the largest batch
        mine = report.extra.setdefault("batch", {"ops": 0, "pays_from": 0})
        mine["ops"] += sub.extra["batch"]["ops"]
        mine["pays_from"] = max(mine["pays_from"], sub.extra["batch"]["pays_from"])
    for key in ("freezing", "estimate"):   # what freezing would gain, the cost model's
        if key in sub.extra:                # estimate: summed over the bodies
            total = report.extra.setdefault(key, {})
            for name, value in sub.extra[key].items():
                if isinstance(value, str):   # a second MetaGraph's hint: one is said
                    total.setdefault(name, value)
                else:
                    total[name] = round(total.get(name, 0) + value, 3)
