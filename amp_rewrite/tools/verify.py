"""``amp-rewrite verify ORIG CONVERTED``: how far the converted graph's numbers moved, and where.

Both models run on the same inputs (an ``.npz`` file, or random data from the inputs' dtypes
and shapes, ``--samples`` sets of it). Each output is measured (largest absolute error,
relative L2 error, share of elements outside ``|conv - orig| <= atol + rtol*|orig|``, and for
an output with a class axis the top-1 agreement) and judged by the checks in force, each with
its threshold, and always by one more:

* ``finite``: an element the converted model gives as inf or NaN where the float32 model
  gives a number fails its output, whatever its sign and whatever the other checks say: the
  user receives that inf (a softmax over it gives NaN). The line says how many;
* ``rel_l2``: ``||conv - orig||_2 / ||orig||_2`` at most ``--rel-l2`` (default by the
  converted graph's lowest float dtype: float16 1e-2, bfloat16 5e-2, float32 1e-5); for the
  gradients among a training graph's outputs at most ``--grad-rel-l2`` (default 1e-1);
* ``top1``: on a float output of rank 2 or more whose last dimension is over 1 (a batch of
  scores; a score per pixel of a segmentation, per token of a language model), the share of
  positions (rows, pixels, tokens) whose argmax over the last axis agrees, at least ``--top1``
  (default 0.99). A position whose original scores for the two classes involved differ by no
  more than the ``rel_l2`` bound times the position's L2 norm is a near-tie, within the error
  ``rel_l2`` accepts: it counts as agreeing.
  An output that is a share of yes/no decisions (an accuracy, the mean of a cast
  ``Equal(ArgMax(...), labels)``) moves by whole decisions, not by rounding: it is judged by
  ``top1``'s allowance instead of ``rel_l2`` (unless ``--check rel_l2`` is chosen): it may
  move by at most ``1 - --top1`` (one point at 0.99). How many decisions flipped it cannot
  say (flips either way cancel in a share): compare the scores themselves for that;
* ``match``: an integer or boolean output (token ids, class ids) is compared by exact match,
  in place of ``rel_l2`` and ``top1``: the share of its elements equal to the original's, at
  least ``--top1``;
* ``allclose``: every element within ``atol + rtol*|orig|`` (``--rtol``/``--atol``; defaults
  float16 0.01/0.001, bfloat16 0.05/0.01, float32 1e-5/1e-6);
* ``max_abs``: the largest absolute error at most ``--max-abs`` (no default).

Without ``--check``, ``rel_l2`` and ``top1`` are in force, plus any check whose threshold is
given. The result names, for each output, which check failed. A verdict needs a finite
reference: where the float32 model itself gives inf or NaN in an output on the inputs given,
nothing is judged (an :class:`InputError` naming the output and how many elements), unless
``--allow-nonfinite-reference`` asks to compare anyway (an element non-finite on both sides,
the same value, then agrees).

``--per-node`` compares the tensors inside both models and ranks them by the error each
*adds* over the tensors it is computed from (its relative L2 error minus the largest of
theirs), so the first tensor that diverges, such as an op overflowing float16, comes first.
Inside the model, a 16-bit dtype's ±inf for a float32 value past its range (of the same sign)
is harmless only where the value is past the range by construction, a constant mask (a -1e9
attention mask, also times a 0/1 mask from the data: :mod:`amp_rewrite.tools.masks`, the rule
``tune`` uses too), and only while what its consumers compute from it agrees (a softmax turns
the masked scores into the same zeros); a tensor the data drives past the range is an
overflow even where nothing after it shows harm on these samples, and a mask whose infinities
a consumer turns into a non-finite value the original does not have counts as an error, in the
tensors that carry them down to it, so the tensor where they start comes first
(:func:`attribute`).
Graph files compare every float tensor a fetch reaches without running a variable write;
SavedModels the tensors of their signature's function bodies (see
:meth:`amp_rewrite.tools.runner.SavedModelRunner.trace`). A tensor it cannot compare (its shape
changed, TensorFlow will not fetch it, only one model has it ...) is counted, by reason
(:data:`UNCOMPARED`), never dropped silently. Exit code 1 when an output fails a check.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..core.dtypes import BFLOAT16, FLOAT, HALF, LARGEST, TARGET_NAMES, TARGETS, held
from ..core.errors import InputError
from .runner import (
    GraphRunner,
    Runner,
    check_same_interface,
    fill_iterator_inputs,
    input_feeds,
    open_pair,
)
from .masks import constant_masks
from .ranges import Ranges, TensorRange
from .traces import upstream

log = logging.getLogger(__name__)

#: every check, and those in force without --check
CHECKS = ("rel_l2", "top1", "allclose", "max_abs")
DEFAULT_CHECKS = ("rel_l2", "top1")

# Defaults by the lowest float dtype of the converted graph. rel_l2: healthy conversions
# measure below (tests/test_keras_apps.py holds the logits of the Keras applications it converts
# under half of these: 5e-3 float16, 2e-2 bfloat16), while a real fault (an overflow, a deny op
# in low precision) gives inf or errors of order 1.
REL_L2 = {BFLOAT16: 5e-2, HALF: 1e-2, FLOAT: 1e-5}
# Gradients (of a training graph's outputs) move more: a ReLU whose input sits near zero
# flips its mask in low precision, and the backward pass sums such flips. Healthy conversions
# of the tests' training graphs (MLP, CNN with batch norm; SGD, Adam; digits and random data)
# measure up to 2.6e-2 (float16) and 2.8e-2 (bfloat16); a broken one gives about 1 (gradients
# flushed to zero, a scale not undone) or inf.
GRAD_REL_L2 = {BFLOAT16: 1e-1, HALF: 1e-1, FLOAT: 1e-5}
#: the largest finite value of each 16-bit dtype: rounding a float32 value past it (on either
#: side) to that dtype gives ±inf, so such an infinity in a converted tensor is no error of its own
BEYOND = {name: LARGEST[dtype] for name, dtype in TARGETS.items()}
#: (rtol, atol) of the allclose check
ALLCLOSE = {BFLOAT16: (5e-2, 1e-2), HALF: (1e-2, 1e-3), FLOAT: (1e-5, 1e-6)}
TOP1 = 0.99
_FLAGS = {"rel_l2": "--rel-l2/--grad-rel-l2", "top1": "--top1", "max_abs": "--max-abs",
          "allclose": "--rtol/--atol"}


@dataclass(frozen=True)
class Criteria:
    """The checks in force and every threshold (``dtype``: what the defaults were chosen for;
    ``chosen``: the checks came from ``--check``)."""

    checks: tuple[str, ...]
    dtype: str
    rel_l2: float
    top1: float
    grad_rel_l2: float
    rtol: float
    atol: float
    max_abs: float | None = None
    chosen: bool = False
    #: compare outputs the float32 model itself gives as inf or NaN (--allow-nonfinite-reference)
    nonfinite_reference: bool = False

    @property
    def limit(self) -> float:
        """The largest finite value of ``dtype`` (inf for float32): past it an original value
        agrees with the ±inf of the same sign (:data:`BEYOND`)."""
        return BEYOND.get(self.dtype, math.inf)

    def thresholds(self) -> list[dict]:
        """One entry per check in force: its name and threshold(s)."""
        out = []
        for check in self.checks:
            if check == "allclose":
                out.append({"check": check, "rtol": self.rtol, "atol": self.atol})
            elif check == "rel_l2":
                out.append({"check": check, "threshold": self.rel_l2,
                            "gradients": self.grad_rel_l2})
            else:
                out.append({"check": check, "threshold": getattr(self, check)})
        return out

    def describe(self) -> str:
        parts = {"rel_l2": f"rel_l2 <= {self.rel_l2:g} (gradients {self.grad_rel_l2:g})",
                 "top1": f"top1 >= {100 * self.top1:g}% (outputs with a class axis; near-ties agree)",
                 "allclose": f"allclose |conv - orig| <= {self.atol:g} + {self.rtol:g}*|orig|",
                 "max_abs": f"max_abs <= {self.max_abs:g}" if self.max_abs is not None else ""}
        return ", ".join([parts[c] for c in self.checks] + ["finite where float32 is"])


def criteria(dtype: int = FLOAT, checks: Sequence[str] = (), *, rel_l2: float | None = None,
             grad_rel_l2: float | None = None, top1: float | None = None,
             rtol: float | None = None, atol: float | None = None,
             max_abs: float | None = None, nonfinite_reference: bool = False) -> Criteria:
    """The checks and thresholds in force for a converted model whose lowest float dtype is
    ``dtype``: ``checks`` (``--check``) or the defaults plus each check a threshold is given
    for. A threshold out of range, or given for a check not chosen, is an InputError.
    ``nonfinite_reference``: outputs the float32 model gives as inf or NaN are compared
    anyway (else they are refused: :func:`compare_outputs`)."""
    for check in checks:
        if check not in CHECKS:
            raise InputError(f"--check {check}: unknown check (choose from {', '.join(CHECKS)})")
    for flag, value, high in (("--rel-l2", rel_l2, None), ("--grad-rel-l2", grad_rel_l2, None),
                              ("--top1", top1, 1.0),
                              ("--rtol", rtol, None), ("--atol", atol, None),
                              ("--max-abs", max_abs, None)):
        if value is not None and not (value >= 0 and (high is None or value <= high)
                                      and math.isfinite(value)):
            bound = "between 0 and 1" if high else "a finite number >= 0"
            raise InputError(f"{flag} {value:g}: must be {bound}")
    given = {"rel_l2": rel_l2 is not None or grad_rel_l2 is not None, "top1": top1 is not None,
             "allclose": rtol is not None or atol is not None, "max_abs": max_abs is not None}
    if checks:
        chosen = tuple(dict.fromkeys(checks))
        for check, is_given in given.items():
            # rel_l2's bound also sets the top-1 near-tie margin, so it may come alone
            if is_given and check not in chosen and not (check == "rel_l2" and "top1" in chosen):
                raise InputError(f"{_FLAGS[check]} is the threshold of --check {check}, which is "
                                 f"not among the checks chosen ({', '.join(chosen)}); add "
                                 f"--check {check} or drop {_FLAGS[check]}")
    else:
        chosen = DEFAULT_CHECKS + tuple(c for c in ("allclose", "max_abs") if given[c])
    if "max_abs" in chosen and max_abs is None:
        raise InputError("--check max_abs needs --max-abs X: an absolute error has no default "
                         "(it depends on the outputs' scale)")
    d_rtol, d_atol = ALLCLOSE.get(dtype, ALLCLOSE[FLOAT])
    return Criteria(chosen, TARGET_NAMES.get(dtype, "float32"),
                    REL_L2.get(dtype, REL_L2[FLOAT]) if rel_l2 is None else rel_l2,
                    TOP1 if top1 is None else top1,
                    GRAD_REL_L2.get(dtype, GRAD_REL_L2[FLOAT]) if grad_rel_l2 is None else grad_rel_l2,
                    d_rtol if rtol is None else rtol, d_atol if atol is None else atol,
                    max_abs, bool(checks), nonfinite_reference)


class ErrorStats:
    """Errors of one tensor accumulated over samples (relative L2 over all of them together).

    A float tensor with a class axis (rank 2 or more, its last dimension over 1: a batch of
    scores, or a score per pixel or token) is also judged by top-1 agreement at every position
    along the other axes; a position is a near-tie when the original's scores of the two
    classes differ by at most ``tie`` times the position's L2 norm. An integer or boolean
    tensor (token ids, class ids, masks) is compared element by element for exact equality
    (``matched``).

    ``lost`` counts the elements the converted model holds as inf or NaN where the original is
    finite; ``ref_nonfinite`` those the original itself holds as inf or NaN.

    Inside a model (``verify --per-node``), a converted ±inf where the original holds a finite
    value beyond ``limit`` (the largest finite value of the converted dtype,
    :attr:`Criteria.limit`) of the same sign is that dtype's rounding of it: counted in
    ``beyond``, and it agrees, as two equal infinities do; whether that is harmless is the
    rule of :mod:`amp_rewrite.tools.masks`. The default limit (inf), which outputs are compared
    with, accepts no such value."""

    def __init__(self, rtol: float, atol: float, tie: float = 0.0, limit: float = math.inf):
        self.rtol, self.atol, self.tie, self.limit = rtol, atol, tie, limit
        self.diff_sq = self.ref_sq = self.max_abs = 0.0
        self.out_of_tol = self.total = self.nonfinite = self.beyond = 0
        self.lost = self.ref_nonfinite = 0
        self.rows = self.agree = self.ties = 0
        self.classifier = True
        self.positions = False   # the class axis is that of a rank-3+ tensor: per position
        self.integer = False     # integers or booleans: compared by exact match
        self.matched = 0
        self.decisions = False   # a share of yes/no decisions (see the module docstring)

    def update(self, ref: np.ndarray, out: np.ndarray, top1: bool = True) -> None:
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.shape != out.shape:
            raise ValueError(f"shape {list(out.shape)} where the original has {list(ref.shape)}")
        self.integer = ref.dtype.kind in "iub" and out.dtype.kind in "iub"
        if self.integer:
            self.matched += int(np.count_nonzero(ref == out))
        ref = ref.astype(np.float64)
        out = out.astype(np.float64)
        with np.errstate(all="ignore"):   # inf - inf, inf * 0: counted, never warned
            self._update(ref, out, top1)

    def _update(self, ref: np.ndarray, out: np.ndarray, top1: bool) -> None:
        self.lost += int(np.count_nonzero(~np.isfinite(out) & np.isfinite(ref)))
        self.ref_nonfinite += int(np.count_nonzero(~np.isfinite(ref)))
        # float16 holds a float32 value past its range as the infinity of its sign: compare it
        # as the original rounded to float16 (an inf on both sides); the other sign, a NaN or
        # an inf from a value within the range stay errors
        beyond = (np.isinf(out) & np.isfinite(ref) & (np.abs(ref) > self.limit)
                  & (np.sign(ref) == np.sign(out)))
        if beyond.any():
            self.beyond += int(np.count_nonzero(beyond))
            self.lost -= int(np.count_nonzero(beyond))
            ref = np.where(beyond, out, ref)
        finite = np.isfinite(ref) & np.isfinite(out)
        # a non-finite value on either side counts unless both sides hold the same one
        same_special = (ref == out) | (np.isnan(ref) & np.isnan(out))
        self.nonfinite += int(np.count_nonzero(~finite & ~same_special))
        diff = np.abs(np.where(finite, out, 0.0) - np.where(finite, ref, 0.0))
        self.diff_sq += float(np.sum(diff * diff))
        self.ref_sq += float(np.sum(np.where(finite, ref * ref, 0.0)))
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
        close = np.isclose(out, ref, rtol=self.rtol, atol=self.atol, equal_nan=True)
        self.out_of_tol += int(np.count_nonzero(~close))
        self.total += ref.size
        self.classifier = (self.classifier and top1 and not self.integer and ref.ndim >= 2
                           and ref.shape[-1] > 1)
        if self.classifier:
            self.positions = self.positions or ref.ndim > 2
            classes = ref.shape[-1]
            self._top1(ref.reshape(-1, classes), out.reshape(-1, classes),
                       (np.isfinite(out) | same_special).reshape(-1, classes))

    def _top1(self, ref: np.ndarray, out: np.ndarray, agreed: np.ndarray) -> None:
        rows = np.arange(ref.shape[0])
        want = np.argmax(np.where(np.isnan(ref), -np.inf, ref), axis=1)
        got = np.argmax(np.where(np.isnan(out), -np.inf, out), axis=1)
        # a row with a non-finite value the original does not share never agrees
        usable = agreed.all(axis=1)
        agree = usable & (want == got)
        norm = np.sqrt(np.sum(np.where(np.isfinite(ref), ref * ref, 0.0), axis=1))
        gap = ref[rows, want] - ref[rows, got]
        tie = usable & ~agree & (gap <= self.tie * norm)
        self.rows += ref.shape[0]
        self.agree += int(np.count_nonzero(agree))
        self.ties += int(np.count_nonzero(tie))

    @property
    def rel_l2(self) -> float:
        if self.nonfinite:
            return math.inf
        if self.diff_sq == 0.0:
            return 0.0
        return math.sqrt(self.diff_sq) / max(math.sqrt(self.ref_sq), 1e-30)

    @property
    def max_abs_error(self) -> float:
        return math.inf if self.nonfinite else self.max_abs

    @property
    def share(self) -> float:
        return self.out_of_tol / self.total if self.total else 0.0

    @property
    def top1(self) -> float | None:
        """Positions whose argmax agrees or that are near-ties, as a share; None: no class
        axis."""
        if not (self.classifier and self.rows):
            return None
        return (self.agree + self.ties) / self.rows

    @property
    def match(self) -> float | None:
        """The share of elements exactly equal, for integer and boolean tensors; else None."""
        if not self.integer:
            return None
        return self.matched / self.total if self.total else 1.0


@dataclass
class CheckResult:
    """One check of one output: what was measured, the threshold, the verdict."""

    check: str
    value: float
    threshold: float
    ok: bool


@dataclass
class OutputError:
    name: str
    max_abs: float
    rel_l2: float
    out_of_tolerance: float     # share of elements outside atol + rtol*|orig|, 0..1
    elements: int
    nonfinite: int
    ok: bool
    top1: float | None = None   # share of rows agreeing (near-ties included); None: not scores
    rows: int = 0
    top1_disagree: int = 0      # rows whose argmax moved, near-ties not counted
    top1_ties: int = 0
    kind: str = "output"        # "output", or "gradient" (compared unscaled where scaled)
    converted: str = ""         # the converted model's tensor compared, where its name differs
    checks: list[CheckResult] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    decisions: bool = False     # a share of yes/no decisions (an accuracy): top1 bounds its move
    lost: int = 0               # elements inf or NaN where the original is finite: it fails
    positions: bool = False     # top1 is per position of a rank-3+ output (pixels, tokens)
    match: float | None = None  # integer/boolean output: share of elements exactly equal
    reference_nonfinite: int = 0  # elements the original itself holds as inf or NaN


@dataclass
class NodeError:
    tensor: str
    op: str
    dtype: str                  # the converted graph's dtype of this tensor
    rel_l2: float
    added: float                # rel_l2 minus the largest rel_l2 among its compared inputs
    beyond_range: int = 0       # elements past the dtype's range held as ±inf (ErrorStats)
    harmless: bool = True       # ... which agree: a constant mask no consumer turns into an error
    data_driven: bool = False   # ... past the range by the data's doing, not a constant mask's
    differs: bool = False       # ... carried down to a tensor non-finite where float32 is not

    def beyond_words(self, dtype: str) -> str:
        """What its elements past ``dtype``'s range mean, for the ranking's line ("" if none)."""
        if not self.beyond_range:
            return ""
        if self.harmless:
            why = "a constant mask: no consumer's result changes"
        elif self.data_driven:
            why = ("the data drives it there, an overflow whatever the consumers show on this "
                   "batch (the next batch's sign may differ)")
            why += "; a consumer's result differs" if self.differs else ""
        else:
            why = "a constant mask, but a consumer's result differs"
        return f"{self.beyond_range} past {dtype}'s range as ±inf: {why}"


#: why ``--per-node`` could not compare a tensor (:class:`Uncompared`), by reason code
UNCOMPARED = {
    "shape_changed": "shape differs between the two models",
    "runs_changed": "ran a different number of times in the two models",
    "fetch_failed": "TensorFlow could not fetch it",
    "control_flow": "inside a v1 while loop or cond branch, which a fetch cannot reach",
    "after_write": "computed after a variable write, which fetching it would run",
    "not_float": "a float in one model, of another dtype in the other",
    "only_original": "only in the original (the conversion removed or renamed it)",
    "only_converted": "only in the converted model (casts and nodes the conversion added)",
    "skipped_step": ("computed from the scaled gradients of a converted train step that "
                     "skipped its update, as it does when they are not all finite (at too high "
                     "a loss scale, which dynamic loss scaling lowers)"),
    "loss_scaled": "holds the loss-scaled value, at a scale not known for every run",
}
#: tensor names an :class:`Uncompared` group keeps as examples
_EXAMPLES = 5
#: the original's largest tensors ``--per-node`` names (``amp-rewrite ranges`` lists them all)
_RANGES_SHOWN = 3


@dataclass
class Uncompared:
    """The tensors ``--per-node`` could not compare for one reason (a key of
    :data:`UNCOMPARED`): how many, and the first few of them."""

    reason: str
    count: int
    tensors: list[str]

    @property
    def why(self) -> str:
        return UNCOMPARED[self.reason]


@dataclass
class VerifyResult:
    """What ``verify`` found; ``to_dict`` is what the HTML report shows. With ``--per-node``
    (``per_node``), ``nodes`` ranks the tensors compared and ``uncompared`` counts, by reason,
    those of either model that could not be compared."""

    samples: int
    criteria: Criteria
    outputs: list[OutputError]
    nodes: list[NodeError] = field(default_factory=list)
    nodes_compared: int = 0
    uncompared: list[Uncompared] = field(default_factory=list)
    per_node: bool = False
    #: with ``per_node``, the original's tensors closest to float16's largest value, first
    ranges: list[TensorRange] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def rtol(self) -> float:
        return self.criteria.rtol

    @property
    def atol(self) -> float:
        return self.criteria.atol

    def failures(self) -> dict[str, list[str]]:
        """Output -> the checks it failed (outputs that pass are left out)."""
        return {o.name: list(o.failed) for o in self.outputs if o.failed}

    def to_dict(self) -> dict:
        c = self.criteria
        return {"samples": self.samples, "dtype": c.dtype, "checks": c.thresholds(),
                "checks_chosen": c.chosen, "rel_l2": c.rel_l2, "grad_rel_l2": c.grad_rel_l2,
                "top1": c.top1,
                "rtol": c.rtol, "atol": c.atol, "max_abs": c.max_abs,
                "ok": self.ok, "failed": self.failures(),
                "outputs": [asdict(o) for o in self.outputs],
                "nodes": [asdict(n) for n in self.nodes], "nodes_compared": self.nodes_compared,
                "per_node": self.per_node,
                "uncompared": [dict(asdict(u), why=u.why) for u in self.uncompared],
                "ranges": [t.to_dict(target=TARGETS.get(c.dtype, HALF)) for t in self.ranges]}


def lowest_dtype(runner: Runner) -> int:
    """The lowest-precision float dtype the model computes in (bfloat16, float16, float32)."""
    found = _dtypes_in(runner)
    return next((d for d in (BFLOAT16, HALF) if d in found), FLOAT)


def _dtypes_in(runner: Runner) -> set[int]:
    if isinstance(runner, GraphRunner):
        graph_def = runner.graph.as_graph_def()
    else:
        graph_def = runner.fn.graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return set().union(*map(held, nodes))


def feed_sets(runner: Runner, inputs: str | None, samples: int, shapes: Mapping,
              seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The feeds to run: the ``.npz`` file's arrays once, or ``samples`` random sets, every
    name checked (:func:`~amp_rewrite.tools.runner.input_feeds`); the outputs of tf.data
    iterators they lack are batches of ``runner``'s own iterators, one per set
    (:func:`~amp_rewrite.tools.runner.fill_iterator_inputs`), never random data."""
    return fill_iterator_inputs(runner, input_feeds(runner.inputs, inputs, samples, shapes, seed))


