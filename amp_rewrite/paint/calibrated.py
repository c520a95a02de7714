"""Step 0c of painting: nodes whose values come near the 16-bit dtype's largest value on the
calibration data stay float32 (code ``range``).

Calibration (``--calibration``, :func:`amp_rewrite.tools.ranges.calibrate`) ran the float32
model and recorded each float tensor's largest finite magnitude. A node that produces or reads
a tensor within ``headroom`` of the target's largest value
(:func:`~amp_rewrite.core.dtypes.near_limit`: ``max |x| >= 65504 / headroom`` in float16) is
blocked before anything is painted, as a ``keep_fp32`` override blocks it: no later step paints
it (a ``force_lowp`` override lifts it: the data was a sample, the override is the user's word),
and its neighbours are painted by the usual rules, with casts between. So a large tensor is
computed, and read, in float32 only.

Only what painting could otherwise take is blocked: items of allow, infer and clear ops (every
op at level ``unsafe_force_all``). Deny ops and ops on no list stay float32 with their own
codes, and items already fixed (the interface, variables, ``--keep``) keep theirs. Tensors the
calibration did not record (inside a v1 loop, say) decide nothing.
"""

from __future__ import annotations

from typing import Mapping

from ..core.dtypes import LARGEST, near_limit
from .decisions import Decision
from .state import PaintState


def block_ranges(s: PaintState, ranges: Mapping[str, float], headroom: float) -> None:
    """Block, with code ``range``, every float32 item painting could take of a node whose
    inputs or outputs reach ``LARGEST[target] / headroom`` in ``ranges`` (tensor name
    ``node:port`` -> largest finite magnitude observed)."""
    if not ranges:
        return
    produced: dict[str, tuple[float, str]] = {}
    for tensor, value in ranges.items():
        node = tensor.rpartition(":")[0]
        if node in s.nodes and value > produced.get(node, (-1.0, ""))[0]:
            produced[node] = (value, tensor)
    force_all = s.rules.level == "unsafe_force_all"
    found: dict[str, Decision | None] = {}
    for idx, (name, _) in enumerate(s.items):
        if idx in s.blocked or not (force_all or s.cat[idx] in ("allow", "infer", "clear")):
            continue
        if name not in found:
            found[name] = _decision(s, name, produced, ranges, headroom)
        if found[name] is not None:
            s.blocked[idx] = found[name]


def _decision(s: PaintState, name: str, produced, ranges, headroom) -> Decision | None:
    """The ``range`` decision for node ``name``, naming its largest tensor, or None."""
    largest, tensor, role = -1.0, "", ""
    if name in produced:
        largest, tensor = produced[name]
        role = "output"
    for ref in s.graph.inputs(name):
        key = f"{ref.node}:{ref.port}"
        if ranges.get(key, -1.0) > largest:
            largest, tensor, role = ranges[key], key, "input"
    if not tensor or not near_limit(largest, s.target, headroom):
        return None
    top = LARGEST[s.target]
    return Decision(False, "range", f"calibration: its {role} `{tensor}` reached max |x| "
                    f"{largest:.4g}, within the headroom {headroom:g} of {s.tname}'s largest "
                    f"value {top:.6g} (limit {top / headroom:.4g})")
