"""One graph and the functions it reaches, converted: the per-graph driver every format uses.

:func:`convert_graph` takes a ``MetaGraphDef`` (a GraphDef file is wrapped in one, a SavedModel
brings one per tag set) and runs, in order: the input checks, optional constant folding, the
graph's own nodes through :func:`~amp_rewrite.conversion.rewrite.rewrite`, loss scaling where it
trains, then every library function it reaches
(:func:`~amp_rewrite.conversion.library.paint_library`). The
MetaGraph's signature tensors are its interface and keep their dtypes; the functions its object
graph restores keep their signatures. :func:`emulate` turns a converted float16 MetaGraph into
its float32 emulation (``--emulate``); the pipeline runs it last, once a SavedModel's train
functions are loss-scaled too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from ..check import lint
from ..core import hardware
from ..core.dtypes import CONVERSION_TARGETS, HEADROOM
from ..core.errors import InputError, LintError, UnsupportedGraphError, option
from ..core.ir import Graph, copy_except
from ..core.ops import PLACEHOLDER_OPS
from ..report.decisions import Report
from ..paint.costs import DEFAULT_BATCH
from ..rules import cost_table
from ..rules.loader import LISTS, RuleSet, load_rules
from ..schema.functiondef import check_call_types, saver_functions
from ..schema.inputs import (
    component_shapes,
    fitting_shape,
    input_keys,
    match_inputs,
    meta_graph_inputs,
)
from ..schema.opdefs import graph_with_defaults, strip_graph_defaults
from ..schema.snapshot import Before
from ..training.config import HINTS, scale_config
from ..training.detect import trains
from ..training.in_functions import scale_train_functions
from ..training.in_graph import add_function_state, add_loss_scaling, function_train_steps
from ..transforms import bnfold, constfold
from ..transforms.emulate import emulate_float16
from .library import kept, paint_library, rules_for, split_keep
from .rewrite import Target, rewrite
from .widening import Widened, dtypes_to_widen, note_widening, widen_meta_graph

log = logging.getLogger(__name__)

DEVICES = {"gpu": "GPU", "cpu": "CPU"}
# The least matrix intensity (FLOPs per element moved, costs.matrix_intensity) an island's
# biggest matrix op needs for the island to go to 16 bits, by (target, device). bfloat16 on a
# CPU (AVX512-BF16, BENCHMARKS.md "Small matrix ops"): an isolated bfloat16 MatMul between
# casts breaks even near 50 and gains 1.33x at 128, while a training step whose widest layer is
# 64 ran at 0.96x ("Training step"); 128 keeps such models float32. Elsewhere 0, as grappler: float16 on a CPU is for checking numbers, not
# speed, and GPUs could not be measured here.
DEFAULT_MIN_INTENSITY = {("bfloat16", "cpu"): 128.0}
# When the cost model's estimate of what freezing the variables and --fold-constants would gain
# (paint.costs.FreezeGain) is worth a warning: at least a tenth of the weighed islands' float32
# matrix time (a gain of 1.1x were that the whole run, twice the 5% run-to-run noise of
# BENCHMARKS.md "Keras SavedModels") and at least 1 µs a sample. The floor leaves out recurrent
# text classifiers, whose loop bodies the estimate weighs one step of: a GRU's and an LSTM's
# 0.4-0.5 µs would paint their matrix ops, and frozen with --fold-constants they ran slower
# than frozen float32 (Xception, MobileNetV2 with trained batch norms: 400-800 µs; frozen and
# folded they ran 2.0-2.5x as fast as their SavedModels' conversions)
FREEZE_HINT_SHARE = 0.1
FREEZE_HINT_US = 1.0


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
    # fold Const-only float32 subgraphs and batch norms first (graphs without variables); None:
    # by default, which folds for bfloat16 on a CPU (:meth:`folds`)
    fold_constants: bool | None = None
    min_matrix_intensity: float | None = None   # None: by device (DEFAULT_MIN_INTENSITY)
    emulate: bool = False                  # float16's float32 emulation (amp_rewrite.transforms.emulate)
    cost_aware: bool = False               # never slower than float32 on this machine
    # calibration: tensor name (``node:port``, ``function/node:port`` inside a function) ->
    # the largest finite magnitude the float32 model gave it on data
    # (amp_rewrite.tools.ranges.calibrate(...).maxima()); a node that computes or reads a
    # tensor within ``headroom`` of the target's largest value stays float32 (code range)
    calibration: Mapping[str, float] | None = None
    headroom: float = HEADROOM
    # input name (a placeholder, or a signature's input key) -> the shape the model runs at
    # (``--shape``), for the cost model: bfloat16 on a CPU weighs variable-weight casts per run
    # against matrix savings per sample, so it needs the batch (paint.costs.DEFAULT_BATCH else)
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    # --freeze: a SavedModel's signatures frozen, folded and converted, written as a SavedModel
    # with the same signatures (conversion.pipeline; docs/savedmodels.md "--freeze"); None: by
    # default, which freezes a SavedModel that only serves, for bfloat16 on a CPU
    # (:meth:`may_freeze`), and keeps its variables where freezing would drop what it holds
    freeze: bool | None = None
    # --costs: the cost model's rates, a table file or "shipped"; None: the table measured on
    # this CPU where there is one, else the shipped one (rules.cost_table.choose)
    costs: str | os.PathLike | None = None

    def rule_set(self) -> RuleSet:
        if isinstance(self.rules, RuleSet):
            return self.rules
        if self.target == "float32":   # nothing is painted: no list applies
            return RuleSet("float32", {name: frozenset() for name in LISTS})
        return load_rules(self.target, list(self.rules or ()))

    def check(self) -> None:
        if self.target not in CONVERSION_TARGETS:
            raise InputError(f"unknown target {self.target!r}: choose float16, bfloat16 or "
                             "float32")
        if self.target == "float32":
            self._check_float32()
        if self.device not in DEVICES:
            raise InputError(f"unknown device {self.device!r}: choose gpu or cpu")
        if self.emulate and self.target != "float16":
            raise InputError("--emulate emulates float16: use it with --target float16")
        if self.emulate and self.lowp_io:
            raise InputError("--emulate keeps the graph's interface float32: drop --lowp-io")
        if self.freeze and self.lowp_io:
            raise InputError("--freeze keeps the signatures' inputs and outputs as they are: "
                             "drop --lowp-io")
        if self.freeze and self.calibration is not None:
            raise InputError("--calibration names the SavedModel's tensors, which freezing "
                             "renames: convert with --freeze without --calibration")
        if self.min_matrix_intensity is not None and not self.min_matrix_intensity >= 0:
            raise InputError(f"--min-matrix-intensity must be 0 or more, not "
                             f"{self.min_matrix_intensity!r}")
        if not (isinstance(self.headroom, (int, float)) and 1 <= self.headroom < math.inf):
            raise InputError(f"--headroom must be a number of at least 1 (a share of the "
                             f"16-bit dtype's largest value), not {self.headroom!r}")
        if self.shapes and not self.weighed():
            raise InputError("--shape tells the cost model of --target bfloat16 --device cpu "
                             f"the batch; a {self.target} conversion for {self.device} has no "
                             "such cost model: drop --shape")
        if self.costs is not None and not self.weighed():
            raise InputError("--costs gives the cost model of --target bfloat16 --device cpu "
                             f"its rates; a {self.target} conversion for {self.device} has no "
                             "such cost model: drop --costs")
        for name, dims in dict(self.shapes or {}).items():
            if not (isinstance(dims, (list, tuple)) and all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)):
                raise InputError(f"--shape {name}: the shape must be a list of dimensions of at "
                                 f"least 0, not {dims!r}")
        if self.calibration is not None:
            if not isinstance(self.calibration, Mapping):
                raise InputError("calibration must map tensor names to the largest magnitude "
                                 "observed (amp_rewrite.tools.ranges.calibrate(...).maxima())")
            bad = next(((k, v) for k, v in self.calibration.items()
                        if not isinstance(v, (int, float)) or not v >= 0), None)
            if bad is not None:
                raise InputError(f"calibration: tensor {bad[0]!r} has largest magnitude "
                                 f"{bad[1]!r}: must be a number >= 0")

    def _check_float32(self) -> None:
        """``--target float32`` puts nothing in 16 bits: an option that only says how to paint,
        or loss scaling, would do nothing, so it is a usage error, as the loss-scale options
        the mode ignores are (:func:`~amp_rewrite.training.config.scale_config`)."""
        given = [(self.rules and not isinstance(self.rules, RuleSet), "--rules", "rules"),
                 (self.lowp_io, "--lowp-io", "lowp_io"), (self.emulate, "--emulate", "emulate"),
                 (self.min_matrix_intensity is not None, "--min-matrix-intensity",
                  "min_matrix_intensity"),
                 (self.cost_aware, "--cost-aware", "cost_aware"),
                 (self.calibration is not None, "--calibration", "calibration"),
                 (self.loss_scale is not None and str(self.loss_scale).strip().lower() != "none",
                  "--loss-scale", "loss_scale")]
        for asked, flag, keyword in given:
            if asked:
                name = option(flag, keyword)
                target = option("--target float32", "target='float32'")
                raise InputError(f"{name} says how to paint in 16 bits, and {target} paints "
                                 "nothing (a model that computes in 16 bits is moved back to "
                                 f"float32 whole): drop {name}")

    def painting_target(self) -> Target:
        """The target painting works for: dtype, device type, least matrix intensity."""
        least = self.min_matrix_intensity
        if least is None:
            least = DEFAULT_MIN_INTENSITY.get((self.target, self.device), 0.0)
        if self.cost_aware and self.slower_here():
            least = math.inf   # no island gains here: every one stays float32 (paint.islands)
        batches = [dims[0] for dims in (self.shapes or {}).values() if len(dims)]
        # several inputs of different batches: the smallest, as weight casts weigh most there
        return Target(self.target, DEVICES[self.device], float(least),
                      batch=max(1, min(batches)) if batches else None,
                      costs=self.cost_table() if self.weighed() else None)

    def cost_table(self) -> CostTable:
        """The rates the cost model weighs with: ``costs`` (a file, or the shipped table), else
        the table measured on this CPU, else the shipped one
        (:func:`~amp_rewrite.rules.cost_table.choose`)."""
        return cost_table.choose(self.costs)

    def weighed(self) -> bool:
        """Whether the cost model of bfloat16 on a CPU weighs this conversion (what
        ``--shape`` informs and ``--measure`` times)."""
        return (self.target, self.device) == ("bfloat16", "cpu")

    def folds(self, graph_def) -> bool:
        """Whether ``graph_def`` is folded first (``--fold-constants``): as asked, else by
        default for bfloat16 on a CPU, where a batch norm left unfolded keeps its convolution
        from fusing with its activation (docs/decisions.md "--fold-constants"), in a graph
        without variables (a training graph is never folded)."""
        if self.fold_constants is not None:
            return self.fold_constants
        return self.weighed() and not self.emulate and not constfold.has_variables(graph_def)

    def may_freeze(self) -> bool:
        """Whether a SavedModel is frozen unless something in it forbids it: ``--freeze``, or
        by default for bfloat16 on a CPU, where weights cast on every run and batch norms on
        variables cost more than the 16-bit matrix work saves at small batches
        (docs/decisions.md "Frozen and folded by default (bfloat16 on a CPU)"), unless an option names what
        freezing changes (``--lowp-io``, ``--calibration``, ``--emulate``)."""
        if self.freeze is not None:
            return self.freeze
        return (self.weighed() and not self.lowp_io and self.calibration is None
                and not self.emulate)

    def slower_here(self) -> bool:
        """Whether the conversion asked for runs slower than float32 on this machine:
        bfloat16 for a CPU that has no bfloat16 matrix unit (AMX-BF16 or AVX512-BF16)."""
        return self.weighed() and hardware.bf16_matrix_unit() is None


def input_shapes(shapes: Mapping[str, Sequence[int]], graph: Graph,
                 meta: meta_graph_pb2.MetaGraphDef) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``--shape``'s names resolved to the placeholders of ``graph`` they feed, by the rule
    every command names inputs by (:func:`~amp_rewrite.schema.inputs.match_inputs`, on the
    MetaGraph's inputs: its signatures', else its placeholders); a name that names none, or a
    shape that does not fit the input's stated one, is an InputError."""
    resolved = []
    specs = meta_graph_inputs(meta, graph)
    # a RaggedTensor's or SparseTensor's shape as a whole (by the argument's name) fixes only
    # what it fixes of its components (a RaggedTensor's rows: its row splits' length)
    shapes = component_shapes(shapes, specs)
    for name in match_inputs(shapes, specs, "--shape"):
        # a signature's input key names that input of every signature that has it (a Keras
        # export's serve and serving_default)
        for spec in (s for s in specs if name in input_keys(s)):
            dims = fitting_shape(name, shapes[name], spec)
            node = spec.tensor.rpartition(":")[0]
            if node in graph and graph.node(node).op in PLACEHOLDER_OPS:
                resolved.append((node, dims))
    return tuple(dict(resolved).items())