def compare_outputs(original: Runner, converted: Runner, feeds: Sequence[Mapping],
                    crit: Criteria) -> list[OutputError]:
    """Run both models on every feed set, compare their outputs position by position and
    judge each by the checks in force."""
    check_same_interface(original, converted)
    run_a, run_b = original.callable(), converted.callable()
    # an output is what the user receives: an inf past the range is no rounding to accept there
    stats = [ErrorStats(crit.rtol, crit.atol, crit.rel_l2) for _ in original.outputs]
    gradients = [name in original.gradients for name in original.outputs]
    shares = original.decision_shares()
    for name, s in zip(original.outputs, stats):
        s.decisions = name in shares
    for feed in feeds:
        for name, s, grad, a, b in zip(original.outputs, stats, gradients, run_a(feed), run_b(feed)):
            try:
                s.update(a, b, top1=not grad)   # a weight gradient is no batch of scores
            except ValueError as exc:
                raise InputError(f"output {name}: the converted model gives {exc} (--output "
                                 "picks the outputs to compare)") from None
    check_finite_reference(original.outputs,
                           [0 if crit.nonfinite_reference else s.ref_nonfinite for s in stats],
                           [s.total for s in stats])
    out = [_judge(name, other, s, grad, crit) for name, other, s, grad
           in zip(original.outputs, converted.outputs, stats, gradients)]
    if crit.chosen and "top1" in crit.checks and all(
            o.top1 is None and o.match is None and not o.decisions for o in out):
        raise InputError("--check top1: no output has a class axis (a float output of rank 2 "
                         "or more whose last dimension is over 1) or holds integers; pick one "
                         "with --output or choose another --check")
    return out


