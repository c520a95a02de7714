"""The parts of a graph that trains, read from its structure: the backward pass and the update.

A graph (or a function body) trains when it computes gradients, under a backprop name scope
(``gradients/`` of ``tf.gradients``, ``gradient_tape/`` of a ``GradientTape``), and writes
variables. Its **update region** is what lies between the two: the nodes outside the backward
pass that are computed from the gradients and lead to a variable write (momentum and Adam's
moments, bias corrections applied to them, weight decay, clipping, the all-reduce point, the
update itself), and what only they read (a learning-rate schedule, ``1 - beta ** t``). Painting
keeps that region float32 (``paint.updates``, decision code ``update``), so the update reads the
gradients in float32, as loss scaling unscales them; the lint holds a converted graph to it
(``check.lint``: no path from a gradient to a write through a 16-bit tensor).

A write here is a variable write (:func:`~amp_rewrite.schema.opdefs.is_variable_write`), or a
functional op that reads a resource handle: loss scaling turns each write of a TF2 train step
into an ``If`` on its finiteness check whose branch writes.

Everything here only reads the graph; nothing raises. ``training.detect`` builds the loss
scaling's finer detection (seeds, hints, all-reduces) on the scope defined here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.dtypes import RESOURCE
from ..core.ir import Graph, Node, TensorRef
from ..core.ops import FUNCTIONAL_OPS
from .opdefs import input_dtype, is_variable_write

_BACKPROP_SCOPE = re.compile(r"(?:^|/)(?:gradients(?:_\d+)?|gradient_tape)/")


def backprop_scope(name: str) -> str | None:
    """The backprop name scope ``name`` lies in (``"gradients/"``, ``"x/gradient_tape/"``), or None."""
    match = None
    for match in _BACKPROP_SCOPE.finditer(name):
        pass
    return name[:match.end()] if match else None


def trains(nodes) -> bool:
    """Whether ``nodes`` (the NodeDefs of a graph or of a function body) compute gradients (a
    node under a backprop scope) and write variables."""
    nodes = list(nodes)
    return any(backprop_scope(n.name) for n in nodes) and any(is_variable_write(n.op) for n in nodes)


def writes(graph: Graph, node: Node) -> bool:
    """Whether ``node`` writes a variable: a write op, or a functional op that reads a resource
    handle (a gated write of a loss-scaled step, a call or branch that writes)."""
    if is_variable_write(node.op):
        return True
    return node.op in FUNCTIONAL_OPS and any(
        input_dtype(node, port) == RESOURCE for port in range(len(graph.inputs(node.name))))


@dataclass(frozen=True)
class UpdateRegion:
    """The update region of one graph (see the module doc); empty when it does not train."""

    #: outside the backward pass, computed from the gradients, leading to a write
    computed: frozenset[str] = frozenset()
    #: what only the update reads (not the forward or backward pass): schedules, corrections
    read: frozenset[str] = frozenset()
    #: the backward pass: the backprop scopes and what lies between their nodes
    backward: frozenset[str] = frozenset()
    #: the tensors leaving the backward pass that the update reads (the gradients)
    gradients: tuple[TensorRef, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.computed)

    def __contains__(self, name: str) -> bool:
        return name in self.computed or name in self.read


def update_region(graph: Graph) -> UpdateRegion:
    """The update region of ``graph`` (data edges only).

    The backward pass is every node under a backprop scope and what lies between such nodes (a
    tape sums a gradient's terms with an ``AddN`` outside its scope and reads the sum again; a
    gradient penalty differentiates what another gradient computed; a forward loop reads its
    gradient's accumulators and is read by them): none of it is the update. The region is
    what the backward pass computes that feeds a write, and the side computations that feed
    only it. Worked out once per version of the graph (:meth:`Graph.memo`): painting and the
    lint of an unedited graph share it."""
    return graph.memo(update_region, _update_region)


def _update_region(graph: Graph) -> UpdateRegion:
    names = graph.names()
    # backprop_scope's test, its pattern looked for only in names that can hold it
    scoped = [n for n in names if "gradient" in n and _BACKPROP_SCOPE.search(n)]
    if not scoped:
        return UpdateRegion()
    sinks = [node.name for node in graph.nodes() if writes(graph, node)]
    if not sinks:
        return UpdateRegion()
    after = graph.descendants(scoped)
    upstream = graph.ancestors(scoped, control=False)
    backward = set(scoped) | (after & upstream)
    # A path from a node after the backward pass but not in it to a write stays outside it (a
    # node on it that reached the backward pass would put the start in it too), so the walk up
    # from the writes goes through those nodes only, not through the whole graph.
    outside = after - backward
    computed = graph.ancestors([s for s in sinks if s in outside], control=False,
                               past=lambda node: node.name in outside) & outside
    if not computed:
        return UpdateRegion()
    # nor does what only the update reads lie behind the forward or backward pass: the walk
    # up from the update stops at them
    read = graph.ancestors(computed, control=False, past=lambda node: node.name not in upstream) \
        - upstream - computed
    gradients = dict.fromkeys(ref for name in names if name in computed
                              for ref in graph.inputs(name) if ref.node in backward)
    return UpdateRegion(frozenset(computed), frozenset(read), frozenset(backward),
                        tuple(gradients))
