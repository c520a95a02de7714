"""``amp-rewrite costs measure``: time the single ops the cost model's rates come from, on this
CPU, and make its cost table (:mod:`amp_rewrite.rules.cost_table`).

Matrix ops save time in proportion to their FLOPs; an elementwise op whose bfloat16 kernel is
slower than its float32 one (TensorFlow's CPU kernels for most activations are Eigen loops, not
oneDNN's, unless the remapper fuses them into a convolution) costs time in proportion to the
elements it writes. Each op runs on a tensor computed in the graph (a Cast of the input), once in
float32 and once in bfloat16, the same graph without the op timed beside it and subtracted;
``rounds`` runs each, interleaved in one process, medians (:func:`time_op`). From those
(:meth:`Measurement.rates`):

* ``saved_ps_per_flop``: the median over Conv2D 1x1, Conv2D 3x3 and MatMul of the time bfloat16
  saves per FLOP, and ``saved_ps_per_flop_by_op`` what each kind saves (Conv2D the mean of its
  two rows, the depthwise convolution and MatMul their own): a depthwise convolution can lose
  in bfloat16 where the others gain;
* ``fp32_ps_per_flop``: the median over the same of their float32 time per FLOP;
* ``unfused_ps_per_element``: each activation's time bfloat16 adds per element it writes;
* ``folded_ps_per_element``: the mean of a per-channel Mul's and AddV2's float32 time per
  element (what folding a batch norm into a convolution saves);
* ``cast_ps_per_element``: a float32 -> bfloat16 Cast's time per element, in a float32 graph.

A time below 0 (noise, for the ops that are times and not differences) is written as 0. The
tensor is ``SHAPE``, a MobileNetV2 expansion's activations at batch 8 (BENCHMARKS.md "Op costs
in bfloat16 on this CPU" was made so, by ``benchmarks/cpu_costs.py``); ``quick`` takes a small
one and 3 rounds, to check the command in seconds: its rates are dispatch, not this CPU's.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tensorflow as tf

from ..core import hardware
from ..rules import cost_table

v1 = tf.compat.v1
SHAPE = (8, 56, 56, 144)   # a MobileNetV2 expansion's activations at batch 8
ROUNDS = 30
QUICK_SHAPE = (2, 8, 8, 16)
QUICK_ROUNDS = 3
#: the matrix ops whose saving per FLOP is the table's (the depthwise convolution is only shown)
SAVING_OPS = ("Conv2D 1x1", "Conv2D 3x3", "MatMul")
FOLDED_OPS = ("Mul (per-channel vector)", "AddV2 (per-channel vector)")
CAST = "Cast float32 -> bfloat16 (in float32)"


def _filter(shape, dt):
    return tf.constant(np.random.default_rng(0).normal(0, 0.1, shape).astype(np.float32), dt)


def matrix_ops(shape) -> dict[str, tuple[Callable, int]]:
    """Name -> (function of (x, dtype), its FLOPs on a tensor of ``shape``), ``c`` channels."""
    c, n = shape[-1], int(np.prod(shape))
    return {
        "Conv2D 1x1": (lambda x, dt: tf.nn.conv2d(x, _filter((1, 1, c, c), dt), 1, "SAME"),
                       2 * c * n),
        "Conv2D 3x3": (lambda x, dt: tf.nn.conv2d(x, _filter((3, 3, c, c), dt), 1, "SAME"),
                       2 * 9 * c * n),
        "DepthwiseConv2dNative 3x3": (lambda x, dt: tf.nn.depthwise_conv2d(
            x, _filter((3, 3, c, 1), dt), [1, 1, 1, 1], "SAME"), 2 * 9 * n),
        "MatMul": (lambda x, dt: tf.matmul(tf.reshape(x, [-1, c]), _filter((c, 4 * c), dt)),
                   2 * c * 4 * c * n // c),
    }


def elementwise_ops(shape) -> dict[str, Callable]:
    """Name -> function of (x, dtype): the activations of the table
    (:data:`~amp_rewrite.rules.cost_table.UNFUSED_OPS`), what folding removes, a weight's cast,
    and the ops BENCHMARKS.md shows beside them."""
    c = shape[-1]
    return {
        "Relu": lambda x, dt: tf.nn.relu(x),
        "Relu6": lambda x, dt: tf.nn.relu6(x),
        "Elu": lambda x, dt: tf.nn.elu(x),
        "Selu": lambda x, dt: tf.nn.selu(x),
        "LeakyRelu": lambda x, dt: tf.nn.leaky_relu(x),
        "Sigmoid": lambda x, dt: tf.sigmoid(x),
        "Tanh": lambda x, dt: tf.tanh(x),
        "Softplus": lambda x, dt: tf.nn.softplus(x),
        "Erf": lambda x, dt: tf.math.erf(x),
        "Exp": lambda x, dt: tf.exp(x),
        "Mul (per-channel vector)": lambda x, dt: x * _filter((c,), dt),
        "AddV2 (per-channel vector)": lambda x, dt: x + _filter((c,), dt),
        "AddV2 (two tensors)": lambda x, dt: x + tf.nn.relu(x),
        "BiasAdd": lambda x, dt: tf.nn.bias_add(x, _filter((c,), dt)),
        CAST: lambda x, dt: tf.cast(x, tf.bfloat16),
    }


def _graph(fn, dt, shape) -> tf.Graph:
    """``out`` = fn(cast(x)), or the cast alone (``fn`` None), summed over a slice so that
    fetching costs nothing."""
    g = tf.Graph()
    with g.as_default():
        x = tf.cast(v1.placeholder(tf.float32, shape, name="x"), dt)
        y = x if fn is None else fn(x, dt)
        tf.identity(tf.reduce_sum(tf.cast(tf.reshape(y, [-1])[:8], tf.float32)), name="out")
    return g


def time_op(fn, rounds: int, shape=SHAPE) -> dict[str, float]:
    """Median seconds of the op alone (graph minus its base), float32 and bfloat16: the four
    graphs interleaved, each round in another order, after 3 untimed rounds."""
    runs = {(k, dt): v1.Session(graph=_graph(f, dt, shape))
            for k, f in (("op", fn), ("base", None)) for dt in (tf.float32, tf.bfloat16)}
    feed = {"x:0": np.random.default_rng(1).normal(size=shape).astype(np.float32)}
    times = {k: [] for k in runs}
    keys = list(runs)
    try:
        for i in range(rounds + 3):
            for k in keys[i % 4:] + keys[:i % 4]:
                start = time.perf_counter()
                runs[k].run("out:0", feed)
                if i >= 3:
                    times[k].append(time.perf_counter() - start)
    finally:
        for session in runs.values():
            session.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {dt.name: med[("op", dt)] - med[("base", dt)] for dt in (tf.float32, tf.bfloat16)}


@dataclass
class Measurement:
    """What :func:`measure` timed: per op, seconds in float32 and bfloat16 (its FLOPs for a
    matrix op), and how."""

    shape: tuple[int, ...]
    rounds: int
    quick: bool
    matrix: dict[str, tuple[dict[str, float], int]] = field(default_factory=dict)
    elementwise: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape))

    def per_unit(self, name: str) -> float:
        """ps per FLOP a matrix op saves, or ps per element an elementwise op loses in bfloat16
        (a Cast: takes in float32)."""
        if name in self.matrix:
            t, flops = self.matrix[name]
            return (t["float32"] - t["bfloat16"]) / flops * 1e12
        t = self.elementwise[name]
        if name == CAST:
            return t["float32"] / self.elements * 1e12
        return (t["bfloat16"] - t["float32"]) / self.elements * 1e12

    def rates(self) -> dict[str, float]:
        """The table's ``[rates]`` (module docstring)."""
        fp32 = [self.matrix[n][0]["float32"] / self.matrix[n][1] * 1e12 for n in SAVING_OPS]
        folded = [self.elementwise[n]["float32"] / self.elements * 1e12 for n in FOLDED_OPS]
        return {"saved_ps_per_flop": statistics.median(self.per_unit(n) for n in SAVING_OPS),
                "fp32_ps_per_flop": max(0.0, statistics.median(fp32)),
                "cast_ps_per_element": max(0.0, self.per_unit(CAST)),
                "folded_ps_per_element": max(0.0, statistics.mean(folded))}

    def unfused(self) -> dict[str, float]:
        return {op: self.per_unit(op) for op in cost_table.UNFUSED_OPS}

    def saved_by_op(self) -> dict[str, float]:
        """What each kind of matrix op saves per FLOP (``[rates.saved_ps_per_flop_by_op]``):
        Conv2D the mean of its 1x1 and 3x3 rows, the depthwise convolution and MatMul their
        own row."""
        return {"Conv2D": statistics.mean(self.per_unit(n) for n in ("Conv2D 1x1", "Conv2D 3x3")),
                "DepthwiseConv2dNative": self.per_unit("DepthwiseConv2dNative 3x3"),
                "MatMul": self.per_unit("MatMul")}

    def table_text(self) -> str:
        """The cost table of this CPU (:func:`amp_rewrite.rules.cost_table.format_table`)."""
        measured = {"cpu": hardware.describe(), "tensorflow": tf.__version__,
                    "key": cost_table.machine_key(), "cores": os.cpu_count() or 1,
                    "rounds": self.rounds, "shape": "x".join(map(str, self.shape)),
                    "quick": self.quick, "date": datetime.date.today().isoformat(),
                    "source": "amp-rewrite costs measure"}
        return cost_table.format_table(self.rates(), self.unfused(), measured,
                                       self.saved_by_op())


