"""What a graph held before a conversion changed it in place: what the report and the lint
compare the result with.

A conversion used to keep a whole copy of the graph for that, as much memory again as the IR
itself; the comparisons need far less: each node's name and op in listing order, the dtype
each of its type attributes held, and, for the edges into or out of an op TensorFlow does not
register (whose dtypes nothing else vouches for), the dtype each carried.
"""

from __future__ import annotations

from ..core.dtypes import LOW_PRECISION
from ..core.ir import Graph
from .opdefs import TypeAttr, edge_dtype, get_dtype, node_types


class Before:
    """A record of ``graph`` as it is now (see the module doc); the graph itself is not kept."""

    def __init__(self, graph: Graph):
        self._ops: dict[str, str] = {}   # name -> op, in listing order
        # name -> (the node's type attributes, the dtype each held); the attrs tuple is the
        # one the type model shares between nodes of the same layout
        self._dtypes: dict[str, tuple[tuple[TypeAttr, ...], tuple[int, ...]]] = {}
        self._edges: dict[tuple[str, int], int] = {}
        unregistered: list[str] = []
        self.unregistered_ops = set()   # ops of nodes TensorFlow does not register
        self.low_precision: list[str] = []   # nodes with a type attribute already 16-bit
        for node in graph.nodes():
            self._ops[node.name] = node.op
            types = node_types(node)
            if types is None:
                unregistered.append(node.name)
                self.unregistered_ops.add(node.op)
                continue
            dtypes = tuple(get_dtype(node, a) for a in types.attrs)
            self._dtypes[node.name] = (types.attrs, dtypes)
            if any(d in LOW_PRECISION for d in dtypes):
                self.low_precision.append(node.name)
        edges = {(name, port, ref) for name in unregistered
                 for port, ref in enumerate(graph.inputs(name))}
        edges.update((reader, port, graph.input(reader, port)) for name in unregistered
                     for reader, port in graph.consumers(name))
        for name, port, ref in edges:
            was = edge_dtype(graph.node(ref.node), ref.port, graph.node(name), port)
            if was is not None:
                self._edges[(name, port)] = was

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def nodes(self) -> list[tuple[str, str]]:
        """``(name, op)`` of every node, in the graph's listing order."""
        return list(self._ops.items())

    def dtypes(self, name: str) -> dict[TypeAttr, int]:
        """The dtype each type attribute of ``name`` held (empty: an unregistered op or no node)."""
        attrs, dtypes = self._dtypes.get(name, ((), ()))
        return dict(zip(attrs, dtypes))

    def dtype(self, name: str, attr: TypeAttr) -> int | None:
        """The dtype ``attr`` of ``name`` held; None if the node or the attribute was not there."""
        return self.dtypes(name).get(attr)

    def edge_dtype(self, name: str, port: int) -> int | None:
        """The dtype input ``port`` of ``name`` carried, for the edges touching an op TensorFlow
        does not register (None for the others, or when nothing told the dtype)."""
        return self._edges.get((name, port))
