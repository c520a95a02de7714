"""Function libraries as IR: FunctionDef <-> :class:`~amp_rewrite.core.ir.Graph`, reachability, and
the contract between a call site and its callee.

A ``FunctionDef`` becomes an ordinary graph so the same painting, casts and lint run on it:
each input argument is a ``Placeholder`` named after the argument, each output argument an
``Identity`` *sentinel* reading the returned tensor, and the FunctionDef's
``node:out_arg:index`` input strings become flat ``node:port`` edges (the port layout comes
from the OpDef, or from the callee's signature for a direct call). Because the Placeholders
and sentinels are the body's interface, a body is painted with float32 arguments and results.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2

from ..core.dtypes import INVALID, RESOURCE
from ..core.errors import InputError, UnsupportedGraphError
from ..core.ir import Graph, TensorRef
from ..core.ops import CALL_OPS, CASE_OPS, IF_OPS, WHILE_OPS
from .opdefs import fill_defaults, op_def, set_call_signature, strip_defaults


@dataclass
class FunctionGraph:
    """One function as IR: ``args`` are its Placeholders, ``rets`` its output sentinels."""

    fdef: function_pb2.FunctionDef
    graph: Graph
    args: list[str]
    rets: list[str]
    defaults: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # attrs we filled in

    @property
    def name(self) -> str:
        return self.fdef.signature.name

    def boundary(self) -> set[str]:
        return set(self.args) | set(self.rets)


# ----------------------------------------------------------------- reachability
def called_functions(node_def, library_names: set[str]) -> list[str]:
    """Names of the library functions one NodeDef calls (by op name or function attrs)."""
    out = []
    if node_def.op in library_names:
        out.append(node_def.op)
    for key in sorted(node_def.attr):
        value = node_def.attr[key]
        kind = value.WhichOneof("value")
        if kind == "func" and value.func.name in library_names:
            out.append(value.func.name)
        elif kind == "list":
            out.extend(f.name for f in value.list.func if f.name in library_names)
    return out


def reachable(nodes, library: function_pb2.FunctionDefLibrary, extra_roots=()) -> list[str]:
    """Library functions reachable from ``nodes`` and ``extra_roots``, in depth-first order."""
    by_name = {f.signature.name: f for f in library.function}
    names = set(by_name)
    if not names:
        return []   # nothing to reach: spare the look at every node's attrs
    order: list[str] = []
    stack = []
    for nd in nodes:
        stack.extend(called_functions(nd, names))
    stack.extend(sorted(set(extra_roots) & names))  # a protobuf map's order is not stable
    stack.reverse()
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        order.append(name)
        for nd in by_name[name].node_def:
            stack.extend(reversed(called_functions(nd, names)))
    return order


# what tf.saved_model.save names the functions behind its saver: the fallback when the
# MetaGraph's saver_def names no node that calls them
_SAVER_FUNCTION = re.compile(r"__inference__traced_(save|restore)_\d+$")


def saver_functions(meta_graph) -> list[str]:
    """The library functions only a SavedModel's saver reaches (``__inference__traced_save_N``,
    ``__inference__traced_restore_N`` and what they call), in reach order.

    The saver's nodes are those the MetaGraph's ``saver_def`` names (the save tensor's node and
    the restore op), or, when it names none that exists, the graph nodes that call a function
    named as ``tf.saved_model.save`` names the saver's. A function also reached from another
    graph node or from a concrete function the object graph restores is not the saver's: it
    runs when the model runs. Empty for a graph whose saver is made of graph nodes (TF1)."""
    graph_def = meta_graph.graph_def
    library = graph_def.library
    if not library.function:
        return []
    saver = meta_graph.saver_def
    named = {ref.split(":")[0].lstrip("^") for ref in (saver.save_tensor_name,
                                                       saver.restore_op_name) if ref}
    functions = {f.signature.name for f in library.function}
    ends = [nd for nd in graph_def.node if nd.name in named and called_functions(nd, functions)]
    if not ends:
        ends = [nd for nd in graph_def.node
                if any(_SAVER_FUNCTION.match(f) for f in called_functions(nd, functions))]
    if not ends:
        return []
    mine = {nd.name for nd in ends}
    elsewhere = set(reachable([nd for nd in graph_def.node if nd.name not in mine], library,
                              meta_graph.object_graph_def.concrete_functions))
    return [f for f in reachable(ends, library) if f not in elsewhere]


# ----------------------------------------------------------------- FunctionDef <-> IR
def is_concrete(fdef: function_pb2.FunctionDef) -> bool:
    sig = fdef.signature
    args = list(sig.input_arg) + list(sig.output_arg)
    return not sig.attr and all(a.type != INVALID and not a.number_attr
                                and not a.type_list_attr for a in args)


def output_layout(node_def, signatures: dict) -> list[tuple[str, int]]:
    """``(output arg name, index)`` of each flat output port of a node in a function body."""
    if node_def.op in signatures:
        return [(a.name, 0) for a in signatures[node_def.op].output_arg]
    od = op_def(node_def.op)
    if od is None:
        raise UnsupportedGraphError(f"op {node_def.op!r} of node {node_def.name!r} is neither "
                                    "registered with TensorFlow nor a library function")
    out = []
    for arg in od.output_arg:
        if arg.type_list_attr:
            count = len(node_def.attr[arg.type_list_attr].list.type)
        elif arg.number_attr:
            count = node_def.attr[arg.number_attr].i
        else:
            count = 1
        out.extend((arg.name, i) for i in range(count))
    return out


def _flat_input(text: str, ports: dict[str, dict[tuple[str, int], int]], fname: str) -> str:
    """A FunctionDef input string as a GraphDef one: ``n:out:2`` -> ``n:<flat port>``."""
    if text.startswith("^"):
        return text
    parts = text.split(":")
    if len(parts) == 1:
        return text  # an argument: its Placeholder has one output
    node, arg = parts[0], parts[1]
    try:
        index = int(parts[2]) if len(parts) > 2 else 0
        port = ports[node][(arg, index)]
    except (KeyError, ValueError):   # no such node or output, or an index that is no number
        raise InputError(f"function {fname!r}: input {text!r} names no output of a node") from None
    return f"{node}:{port}"


def function_to_graph(fdef: function_pb2.FunctionDef, signatures: dict,
                      handle_shapes: dict[str, list[int]] | None = None) -> FunctionGraph:
    """The body of a concrete function as IR, with Placeholder arguments and sentinel results;
    a node whose op is a function of ``signatures`` (a direct call) is typed by its signature.
    An argument's Placeholder has the ``shape`` its ``_output_shapes`` arg attr states, and a
    resource argument named in ``handle_shapes`` (:func:`variable_argument_shapes`) the shape
    of the variable it holds as ``_handle_shapes``, for the cost model; neither reaches the
    FunctionDef :func:`graph_to_function` writes."""
    fname = fdef.signature.name
    body_names = {nd.name for nd in fdef.node_def}
    gd = graph_pb2.GraphDef()
    for i, arg in enumerate(fdef.signature.input_arg):
        if arg.name in body_names:
            raise UnsupportedGraphError(f"function {fname!r}: argument {arg.name!r} has the name "
                                        "of a node of its body")
        placeholder = gd.node.add(name=arg.name, op="Placeholder")
        placeholder.attr["dtype"].type = arg.type
        stated = fdef.arg_attr[i].attr.get("_output_shapes") if i in fdef.arg_attr else None
        if arg.type != RESOURCE and stated is not None and len(stated.list.shape) == 1:
            placeholder.attr["shape"].shape.CopyFrom(stated.list.shape[0])
        if arg.type == RESOURCE and handle_shapes and arg.name in handle_shapes:
            shape = placeholder.attr["_handle_shapes"].list.shape.add()
            for d in handle_shapes[arg.name]:
                shape.dim.add(size=d)
    ports = {nd.name: {key: i for i, key in enumerate(output_layout(nd, signatures))}
             for nd in fdef.node_def}
    defaults = {}
    for nd in fdef.node_def:
        new = gd.node.add()
        new.CopyFrom(nd)
        del new.input[:]
        new.input.extend(_flat_input(t, ports, fname) for t in nd.input)
        added = fill_defaults(new)
        if added:
            defaults[nd.name] = added
    try:
        graph = Graph.from_graph_def(gd)
    except InputError as exc:
        raise InputError(f"function {fname!r}: {exc}") from None
    for node in graph.nodes():   # a direct call is typed by its callee's signature
        if node.op in signatures:
            set_call_signature(node, signatures[node.op])
    rets = []
    for out in fdef.signature.output_arg:
        ref = TensorRef.parse(_flat_input(fdef.ret[out.name], ports, fname))
        if ref.node not in graph:  # the FunctionDef's fault, not a misuse of the IR
            raise InputError(f"function {fname!r}: result {out.name!r} reads missing node "
                             f"{ref.node!r}")
        sentinel = graph.add_node("Identity", f"{out.name}/amp_ret", [ref],
                                  {"T": attr_value_pb2.AttrValue(type=out.type)})
        rets.append(sentinel.name)
    return FunctionGraph(fdef, graph, [a.name for a in fdef.signature.input_arg], rets, defaults)


def _function_input(fg: FunctionGraph, ref: TensorRef, signatures: dict) -> str:
    if ref.node in fg.args:
        return ref.node
    arg, index = output_layout(fg.graph.node(ref.node).proto, signatures)[ref.port]
    return f"{ref.node}:{arg}:{index}"


def variable_argument_shapes(graph_def: graph_pb2.GraphDef) -> dict[str, dict[str, list[int]]]:
    """Function name -> resource argument -> the static shape of the variable it receives, where
    every call site that passes one agrees: a VarHandleOp's ``shape`` attr (through Identity),
    passed by the graph or, argument to argument, by a function's call, While, If or Case to
    the functions it calls (a SavedModel's variables reach its bodies only so)."""

    def leaf(nd):
        if nd.op == "VarHandleOp" and "shape" in nd.attr and not nd.attr["shape"].shape.unknown_rank:
            dims = [d.size for d in nd.attr["shape"].shape.dim]
            return dims if all(d >= 0 for d in dims) else None
        return None

    return _passed_to_arguments(graph_def, leaf, resources=True, loops=True)


def argument_shapes(graph_def: graph_pb2.GraphDef, given: Mapping[str, Sequence[int]]
                    ) -> dict[str, dict[str, tuple[int, ...]]]:
    """Function name -> data argument -> the shape ``given`` (placeholder of ``graph_def`` ->
    the shape it runs at: ``--shape``) says it receives, where every call site agrees: the
    placeholder passed (through Identity) by the graph's call, If or Case or, argument to
    argument, by a function's to the functions it calls. So a SavedModel's signature input
    reaches the function bodies its signature calls, and the cost model weighs them at the
    batch it runs at. A loop's arguments are left out: its values may change shape from step
    to step. A call site that passes something else makes the argument's shape unknown."""
    if not given:
        return {}

    def leaf(nd):
        if nd.op in ("Placeholder", "PlaceholderWithDefault") and nd.name in given:
            return [int(d) for d in given[nd.name]]
        return None

    found = _passed_to_arguments(graph_def, leaf, resources=False, loops=False)
    return {f: {a: tuple(s) for a, s in args.items()} for f, args in found.items()}


def _passed_to_arguments(graph_def: graph_pb2.GraphDef, leaf, *, resources: bool,
                         loops: bool) -> dict[str, dict[str, list[int]]]:
    """Function name -> argument -> the value ``leaf`` (a NodeDef -> a shape, or None) gives
    the node passed to it (through Identity), where the call sites agree: the graph's calls,
    then, argument to argument, the functions' (``loops``: While too). ``resources``: resource
    arguments only, passed where known (a site that passes none is not counted); else every
    other argument, and a site that passes an unknown one makes it unknown."""
    by_name = {f.signature.name: f for f in graph_def.library.function}
    found: dict[str, dict[str, list[int] | None]] = {}

    def record(callee: str, index: int, shape: list[int] | None) -> None:
        fdef = by_name.get(callee)
        if (fdef is None or index >= len(fdef.signature.input_arg)
                or (fdef.signature.input_arg[index].type == RESOURCE) != resources
                or (shape is None and resources)):
            return
        arg = fdef.signature.input_arg[index].name
        seen = found.setdefault(callee, {})
        if arg not in seen:
            seen[arg] = shape
        elif seen[arg] is not None and seen[arg] != shape:
            seen[arg] = None   # call sites disagree: unknown

    def visit(nodes: dict, resolve) -> None:
        for nd in nodes.values():
            for callee, offset in _callees(nd, by_name, loops):
                data = [t for t in nd.input if not t.startswith("^")]
                for i, text in enumerate(data[offset:]):
                    record(callee, i, resolve(text))

    def value(nodes: dict, name: str, args: dict, depth: int = 8):
        nd = nodes.get(name)
        if nd is None:
            return args.get(name)
        if nd.op == "Identity" and nd.input and depth:
            return value(nodes, nd.input[0].split(":")[0], args, depth - 1)
        return leaf(nd)

    top = {nd.name: nd for nd in graph_def.node}
    visit(top, lambda t: value(top, t.split(":")[0], {}))
    bodies = {name: {nd.name: nd for nd in f.node_def} for name, f in by_name.items()}
    # callers before callees (a call graph has no cycle): a body passes its arguments on once
    # every site that calls it has been seen
    for name in _callers_first(bodies, by_name):
        nodes, args = bodies[name], found.get(name, {})
        visit(nodes, lambda t, n=nodes, a=args: value(n, t.split(":")[0], a))
    return {f: {a: s for a, s in args.items() if s is not None} for f, args in found.items()}


def _callers_first(bodies: dict, by_name: dict) -> list[str]:
    """The functions of ``bodies`` ordered so that each comes after every function that calls
    it (any order among the rest; a cycle, which TensorFlow refuses, ends the order early). A
    call of a function the library does not hold (the importer refuses it later) orders
    nothing."""
    callees = {name: {c for nd in nodes.values() for c, _ in _callees(nd, by_name)
                      if c in bodies} - {name}
               for name, nodes in bodies.items()}
    waiting = {name: 0 for name in bodies}
    for name, called in callees.items():
        for callee in called:
            waiting[callee] += 1
    ready = sorted(name for name, n in waiting.items() if not n)
    order = []
    while ready:
        name = ready.pop()
        order.append(name)
        for callee in sorted(callees[name]):
            waiting[callee] -= 1
            if not waiting[callee]:
                ready.append(callee)
    return order


def _callees(nd, by_name, loops: bool = True) -> list[tuple[str, int]]:
    """The functions a node calls with its data inputs, and the first input each receives
    (``loops``: a While's body and cond too)."""
    if nd.op in by_name:
        return [(nd.op, 0)]
    if nd.op in CALL_OPS:
        return [(nd.attr["f"].func.name, 0)]
    if nd.op in WHILE_OPS and loops:
        return [(nd.attr["body"].func.name, 0), (nd.attr["cond"].func.name, 0)]
    if nd.op in IF_OPS:
        return [(nd.attr[b].func.name, 1) for b in ("then_branch", "else_branch")]
    if nd.op in CASE_OPS:
        return [(f.name, 1) for f in nd.attr["branches"].list.func]
    return []


def graph_to_function(fg: FunctionGraph, signatures: dict) -> function_pb2.FunctionDef:
    """The FunctionDef of ``fg``: its body, returns and signature types as the IR holds them."""
    out = function_pb2.FunctionDef()
    out.CopyFrom(fg.fdef)
    del out.node_def[:]
    boundary = fg.boundary()
    graph = fg.graph
    for node in graph.nodes():
        if node.name in boundary:
            continue
        nd = out.node_def.add()
        nd.CopyFrom(node.proto)
        nd.input.extend(_function_input(fg, ref, signatures) for ref in graph.inputs(node.name))
        nd.input.extend("^" + src for src in graph.control_inputs(node.name))
        strip_defaults(nd, fg.defaults.get(node.name, ()))
    for arg, name in zip(out.signature.input_arg, fg.args):
        arg.type = graph.node(name).attr["dtype"].type
    for arg, sentinel in zip(out.signature.output_arg, fg.rets):
        arg.type = graph.node(sentinel).attr["T"].type
        out.ret[arg.name] = _function_input(fg, graph.input(sentinel, 0), signatures)
    return out


def gradient_linked(library) -> set[str]:
    """Functions named in the library's gradient tables: renaming or retyping them would break
    the link (custom gradients of a SavedModel live in ``registered_gradients``)."""
    names = {n for g in library.gradient for n in (g.function_name, g.gradient_func)}
    return names | {g.gradient_func for g in library.registered_gradients}


def drop_unreachable(graph_def, candidates: set[str], extra_roots) -> None:
    """Remove functions of ``candidates`` nothing calls any more (replaced by specialized copies)."""
    library = graph_def.library
    still = set(reachable(graph_def.node, library, extra_roots))
    dead = candidates - still
    if dead:
        keep = [f for f in library.function if f.signature.name not in dead]
        del library.function[:]
        library.function.extend(keep)


# ----------------------------------------------------------------- consistency
def check_call_types(graph_def: graph_pb2.GraphDef) -> list[str]:
    """Every call site's type lists equal its callees' signatures (While: T = cond = body)."""
    sigs = {f.signature.name: f.signature for f in graph_def.library.function}
    if not sigs:
        return []   # no callee to disagree with: spare a look at every node
    problems = []
    bodies = [(None, graph_def.node)] + [(f.signature.name, f.node_def)
                                         for f in graph_def.library.function]
    for owner, nodes in bodies:
        for nd in nodes:
            for callee, want_in, want_out in _call_contract(nd):
                sig = sigs.get(callee)
                if sig is None:
                    continue
                have_in = [a.type for a in sig.input_arg]
                have_out = [a.type for a in sig.output_arg]
                if (want_in is not None and have_in != want_in) or \
                        (want_out is not None and have_out != want_out):
                    where = f"function {owner!r}" if owner else "the graph"
                    problems.append(f"node {nd.name!r} ({nd.op}) in {where} calls {callee!r} "
                                    "with types that differ from its signature")
    return problems


def _types(nd, attr: str) -> list[int]:
    return list(nd.attr[attr].list.type) if attr in nd.attr else []


def _call_contract(nd):
    """``(callee, input types, output types)`` a functional op promises its callees."""
    if nd.op in WHILE_OPS:
        t = _types(nd, "T")
        return [(nd.attr["cond"].func.name, t, None), (nd.attr["body"].func.name, t, t)]
    if nd.op in IF_OPS:
        tin, tout = _types(nd, "Tin"), _types(nd, "Tout")
        return [(nd.attr[b].func.name, tin, tout) for b in ("then_branch", "else_branch")]
    if nd.op in CASE_OPS:
        tin, tout = _types(nd, "Tin"), _types(nd, "Tout")
        return [(f.name, tin, tout) for f in nd.attr["branches"].list.func]
    if nd.op in CALL_OPS:
        return [(nd.attr["f"].func.name, _types(nd, "Tin"), _types(nd, "Tout"))]
    return []