#: the flag that compares anyway where the float32 model's outputs are not finite
NONFINITE_FLAG = "--allow-nonfinite-reference"


def check_finite_reference(names: Sequence[str], nonfinite: Sequence[int],
                           totals: Sequence[int]) -> None:
    """A verdict needs a finite reference: where the float32 model itself gives inf or NaN in
    an output (``nonfinite`` of ``totals`` elements, by output), an :class:`InputError` names
    the first such output and how many, and the flag that compares anyway. Outputs that hold
    no element at all (an empty batch) leave nothing to judge: refused too."""
    if names and not any(totals):
        raise InputError(f"the outputs ({', '.join(names)}) hold no elements on these inputs "
                         "(an empty batch?): there is nothing to judge the conversion by")
    for name, bad, total in zip(names, nonfinite, totals):
        if bad:
            raise InputError(
                f"the float32 model itself gives {bad} of {total} element(s) of output {name} "
                "as inf or NaN on these inputs, so there is no finite reference to judge the "
                f"conversion by; check the inputs, or compare anyway with {NONFINITE_FLAG}")


def _judge(name: str, other: str, s: ErrorStats, gradient: bool, crit: Criteria) -> OutputError:
    # whatever the checks, an element the user receives as inf or NaN where float32 gives a
    # number fails its output
    checks = [CheckResult("finite", s.lost, 0, False)] if s.lost else []
    decided = s.match is not None and bool({"rel_l2", "top1"} & set(crit.checks))
    if decided:   # ids moved: a share of exact matches, with top1's allowance
        checks.append(CheckResult("match", s.match, crit.top1, s.match >= crit.top1))
    for check in crit.checks:
        if decided and check in ("rel_l2", "top1"):
            continue
        if check == "rel_l2":
            if s.decisions and "top1" in crit.checks and not crit.chosen:
                continue    # a decision moving is no rounding error: top1 judges it
            bound = crit.grad_rel_l2 if gradient else crit.rel_l2
            checks.append(CheckResult(check, s.rel_l2, bound, s.rel_l2 <= bound))
        elif check == "max_abs":
            checks.append(CheckResult(check, s.max_abs_error, crit.max_abs,
                                      s.max_abs_error <= crit.max_abs))
        elif check == "allclose":
            checks.append(CheckResult(check, s.share, 0.0, s.out_of_tol == 0 and s.nonfinite == 0))
        elif check == "top1" and s.decisions:
            # the share may move as far as top1 lets decisions move
            checks.append(CheckResult(check, s.max_abs_error, 1.0 - crit.top1,
                                      s.max_abs_error <= 1.0 - crit.top1))
        elif check == "top1" and s.top1 is not None:
            checks.append(CheckResult(check, s.top1, crit.top1, s.top1 >= crit.top1))
    failed = [c.check for c in checks if not c.ok]
    return OutputError(name, s.max_abs_error, s.rel_l2, s.share, s.total, s.nonfinite,
                       not failed, s.top1, s.rows if s.top1 is not None else 0,
                       s.rows - s.agree - s.ties if s.top1 is not None else 0,
                       s.ties if s.top1 is not None else 0,
                       "gradient" if gradient else "output", other if other != name else "",
                       checks, failed, s.decisions, s.lost, s.positions, s.match,
                       s.ref_nonfinite)


