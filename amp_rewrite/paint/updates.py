"""Step 0b of painting: in a graph or function body that trains, the update stays float32
(code ``update``).

The update region (:func:`~amp_rewrite.schema.backprop.update_region`) is what lies outside
the backward pass, is computed from the gradients and leads to a variable write, whatever wrote
it: a hand-written AdamW (moments, bias corrections, warmup, decoupled weight decay), Keras'
optimizers, TF1's, clipping, raw ``ResourceApply*``; and what only it reads (a learning-rate
schedule, ``1 - beta ** t``). In 16 bits an update loses what it exists to keep: float16's
``(1 - beta2) * g * g`` rounds small gradients to zero, and bfloat16's 8-bit mantissa drops
most of a small step added to a weight. So every such item is blocked before anything is
painted, for every target; the gradients themselves are computed where painting puts them (a
gradient MatMul in float16) and cast to float32 where they leave the backward pass, which is
where loss scaling unscales them (docs/training.md "Updates in float32").

Only what painting could otherwise take is blocked: items of allow, infer and clear ops (every
op at level ``unsafe_force_all``). Deny ops, ops on no list and items already fixed (variables,
the interface, ``--keep``) keep their own codes. A ``force_lowp`` override cannot lift it
(:mod:`.overrides`): the lint holds every converted graph to it.
"""

from __future__ import annotations

from ..schema.backprop import update_region
from .decisions import Decision
from .state import PaintState

_COMPUTED = Decision(False, "update", "update: computed from the gradients and written to a "
                     "variable, so it runs in float32 (the gradients are unscaled in float32; "
                     "16-bit moments and steps round small gradients away)")
_READ = Decision(False, "update", "read by the update only (a learning-rate schedule, a bias "
                 "correction): runs in float32 with it")


def block_updates(s: PaintState) -> None:
    """Block, with code ``update``, the items painting could take of the update region's
    nodes."""
    region = update_region(s.graph)
    if not region:
        return
    force_all = s.rules.level == "unsafe_force_all"
    for idx, (name, _) in enumerate(s.items):
        if idx in s.blocked or name not in region:
            continue
        if force_all or s.cat[idx] in ("allow", "infer", "clear"):
            s.blocked[idx] = _COMPUTED if name in region.computed else _READ
