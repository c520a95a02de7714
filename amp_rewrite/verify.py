"""``amp-rewrite verify ORIG CONVERTED``: how far the converted graph's numbers moved, and where.

Both models run on the same inputs (an ``.npz`` file, or random data from the inputs' dtypes
and shapes, ``--samples`` sets of it). For each output we report the largest absolute error,
the relative L2 error and the share of elements outside ``|conv - orig| <= atol + rtol*|orig|``;
a non-finite value where the original is finite counts as an infinite error. ``--per-node``
fetches every tensor that exists in both graphs and ranks them by the error each *adds* over
its inputs (its relative L2 error minus the largest of its inputs'), so the first tensor that
diverges, such as an op overflowing float16, comes first. Exit code 1 when an output is out of
tolerance.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .dtypes import BFLOAT16, FLOAT, FLOATING, HALF
from .errors import InputError
from .runner import (GraphRunner, Runner, check_same_interface, concrete_shape, load_inputs,
                     open_pair, random_inputs)

log = logging.getLogger(__name__)

# default (rtol, atol) by the lowest float dtype found in the converted graph
TOLERANCES = {
    BFLOAT16: (5e-2, 1e-2),   # 8-bit mantissa: ~0.4% per rounding, compounding
    HALF: (1e-2, 1e-3),       # 11-bit mantissa
    FLOAT: (1e-5, 1e-6),
}


class ErrorStats:
    """Errors of one tensor accumulated over samples (relative L2 over all of them together)."""

    def __init__(self, rtol: float, atol: float):
        self.rtol, self.atol = rtol, atol
        self.diff_sq = self.ref_sq = self.max_abs = 0.0
        self.out_of_tol = self.total = self.nonfinite = 0

    def update(self, ref: np.ndarray, out: np.ndarray) -> None:
        ref = np.asarray(ref, np.float64)
        out = np.asarray(out, np.float64)
        if ref.shape != out.shape:
            raise ValueError(f"shape {list(out.shape)} where the original has {list(ref.shape)}")
        finite = np.isfinite(ref) & np.isfinite(out)
        # a non-finite value on either side counts unless both sides hold the same one
        same_special = (ref == out) | (np.isnan(ref) & np.isnan(out))
        self.nonfinite += int(np.count_nonzero(~finite & ~same_special))
        diff = np.abs(np.where(finite, out - ref, 0.0))
        self.diff_sq += float(np.sum(diff * diff))
        self.ref_sq += float(np.sum(np.where(finite, ref * ref, 0.0)))
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
        close = np.isclose(out, ref, rtol=self.rtol, atol=self.atol, equal_nan=True)
        self.out_of_tol += int(np.count_nonzero(~close))
        self.total += ref.size

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
    def ok(self) -> bool:
        return self.out_of_tol == 0 and self.nonfinite == 0


@dataclass
class OutputError:
    name: str
    max_abs: float
    rel_l2: float
    out_of_tolerance: float     # share of elements, 0..1
    elements: int
    nonfinite: int
    ok: bool


@dataclass
class NodeError:
    tensor: str
    op: str
    dtype: str                  # the converted graph's dtype of this tensor
    rel_l2: float
    added: float                # rel_l2 minus the largest rel_l2 among its compared inputs


@dataclass
class VerifyResult:
    """What ``verify`` found; ``to_dict`` is what the HTML report shows."""

    samples: int
    rtol: float
    atol: float
    outputs: list[OutputError]
    nodes: list[NodeError] = field(default_factory=list)
    nodes_compared: int = 0

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    def to_dict(self) -> dict:
        return {"samples": self.samples, "rtol": self.rtol, "atol": self.atol, "ok": self.ok,
                "outputs": [asdict(o) for o in self.outputs],
                "nodes": [asdict(n) for n in self.nodes], "nodes_compared": self.nodes_compared}


def default_tolerance(runner: Runner) -> tuple[float, float]:
    """(rtol, atol) suited to the lowest-precision float dtype the model computes in."""
    found = _dtypes_in(runner)
    for dtype in (BFLOAT16, HALF):
        if dtype in found:
            return TOLERANCES[dtype]
    return TOLERANCES[FLOAT]


def _dtypes_in(runner: Runner) -> set[int]:
    if isinstance(runner, GraphRunner):
        graph_def = runner.graph.as_graph_def()
    else:
        graph_def = runner.fn.graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    found = set()
    for node in nodes:
        for value in node.attr.values():
            kind = value.WhichOneof("value")
            if kind == "type":
                found.add(value.type)
            elif kind == "list":
                found.update(value.list.type)
    return found


def feed_sets(runner: Runner, inputs: str | None, samples: int, shapes: Mapping,
              seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The feeds to run: the ``.npz`` file's arrays once, or ``samples`` random sets."""
    if inputs:
        return [load_inputs(inputs, runner.inputs)]
    fixed = {spec.name: concrete_shape(spec, shapes) for spec in runner.inputs}  # warns once
    return [random_inputs(runner.inputs, fixed, seed + i) for i in range(samples)]