@dataclass
class Attribution:
    """What :func:`attribute` found: the ranking, per tensor compared (by the original's
    name) what it is (:class:`~amp_rewrite.tools.traces.TensorInfo`, from the original) and its
    dtype in the converted model, and the tensors that could not be compared, each with its
    reason (a key of :data:`UNCOMPARED`), in the order found."""

    ranked: list[NodeError]
    info: dict
    dtypes: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)
    ranges: Ranges = field(default_factory=Ranges)   # the original's tensors' magnitudes

    def sources(self, tensor: str) -> set[str]:
        """The compared tensors ``tensor`` is computed from (through variant tensors)."""
        return _float_sources(tensor, self.info, self.dtypes)

    def uncompared(self) -> list[Uncompared]:
        """The tensors not compared, grouped by reason, largest group first."""
        groups: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            groups.setdefault(reason, []).append(name)
        order = list(UNCOMPARED)
        return [Uncompared(reason, len(names), names[:_EXAMPLES]) for reason, names in
                sorted(groups.items(), key=lambda g: (-len(g[1]), order.index(g[0])))]


def per_node(original: Runner, converted: Runner, feeds: Sequence[Mapping],
             crit: Criteria) -> tuple[list[NodeError], int]:
    """Every float tensor present in both models, ranked by the error it adds over the
    tensors it is computed from.

    Returns the ranking (largest added error first, earlier tensors first among equals) and
    how many tensors were compared. What could not be compared (a tensor whose shape or
    number of executions the conversion changed, one only one model has ...) is in
    :func:`attribute`'s result.
    """
    found = attribute(original, converted, feeds, crit)
    return found.ranked, len(found.ranked)