def _cost_model(target: Target) -> dict:
    """The report's ``cost_model`` entry: the batch an open first dimension stands for when the
    cost model weighs an island (``--shape``'s, which also reaches the function bodies its
    inputs are passed to, else :data:`~amp_rewrite.paint.costs.DEFAULT_BATCH`), and the table
    of rates it weighed with (``costs``: which, and the rates; a weighed target always has
    one, :meth:`Options.painting_target`)."""
    told, costs = target.batch is not None, target.costs
    entry = {"batch": target.batch if told else DEFAULT_BATCH, "told": told,
             "costs": costs.to_dict()}
    batch = (f"islands weighed at a batch of {target.batch} (--shape)" if told else
             f"islands weighed at an open batch as {DEFAULT_BATCH}")
    entry["summary"] = f"{batch}, with {costs.summary()}"
    return entry


def _hint_batch(report: Report, meta: meta_graph_pb2.MetaGraphDef, graph: Graph,
                batch: int) -> None:
    """Matrix ops kept float32 because their variable weights, cast once a run, cost more than
    they save for the samples an open batch stands for: say from which batch they would gain,
    and how to say so (``--shape`` on a signature input, its other dimensions as stated)."""
    kept_ops, pays = report.extra["batch"]["ops"], report.extra["batch"]["pays_from"]
    example = f"NAME={pays},..."
    signed = meta_graph_inputs(meta, graph) if meta.signature_def else []
    for spec in signed:   # the first signature input whose other dimensions are stated
        if spec.shape and all(d is not None for d in spec.shape[1:]):
            example = ",".join(map(str, [f"{spec.name}={pays}", *spec.shape[1:]]))
            break
    text = (f"{kept_ops} matrix ops stayed float32 (code cost): their variable weights, cast to "
            f"{report.target} on every run, cost more than they save for a batch of "
            f"{batch}; "
            f"from a batch of {pays} on they gain: if the model runs at such batches, "
            f"convert with --shape {example}")
    report.extra["batch"]["summary"] = text   # the CLI prints it with the summary
    report.warnings.append(text)


