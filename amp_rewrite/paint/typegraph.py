"""The graph painting walks: type attributes as nodes, joined where data flows between them.

Two attributes are joined when a data edge runs from a port the first governs to a port the
second governs (``MatMul.T`` -> ``Relu.T``), and the writers of one TensorList are joined to
its readers (their ``element_dtype``), which no data edge joins directly.
"""

from __future__ import annotations

from ..core.dtypes import FLOAT
from ..core.ir import Graph
from ..core.ops import is_tensorlist_op
from ..schema.opdefs import NodeTypes, TypeAttr, node_types, tensorlist_groups
from .decisions import TNode

ELEMENT_DTYPE = TypeAttr("element_dtype")


class TypeGraph:
    """Type attributes of ``graph`` numbered in ``order``, with their fan-in and fan-out."""

    def __init__(self, graph: Graph, order: list[str]):
        self.graph = graph
        self.items: list[TNode] = []
        # a node's items are numbered consecutively from its first; nodes of one port layout
        # share one NodeTypes, so each attr's offset, and each port's, is worked out per layout
        self._first: dict[str, int] = {}
        self._layout: dict[str, _Offsets] = {}
        offsets: dict[int, _Offsets] = {}
        items = self.items
        for name in order:
            types = node_types(graph.node(name))
            if types is None:
                continue
            layout = offsets.get(id(types))
            if layout is None:
                layout = offsets[id(types)] = _Offsets(types)
            self._first[name] = len(items)
            self._layout[name] = layout
            items.extend((name, attr) for attr in types.attrs)
        self.fanin: list[set[int]] = [set() for _ in items]
        self.fanout: list[set[int]] = [set() for _ in items]
        first, layouts, fanin, fanout = self._first, self._layout, self.fanin, self.fanout
        for dst in graph.names():
            dst_layout = layouts.get(dst)
            if dst_layout is None:
                continue
            dst_first, dst_ports = first[dst], dst_layout.inputs
            for port, ref in enumerate(graph.inputs(dst)):
                src_layout = layouts.get(ref.node)
                if src_layout is None or port >= len(dst_ports):
                    continue
                b = dst_ports[port]
                a = src_layout.outputs[ref.port] if ref.port < len(src_layout.outputs) else None
                if a is not None and b is not None:
                    a += first[ref.node]
                    b += dst_first
                    fanout[a].add(b)   # add_edge, inline: once per edge of the graph
                    fanin[b].add(a)
        self.clusters = tensorlist_clusters(graph)
        self._join_tensorlists()
        # the walks' neighbour lists by direction (see dfs)
        self._walk: dict[str, dict[int, tuple[int, ...]]] = {}

    def item(self, name: str, attr: TypeAttr) -> int | None:
        """The number of ``(name, attr)``, or None if it is not an item."""
        layout = self._layout.get(name)
        offset = None if layout is None else layout.attrs.get(attr)
        return None if offset is None else self._first[name] + offset

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
                idx = self.item(name, ELEMENT_DTYPE)
                if idx is None:
                    continue
                types = node_types(self.graph.node(name))
                if any(p.attr == ELEMENT_DTYPE for p in types.inputs):
                    writers.append(idx)
                if any(p.attr == ELEMENT_DTYPE for p in types.outputs):
                    readers.append(idx)
            for w in writers:
                for r in readers:
                    if w != r:
                        self.add_edge(w, r)


class _Offsets:
    """One port layout's offsets from a node's first item: of each type attr, and of the attr
    governing each input and output port (None: a port of fixed dtype)."""

    __slots__ = ("attrs", "inputs", "outputs")

    def __init__(self, types: NodeTypes):
        self.attrs = {attr: i for i, attr in enumerate(types.attrs)}
        self.inputs = tuple(None if p.attr is None else self.attrs[p.attr] for p in types.inputs)
        self.outputs = tuple(None if p.attr is None else self.attrs[p.attr] for p in types.outputs)


def tensorlist_clusters(graph: Graph) -> list[tuple[list[str], list[str]]]:
    """Groups of float32 TensorList ops whose handles meet, through any op that carries a
    DT_VARIANT (Identity, Reshape, Pack, ConcatLists, loop plumbing ...), as grappler follows
    them: ``(the TensorList ops, the other nodes the handles pass)``."""
    out = []
    for members in tensorlist_groups(graph):
        lists = [m for m in members if is_tensorlist_op(graph.node(m).op)
                 and "element_dtype" in graph.node(m).attr
                 and graph.node(m).attr["element_dtype"].type == FLOAT]
        if lists:
            out.append((lists, [m for m in members if not is_tensorlist_op(graph.node(m).op)]))
    return out
