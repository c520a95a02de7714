"""Find the backward pass of a training graph: the backprop seeds, the gradients, the updates.

A TF1 training graph built with ``tf.gradients`` (``optimizer.minimize``) starts backprop at
a ``Fill`` of ones under a ``gradients/`` name scope (``gradients/grad_ys_0`` or
``gradients/Fill``); one built with ``tf.GradientTape`` starts at a Const of ones read only by
nodes under ``gradient_tape/``. The gradients are the float tensors that leave that scope
(moved past an all-reduce that reads them, so every replica checks the same values); the
updates are the variable writes (Apply*, ResourceApply*, the sparse ones, Assign*, the
Scatter* ops that write a variable; :func:`~amp_rewrite.schema.opdefs.is_variable_write`)
that read them.

Everything here only reads the graph. The backprop scope and what counts as training are
:mod:`amp_rewrite.schema.backprop`'s (painting and the lint ask there too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.dtypes import CONVERTIBLE
from ..core.errors import UnsupportedGraphError
from ..core.ir import Graph, TensorRef
from ..core.ops import ALL_REDUCE_OPS
from ..schema.backprop import backprop_scope, trains
from ..schema.consts import is_all_ones
from ..schema.opdefs import is_variable_write, output_dtype

_SEED_LEAF = re.compile(r"^(?:Fill|grad_ys_\d+)$")


def training_functions(library, names=None) -> list[str]:
    """The functions of ``library`` (a FunctionDefLibrary; only those in ``names``, where given)
    whose bodies train, in library order."""
    wanted = None if names is None else set(names)
    return [f.signature.name for f in library.function
            if (wanted is None or f.signature.name in wanted) and trains(f.node_def)]


def training_parts(graph_def) -> list[str]:
    """What in ``graph_def`` trains: ``"the graph"`` and/or ``"function 'name'"`` for each
    library function that does."""
    return ((["the graph"] if trains(graph_def.node) else [])
            + [f"function {name!r}" for name in training_functions(graph_def.library)])


@dataclass
class Backprop:
    """What :func:`find_backprop` found; names only, in graph order."""

    seeds: list[str]
    gradients: list[TensorRef]          # the gradient tensors to unscale (after any all-reduce)
    updates: list[str]                  # variable writes that read the gradients
    all_reduced: int = 0                # gradients taken after an all-reduce
    notes: list[str] = field(default_factory=list)


def _auto_seeds(graph: Graph) -> list[str]:
    seeds = []
    for node in graph.nodes():
        scope = backprop_scope(node.name)
        if node.op == "Fill" and scope is not None:
            leaf = node.name[len(scope):]
            if _SEED_LEAF.match(leaf) and is_all_ones(graph.node(graph.input(node.name, 1).node)):
                seeds.append(node.name)
        elif node.op == "Const" and scope is None:
            readers = graph.consumers(node.name)
            if readers and all(backprop_scope(r) and "gradient_tape/" in backprop_scope(r)
                               for r, _ in readers) and is_all_ones(node):
                seeds.append(node.name)
    return seeds


def _loss_seeds(graph: Graph, seeds: list[str], loss: str) -> list[str]:
    """The seeds that start backprop at ``loss``.

    A seed matches when it is ``Fill(Shape(loss), 1)``, or when it feeds the gradient of the
    loss op itself (``gradients/<loss>_grad/...``); a scalar loss's shape is a Const, so the
    second test is the one that usually decides. Identity ops at the end of the loss are looked
    through (their gradient makes no node). A GradientTape names its gradient nodes by op type,
    not by op name, so its seed is named with ``--grad`` instead.
    """
    want = TensorRef.parse(loss)
    if want.node not in graph:
        raise UnsupportedGraphError(f"--loss names no node {loss!r}")
    names = [want.node]
    while graph.node(names[-1]).op == "Identity":
        names.append(graph.input(names[-1], 0).node)
    picked = []
    for seed in seeds:
        scope = backprop_scope(seed) or _reader_scope(graph, seed) or ""
        prefixes = tuple(f"{scope}{n}_grad/" for n in names)
        dims = graph.node(graph.input(seed, 0).node) if graph.node(seed).op == "Fill" else None
        if (dims is not None and dims.op == "Shape" and graph.input(dims.name, 0) == want) or \
                any(r.startswith(prefixes) for r, _ in graph.consumers(seed)):
            picked.append(seed)
    if not picked:
        raise UnsupportedGraphError(
            f"no backprop seed reads the shape of loss {loss!r} or feeds its gradient (seeds "
            f"found: {', '.join(seeds) or 'none'}); name the seed itself with --grad")
    return picked


def _past_all_reduce(graph: Graph, ref: TensorRef, counter: list[int]) -> TensorRef:
    readers = graph.consumers(ref.node, ref.port)
    if len(readers) == 1 and graph.node(readers[0][0]).op in ALL_REDUCE_OPS:
        counter[0] += 1
        return _past_all_reduce(graph, TensorRef(readers[0][0], 0), counter)
    return ref


def _gradient_tensors(graph: Graph, seeds: list[str], region: set[str]) -> tuple[list[TensorRef], int]:
    """Float tensors made in the backward pass and read outside it. The backward pass is a
    seed's backprop scope and what lies between its nodes on the seeds' side: a GradientTape
    sums a tensor's gradient contributions with an ``AddN`` outside its scope, which the scope
    reads again (a forward loop that reads the scope's accumulators computes no gradient)."""
    scopes = {backprop_scope(s) or _reader_scope(graph, s) for s in seeds}
    scopes.discard(None)
    scoped = {n for n in region if any(n.startswith(s) for s in scopes)} | set(seeds)
    inside = scoped | (graph.descendants(seeds) & graph.ancestors(scoped))
    found: list[TensorRef] = []
    counter = [0]
    for name in graph.names():
        if name not in inside:
            continue
        for port, reader, _ in graph.out_edges(name):
            ref = TensorRef(name, port)
            if reader in inside or output_dtype(graph.node(name), port) not in CONVERTIBLE:
                continue
            ref = _past_all_reduce(graph, ref, counter)
            if ref not in found:
                found.append(ref)
    return found, counter[0]


def _reader_scope(graph: Graph, seed: str) -> str | None:
    scopes = {backprop_scope(r) for r, _ in graph.consumers(seed)}
    return scopes.pop() if len(scopes) == 1 else None


def _separate_steps(update_sets: list[set[str]]) -> bool:
    """Whether the seeds' update sets fall apart into groups sharing no update."""
    if not update_sets:
        return False
    joined, rest = set(update_sets[0]), list(update_sets[1:])
    grew = True
    while grew and rest:
        grew = False
        for updates in list(rest):
            if updates & joined:
                joined |= updates
                rest.remove(updates)
                grew = True
    return bool(rest)


def find_backprop(graph: Graph, *, loss: str | None = None, grads: list[str] = ()) -> Backprop | None:
    """The backward pass of ``graph``, or None when the graph does not train.

    A graph trains when a variable write reads (through data edges) a node of a backprop
    scope or of a named seed. Raises :class:`UnsupportedGraphError` naming the missing part
    when it trains but the seed or the updates cannot be identified without doubt.
    """
    seeds = _seeds(graph, loss, grads)
    backprop_nodes = [n for n in graph.names() if backprop_scope(n)] + seeds
    trained = [n for n in sorted(graph.descendants(backprop_nodes))
               if is_variable_write(graph.node(n).op)]
    if not trained:
        if grads or loss:
            raise UnsupportedGraphError(
                "the seed given with --grad/--loss reaches no variable write (an optimizer's "
                "Apply*, an Assign*, a variable's Scatter*): nothing to loss-scale")
        return None
    if not seeds:
        raise UnsupportedGraphError(
            f"the graph trains ({len(trained)} variable updates, e.g. {trained[0]!r}) but its "
            "backprop seed is missing: no Fill of ones under a gradients/ scope and no ones "
            "read only by gradient_tape/; name the seed (the gradient fed to tf.gradients or the "
            "tape) with --grad NAME")
    region = graph.descendants(seeds)
    seeds = _one_train_step(graph, seeds, named=bool(grads or loss))
    unseeded = [n for n in trained if n not in region]
    if unseeded:
        raise UnsupportedGraphError(
            f"variable update {unseeded[0]!r} ({graph.node(unseeded[0]).op}) reads gradients that "
            f"no backprop seed found ({', '.join(seeds) or 'none'}) leads to; name every seed with --grad")
    gradients, reduced = _gradient_tensors(graph, seeds, region)
    after = graph.descendants([g.node for g in gradients])
    updates = [n for n in graph.names() if n in after and is_variable_write(graph.node(n).op)]
    if not gradients or not updates:
        raise UnsupportedGraphError(
            f"found backprop seed(s) {', '.join(seeds)} but could not tell which tensors are the "
            "gradients the updates read: no float tensor leaving the backward pass's gradients/ "
            "or gradient_tape/ scope reaches a variable write (an update made inside that scope "
            "reads them there); convert with --loss-scale none, or --target bfloat16")
    return Backprop([s for s in graph.names() if s in seeds], gradients, updates, reduced)


def _seeds(graph: Graph, loss: str | None, grads: list[str]) -> list[str]:
    """The seeds the user named with ``grads``, else those found (of ``loss``, if named)."""
    for name in grads:
        if TensorRef.parse(name).node not in graph:
            raise UnsupportedGraphError(f"--grad names no node {name!r}")
    seeds = [TensorRef.parse(g).node for g in grads] or _auto_seeds(graph)
    if loss is not None and not grads:
        seeds = _loss_seeds(graph, seeds, loss)
    return seeds


def _one_train_step(graph: Graph, seeds: list[str], named: bool) -> list[str]:
    """The seeds that reach an update; refused when they fall into separate train steps (a
    GAN's two) and the user did not name which to scale: one scale and one check would tie
    them together. Towers whose gradients meet in the same updates are one step."""
    reached = {s: {n for n in graph.descendants([s]) if is_variable_write(graph.node(n).op)}
               for s in seeds}
    seeds = [s for s in seeds if reached[s]]
    if _separate_steps([reached[s] for s in seeds]) and not named:
        raise UnsupportedGraphError(
            f"{len(seeds)} backprop seeds reach separate variable updates ({', '.join(seeds)}): "
            "name the loss to scale with --loss NAME, or every seed to scale together with --grad NAME")
    return seeds