def compare_outputs(original: Runner, converted: Runner, feeds: Sequence[Mapping],
                    rtol: float, atol: float) -> list[OutputError]:
    """Run both models on every feed set and compare their outputs, position by position."""
    check_same_interface(original, converted)
    run_a, run_b = original.callable(), converted.callable()
    stats = [ErrorStats(rtol, atol) for _ in original.outputs]
    for feed in feeds:
        for name, s, a, b in zip(original.outputs, stats, run_a(feed), run_b(feed)):
            try:
                s.update(a, b)
            except ValueError as exc:
                raise InputError(f"output {name}: the converted model gives {exc} (--output "
                                 "picks the outputs to compare)") from None
    return [OutputError(name, s.max_abs_error, s.rel_l2, s.share, s.total, s.nonfinite, s.ok)
            for name, s in zip(original.outputs, stats)]


def per_node(original: GraphRunner, converted: GraphRunner, feeds: Sequence[Mapping],
             rtol: float, atol: float) -> tuple[list[NodeError], int]:
    """Every float tensor present in both graphs, ranked by the error it adds over its inputs.

    Returns the ranking (largest added error first, earlier tensors first among equals) and
    how many tensors were compared.
    """
    names = _common_tensors(original, converted)
    stats = {n: ErrorStats(rtol, atol) for n in names}
    for feed in feeds:
        for name, a, b in zip(names, _fetch(original, feed, names), _fetch(converted, feed, names)):
            if a is None or b is None or name not in stats:
                stats.pop(name, None)
                continue
            try:
                stats[name].update(a, b)
            except ValueError:  # the conversion changed this tensor's shape: not comparable
                stats.pop(name)
    order = _topological_order(original)
    ranked = []
    for name, s in stats.items():
        t = original.graph.get_tensor_by_name(name)
        inputs = [stats[i.name].rel_l2 for i in t.op.inputs if i.name in stats]
        ranked.append(NodeError(name, t.op.type, _dtype_name(converted, name), s.rel_l2,
                                _added(s.rel_l2, max(inputs, default=0.0))))
    ranked.sort(key=lambda n: (-n.added, order.get(n.tensor.rsplit(":", 1)[0], 0)))
    return ranked, len(stats)


def _added(err: float, inherited: float) -> float:
    if math.isinf(err):
        return 0.0 if math.isinf(inherited) else math.inf
    return max(err - inherited, 0.0)


def _common_tensors(original: GraphRunner, converted: GraphRunner) -> list[str]:
    theirs = set(converted.fetchable())
    names = []
    for name in original.fetchable():
        if name not in theirs:
            continue
        a = original.graph.get_tensor_by_name(name).dtype.as_datatype_enum
        b = converted.graph.get_tensor_by_name(name).dtype.as_datatype_enum
        if a in FLOATING and b in FLOATING:
            names.append(name)
    return names


