"""A model that computes in 16 bits, widened to float32 before it is converted.

A Keras ``mixed_float16`` export, a graph built in float16, a model converted before: where it
computes in a 16-bit dtype the conversion does not target (:func:`dtypes_to_widen`), every
graph of it (its own nodes and each function it reaches) is widened to float32 first
(:func:`~amp_rewrite.transforms.widen.widen`), so the rest of the conversion starts from a
float32 model as from an FP32 original; :func:`note_widening` then tells in the report, node
by node, what each was in the input (docs/convert.md "Converting a converted model").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Collection

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from ..check import lint
from ..core.dtypes import FLOAT, LOW_PRECISION, TARGET_NAMES, TARGETS, dtype_name, held
from ..core.errors import LintError, UnsupportedGraphError
from ..core.ir import Graph
from ..core.ops import FUNCTIONAL_OPS, MATRIX_OPS
from ..schema.opdefs import is_variable_write
from ..paint.decisions import Decision
from ..report.decisions import NodeReport, Report, computes_in
from ..schema.backprop import trains
from ..schema.functiondef import (
    called_functions,
    check_call_types,
    function_to_graph,
    gradient_linked,
    graph_to_function,
    is_concrete,
    reachable,
)
from ..schema.opdefs import (
    TypeAttr,
    graph_with_defaults,
    set_call_signature,
    strip_graph_defaults,
)
from ..schema.snapshot import Before
from ..transforms.widen import Widening, widen
from .library import kept


@dataclass
class Widened:
    """What widening did to a MetaGraph: each graph's :class:`Widening`, by the prefix the
    report names its nodes with (``""`` for the graph's own nodes, ``function/`` for a body),
    and the dtypes it widened."""

    dtypes: frozenset[int]
    graphs: dict[str, Widening] = field(default_factory=dict)


def dtypes_to_widen(meta_graph: meta_graph_pb2.MetaGraphDef, target: str) -> frozenset[int]:
    """The 16-bit dtypes to widen to float32 before converting ``meta_graph`` for ``target``:
    for ``float32``, both, where the graph or a function it reaches holds one; for a 16-bit
    target, the other one, where a MatMul/Conv-family op (the graph's own, or in a function it
    reaches) computes in it. A graph already in ``target`` is left as it is, and 16-bit values
    only at an FP32 graph's edges (inputs, Casts, stored Consts) stay as they are."""
    wanted = (frozenset(LOW_PRECISION) if target == "float32"
              else frozenset(LOW_PRECISION) - {TARGETS[target]})
    found: set[int] = set()
    for nodes in _bodies(meta_graph):
        for nd in nodes:
            if target == "float32" or nd.op in MATRIX_OPS:
                found.update(held(nd) & wanted)
    return frozenset(found)


def widen_meta_graph(meta_graph: meta_graph_pb2.MetaGraphDef, dtypes: Collection[int], *,
                     keep: dict[str, tuple[str, str]], user_keep: Collection[str],
                     device: str) -> tuple[graph_pb2.GraphDef, Widened]:
    """``meta_graph``'s GraphDef with ``dtypes`` widened to float32 in the graph's own nodes
    (``keep``: those whose dtypes must not change, with why), in every function it reaches
    (their arguments and results, and the ``--keep`` names of their nodes ``user_keep``,
    kept) and at the boundaries between them (:func:`widen_boundaries`), each graph linted
    against what it was; the input is not changed."""
    source = meta_graph.graph_def
    for owner, nodes in _bodies(meta_graph, named=True):
        _refuse_trained_16bit_variables(nodes, dtypes, owner)
    roots = set(meta_graph.object_graph_def.concrete_functions)
    names = reachable(source.node, source.library, roots)
    out = graph_pb2.GraphDef()
    out.CopyFrom(source)
    sites = widen_boundaries(out, dtypes, names, roots | gradient_linked(source.library))
    widened = Widened(frozenset(dtypes))
    signatures = {f.signature.name: f.signature for f in out.library.function}
    graph, added = graph_with_defaults(out)
    widened.graphs[""] = _widen_checked(graph, dtypes, keep, device, signatures, sites.get(None))
    main = graph.to_graph_def(out)
    strip_graph_defaults(main, added)
    by_name = {f.signature.name: f for f in main.library.function}
    for name in names:
        fdef = by_name[name]
        if not is_concrete(fdef) or (name not in sites and not any(
                held(nd) & set(dtypes) for nd in fdef.node_def)):
            continue   # (a polymorphic body is left as it is, as painting leaves it)
        fg = function_to_graph(fdef, signatures)
        body_keep = kept(boundary=fg.boundary(),
                         user=[k[len(name) + 1:] for k in user_keep if k.startswith(name + "/")])
        for control in fdef.control_ret.values():   # named by the FunctionDef: never removed
            body_keep.setdefault(control, ("interface", "a control output of its function"))
        widened.graphs[f"{name}/"] = _widen_checked(fg.graph, dtypes, body_keep, device,
                                                    signatures, sites.get(name))
        fdef.CopyFrom(graph_to_function(fg, signatures))
    problems = check_call_types(main)
    if problems:
        raise LintError(problems)
    return main, widened


def _widen_checked(graph: Graph, dtypes, keep, device: str, signatures,
                   retyped: dict | None) -> Widening:
    """:func:`widen` on ``graph`` (``retyped``: its calls and loops whose types
    :func:`widen_boundaries` widened), then the lint of what it changed against what it was."""
    for node in graph.nodes():
        if node.op in signatures:   # a direct call: typed by its callee's signature
            set_call_signature(node, signatures[node.op])
    before = Before(graph)
    result = widen(graph, dtypes, keep=keep, device=device, retyped=retyped or {})
    # what widening changed: the rest is the input's, which rewrite() checks as the user's
    lint.lint(graph, original=before, only=result.touched)
    return result


def widen_boundaries(graph_def: graph_pb2.GraphDef, dtypes: Collection[int],
                     names: Collection[str], pinned: Collection[str]
                     ) -> dict[str | None, dict[str, dict[TypeAttr, int]]]:
    """Widen, in place, the arguments and results of ``dtypes`` of the functions ``names``
    (those the graph reaches) and the types of every call, loop and branch that calls them, so
    a value that crossed a boundary in 16 bits crosses it in float32. A function keeps its
    signature where one of those that share a call with it (a loop's condition and body, an
    If's branches) is ``pinned`` (a SavedModel restores it, a gradient table names it), is
    polymorphic, or is named by an op that is no call (a tf.data function). Returns, per
    owner (None: the graph's own nodes), the call sites retyped: node -> type attribute ->
    the dtype it held (a direct call, typed by the signature, with none)."""
    by_name = {f.signature.name: f for f in graph_def.library.function}
    wanted = set(dtypes)
    group = {name: name for name in names}   # union-find: functions one call ties together
    blocked = {n for n in names if n in pinned or not is_concrete(by_name[n])}
    calls = []
    for owner, nodes in [(None, graph_def.node)] + [(n, by_name[n].node_def) for n in names]:
        for nd in nodes:
            callees = [c for c in called_functions(nd, set(by_name)) if c in group]
            if callees and (nd.op in FUNCTIONAL_OPS or nd.op in by_name):
                calls.append((owner, nd, callees))
                for other in callees[1:]:
                    group[_root(group, other)] = _root(group, callees[0])
            else:
                blocked.update(callees)
    stays = {_root(group, n) for n in blocked}
    raised = {n for n in names if _root(group, n) not in stays}
    for name in raised:
        for arg in list(by_name[name].signature.input_arg) + list(by_name[name].signature.output_arg):
            if arg.type in wanted:
                arg.type = FLOAT
    sites: dict[str | None, dict[str, dict[TypeAttr, int]]] = {}
    for owner, nd, callees in calls:
        if callees[0] in raised:
            sites.setdefault(owner, {})[nd.name] = _widen_call(nd, wanted)
    return sites


def _root(group: dict[str, str], name: str) -> str:
    while group[name] != name:
        group[name] = group[group[name]]
        name = group[name]
    return name


def _widen_call(nd, wanted: set[int]) -> dict[TypeAttr, int]:
    """A call's, loop's or branch's type lists of ``wanted`` dtypes to float32, in place
    (its callees' signatures widened with them); returns the attributes it changed."""
    changed = {}
    for key in ("T", "Tin", "Tout"):
        if key in nd.attr and nd.op in FUNCTIONAL_OPS:
            types = nd.attr[key].list.type
            for i, dtype in enumerate(types):
                if dtype in wanted:
                    changed[TypeAttr(key, i)] = dtype
                    types[i] = FLOAT
    return changed


def note_widening(report: Report, widened: Widened, target: str) -> None:
    """Tell in ``report`` what widening did: each widened node's reason says what it was in the
    input, and a node that computes in ``target`` now because painting put it there gets code
    ``retyped`` (its painting's reason kept in the text); the input's Casts widening removed
    are reported (code ``cast_removed``) and counted as removed, the Casts it added as added;
    the ``widening`` section sums it up."""
    by_name = {n.name: n for n in report.nodes}
    for prefix, done in widened.graphs.items():
        for name, attrs in done.lifted.items():
            node = by_name.get(prefix + name)
            if node is not None:
                _note_lifted(node, attrs, target)
        for name, why in done.kept.items():
            node = by_name.get(prefix + name)
            if node is not None:
                held = " and ".join(sorted({_name(d) for d in _sixteen(node)}))
                node.reason = f"keeps {held} ({why}): {node.reason}"
        for name, attrs in done.removed.items():
            node = NodeReport(prefix + name, "Cast", "float32", "", "",
                              attrs={str(a): "float" for a in attrs})
            _decide(node, Decision(False, "cast_removed", _removed_reason(attrs)))
            report.nodes.append(node)
        report.casts_removed.extend(prefix + n for n in done.removed)
        report.casts_added.extend(prefix + n for n in done.casts_added)
        added = {prefix + n for n in done.casts_added}
        report.low_precision_input[:] = [n for n in report.low_precision_input if n not in added]
    report.extra["widening"] = _summary(widened, target)


def _note_lifted(node: NodeReport, attrs, target: str) -> None:
    """What a node widening moved to float32 (``attrs``: the dtypes it held) says, once
    painting decided where it ends (``node``'s code and reason): for ``float32``, code
    ``target_float32``; in the target now, code ``retyped``, the painting's reason after what it
    was; float32 now, the painting's code and reason after what it was."""
    was = " and ".join(sorted({_name(d) for d in attrs.values()}))
    if target == "float32":
        _decide(node, Decision(False, "target_float32", f"{was} in the input, float32 now: the "
                                                         "target is float32"))
    elif computes_in(node) == target:
        _decide(node, Decision(True, "retyped", f"{was} in the input, {target} now: "
                                                f"{node.reason}"))
    else:   # painting kept it float32, and its code says why
        node.reason = f"{was} in the input, float32 now: {node.reason}"


def _removed_reason(attrs) -> str:
    src, dst = (_name(attrs.get(TypeAttr(a), FLOAT)) for a in ("SrcT", "DstT"))
    return (f"the input's Cast from {src} to {dst}: once its neighbours were widened it cast "
            "float32 to float32, so its readers read its input (a float32 value, not rounded to "
            "16 bits first) and it is removed")


def _sixteen(node: NodeReport) -> set[int]:
    """The 16-bit dtypes a reported node holds."""
    return {d for d in TARGET_NAMES if dtype_name(d) in node.attrs.values()}


def _decide(node: NodeReport, decision: Decision) -> None:
    node.code, node.reason = decision.code, decision.text


def _summary(widened: Widened, target: str) -> dict:
    """The report's ``widening`` section: what it widened, removed, kept, with a summary."""
    names = " and ".join(sorted(TARGET_NAMES[d] for d in widened.dtypes))
    graphs = list(widened.graphs.values())
    lifted = sum(len(g.lifted) for g in graphs)
    removed = sum(len(g.removed) for g in graphs)
    stored = sum(len(g.consts) for g in graphs)
    kept = Counter(why for g in graphs for why in g.kept.values())
    then = ("the target is float32" if target == "float32"
            else f"then painted for {target} as a float32 model is")
    text = (f"the input computes in {names}: {lifted} nodes widened to float32 first ({then}), "
            f"{removed} of its Casts between float32 and 16 bits removed")
    if stored:
        text += (f"; {stored} Consts it stored in {names} hold the same values in float32, "
                 f"so they keep {names}'s rounding")
    if kept:
        text += (f"; {sum(kept.values())} nodes keep their 16-bit dtype ("
                 + ", ".join(f"{why} {n}" for why, n in sorted(kept.items())) + ")")
    return {"from": sorted(TARGET_NAMES[d] for d in widened.dtypes), "nodes": lifted,
            "casts_removed": removed, "consts": stored, "kept": dict(sorted(kept.items())),
            "summary": text}


def _bodies(meta_graph: meta_graph_pb2.MetaGraphDef, named: bool = False):
    """The graph's own nodes, then each function body it reaches (its object graph's concrete
    functions included); ``named``: each as ``(function name or None, nodes)``."""
    graph_def = meta_graph.graph_def
    by_name = {f.signature.name: f for f in graph_def.library.function}
    yield (None, graph_def.node) if named else graph_def.node
    for name in reachable(graph_def.node, graph_def.library,
                          meta_graph.object_graph_def.concrete_functions):
        yield (name, by_name[name].node_def) if named else by_name[name].node_def


def _refuse_trained_16bit_variables(nodes, dtypes: Collection[int], owner: str | None) -> None:
    """Refuse a graph (or function body) that trains variables stored in a dtype to widen:
    widening keeps each variable's stored dtype (a checkpoint holds it), so the updates it
    computes in float32 would be rounded back to 16 bits at every write, a model neither
    float32 nor the one trained."""
    if not trains(nodes):
        return
    writes = [nd for nd in nodes if is_variable_write(nd.op) and held(nd) & set(dtypes)]
    if writes:   # named by an update rather than an initializer's plain assignment
        write = min(writes, key=lambda nd: nd.op in ("Assign", "AssignVariableOp"))
        name = " and ".join(sorted(TARGET_NAMES[d] for d in held(write) & set(dtypes)))
        where = f"function {owner!r}" if owner else "the graph"
        raise UnsupportedGraphError(
            f"{where} trains variables stored in {name} ({write.op} {write.name!r} writes one): "
            f"a conversion keeps each variable's stored dtype, so their updates would be "
            f"rounded to {name} at every step; convert it for {name} as it is, or store its "
            "variables in float32 (Keras: the mixed_float16 policy, not float16)")


def _name(dtype: int) -> str:
    """The user's name of a dtype: ``float16``, ``bfloat16``, ``float32``, else TensorFlow's."""
    return TARGET_NAMES.get(dtype) or ("float32" if dtype == FLOAT else dtype_name(dtype))