def attribute(original: Runner, converted: Runner, feeds: Sequence[Mapping],
              crit: Criteria) -> Attribution:
    """:func:`per_node`'s ranking with what it was computed from and what it could not
    compare (see :class:`Attribution`)."""
    if isinstance(original, GraphRunner) != isinstance(converted, GraphRunner):
        raise InputError("--per-node needs two models of the same kind (two graph files or two "
                         "SavedModel directories)")
    skipped: dict[str, str] = {}
    names = _graph_names(original, converted, skipped) if isinstance(original, GraphRunner) else None
    stats: dict[str, ErrorStats] = {}
    runs: dict[str, list[tuple[int, int]]] = {}   # executions in (original, converted), by feed
    info, dtypes = {}, {}
    ranges = Ranges()
    for feed in feeds:
        ta, tb = original.trace(feed, names), converted.trace(feed, names)
        ranges.add(ta)
        for name in names or ():
            if name not in ta.values or name not in tb.values:
                skipped.setdefault(name, "fetch_failed")
        for name in list(ta.values) + [n for n in tb.values if n not in ta.values]:
            va, vb = ta.values.get(name, []), tb.values.get(name, [])
            runs.setdefault(name, []).append((len(va), len(vb)))
            if name in skipped or len(va) != len(vb):
                continue
            if any(np.shape(a) != np.shape(b) for a, b in zip(va, vb)):
                skipped[name] = "shape_changed"
                continue
            s = stats.setdefault(name, ErrorStats(crit.rtol, crit.atol, crit.rel_l2, crit.limit))
            for a, b in zip(va, vb):
                s.update(a, b, top1=False)
        info.update(ta.info)
        dtypes.update({name: i.dtype for name, i in tb.info.items()})
    for name, counts in runs.items():
        if name not in skipped and any(a != b for a, b in counts):
            skipped[name] = ("only_original" if not any(b for _, b in counts) else
                             "only_converted" if not any(a for a, _ in counts) else "runs_changed")
    for model in (original, converted):     # known once traced (a TF1 SavedModel's graph)
        for name, reason in model.uncomparable().items():
            skipped.setdefault(name, reason)
    for name in skipped:
        stats.pop(name, None)
    data, differs = _harmful_infinities(info, stats, ranges, crit.limit)
    harmful = data | differs
    errors = {name: math.inf if name in harmful else s.rel_l2 for name, s in stats.items()}
    ranked = []
    for name, s in stats.items():
        inherited = [errors[i] for i in _float_sources(name, info, stats)]
        ranked.append(NodeError(name, info[name].op, dtypes.get(name, info[name].dtype),
                                errors[name], _added(errors[name], max(inherited, default=0.0)),
                                s.beyond, name not in harmful, name in data, name in differs))
    ranked.sort(key=lambda n: (-n.added, info[n.tensor].order))
    compared = {n.tensor: n.dtype for n in ranked}
    return Attribution(ranked, info, compared, skipped, ranges)


