"""How large the float tensors of an FP32 model get on data: calibration for range-aware
precision (``amp-rewrite MODEL -o OUT --calibration data.npz``) and ``amp-rewrite ranges``.

:func:`calibrate` runs the float32 model on the samples given, with the tracing ``verify
--per-node`` uses (:meth:`~amp_rewrite.tools.runner.Runner.trace`: every float tensor of a graph
file that a fetch reaches, every tensor of a SavedModel signature's function bodies, named
``function/node:port`` as the conversion report names nodes), and records per tensor
(:class:`TensorRange`) its largest finite magnitude over every sample and execution, and, for
each 16-bit dtype, how many of its nonzero values fall below that dtype's smallest normal or
round to zero there. Infinities and NaNs the float32 model computes itself are counted apart,
never as the maximum: a 16-bit dtype holds them as they are.

:meth:`Ranges.maxima` is what the conversion takes (``Options.calibration``): a node whose
inputs or outputs come within ``headroom`` of the 16-bit dtype's largest value stays float32
(code ``range``, :mod:`amp_rewrite.paint.calibrated`); :func:`format_ranges` is the ``ranges``
command's table, the tensors closest to the target's limit first (``--target``: float16's 65504
by default, bfloat16's 3.39e38).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from ..core.dtypes import (
    HALF,
    HEADROOM,
    LARGEST,
    LOW_PRECISION,
    SMALLEST_NORMAL,
    SMALLEST_SUBNORMAL,
    TARGET_NAMES,
    near_limit,
)
from ..core.errors import InputError
from ..core.ops import PLACEHOLDER_OPS
from ..io.files import is_keras_file
from ..io.keras_files import saved_models
from ..io.load import Model
from ..schema.inputs import match_inputs
from .masks import constant_masks
from .runner import GraphRunner, Runner, load_inputs, open_model
from .traces import TensorInfo, Trace

log = logging.getLogger(__name__)

#: why a tensor of the model was not recorded (the reasons a runner gives, see
#: :meth:`~amp_rewrite.tools.runner.Runner.uncomparable`)
UNRECORDED = {
    "control_flow": "inside a v1 while loop or cond branch, which a fetch cannot reach",
    "after_write": "computed after a variable write, which fetching it would run",
    "fetch_failed": "TensorFlow could not fetch it",
}


@dataclass
class TensorRange:
    """What one float tensor held over the samples: its largest finite magnitude, how many
    values it held (every sample, every execution), how many were nonzero and finite, how
    many were not finite and, of those, how many infinite; per 16-bit dtype name (``float16``, ``bfloat16``), how many nonzero
    values lie below its smallest normal (``subnormal``) and how many round to zero there
    (``flushed``)."""

    tensor: str
    op: str
    dtype: str
    order: int = 0
    max_abs: float = 0.0
    values: int = 0
    nonzero: int = 0
    nonfinite: int = 0
    infinite: int = 0
    subnormal: dict[str, int] = field(default_factory=dict)
    flushed: dict[str, int] = field(default_factory=dict)
    #: every value 0 or 1 (a 0/1 mask on these samples: :mod:`amp_rewrite.tools.masks`)
    binary: bool = True

    def ratio(self, target: int = HALF) -> float:
        """The largest magnitude as a share of ``target``'s largest finite value."""
        return self.max_abs / LARGEST[target]

    def add(self, value: np.ndarray) -> None:
        a = np.asarray(value)
        if a.dtype not in (np.float32, np.float64):
            a = a.astype(np.float32)        # float16 / bfloat16 arrays: compare in float32
        mag = np.abs(a).ravel()
        finite = np.isfinite(mag)
        bad = mag.size - int(np.count_nonzero(finite))
        if bad:
            self.infinite += int(np.count_nonzero(np.isinf(mag)))
            mag = mag[finite]
        self.values += a.size
        self.nonfinite += bad
        self.binary = self.binary and not bad and bool(np.all((mag == 0) | (mag == 1))) \
            and not np.any(a < 0)
        if not mag.size:
            return
        self.max_abs = max(self.max_abs, float(mag.max()))
        nonzero = mag[mag > 0]
        self.nonzero += nonzero.size
        for dtype in LOW_PRECISION:
            name = TARGET_NAMES[dtype]
            self.subnormal[name] = self.subnormal.get(name, 0) + int(
                np.count_nonzero(nonzero < SMALLEST_NORMAL[dtype]))
            self.flushed[name] = self.flushed.get(name, 0) + int(
                np.count_nonzero(nonzero <= SMALLEST_SUBNORMAL[dtype] / 2))

    def to_dict(self, headroom: float = HEADROOM, target: int = HALF) -> dict:
        """Its figures; ``ratio`` and ``within_headroom`` of ``target``'s largest value."""
        return {"tensor": self.tensor, "op": self.op, "dtype": self.dtype,
                "max_abs": self.max_abs, "ratio": self.ratio(target),
                "within_headroom": near_limit(self.max_abs, target, headroom),
                "values": self.values, "nonzero": self.nonzero, "nonfinite": self.nonfinite,
                "subnormal": dict(self.subnormal), "flushed": dict(self.flushed)}