def _fetch(runner: GraphRunner, feed: Mapping, names: list[str]) -> list[np.ndarray | None]:
    """All tensors in one run; if TensorFlow refuses one of them, each on its own (None on failure)."""
    import tensorflow as tf
    try:
        return runner.fetch(feed, names)
    except tf.errors.OpError:
        log.info("fetching all tensors at once failed; fetching one at a time")
    out = []
    for name in names:
        try:
            out.append(runner.fetch(feed, [name])[0])
        except tf.errors.OpError:
            out.append(None)
    return out


def _dtype_name(runner: GraphRunner, name: str) -> str:
    return runner.graph.get_tensor_by_name(name).dtype.name


def _topological_order(runner: GraphRunner) -> dict[str, int]:
    """Op name -> position in a topological order (loop back edges are skipped, not followed)."""
    ops = runner.graph.get_operations()
    preds = {op.name: [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
             for op in ops}
    order: dict[str, int] = {}
    for root in preds:
        if root in order:
            continue
        stack, visiting = [(root, iter(preds[root]))], {root}
        while stack:
            name, pending = stack[-1]
            nxt = next((p for p in pending if p not in order and p not in visiting), None)
            if nxt is None:
                stack.pop()
                visiting.discard(name)
                order[name] = len(order)
            else:
                visiting.add(nxt)
                stack.append((nxt, iter(preds[nxt])))
    return order


def verify(original_path, converted_path, *, inputs: str | None = None, samples: int = 1,
           shapes: Mapping | None = None, rtol: float | None = None, atol: float | None = None,
           nodes: bool = False, signature: str | None = None, outputs: Sequence[str] = (),
           checkpoint: str | None = None) -> VerifyResult:
    """Compare two models on the same inputs (see the module docstring)."""
    if samples < 1:
        raise InputError("--samples must be at least 1")
    with open_pair(original_path, converted_path, signature=signature, outputs=outputs,
                   checkpoint=checkpoint) as (a, b):
        d_rtol, d_atol = default_tolerance(b)
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
        feeds = feed_sets(a, inputs, samples, shapes or {})
        result = VerifyResult(len(feeds), rtol, atol, compare_outputs(a, b, feeds, rtol, atol))
        if nodes:
            if not (isinstance(a, GraphRunner) and isinstance(b, GraphRunner)):
                raise InputError("--per-node needs graph files (GraphDef or MetaGraph), "
                                 "not SavedModel directories")
            result.nodes, result.nodes_compared = per_node(a, b, feeds, rtol, atol)
    return result


def format_result(result: VerifyResult, top: int = 10) -> str:
    lines = [f"{result.samples} sample(s), tolerance |conv - orig| <= {result.atol:g} + "
             f"{result.rtol:g} * |orig|"]
    width = max(len(o.name) for o in result.outputs)
    for o in result.outputs:
        lines.append(f"{o.name:<{width}}  max abs {o.max_abs:.3g}  rel L2 {o.rel_l2:.3g}  "
                     f"out of tolerance {100 * o.out_of_tolerance:.2f}% of {o.elements}  "
                     + ("ok" if o.ok else "FAIL"))
    if result.nodes:
        shown = result.nodes[:top]
        lines.append(f"per node: {len(shown)} of {result.nodes_compared} tensors, by error added "
                     "over their inputs (relative L2)")
        w = max(len(n.tensor) for n in shown)
        for i, n in enumerate(shown, 1):
            lines.append(f"{i:>3}. {n.tensor:<{w}}  {n.op:<16} {n.dtype:<9} added {n.added:.3g}  "
                         f"total {n.rel_l2:.3g}")
    lines.append("verdict: " + ("within tolerance" if result.ok else "OUT OF TOLERANCE"))
    return "\n".join(lines)
