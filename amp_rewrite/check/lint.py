"""The lint every converted graph and function must pass before anything is written.

A failure here is an amp-rewrite bug, never the user's: the CLI reports it as an internal
error (exit 70) and writes nothing. The same checks on an input (:mod:`.input`) are the user's.
"""

from __future__ import annotations

from typing import Collection

from ..core.dtypes import INVALID, LOW_PRECISION, dtype_name
from ..core.errors import LintError
from ..core.ir import Graph
from ..core.ops import NEXT_ITERATION_OPS, VARIABLE_OPS
from ..rules.loader import RuleSet
from ..schema.backprop import update_region
from ..schema.opdefs import (
    TypeAttr,
    allowed_by_opdef,
    edge_dtype,
    get_dtype,
    input_dtype,
    node_types,
    output_dtype,
    tensorlist_groups,
)
from ..schema.snapshot import Before

_ELEMENT_DTYPE = TypeAttr("element_dtype")


def lint_problems(graph: Graph, *, original: Before | None = None,
                  rules: RuleSet | None = None, only: Collection[str] | None = None,
                  imported: bool = False) -> list[str]:
    """Every problem found, as one sentence each naming the node; empty when the graph is sound.

    Checks: node names are unique and every input names an existing node (the IR refuses both,
    so they are checked on the exported GraphDef); each data edge's producer dtype equals what
    the consumer's OpDef expects; every type attribute holds a dtype its OpDef allows; no
    deny-list op runs in low precision (unless a user override forced it); variable ops keep
    their dtypes; an op TensorFlow does not register sees the dtypes it saw before; no node the
    conversion added sits on a v1 loop's back edge; the TensorList ops of one list (whose
    handles meet) that held one element dtype still hold one (a list with float32 and float16
    ops fails only when it runs); in a graph that trains, no path from a gradient to a variable
    write goes through a 16-bit tensor the conversion made (the update reads the gradients,
    unscaled, in float32: docs/training.md "Updates in float32"). Those last six compare with
    ``original``, the record of the graph before the conversion.

    ``only`` limits the checks to those nodes and the edges into them: a pass that knows what
    it changed (and the readers of what it retyped) need not lint what ``original`` already
    passed. ``imported``: the graph is as :meth:`Graph.from_graph_def` built it, which refused
    repeated names and dangling inputs already, so the names are not checked again.
    """
    names = graph.names() if only is None else [n for n in graph.names() if n in only]
    problems = [] if imported else _name_problems(graph, names)
    if original is not None and original.unregistered_ops:   # a conversion adds none
        problems += _unknown_op_edges(graph, original, names)
    for node in (graph.node(n) for n in names):
        types = node_types(node)
        if types is None:
            continue
        problems += _edge_problems(graph, node, types)
        problems += _attr_problems(node, types)
        if rules is not None:
            problems += _deny_problems(node, types, rules, original)
        if original is not None and node.op in VARIABLE_OPS and node.name in original:
            problems += _variable_problems(node, types, original)
        if original is not None and node.name not in original:
            problems += _back_edge_problems(graph, node)
    if original is not None:
        problems += _tensorlist_problems(graph, original, names)
        problems += _update_problems(graph, original, names)
    return problems


def _update_problems(graph: Graph, original: Before, names: list[str]) -> list[str]:
    """The edges of the update region (:func:`~amp_rewrite.schema.backprop.update_region`)
    into ``names``, on a path from a gradient leaving the backward pass to a variable write,
    that carry a 16-bit dtype their producer did not have before the conversion: an unscaled
    gradient cast back to 16 bits, or a moment computed in float16. The region is worked out
    only where such an edge exists at all (it walks the whole graph; most lints have none)."""
    was_low = set(original.low_precision)
    suspects = []
    for name in names:
        for port, ref in enumerate(graph.inputs(name)):
            dtype = output_dtype(graph.node(ref.node), ref.port)
            if dtype in LOW_PRECISION and ref.node not in was_low:
                suspects.append((name, port, ref, dtype))
    region = update_region(graph) if suspects else None
    if not region:
        return []
    return [f"edge {ref} -> {name!r}:{port} ({graph.node(name).op}) carries "
            f"{dtype_name(dtype)} between the gradients and a variable write: the update must "
            "read them in float32" for name, port, ref, dtype in suspects
            if name in region.computed and (ref.node in region.computed
                                            or ref.node in region.backward)]


def _tensorlist_problems(graph: Graph, original: Before, names: list[str]) -> list[str]:
    """The TensorList ops of one group (:func:`tensorlist_groups`) that held one element dtype
    before hold one now, for the groups with a node among ``names``."""
    problems = []
    wanted = set(names)
    for members in tensorlist_groups(graph):
        if wanted.isdisjoint(members):
            continue
        now: dict[int, dict[int, str]] = {}   # element dtype before -> dtype now -> an op
        for name in members:
            was = original.dtype(name, _ELEMENT_DTYPE)
            if was:   # a TensorList op of the input with an element dtype
                dtype = get_dtype(graph.node(name), _ELEMENT_DTYPE)
                now.setdefault(was, {}).setdefault(dtype, name)
        for held in now.values():
            if len(held) > 1:
                ops = ", ".join(f"{name!r} {dtype_name(d)}" for d, name in sorted(held.items()))
                problems.append(f"the TensorList ops of one list disagree on element_dtype: {ops}")
    return problems