def _hint_folding(report: Report) -> None:
    """Matrix ops kept float32 because their activations would run unfused, in a graph
    --fold-constants could fold: folded, a trained batch norm becomes a bias TensorFlow fuses
    (docs/decisions.md "--fold-constants"); an untrained one folds away, so this says "may"."""
    text = (f"{report.extra['unfused_kept']} matrix ops stayed float32 because their "
            "activations would run unfused in bfloat16 (code cost); the graph has no variables, "
            "and --fold-constants may let TensorFlow fuse them: it folds batch norms into the "
            "convolutions as biases")
    report.warnings.append(text)
    log.warning(text)


def _hint_freezing(report: Report, saved: bool) -> None:
    """Where the weights are variables and the cost model estimates that freezing them and
    converting with --fold-constants gains enough (:data:`FREEZE_HINT_SHARE`,
    :data:`FREEZE_HINT_US`), say so, with the estimate (docs/savedmodels.md "When freezing
    gains"): for a SavedModel's graph (``saved``), the command that does it, ``--freeze``."""
    gain = report.extra.get("freezing")
    if not gain or gain["gain_us"] < max(FREEZE_HINT_US, FREEZE_HINT_SHARE * gain["fp32_us"]):
        return
    more = (f" and puts {gain['matrix_ops']} matrix ops kept float32 here in {report.target}"
            if gain["matrix_ops"] else "")
    how = ("convert with --freeze (every signature frozen, folded and converted, written as a "
           "SavedModel serving the same signatures)" if saved else
           "freeze the variables to Consts and convert the frozen graph with --fold-constants")
    where = "--freeze" if saved else "Frozen graphs from a SavedModel"
    text = (f"{how}: by the cost model that gains about {gain['gain_us']:.0f} µs a sample{more} "
            f"(no weight casts, batch norms folded into the convolutions; docs/savedmodels.md "
            f"\"{where}\")")
    gain["summary"] = text   # the CLI prints it with the summary, so it is not logged too
    report.warnings.append(text)