def measure(*, quick: bool = False, rounds: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> Measurement:
    """Time every op of :func:`matrix_ops` and :func:`elementwise_ops` on this CPU (``quick``:
    a small tensor and 3 rounds); ``progress(done, total)`` after each op."""
    shape = QUICK_SHAPE if quick else SHAPE
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    found = Measurement(shape, rounds, quick)
    matrix, elementwise = matrix_ops(shape), elementwise_ops(shape)
    total = len(matrix) + len(elementwise)
    for name, (fn, flops) in matrix.items():
        found.matrix[name] = (time_op(fn, rounds, shape), flops)
        if progress:
            progress(len(found.matrix), total)
    for name, fn in elementwise.items():
        found.elementwise[name] = time_op(fn, rounds, shape)
        if progress:
            progress(len(found.matrix) + len(found.elementwise), total)
    return found


def format_table(table: cost_table.CostTable) -> str:
    """What ``amp-rewrite costs show`` prints: which table a conversion here weighs with, this
    machine's key and where measured tables are kept, and the rates."""
    lines = [f"cost table: {table.summary()}",
             f"this machine: {cost_table.machine_key()}",
             f"measured tables: {cost_table.costs_dir()} (${cost_table.DIR_VARIABLE}); this "
             f"machine's: {cost_table.measured_path().name}"]
    for name, (unit, what) in cost_table.RATES.items():
        lines.append(f"  {name} = {getattr(table, name):g} ({unit}: {what})")
    lines.append(f"  {cost_table.UNFUSED} (ps per element an unfused activation loses): "
                 + ", ".join(f"{op} {v:g}" for op, v in table.unfused_ps_per_element.items()))
    return "\n".join(lines)
