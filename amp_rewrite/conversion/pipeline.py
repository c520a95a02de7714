"""A whole conversion: load -> every graph through
:func:`~amp_rewrite.conversion.graph.convert_graph` -> save.

:func:`convert_file` goes from a path to a path, :func:`convert_model` from a loaded
:class:`~amp_rewrite.io.load.Model` to a converted one, :func:`convert` from a GraphDef in memory
to a GraphDef. Each returns the :class:`~amp_rewrite.report.decisions.Report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

from tensorflow.core.framework import graph_pb2

from ..core import hardware
from ..core.dtypes import HEADROOM, LARGEST, TARGETS
from ..core.errors import InputError, RuleError, UnsupportedGraphError, option
from ..io.files import (
    check_container,
    is_keras_file,
    is_saved_model,
    not_freezable,
    refuse_graph_file_options,
    same_file,
)
from ..io.frozen import check_freezable, freeze, serving_keys
from ..io.keras_files import saved_models
from ..io.load import Model, load
from ..io.save import save
from ..report.decisions import Report
from ..rules.loader import RuleSet
from ..schema.functiondef import reachable
from ..schema.opdefs import is_variable_write
from ..training.config import scale_config
from ..training.detect import training_functions, training_parts
from ..training.in_functions import (
    add_saved_model_loss_scaling,
    unscalable_train_functions,
)
from ..training.state import SCOPE
from .graph import Options, convert_graph, emulate
from .library import merge_report, warn_unmatched
from .rewrite import warnings_once

log = logging.getLogger(__name__)


def convert_file(input_path: str | os.PathLike, output_path: str | os.PathLike, *,
                 force: bool = False, in_place: bool = False, **options) -> Report:
    """Load ``input_path``, convert it, and write ``output_path`` atomically.

    The input is never overwritten unless ``in_place`` is set; an existing output is only
    replaced with ``force``. Options are those of :class:`Options`. A Keras file (``.keras``,
    ``.h5``) converts as the SavedModel of its serving function, to a SavedModel directory
    (:mod:`amp_rewrite.io.keras_files`).
    """
    src, dst = Path(input_path), Path(output_path)
    if same_file(src, dst) and not in_place:
        raise InputError(f"{dst}: the output is the input; pass "
                         f"{option('--in-place', 'in_place=True')} to overwrite it")
    check_container(src, dst)
    opts = Options(**options)
    opts.check()   # before a Keras file's export, which takes seconds
    if is_saved_model(src) or is_keras_file(src):
        refuse_graph_file_options(src, _graph_file_options(opts))
    with saved_models([src]) as (saved,):   # a Keras file: its export, for the block
        converted, report = convert_path(saved, opts)
        save(converted, dst, force=force or in_place)
    return report


def convert_path(input_path: str | os.PathLike, options: Options) -> tuple[Model, Report]:
    """Load ``input_path`` and convert it in memory: the converted model and its report, for
    a caller that writes it with other outputs (the command line). A user error names the
    file as well as the node."""
    src = Path(input_path)
    options.check()
    try:
        converted, report = convert_model(load(src), options)
    except InputError as exc:
        # errors found in the graph name a node; the user also needs to know which file
        if not isinstance(exc, RuleError) and not str(exc).startswith(str(src)):
            exc.args = (f"{src}: {exc}",)
        raise
    _say_unweighed(report, options)
    _warn_float32_model(report, options)
    return converted, report


def convert_model(model: Model, options: Options) -> tuple[Model, Report]:
    """Convert every graph of ``model``; returns the converted model (``model`` is not changed)
    and one report (nodes of a SavedModel's second and later MetaGraphs named ``[tags]/name``)."""
    with _collector_paused(), warnings_once():
        return _convert_model(model, options)


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector for the duration.

    A conversion allocates several container objects per node that all live until it ends, so
    the collector's full passes, triggered by the allocations themselves, walk every one of them
    again and again: 40% of the conversion time on a 30k-node graph (BENCHMARKS.md "Conversion
    speed"). Reference counting still frees what the conversion drops; the few cycles it makes
    are collected once the collector runs again.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _convert_model(model: Model, options: Options) -> tuple[Model, Report]:
    options.check()
    if options.freeze:
        return _convert_frozen(model, options)
    kept_variables = refused = None   # refused: why --freeze refuses the model, once known
    if options.freeze is False and options.weighed() and model.kind == "savedmodel":
        kept_variables = f"asked ({option('--no-freeze', 'freeze=False')})"
    elif options.freeze is None and options.may_freeze() and model.kind == "savedmodel":
        kept_variables = _unfrozen_by_default(model)
        if kept_variables is None:
            try:
                return _convert_frozen(model, options, by_default=True)
            except _NotFrozen as exc:
                kept_variables, refused = str(exc), exc.refused
            log.info("kept the variables: %s", kept_variables)
    rules = options.rule_set()
    saved = model.kind == "savedmodel"
    config = scale_config(options.loss_scale, options.target, dict(options.loss_scale_options))
    if saved:
        refuse_graph_file_options(model.path, _graph_file_options(options))
        if config is not None:
            _refuse_saved_model_training(model, options)
    converted, report, added = [], None, {}
    for meta in model.meta_graphs:
        # every train step the SavedModel restores is scaled, a method's as a signature's;
        # a method no signature reaches that scaling would refuse is left alone, with why
        leave = unscalable_train_functions(meta, config) if saved and config is not None else {}
        new, sub = convert_graph(meta, options, rules=rules, loss_scaling=not saved,
                                 leave=sorted(leave))
        if saved and config is not None:
            state = add_saved_model_loss_scaling(new, config, sub, leave)
            if state is not None and added:
                raise UnsupportedGraphError(f"{model.path}: train functions in more than one "
                                            "MetaGraph; loss-scale state is added to one")
            added = {SCOPE: state} if state is not None else added
        if options.emulate:   # once scaled: the emulation computes what float16 would
            emulate(new, sub)
        converted.append(new)
        if report is None:
            report = sub
        else:
            merge_report(report, "[" + ",".join(meta.meta_info_def.tags) + "]", sub)
    _warn_low_precision_input(report)
    warn_unmatched(rules, report)
    if options.calibration is not None:
        _report_calibration(report, options)
    _warn_if_slower_here(options)
    if kept_variables is not None:
        report.extra["freeze"] = {"frozen": False, "reason": kept_variables,
                                  "summary": f"not frozen, the variables kept: {kept_variables}"}
    if saved:
        _hint_only_what_freezes(model, options, report, refused)
    return dataclasses.replace(model, meta_graphs=tuple(converted), added_variables=added), report


def _hint_only_what_freezes(model: Model, options: Options, report: Report,
                            refused: str | None) -> None:
    """The freezing hint (``convert with --freeze``, where the cost model estimates freezing
    gains) names only what --freeze does: where it refuses the SavedModel (``refused``, or
    what it refuses before freezing), the hint says the gain and the refusal, which names
    what to do; where an option given names what freezing changes, it says to drop it."""
    gain = report.extra.get("freezing")
    if not gain or not gain.get("summary", "").startswith("convert with --freeze"):
        return
    reason = refused or _freeze_refusal(model)
    if reason is not None:
        text = (f"freezing the variables would gain about {gain['gain_us']:.0f} µs a sample by "
                f"the cost model, but --freeze refuses this SavedModel: {reason}")
    else:
        given = [flag for flag, on in (("--lowp-io", options.lowp_io),
                                       ("--calibration", options.calibration is not None)) if on]
        if not given:
            return
        text = gain["summary"].replace(
            "convert with --freeze", f"convert with --freeze, without {' and '.join(given)} "
            "(freezing renames the tensors and keeps the signatures' dtypes)", 1)
    report.warnings[:] = [text if w == gain["summary"] else w for w in report.warnings]
    gain["summary"] = text


def _freeze_refusal(model: Model) -> str | None:
    """What --freeze refuses the SavedModel ``model`` for before it freezes anything, or None."""
    try:
        check_freezable(model.path, model.meta_graphs)
        _refuse_freezing_training(model)
    except UnsupportedGraphError as exc:
        return str(exc)
    return None


def _warn_low_precision_input(report: Report) -> None:
    """One warning for the nodes the input already held in a 16-bit dtype (a model converted
    before, or built so), whether in its graph or its function bodies; given once all are
    painted, so a refusal found on the way (a SavedModel already loss-scaled) comes alone."""
    held = report.low_precision_input
    if held:
        text = (f"the input already has {len(held)} low-precision nodes (e.g. {held[0]!r}); "
                "they are left as they are")
        report.warnings.append(text)
        log.warning(text)


class _NotFrozen(Exception):
    """Why a SavedModel the conversion would freeze by default keeps its variables, and
    ``refused``: why --freeze refuses it, where it does."""

    def __init__(self, why: str, refused: str | None = None):
        super().__init__(why)
        self.refused = refused


# The variables' bytes past which a SavedModel is not frozen by default: a Const holds at most
# 2 GB (protobuf's limit on one message), which TensorFlow's freezing fails on after minutes
# and many gigabytes (--freeze says so for such a model when asked)
FREEZE_BY_DEFAULT_BYTES = 1 << 30


def _unfrozen_by_default(model: Model) -> str | None:
    """Why the SavedModel ``model`` keeps its variables though the conversion would freeze it
    by default (docs/decisions.md "Frozen and folded by default (bfloat16 on a CPU)"), or
    None: it is frozen unless freezing it finds more (:class:`_NotFrozen`)."""
    if len(model.meta_graphs) != 1 or not serving_keys(model.meta_graphs[0]):
        return "it has no serving signature, or more than one MetaGraph (--freeze takes one)"
    try:
        _refuse_freezing_training(model)
    except UnsupportedGraphError:
        return "a signature trains or writes a variable, so the weights change as it runs"
    meta = model.meta_graphs[0]
    library = meta.graph_def.library
    bodies = {f.signature.name: f.node_def for f in library.function}
    restored = reachable([], library, meta.object_graph_def.concrete_functions)
    if training_functions(library, restored) or any(
            is_variable_write(nd.op) for name in restored for nd in bodies.get(name, ())):
        return ("a function it restores trains or writes a variable (a train step): frozen, "
                "the output would lose it")
    size = _variables_bytes(model.path)
    if size > FREEZE_BY_DEFAULT_BYTES:
        return (f"its variables hold {size / (1 << 30):.1f} GiB, more than freezing by default "
                f"takes ({FREEZE_BY_DEFAULT_BYTES >> 30} GiB)")
    return None


def _variables_bytes(path: Path) -> int:
    """The bytes of the SavedModel's variables on disk (its checkpoint's data files)."""
    folder = Path(path) / "variables"
    return sum(f.stat().st_size for f in folder.glob("variables.data-*")) if folder.is_dir() else 0


def _convert_frozen(model: Model, options: Options,
                    by_default: bool = False) -> tuple[Model, Report]:
    """``--freeze``: every serving signature of the SavedModel ``model`` frozen
    (:func:`~amp_rewrite.io.frozen.freeze`), each frozen graph converted as a graph file with
    --fold-constants, the result a model that saving writes as a SavedModel serving the same
    signatures. The report names a second graph's nodes ``[its signatures]/name``.
    ``by_default``: frozen without --freeze, so what --freeze refuses (and a method the output
    would not carry) raises :class:`_NotFrozen` with why, and the caller keeps the variables."""
    if model.kind != "savedmodel":
        raise InputError(not_freezable(model.path))
    refuse_graph_file_options(model.path, _graph_file_options(options))
    _refuse_freezing_training(model)
    measure = options.target == "float16"   # float16's range: the kept variables' magnitudes
    if by_default:
        try:
            frozen = freeze(model.path, model.meta_graphs, measure=measure)
        except (UnsupportedGraphError, InputError) as exc:
            raise _NotFrozen(f"freezing it failed ({exc})", refused=str(exc)) from None
        if frozen.dropped:
            raise _NotFrozen(f"frozen, the output would not carry its method"
                             f"{'s' * (len(frozen.dropped) > 1)} {', '.join(frozen.dropped)} "
                             "(--freeze writes the signatures and the methods that serve them)")
    else:
        frozen = freeze(model.path, model.meta_graphs, measure=measure)
    graphs = [Model(model.path, "metagraph", False, (meta,)) for meta in frozen.meta_graphs]
    each = dataclasses.replace(options, freeze=False, fold_constants=True)
    converted, report = [], None
    for graph, keep, shapes in zip(graphs, _per_graph(options.keep, graphs, _node_names),
                                   _per_graph(options.shapes, graphs, _input_names)):
        new, sub = _convert_model(graph, dataclasses.replace(each, keep=keep, shapes=shapes))
        graph.meta_graph.ClearField("graph_def")   # its weights, converted: not kept twice
        converted.append(new.meta_graph)
        if report is None:
            report = sub
        else:
            merge_report(report, "[" + ",".join(sorted(graph.meta_graph.signature_def)) + "]", sub)
    report.extra["freeze"] = frozen.summary(by_default, converted)
    return dataclasses.replace(model, kind="frozen", meta_graphs=tuple(converted),
                               frozen=frozen), report


def _per_graph(given, graphs: list[Model], names) -> list:
    """``given`` (--keep names, or --shape's dict) split over the frozen ``graphs``: to each,
    what names one of its nodes or inputs (``names``); what names none goes to the first, which
    refuses it with the names it has."""
    known = [names(g.meta_graph) for g in graphs]
    anywhere = set().union(*known)
    parts = [[k for k in given if k in mine or (i == 0 and k not in anywhere)]
             for i, mine in enumerate(known)]
    return [{k: given[k] for k in part} if isinstance(given, Mapping) else part for part in parts]


def _node_names(meta) -> set[str]:
    graph_def = meta.graph_def
    return {n.name for n in graph_def.node} | {
        f"{f.signature.name}/{n.name}" for f in graph_def.library.function for n in f.node_def}


def _input_names(meta) -> set[str]:
    names = set()
    for sig in meta.signature_def.values():
        for key, info in sig.inputs.items():
            names |= {key, info.name, info.name.rpartition(":")[0]}
    return names


def _refuse_freezing_training(model: Model) -> None:
    """Refuse --freeze for a SavedModel with a signature that trains (a function it calls
    computes gradients and writes variables) or otherwise writes a variable: its weights change
    as it runs, so they cannot be frozen."""
    for meta in model.meta_graphs:
        library, nodes = meta.graph_def.library, {n.name: n for n in meta.graph_def.node}
        bodies = {f.signature.name: f.node_def for f in library.function}
        for key in serving_keys(meta):
            called = [nodes[i.name.split(":")[0]] for i in meta.signature_def[key].outputs.values()
                      if i.name.split(":")[0] in nodes]
            reached = reachable(called, library)
            train = training_functions(library, reached)
            write = next(((name, nd.op) for name in reached for nd in bodies[name]
                          if is_variable_write(nd.op)), None)
            if train or write:
                what = (f"trains (function {train[0]!r} computes gradients and writes "
                        "variables)" if train else
                        f"writes a variable ({write[1]} in function {write[0]!r})")
                raise UnsupportedGraphError(
                    f"{model.path}: signature {key!r} {what}: its weights change as it runs, "
                    "so they cannot be frozen; convert without --freeze (docs/savedmodels.md "
                    "\"--freeze\")")


def _report_calibration(report: Report, options: Options) -> None:
    """The report's ``calibration`` section: how many tensors the calibration held, the limit
    it drew, and how many nodes it kept float32 (code ``range``); a warning when none of its
    tensors belongs to the model (calibration of another model: it decided nothing)."""
    largest = LARGEST[TARGETS[options.target]]
    limit = largest / options.headroom
    kept = sum(1 for n in report.nodes if n.code == "range")
    names = {n.name for n in report.nodes}
    matched = sum(1 for t in options.calibration if t.rpartition(":")[0] in names)
    report.extra["calibration"] = {
        "tensors": len(options.calibration), "matched": matched, "headroom": options.headroom,
        "limit": limit, "kept": kept,
        "summary": f"{kept} nodes kept float32 (code range): each computes or reads a tensor "
                   f"whose largest magnitude on the calibration data is {limit:.4g} or more "
                   f"({options.target}'s largest value {largest:.6g} / headroom "
                   f"{options.headroom:g})"}
    if options.calibration and not matched:
        text = (f"calibration: none of its {len(options.calibration)} tensors is one of the "
                "model's (calibration of another model?): it decided nothing")
        report.warnings.append(text)
        log.warning(text)


def _say_unweighed(report: Report, options: Options) -> None:
    """Say plainly where the cost model of bfloat16 on a CPU painted matrix ops it could not
    weigh (their FLOPs or their island's shapes not known from the graph: an open dimension
    other than the batch, a shape computed at run time): they run in bfloat16 as grappler
    would paint them, which at a small batch may be slower than float32, and the estimate
    leaves them out, so it cannot tell the model's speed."""
    estimate = report.extra.get("estimate")
    if not options.weighed() or not estimate or not estimate.get("unknown"):
        return
    unknown = int(estimate["unknown"])
    text = (f"{unknown} bfloat16 matrix op{'s' * (unknown != 1)} could not be weighed (their "
            "shapes are not known from the graph): painted as grappler paints them, they may "
            "run slower than float32 at small batches, and the estimate cannot tell the "
            "model's speed; 'amp-rewrite bench' measures it, --measure converts both ways "
            "and writes the faster")
    estimate["summary"] = text   # the CLI prints it with the summary
    report.warnings.append(text)


def _warn_float32_model(report: Report, options: Options) -> None:
    """Warn where the output computes no MatMul/Conv-family op in 16 bits: a float32 model,
    and why (:meth:`Report.float32_model`). Said by the conversions a user asks for
    (:func:`convert`, :func:`convert_path`), not by tune's trials; --cost-aware on a CPU
    without a bfloat16 unit has said it already (:func:`_warn_if_slower_here`)."""
    text = report.float32_model()
    if text and not (options.cost_aware and options.slower_here()):
        report.warnings.append(text)
        log.warning(text)


def _warn_if_slower_here(options: Options) -> None:
    """bfloat16 for a CPU that has no bfloat16 matrix unit runs slower than float32 there: say
    so (the model may be meant for another machine, so it is converted all the same). Logged,
    not in the report: the report depends on the input and options only, not on the machine."""
    if not options.slower_here():
        return
    others = " or ".join(c for c in hardware.CPU_CLASSES if c != "avx2")
    if options.cost_aware:
        log.warning("this CPU (%s) has no bfloat16 matrix unit (AMX-BF16 or AVX512-BF16): "
                    "--cost-aware kept every island float32, so the model runs as fast as the "
                    "input here", hardware.describe())
        return
    if options.cost_table().saves_nothing():
        log.warning("this CPU (%s) has no bfloat16 matrix unit (AMX-BF16 or AVX512-BF16): every "
                    "island stayed float32, so the model runs as fast as the input here; to "
                    "convert it for a CPU that has one, --costs %s (docs/decisions.md \"Which "
                    "CPUs gain from bfloat16\")", hardware.describe(), others)
        return
    log.warning("this CPU (%s) has no bfloat16 matrix unit (AMX-BF16 or AVX512-BF16): the "
                "converted model, weighed with %s, runs slower than float32 here; it is for "
                "CPUs that have one (docs/decisions.md \"Which CPUs gain from bfloat16\"; "
                "without --costs it stays float32 here)", hardware.describe(),
                options.cost_table().summary())


def convert(graph_def: graph_pb2.GraphDef | bytes, target: str = "float16", device: str = "gpu",
            rules: RuleSet | Sequence[str | os.PathLike] | None = None,
            keep: Sequence[str] = (), lowp_io: bool = False, fold_constants: bool | None = None,
            min_matrix_intensity: float | None = None,
            cost_aware: bool = False, calibration: Mapping[str, float] | None = None,
            headroom: float = HEADROOM, shapes: Mapping[str, Sequence[int]] | None = None,
            costs: str | os.PathLike | None = None) -> tuple[graph_pb2.GraphDef, Report]:
    """Convert an FP32 GraphDef to mixed precision; returns ``(new_graph_def, report)``.

    ``graph_def``: a ``GraphDef``, or its serialized bytes (a file's, read as they are); anything
    else is an :class:`InputError`. The input is not changed. ``target`` is ``"float16"`` or ``"bfloat16"``, or ``"float32"``
    (a graph that computes in 16 bits moved back whole, docs/convert.md "Converting a converted
    model"); ``device`` is the
    device unplaced nodes will run on (``"gpu"`` or ``"cpu"``), which decides which kernels
    exist; ``rules`` is a :class:`RuleSet` or a list of rule files stacked on the defaults;
    ``keep`` names nodes whose dtypes must not change; ``fold_constants`` folds Const-only
    float32 subgraphs and batch norms first (graphs without variables; None: for bfloat16 on
    a CPU, docs/decisions.md "--fold-constants"); ``min_matrix_intensity`` is the least
    matrix work per element moved that a 16-bit island needs (None: 128 for bfloat16 on CPU, else 0;
    docs/decisions.md "Small matrix ops stay float32"); ``cost_aware`` keeps float32 what would run slower
    than float32 on this machine (bfloat16 on a CPU with no bfloat16 matrix unit; docs/decisions.md "Which
    CPUs gain from bfloat16"); ``calibration`` maps tensor names to the largest magnitude
    the float32 graph gave them on data (``amp_rewrite.tools.ranges.calibrate(...).maxima()``):
    a node that computes or reads one within ``headroom`` of the target's largest value stays
    float32 (docs/ranges.md); ``shapes`` maps placeholder names to the shapes the model runs
    at, for the cost model (its batch above all: docs/decisions.md "The batch the cost model
    assumes"); ``costs`` its rates, a table file or ``"shipped"`` (None: the table measured on
    this CPU where there is one, else the shipped one; docs/decisions.md "The cost model").
    Painting and casts only: loss scaling needs the
    MetaGraph's collections and Saver, so it comes with :func:`convert_file`.
    """
    options = Options(target=target, device=device, rules=rules, keep=keep, lowp_io=lowp_io,
                      fold_constants=fold_constants, loss_scale="none",
                      min_matrix_intensity=min_matrix_intensity, cost_aware=cost_aware,
                      calibration=calibration, headroom=headroom, shapes=dict(shapes or {}),
                      costs=costs)
    converted, report = convert_model(_graph_def_model(graph_def), options)
    _say_unweighed(report, options)
    _warn_float32_model(report, options)
    return converted.graph_def, report


def _graph_def_model(graph_def) -> Model:
    """What :func:`convert` takes, as a model: a GraphDef, or the bytes of one."""
    if isinstance(graph_def, (bytes, bytearray, memoryview)):
        return Model.of_serialized_graph_def(bytes(graph_def), "convert: the bytes given")
    if not isinstance(graph_def, graph_pb2.GraphDef):
        hint = (" (for a file, convert_file(path, output_path))"
                if isinstance(graph_def, (str, os.PathLike)) else "")
        raise InputError(f"convert: takes a GraphDef (tf.compat.v1.GraphDef) or its serialized "
                         f"bytes, not {type(graph_def).__name__} {_short(graph_def)}{hint}")
    return Model.of_graph_def(graph_def)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_saved_model_training(model: Model, options: Options) -> None:
    """Refuse loss scaling of a SavedModel whose graph itself trains (TF1 style): its state
    would need the TF1 saver's functions extended, which amp-rewrite does not do. TF2 train
    steps (library functions) are scaled by :func:`add_saved_model_loss_scaling`. Called
    when loss scaling is asked for."""
    for meta in model.meta_graphs:
        if "the graph" not in training_parts(meta.graph_def):
            continue
        if options.target != "float16":
            raise UnsupportedGraphError(
                f"{model.path}: the graph trains (a TF1 train op in a SavedModel); amp-rewrite "
                f"adds no loss scaling to those, and {options.target} needs none: drop "
                f"--loss-scale {options.loss_scale}")
        raise UnsupportedGraphError(
            f"{model.path}: the graph trains (a TF1 train op in a SavedModel); float16 training "
            "needs loss scaling, which amp-rewrite adds to TF1 training graphs saved as a "
            "MetaGraph (.meta) and to TF2 train-step functions, not to a TF1 SavedModel's graph. "
            "Convert its MetaGraph (.meta), or use --target bfloat16 (no loss scaling needed), "
            "or --loss-scale none (small gradients may underflow to zero)")


def _graph_file_options(options: Options) -> dict:
    """The options :func:`refuse_graph_file_options` looks at, by their names (--freeze folds:
    --fold-constants is no graph file's option there)."""
    return {"lowp_io": options.lowp_io,
            "fold_constants": options.fold_constants and not options.freeze,
            **(options.loss_scale_options or {})}


__all__ = ["Options", "convert", "convert_file", "convert_graph", "convert_model",
           "convert_path"]
