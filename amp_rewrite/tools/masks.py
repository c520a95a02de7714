"""Which tensors of a model are past a 16-bit range *by construction*: the one rule.

A 16-bit dtype holds a float32 value past its range as the infinity of its sign. That is
harmless only where the value is large because the model was built so, not because of the data:
a causal or padding mask of ``-1e9`` (or ``tf.float32.min``), possibly multiplied by a 0/1 mask
computed from the data, added to attention scores, which a softmax turns into the same zeros
whatever the batch. A tensor that the *data* drives past the range (scores that one batch makes
``-70000`` and the next ``+70000``) is an overflow, even where the batch at hand shows its
infinities harmless: the sign, and so the harm, depends on the data.

:func:`constant_masks` answers from what one model's trace records (:class:`TensorInfo`:
each float tensor's op and sources) and from the float32 values it held on the samples (a
mapping to :class:`~amp_rewrite.tools.ranges.TensorRange`, read for ``max_abs``, ``binary``,
``values`` and ``nonzero``). It is the rule ``verify --per-node``, ``tune``'s range margin and
``tune``'s acceptance of a trial share (docs/verify.md "Infinities inside the model"). A tensor
is a *constant mask* when

* it is a constant past the range (a ``Const``, or a ``Fill``/broadcast/reshape of one), or
* an op that carries magnitudes through unchanged (Identity, Reshape, Cast, Neg, Transpose,
  a broadcast, a slice or gather ...) or that joins them with others without scaling them
  (Add, Sub, BiasAdd, Select, Minimum, Maximum, Concat, Pack) has a constant mask among its
  float inputs, or
* a ``Mul`` has exactly one constant mask among its float inputs and every other one is a 0/1
  mask: all its values 0 or 1 on the samples *and* 0/1 by construction (a cast of a boolean or
  integer tensor, a constant, ``1 - mask``, a product, minimum, maximum, band part, reshape or
  selection of 0/1 masks). The sign and magnitude of the product are then the constant's.

Everything else past the range is data's doing. The rule looks only at float tensors the trace
recorded; an input it did not record (an integer or boolean tensor) counts as data, except as
the source of a cast, which a 0/1 mask may be.
"""

from __future__ import annotations

from typing import Mapping

from ..core.ir import postorder
from .traces import TensorInfo

# ops whose output holds the values of their float input(s), moved, repeated or re-typed
_CARRY = frozenset({
    "Identity", "IdentityN", "StopGradient", "Snapshot", "Reshape", "ExpandDims", "Squeeze",
    "Transpose", "Tile", "BroadcastTo", "Cast", "Neg", "Fill", "Slice", "StridedSlice",
    "GatherV2", "Gather", "GatherNd", "ConcatV2", "Concat", "Pack", "MatrixBandPart",
    "PreventGradient", "EnsureShape",
})
# ops that join a mask with other values without scaling it: the mask's magnitude survives
_JOIN = frozenset({"Add", "AddV2", "Sub", "BiasAdd", "AddN", "Select", "SelectV2", "Minimum",
                   "Maximum"})
# ops that keep 0/1 values 0/1 when every float input is a 0/1 mask
_BINARY_CLOSED = _CARRY - {"Neg", "Fill"} | {"Mul", "Minimum", "Maximum", "Select", "SelectV2"}
_CONSTANT = frozenset({"Const", "Fill", "OnesLike", "ZerosLike"})


class _Rule:
    """The three facts of the module docstring, per tensor, each decided from its float
    inputs' facts: :meth:`decide` takes the tensors in :func:`~amp_rewrite.core.ir.postorder`
    (inputs first, no recursion); an input not yet decided (a loop's back edge) counts False,
    as a cycle proves nothing."""

    def __init__(self, info: Mapping[str, TensorInfo], ranges: Mapping, limit: float):
        self.info, self.ranges, self.limit = info, ranges, limit
        self.is_constant: dict[str, bool] = {}
        self.is_binary: dict[str, bool] = {}
        self.is_mask: dict[str, bool] = {}

    def floats(self, name: str) -> list[str]:
        """The float tensors ``name`` is computed from that the trace recorded (none for a
        tensor it did not record)."""
        if name not in self.info or name not in self.ranges:
            return []
        return sorted(s for s in self.info[name].sources
                      if s in self.info and s in self.ranges)

    def decide(self, names) -> None:
        """The facts of ``names`` and of every tensor they are computed from."""
        for name in postorder(names, self.floats):
            if name in self.info and name in self.ranges:
                floats = self.floats(name)
                self.is_constant[name] = self._constant(name, floats)
                self.is_binary[name] = self._binary(name, floats)
                self.is_mask[name] = self._mask(name, floats)

    def _constant(self, name: str, floats: list[str]) -> bool:
        """Computed from constants alone, as far as its float inputs go."""
        op = self.info[name].op
        if op == "Const":
            return True
        return op in _CARRY | _JOIN | {"Mul"} and bool(floats) and all(
            self.is_constant.get(f, False) for f in floats)

    def _binary(self, name: str, floats: list[str]) -> bool:
        """A 0/1 mask: every value 0 or 1 on the samples, and 0/1 by construction."""
        if not self.ranges[name].binary:
            return False
        op = self.info[name].op
        if op in _CONSTANT or (op == "Cast" and not floats):
            return True
        binary = [self.is_binary.get(f, False) for f in floats]
        if op == "Sub":     # 1 - mask
            return len(floats) == 2 and any(self._ones(f) for f in floats) and all(binary)
        return op in _BINARY_CLOSED and bool(floats) and all(binary)

    def _ones(self, name: str) -> bool:
        r = self.ranges[name]
        return self.is_constant.get(name, False) and r.binary and r.nonzero == r.values

    def _mask(self, name: str, floats: list[str]) -> bool:
        op = self.info[name].op
        if self.is_constant[name]:   # -inf itself, or a finite value past the range
            return self.ranges[name].max_abs > self.limit or bool(self.ranges[name].infinite)
        masks = [f for f in floats if self.is_mask.get(f, False)]
        if op in _CARRY | _JOIN:
            return bool(masks)
        if op == "Mul":
            return len(masks) == 1 and all(self.is_binary.get(f, False)
                                           for f in floats if f != masks[0])
        return False


def constant_masks(info: Mapping[str, TensorInfo], ranges: Mapping, limit: float,
                   names=None) -> set[str]:
    """Of ``names`` (default: every tensor ``ranges`` holds), those whose magnitude past
    ``limit`` (a 16-bit dtype's largest finite value) comes from a constant, not from the data
    (module docstring). ``info``: the float32 model's trace; ``ranges``: tensor name -> its
    :class:`~amp_rewrite.tools.ranges.TensorRange` over the samples. Linear in the tensors
    they are computed from, and without recursion (a chain of 100,000 tensors answers in
    about a second)."""
    wanted = list(ranges if names is None else names)
    rule = _Rule(info, ranges, limit)
    rule.decide(wanted)
    return {n for n in wanted if rule.is_mask.get(n, False)}


__all__ = ["constant_masks"]