def convert_graph(meta_graph: meta_graph_pb2.MetaGraphDef, options: Options, *,
                  rules: RuleSet | None = None, loss_scaling: bool = True,
                  leave: Sequence[str] = ()) -> tuple[meta_graph_pb2.MetaGraphDef, Report]:
    """Convert ``meta_graph``'s graph and the functions it reaches; returns a new MetaGraphDef
    (the input is not changed) and the report.

    ``rules`` defaults to ``options.rule_set()``; ``loss_scaling=False`` leaves a graph that
    trains unscaled whatever ``options`` ask (SavedModels, see README); ``leave`` names library
    functions left unpainted (a SavedModel's train methods that loss scaling would refuse:
    :func:`~amp_rewrite.training.in_functions.unscalable_train_functions`).
    """
    options.check()
    rules = rules or options.rule_set()
    meta = meta_graph_pb2.MetaGraphDef()
    copy_except(meta_graph, meta, "graph_def")   # the graph is written once converted
    source = meta_graph.graph_def
    problems = check_call_types(source)
    if problems:  # the input's fault: the same check on the output would call it ours
        raise InputError(f"the input graph is not valid: {problems[0]}")
    interface = signature_tensors(meta)
    source, widened = _widened(meta_graph, options, interface)
    fold = options.folds(source)
    if fold and constfold.foldable(source):   # (grappler's pass takes seconds to fold nothing)
        source = constfold.fold_constants(source, set(options.keep) | interface)
    graph, added = graph_with_defaults(source)
    keep = kept(interface=interface, user=split_keep(options.keep, graph, source.library))
    fused = (bnfold.fold_batch_norms(graph, set(keep)) if fold
             and not constfold.has_variables(source) else None)
    if fused is not None:   # the scales TensorFlow's folding multiplied into Conv2D filters itself
        fused.pushed = constfold.scales_pushed(meta_graph.graph_def, source)
    calls = {f.signature.name: f.signature for f in source.library.function}
    main_rules = rules_for(rules, graph.names())  # overrides of function nodes: later
    target = dataclasses.replace(options.painting_target(),
                                 input_shapes=input_shapes(options.shapes or {}, graph, meta_graph))
    report, before = rewrite(graph, main_rules, target, keep=keep, lowp_io=options.lowp_io,
                             calls=calls, ranges=options.calibration, headroom=options.headroom)
    if options.weighed():   # the batch an open first dimension is weighed at, here and in bodies
        report.extra["cost_model"] = _cost_model(target)
    if fused:
        report.extra["fusion"] = fused.summary()
    if trains(source.node):   # its weights change: freezing them is no option
        report.extra.pop("freezing", None)
    if report.extra.get("unfused_kept") and not fold and not constfold.has_variables(source):
        _hint_folding(report)
    config = scale_config(options.loss_scale, options.target,
                          dict(options.loss_scale_options or {})) if loss_scaling else None
    steps, state = _scale_graph(graph, before, meta, source.library, config, options, main_rules,
                                report) if config is not None else ([], None)
    out = graph.to_graph_def(source, into=meta.graph_def)
    strip_graph_defaults(out, added)
    paint_library(out, rules, report, target, keep=options.keep,
                  roots=sorted(meta.object_graph_def.concrete_functions), interface=interface,
                  ranges=options.calibration, headroom=options.headroom, leave=leave)
    if not fold:   # a SavedModel's MetaGraph has tags: --freeze takes it
        _hint_freezing(report, saved=bool(meta_graph.meta_info_def.tags))
    saver = set(saver_functions(meta_graph))
    report.saver_functions = [scope for scope in report.scopes if scope in saver]
    if report.extra.get("batch"):
        _hint_batch(report, meta, graph, target.batch or DEFAULT_BATCH)
    if widened is not None:
        note_widening(report, widened, options.target)
    if state is not None:   # a train step in a library function: scaled once painted
        scale_train_functions(meta, steps, config, report)
        report.extra["loss_scaling"].update(state)
    # every step above linted what it edited; the calls between the graph and its functions
    # are checked once more on the final graph, as on the input
    problems = check_call_types(meta.graph_def)
    if problems:
        raise LintError(problems)
    return meta, report


