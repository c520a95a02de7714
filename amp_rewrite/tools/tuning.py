"""``amp-rewrite tune``: the fewest nodes kept in float32 for every sample to meet a tolerance.

Rule lists are a guess: a sum over many large values, a softmax or a LayerNorm over large
logits can overflow or lose accuracy in float16 where the lists call the op safe. ``tune``
starts from the painted graph and searches with the error attribution of ``verify
--per-node`` instead of blind bisection:

1. *Trial 0* is the ordinary conversion. A trial converts the model with the nodes kept so far
   as ``keep_fp32`` overrides, runs it on every sample, and scores each sample with the metric
   (lower is better); it passes when every sample's score is within the tolerance and, for
   the default metric ``rel_l2``, ``verify``'s other default checks pass on the samples too
   (top-1 agreement of batches of scores, the move of a share of decisions). Both
   models run as ``verify`` runs them (:func:`amp_rewrite.tools.runner.open_model` and
   :func:`~amp_rewrite.tools.runner.open_converted`: the same outputs and weights, the same
   session), so a tuned model passes ``verify`` on the same samples and tolerance.
   *The error margin* (``error_margin`` F, default 1): a trial passes on the tuning samples
   only when their worst score is at most tolerance / F (``verify``'s other checks are
   unchanged). The samples' error is an estimate of the error on the data the model meets
   next: a result that meets the tolerance just barely on them exceeds it on the next batch
   about as often as not. Held-out samples are still judged against the tolerance itself.
   *The range margin* (trial 1, when it keeps anything): the float32 model is traced on every
   sample (the trace ``verify --per-node`` takes), and each tensor whose largest magnitude
   comes within ``headroom`` of the target's largest value
   (:func:`~amp_rewrite.core.dtypes.near_limit`, default
   :data:`~amp_rewrite.core.dtypes.HEADROOM`) is held in float32: the node computing
   it and the nodes reading it (which would read it through a cast to the target: an input
   cast), wherever the painted graph puts them in low precision. The tuning samples are a few
   batches of a distribution the model then meets millions of times: a tensor that reaches
   a quarter of 65504 on them overflows on the next batch. Tensors already past the range on
   the samples are kept too, unless the painted graph shows their infinities harmless (a
   -1e9 attention mask: every tensor computed from it agrees, as ``verify`` compares). These
   keeps are never released: the samples cannot show that they are not needed. A model the
   trace refuses (a signature that writes a lookup table) is tuned without them, and the result's
   message says so.
2. While a trial fails, the worst sample is traced through both models
   (:func:`amp_rewrite.tools.verify.attribute`) and the nodes where the error starts are kept in
   float32: the low-precision tensors that add the most error over their inputs (an overflow
   to inf comes first), or, where the tensor adding it is float32 (an Exp or Softmax fed
   rounded values), the low-precision tensors it is computed from. Every tensor within half of
   the largest added error is taken in one trial; overflows (inf: a tensor non-finite where
   the float32 model and the tensors it is computed from are finite) all together, a group
   in one trial, as step 3 releases those that were consequences of another. When the
   attribution names nothing new, every node still in low precision is kept at once; if
   even that fails, the tolerance
   cannot be met (nothing is written). The metrics and the attribution compare as ``verify``
   does: a value past the target's range that it holds as the infinity of its sign (a -1e9
   attention mask) agrees, so no keep is spent on it unless a consumer turns it into an error.
3. Once a trial passes, the nodes step 2 kept are released again, last kept first, in halves
   (a released group that fails is split and its halves tried on their own), so a node stays
   float32 only when releasing it alone fails the tolerance. A set already tried is not run
   twice.
4. With ``relax``, the other direction, where the lists were too careful: the float32 nodes
   that only the lists kept float32 (deny, infer or clear alone, not listed) and that exchange
   data with a low-precision node are forced into low precision (``force_lowp``), all at once
   and then in halves of each group that fails, keeping every group that passes.

``max_trials`` bounds the conversions run; pruning stops at the budget with a passing result.
Held-out samples are never tuned on: the result is judged on them as on the tuning samples (the
metric, and ``verify``'s checks for ``rel_l2``), and a result that fails there is a failure
(nothing written) unless ``allow_holdout_failure``.
Before any trial, the float32 model is run twice and scored against itself: a metric that
does not give at most the tolerance for equal outputs (or a model whose outputs vary between
runs) is refused, as no conversion could meet it.

The result is the converted model and a rules file of the overrides chosen (``keep_fp32``,
each with the op and the error that chose it; ``force_lowp`` from ``relax``), which
``--rules`` reapplies to give the same graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..conversion.graph import Options
from ..conversion.pipeline import convert_model
from ..core.dtypes import BFLOAT16, HALF, HEADROOM, LARGEST, TARGET_NAMES, TARGETS, near_limit
from ..core.errors import InputError, UnsupportedGraphError
from ..core.ops import FUNCTIONAL_OPS, MATRIX_OPS
from ..io.files import (
    OutputSet,
    check_container,
    check_file_destination,
    is_keras_file,
    same_file,
    tune_rules_path,
)
from ..io.keras_files import saved_models
from ..io.load import Model, load
from ..io.save import check_destination, save, stage
from ..report.decisions import Report
from ..rules.loader import NodeRule
from ..schema.inputs import match_inputs
from ..training.detect import training_parts
from .ranges import Ranges
from .runner import (
    Runner,
    fill_iterator_inputs,
    load_inputs,
    open_converted,
    open_model,
)
from .traces import upstream
from .masks import constant_masks
from .verify import (REL_L2, TOP1, Attribution, ErrorStats, attribute,
                     check_finite_reference, compare_outputs, criteria, lowest_dtype)

log = logging.getLogger(__name__)
#: tune's feeds when none are given (told apart from feeds given along with inputs=)
_NO_FEEDS: tuple = ()

#: the built-in metrics, each the worst over a sample's outputs (lower is better)
METRICS = ("rel_l2", "max_abs", "top1")
_LOWP = {TARGET_NAMES[HALF], TARGET_NAMES[BFLOAT16]}
DEFAULT_MAX_TRIALS = 50
# A tensor adding at least this share of the largest added error is kept in the same trial:
# overflows (inf) are taken together, a long tail of rounding noise is not.
_BATCH_SHARE = 0.5
_SOURCE = "amp-rewrite tune"
# float32 decisions that only the rule lists made: tune --relax may overturn them
RELAXABLE = {"deny_list", "deny_propagated", "infer_alone", "clear_alone", "not_listed"}

Outputs = Mapping[str, np.ndarray]
Metric = Callable[[Outputs, Outputs], float]


# ----------------------------------------------------------------- metrics
def _stats(ref: Outputs, out: Outputs, top1: bool = False):
    """Each output's :class:`~amp_rewrite.tools.verify.ErrorStats`, compared as ``verify``
    compares outputs: an inf or NaN where float32 gives a number is an infinite error, whatever
    its sign."""
    for name, a in ref.items():
        s = ErrorStats(0.0, 0.0)
        s.update(a, out[name], top1=top1)
        yield s


def _rel_l2(ref: Outputs, out: Outputs) -> float:
    return max((s.rel_l2 for s in _stats(ref, out)), default=0.0)


def _max_abs(ref: Outputs, out: Outputs) -> float:
    return max((s.max_abs_error for s in _stats(ref, out)), default=0.0)


def _top1(ref: Outputs, out: Outputs) -> float:
    """The share of positions whose argmax moved, on the outputs with a class axis."""
    moved = [(s.rows - s.agree) / s.rows for s in _stats(ref, out, top1=True)
             if s.top1 is not None]
    if not moved:
        raise InputError("metric top1: no output has a class axis (a float output of rank 2 "
                         "or more whose last dimension is over 1); pick one with "
                         "--output-tensor or choose another --metric")
    return max(moved)


_BUILTIN: dict[str, Metric] = {"rel_l2": _rel_l2, "max_abs": _max_abs, "top1": _top1}


def _per_output(metric: Metric, ref: Outputs, out: Outputs) -> dict[str, float]:
    """A built-in ``metric`` of each output alone (top1: of those that are batches of
    scores); NaN counts as inf, as in a score."""
    values = {}
    for name in ref:
        try:
            value = float(metric({name: ref[name]}, {name: out[name]}))
        except InputError:      # top1 of an output that is no batch of scores
            continue
        values[name] = math.inf if math.isnan(value) else value
    return values


def default_tolerance(metric: str, target: str) -> float:
    """What ``verify`` accepts by default, so that a tuned model passes ``verify``: rel_l2 by
    target (float16 1e-2, bfloat16 5e-2), top1 one row in a hundred moved; max_abs depends on
    the outputs' scale and has none."""
    if metric == "rel_l2":
        return REL_L2[HALF if target == "float16" else BFLOAT16]
    if metric == "top1":
        return round(1.0 - TOP1, 12)
    raise InputError(f"--metric {metric} needs --tolerance X: an absolute error has no default "
                     "(it depends on the outputs' scale)")


