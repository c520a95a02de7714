"""After the list-driven steps: low-precision islands too small to pay for their casts go back.

An island is a connected group of painted items (joined where data flows between them). Its
worth is its biggest matrix op's intensity (FLOPs per element it moves, from its weight's
shape: :func:`amp_rewrite.paint.costs.matrix_intensity`): where that is known for every matrix op of
the island and under ``min_intensity``, the island's casts and 16-bit elementwise ops cost more
than its matrix work saves, and the whole island stays float32 (code ``cost``). An island with
one big matrix op keeps its small ones too: inside it they need no casts. Measured on a CPU
(BENCHMARKS.md "Small matrix ops", "Training step"); off (0) by default elsewhere.

bfloat16 on a CPU also weighs each island that passes as a whole
(:func:`amp_rewrite.paint.costs.runtime_estimate`): where its activations that TensorFlow runs unfused
in slow bfloat16 loops, and the casts of the weights its matrix ops read from variables (on
every run), lose more time than its matrix ops save, it stays float32 (code ``cost``). Only
islands holding such an activation or such a weight are weighed, so shapes are worked out for
those alone.
"""

from __future__ import annotations

import math

from ..core import hardware
from ..core.ops import MATRIX_OPS
from .costs import (
    FOLDING_FUSES,
    Estimate,
    frozen_estimate,
    matrix_intensity,
    reads_variables,
    runtime_estimate,
)
from .decisions import Decision
from .state import PaintState


def drop_cheap_islands(s: PaintState) -> None:
    """Put back in float32 the islands under ``s.min_intensity``; an infinite one (--cost-aware
    on a CPU with no 16-bit matrix unit) puts back every island. Overrides come after: a
    ``force_lowp`` lifts the ``cost`` code."""
    if s.min_intensity <= 0:
        return
    weigh = (s.tname, s.device) == ("bfloat16", "CPU")
    no_unit = math.isinf(s.min_intensity)
    if no_unit:
        text = (f"--cost-aware: this CPU ({hardware.describe()}) has no {s.tname} matrix unit, "
                f"so {s.tname} would run slower than float32 here")
    elif weigh and s.costs.saves_nothing():
        # a CPU class without a bfloat16 matrix unit: no island's matrix work saves anything,
        # whatever its shapes (those the estimate could not weigh included)
        no_unit = True
        text = (f"bfloat16 matrix work saves nothing on a CPU of this class (no bfloat16 matrix "
                f"unit, by {s.costs.cite()}), so the island would run slower than float32")
    if weigh and not no_unit:
        s.weighed = []
    shapes = s.shapes
    seen: set[int] = set()
    variables: bool | None = None   # whether the graph reads variables, once an island asks
    for start in sorted(s.allow):
        if start in seen:
            continue
        island = _island(s, start)
        seen |= island
        if not no_unit:
            worth = _worth(s, island)
            if worth is not None and worth < s.min_intensity:
                text = (f"in a {s.tname} island whose biggest matrix op does {worth:.0f} FLOPs "
                        f"per element it moves, under {s.min_intensity:g} "
                        "(--min-matrix-intensity): its casts and 16-bit neighbours would cost "
                        "more than its matrix work saves")
            else:
                if not weigh:
                    continue
                names = {s.items[i][0] for i in island}
                est = runtime_estimate(s.graph, shapes, names, s.batch, s.costs)
                s.weighed.append((names, est))
                matrix = sum(s.nodes[n].op in MATRIX_OPS for n in names)
                # freezing could change it; a per-row estimate (no variable cast: shapes.ROWS)
                # has no samples to add to the others'
                if est is not None and (est.weights or est.slow) and not est.per_row:
                    if variables is None:
                        variables = reads_variables(s.graph)
                    if variables:
                        _weigh_freezing(s, shapes, names, est, matrix)
                if est is None or not est.slower:
                    continue
                text = f"in a {s.tname} island {est.describe(s.tname)}"
                if FOLDING_FUSES & set(est.slow):   # folded batch norms could make them fusable
                    s.unfused_kept += matrix
                if est.pays_from:   # a larger batch would share the weight casts enough
                    s.batch_kept.append((matrix, est.pays_from))
        for idx in island:
            s.allow.pop(idx)
            s.blocked[idx] = Decision(False, "cost", text)


def _weigh_freezing(s: PaintState, shapes, names: set[str], est: Estimate,
                    matrix: int) -> None:
    """Add the island (``matrix`` its matrix ops) to ``s.freezing``: what it would save frozen
    with --fold-constants (:func:`~amp_rewrite.paint.costs.frozen_estimate`) beside what it
    saves as it is."""
    frozen = frozen_estimate(s.graph, shapes, names, est, s.costs)
    if frozen is not None:
        s.freezing.add(est, *frozen, matrix, s.costs)


def _island(s: PaintState, start: int) -> set[int]:
    island, stack = {start}, [start]
    while stack:
        idx = stack.pop()
        for nbr in s.tg.fanin[idx] | s.tg.fanout[idx]:
            if nbr in s.allow and nbr not in island:
                island.add(nbr)
                stack.append(nbr)
    return island


def _worth(s: PaintState, island: set[int]) -> float | None:
    """The largest intensity of the island's matrix ops; None if one of them is unknown (or
    it has none: it was painted for another reason, an override say)."""
    best = None
    for name in {s.items[i][0] for i in island}:
        node = s.nodes[name]
        if node.op not in MATRIX_OPS:
            continue
        intensity = matrix_intensity(s.graph, node)
        if intensity is None:
            return None
        best = intensity if best is None else max(best, intensity)
    return best