def emulate(meta: meta_graph_pb2.MetaGraphDef, report: Report) -> None:
    """Replace ``meta``'s float16 graph, in place, by its float32 emulation
    (:mod:`amp_rewrite.transforms.emulate`): its own nodes and its functions' bodies, the
    signatures of the functions the SavedModel restores kept float32. Run on a converted
    MetaGraph once it is loss-scaled, so the emulation computes what the float16 model would,
    scaling included; ``report`` gets the ``emulation`` section."""
    emulated = emulate_float16(meta.graph_def, roots=meta.object_graph_def.concrete_functions)
    meta.graph_def.CopyFrom(emulated.graph_def)
    where = f"; {len(emulated.functions)} function bodies emulated" if emulated.functions else ""
    report.extra["emulation"] = {
        "ops": emulated.ops, "functions": emulated.functions,
        "summary": f"{emulated.ops} float16 ops computed in float32 on values rounded to "
                   f"float16{where}"}


def _scale_graph(work: Graph, original: Before, meta, library, config, options: Options,
                 rules: RuleSet, report: Report) -> tuple[list[str], dict | None]:
    """Loss scaling in the graph's own nodes, in place; or, when its train step is a library
    function it calls, the state variables in the graph: returns those functions and what the
    report says of the state, for :func:`scale_train_functions` once the library is painted."""
    hints = {k: v for k, v in (options.loss_scale_options or {}).items() if k in HINTS}
    steps = function_train_steps(work, library)
    state = add_function_state(work, meta, steps, config, hints, report) if steps else None
    if state is not None or add_loss_scaling(work, meta, config, hints, report):
        lint.lint(work, original=original, rules=rules)
    return steps, state