@dataclass
class Ranges:
    """The float tensors of one model over ``samples`` runs (:class:`TensorRange` by tensor
    name), and the tensors of its computation a run could not record, each with why (a key
    of :data:`UNRECORDED`)."""

    samples: int = 0
    tensors: dict[str, TensorRange] = field(default_factory=dict)
    unrecorded: dict[str, str] = field(default_factory=dict)
    #: what each tensor is (its op and sources), from the traces added
    info: dict[str, TensorInfo] = field(default_factory=dict)

    def add(self, trace: Trace) -> None:
        """One run's float tensors (every value a tensor took: a loop body's, per iteration)."""
        self.samples += 1
        self.info.update(trace.info)
        for name, values in trace.values.items():
            found = self.tensors.get(name)
            if found is None:
                info = trace.info[name]
                found = self.tensors[name] = TensorRange(name, info.op, info.dtype, info.order)
            for value in values:
                found.add(value)

    def check_finite(self, data: str = "the calibration data",
                     anyway: str = "calibrate anyway") -> None:
        """Calibration (and tuning) needs a finite reference: an :class:`InputError` where a
        tensor holds inf or NaN in the float32 model itself on ``data`` (an all-NaN batch,
        inputs of 1e30), naming the first such tensor and how many values, unless it is a
        constant mask (a -inf or -1e9 mask is past any range by construction:
        :mod:`.masks`)."""
        bad = [t for t in self.ranked() if t.nonfinite]
        masks = constant_masks(self.info, self.tensors, LARGEST[HALF], [t.tensor for t in bad])
        bad = sorted((t for t in bad if t.tensor not in masks), key=lambda t: (t.order, t.tensor))
        if bad:
            first = bad[0]
            more = f" (and {len(bad) - 1} more tensor(s) computed in float32)" if len(bad) > 1 else ""
            where = (f"input {first.tensor} holds" if first.op in PLACEHOLDER_OPS else
                     f"the float32 model itself gives, in {first.tensor} ({first.op}),")
            raise InputError(
                f"{where} {first.nonfinite} of {first.values} value(s) as inf or NaN on {data}"
                f"{more}: there is no finite reference to compare 16 bits with; check the "
                f"inputs, or {anyway} with --allow-nonfinite-reference")

    def maxima(self) -> dict[str, float]:
        """Tensor name -> its largest finite magnitude: what a conversion takes as calibration
        (``Options.calibration``)."""
        return {name: t.max_abs for name, t in self.tensors.items()}

    def ranked(self) -> list[TensorRange]:
        """Every tensor, the largest magnitude first (earlier tensors first among equals)."""
        return sorted(self.tensors.values(), key=lambda t: (-t.max_abs, t.order, t.tensor))

    def near(self, headroom: float = HEADROOM, target: int = HALF) -> list[TensorRange]:
        """The tensors within ``headroom`` of ``target``'s largest value, largest first."""
        return [t for t in self.ranked() if near_limit(t.max_abs, target, headroom)]

    def shares(self, target: int) -> tuple[float, float, int]:
        """Over every tensor: the share of nonzero finite values below ``target``'s smallest
        normal, the share that round to zero in it, and how many tensors hold any of those."""
        name = TARGET_NAMES[target]
        nonzero = sum(t.nonzero for t in self.tensors.values())
        sub = sum(t.subnormal.get(name, 0) for t in self.tensors.values())
        zero = sum(t.flushed.get(name, 0) for t in self.tensors.values())
        holding = sum(1 for t in self.tensors.values() if t.subnormal.get(name, 0))
        return (sub / nonzero if nonzero else 0.0, zero / nonzero if nonzero else 0.0, holding)

    def to_dict(self, headroom: float = HEADROOM, target: int = HALF) -> dict:
        """Every tensor's figures, against ``target``'s largest value."""
        limit = LARGEST[target] / headroom
        return {"samples": self.samples, "target": TARGET_NAMES[target],
                "largest": LARGEST[target], "headroom": headroom,
                "limit": limit, "within_headroom": len(self.near(headroom, target)),
                "tensors": [t.to_dict(headroom, target) for t in self.ranked()],
                "unrecorded": [{"tensor": name, "reason": reason, "why": UNRECORDED.get(reason, reason)}
                               for name, reason in self.unrecorded.items()]}


Sample = Mapping[str, np.ndarray] | str | os.PathLike