# ----------------------------------------------------------------- what to meet
@dataclass(frozen=True)
class Search:
    """What a tuning must meet and how far it may look: :func:`tune`'s keywords, checked by
    :func:`search_settings`. ``metric`` names the metric (a function's ``__name__``),
    ``score`` computes it, ``per_output`` scores one output alone (built-in metrics; names
    the output a held-out sample fails on)."""

    metric: str
    score: Metric
    tolerance: float
    per_output: Callable | None = None
    max_trials: int = DEFAULT_MAX_TRIALS
    headroom: float = HEADROOM
    error_margin: float = 1.0
    relax: bool = False
    nonfinite_reference: bool = False

    @property
    def accept(self) -> float:
        """What a trial must meet on the tuning samples; verify's checks and the held-out
        samples are judged against the tolerance itself (the margin is for unseen data)."""
        return self.tolerance / self.error_margin

    @property
    def verify_checks(self) -> bool:
        """The default metric is verify's default judgement: its other checks must agree."""
        return self.metric == "rel_l2"


def search_settings(metric: str | Metric, tolerance: float | None, target: str, *,
                    max_trials: int = DEFAULT_MAX_TRIALS, headroom: float = HEADROOM,
                    error_margin: float = 1.0, relax: bool = False,
                    nonfinite_reference: bool = False) -> Search:
    """:class:`Search` from :func:`tune`'s keywords, each checked (an :class:`InputError`
    naming the flag)."""
    if isinstance(metric, str):
        if metric not in METRICS:
            raise InputError(f"--metric {metric}: unknown metric (choose from {', '.join(METRICS)})")
        name, score = metric, _BUILTIN[metric]
        per_output = functools.partial(_per_output, score)
        tolerance = default_tolerance(metric, target) if tolerance is None else tolerance
    else:
        name, score, per_output = getattr(metric, "__name__", "custom"), metric, None
        if tolerance is None:
            raise InputError("a metric function needs a tolerance")
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise InputError(f"--tolerance {tolerance!r}: must be a finite number >= 0")
    if not (headroom >= 1 and math.isfinite(headroom)):
        raise InputError(f"--headroom {headroom!r}: must be a finite number >= 1 (1: no margin "
                         "beyond the target's range)")
    if not (error_margin >= 1 and math.isfinite(error_margin)):
        raise InputError(f"--error-margin {error_margin!r}: must be a finite number >= 1 (a "
                         "trial passes at the tolerance divided by it; 1: no margin)")
    if max_trials < 1:
        raise InputError("--max-trials must be at least 1")
    return Search(name, score, tolerance, per_output, max_trials, headroom, error_margin, relax,
                  nonfinite_reference)


# ----------------------------------------------------------------- results
@dataclass
class Kept:
    """A node tune keeps in float32, and why: the tensor whose added error chose it, or for
    the range margin (``largest`` set) the tensor it computes or reads, whose largest
    magnitude on the tuning samples is ``largest``."""

    node: str
    op: str
    tensor: str
    added: float
    trial: int
    largest: float | None = None

    def why(self, target: str, headroom: float) -> str:
        """In words, for the summary and the rules file."""
        if self.largest is not None:
            top = LARGEST[TARGETS[target]]
            where = (f"past {target}'s largest value {top:g}" if self.largest > top else
                     f"within headroom {headroom:g} of {target}'s largest value {top:g}")
            tensor = (self.tensor if self.tensor.rsplit(":", 1)[0] == self.node
                      else f"reads {self.tensor}, which")
            return f"{tensor} reaches {self.largest:.3g} on the tuning samples, {where}"
        if self.tensor:
            return f"{self.tensor} added {self.added:.3g}"
        return "kept with every low-precision node"