def _widened(meta_graph: meta_graph_pb2.MetaGraphDef, options: Options,
             interface: set[str]) -> tuple[graph_pb2.GraphDef, Widened | None]:
    """``meta_graph``'s GraphDef, widened to float32 where it computes in a 16-bit dtype the
    conversion does not target (:func:`~amp_rewrite.conversion.widening.dtypes_to_widen`),
    before anything else reads it (constant folding would round a float32 weight's Cast to
    16 bits into a Const); the signature tensors and ``--keep`` names keep their dtypes."""
    dtypes = dtypes_to_widen(meta_graph, options.target)
    if not dtypes:
        return meta_graph.graph_def, None
    graph, _ = graph_with_defaults(meta_graph.graph_def)
    user = split_keep(options.keep, graph, meta_graph.graph_def.library)
    source, widened = widen_meta_graph(meta_graph, dtypes,
                                       keep=kept(interface=interface, user=user),
                                       user_keep=options.keep, device=DEVICES[options.device])
    return source, widened


def signature_tensors(meta_graph: meta_graph_pb2.MetaGraphDef) -> set[str]:
    """Node names behind the MetaGraph's signature inputs and outputs (the interface)."""
    names: set[str] = set()
    for sig in meta_graph.signature_def.values():
        for info in list(sig.inputs.values()) + list(sig.outputs.values()):
            if info.name:
                names.add(info.name.split(":")[0].lstrip("^"))
    return names
