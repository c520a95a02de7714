"""``amp-rewrite bench ORIG CONVERTED``: median latency and throughput of both, side by side.

Both models are loaded into the same process, warmed up, then timed interleaved (ABBA order,
so drift in clock speed or caches falls on both alike) on the same inputs, computing the
outputs verify compares (:func:`amp_rewrite.tools.runner.open_pair`: a training graph's forward
outputs and unscaled gradients, never a variable update). A graph fed by a tf.data iterator
is timed on one batch of it, fed to both (:func:`~amp_rewrite.tools.verify.feed_sets`): the
models' work, not the input pipeline's. The speed-up is the
original's median latency over the converted one's; throughput is the batch (the first input's
leading dimension) over the median latency.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

from ..core.errors import InputError
from .runner import open_pair
from .verify import feed_sets


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    throughput: float   # samples per second at the median latency


@dataclass
class BenchResult:
    runs: int
    warmup: int
    batch: int
    original: Timing
    converted: Timing
    round_speedups: list[float]   # original / converted time within each timed round

    @property
    def speedup(self) -> float:
        """How many times faster the converted model is (original / converted median latency)."""
        return self.original.median_ms / self.converted.median_ms

    def speedup_range(self) -> tuple[float, float]:
        """p10 and p90 of the per-round ratios: how much the ratio moved during the run."""
        q = _deciles(self.round_speedups)
        return q[0], q[-1]

    def to_dict(self) -> dict:
        low, high = self.speedup_range()
        return {"runs": self.runs, "warmup": self.warmup, "batch": self.batch,
                "original": asdict(self.original), "converted": asdict(self.converted),
                "speedup": self.speedup, "speedup_p10": low, "speedup_p90": high}


def _deciles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 9
    return statistics.quantiles(sorted(values), n=10, method="inclusive")


def _timing(seconds: list[float], batch: int) -> Timing:
    ms = sorted(s * 1e3 for s in seconds)
    q = _deciles(ms)
    median = statistics.median(ms)
    return Timing(median, q[0], q[-1], batch / (median / 1e3))


def time_interleaved(a: Callable[[], object], b: Callable[[], object], runs: int, warmup: int,
                     progress: Callable[[int, int], None] | None = None) -> tuple[list[float], list[float]]:
    """Call ``a`` and ``b`` alternately (ABBA), ``warmup`` untimed rounds first; seconds per call."""
    total = warmup + runs
    times_a, times_b = [], []
    for i in range(total):
        order = ((a, times_a), (b, times_b)) if i % 2 == 0 else ((b, times_b), (a, times_a))
        for fn, sink in order:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                sink.append(elapsed)
        if progress:
            progress(i + 1, total)
    return times_a, times_b


def bench(original_path, converted_path, *, runs: int = 20, warmup: int = 3,
          shapes: Mapping | None = None, inputs: str | None = None, signature: str | None = None,
          outputs: Sequence[str] = (), checkpoint: str | None = None,
          progress: Callable[[int, int], None] | None = None,
          init_ops: Sequence[str] = ()) -> BenchResult:
    """Time both models on the same inputs (see the module docstring; ``init_ops``:
    ``--init-op``)."""
    if runs < 1 or warmup < 0:
        raise InputError("--runs must be at least 1 and --warmup at least 0")
    with open_pair(original_path, converted_path, signature=signature, outputs=outputs,
                   checkpoint=checkpoint, init_ops=init_ops) as (ra, rb):
        feed = feed_sets(ra, inputs, 1, shapes or {})[0]
        call_a, call_b = ra.callable(), rb.callable()
        times_a, times_b = time_interleaved(lambda: call_a(feed), lambda: call_b(feed), runs,
                                            warmup, progress)
    first = next(iter(feed.values()), None)
    batch = int(first.shape[0]) if first is not None and first.ndim else 1
    return BenchResult(runs, warmup, batch, _timing(times_a, batch), _timing(times_b, batch),
                       [a / b for a, b in zip(times_a, times_b)])


def format_result(result: BenchResult) -> str:
    rows = [("original", result.original), ("converted", result.converted)]
    lines = [f"{result.runs} timed runs each after {result.warmup} warm-up, interleaved, "
             f"batch {result.batch}"]
    for name, t in rows:
        lines.append(f"{name:<9}  median {t.median_ms:9.3f} ms  (p10 {t.p10_ms:.3f}, p90 "
                     f"{t.p90_ms:.3f})  {t.throughput:10.1f} samples/s")
    low, high = result.speedup_range()
    lines.append(f"speed-up (original / converted median latency): {result.speedup:.2f}x "
                 f"(per round p10-p90 {low:.2f}-{high:.2f}x)")
    return "\n".join(lines)
