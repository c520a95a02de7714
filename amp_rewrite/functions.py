"""Function libraries: FunctionDef <-> IR, painting every reachable body, boundary types.

A ``FunctionDef`` becomes an ordinary :class:`~amp_rewrite.ir.Graph` so the same painting,
casts and lint run on it: each input argument is a ``Placeholder`` named after the argument,
each output argument an ``Identity`` *sentinel* reading the returned tensor, and the
FunctionDef's ``node:out_arg:index`` input strings become flat ``node:port`` edges (the port
layout comes from the OpDef, or from the callee's signature for a direct call). Because the
Placeholders and sentinels are the body's interface, a body is painted with float32 arguments
and results, and casts sit just inside the boundary.

Afterwards :class:`BoundaryLowering` moves boundaries that only carry casts into low precision
(``While`` loop-carried values, arguments and results of ``If``/``Case``/``PartitionedCall``
callees), so the casts leave the loop or the call; a callee shared by call sites that want
different boundary types is copied (specialized) first. Functions a SavedModel restores (the
roots) keep their signatures. :func:`paint_library` runs all of it on a GraphDef's library.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, types_pb2

from . import lint
from .casts import cast_types, insert_cast, widened_source
from .errors import InputError, LintError, UnsupportedGraphError
from .ir import Graph, TensorRef
from .types import FLOAT, TARGETS, op_def

log = logging.getLogger(__name__)

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


# ----------------------------------------------------------------- default attributes
def fill_defaults(node_def) -> list[str]:
    """Set the OpDef defaults of attrs ``node_def`` omits; returns their names.

    SavedModels strip default-valued attrs, but the type model reads every type attr.
    """
    od = op_def(node_def.op)
    added = []
    for attr in od.attr if od is not None else ():
        if attr.name not in node_def.attr and attr.HasField("default_value"):
            node_def.attr[attr.name].CopyFrom(attr.default_value)
            added.append(attr.name)
    return added


def strip_defaults(node_def, names) -> None:
    """Remove the attrs :func:`fill_defaults` added that still hold their default."""
    od = op_def(node_def.op)
    defaults = {a.name: a.default_value for a in od.attr} if od is not None else {}
    for name in names:
        if name in node_def.attr and node_def.attr[name] == defaults.get(name):
            del node_def.attr[name]


def graph_def_with_defaults(graph_def: graph_pb2.GraphDef):
    """A copy of ``graph_def`` with default attrs filled in, and which ones were added."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    added = {nd.name: fill_defaults(nd) for nd in out.node}
    return out, {k: v for k, v in added.items() if v}


def strip_graph_defaults(graph_def: graph_pb2.GraphDef, added: dict[str, list[str]]) -> None:
    for nd in graph_def.node:
        if nd.name in added:
            strip_defaults(nd, added[nd.name])


# ----------------------------------------------------------------- FunctionDef <-> IR
def _is_concrete(fdef: function_pb2.FunctionDef) -> bool:
    sig = fdef.signature
    args = list(sig.input_arg) + list(sig.output_arg)
    return not sig.attr and all(a.type != types_pb2.DT_INVALID and not a.number_attr
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
    index = int(parts[2]) if len(parts) > 2 else 0
    try:
        port = ports[node][(arg, index)]
    except KeyError:
        raise InputError(f"function {fname!r}: input {text!r} names no output of a node") from None
    return f"{node}:{port}"


def function_to_graph(fdef: function_pb2.FunctionDef, signatures: dict) -> FunctionGraph:
    """The body of a concrete function as IR, with Placeholder arguments and sentinel results."""
    fname = fdef.signature.name
    body_names = {nd.name for nd in fdef.node_def}
    gd = graph_pb2.GraphDef()
    for arg in fdef.signature.input_arg:
        if arg.name in body_names:
            raise UnsupportedGraphError(f"function {fname!r}: argument {arg.name!r} has the name "
                                        "of a node of its body")
        gd.node.add(name=arg.name, op="Placeholder").attr["dtype"].type = arg.type
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
    rets = []
    for out in fdef.signature.output_arg:
        ref = TensorRef.parse(_flat_input(fdef.ret[out.name], ports, fname))
        sentinel = graph.add_node("Identity", f"{out.name}/amp_ret", [ref],
                                  {"T": attr_value_pb2.AttrValue(type=out.type)})
        rets.append(sentinel.name)
    return FunctionGraph(fdef, graph, [a.name for a in fdef.signature.input_arg], rets, defaults)


def _function_input(fg: FunctionGraph, ref: TensorRef, signatures: dict) -> str:
    if ref.node in fg.args:
        return ref.node
    arg, index = output_layout(fg.graph.node(ref.node).proto, signatures)[ref.port]
    return f"{ref.node}:{arg}:{index}"


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


# ----------------------------------------------------------------- painting a library
def paint_library(graph_def: graph_pb2.GraphDef, options, rules, report, extra_roots=(),
                  interface=(), lower: bool = True) -> None:
    """Paint, in place, every library function reachable from ``graph_def``'s nodes or roots.

    Bodies are painted like graphs, with float32 boundaries; then boundaries that only carry
    casts are lowered (:class:`BoundaryLowering`), in the functions and at the graph's own
    call sites. ``extra_roots`` (a SavedModel's concrete functions) keep their signatures.
    The nodes of each function appear in ``report`` as ``function/node``. Raises
    :class:`LintError` if a call site's types and its callee's signature disagree afterwards.
    ``interface`` names the graph's nodes whose outputs are fetched (signature tensors): their
    dtypes never change, nor those of outputs nothing reads. ``lower=False`` keeps every
    boundary float32 (for comparison: benchmarks/functions.py).
    """
    library = graph_def.library
    names = reachable(graph_def.node, library, extra_roots)
    if not names:
        return
    signatures = {f.signature.name: f.signature for f in library.function}
    by_name = {f.signature.name: f for f in library.function}
    graphs: dict[str, FunctionGraph] = {}
    for name in names:
        fg = _convert_function(by_name[name], library, signatures, options, rules, report)
        if fg is not None:
            graphs[name] = fg
    roots = set(extra_roots) | _gradient_linked(library)
    protected = set(interface) | set(options.keep)
    lowering = _lower(graph_def, graphs, roots, signatures, TARGETS[options.target], report,
                      protected, rounds=8 if lower else 0)
    for name in names:
        if name in graphs:
            by_name[name].CopyFrom(graph_to_function(graphs[name], signatures))
    for name in lowering.specialized:
        library.function.add().CopyFrom(graph_to_function(graphs[name], signatures))
    _drop_unreachable(graph_def, set(names) - roots, extra_roots)
    problems = check_call_types(graph_def)
    if problems:
        raise LintError(problems)


def _lower(graph_def, graphs, roots, signatures, target, report, protected,
           rounds) -> "BoundaryLowering":
    """Run :class:`BoundaryLowering` over the functions and ``graph_def``'s own nodes, lint
    what changed, write the graph's nodes back and record the result in ``report``."""
    filled, added = graph_def_with_defaults(graph_def)
    main = Graph.from_graph_def(filled)
    lowering = BoundaryLowering(graphs, main, roots, signatures, target,
                                inserted=set(report.casts_added), protected=protected)
    lowering.run(rounds)
    for owner in sorted(lowering.changed, key=str):
        lint.lint(main if owner is None else graphs[owner].graph)
    if None in lowering.changed:
        out = main.to_graph_def(filled)
        strip_graph_defaults(out, added)
        del graph_def.node[:]
        graph_def.node.extend(out.node)
    if lowering.lowered:
        report.extra["functions"] = lowering.summary()
        # casts we inserted and then moved are simply not there; only the input's own count
        # as removed
        gone = set(lowering.casts_removed)
        report.casts_added[:] = [n for n in report.casts_added + lowering.casts_added
                                 + lowering.copied_casts if n not in gone]
        report.casts_removed.extend(lowering.input_casts_removed)
    return lowering


def _gradient_linked(library) -> set[str]:
    """Functions named in the library's gradient tables: renaming or retyping them would break
    the link (custom gradients of a SavedModel live in ``registered_gradients``)."""
    names = {n for g in library.gradient for n in (g.function_name, g.gradient_func)}
    return names | {g.gradient_func for g in library.registered_gradients}


def _drop_unreachable(graph_def, candidates: set[str], extra_roots) -> None:
    """Remove functions of ``candidates`` nothing calls any more (replaced by specialized copies)."""
    library = graph_def.library
    still = set(reachable(graph_def.node, library, extra_roots))
    dead = candidates - still
    if dead:
        keep = [f for f in library.function if f.signature.name not in dead]
        del library.function[:]
        library.function.extend(keep)


def _convert_function(fdef, library, signatures, options, rules, report) -> FunctionGraph | None:
    """Paint one function body; None (with a warning) when it cannot be painted."""
    from .pipeline import convert_graph

    name = fdef.signature.name
    if not _is_concrete(fdef):
        report.warnings.append(f"function {name!r} is polymorphic (type attributes in its "
                               "signature): left as it is")
        return None
    body_options = dataclasses.replace(options, keep=(), lowp_io=False)
    try:
        fg = function_to_graph(fdef, signatures)
        keep = fg.boundary() | direct_call_feeders(fg.graph, library) | {
            k[len(name) + 1:] for k in options.keep if k.startswith(name + "/")}
        body_rules = rules_for(rules, fg.graph.names(), prefix=name)
        work, sub = convert_graph(fg.graph, body_options, body_rules, extra_keep=keep)
    except InputError as exc:
        # TensorFlow ran this body; if our IR cannot take it, it stays as it was
        report.warnings.append(f"function {name!r} left as it is: {exc}")
        log.warning("function %r left as it is: %s", name, exc)
        return None
    merge_report(report, name, sub, exclude=fg.boundary())
    return dataclasses.replace(fg, graph=work)


@dataclass(frozen=True)
class _ScopedRule:
    """A rule-file override as a function body sees it: it matches ``function/node`` names,
    the names the report and ``explain`` use."""

    rule: object
    prefix: str

    action = property(lambda self: self.rule.action)
    pattern = property(lambda self: self.rule.pattern)
    source = property(lambda self: self.rule.source)

    def matches(self, name: str) -> bool:
        return self.rule.matches(f"{self.prefix}/{name}")


def rules_for(rules, names, prefix: str | None = None):
    """``rules`` with only the overrides that match one of ``names`` (``prefix/name`` inside
    function ``prefix``): painting one graph of many must not warn about overrides meant for
    another."""
    scoped = [r if prefix is None else _ScopedRule(r, prefix) for r in rules.node_rules]
    return dataclasses.replace(rules, node_rules=[r for r in scoped
                                                  if any(r.matches(n) for n in names)])


def main_options(options, graph: Graph, library: function_pb2.FunctionDefLibrary):
    """``options`` for painting the graph itself: ``--keep`` names of function nodes
    (``function/node``, as the report names them) are checked here and left to the bodies."""
    bodies = {f.signature.name: {nd.name for nd in f.node_def} for f in library.function}
    mine = []
    for name in options.keep:
        if name in graph:
            mine.append(name)
            continue
        function, _, node = name.partition("/")
        while function not in bodies and node:
            head, _, node = node.partition("/")
            function = f"{function}/{head}"
        if node not in bodies.get(function, ()):
            raise InputError(f"--keep names no node {name!r}")
    return dataclasses.replace(options, keep=tuple(mine))


def warn_unmatched(rules, report) -> None:
    """Warn about each override that matches no node of the report (graph or function): each
    graph was painted with only the overrides that match in it (:func:`rules_for`)."""
    names = [n.name for n in report.nodes]
    for rule in rules.node_rules:
        if not any(rule.matches(n) for n in names):
            msg = f"override {rule.pattern} ({rule.source}) matches no node"
            report.warnings.append(msg)
            log.warning(msg)


def merge_report(report, prefix: str, sub, exclude=()) -> None:
    """Append ``sub``'s nodes, casts and warnings to ``report``, named ``prefix/name``."""
    skip = set(exclude)
    for node in sub.nodes:
        if node.name not in skip:
            report.nodes.append(dataclasses.replace(node, name=f"{prefix}/{node.name}"))
    report.casts_added.extend(f"{prefix}/{n}" for n in sub.casts_added)
    report.casts_removed.extend(f"{prefix}/{n}" for n in sub.casts_removed)
    report.consts_converted.extend(f"{prefix}/{n}" for n in sub.consts_converted)
    report.warnings.extend(f"function {prefix!r}: {w}" for w in sub.warnings)


_WHILE = ("While", "StatelessWhile")
_BRANCH = ("If", "StatelessIf", "Case", "StatelessCase")
_CALL = ("PartitionedCall", "StatefulPartitionedCall")


class BoundaryLowering:
    """Moves float32 function boundaries that only carry casts into the target dtype.

    A boundary is lowered only where the values crossing it are rounded to the target anyway,
    so results do not change (beyond a While loop that runs zero times returning its input
    rounded): an input whose callee arguments are only read by casts to the target, an output
    whose callee results come from exact widening casts (target -> float). For a ``While``
    loop-carried value this takes the two casts per iteration out of the loop. A callee that
    is also called elsewhere, or is a root (its signature is an interface), is copied first.
    """

    def __init__(self, graphs: dict[str, FunctionGraph], main: Graph, roots: set[str],
                 signatures: dict, target: int, inserted: set[str] = frozenset(),
                 protected: set[str] = frozenset()):
        self.graphs = graphs
        self.main = main
        self.protected = set(protected)      # the graph's own interface nodes: never retyped
        self.roots = roots
        self.signatures = signatures
        self.target = target
        self.specialized: list[str] = []
        self.lowered = 0
        self.inserted = set(inserted)        # report names of the casts painting inserted
        self.casts_added: list[str] = []     # report names: ``function/node``, or ``node``
        self.casts_removed: list[str] = []
        self.input_casts_removed: list[str] = []   # of those, casts the input had
        self.copied_casts: list[str] = []    # inserted casts inside specialized copies
        self.changed: set[str | None] = set()   # owners (None: the main graph) and callees edited

    # ------------------------------------------------------------- bookkeeping
    def _owners(self):
        yield None, self.main
        for name, fg in list(self.graphs.items()):
            yield name, fg.graph

    def _refcount(self, fname: str) -> int:
        names = set(self.graphs)
        count = 1 if fname in self.roots else 0
        for _, graph in self._owners():
            for node in graph.nodes():
                count += called_functions(node.proto, names).count(fname)
        return count

    def _callee_slots(self, node) -> list[tuple[str, int]]:
        """``(attr, list index or -1)`` of each function a functional node calls."""
        if node.op in _WHILE:
            return [("cond", -1), ("body", -1)]
        if node.op in ("If", "StatelessIf"):
            return [("then_branch", -1), ("else_branch", -1)]
        if node.op in ("Case", "StatelessCase"):
            return [("branches", i) for i in range(len(node.attr["branches"].list.func))]
        return [("f", -1)]

    @staticmethod
    def _slot_ref(node, slot):
        attr, index = slot
        return node.attr[attr].func if index < 0 else node.attr[attr].list.func[index]

    def _callees(self, node) -> list[FunctionGraph] | None:
        names = [self._slot_ref(node, s).name for s in self._callee_slots(node)]
        if not all(n in self.graphs for n in names):
            return None
        return [self.graphs[n] for n in names]

    def _own(self, node) -> list[FunctionGraph]:
        """The callees of ``node``, each copied first if anything else calls it."""
        out = []
        for slot in self._callee_slots(node):
            ref = self._slot_ref(node, slot)
            if self._refcount(ref.name) > 1:
                ref.name = self._copy(ref.name)
            out.append(self.graphs[ref.name])
            self.changed.add(ref.name)
        return out

    def _copy(self, fname: str) -> str:
        fg = self.graphs[fname]
        i = 1
        while f"{fname}_amp{i}" in self.signatures:
            i += 1
        name = f"{fname}_amp{i}"
        fdef = function_pb2.FunctionDef()
        fdef.CopyFrom(fg.fdef)
        fdef.signature.name = name
        self.graphs[name] = FunctionGraph(fdef, fg.graph.copy(), list(fg.args), list(fg.rets),
                                          dict(fg.defaults))
        self.signatures[name] = fdef.signature
        self.specialized.append(name)
        self.copied_casts.extend(f"{name}/{n.name}" for n in self.graphs[name].graph.nodes()
                                 if n.meta.get("amp_inserted"))
        return name

    # ------------------------------------------------------------- predicates
    def _narrowing_readers(self, graph: Graph, ref: TensorRef) -> list[str] | None:
        """The readers of ``ref`` if every one is a Cast float -> target, else None."""
        readers = graph.consumers(ref.node, ref.port)
        names = [r for r, _ in readers]
        for name in names:
            node = graph.node(name)
            if cast_types(node) != (FLOAT, self.target) or graph.control_consumers(name):
                return None
        return names

    def _widened(self, graph: Graph, ref: TensorRef) -> TensorRef | None:
        """The target-dtype tensor ``ref`` exactly widens (a Cast target -> float), else None."""
        return widened_source(graph, ref, self.target)

    def _arg_ok(self, fg: FunctionGraph, k: int, need_reader: bool) -> bool:
        readers = self._narrowing_readers(fg.graph, TensorRef(fg.args[k]))
        return readers is not None and (bool(readers) or not need_reader)

    def _ret_ok(self, fg: FunctionGraph, j: int) -> bool:
        return self._widened(fg.graph, fg.graph.input(fg.rets[j], 0)) is not None

    # ------------------------------------------------------------- edits
    def _lower_arg(self, fg: FunctionGraph, k: int) -> None:
        graph, arg = fg.graph, fg.args[k]
        graph.node(arg).attr["dtype"].type = self.target
        for reader in self._narrowing_readers(graph, TensorRef(arg)):
            graph.replace_uses(TensorRef(reader), TensorRef(arg))
            self._remove(graph, reader)

    def _lower_ret(self, fg: FunctionGraph, j: int) -> None:
        graph, sentinel = fg.graph, fg.rets[j]
        old = graph.input(sentinel, 0)
        graph.set_input(sentinel, 0, self._widened(graph, old))
        graph.node(sentinel).attr["T"].type = self.target
        self._drop_if_unread(graph, old.node)

    def _drop_if_unread(self, graph: Graph, name: str) -> None:
        if not graph.consumers(name) and not graph.control_consumers(name):
            self._remove(graph, name)

    def _qualified(self, graph: Graph, name: str) -> str:
        owner = next((n for n, fg in self.graphs.items() if fg.graph is graph), None)
        return name if owner is None else f"{owner}/{name}"

    def _remove(self, graph: Graph, name: str) -> None:
        qualified = self._qualified(graph, name)
        self.casts_removed.append(qualified)
        if not graph.node(name).meta.get("amp_inserted") and qualified not in self.inserted:
            self.input_casts_removed.append(qualified)
        graph.remove_node(name)

    def _cast(self, graph: Graph, ref: TensorRef, src: int, dst: int) -> TensorRef:
        """A Cast of ``ref`` from ``src`` to ``dst``: an existing one, else a new one."""
        for reader, _ in graph.consumers(ref.node, ref.port):
            if cast_types(graph.node(reader)) == (src, dst):
                return TensorRef(reader)
        new = insert_cast(graph, ref, src, dst)
        self.casts_added.append(self._qualified(graph, new.node))
        return new

    def _feed_lowp(self, graph: Graph, node: str, port: int) -> None:
        """Make input ``port`` of ``node`` read a target-dtype tensor."""
        ref = graph.input(node, port)
        source = self._widened(graph, ref)
        graph.set_input(node, port, source or self._cast(graph, ref, FLOAT, self.target))
        if source is not None:
            self._drop_if_unread(graph, ref.node)

    def _read_lowp(self, graph: Graph, node: str, port: int) -> None:
        """Output ``port`` of ``node`` is now in the target dtype: fix its readers."""
        out = TensorRef(node, port)
        for reader, reader_port in graph.consumers(node, port):
            if cast_types(graph.node(reader)) == (FLOAT, self.target) and \
                    not graph.control_consumers(reader):
                graph.replace_uses(TensorRef(reader), out)
                self._remove(graph, reader)
            else:
                graph.set_input(reader, reader_port, self._cast(graph, out, self.target, FLOAT))

    # ------------------------------------------------------------- sites
    def run(self, rounds: int = 8) -> None:
        """Lower boundaries until nothing changes (one lowering can enable the next)."""
        for _ in range(rounds):
            before = self.lowered
            for owner, graph in list(self._owners()):
                for node in list(graph.nodes()):
                    if node.name in graph and node.op in _WHILE + _BRANCH + _CALL:
                        self._site(owner, graph, graph.node(node.name))
            if self.lowered == before:
                return

    def _site(self, owner, graph: Graph, node) -> None:
        if self._callees(node) is None or (owner is None and node.name in self.protected):
            return
        if node.op in _WHILE:
            for i, dtype in enumerate(node.attr["T"].list.type):
                # an output of the graph nothing reads may be fetched: it keeps its dtype
                fetched = owner is None and not graph.consumers(node.name, i)
                if dtype == FLOAT and not fetched and self._while_var_ok(node, i):
                    self._lower_while_var(owner, graph, node, i)
            return
        offset = 1 if node.op in _BRANCH else 0
        for k, dtype in enumerate(node.attr["Tin"].list.type):
            if dtype == FLOAT and self._input_ok(graph, node, k, offset):
                self._lower_input(owner, graph, node, k, offset)
        for j, dtype in enumerate(node.attr["Tout"].list.type):
            if dtype == FLOAT and self._output_ok(graph, node, j):
                self._lower_output(owner, graph, node, j)

    def _while_var_ok(self, node, i: int) -> bool:
        cond, body = self._callees(node)
        return (self._arg_ok(body, i, need_reader=True) and self._ret_ok(body, i)
                and self._arg_ok(cond, i, need_reader=False))

    def _lower_while_var(self, owner, graph: Graph, node, i: int) -> None:
        cond, body = self._own(node)
        node.attr["T"].list.type[i] = self.target
        self._lower_arg(body, i)
        self._lower_ret(body, i)
        self._lower_arg(cond, i)
        self._feed_lowp(graph, node.name, i)
        self._read_lowp(graph, node.name, i)
        self._done(owner)

    def _input_ok(self, graph: Graph, node, k: int, offset: int) -> bool:
        callees = self._callees(node)
        return (self._widened(graph, graph.input(node.name, k + offset)) is not None
                and all(self._arg_ok(fg, k, need_reader=False) for fg in callees)
                and any(self._arg_ok(fg, k, need_reader=True) for fg in callees))

    def _lower_input(self, owner, graph: Graph, node, k: int, offset: int) -> None:
        for fg in self._own(node):
            self._lower_arg(fg, k)
        node.attr["Tin"].list.type[k] = self.target
        self._feed_lowp(graph, node.name, k + offset)
        self._done(owner)

    def _output_ok(self, graph: Graph, node, j: int) -> bool:
        readers = self._narrowing_readers(graph, TensorRef(node.name, j))
        return bool(readers) and all(self._ret_ok(fg, j) for fg in self._callees(node))

    def _lower_output(self, owner, graph: Graph, node, j: int) -> None:
        for fg in self._own(node):
            self._lower_ret(fg, j)
        node.attr["Tout"].list.type[j] = self.target
        self._read_lowp(graph, node.name, j)
        self._done(owner)

    def _done(self, owner) -> None:
        self.lowered += 1
        self.changed.add(owner)

    def summary(self) -> dict:
        return {"boundaries_lowered": self.lowered, "specialized": list(self.specialized),
                "casts_inserted": len(self.casts_added), "casts_removed": len(self.casts_removed),
                "summary": f"{self.lowered} function boundaries moved to low precision, "
                           f"{len(self.specialized)} functions specialized, casts "
                           f"+{len(self.casts_added)}/-{len(self.casts_removed)}"}


# ----------------------------------------------------------------- consistency
def check_call_types(graph_def: graph_pb2.GraphDef) -> list[str]:
    """Every call site's type lists equal its callees' signatures (While: T = cond = body)."""
    sigs = {f.signature.name: f.signature for f in graph_def.library.function}
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
    if nd.op in _WHILE:
        t = _types(nd, "T")
        return [(nd.attr["cond"].func.name, t, None), (nd.attr["body"].func.name, t, t)]
    if nd.op in ("If", "StatelessIf"):
        tin, tout = _types(nd, "Tin"), _types(nd, "Tout")
        return [(nd.attr[b].func.name, tin, tout) for b in ("then_branch", "else_branch")]
    if nd.op in ("Case", "StatelessCase"):
        tin, tout = _types(nd, "Tin"), _types(nd, "Tout")
        return [(f.name, tin, tout) for f in nd.attr["branches"].list.func]
    if nd.op in _CALL:
        return [(nd.attr["f"].func.name, _types(nd, "Tin"), _types(nd, "Tout"))]
    return []


def direct_call_feeders(graph: Graph, library: function_pb2.FunctionDefLibrary) -> set[str]:
    """Nodes that feed or read a direct call of a library function (op = function name).

    They are kept float32: such a call has no OpDef, so the cast pass cannot learn the dtypes
    its ports carry, and function arguments and results stay float32.
    """
    names = {f.signature.name for f in library.function}
    out = set()
    for node in graph.nodes():
        if node.op in names:
            out.update(ref.node for ref in graph.inputs(node.name))
            out.update(reader for reader, _ in graph.consumers(node.name))
    return out