@dataclass
class TuneResult:
    """What :func:`tune` did. ``ok``: every sample met the tolerance (only then is anything
    written); ``model``/``report``: the best passing conversion (else the last tried)."""

    ok: bool
    metric: str
    tolerance: float
    samples: int
    trials: int
    seconds: float
    before: float                     # worst sample's metric, painted graph (trial 0)
    after: float                      # the same for the result
    kept: list[Kept]
    forced: list[str]                 # nodes relax moved into low precision
    lowp_before: int                  # nodes in low precision, painted graph
    lowp_after: int
    model: Model
    report: Report
    holdout_before: float | None = None   # the metric on held-out samples (never tuned on)
    holdout_after: float | None = None
    # what the result fails on the held-out samples: the output and by how much ("" if none)
    holdout_failure: str = ""
    message: str = ""                 # why it stopped, when not ok; else what was cut short
    rules_file: str | None = None
    trial_log: list[dict] = field(default_factory=list)
    target: str = "float16"
    headroom: float = HEADROOM        # the range margin's safety factor
    error_margin: float = 1.0         # trials passed at tolerance / error_margin
    # the matrix ops of the painted graph and of the result: how many, in 16 bits, and kept
    # float32 by the CPU cost model (tools.tuning._matrix)
    matrix_before: dict = field(default_factory=dict)
    matrix_after: dict = field(default_factory=dict)

    def float32_model(self) -> str | None:
        """Where the result computes none of its matrix ops in 16 bits: the sentence convert
        says of such an output (:meth:`~amp_rewrite.report.decisions.Report.float32_model`)
        and why: the tolerance, where tune's keeps made it so (the painted graph ran some in
        16 bits), else the painting it started from; None otherwise. Only a passing result
        is written, and it is no plain success: the summary, the command and the page say
        so."""
        text = self.report.float32_model()
        if text is None:
            return None
        if self.matrix_before.get("lowp"):
            return (f"{text}; why: the tolerance: tune kept float32 the "
                    f"{self.matrix_before['lowp']} matrix op(s) the painted graph ran in "
                    f"{self.target} to meet {self.metric} <= {self.tolerance:g}"
                    f"{self._margin_note()} on its {self.samples} sample(s) (a looser "
                    "--tolerance keeps fewer; a float32 model gains no speed)")
        return f"{text}; why: the painted graph tune started from was one already"

    @property
    def mostly_float32(self) -> bool:
        """The painted graph tune started from runs at most half its matrix ops in 16 bits:
        whatever it kept, the result is mostly a float32 model."""
        m = self.matrix_before
        return bool(m.get("total")) and 2 * m["lowp"] <= m["total"]

    def start_line(self) -> str:
        """What tune started from: the painted graph's matrix ops in 16 bits and, where the
        CPU cost model kept some float32, how to tune the graph painted whole instead."""
        m = self.matrix_before
        if not m.get("total"):
            return "painted graph: no matrix ops (MatMul/Conv family)"
        line = f"painted graph: {m['lowp']} of {m['total']} matrix ops in {self.target}"
        if m["cost"]:
            line += (f"; the CPU cost model kept {m['cost']} float32 (too little matrix work "
                     "to gain, by their shapes and the batch it weighed), so this tuned that "
                     "graph: to tune the graph painted whole, pass --min-matrix-intensity 0, or "
                     "the batch you serve with --shape NAME=D1,D2,... where the batch decided")
        return line

    @property
    def graph_def(self):
        return self.model.graph_def

    def to_dict(self) -> dict:
        """The verdict and the search's figures, as the HTML page reads them."""
        return {"ok": self.ok, "metric": self.metric, "tolerance": self.tolerance,
                "error_margin": self.error_margin, "samples": self.samples,
                "trials": self.trials, "before": self.before, "after": self.after,
                "kept": len(self.kept), "forced": len(self.forced),
                "holdout_after": self.holdout_after, "holdout_failure": self.holdout_failure,
                "target": self.target, "float32_model": self.float32_model(),
                "summary": self.summary()}

    def _margin_note(self) -> str:
        if self.error_margin == 1:
            return ""
        return (f" (tuned to {self.tolerance / self.error_margin:g}: error margin "
                f"{self.error_margin:g})")

    def summary(self) -> str:
        lines = [f"metric {self.metric} (worst of {self.samples} sample(s)), tolerance "
                 f"{self.tolerance:g}{self._margin_note()}: painted graph {self.before:.3g} -> "
                 f"{'tuned' if self.ok else 'best tried'} {self.after:.3g}",
                 f"{self.trials} trials in {self.seconds:.1f} s; {len(self.kept)} node(s) kept "
                 f"in float32; nodes in low precision {self.lowp_before} -> {self.lowp_after}",
                 self.start_line()]
        if self.ok and (float32 := self.float32_model()):
            lines.insert(0, f"tuned to a float32 model, no plain success: {float32}")
        elif self.mostly_float32:
            lines.append(f"note: the result is mostly float32 ({self.matrix_after['lowp']} of "
                         f"{self.matrix_after['total']} matrix ops in {self.target}): it "
                         "meets the tolerance, but gains little speed")
        if self.holdout_before is not None:
            verdict = f"FAIL: {self.holdout_failure}" if self.holdout_failure else "ok"
            lines.append(f"held-out samples: {self.holdout_before:.3g} -> "
                         f"{self.holdout_after:.3g} ({verdict})")
        margin = sum(1 for k in self.kept if k.largest is not None)
        if margin:
            lines.append(f"range margin: {margin} node(s) kept for tensors within headroom "
                         f"{self.headroom:g} of {self.target}'s range on the tuning samples")
        for k in self.kept:
            lines.append(f"  keep_fp32 {k.node} ({k.op}): {k.why(self.target, self.headroom)}")
        for name in self.forced:
            lines.append(f"  force_lowp {name}: the tolerance holds with it in low precision")
        if self.message and not (self.holdout_failure and self.message.startswith("held-out")):
            lines.append(self.message)      # (a held-out failure is said in its line above)
        return "\n".join(lines)


