"""The pipeline: load -> IR -> type model -> paint -> casts (-> loss scaling) -> lint -> save.

:func:`convert` works on a GraphDef in memory; :func:`convert_model` on a loaded
:class:`~amp_rewrite.load.Model` (GraphDef, MetaGraph or SavedModel); :func:`convert_file`
from a path to a path. Each returns a :class:`~amp_rewrite.report.Report`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tensorflow.core.framework import graph_pb2

from . import casts, fold, functions, lint, load as load_mod, loss_scaling, save as save_mod
from .errors import InputError, RuleError
from .ir import Graph
from .paint import paint
from .report import Report, build_report
from .rules import RuleSet, load_rules
from .types import LOW_PRECISION, TARGETS, dtype_name, get_dtype, node_types, op_def

log = logging.getLogger(__name__)

DEVICES = {"gpu": "GPU", "cpu": "CPU"}


@dataclass
class Options:
    """What one conversion is asked to do (the CLI flags, as data)."""

    target: str = "float16"
    device: str = "gpu"
    rules: RuleSet | Sequence[str | os.PathLike] | None = None
    keep: Sequence[str] = ()
    lowp_io: bool = False
    loss_scale: str | None = None          # "dynamic", "none" or a number; None: by target
    loss_scale_options: dict = field(default_factory=dict)
    fold_constants: bool = False           # fold Const-only float32 subgraphs first

    def rule_set(self) -> RuleSet:
        if isinstance(self.rules, RuleSet):
            return self.rules
        return load_rules(self.target, list(self.rules or ()))

    def check(self) -> None:
        if self.target not in TARGETS:
            raise InputError(f"unknown target {self.target!r}: choose float16 or bfloat16")
        if self.device not in DEVICES:
            raise InputError(f"unknown device {self.device!r}: choose gpu or cpu")


def convert_graph(graph: Graph, options: Options, rules: RuleSet | None = None,
                  extra_keep: Sequence[str] = ()) -> tuple[Graph, Report]:
    """Convert an IR graph; returns a new graph (the input is not changed) and the report."""
    options.check()
    rules = rules or options.rule_set()
    target = TARGETS[options.target]
    device = DEVICES[options.device]
    keep = set(options.keep) | set(extra_keep)
    missing = sorted(k for k in set(options.keep) if k not in graph)
    if missing:
        raise InputError(f"--keep names no node {missing[0]!r}")

    check_input(graph)
    original = graph
    work = graph.copy()
    already = [n.name for n in work.nodes() if node_types(n) and
               any(get_dtype(n, a) in LOW_PRECISION for a in node_types(n).attrs)]
    painting = paint(work, rules, target=target, device=device, keep=keep, lowp_io=options.lowp_io)
    stats = casts.apply_painting(work, painting)
    report = build_report(work, original, painting, target=options.target, device=device,
                          rules=rules, matrix_ops=rules.lists["allow"])
    report.casts_added = stats.added
    report.casts_removed = stats.removed
    report.consts_converted = stats.consts
    unknown = sorted({n.op for n in original.nodes() if node_types(n) is None})
    if unknown:
        report.warnings.append("ops not registered with TensorFlow left as they are: "
                               + ", ".join(unknown))
    if already:
        report.warnings.append(f"the input already has {len(already)} low-precision nodes "
                               f"(e.g. {already[0]!r}); they are left as they are")
    lint.lint(work, original=original, rules=rules)
    for w in report.warnings:
        log.warning(w)
    return work, report


# Ports a graph may declare through number attrs (N of ConcatV2, num_split of Split ...) beyond
# one per data edge: the type model lists every port, so a forged N of 2**40 in a tiny file
# would otherwise exhaust memory.
_SPARE_PORTS = 1 << 20


def check_input(graph: Graph) -> None:
    """Refuse, with an :class:`InputError` naming the node, a graph TensorFlow would not import.

    Port counts must be sane before anything lists ports; then the lint's checks (each input's
    arity and dtype matches its OpDef, type attrs hold allowed dtypes) run on the input, so a
    broken input is reported as the user's problem, not as a failed lint of our output.
    """
    budget = _SPARE_PORTS + sum(1 for _ in graph.data_edges())
    for node in graph.nodes():
        if node.op == "Const":
            _check_const(node)
        od = op_def(node.op)
        for arg in list(od.input_arg) + list(od.output_arg) if od is not None else ():
            if not arg.number_attr:
                continue
            n = node.attr[arg.number_attr].i if arg.number_attr in node.attr else -1
            budget -= max(n, 0)
            if n < 0 or budget < 0:
                raise InputError(f"node {node.name!r} ({node.op}) has {arg.number_attr}={n}, "
                                 "not a usable port count")
    problems = lint.lint_problems(graph)
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


def _import(graph_def: graph_pb2.GraphDef) -> tuple[Graph, dict[str, list[str]]]:
    """The IR of ``graph_def`` with the OpDef defaults of omitted attrs filled in (graphs saved
    with ``strip_default_attrs`` lack type attrs the type model reads), and which were filled."""
    graph = Graph.from_graph_def(graph_def)
    added = {}
    for node in graph.nodes():
        names = functions.fill_defaults(node.proto)
        if names:
            added[node.name] = names
    return graph, added


def convert(graph_def: graph_pb2.GraphDef, target: str = "float16", device: str = "gpu",
            rules: RuleSet | Sequence[str | os.PathLike] | None = None,
            keep: Sequence[str] = (), lowp_io: bool = False,
            fold_constants: bool = False) -> tuple[graph_pb2.GraphDef, Report]:
    """Convert an FP32 GraphDef to mixed precision; returns ``(new_graph_def, report)``.

    The input is not changed. ``target`` is ``"float16"`` or ``"bfloat16"``; ``device`` is the
    device unplaced nodes will run on (``"gpu"`` or ``"cpu"``), which decides which kernels
    exist; ``rules`` is a :class:`RuleSet` or a list of rule files stacked on the defaults;
    ``keep`` names nodes whose dtypes must not change; ``fold_constants`` folds Const-only
    float32 subgraphs first (graphs without variables). Painting and casts only: loss scaling
    needs the MetaGraph's collections and Saver, so it comes with :func:`convert_file`.
    """
    options = Options(target=target, device=device, rules=rules, keep=keep, lowp_io=lowp_io,
                      fold_constants=fold_constants)
    model = load_mod.Model(Path("<graph_def>"), "graphdef", False, graph_def)
    report = _convert_graph_model(model, options, train=False)
    return model.graph_def, report


def _check_calls(model: load_mod.Model) -> None:
    """A call whose types already disagree with its callee's signature is the input's fault
    (the same check on the output would call it ours)."""
    saved = model.extra.get("saved_model")
    for graph_def in [m.graph_def for m in saved.meta_graphs] if saved else [model.graph_def]:
        problems = functions.check_call_types(graph_def)
        if problems:
            raise InputError(f"the input graph is not valid: {problems[0]}")


def convert_model(model: load_mod.Model, options: Options, *, train: bool = True) -> Report:
    """Convert a loaded model in place (its graph_def, and its functions where it has them).

    ``train=False`` paints and casts only, even where the graph trains (``explain`` uses it).
    """
    if model.kind == "savedmodel":
        _check_calls(model)
        from .savedmodel import convert_saved_model
        if options.fold_constants:
            log.warning("--fold-constants: a SavedModel's weights are variables; nothing to fold")
        return convert_saved_model(model, options)
    return _convert_graph_model(model, options, train=train)


def _convert_graph_model(model: load_mod.Model, options: Options, *, train: bool) -> Report:
    """Convert a GraphDef or MetaGraph model in place; ``train`` adds loss scaling where it trains."""
    _check_calls(model)
    interface = model.signature_tensors()
    graph_def = model.graph_def
    if options.fold_constants:
        graph_def = fold.fold_constants(graph_def, set(options.keep) | interface)
    graph, added = _import(graph_def)
    rules = options.rule_set()
    keep = interface | functions.direct_call_feeders(graph, graph_def.library)
    main_rules = functions.rules_for(rules, graph.names())  # overrides of function nodes: later
    main_opts = functions.main_options(options, graph, graph_def.library)
    work, report = convert_graph(graph, main_opts, main_rules, extra_keep=keep)
    if train and loss_scaling.apply(work, model, options, report):
        lint.lint(work, original=graph, rules=main_rules)
    model.graph_def = work.to_graph_def(graph_def)
    functions.strip_graph_defaults(model.graph_def, added)
    functions.paint_library(model.graph_def, options, rules, report, interface=interface)
    functions.warn_unmatched(rules, report)
    return report


def convert_file(input_path: str | os.PathLike, output_path: str | os.PathLike, *,
                 force: bool = False, in_place: bool = False, **options) -> Report:
    """Load ``input_path``, convert it, and write ``output_path`` atomically.

    The input is never overwritten unless ``in_place`` is set; an existing output is only
    replaced with ``force``. Options are those of :class:`Options`.
    """
    src, dst = Path(input_path), Path(output_path)
    if save_mod.same_file(src, dst) and not in_place:
        raise InputError(f"{dst}: the output is the input; pass --in-place to overwrite it")
    opts = Options(**options)
    opts.check()
    model = load_mod.load(src)
    try:
        report = convert_model(model, opts)
    except InputError as exc:
        # errors found in the graph name a node; the user also needs to know which file
        if not isinstance(exc, RuleError) and not str(exc).startswith(str(src)):
            exc.args = (f"{src}: {exc}",)
        raise
    save_mod.save(model, dst, force=force or in_place)
    return report


__all__ = ["Options", "convert", "convert_file", "convert_graph", "convert_model", "dtype_name"]