def _graph_names(original: GraphRunner, converted: GraphRunner, skipped: dict[str, str]) -> list[str]:
    """The float tensors both graphs can record (in the original's order); those only one
    of them has go into ``skipped`` (a tensor neither can fetch is counted once)."""
    mine, theirs = original.comparable(), converted.comparable()
    hidden = {**converted.uncomparable(), **original.uncomparable()}
    shared = set(mine) & set(theirs)
    for name in mine:
        if name not in shared:
            skipped[name] = hidden.get(name) or (
                "not_float" if _has_tensor(converted, name) else "only_original")
    for name in theirs:
        if name not in shared:
            skipped[name] = hidden.get(name) or (
                "not_float" if _has_tensor(original, name) else "only_converted")
    return [name for name in mine if name in shared]


def _has_tensor(runner: GraphRunner, name: str) -> bool:
    try:
        runner.tensor(name)
    except InputError:
        return False
    return True


def _harmful_infinities(info: Mapping, stats: Mapping[str, ErrorStats], ranges: Ranges,
                        limit: float) -> tuple[set[str], set[str]]:
    """The tensors whose ±inf past the dtype's range (``ErrorStats.beyond``) count as errors,
    in two sets, which may meet. First, every one the data drives past the range: not a
    constant mask (:func:`~amp_rewrite.tools.masks.constant_masks` on the original's trace
    and ``ranges``), even where nothing after it shows harm on these samples, since the sign
    of the next batch's overflow, and so the harm, is the data's. Second, every one whose
    infinities reach a tensor holding a non-finite value the original does not, through an
    unbroken path of such tensors: its infinities are that tensor's cause (``mask * 0`` is
    NaN in float16). Only a constant mask no consumer turns into an error (a -1e9 mask a
    softmax turns into zeros) agrees."""
    carrying = {name for name, s in stats.items() if s.beyond}
    if not carrying:
        return set(), set()
    data = carrying - constant_masks(info, ranges.tensors, limit, carrying)
    differs: set[str] = set()
    todo = [name for name, s in stats.items() if s.nonfinite]
    while todo:
        for source in _float_sources(todo.pop(), info, stats):
            if source in carrying and source not in differs:
                differs.add(source)
                todo.append(source)
    return data, differs