def calibrate(model: str | os.PathLike | Model, samples: Sample | Iterable[Sample], *,
              signature: str | None = None, checkpoint: str | None = None) -> Ranges:
    """Run the float32 ``model`` on each of ``samples`` and record its float tensors.

    ``model``: a GraphDef or MetaGraph file, a SavedModel directory (its signature
    ``signature``, default ``serving_default``), a Keras file (run as the SavedModel of its
    serving function) or a loaded :class:`~amp_rewrite.io.load.Model`. ``samples``: ``.npz``
    paths or feed dicts keyed by input name, one run each; every key must name an input and
    every input needs an array (:func:`~amp_rewrite.schema.inputs.match_inputs`). A MetaGraph's
    variables are restored from ``checkpoint``, else drawn by their initializers (logged: the
    ranges are then those of an untrained model).
    """
    if isinstance(samples, (str, os.PathLike, Mapping)):
        samples = [samples]
    samples = list(samples)
    if not samples:
        raise InputError("calibration needs at least one sample (--calibration DATA.npz)")
    with contextlib.ExitStack() as stack:
        if not isinstance(model, Model) and is_keras_file(model):
            (model,) = stack.enter_context(saved_models([model]))
        runner = stack.enter_context(open_model(model, signature=signature,
                                                checkpoint=checkpoint))
        _warn_untrained(runner, checkpoint)
        found = Ranges()
        for sample in samples:
            feed = _feed(sample, runner)
            if isinstance(runner, GraphRunner):
                runner.callable()(feed)   # inputs it refuses are the user's: one line, exit 2
            found.add(runner.trace(feed))
        found.unrecorded = {name: reason for name, reason in runner.uncomparable().items()
                            if name not in found.tensors}
    return found


def _warn_untrained(runner: Runner, checkpoint: str | None) -> None:
    if isinstance(runner, GraphRunner) and checkpoint is None \
            and runner.graph.get_collection("variables") and runner.model.kind != "savedmodel":
        log.warning("%s: its variables hold their initializers' values (no --checkpoint): the "
                    "ranges recorded are those of an untrained model", runner.path)


def _feed(sample: Sample, runner: Runner) -> dict[str, np.ndarray]:
    """One sample as feeds by input name: an ``.npz`` file's arrays, or a feed dict, each name
    checked as ``verify`` and ``tune`` check them."""
    if isinstance(sample, (str, os.PathLike)):
        return load_inputs(sample, runner.inputs)
    named = {spec.name: sample[key] for key, spec in
             match_inputs(sample, runner.inputs, "calibration: a feed dict's key").items()}
    missing = [s.name for s in runner.inputs if s.name not in named]
    if missing:
        raise InputError(f"calibration: a feed dict has no array for input(s) "
                         f"{', '.join(map(repr, missing))} (has: {', '.join(map(str, sample))})")
    return {s.name: np.asarray(named[s.name]) for s in runner.inputs}


def format_ranges(found: Ranges, top: int = 20, headroom: float = HEADROOM,
                  target: int = HALF) -> str:
    """The ``ranges`` command's output: a line on what was recorded, the ``top`` tensors
    closest to ``target``'s largest value (the share of it each reaches, its largest
    magnitude, op and name; ``*`` where it comes within ``headroom``, so ``--calibration``
    with that ``--target`` keeps the nodes that produce and read it float32), the shares of
    small values each 16-bit dtype loses, and what could not be recorded."""
    name = TARGET_NAMES[target]
    largest, limit = LARGEST[target], LARGEST[target] / headroom
    near = found.near(headroom, target)
    lines = [f"{len(found.tensors)} float tensors over {found.samples} sample(s); "
             f"{len(near)} within the headroom {headroom:g} of {name}'s largest value "
             f"{largest:.6g} (max |x| >= {limit:.4g}, marked *: --calibration keeps the nodes "
             "that compute and read them float32)"]
    shown = found.ranked()[:top]
    if shown:
        width = max(len(t.op) for t in shown)
        lines.append(f"  {'of ' + format(largest, '.3g' if largest > 1e6 else 'g'):>9}  {'max |x|':>9}  "
                     f"{'op':<{width}}  tensor")
    for t in shown:
        mark = "*" if near_limit(t.max_abs, target, headroom) else " "
        note = f"  (past {name}'s range: inf there)" if t.max_abs > largest else ""
        if t.nonfinite:
            note += f"  ({t.nonfinite} inf/nan in float32 itself)"
        lines.append(f"{mark} {t.ratio(target):>9.3g}  {t.max_abs:>9.3g}  {t.op:<{width}}  "
                     f"{t.tensor}{note}")
    for dtype in LOW_PRECISION:
        sub, zero, holding = found.shares(dtype)
        name = TARGET_NAMES[dtype]
        lines.append(f"small values in {name}: {_percent(sub)} of the nonzero values lie below its "
                     f"smallest normal {SMALLEST_NORMAL[dtype]:.3g} (in {holding} tensors), "
                     f"{_percent(zero)} round to zero")
    if found.unrecorded:
        groups: dict[str, int] = {}
        for reason in found.unrecorded.values():
            groups[reason] = groups.get(reason, 0) + 1
        lines.append(f"not recorded: {len(found.unrecorded)} tensor(s) (" + "; ".join(
            f"{UNRECORDED.get(r, r)}: {n}" for r, n in sorted(groups.items(), key=lambda g: -g[1]))
            + ")")
    return "\n".join(lines)


def _percent(share: float) -> str:
    return "0%" if share == 0 else f"{100 * share:.3g}%"

