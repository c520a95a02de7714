"""``convert --measure``: where the cost model kept islands float32, time its choice against the
conversion painted whole on this machine, and keep the faster.

The cost model's estimate (:mod:`amp_rewrite.paint.costs`) weighs bfloat16 on a CPU with
rates measured on single ops; inside a model they move (BENCHMARKS.md "Convolution savings
inside a model": an untrained MobileNetV2's convolutions save three times what it credits, so
it keeps float32 a model that grappler's painting runs 1.12x faster, while the isolated block
of the same shape still runs slower painted). So where the estimate decided (some node has
code ``cost``), both conversions are written to a temporary folder and timed against each other
by :func:`amp_rewrite.tools.bench.bench`, interleaved on the same inputs; the one painted whole
is kept where its median time over the interleaved rounds is lower, else the estimate's: the
medians decide, not a round or two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..conversion.graph import FREEZE_HINT_SHARE, Options
from ..conversion.pipeline import convert_path
from ..core.errors import InputError
from ..io.load import Model
from ..io.save import save
from ..report.decisions import Report
from .bench import BenchResult, bench

log = logging.getLogger(__name__)


@dataclass
class Measured:
    """What ``--measure`` found: the two conversions' medians (ms) on this machine, the ratio
    of the medians and the p10-p90 of the per-round ratios (above 1: the painted one faster),
    and which was kept (``"estimated"`` or ``"painted"``)."""

    chosen: str
    estimated_ms: float = 0.0
    painted_ms: float = 0.0
    ratio: float = 1.0
    ratio_range: tuple[float, float] = (1.0, 1.0)
    kept_by_estimate: int = 0     # nodes the estimate kept float32 (code cost)
    # a SavedModel's conversion against its --freeze conversion: that one's median (ms), and
    # the ratio of the medians (above 1: frozen faster) with its p10-p90; None: not timed
    frozen_ms: float | None = None
    frozen_ratio: float | None = None
    frozen_range: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "summary": self.summary()}

    def summary(self) -> str:
        if not self.kept_by_estimate:
            text = "nothing to measure: the cost model kept no node float32"
        else:
            kept = {"painted": "the conversion painted whole", "estimated": "the cost model's"}
            text = (f"{self.kept_by_estimate} nodes the cost model kept float32 (code cost); "
                    f"timed here, the cost model's conversion {self.estimated_ms:.2f} ms, "
                    f"painted whole {self.painted_ms:.2f} ms (painted {self.ratio:.2f}x as fast, "
                    f"p10-p90 {self.ratio_range[0]:.2f}-{self.ratio_range[1]:.2f}): wrote "
                    f"{kept[self.chosen]}")
        if self.frozen_ratio is not None:
            low, high = self.frozen_range
            text += (f"; frozen (--freeze) {self.frozen_ms:.2f} ms, {self.frozen_ratio:.2f}x as "
                     f"fast as the conversion written (p10-p90 {low:.2f}-{high:.2f})")
        return text


def pick(result: BenchResult) -> str:
    """``"painted"`` where the painted conversion (the second model of ``result``) was faster
    by the median over the interleaved rounds, else ``"estimated"``."""
    return "painted" if result.speedup > 1.0 else "estimated"


#: what times two saved models against each other: :func:`~amp_rewrite.tools.bench.bench`'s
#: signature, ``(first_path, second_path, *, runs, warmup, shapes) -> BenchResult``
Timer = Callable[..., BenchResult]


def measured_conversion(input_path, output_name: str, options: Options, *,
                        shapes: Mapping | None = None, runs: int = 20, warmup: int = 3,
                        timer: Timer = bench) -> tuple[Model, Report, Measured]:
    """``input_path`` converted with ``options`` or, where the cost model kept nodes float32
    and painting them ran faster here, with ``min_matrix_intensity=0`` (painted whole): the
    model and its report, whose ``measured`` entry says what was timed. ``output_name`` names
    the candidates in the temporary folder (its suffix decides their format); ``shapes`` feeds
    open dimensions as ``bench --shape`` does. Only the kept conversion's log lines are said.
    ``timer`` times the two saved candidates (:func:`~amp_rewrite.tools.bench.bench`; the tests
    give it fixed timings, so that each choice is checked whichever this CPU would make)."""
    if not options.weighed():
        raise InputError("--measure times the cost model of --target bfloat16 --device cpu "
                         "against painting whole on this CPU; a "
                         f"{options.target} conversion for {options.device} has none to time")
    logs: dict[str, list[logging.LogRecord]] = {"estimated": [], "painted": []}
    with _held(logs["estimated"]):
        estimated = convert_path(input_path, options)
    kept = sum(n.code == "cost" for n in estimated[1].nodes)
    found = Measured("estimated", kept_by_estimate=kept)
    if kept:
        with _held(logs["painted"]):
            painted = convert_path(input_path, dataclasses.replace(options, min_matrix_intensity=0))
        result = _timed({"estimated": estimated[0], "painted": painted[0]}, output_name, timer,
                        runs=runs, warmup=warmup, shapes=shapes)
        found = Measured(pick(result), result.original.median_ms, result.converted.median_ms,
                         result.speedup, result.speedup_range(), kept)
    for record in logs[found.chosen]:   # said now, as the conversion written would say them
        logging.getLogger(record.name).handle(record)
    model, report = painted if found.chosen == "painted" else estimated
    if not options.freeze and model.kind == "savedmodel":
        _time_freezing(input_path, output_name, model, report, found, options, timer,
                       shapes=shapes, runs=runs, warmup=warmup)
    report.extra["measured"] = found.to_dict()
    return model, report, found


def _time_freezing(input_path, output_name: str, model: Model, report: Report, found: Measured,
                   options: Options, timer: Timer, **timing) -> None:
    """Time the SavedModel conversion ``model`` against the input's --freeze conversion (into
    ``found``) and where frozen runs at least :data:`FREEZE_HINT_SHARE` faster, say so in the
    report's ``freezing`` entry, naming --freeze: a measurement that it gains, where the
    estimate may not see it (docs/savedmodels.md "When freezing gains"). A SavedModel that
    --freeze refuses (a signature that trains) is not timed."""
    try:
        with _held([]):
            frozen, _ = convert_path(input_path, dataclasses.replace(options, freeze=True))
    except InputError as exc:
        log.info("--measure: no --freeze conversion to time: %s", exc)
        return
    result = _timed({"written": model, "frozen": frozen}, output_name, timer, **timing)
    found.frozen_ms, found.frozen_ratio = result.converted.median_ms, result.speedup
    found.frozen_range = result.speedup_range()
    if result.speedup < 1 + FREEZE_HINT_SHARE:
        return
    low, high = found.frozen_range
    text = (f"convert with --freeze: timed here, every signature frozen, folded and converted "
            f"ran {result.speedup:.2f}x as fast as this conversion (p10-p90 {low:.2f}-"
            f"{high:.2f}; docs/savedmodels.md \"--freeze\")")
    gain = report.extra.setdefault("freezing", {})
    if "summary" in gain:
        report.warnings.remove(gain["summary"])
    gain["measured_ratio"], gain["summary"] = round(result.speedup, 3), text
    report.warnings.append(text)


def _timed(candidates: dict[str, Model], output_name: str, timer: Timer, **timing) -> BenchResult:
    """The first of two models timed against the second by ``timer``, each saved for it as
    ``output_name`` (whose suffix decides the format) in a temporary folder of its key's name."""
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-measure-") as tmp:
        paths = [Path(tmp) / name / Path(output_name).name for name in candidates]
        for model, path in zip(candidates.values(), paths):
            path.parent.mkdir()
            save(model, path)
        return timer(*paths, **timing)


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