@dataclass
class _Trial:
    keep: frozenset[str]
    scores: list[float]
    model: Model
    report: Report
    runner: Runner | None
    force: frozenset[str] = frozenset()
    ok: bool = False          # every sample within tolerance / error margin, verify agrees
    verify_failed: str = ""   # what verify's checks, or a look inside, refuse where the metric passes
    found: Attribution | None = None   # its tensors against the float32 model's, once traced

    @property
    def score(self) -> float:
        return max(self.scores)

    @property
    def forced(self) -> list[str]:
        """The nodes forced into low precision, in graph order."""
        return [n.name for n in self.report.nodes if n.name in self.force]

    def close(self) -> None:
        """Close the runner, and delete the SavedModel it ran from (a copy per trial would
        otherwise fill the disk with up to --max-trials copies of the model)."""
        if self.runner is not None:
            folder = getattr(self.runner, "path", None) if self.model.kind == "savedmodel" else None
            self.runner.close()
            self.runner = None
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------- the search
class _Tuner:
    def __init__(self, model: Model, options: Options, ref: Runner, feeds: list[dict],
                 search: Search, workdir: Path, *, signature: str | None = None,
                 outputs: Sequence[str] = (), progress=None):
        self.model, self.options, self.ref, self.feeds = model, options, ref, feeds
        self.search = search
        # why the model's tensors cannot be traced, if they cannot: the range margin and the
        # look inside each trial are then skipped, and the result's message says so
        self.skipped = ""
        self.signature, self.outputs = signature, outputs
        self.progress, self.workdir = progress, workdir
        self.base = options.rule_set()
        self.ref_outputs = [self._outputs(ref, f) for f in feeds]
        # the target's range: past it the original may agree with an inf of its sign, where
        # it is a constant mask (tools.masks)
        self.crit = criteria(TARGETS[options.target])
        self.trials = self.folders = 0
        # every trial made, by its (keep, force) sets: none is run twice, and each is closed
        # at the end (closing one twice is harmless)
        self.seen: dict[tuple[frozenset[str], frozenset[str]], _Trial] = {}
        self.log: list[dict] = []

    def _outputs(self, runner: Runner, feed: Mapping) -> dict[str, np.ndarray]:
        return dict(zip(self.ref.outputs, runner.callable()(feed)))

    def check_baseline(self) -> None:
        """The float32 model judged against itself: its outputs finite on the samples (a
        verdict needs a finite reference, unless ``nonfinite_reference``) and the metric 0."""
        check_reference(self.ref.outputs, self.ref_outputs, self.search.nonfinite_reference)
        for i, (feed, want) in enumerate(zip(self.feeds, self.ref_outputs)):
            again = self._score(want, self._outputs(self.ref, feed))
            if not again <= self.search.accept:
                raise InputError(
                    f"the tolerance cannot be met: the float32 model scored against itself (run "
                    f"twice on sample {i}) gives {again:.3g} > {self.search.accept:g}, so no "
                    "conversion can pass; the metric must give 0 (at most the tolerance) for "
                    "equal outputs, and the model's outputs must not vary between runs")

    def _score(self, ref: Outputs, out: Outputs) -> float:
        value = float(self.search.score(ref, out))
        return math.inf if math.isnan(value) else value

    def trial(self, keep: Iterable[str], why: str, force: Iterable[str] = ()) -> _Trial:
        """Convert with ``keep`` as keep_fp32 and ``force`` as force_lowp overrides, run every
        sample and score it."""
        keep, force = frozenset(keep), frozenset(force)
        self.trials += 1
        converted, report = self._convert(keep, force)
        runner = self._open_converted(converted)
        t = _Trial(keep, [], converted, report, runner, force)
        self.seen[(keep, force)] = t
        t.scores = [self._score(want, self._outputs(runner, feed))
                    for feed, want in zip(self.feeds, self.ref_outputs)]
        ok = t.score <= self.search.accept
        if ok and self.search.verify_checks:
            t.verify_failed = self._verify_refuses(t)
            ok = not t.verify_failed
        if ok:
            t.verify_failed = self._inside(t)
            ok = not t.verify_failed
        t.ok = ok
        self.log.append({"trial": self.trials - 1, "why": why, "kept": len(keep),
                         "forced": len(force), "metric": t.score, "ok": ok,
                         "keep": sorted(keep)})
        log.info("trial %d (%s): %d kept, %d forced, metric %.3g %s", self.trials - 1, why,
                 len(keep), len(force), t.score, "ok" if ok else "over")
        if self.progress is not None:
            self.progress(self.trials, self.search.max_trials, t.score, len(keep))
        return t

    def _convert(self, keep: Iterable[str], force: Iterable[str] = ()):
        """The model converted with ``keep`` as keep_fp32 and ``force`` as force_lowp
        overrides, after the rules given: (model, report)."""
        rules = dataclasses.replace(self.base, node_rules=list(self.base.node_rules)
                                    + [keep_rule(name) for name in sorted(keep)]
                                    + [keep_rule(name, "force_lowp") for name in sorted(force)])
        return convert_model(self.model, dataclasses.replace(self.options, rules=rules))

    def _verify_refuses(self, t: _Trial) -> str:
        """What ``verify`` with its default checks, the tolerance as its ``--rel-l2``, refuses
        in trial ``t`` on the samples ("" when it passes): the metric bounds each sample's
        relative L2 error, verify also the top-1 agreement of batches of scores and how far a
        share of decisions moves."""
        outs = compare_outputs(self.ref, t.runner, self.feeds, self.verify_criteria(t.runner))
        return "; ".join(f"{o.name}: {', '.join(o.failed)}" for o in outs if not o.ok)

    def verify_criteria(self, runner: Runner):
        """``verify``'s default checks for a conversion, with the tolerance as its bound."""
        return criteria(lowest_dtype(runner), rel_l2=self.search.tolerance,
                        nonfinite_reference=self.search.nonfinite_reference)

    def _inside(self, t: _Trial) -> str:
        """What trial ``t`` holds inside on the samples that no output shows yet ("" if
        nothing): tensors that are inf or NaN where the float32 model is finite, but for a
        constant mask's rounding no consumer turns into an error (the rule ``verify
        --per-node`` judges by, :func:`~amp_rewrite.tools.verify.attribute`). Such a tensor
        passes a batch by luck (scores overflowing to -inf, which a softmax turns into the
        zeros float32 gives) and fails the next (+inf: NaN). Not looked at where the model
        cannot be traced (said in :attr:`skipped`)."""
        if self.skipped:
            return ""
        try:
            t.found = attribute(self.ref, t.runner, self.feeds, self.crit)
        except InputError as exc:
            self._skip(exc)
            return ""
        bad = [n.tensor for n in t.found.ranked if math.isinf(n.rel_l2)]
        if not bad:
            return ""
        return (f"{len(bad)} tensor(s) inside hold inf or NaN where float32 is finite, which "
                f"the next batch may carry to an output: {', '.join(bad[:3])}"
                + (" ..." if len(bad) > 3 else ""))

    def _open_converted(self, converted: Model) -> Runner:
        """A trial's conversion opened as ``verify`` opens one against the original
        (:func:`~amp_rewrite.tools.runner.open_converted`): the same outputs, the original's weights,
        the same session; a SavedModel runs from a folder of its own."""
        if converted.kind == "savedmodel":
            self.folders += 1
            folder = self.workdir / f"model{self.folders}"
            save(converted, folder)
            converted = folder
        return open_converted(self.ref, converted, signature=self.signature, outputs=self.outputs)

    def culprits(self, t: _Trial, kept: Mapping[str, Kept], names: set[str]) -> list[Kept]:
        """The nodes where the worst sample's error starts (module docstring, step 2)."""
        worst = max(range(len(self.feeds)), key=lambda i: t.scores[i])
        # a trial refused for what it holds inside was traced on every sample already
        found = t.found or attribute(self.ref, t.runner, [self.feeds[worst]], self.crit)
        chosen: dict[str, Kept] = {}
        first = None
        for n in found.ranked:
            if n.added <= 0 or (first is not None and not n.added >= _BATCH_SHARE * first):
                break
            for tensor in _lowp_sources(n.tensor, found):
                node = tensor.rsplit(":", 1)[0]
                if node in kept or node in chosen or node not in names:
                    continue
                chosen[node] = Kept(node, found.info[tensor].op, n.tensor, n.added, self.trials)
                first = n.added if first is None else first
        # every overflow (added inf) is taken at once, a group: those that are consequences
        # of another, seen through tensors the comparison cannot follow (casts, folded
        # constants), are released again once a trial passes
        return list(chosen.values())

    def margin(self, start: _Trial) -> dict[str, Kept]:
        """The range margin (module docstring, step 1): node -> why, for the nodes the painted
        graph ``start`` holds in low precision that compute or read a tensor within the
        headroom of the target's range on the tuning samples."""
        target = TARGETS[self.options.target]
        ranges = Ranges()
        info: dict = {}
        if self.skipped:
            return {}
        try:
            for feed in self.feeds:
                trace = self.ref.trace(feed)
                ranges.add(trace)
                info.update(trace.info)
        except InputError as exc:
            self._skip(exc)
            return {}
        if not self.search.nonfinite_reference:   # no NaN of float32's own to chase
            ranges.check_finite("the tuning samples", "tune anyway")
        # an infinity the float32 model holds itself is past any range (NaNs are left out)
        largest = {name: math.inf if t.infinite else t.max_abs
                   for name, t in ranges.tensors.items()}
        near = {name: v for name, v in largest.items() if near_limit(v, target, self.search.headroom)}
        # a constant mask (-1e9) is past the range by construction, whatever the data: it is
        # the one exception (tools.masks: the rule verify --per-node judges by too)
        masks = constant_masks(info, ranges.tensors, LARGEST[target], near)
        near = {name: v for name, v in near.items() if name not in masks}
        order = sorted(near, key=lambda t: (info[t].order, t))
        chosen: dict[str, Kept] = {}

        def keep(names: Iterable[str], report: Report, tensor: str) -> None:
            lowp = {n.name: n for n in report.nodes if n.precision in _LOWP | {"mixed"}}
            for name in names:
                if name in lowp and name not in chosen:
                    chosen[name] = Kept(name, lowp[name].op, tensor, math.nan, self.trials,
                                        largest=near[tensor])

        # first the nodes computing the tensors (a constant, a large weight, is held where it
        # is read instead), then those reading them that are still in low precision with
        # these kept: a reader the painting moves to float32 beside them needs no keep
        for tensor in order:
            if info[tensor].op != "Const":
                keep([tensor.rsplit(":", 1)[0]], start.report, tensor)
        report = self._convert(chosen)[1] if chosen else start.report
        readers = _consumers(self.model)
        for tensor in order:
            keep(sorted(readers.get(tensor.rsplit(":", 1)[0], ())), report, tensor)
        return chosen

    def _skip(self, exc: InputError) -> None:
        """A model verify --per-node refuses to trace (a signature writing a table, a random
        op inside) is still tuned, as before the margin, without it and without looking
        inside the trials: said, not silent."""
        self.skipped = f"range margin skipped: {exc}"
        log.warning("%s", self.skipped)

    def run(self) -> tuple[_Trial, dict[str, Kept], _Trial, bool, str]:
        """The search; returns the painted graph's trial, what is kept, the result's trial,
        whether it passes and a note (why it failed, or what was cut short)."""
        start = self.trial((), "painted graph")
        names = {n.name for n in start.report.nodes}
        margin = self.margin(start)
        kept: dict[str, Kept] = dict(margin)
        current = start
        if margin:
            if self.trials >= self.search.max_trials:
                return start, kept, start, False, (
                    f"not met within --max-trials {self.search.max_trials}: the range margin "
                    f"({len(margin)} node(s)) needs a trial of its own")
            current = self.trial(kept, "range margin")
        while not current.ok:
            if self.trials >= self.search.max_trials:
                return start, kept, current, False, (
                    f"not met within --max-trials {self.search.max_trials}: in the last trial, "
                    f"{_failure(current, self.search.accept)} with {len(kept)} node(s) kept")
            new = self.culprits(current, kept, names)
            why = "attribution"
            if not new:
                new = [Kept(n.name, n.op, "", math.nan, self.trials) for n in current.report.nodes
                       if n.precision in _LOWP | {"mixed"} and n.name in names
                       and n.name not in kept]
                why = "every node left in low precision"
                if not new:
                    return start, kept, current, False, (
                        f"the tolerance cannot be met: with every node the conversion may keep "
                        f"in float32 kept, {_failure(current, self.search.accept)}")
            kept.update((k.node, k) for k in new)
            if current is not start:
                current.close()
            current = self.trial(kept, why)
        # the margin's keeps stay: the tuning samples cannot show them unneeded
        current, note = self._release(current, [k for k in kept if k not in margin])
        kept = {k: v for k, v in kept.items() if k in current.keep}
        if self.search.relax and not note:
            current, note = self._relax(current)
        return start, kept, current, current.ok, "; ".join(filter(None, [note, self.skipped]))

    def _release(self, passing: _Trial, kept: list[str]) -> tuple[_Trial, str]:
        """Release ``kept`` (in the order the search kept them) in halves, last kept first
        (module docstring, step 3)."""
        return self._bisect(passing, kept[::-1], lambda t, group: (t.keep - set(group), t.force),
                            "release", "releasing kept nodes: some may not be needed")

    def _relax(self, passing: _Trial) -> tuple[_Trial, str]:
        """Force into low precision, in halves, the float32 nodes next to low-precision ones
        that the lists (not the tolerance, an interface or a kernel) kept float32 (step 4)."""
        lowp = {n.name for n in passing.report.nodes if n.precision in _LOWP}
        neighbours = _neighbours(self.model)    # only relax needs the graph's edges
        candidates = [n.name for n in passing.report.nodes
                      if n.precision == "float32" and n.code in RELAXABLE
                      and n.op not in FUNCTIONAL_OPS
                      and n.name not in passing.keep and neighbours.get(n.name, set()) & lowp]
        return self._bisect(passing, candidates, lambda t, group: (t.keep, t.force | set(group)),
                            "relax", "relaxing: more nodes may run in low precision")

    def _bisect(self, passing: _Trial, items: list[str], step, why: str, cut: str):
        """Try ``step`` with each group of ``items``, whole first, then halves of a group
        that fails; a group whose trial passes is taken. Returns the last passing trial and
        what the budget cut short."""
        groups = [items] if items else []
        while groups:
            group = groups.pop(0)
            keep, force = step(passing, group)
            t = self.seen.get((frozenset(keep), frozenset(force)))
            if t is None:
                if self.trials >= self.search.max_trials:
                    return passing, f"stopped {cut} at --max-trials {self.search.max_trials}"
                t = self.trial(keep, f"{why} {len(group)}", force)
            if t.ok:
                if t is not passing:
                    passing.close()
                passing = t
            else:
                t.close()
                if len(group) > 1:
                    groups[:0] = [group[: len(group) // 2], group[len(group) // 2:]]
        return passing, ""


def _lowp_sources(tensor: str, found: Attribution) -> list[str]:
    """``tensor`` if the conversion computes it in low precision, else the nearest
    low-precision tensors it is computed from (through float32 ones)."""
    def lowp(name: str) -> bool:
        return found.dtypes.get(name) in _LOWP
    out = {tensor} if lowp(tensor) else upstream(tensor, found.sources, lowp)
    return sorted(out, key=lambda n: (found.info[n].order, n))


def keep_rule(node: str, action: str = "keep_fp32") -> NodeRule:
    """An override (``keep_fp32`` or ``force_lowp``) matching exactly ``node``: a glob of the
    name itself, as TensorFlow's node names hold none of ``*?[]``."""
    return NodeRule(action, node, None, _SOURCE)


def _edges(model: Model) -> Iterable[tuple[str, str]]:
    """(producer, consumer) of each data edge, in the graph and in each function body
    (``function/node``, as the report and the replay name them; a body's argument is the
    node ``function/arg``)."""
    graph_def = model.graph_def
    for node in graph_def.node:
        for name in node.input:
            if not name.startswith("^"):
                yield name.split(":")[0], node.name
    for function in graph_def.library.function:
        prefix = function.signature.name + "/"
        for node in function.node_def:
            for name in node.input:
                if not name.startswith("^"):
                    yield prefix + name.split(":")[0], prefix + node.name


def _neighbours(model: Model) -> dict[str, set[str]]:
    """Node -> the nodes it exchanges data with (both directions). Linear in the edges."""
    adjacent: dict[str, set[str]] = {}
    for a, b in _edges(model):
        adjacent.setdefault(a, set()).add(b)
        adjacent.setdefault(b, set()).add(a)
    return adjacent


def _consumers(model: Model) -> dict[str, set[str]]:
    """Node -> the nodes that read its outputs."""
    readers: dict[str, set[str]] = {}
    for a, b in _edges(model):
        readers.setdefault(a, set()).add(b)
    return readers


def _open(model: Model, signature: str | None, outputs: Sequence[str],
          init_ops: Sequence[str] = ()) -> Runner:
    """The float32 model opened as ``verify`` opens the original (its variables drawn by their
    initializers, once: every trial gets their values; ``init_ops`` run in it and in every
    trial)."""
    if model.kind == "savedmodel" and outputs:
        raise InputError(f"{model.path}: output tensors (--output-tensor) apply to graph "
                         "files; a SavedModel's signature names its outputs")
    return open_model(model, signature=signature, outputs=outputs, init_ops=init_ops)


# ----------------------------------------------------------------- the entry point
def tune(model: str | os.PathLike | Model, output: str | os.PathLike | None = None, *,
         feeds: Iterable[Mapping[str, np.ndarray]] | str | os.PathLike = _NO_FEEDS,
         inputs: Iterable[Mapping[str, np.ndarray]] | str | os.PathLike | None = None,
         metric: str | Metric = "rel_l2", tolerance: float | None = None,
         max_trials: int = DEFAULT_MAX_TRIALS,
         holdout: Iterable[Mapping[str, np.ndarray]] | Sequence[str] = (),
         rules_out: str | os.PathLike | None = None, signature: str | None = None,
         outputs: Sequence[str] = (), force: bool = False, relax: bool = False,
         progress: Callable[[int, int, float, int], None] | None = None,
         report: str | os.PathLike | None = None, init_ops: Sequence[str] = (),
         headroom: float = HEADROOM, allow_holdout_failure: bool = False,
         error_margin: float = 1.0, nonfinite_reference: bool = False,
         pages: Mapping[str | os.PathLike, Callable[[TuneResult], bytes]] | None = None,
         **options) -> TuneResult:
    """Convert ``model`` keeping the fewest nodes in float32 for which every feed set of
    ``feeds`` meets ``metric <= tolerance`` (see the module docstring).

    ``model``: a path (GraphDef, MetaGraph, SavedModel directory, Keras file) or a loaded
    :class:`~amp_rewrite.io.load.Model` (``Model.of_graph_def(graph_def)``). ``feeds``: feed
    dicts keyed by input name (signature keys, or placeholder names), or ``.npz`` paths, one
    sample each; a graph fed by tf.data iterators takes the iterators' outputs by tensor name
    (``IteratorGetNext:0``) or, where a sample lacks them, the next batch of the float32
    model's own iterator (sample *i*, then the held-out ones, in order), and without feeds its
    first batch is the one sample. ``inputs``: the same, by the name of the command's
    ``--inputs`` (give one of the two). ``metric``: ``"rel_l2"``, ``"max_abs"``, ``"top1"`` (worst
    over the outputs), or ``metric(fp32_outputs, converted_outputs) -> float`` on dicts output
    name -> array, lower is better. ``tolerance`` defaults to what ``verify`` accepts
    (:func:`default_tolerance`). ``holdout``: samples never tuned on; the result must pass
    on them as on ``feeds`` (``result.holdout_failure`` says which output fails and by how
    much), else it is a failure, unless ``allow_holdout_failure``. ``headroom``: the range
    margin's safety factor (module docstring, step 1; at least 1, where only tensors past the
    range on ``feeds`` are kept up front). ``error_margin``: the precision margin (module
    docstring, step 1): a trial passes on ``feeds`` only at ``metric <= tolerance /
    error_margin`` (at least 1; 1 is no margin), while ``holdout`` and ``verify``'s other
    checks are judged against ``tolerance``. ``relax``: also move nodes the lists kept float32
    into low precision where the tolerance holds (module docstring, step 4). ``options``:
    those of :class:`~amp_rewrite.conversion.graph.Options`. ``init_ops``: ops to run once
    per session after the initializers found (``--init-op``;
    :meth:`~amp_rewrite.tools.analysis.Analysis.init_ops`).

    When it passes and ``output`` is given, writes the converted model there, the chosen
    overrides to ``rules_out`` (default: beside the output, ``<output>.tune.toml``) and, if
    given, the JSON report of the conversion to ``report`` and each of ``pages`` (path -> the
    file's bytes made from the result: the CLI's ``--html``), all or none; an existing file is
    replaced only with ``force``. When it does not pass, nothing is written and ``result.ok``
    is False, ``result.message`` says why.
    """
    started = time.perf_counter()
    if inputs is not None:
        if feeds is not _NO_FEEDS:
            raise InputError("tune: give the samples once, as inputs= (the command's --inputs) "
                             "or as feeds=, not both")
        feeds = inputs
    # a SavedModel's trials keep its variables (what convert freezes by default renames the
    # nodes the search keeps float32 by name)
    opts = Options(**{"freeze": False, **options})
    opts.check()
    search = search_settings(metric, tolerance, opts.target, max_trials=max_trials,
                             headroom=headroom, error_margin=error_margin, relax=relax,
                             nonfinite_reference=nonfinite_reference)
    with contextlib.ExitStack() as stack:
        model = _model(model, stack)
        out_paths = _check_outputs(model, output, rules_out, force, report)
        if model.kind != "savedmodel" and "the graph" in training_parts(model.graph_def):
            raise UnsupportedGraphError(f"{model.path}: the graph trains; tune compares "
                                        "inference outputs: freeze or export the inference "
                                        "graph first")
        result = _search(model, opts, search, feeds, holdout, signature=signature,
                         outputs=outputs, init_ops=init_ops, progress=progress,
                         allow_holdout_failure=allow_holdout_failure)
        result.seconds = time.perf_counter() - started
        if result.ok and (float32 := result.float32_model()):
            result.report.warnings.append(float32)   # as convert's report holds its own
        if result.ok and out_paths is not None:
            _write(result, model, opts, out_paths, report, force, pages or {})
    return result


def _model(model: str | os.PathLike | Model, stack: contextlib.ExitStack) -> Model:
    """``model`` loaded; a Keras file as its export, which lives as long as ``stack``."""
    if isinstance(model, Model):
        return model
    if is_keras_file(model):
        (saved,) = stack.enter_context(saved_models([model]))
        return dataclasses.replace(load(saved), source=Path(model))
    return load(model)


def _search(model: Model, opts: Options, search: Search, feeds, holdout, *, signature,
            outputs, init_ops, progress, allow_holdout_failure: bool) -> TuneResult:
    """The float32 model opened, the search run on ``feeds`` and judged on ``holdout``."""
    with tempfile.TemporaryDirectory(prefix="amp-tune.") as workdir, \
            _open(model, signature, outputs, init_ops) as ref:
        tuner = _Tuner(model, opts, ref, _feed_list(feeds, ref, "feeds"), search, Path(workdir),
                       signature=signature, outputs=outputs, progress=progress)
        held = _feed_list(holdout, ref, "holdout")
        try:
            tuner.check_baseline()
            start, kept, final, ok, note = tuner.run()
            result = TuneResult(
                ok, search.metric, search.tolerance, len(tuner.feeds), tuner.trials,
                0.0, start.score, final.score, list(kept.values()),
                final.forced, _lowp(start.report),
                _lowp(final.report), final.model, final.report, message=note,
                trial_log=tuner.log, target=opts.target, headroom=search.headroom,
                error_margin=search.error_margin, matrix_before=_matrix(start.report),
                matrix_after=_matrix(final.report))
            if held:
                _judge_holdout(tuner, result, start, final, held, allow_holdout_failure)
        finally:
            for t in tuner.seen.values():
                t.close()
    return result


def _judge_holdout(tuner: _Tuner, result: TuneResult, start: _Trial, final: _Trial,
                   held: list[dict], allow_failure: bool) -> None:
    """The painted graph and the result scored on the held-out samples, never tuned on; a
    result that fails there fails, unless ``allow_failure``."""
    wanted = [tuner._outputs(tuner.ref, f) for f in held]
    check_reference(tuner.ref.outputs, wanted, tuner.search.nonfinite_reference)
    result.holdout_before = _score_on(tuner, start, held, wanted, judge=False)[0]
    result.holdout_after, result.holdout_failure = _score_on(tuner, final, held, wanted)
    if result.ok and result.holdout_failure and not allow_failure:
        result.ok = False
        result.message = (f"held-out samples: {result.holdout_failure} "
                          "(--allow-holdout-failure writes it anyway)")


def _write(result: TuneResult, model: Model, opts: Options, paths, report, force: bool,
           pages: Mapping) -> None:
    """The tuned model, its rules file, (``report``) the JSON report and the ``pages``, all
    or none."""
    out, rules_path = paths
    with OutputSet() as written:    # checked before the search, each of them
        stage(result.model, out, written, force=force)
        written.add_file(rules_path, rules_text(result, model, opts).encode("utf-8"),
                         force=force)
        if report is not None:
            written.add_file(report, result.report.to_json().encode("utf-8"), force=force)
        for path, page in pages.items():
            written.add_file(path, page(result), force=force)
        written.commit()
    result.rules_file = str(rules_path)


def check_reference(names: Sequence[str], outputs: Sequence[Outputs],
                    nonfinite_reference: bool = False) -> None:
    """The float32 model's outputs on every sample (dicts by output name) hold elements, all
    finite (unless ``nonfinite_reference``), else the :class:`InputError` of
    :func:`~amp_rewrite.tools.verify.check_finite_reference`."""
    nonfinite = [0 if nonfinite_reference else
                 sum(int(np.count_nonzero(~np.isfinite(np.asarray(o[n], np.float64))))
                     for o in outputs) for n in names]
    totals = [sum(np.size(o[n]) for o in outputs) for n in names]
    check_finite_reference(names, nonfinite, totals)


def _matrix(report: Report) -> dict[str, int]:
    """The matrix ops (the MatMul/Conv family, function bodies included) of a conversion: how
    many, how many in 16 bits, and how many the CPU cost model kept float32 (code ``cost``)."""
    ops = [n for n in report.nodes if n.op in MATRIX_OPS]
    return {"total": len(ops), "lowp": sum(1 for n in ops if n.precision in _LOWP | {"mixed"}),
            "cost": sum(1 for n in ops if n.code == "cost")}


def _score_on(tuner: _Tuner, t: _Trial, feeds: list[dict], wanted: list[dict],
              judge: bool = True) -> tuple[float, str]:
    """``t``'s worst score on ``feeds``, whose float32 outputs are ``wanted``, and (``judge``)
    what it fails there as a trial would fail ("" if nothing): the output and by how much."""
    runner = t.runner or tuner._open_converted(t.model)
    try:
        got = [tuner._outputs(runner, f) for f in feeds]
        scores = [tuner._score(want, out) for want, out in zip(wanted, got)]
        worst = max(range(len(scores)), key=lambda i: scores[i])
        if not judge:
            return scores[worst], ""
        if scores[worst] > tuner.search.tolerance:
            return scores[worst], _over(tuner, wanted[worst], got[worst], worst, len(feeds))
        if tuner.search.verify_checks:
            for o in compare_outputs(tuner.ref, runner, feeds, tuner.verify_criteria(runner)):
                for c in o.checks:
                    if not c.ok:
                        need = "at least" if c.check == "top1" and not o.decisions else "limit"
                        return scores[worst], (f"output {o.name!r} {c.check} {c.value:.3g} "
                                               f"({need} {c.threshold:g})")
        return scores[worst], ""
    finally:
        if runner is not t.runner:
            runner.close()


def _over(tuner: _Tuner, want: Outputs, got: Outputs, index: int, count: int) -> str:
    """The output whose metric is worst on one sample (a built-in metric), else the metric
    function's value on the sample, with the tolerance."""
    search = tuner.search
    limit = f"(limit {search.tolerance:g})"
    if search.per_output is None:
        return (f"{search.metric} {tuner._score(want, got):.3g} on sample {index + 1} of "
                f"{count} {limit}")
    values = search.per_output(want, got)
    name = max(values, key=lambda k: (values[k], k))
    return f"output {name!r} {search.metric} {values[name]:.3g} {limit}"


def _failure(t: _Trial, tolerance: float) -> str:
    """Why trial ``t`` does not pass, in words for the result's message."""
    if t.score <= tolerance and t.verify_failed:
        return t.verify_failed if t.found is not None else (
            f"verify's default checks fail ({t.verify_failed})")
    return f"the metric is {t.score:.3g} > {tolerance:g}"


def _lowp(report: Report) -> int:
    return sum(1 for n in report.nodes if n.precision in _LOWP | {"mixed"})


def _feed_list(feeds, ref: Runner, what: str) -> list[dict]:
    """The samples as feed dicts by input name; the iterator outputs a sample lacks are the
    next batches of ``ref``'s iterators (:func:`~amp_rewrite.tools.runner.fill_iterator_inputs`);
    no samples at all, for a model that only iterators feed, is one sample: their first batch."""
    if isinstance(feeds, (str, os.PathLike)):
        feeds = [feeds]
    out = []
    for feed in feeds:
        if isinstance(feed, (str, os.PathLike)):
            out.append(load_inputs(feed, ref.inputs))
            continue
        named = {spec.name: feed[key] for key, spec in
                 match_inputs(feed, ref.inputs, f"{what}: a feed dict's key").items()}
        missing = [s.name for s in ref.inputs if s.name not in named and not s.iterator]
        if missing:
            raise InputError(f"{what}: a feed dict has no array for input(s) "
                             f"{', '.join(map(repr, missing))} (has: {', '.join(map(str, feed))})")
        out.append({s.name: np.asarray(named[s.name]) for s in ref.inputs if s.name in named})
    if what == "feeds" and not out:
        if not ref.inputs or any(not s.iterator for s in ref.inputs):
            raise InputError("tune needs at least one sample (--inputs DATA.npz)")
        out = [{}]
    return fill_iterator_inputs(ref, out)


def _check_outputs(model: Model, output, rules_out, force: bool, report=None):
    """The output and rules paths, checked before any work as saving would check them (and
    the report path): not the input nor inside it, not existing unless ``force``, in a folder
    that exists."""
    if output is None:
        return None
    out = Path(output)
    rules_path = Path(rules_out) if rules_out is not None else tune_rules_path(out)
    paths = [model.path, out, rules_path] + ([Path(report)] if report is not None else [])
    if any(same_file(a, b) for i, a in enumerate(paths) for b in paths[i + 1:]):
        raise InputError(f"{out}: the output, the rules file, the report and the input must be "
                         "different files")
    if report is not None:
        check_file_destination(Path(report), force=force)
    if model.path.exists():
        check_container(model.path, out)
    check_destination(model, out, force=force)
    check_file_destination(rules_path, force=force)
    if model.kind == "savedmodel" and Path(model.path).resolve() in rules_path.resolve().parents:
        raise InputError(f"{rules_path}: inside the input SavedModel {model.path}; write it "
                         "elsewhere (--rules-out)")
    return out, rules_path


def rules_text(result: TuneResult, model: Model, options: Options) -> str:
    """The rules file of the overrides chosen: reapplied with ``--rules`` (after the same
    rule files tune was given) it gives the same conversion."""
    flags = ["--target", options.target, "--device", options.device]
    if not hasattr(options.rules, "lists"):     # files, not a RuleSet object
        flags += [x for r in options.rules or () for x in ("--rules", str(r))]
    flags += [x for name in options.keep for x in ("--keep", name)]
    flags += ["--lowp-io"] if options.lowp_io else []
    flags += ["--fold-constants"] if options.fold_constants else []
    if options.min_matrix_intensity is not None:
        flags += ["--min-matrix-intensity", f"{options.min_matrix_intensity:g}"]
    flags += ["--cost-aware"] if options.cost_aware else []
    flags += ["--costs", str(options.costs)] if options.costs is not None else []
    source = model.source or model.path     # a Keras file's name, not its export's folder
    lines = [f"# Written by amp-rewrite tune for {source}: the overrides with which",
             f"# every one of {result.samples} sample(s) meets {result.metric} <= "
             f"{result.tolerance:g} ({options.target}, device {options.device}).",
             f"# Painted graph {result.before:.3g} -> tuned {result.after:.3g}; {result.trials} "
             f"trials, {result.seconds:.1f} s.",
             "# Reapply: amp-rewrite IN -o OUT " + " ".join(flags) + " --rules THIS_FILE",
             ""]
    for k in result.kept:
        why = (f"{k.tensor} added {k.added:.3g} to the error (trial {k.trial})"
               if k.tensor and k.largest is None
               else f"{k.why(result.target, result.headroom)} (trial {k.trial})")
        lines += [f"# {k.op}: {why}", "[[override]]", f'glob = "{k.node}"',
                  'action = "keep_fp32"', ""]
    for name in result.forced:
        lines += ["# the rule lists kept it float32; the tolerance holds in low precision",
                  "[[override]]", f'glob = "{name}"', 'action = "force_lowp"', ""]
    return "\n".join(lines)


__all__ = ["METRICS", "Kept", "TuneResult", "default_tolerance", "keep_rule", "rules_text", "tune"]