def _back_edge_problems(graph: Graph, node) -> list[str]:
    """A node the conversion added may not read a NextIteration: a v1 loop's back edge must
    run straight into its Merge, so a cast there means the loop's dtypes did not agree."""
    return [f"node {node.name!r} ({node.op}), added by the conversion, sits on the loop back "
            f"edge from {ref.node!r}" for ref in graph.inputs(node.name)
            if graph.node(ref.node).op in NEXT_ITERATION_OPS]


def _name_problems(graph: Graph, names: list[str]) -> list[str]:
    """Names unique and every input naming a node of the graph: what TensorFlow's importer
    checks first. The IR keeps both by construction; this catches an IR that does not."""
    problems = []
    listed = graph.names()
    if len(set(listed)) != len(listed) or len(listed) != len(graph):
        seen: set[str] = set()
        dup = next((n for n in listed if n in seen or seen.add(n)), "?")
        problems.append(f"node name {dup!r} is used twice")
    for name in names:
        for src in [ref.node for ref in graph.inputs(name)] + graph.control_inputs(name):
            if src not in graph:
                problems.append(f"node {name!r} reads missing node {src!r}")
    return problems


def _edge_problems(graph: Graph, node, types) -> list[str]:
    """The node's data inputs: as many as its OpDef has, each of the dtype it expects."""
    problems = []
    inputs = graph.inputs(node.name)
    if len(inputs) != len(types.inputs):
        problems.append(f"node {node.name!r} ({node.op}) has {len(inputs)} data inputs, its "
                        f"OpDef expects {len(types.inputs)}")
    for port, ref in enumerate(inputs):
        src = graph.node(ref.node)
        src_types = node_types(src)
        if src_types is not None and ref.port >= len(src_types.outputs):
            problems.append(f"node {node.name!r} reads output {ref.port} of {ref.node!r}, which "
                            f"has {len(src_types.outputs)} outputs")
            continue
        have = output_dtype(src, ref.port)
        want = input_dtype(node, port)
        if have is not None and want is not None and have != want:
            problems.append(f"edge {ref} -> {node.name!r}:{port} ({node.op}) carries "
                            f"{dtype_name(have)} but the op expects {dtype_name(want)}")
    return problems


def _attr_problems(node, types) -> list[str]:
    problems = []
    for attr in types.attrs:
        dtype = get_dtype(node, attr)
        if dtype and not allowed_by_opdef(node, attr, dtype):
            problems.append(f"node {node.name!r} ({node.op}) has {attr}={dtype_name(dtype)}, "
                            f"which its OpDef does not allow")
    return problems


def _deny_problems(node, types, rules: RuleSet, original: Before | None) -> list[str]:
    """A deny op the conversion moved to low precision, unless the user forced it."""
    if rules.category(node.op) != "deny" or rules.level == "unsafe_force_all":
        return []
    forced = rules.node_rule(node.name)
    if forced is not None and forced.action == "force_lowp":
        return []
    return [f"deny op {node.name!r} ({node.op}) runs in {dtype_name(get_dtype(node, attr))}"
            for attr in types.attrs
            if get_dtype(node, attr) in LOW_PRECISION and _was_float(original, node.name, attr)]


def _variable_problems(node, types, original: Before) -> list[str]:
    was = original.dtypes(node.name)
    return [f"variable op {node.name!r} ({node.op}) changed {attr} from "
            f"{dtype_name(was.get(attr, INVALID))} to {dtype_name(get_dtype(node, attr))}"
            for attr in types.attrs if get_dtype(node, attr) != was.get(attr, INVALID)]


def _unknown_op_edges(graph: Graph, original: Before, names: list[str]) -> list[str]:
    """An op with no OpDef (a custom op) must see the dtypes it saw before on every edge."""
    problems = []
    for name in names:
        for port, ref in enumerate(graph.inputs(name)):
            src, dst = graph.node(ref.node), graph.node(name)
            if name not in original or (node_types(src) is not None and node_types(dst) is not None):
                continue
            was = original.edge_dtype(name, port)
            now = edge_dtype(src, ref.port, dst, port)
            if was is not None and now is not None and was != now:
                problems.append(f"edge {ref} -> {name!r}:{port} of an unregistered op carried "
                                f"{dtype_name(was)} and now carries {dtype_name(now)}")
    return problems


def _was_float(original: Before | None, name: str, attr: TypeAttr) -> bool:
    was = original.dtype(name, attr) if original is not None else None
    return was is None or was not in LOW_PRECISION


def lint(graph: Graph, **kwargs) -> None:
    """Raise :class:`LintError` listing every problem :func:`lint_problems` finds."""
    problems = lint_problems(graph, **kwargs)
    if problems:
        raise LintError(problems)
