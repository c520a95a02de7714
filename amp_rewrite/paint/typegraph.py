"""The graph painting walks: type attributes as nodes, joined where data flows between them.

Two attributes are joined when a data edge runs from a port the first governs to a port the
second governs (``MatMul.T`` -> ``Relu.T``), and the writers of one TensorList are joined to
its readers (their ``element_dtype``), which no data edge joins directly.
"""

from __future__ import annotations

from ..dtypes import FLOAT, VARIANT
from ..ir import Graph
from ..ops import is_tensorlist_op
from ..signatures import TypeAttr, node_types, output_dtype
from .decisions import TNode

ELEMENT_DTYPE = TypeAttr("element_dtype")


class TypeGraph:
    """Type attributes of ``graph`` numbered in ``order``, with their fan-in and fan-out."""

    def __init__(self, graph: Graph, order: list[str]):
        self.graph = graph
        self.items: list[TNode] = []
        self.index: dict[TNode, int] = {}
        typed = {}   # name -> its port layout, for the nodes TensorFlow registers
        for name in order:
            types = node_types(graph.node(name))
            if types is None:
                continue
            typed[name] = types
            for attr in types.attrs:
                self.index[(name, attr)] = len(self.items)
                self.items.append((name, attr))
        self.fanin: list[set[int]] = [set() for _ in self.items]
        self.fanout: list[set[int]] = [set() for _ in self.items]
        index = self.index
        for dst in graph.names():
            dst_types = typed.get(dst)
            if dst_types is None:
                continue
            for port, ref in enumerate(graph.inputs(dst)):
                src_types = typed.get(ref.node)
                if src_types is None:
                    continue
                if ref.port >= len(src_types.outputs) or port >= len(dst_types.inputs):
                    continue
                a, b = src_types.outputs[ref.port].attr, dst_types.inputs[port].attr
                if a is not None and b is not None:
                    self.add_edge(index[(ref.node, a)], index[(dst, b)])
        self.clusters = tensorlist_clusters(graph)
        self._join_tensorlists()
        # the walks' neighbour lists by direction (see dfs)
        self._walk: dict[str, dict[int, tuple[int, ...]]] = {}

    def add_edge(self, a: int, b: int) -> None:
        """Join two items (while the type graph is built: the walks read a sorted copy)."""
        self.fanout[a].add(b)
        self.fanin[b].add(a)

    def dfs(self, roots: list[int], direction: str, enter, visit) -> None:
        """Depth-first from each root on its own: ``enter(idx, root)`` gates each item,
        ``visit(idx, parent, root)`` sees each entered one; ``direction`` is in, out or both."""
        # each item's neighbours sorted once per direction, when first visited: sorted, so the
        # first path found (the reason recorded) does not depend on the order edges were added
        # in; descending, so the lowest is popped first
        order = self._walk.setdefault(direction, {})
        for root in roots:
            stack: list[tuple[int, int | None]] = [(root, None)]
            seen: set[int] = set()
            while stack:
                idx, parent = stack.pop()
                if idx in seen or not enter(idx, root):
                    continue
                seen.add(idx)
                visit(idx, parent, root)
                nbrs = order.get(idx)
                if nbrs is None:
                    nbrs = order[idx] = self._neighbours(idx, direction)
                for n in nbrs:
                    if n not in seen:
                        stack.append((n, idx))

    def _neighbours(self, idx: int, direction: str) -> tuple[int, ...]:
        if direction == "in":
            found = self.fanin[idx]
        elif direction == "out":
            found = self.fanout[idx]
        else:
            found = self.fanin[idx] | self.fanout[idx]
        return tuple(sorted(found, reverse=True))

    def _join_tensorlists(self) -> None:
        """Join the element_dtype of TensorList writers to that of readers of the same list."""
        for members, _ in self.clusters:
            writers, readers = [], []
            for name in members:
                if (name, ELEMENT_DTYPE) not in self.index:
                    continue
                types = node_types(self.graph.node(name))
                if any(p.attr == ELEMENT_DTYPE for p in types.inputs):
                    writers.append(self.index[(name, ELEMENT_DTYPE)])
                if any(p.attr == ELEMENT_DTYPE for p in types.outputs):
                    readers.append(self.index[(name, ELEMENT_DTYPE)])
            for w in writers:
                for r in readers:
                    if w != r:
                        self.add_edge(w, r)


def tensorlist_clusters(graph: Graph) -> list[tuple[list[str], list[str]]]:
    """Groups of float32 TensorList ops whose handles meet, through any op that carries a
    DT_VARIANT (Identity, Reshape, Pack, ConcatLists, loop plumbing ...), as grappler follows
    them: ``(the TensorList ops, the other nodes the handles pass)``."""
    if not any(is_tensorlist_op(node.op) for node in graph.nodes()):
        return []   # no group to find: spare the pass over every edge
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for ref, dst, _ in graph.data_edges():
        if output_dtype(graph.node(ref.node), ref.port) == VARIANT:
            a, b = find(ref.node), find(dst)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[str, list[str]] = {}
    for name in graph.names():
        groups.setdefault(find(name), []).append(name)
    out = []
    for members in groups.values():
        lists = [m for m in members if is_tensorlist_op(graph.node(m).op)
                 and "element_dtype" in graph.node(m).attr
                 and graph.node(m).attr["element_dtype"].type == FLOAT]
        if lists:
            out.append((lists, [m for m in members if not is_tensorlist_op(graph.node(m).op)]))
    return out
