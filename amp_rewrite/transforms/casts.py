"""Apply a :class:`~amp_rewrite.paint.Painting`: change type attributes and insert casts.

Promises:

* one Cast per (source tensor, target dtype), shared by all consumers, placed on the source
  node's device and named ``<source>/amp_<dtype>`` (``_<port>`` for outputs other than 0);
* no half -> float -> half chains: where a low-precision consumer would read the float32
  output of a widening Cast (half/bfloat16 -> float, which is exact), it reads the Cast's input;
  a Cast left with no reader at all is removed;
* Consts painted by the painting are stored in the target dtype (no run-time cast).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import attr_value_pb2

from ..core.dtypes import CONVERTIBLE, FLOAT, LOW_PRECISION, dtype_name
from ..core.ir import Graph, TensorRef
from ..paint import Painting
from ..schema import consts
from ..schema.opdefs import TypeAttr, input_dtype, output_dtype, set_dtype
from ..schema.snapshot import Before


@dataclass
class CastStats:
    added: list[str] = field(default_factory=list)      # names of inserted casts
    folded: int = 0                                       # consumers that skipped a cast chain
    removed: list[str] = field(default_factory=list)     # original casts left unused, removed
    consts: list[str] = field(default_factory=list)      # Consts stored in low precision
    touched: set[str] = field(default_factory=set)        # nodes retyped, added or rewired

    def touched_and_readers(self, graph: Graph) -> set[str]:
        """The touched nodes still in ``graph`` and the readers of each (a retyped node changes
        the dtype its readers get): the nodes whose input edges a change can have broken, which
        the casts step and the lint of the result look at."""
        scope = {n for n in self.touched if n in graph}
        for name in list(scope):
            scope.update(reader for reader, _ in graph.consumers(name))
        return scope


def apply_painting(graph: Graph, painting: Painting, before: Before) -> CastStats:
    """Rewrite ``graph`` in place to the dtypes ``painting`` decided; returns what was added.

    ``before`` records the graph before painting: an op TensorFlow does not register (a custom
    op) has no OpDef to say what it reads or makes, so its edges keep the dtypes they had.
    """
    stats = CastStats()
    originally_read = {n for n in graph.names() if graph.is_read(n)}
    retargeted = {name for (name, attr), d in painting.decisions.items()
                  if d.code == "cast_retargeted" and attr == TypeAttr("DstT")}
    _retype(graph, painting, stats)
    cast_edges(graph, before, retargeted, stats)
    _drop_unread_casts(graph, originally_read, retargeted, stats)
    return stats


def _retype(graph: Graph, painting: Painting, stats: CastStats) -> None:
    """Set every painted type attribute to the target; Consts convert their values."""
    for (name, attr), decision in sorted(painting.decisions.items()):
        if not decision.lowp:
            continue
        node = graph.node(name)
        set_dtype(node, attr, painting.target)
        stats.touched.add(name)
        if node.op == "Const" and attr.attr == "dtype":
            consts.convert(node, painting.target)
            stats.consts.append(name)


def cast_edges(graph: Graph, before: Before, retargeted: set[str], stats: CastStats) -> None:
    """Put a cast on every edge whose two ends now disagree (one per source tensor and dtype).

    The input's edges all agreed (``check_input``), so only those into or out of a node the
    painting retyped (``stats.touched`` so far) can disagree now; they are visited in listing
    order all the same, so casts get the same names whatever else the graph holds.
    """
    made: dict[tuple[TensorRef, int], TensorRef] = {}
    scope = stats.touched_and_readers(graph)
    for name in [n for n in graph.names() if n in scope]:
        for port, ref in enumerate(graph.inputs(name)):
            have = output_dtype(graph.node(ref.node), ref.port)
            want = input_dtype(graph.node(name), port)
            if have is None or want is None:
                was = before.edge_dtype(name, port)
                have = was if have is None else have
                want = was if want is None else want
            if have == want or have not in CONVERTIBLE or want not in CONVERTIBLE:
                continue
            stats.touched.add(name)
            if name in retargeted and have in LOW_PRECISION:
                # a retargeted Cast reads the low-precision tensor itself: no cast in front
                set_dtype(graph.node(name), TypeAttr("SrcT"), have)
                continue
            source = widened_source(graph, ref, want)
            if source is not None:
                graph.set_input(name, port, source)
                stats.folded += 1
                continue
            key = (ref, want)
            if key not in made:
                made[key] = insert_cast(graph, ref, have, want)
                stats.added.append(made[key].node)
                stats.touched.add(made[key].node)
            graph.set_input(name, port, made[key])


def _drop_unread_casts(graph: Graph, originally_read: set[str], retargeted: set[str],
                       stats: CastStats) -> None:
    """Remove the input's Casts nothing reads any more; a retargeted Cast that now casts a
    dtype to itself hands its readers its input first."""
    for name in list(graph.names()):
        node = graph.node(name)
        if node.op != "Cast" or name not in originally_read:
            continue
        if (name in retargeted and cast_types(node)[0] == cast_types(node)[1]
                and not graph.control_consumers(name)):
            stats.touched.update(reader for reader, _ in graph.consumers(name))
            graph.replace_uses(TensorRef(name, 0), graph.input(name, 0))
        if not graph.consumers(name) and not graph.control_consumers(name):
            graph.remove_node(name)
            stats.removed.append(name)


def cast_types(node) -> tuple[int, int] | None:
    """``(SrcT, DstT)`` of a Cast node, else None."""
    if node.op != "Cast":
        return None
    return node.attr["SrcT"].type, node.attr["DstT"].type


def widened_source(graph: Graph, ref: TensorRef, want: int) -> TensorRef | None:
    """If ``ref`` is an exact widening Cast (``want`` -> float) of a ``want``-typed tensor, that
    tensor: a ``want`` reader can take it and skip the round trip."""
    if ref.port == 0 and want in LOW_PRECISION and cast_types(graph.node(ref.node)) == (want, FLOAT):
        return graph.input(ref.node, 0)
    return None


def insert_cast(graph: Graph, ref: TensorRef, src: int, dst: int) -> TensorRef:
    """A new Cast of ``ref`` from ``src`` to ``dst``, on the source's device, listed after it."""
    base = f"{ref.node}/amp_{dtype_name(dst)}" + (f"_{ref.port}" if ref.port else "")
    attrs = {
        "SrcT": attr_value_pb2.AttrValue(type=src),
        "DstT": attr_value_pb2.AttrValue(type=dst),
        "Truncate": attr_value_pb2.AttrValue(b=False),
    }
    node = graph.add_node("Cast", base, [ref], attrs, device=graph.node(ref.node).device,
                          after=ref.node)
    node.meta["amp_inserted"] = True
    return TensorRef(node.name, 0)
