"""What painting decides: a :class:`Decision` per (node, type attribute), with its reason.

Every decision is recorded at the moment it is made; the report and ``explain`` read these and
never recompute them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schema.opdefs import TypeAttr

TNode = tuple[str, TypeAttr]

#: decision codes that mean "runs in the target dtype" (docs/report.md "Report schema")
LOWP_CODES = ("allow_list", "between_allow", "follows_allow", "clear_spread", "user_force",
              "cast_retargeted", "const_converted", "variable_stored", "lowp_io",
              "tensorlist_match", "retyped")


@dataclass(frozen=True)
class Decision:
    """Why one (node, type attribute) ended where it did.

    ``code`` is stable and machine-readable (documented in docs/report.md "Report schema"); ``text``
    is the sentence ``explain`` prints; ``via`` names the nodes of the chain that forced it,
    from the root cause to the nearest neighbour.
    """

    lowp: bool
    code: str
    text: str
    via: tuple[str, ...] = ()


@dataclass
class Painting:
    """The result of painting: which type attributes go low precision, and why each did."""

    target: int
    device: str
    decisions: dict[TNode, Decision] = field(default_factory=dict)
    node_codes: dict[str, Decision] = field(default_factory=dict)  # nodes with no type attrs
    warnings: list[str] = field(default_factory=list)
    unfused_kept: int = 0   # matrix ops kept float32 for activations folding could fuse
    # (matrix ops, least batch that would pay) of islands kept float32 for weight casts
    batch_kept: list[tuple[int, int]] = field(default_factory=list)
    freezing: dict = field(default_factory=dict)   # costs.FreezeGain.to_dict(), if weighed
    # each matrix op's FLOPs from the graph's shapes (costs.matrix_flops; None: not known)
    flops: dict[str, int | None] = field(default_factory=dict)
    estimate: dict = field(default_factory=dict)   # costs.graph_estimate(), if the model weighed
    _index: dict[str, list[TNode]] = field(default_factory=dict, repr=False, compare=False)
    _indexed: int = field(default=-1, repr=False, compare=False)

    @property
    def lowp(self) -> set[TNode]:
        return {t for t, d in self.decisions.items() if d.lowp}

    def node_decision(self, name: str) -> Decision | None:
        """One decision for the whole node: its first low-precision attr, else its float32 one."""
        mine = [self.decisions[t] for t in self._attrs_of(name)]
        for d in mine:
            if d.lowp:
                return d
        if name in self.node_codes:
            return self.node_codes[name]
        # an index type (StridedSlice's Index, GatherV2's Taxis) says nothing about the node
        floats = [d for d in mine if d.code != "not_float32"]
        return (floats or mine or [None])[0]

    def _attrs_of(self, name: str) -> list[TNode]:
        # The report asks once per node: index the keys by node instead of scanning them all
        # each time (quadratic on large graphs). Rebuilt when passes add decisions.
        if self._indexed != len(self.decisions):
            self._index = {}
            for key in sorted(self.decisions):
                self._index.setdefault(key[0], []).append(key)
            self._indexed = len(self.decisions)
        return self._index.get(name, [])
