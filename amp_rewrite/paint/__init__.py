"""Painting: decide, per (node, type attribute), whether it runs in low precision, and why.

The baseline is grappler's ``auto_mixed_precision`` pass (docs/decisions.md "How we decide"). The steps,
in the order :func:`paint` runs them, each in its own module:

0. :mod:`.state`: variables, non-float32 types, ``keep_fp32`` overrides and the graph's
   interface are blocked;
0b. :mod:`.updates`: in a graph that trains, the update (from the gradients to the variable
   writes) is blocked (code ``update``);
0c. :mod:`.calibrated`: with calibration, nodes whose values come within the headroom of the
   target's largest value are blocked (code ``range``);
1-5. :mod:`.propagation`: allow ops, deny propagation, infer/clear ops between allow ops,
   infer ops after allow ops (rule ``infer_follows_allow``), allow spreading through clear ops;
5b. :mod:`.islands`: a painted island whose matrix ops are all too small to pay for its casts
   goes back to float32 (``min_intensity``, bfloat16 on a CPU);
6. :mod:`.overrides`: ``force_lowp`` overrides;
7. :mod:`.agreement`: v1 loop back edges and TensorList clusters agree on one dtype;
8. :mod:`.feeders`: Casts, Consts (and with ``lowp_io`` Placeholders) that only feed low
   precision follow it;
9. :mod:`.reasons`: every item gets its :class:`Decision`, the undecided ones the reason they
   stayed float32.

The graph is not changed: :mod:`amp_rewrite.transforms.casts` applies the result.
:func:`paint_float32` is the painting of ``--target float32``: nothing goes to 16 bits.
"""

from __future__ import annotations

from typing import Mapping

from ..core.dtypes import FLOAT, HEADROOM
from ..core.ir import Graph
from ..rules.cost_table import CostTable
from ..rules.loader import RuleSet
from .agreement import agree_loops, agree_tensorlists
from .calibrated import block_ranges
from .decisions import LOWP_CODES, Decision, Painting, TNode
from .feeders import paint_feeders
from .islands import drop_cheap_islands
from .overrides import force_overrides
from .propagation import (
    paint_between_allow,
    paint_infer_after_allow,
    propagate_deny,
    seed_allow,
    spread_through_clear,
)
from .reasons import record
from .state import PaintState, interface_names
from .updates import block_updates

__all__ = ["Decision", "LOWP_CODES", "Painting", "TNode", "interface_names", "paint",
           "paint_float32"]


def paint(graph: Graph, rules: RuleSet, *, target: int, device: str = "GPU",
          keep: Mapping[str, tuple[str, str]] | None = None, lowp_io: bool = False,
          min_intensity: float = 0.0, ranges: Mapping[str, float] | None = None,
          headroom: float = HEADROOM, input_shapes: Mapping[str, tuple[int, ...]] | None = None,
          batch: int | None = None, costs: CostTable | None = None) -> Painting:
    """Decide the precision of every (node, type attribute) of ``graph``; the graph is not changed.

    ``keep`` maps the names of nodes whose dtypes must not change to ``(code, reason)``, the
    decision they get (``user_keep`` for ``--keep``, ``interface`` for signature tensors ...).
    A painted island whose matrix ops all have a known intensity
    (:func:`~amp_rewrite.paint.costs.matrix_intensity`) under ``min_intensity`` stays float32 (code
    ``cost``). ``ranges`` maps tensor names (``node:port``) to the largest magnitude calibration
    observed: a node that computes or reads one within ``headroom`` of the target's largest
    value stays float32 (code ``range``, :mod:`.calibrated`). ``input_shapes`` (placeholder
    name -> shape) and ``batch`` (what an open first dimension stands for) are what the model
    runs at, for the cost model's estimate (bfloat16 on a CPU, :mod:`.islands`), and ``costs``
    its rates (None: the shipped table, :mod:`amp_rewrite.rules.cost_table`). In a graph
    that trains, the update stays float32 (code ``update``, :mod:`.updates`).
    """
    s = PaintState(graph, rules, target=target, device=device, keep=dict(keep or {}),
                   lowp_io=lowp_io, min_intensity=min_intensity, input_shapes=input_shapes,
                   batch=batch, costs=costs)
    s.block_fixed()
    block_updates(s)
    block_ranges(s, ranges or {}, headroom)
    seed_allow(s)
    propagate_deny(s)
    paint_between_allow(s)
    if rules.infer_follows_allow:
        paint_infer_after_allow(s)
    spread_through_clear(s)
    drop_cheap_islands(s)
    force_overrides(s)
    agree_loops(s)
    agree_tensorlists(s)
    paint_feeders(s)
    return record(s)


def paint_float32(graph: Graph, rules: RuleSet, *, device: str = "GPU",
                  keep: Mapping[str, tuple[str, str]] | None = None) -> Painting:
    """The painting of ``--target float32``: no (node, type attribute) goes to 16 bits. What
    holds state, the interface, the ``keep`` names and types that are not float32 say why as
    in :func:`paint`; every other float32 item gets code ``target_float32``. (A model that
    computed in 16 bits was widened before: :mod:`amp_rewrite.transforms.widen`.)"""
    s = PaintState(graph, rules, target=FLOAT, device=device, keep=dict(keep or {}),
                   lowp_io=False)
    s.block_fixed(by_device=False)
    for idx in range(len(s.items)):
        s.blocked.setdefault(idx, Decision(False, "target_float32", "the target is float32"))
    return record(s)