def _float_sources(name: str, info: Mapping, stats: Mapping) -> set[str]:
    """The compared tensors ``name`` is computed from, looking through variant tensors (a
    TensorList carries the floats pushed into it to the ones read out of it)."""
    return upstream(name, lambda t: info[t].sources, lambda t: t in stats,
                    lambda t: t in info and info[t].dtype == "variant")


def _added(err: float, inherited: float) -> float:
    if math.isinf(err):
        return 0.0 if math.isinf(inherited) else math.inf
    return max(err - inherited, 0.0)


def verify(original_path, converted_path, *, inputs: str | None = None, samples: int = 1,
           shapes: Mapping | None = None, checks: Sequence[str] = (),
           rel_l2: float | None = None, grad_rel_l2: float | None = None,
           top1: float | None = None, rtol: float | None = None,
           atol: float | None = None, max_abs: float | None = None, nodes: bool = False,
           signature: str | None = None, outputs: Sequence[str] = (),
           checkpoint: str | None = None, emulate: bool = False,
           init_ops: Sequence[str] = (), nonfinite_reference: bool = False) -> VerifyResult:
    """Compare two models on the same inputs (see the module docstring); ``emulate`` runs a
    float16 conversion as its float32 emulation (:mod:`amp_rewrite.transforms.emulate`);
    ``init_ops`` (``--init-op``) run in both before the first run, after the initializers
    found (:meth:`~amp_rewrite.tools.analysis.Analysis.init_ops`); ``nonfinite_reference``
    compares outputs the float32 model itself gives as inf or NaN (refused otherwise)."""
    if samples < 1:
        raise InputError("--samples must be at least 1")
    thresholds = dict(rel_l2=rel_l2, grad_rel_l2=grad_rel_l2, top1=top1, rtol=rtol, atol=atol,
                      max_abs=max_abs, nonfinite_reference=nonfinite_reference)
    criteria(FLOAT, checks, **thresholds)  # flag mistakes answer before the models load
    with open_pair(original_path, converted_path, signature=signature, outputs=outputs,
                   checkpoint=checkpoint, emulate=emulate, init_ops=init_ops) as (a, b):
        crit = criteria(lowest_dtype(b), checks, **thresholds)
        feeds = feed_sets(a, inputs, samples, shapes or {})
        result = VerifyResult(len(feeds), crit, compare_outputs(a, b, feeds, crit))
        if nodes:
            found = attribute(a, b, feeds, crit)
            result.nodes, result.nodes_compared = found.ranked, len(found.ranked)
            result.uncompared, result.per_node = found.uncompared(), True
            result.ranges = found.ranges.ranked()[:_RANGES_SHOWN]
    return result


