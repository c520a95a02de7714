"""``convert --measure``: the conversions worth writing timed on this machine, float32 among
them, and the fastest written.

The cost model's estimate (:mod:`amp_rewrite.paint.costs`) weighs bfloat16 on a CPU with
rates measured on single ops; inside a model they move (BENCHMARKS.md "Convolution savings
inside a model": an untrained MobileNetV2's convolutions save three times what it credits,
so it keeps float32 a model that grappler's painting runs 1.12x faster, while the isolated
block of the same shape still runs slower painted), and a conversion it paints whole can run
slower than the float32 model it came from. So ``--measure`` times the candidates, each
saved to a temporary folder and loaded in a process of its own, in alternating rounds
(:func:`amp_rewrite.tools.bench.time_apart`, as ``bench`` times), on the same inputs:

* ``float32``: the input as it is, unconverted;
* ``estimated``: the cost model's conversion;
* ``painted``: the conversion painted whole (``--min-matrix-intensity 0``), where the
  estimate kept nodes float32 (code ``cost``; elsewhere it is the same conversion).

The one with the lowest median time is written, a tie going to the estimate's, then to
painting whole: the medians decide, not a round or two. Where ``float32`` wins, the output
is the input unconverted, its report says so node by node (code ``measured``) and a warning
says it. A SavedModel's (or Keras file's) ``--freeze`` conversion is timed in the same rounds,
never written: where it ran faster than what is written by ``FREEZE_HINT_SHARE`` or more,
the freezing hint names it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ..conversion.graph import FREEZE_HINT_SHARE, Options
from ..conversion.pipeline import convert_path
from ..core.errors import InputError
from ..io.load import Model, load
from ..io.save import save
from ..paint.decisions import Decision
from ..report.decisions import NodeReport, Report
from .bench import Timed, method_text, spread, time_apart

log = logging.getLogger(__name__)

#: what each candidate is, in the summary's words, in the order a tie prefers them
CANDIDATES = {"estimated": "the cost model's conversion", "painted": "the conversion painted whole",
              "float32": "the float32 model (the input unconverted)"}

#: the reason of every node the cost model's conversion would have put in low precision, where
#: the float32 model ran fastest and was written
WRITTEN_FLOAT32 = Decision(False, "measured", "--measure timed the float32 model fastest on this "
                           "CPU and wrote it unconverted: the conversion would have run this "
                           "node in low precision")


@dataclass
class Measured:
    """What ``--measure`` found: each candidate's median time (ms) on this machine, its speed
    over the float32 model's (the ratio of the medians, above 1: faster) with the p10-p90 of
    that ratio round by round, and which was written (``"estimated"``, ``"painted"`` or
    ``"float32"``)."""

    chosen: str
    times_ms: dict[str, float] = field(default_factory=dict)
    speedups: dict[str, float] = field(default_factory=dict)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    kept_by_estimate: int = 0     # nodes the estimate kept float32 (code cost)
    rounds: int = 0
    #: the cost model's conversion changed nothing (it kept every node float32): it is the
    #: float32 model, timed once as such
    estimate_is_input: bool = False
    # painted whole against the estimate's (above 1: painted faster) and its p10-p90, the
    # figures of the first --measure (1 where painting whole was not timed)
    ratio: float = 1.0
    ratio_range: tuple[float, float] = (1.0, 1.0)
    # a SavedModel's --freeze conversion, timed beside: its median (ms), and its ratio to the
    # model written (above 1: frozen faster) with its p10-p90; None: not timed
    frozen_ms: float | None = None
    frozen_ratio: float | None = None
    frozen_range: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        # the fields of the first --measure, kept for readers of the report
        data["estimated_ms"] = self.times_ms.get("estimated", 0.0)
        data["painted_ms"] = self.times_ms.get("painted", 0.0)
        data["float32_ms"] = self.times_ms.get("float32", 0.0)
        data["method"] = method_text(self.rounds)
        return {**data, "summary": self.summary()}

    def summary(self) -> str:
        timed = ", ".join(self._timed(name) for name in ("float32", "estimated", "painted")
                          if name in self.times_ms)
        kept = (f"{self.kept_by_estimate} nodes the cost model kept float32 (code cost)"
                if self.kept_by_estimate else "the cost model kept no node float32 (painting "
                "whole is the same conversion)")
        if self.chosen == "float32":
            verdict = "the float32 model ran fastest on this CPU: written unconverted"
        else:
            verdict = f"wrote {CANDIDATES[self.chosen]}"
        text = f"{kept}; timed here ({method_text(self.rounds)}): {timed}: {verdict}"
        if self.frozen_ratio is not None:
            low, high = self.frozen_range
            text += (f"; frozen (--freeze) {self.frozen_ms:.2f} ms, {self.frozen_ratio:.2f}x as "
                     f"fast as the model written (p10-p90 {low:.2f}-{high:.2f})")
        return text

    def _timed(self, name: str) -> str:
        words = {"estimated": "the cost model's conversion", "painted": "painted whole",
                 "float32": "float32"}[name]
        if name == "estimated" and self.estimate_is_input:
            return f"{words} is the float32 model (it changed no node)"
        text = f"{words} {self.times_ms[name]:.2f} ms"
        if name != "float32":
            low, high = self.ranges[name]
            text += (f" ({self.speedups[name]:.2f}x float32's speed, p10-p90 "
                     f"{low:.2f}-{high:.2f})")
        return text


def pick(times_ms: Mapping[str, float]) -> str:
    """The candidate with the lowest median time; a tie goes to the first in
    :data:`CANDIDATES` order (the estimate's, then painting whole, then float32)."""
    order = list(CANDIDATES)
    return min(times_ms, key=lambda name: (times_ms[name], order.index(name)))


#: what times saved models against each other: :func:`~amp_rewrite.tools.bench.time_apart`'s
#: signature, ``({name: path}, *, runs, warmup, shapes) -> Timed``, the first the reference
Timer = Callable[..., Timed]


def measured_conversion(input_path, output_name: str, options: Options, *,
                        shapes: Mapping | None = None, runs: int = 20, warmup: int = 3,
                        timer: Timer = time_apart) -> tuple[Model, Report, Measured]:
    """``input_path`` converted with ``options``, painted whole, or left float32, whichever
    ran fastest here (see the module docstring): the model and its report, whose
    ``measured`` entry says what was timed. ``output_name`` names the candidates in the
    temporary folder (its suffix decides their format); ``shapes`` feeds open dimensions as
    ``bench --shape`` does. Only the written conversion's log lines are said. ``timer``
    times the saved candidates (:func:`~amp_rewrite.tools.bench.time_apart`; the tests give
    it fixed timings, so that each choice is checked whichever this CPU would make)."""
    if not options.weighed():
        raise InputError("--measure times the cost model of --target bfloat16 --device cpu "
                         "against painting whole and float32 on this CPU; a "
                         f"{options.target} conversion for {options.device} has none to time")
    logs: dict[str, list[logging.LogRecord]] = {"estimated": [], "painted": [], "float32": []}
    conversions = {"float32": (load(input_path), None)}
    with _held(logs["estimated"]):
        conversions["estimated"] = convert_path(input_path, options)
    kept = sum(n.code == "cost" for n in conversions["estimated"][1].nodes)
    if kept:
        with _held(logs["painted"]):
            conversions["painted"] = convert_path(
                input_path, dataclasses.replace(options, min_matrix_intensity=0))
    frozen = (None if conversions["estimated"][0].kind == "frozen"   # (frozen by default)
              else _frozen(input_path, conversions["float32"][0], options))
    models = {name: model for name, (model, _) in conversions.items()}
    same = _same(models["float32"], models["estimated"])
    timed = _timed({**{k: m for k, m in models.items() if not (same and k == "estimated")},
                    **({"frozen": frozen} if frozen else {})}, output_name, timer,
                   runs=runs, warmup=warmup, shapes=shapes)
    found = _found(timed, list(models), kept, same)
    for record in logs[found.chosen]:   # said now, as the conversion written would say them
        logging.getLogger(record.name).handle(record)
    model, report = conversions[found.chosen]
    if found.chosen == "float32":
        report = float32_report(conversions["estimated"][1])
        log.warning("--measure: the float32 model ran fastest on this CPU: writing it "
                    "unconverted (%s)", found.summary())
    if frozen is not None:
        _hint_freezing(timed, found, report)
    report.extra["measured"] = found.to_dict()
    return model, report, found


def _found(timed: Timed, names: list[str], kept: int, same: bool) -> Measured:
    """The candidates' times (``names``; the frozen conversion's is read by
    :func:`_hint_freezing`), each one's speed over float32's, and the fastest; the estimate's
    conversion where it is the input (``same``) has float32's time, and a tie keeps it."""
    alias = {"estimated": "float32"} if same else {}
    times = {name: timed.timing(alias.get(name, name)).median_ms for name in names}
    speedups, ranges = {}, {}
    for name in names:
        if name != "float32":
            ratios = timed.round_ratios("float32", alias.get(name, name))
            speedups[name] = times["float32"] / times[name]
            ranges[name] = spread(ratios)
    found = Measured(pick(times), times, speedups, ranges, kept,
                     len(timed.seconds["float32"]), same)
    if "painted" in names:
        found.ratio = times["estimated"] / times["painted"]
        found.ratio_range = spread(timed.round_ratios(alias.get("estimated", "estimated"),
                                                      "painted"))
    return found


def _same(model: Model, other: Model) -> bool:
    """Whether ``other`` holds the very graphs of ``model`` (a conversion that changed no
    node)."""
    return (model.kind, model.meta_graphs) == (other.kind, other.meta_graphs) and \
        not other.added_variables


def float32_report(report: Report) -> Report:
    """The report of the float32 model written unconverted, from the cost model's report of
    the same input: every node it would have put in a 16-bit dtype is float32, code
    ``measured`` (:data:`WRITTEN_FLOAT32`); the others keep their decisions; no cast is
    added, no Const converted; its warnings were the conversion's, not this model's."""
    nodes = []
    lowp_input = set(report.low_precision_input)
    for node in report.nodes:
        if node.precision in ("float32", "none") or node.name in lowp_input:
            nodes.append(node)
            continue
        attrs = {k: ("float32" if v in ("bfloat16", "float16") else v)
                 for k, v in node.attrs.items()}
        nodes.append(NodeReport(node.name, node.op, "float32", WRITTEN_FLOAT32.code,
                                WRITTEN_FLOAT32.text, [], attrs, node.flops))
    return dataclasses.replace(report, nodes=nodes, casts_added=[], casts_removed=[],
                               consts_converted=[], warnings=[], extra=dict(report.extra))


def _frozen(input_path, model: Model, options: Options) -> Model | None:
    """A SavedModel's --freeze conversion, timed for the freezing hint (not where the
    conversion asked is frozen already); None where --freeze refuses it (a signature that
    trains)."""
    if options.freeze or model.kind != "savedmodel":
        return None
    try:
        with _held([]):
            return convert_path(input_path, dataclasses.replace(options, freeze=True))[0]
    except InputError as exc:
        log.info("--measure: no --freeze conversion to time: %s", exc)
        return None


def _hint_freezing(timed: Timed, found: Measured, report: Report) -> None:
    """The --freeze conversion against the model written (into ``found``) and where frozen
    ran at least :data:`FREEZE_HINT_SHARE` faster, say so in the report's ``freezing``
    entry, naming --freeze: a measurement that it gains, where the estimate may not see it
    (docs/savedmodels.md "When freezing gains")."""
    written = "float32" if found.estimate_is_input and found.chosen == "estimated" else \
        found.chosen   # an estimate that changed nothing was timed as the float32 model
    found.frozen_ms = timed.timing("frozen").median_ms
    found.frozen_ratio = found.times_ms[found.chosen] / found.frozen_ms
    ratios = timed.round_ratios(written, "frozen")
    found.frozen_range = spread(ratios)
    if found.frozen_ratio < 1 + FREEZE_HINT_SHARE:
        return
    low, high = found.frozen_range
    text = (f"convert with --freeze: timed here, every signature frozen, folded and converted "
            f"ran {found.frozen_ratio:.2f}x as fast as the model written (p10-p90 {low:.2f}-"
            f"{high:.2f}; docs/savedmodels.md \"--freeze\")")
    gain = report.extra.setdefault("freezing", {})
    if gain.get("summary") in report.warnings:
        report.warnings.remove(gain["summary"])
    gain["measured_ratio"], gain["summary"] = round(found.frozen_ratio, 3), text
    report.warnings.append(text)


def _timed(candidates: dict[str, Model], output_name: str, timer: Timer, **timing) -> Timed:
    """The candidates timed by ``timer``, the first the reference, each saved for it as
    ``output_name`` (whose suffix decides the format) in a temporary folder of its key's
    name."""
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-measure-") as tmp:
        paths = {name: Path(tmp) / name / Path(output_name).name for name in candidates}
        for name, model in candidates.items():
            paths[name].parent.mkdir()
            save(model, paths[name])
        return timer(paths, **timing)


class _Hold(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]):
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _held(records: list[logging.LogRecord]):
    """The package's log records kept in ``records``, not said, while a candidate converts:
    the one not written would repeat or contradict the other's warnings."""
    logger = logging.getLogger("amp_rewrite")
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers[:], logger.propagate = [_Hold(records)], False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate
