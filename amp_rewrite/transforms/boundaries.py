"""Moving float32 function boundaries that only carry casts into the target dtype.

Function bodies are painted with float32 arguments and results, so casts first sit just inside
each boundary. :class:`BoundaryLowering` then lowers a boundary where the values crossing it are
rounded to the target anyway, so results do not change (beyond a While loop that runs zero
times returning its input rounded):

* a ``While`` loop-carried value whose body reads it only through casts to the target and
  returns it from a widening cast (the two casts per iteration leave the loop);
* an input of ``If``/``Case``/``PartitionedCall`` whose callees read the argument only through
  casts to the target, fed a widened low-precision tensor;
* an output whose callees return widened low-precision tensors, read only through casts to the
  target.

Three parts: :class:`Callees` finds and specializes the functions a call site calls (a callee
also called elsewhere, or a root whose signature is an interface, is copied first);
:class:`CastEdits` reads and rewrites the casts at a boundary, keeping the report's cast lists;
:class:`BoundaryLowering` walks the call sites until nothing more can be lowered.
"""

from __future__ import annotations

from tensorflow.core.framework import function_pb2

from ..core.dtypes import FLOAT
from ..core.ir import Graph, Node, TensorRef
from ..core.ops import BRANCH_OPS, CASE_OPS, FUNCTIONAL_OPS, IF_OPS, WHILE_OPS
from ..schema.functiondef import FunctionGraph, called_functions
from .casts import cast_types, insert_cast, widened_source


class Callees:
    """The library's function graphs and the main graph that calls them.

    ``changed`` collects the owners edited (None: the main graph) and the callees made their
    own; ``specialized`` the names of the copies made.
    """

    def __init__(self, graphs: dict[str, FunctionGraph], main: Graph, roots: set[str],
                 signatures: dict):
        self.graphs, self.main, self.roots, self.signatures = graphs, main, roots, signatures
        self.specialized: list[str] = []
        self.copied_casts: list[str] = []   # report names of inserted casts inside the copies
        self.changed: set[str | None] = set()

    def owners(self):
        """``(owner, graph)`` of the main graph (owner None) and of every function."""
        yield None, self.main
        for name, fg in list(self.graphs.items()):
            yield name, fg.graph

    def qualified(self, graph: Graph, name: str) -> str:
        """The report's name of node ``name`` of ``graph``: ``function/node``, or ``node``."""
        owner = next((n for n, fg in self.graphs.items() if fg.graph is graph), None)
        return name if owner is None else f"{owner}/{name}"

    def of(self, node: Node) -> list[FunctionGraph] | None:
        """The callees of functional ``node``, or None when one is not a painted function."""
        names = [_slot_ref(node, s).name for s in _callee_slots(node)]
        if not all(n in self.graphs for n in names):
            return None
        return [self.graphs[n] for n in names]

    def own(self, node: Node) -> list[FunctionGraph]:
        """The callees of ``node``, each copied first if anything else calls it."""
        out = []
        for slot in _callee_slots(node):
            ref = _slot_ref(node, slot)
            if self._refcount(ref.name) > 1:
                ref.name = self._copy(ref.name)
            out.append(self.graphs[ref.name])
            self.changed.add(ref.name)
        return out

    def _refcount(self, fname: str) -> int:
        names = set(self.graphs)
        count = 1 if fname in self.roots else 0
        for _, graph in self.owners():
            for node in graph.nodes():
                count += called_functions(node.proto, names).count(fname)
        return count

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


def _callee_slots(node: Node) -> list[tuple[str, int]]:
    """``(attr, list index or -1)`` of each function a functional node calls."""
    if node.op in WHILE_OPS:
        return [("cond", -1), ("body", -1)]
    if node.op in IF_OPS:
        return [("then_branch", -1), ("else_branch", -1)]
    if node.op in CASE_OPS:
        return [("branches", i) for i in range(len(node.attr["branches"].list.func))]
    return [("f", -1)]


def _slot_ref(node: Node, slot: tuple[str, int]):
    attr, index = slot
    return node.attr[attr].func if index < 0 else node.attr[attr].list.func[index]


class CastEdits:
    """Reading and rewriting the casts around boundaries, with the report's cast lists:
    ``added`` and ``removed`` (report names), and of the removed ones ``input_removed``, the
    casts the input graph had (not inserted by painting: ``inserted`` names those)."""

    def __init__(self, callees: Callees, target: int, inserted: set[str]):
        self.callees, self.target, self.inserted = callees, target, set(inserted)
        self.added: list[str] = []
        self.removed: list[str] = []
        self.input_removed: list[str] = []

    def narrowing_readers(self, graph: Graph, ref: TensorRef) -> list[str] | None:
        """The readers of ``ref`` if every one is a Cast float -> target, else None."""
        names = [r for r, _ in graph.consumers(ref.node, ref.port)]
        for name in names:
            if cast_types(graph.node(name)) != (FLOAT, self.target) or graph.control_consumers(name):
                return None
        return names

    def widened(self, graph: Graph, ref: TensorRef) -> TensorRef | None:
        """The target-dtype tensor ``ref`` exactly widens (a Cast target -> float), else None."""
        return widened_source(graph, ref, self.target)

    def arg_ok(self, fg: FunctionGraph, k: int, need_reader: bool) -> bool:
        readers = self.narrowing_readers(fg.graph, TensorRef(fg.args[k]))
        return readers is not None and (bool(readers) or not need_reader)

    def ret_ok(self, fg: FunctionGraph, j: int) -> bool:
        return self.widened(fg.graph, fg.graph.input(fg.rets[j], 0)) is not None

    def lower_arg(self, fg: FunctionGraph, k: int) -> None:
        """Argument ``k`` takes the target dtype; its narrowing casts go."""
        graph, arg = fg.graph, fg.args[k]
        graph.node(arg).attr["dtype"].type = self.target
        for reader in self.narrowing_readers(graph, TensorRef(arg)):
            graph.replace_uses(TensorRef(reader), TensorRef(arg))
            self.remove(graph, reader)

    def lower_ret(self, fg: FunctionGraph, j: int) -> None:
        """Result ``j`` returns the tensor its widening cast widened."""
        graph, sentinel = fg.graph, fg.rets[j]
        old = graph.input(sentinel, 0)
        graph.set_input(sentinel, 0, self.widened(graph, old))
        graph.node(sentinel).attr["T"].type = self.target
        self._drop_if_unread(graph, old.node)

    def feed_lowp(self, graph: Graph, node: str, port: int) -> None:
        """Make input ``port`` of ``node`` read a target-dtype tensor."""
        ref = graph.input(node, port)
        source = self.widened(graph, ref)
        graph.set_input(node, port, source or self._cast(graph, ref, FLOAT, self.target))
        if source is not None:
            self._drop_if_unread(graph, ref.node)

    def read_lowp(self, graph: Graph, node: str, port: int) -> None:
        """Output ``port`` of ``node`` is now in the target dtype: fix its readers."""
        out = TensorRef(node, port)
        for reader, reader_port in graph.consumers(node, port):
            if cast_types(graph.node(reader)) == (FLOAT, self.target) and \
                    not graph.control_consumers(reader):
                graph.replace_uses(TensorRef(reader), out)
                self.remove(graph, reader)
            else:
                graph.set_input(reader, reader_port, self._cast(graph, out, self.target, FLOAT))

    def remove(self, graph: Graph, name: str) -> None:
        qualified = self.callees.qualified(graph, name)
        self.removed.append(qualified)
        if not graph.node(name).meta.get("amp_inserted") and qualified not in self.inserted:
            self.input_removed.append(qualified)
        graph.remove_node(name)

    def _drop_if_unread(self, graph: Graph, name: str) -> None:
        if not graph.consumers(name) and not graph.control_consumers(name):
            self.remove(graph, name)

    def _cast(self, graph: Graph, ref: TensorRef, src: int, dst: int) -> TensorRef:
        """A Cast of ``ref`` from ``src`` to ``dst``: an existing one, else a new one."""
        for reader, _ in graph.consumers(ref.node, ref.port):
            if cast_types(graph.node(reader)) == (src, dst):
                return TensorRef(reader)
        new = insert_cast(graph, ref, src, dst)
        self.added.append(self.callees.qualified(graph, new.node))
        return new


class BoundaryLowering:
    """Lowers every boundary it can (see the module doc); ``protected`` names the main graph's
    interface nodes, which are never retyped."""

    def __init__(self, graphs: dict[str, FunctionGraph], main: Graph, roots: set[str],
                 signatures: dict, target: int, inserted: set[str] = frozenset(),
                 protected: set[str] = frozenset()):
        self.callees = Callees(graphs, main, roots, signatures)
        self.casts = CastEdits(self.callees, target, inserted)
        self.target = target
        self.protected = set(protected)
        self.lowered = 0

    def run(self, rounds: int = 8) -> None:
        """Lower boundaries until nothing changes (one lowering can enable the next)."""
        for _ in range(rounds):
            before = self.lowered
            for owner, graph in list(self.callees.owners()):
                for node in list(graph.nodes()):
                    if node.name in graph and node.op in FUNCTIONAL_OPS:
                        self._site(owner, graph, graph.node(node.name))
            if self.lowered == before:
                return

    def _site(self, owner, graph: Graph, node: Node) -> None:
        if self.callees.of(node) is None or (owner is None and node.name in self.protected):
            return
        if node.op in WHILE_OPS:
            for i, dtype in enumerate(node.attr["T"].list.type):
                # an output of the graph nothing reads may be fetched: it keeps its dtype
                fetched = owner is None and not graph.consumers(node.name, i)
                if dtype == FLOAT and not fetched and self._while_var_ok(node, i):
                    self._lower_while_var(owner, graph, node, i)
            return
        offset = 1 if node.op in BRANCH_OPS else 0
        for k, dtype in enumerate(node.attr["Tin"].list.type):
            if dtype == FLOAT and self._input_ok(graph, node, k, offset):
                self._lower_input(owner, graph, node, k, offset)
        for j, dtype in enumerate(node.attr["Tout"].list.type):
            if dtype == FLOAT and self._output_ok(graph, node, j):
                self._lower_output(owner, graph, node, j)

    def _while_var_ok(self, node: Node, i: int) -> bool:
        cond, body = self.callees.of(node)
        return (self.casts.arg_ok(body, i, need_reader=True) and self.casts.ret_ok(body, i)
                and self.casts.arg_ok(cond, i, need_reader=False))

    def _lower_while_var(self, owner, graph: Graph, node: Node, i: int) -> None:
        cond, body = self.callees.own(node)
        node.attr["T"].list.type[i] = self.target
        self.casts.lower_arg(body, i)
        self.casts.lower_ret(body, i)
        self.casts.lower_arg(cond, i)
        self.casts.feed_lowp(graph, node.name, i)
        self.casts.read_lowp(graph, node.name, i)
        self._done(owner)

    def _input_ok(self, graph: Graph, node: Node, k: int, offset: int) -> bool:
        callees = self.callees.of(node)
        return (self.casts.widened(graph, graph.input(node.name, k + offset)) is not None
                and all(self.casts.arg_ok(fg, k, need_reader=False) for fg in callees)
                and any(self.casts.arg_ok(fg, k, need_reader=True) for fg in callees))

    def _lower_input(self, owner, graph: Graph, node: Node, k: int, offset: int) -> None:
        for fg in self.callees.own(node):
            self.casts.lower_arg(fg, k)
        node.attr["Tin"].list.type[k] = self.target
        self.casts.feed_lowp(graph, node.name, k + offset)
        self._done(owner)

    def _output_ok(self, graph: Graph, node: Node, j: int) -> bool:
        readers = self.casts.narrowing_readers(graph, TensorRef(node.name, j))
        return bool(readers) and all(self.casts.ret_ok(fg, j) for fg in self.callees.of(node))

    def _lower_output(self, owner, graph: Graph, node: Node, j: int) -> None:
        for fg in self.callees.own(node):
            self.casts.lower_ret(fg, j)
        node.attr["Tout"].list.type[j] = self.target
        self.casts.read_lowp(graph, node.name, j)
        self._done(owner)

    def _done(self, owner) -> None:
        self.lowered += 1
        self.callees.changed.add(owner)

    def summary(self) -> dict:
        added, removed = len(self.casts.added), len(self.casts.removed)
        specialized = self.callees.specialized
        return {"boundaries_lowered": self.lowered, "specialized": list(specialized),
                "casts_inserted": added, "casts_removed": removed,
                "summary": f"{self.lowered} function boundaries moved to low precision, "
                           f"{len(specialized)} functions specialized, casts +{added}/-{removed}"}