def format_result(result: VerifyResult, top: int = 10) -> str:
    c = result.criteria
    lines = [f"{result.samples} sample(s); checks ({c.dtype} defaults unless given): {c.describe()}"]
    labels = [o.name + ("" if not o.converted else " (unscaled)" if o.converted.endswith(
        "/amp_unscaled:0") else f" (vs {o.converted})") for o in result.outputs]
    width = max(map(len, labels))
    for o, label in zip(result.outputs, labels):
        parts = [f"max abs {o.max_abs:.3g}", f"rel L2 {o.rel_l2:.3g}"]
        if o.lost:
            parts.append(f"{o.lost} of {o.elements} element(s) inf or NaN where float32 is "
                         "finite")
        if o.match is not None:
            parts = [f"exact match {100 * o.match:.2f}% of {o.elements} elements"] + parts[2:]
        elif o.decisions:
            parts.append(f"a share of decisions: moved {100 * o.max_abs:.2f} points (top1 allows "
                         f"{100 * (1 - c.top1):g})")
        elif o.top1 is not None:
            unit = "positions" if o.positions else "rows"
            parts.append(f"top1 {100 * o.top1:.2f}% of {o.rows} {unit} ({o.top1_disagree} "
                         f"moved, {o.top1_ties} near-ties)")
        if "allclose" in c.checks:
            parts.append(f"outside atol+rtol*|orig| {100 * o.out_of_tolerance:.2f}% of {o.elements}")
        if o.reference_nonfinite:
            parts.append(f"{o.reference_nonfinite} inf/NaN in float32 itself (compared "
                         "anyway)")
        verdict = "ok" if o.ok else "FAIL: " + ", ".join(o.failed)
        lines.append(f"{label:<{width}}  " + "  ".join(parts) + f"  {verdict}")
    if result.per_node:
        lines.extend(_format_nodes(result, top))
    if result.ok:
        lines.append("verdict: within tolerance")
    else:
        failed = "; ".join(f"{name} fails {', '.join(checks)}"
                           for name, checks in result.failures().items())
        lines.append(f"verdict: OUT OF TOLERANCE ({failed})")
    return "\n".join(lines)


def _ranges_line(result: VerifyResult) -> str:
    """The original's largest tensors, as shares of the converted model's 16-bit dtype's
    largest value (float16's 65504, bfloat16's 3.39e38; a float32 model: magnitudes only)."""
    target = TARGETS.get(result.criteria.dtype)
    if target is None:
        return ("largest in the original (amp-rewrite ranges lists more): " + ", ".join(
            f"{t.tensor} ({t.op}) max |x| {t.max_abs:.3g}" for t in result.ranges))
    return (f"closest to {result.criteria.dtype}'s largest value {LARGEST[target]:.6g} in the "
            f"original (amp-rewrite ranges --target {result.criteria.dtype} lists more): "
            + ", ".join(
                f"{t.tensor} ({t.op}) max |x| {t.max_abs:.3g} = {t.ratio(target):.3g} of it"
                for t in result.ranges))


def _format_nodes(result: VerifyResult, top: int) -> list[str]:
    """The per-node ranking's lines, then what could not be compared, by reason."""
    shown = result.nodes[:top]
    lines = [f"per node: {len(shown)} of {result.nodes_compared} tensors, by error added over "
             "their inputs (relative L2)"]
    w = max((len(n.tensor) for n in shown), default=0)
    for i, n in enumerate(shown, 1):
        words = n.beyond_words(result.criteria.dtype)
        beyond = f"  ({words})" if words else ""
        lines.append(f"{i:>3}. {n.tensor:<{w}}  {n.op:<16} {n.dtype:<9} added {n.added:.3g}  "
                     f"total {n.rel_l2:.3g}{beyond}")
    if result.ranges:
        lines.append(_ranges_line(result))
    if result.uncompared:
        total = sum(u.count for u in result.uncompared)
        lines.append(f"not compared: {total} tensor(s)")
        for u in result.uncompared:
            more = ", ..." if u.count > 3 else ""
            lines.append(f"  {u.count:>5}  {u.why} (e.g. {', '.join(u.tensors[:3])}{more})")
    return lines
