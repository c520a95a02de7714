"""Painting: decide, per (node, type attribute), whether it runs in low precision, and why.

The baseline is grappler's ``auto_mixed_precision`` pass (see README "How we decide"):

1. allow ops are painted (where a kernel for the target dtype exists on the node's device);
2. deny spreads forward from deny ops through infer/clear ops that lie upstream of other
   infer/deny ops;
3. infer/clear ops on a path between two allow ops are painted;
4. (rule setting ``infer_follows_allow``, on for bfloat16) an infer op fed by an allow op and
   by no deny op is painted;
5. allow spreads both ways through clear ops (but not back into reads of ref variables);
6. v1 loop back edges (NextIteration -> Merge) and TensorList clusters must agree;
7. per-node overrides from rule files are applied (keep_fp32 blocks, force_lowp paints);
8. existing Casts whose consumers are all low precision, and Consts (and with ``lowp_io``
   Placeholders) read only in low precision, are painted too, so no run-time cast is needed.

Every (node, attribute) gets a :class:`Decision` with its reason at the moment it is made;
the report and ``explain`` read these, they never recompute.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from .errors import InputError
from .ir import Graph, Node
from .rules import RuleSet
from .types import (FLOAT, HALF, TARGET_NAMES, TypeAttr, device_type, dtype_name, get_dtype, kernel_supports,
                    node_types, output_dtype)

log = logging.getLogger(__name__)

TNode = tuple[str, TypeAttr]

# Ops that hold or move the model's state. Their dtypes never change: weights stay float32 on
# disk and in memory (master weights), and a Cast follows each read.
VARIABLE_OPS = frozenset({
    "VarHandleOp", "VariableV2", "Variable", "ReadVariableOp", "AssignVariableOp",
    "AssignAddVariableOp", "AssignSubVariableOp", "Assign", "AssignAdd", "AssignSub",
    "VarIsInitializedOp", "IsVariableInitialized", "ResourceGather", "ResourceGatherNd",
    "DestroyResourceOp", "_VarHandlesOp", "_ReadVariablesOp",
})
PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderWithDefault", "PlaceholderV2"})
# Ops a TensorList handle (a DT_VARIANT) passes through unchanged.
_VARIANT_PASSTHROUGH = frozenset({
    "Identity", "IdentityN", "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge",
    "Switch", "RefSwitch", "NextIteration", "RefNextIteration", "StopGradient", "Snapshot",
})
_MATRIX_HINT = {"GPU": "Tensor Cores", "CPU": "AMX/AVX512 matrix units"}


@dataclass(frozen=True)
class Decision:
    """Why one (node, type attribute) ended where it did.

    ``code`` is stable and machine-readable (documented in README "Report schema"); ``text``
    is the sentence ``explain`` prints; ``via`` names the nodes of the chain that forced it,
    from the root cause to the nearest neighbour.
    """

    lowp: bool
    code: str
    text: str
    via: tuple[str, ...] = ()


@dataclass
class Painting:
    """The result of :func:`paint`: which type attributes go low precision, and why each did."""

    target: int
    device: str
    decisions: dict[TNode, Decision] = field(default_factory=dict)
    node_codes: dict[str, Decision] = field(default_factory=dict)  # nodes with no type attrs
    warnings: list[str] = field(default_factory=list)
    _index: dict[str, list[TNode]] = field(default_factory=dict, repr=False, compare=False)
    _indexed: int = field(default=-1, repr=False, compare=False)

    @property
    def lowp(self) -> set[TNode]:
        return {t for t, d in self.decisions.items() if d.lowp}

    def node_decision(self, name: str) -> Decision | None:
        """One decision for the whole node: its first low-precision attr, else its float32 one."""
        mine = [self.decisions[t] for t in self._attrs_of(name)]
        for d in mine:
            if d.lowp:
                return d
        if name in self.node_codes:
            return self.node_codes[name]
        # an index type (StridedSlice's Index, GatherV2's Taxis) says nothing about the node
        floats = [d for d in mine if d.code != "not_float32"]
        return (floats or mine or [None])[0]

    def _attrs_of(self, name: str) -> list[TNode]:
        # The report asks once per node: index the keys by node instead of scanning them all
        # each time (quadratic on large graphs). Rebuilt when passes add decisions.
        if self._indexed != len(self.decisions):
            self._index = {}
            for key in sorted(self.decisions):
                self._index.setdefault(key[0], []).append(key)
            self._indexed = len(self.decisions)
        return self._index.get(name, [])


class _TypeGraph:
    """Type attributes as nodes, with an edge wherever a data edge joins two of them."""

    def __init__(self, graph: Graph, order: list[str]):
        self.graph = graph
        self.items: list[TNode] = []
        self.index: dict[TNode, int] = {}
        for name in order:
            types = node_types(graph.node(name))
            if types is None:
                continue
            for attr in types.attrs:
                self.index[(name, attr)] = len(self.items)
                self.items.append((name, attr))
        self.fanin: list[set[int]] = [set() for _ in self.items]
        self.fanout: list[set[int]] = [set() for _ in self.items]
        for ref, dst, port in graph.data_edges():
            src_types = node_types(graph.node(ref.node))
            dst_types = node_types(graph.node(dst))
            if src_types is None or dst_types is None:
                continue
            if ref.port >= len(src_types.outputs) or port >= len(dst_types.inputs):
                continue
            a, b = src_types.outputs[ref.port].attr, dst_types.inputs[port].attr
            if a is not None and b is not None:
                self.add_edge(self.index[(ref.node, a)], self.index[(dst, b)])

    def add_edge(self, a: int, b: int) -> None:
        self.fanout[a].add(b)
        self.fanin[b].add(a)

    def dfs(self, roots: list[int], direction: str, enter, visit) -> None:
        """Depth-first from ``roots``; ``enter(idx)`` gates each node, ``visit(idx, parent)``."""
        for root in roots:
            stack: list[tuple[int, int | None]] = [(root, None)]
            seen: set[int] = set()
            while stack:
                idx, parent = stack.pop()
                if idx in seen or not enter(idx, root):
                    continue
                seen.add(idx)
                visit(idx, parent, root)
                nbrs: set[int] = set()
                if direction in ("in", "both"):
                    nbrs |= self.fanin[idx]
                if direction in ("out", "both"):
                    nbrs |= self.fanout[idx]
                for n in sorted(nbrs, reverse=True):
                    stack.append((n, idx))


def _reads_ref(graph: Graph, node: Node) -> bool:
    """Whether a node reads a ref (VariableV2) tensor: painting it would break the variable's reads."""
    for ref in graph.inputs(node.name):
        types = node_types(graph.node(ref.node))
        if types and ref.port < len(types.outputs) and types.outputs[ref.port].is_ref:
            return True
    return False


def _holds_state(node: Node) -> bool:
    if node.op in VARIABLE_OPS:
        return True
    types = node_types(node)
    ports = (types.inputs + types.outputs) if types else ()
    return any(p.is_ref or (p.attr is None and p.fixed == types_pb2.DT_RESOURCE) for p in ports)


def const_values(node: Node) -> np.ndarray:
    """A Const's values; :class:`InputError` when its tensor is malformed."""
    try:
        return tensor_util.MakeNdarray(node.attr["value"].tensor)
    except (TypeError, ValueError) as exc:
        raise InputError(f"Const {node.name!r} holds a malformed tensor: {exc}") from None


# where a Const lists its values when they are not in tensor_content (half: as bits)
_LISTED = {FLOAT: "float_val", HALF: "half_val", types_pb2.DT_DOUBLE: "double_val"}


def listed_values(node: Node) -> np.ndarray | None:
    """The values a splat Const lists, not expanded; None for any other Const.

    A splat (as ``tf.fill`` constants are stored) lists fewer values than its shape holds and
    means the last one repeated. Read the listed ones alone, never the expanded tensor: a few
    bytes can stand for terabytes.
    """
    tensor = node.attr["value"].tensor
    listed_in = _LISTED.get(tensor.dtype)
    if listed_in is None or tensor.tensor_content:
        return None
    dims = [d.size for d in tensor.tensor_shape.dim]
    listed = len(getattr(tensor, listed_in))
    if any(d < 0 for d in dims) or listed >= math.prod(dims):
        return None
    if listed == 0:  # no value listed: all zeros
        return np.zeros(1, np.float64)
    short = tensor_pb2.TensorProto()
    short.CopyFrom(tensor)
    del short.tensor_shape.dim[:]
    short.tensor_shape.dim.add(size=listed)
    return tensor_util.MakeNdarray(short)


def _fits(node: Node, target: int) -> bool:
    """Whether a float32 Const's values are finite after conversion to ``target``."""
    if target != HALF:
        return True
    values = listed_values(node)
    if values is None:
        values = const_values(node)
    finite = np.isfinite(values)
    return not np.any(np.abs(values[finite]) > np.finfo(np.float16).max)


def interface_names(graph: Graph, keep: set[str], lowp_io: bool) -> dict[str, str]:
    """Nodes whose dtypes form the graph's interface, with why: kept float32 by default."""
    out: dict[str, str] = {name: "kept with --keep or as a signature tensor" for name in keep
                           if name in graph}
    if lowp_io:
        return out
    for node in graph.nodes():
        if node.name in out:
            continue
        if node.op in PLACEHOLDER_OPS:
            out[node.name] = "graph input (Placeholder)"
        elif not graph.consumers(node.name):
            types = node_types(node)
            if types and any(output_dtype(node, i) == FLOAT for i in range(len(types.outputs))):
                out[node.name] = "graph output (nothing in the graph reads it)"
    return out


def paint(graph: Graph, rules: RuleSet, *, target: int, device: str = "GPU",
          keep: set[str] | frozenset[str] = frozenset(), lowp_io: bool = False) -> Painting:
    """Decide the precision of every (node, type attribute) of ``graph``; the graph is not changed."""
    order = graph.topological_order()
    tg = _TypeGraph(graph, order)
    result = Painting(target=target, device=device)
    tname = TARGET_NAMES.get(target, dtype_name(target))
    items = tg.items
    nodes = {name: graph.node(name) for name in order}
    cat = [rules.category(nodes[name].op) for name, _ in items]
    interface = interface_names(graph, set(keep), lowp_io)
    _add_tensorlist_edges(graph, tg)

    blocked: dict[int, Decision] = {}   # can never be painted, with why
    kernel_cache: dict[int, bool] = {}

    def kernel_ok(idx: int) -> bool:
        if idx not in kernel_cache:
            name, attr = items[idx]
            node = nodes[name]
            kernel_cache[idx] = kernel_supports(node, {attr: target}, device_type(node, device))
        return kernel_cache[idx]

    node_state = {name: _holds_state(n) for name, n in nodes.items()}
    node_refread = {}
    for idx, (name, attr) in enumerate(items):
        node = nodes[name]
        rule = rules.node_rule(name)
        if node_state[name]:
            blocked[idx] = Decision(False, "variable", "variable op: master weights stay float32")
        elif get_dtype(node, attr) != FLOAT:
            blocked[idx] = Decision(False, "not_float32",
                                    f"type {attr} is {dtype_name(get_dtype(node, attr))}, not float32")
        elif rule is not None and rule.action == "keep_fp32":
            blocked[idx] = Decision(False, "user_keep",
                                    f"kept float32 by override {rule.pattern} ({rule.source})")
        elif name in interface:
            blocked[idx] = Decision(False, "interface", interface[name])
    for name in nodes:
        node_refread[name] = _reads_ref(graph, nodes[name])

    def free(idx: int) -> bool:
        """Not blocked, float32, and TensorFlow has a kernel for it in the target dtype."""
        return idx not in blocked and kernel_ok(idx)

    allow: dict[int, Decision] = {}
    deny_parent: dict[int, int | None] = {}

    # 1. allow ops
    force_all = rules.level == "unsafe_force_all"
    for idx, (name, attr) in enumerate(items):
        if cat[idx] == "allow" or (force_all and nodes[name].op not in ("Const", "Cast")):
            if free(idx):
                why = "allow op" if cat[idx] == "allow" else "level unsafe_force_all"
                allow[idx] = Decision(True, "allow_list",
                                      f"{why}: runs in {tname} on {_MATRIX_HINT.get(device, device)}"
                                      if cat[idx] == "allow" else why)

    # 2. deny propagates forward through infer/clear ops that feed other infer/deny ops
    if not force_all:
        upstream: set[int] = set()
        roots = [i for i in range(len(items)) if cat[i] in ("deny", "infer")]
        tg.dfs(roots, "in",
               lambda i, root: i == root or (i not in upstream and cat[i] == "clear"),
               lambda i, parent, root: upstream.add(i))
        deny_roots = [i for i in range(len(items)) if cat[i] == "deny"]
        for root in deny_roots:
            if root in deny_parent:
                continue
            tg.dfs([root], "out",
                   lambda i, r: i == r or (i not in deny_parent and i in upstream),
                   lambda i, parent, r: deny_parent.setdefault(i, parent))

    def deny_chain(idx: int) -> tuple[str, ...]:
        chain = []
        cur: int | None = idx
        while cur is not None:
            chain.append(items[cur][0])
            cur = deny_parent.get(cur)
        return tuple(reversed(chain))

    # 3. infer/clear ops on a path between two allow ops
    downstream: dict[int, int] = {}
    allow_roots = sorted(allow)
    tg.dfs(allow_roots, "out",
           lambda i, root: i == root or (i not in downstream and i not in allow and i not in deny_parent
                                         and cat[i] in ("clear", "infer") and free(i)),
           lambda i, parent, root: downstream.setdefault(i, root))
    upstream_of_allow: set[int] = set()

    def _between(i: int, r: int) -> None:
        if i == r:
            return
        upstream_of_allow.add(i)
        if i not in allow:
            a, b = items[downstream[i]][0], items[r][0]
            allow[i] = Decision(True, "between_allow",
                                f"{cat[i]} op on a path from allow op `{a}` to allow op `{b}`", (a, b))

    for root in allow_roots:
        tg.dfs([root], "in",
               lambda i, r: i == r or (i not in upstream_of_allow and i in downstream),
               lambda i, parent, r: _between(i, r))

    # 4. infer ops fed by an allow op (and no deny op)
    if rules.infer_follows_allow:
        for idx in range(len(items)):
            if cat[idx] != "infer" or idx in allow or idx in deny_parent or not free(idx):
                continue
            fanin = sorted(tg.fanin[idx])
            if any(f in deny_parent for f in fanin):
                continue
            feeders = [f for f in fanin if f in allow]
            if feeders:
                src = items[feeders[0]][0]
                allow[idx] = Decision(True, "follows_allow",
                                      f"infer op fed by low-precision `{src}` and by no deny op",
                                      (src,))

    # 5. allow spreads both ways through clear ops
    def _spread(i: int, parent: int | None) -> None:
        if parent is None or i in allow:
            return
        src = items[parent][0]
        allow[i] = Decision(True, "clear_spread",
                            f"clear op next to low-precision `{src}`", (src,))

    for root in sorted(allow):
        tg.dfs([root], "both",
               lambda i, r: i == r or (i not in allow and i not in deny_parent and cat[i] == "clear"
                                       and not node_refread[items[i][0]] and free(i)),
               lambda i, parent, r: _spread(i, parent))

    # 6. user overrides that force low precision
    refused: set[str] = set()
    for idx, (name, attr) in enumerate(items):
        rule = rules.node_rule(name)
        if rule is None or rule.action != "force_lowp" or idx in allow:
            continue
        if idx in blocked:
            if blocked[idx].code == "interface" and name not in refused:
                refused.add(name)
                result.warnings.append(f"force_lowp refused for `{name}` by override {rule.pattern} "
                                       f"({rule.source}): {blocked[idx].text}; its dtypes are the "
                                       "graph's interface (--lowp-io lets inputs and outputs go)")
            continue
        if kernel_ok(idx):
            allow[idx] = Decision(True, "user_force",
                                  f"forced {tname} by override {rule.pattern} ({rule.source})")
        elif not _has_lowp_attr(items, idx, kernel_ok):
            msg = (f"force_lowp refused for `{name}` ({nodes[name].op}): no {tname} kernel on "
                   f"{device_type(nodes[name], device)} for type {attr}")
            blocked[idx] = Decision(False, "no_kernel", msg)
            result.warnings.append(msg)
    for rule in rules.node_rules:
        if not any(rule.matches(n) for n in nodes):
            result.warnings.append(f"override {rule.pattern} ({rule.source}) matches no node")

    # 7. loops and TensorLists must agree across their back edges / clusters
    _force_loop_agreement(graph, tg, allow, blocked)
    _force_tensorlist_agreement(graph, tg, allow, blocked, free, tname)

    # 8. Casts, Consts (and Placeholders with lowp_io) that only feed low precision
    for idx, (name, attr) in enumerate(items):
        node = nodes[name]
        if idx in allow or idx in blocked or not tg.fanout[idx]:
            continue
        readers = graph.consumers(name)
        if not all(_reader_lowp(graph, tg, allow, r, p) for r, p in readers):
            continue
        if node.op == "Cast" and attr.attr == "DstT" and kernel_ok(idx):
            allow[idx] = Decision(True, "cast_retargeted",
                                  f"existing Cast feeds only {tname} ops: it casts to {tname} instead")
        elif node.op == "Const" and attr.attr == "dtype":
            if _fits(node, target):
                allow[idx] = Decision(True, "const_converted",
                                      f"Const read only in {tname}: stored as {tname}, no run-time cast")
            else:
                msg = (f"Const `{name}` holds values beyond float16's range (65504): kept float32; "
                       f"its run-time cast to {tname} overflows to inf")
                blocked[idx] = Decision(False, "const_overflow", msg)
                result.warnings.append(msg)
        elif lowp_io and node.op in PLACEHOLDER_OPS and kernel_ok(idx):
            allow[idx] = Decision(True, "lowp_io", f"graph input read only in {tname} (--lowp-io)")

    # Record a decision for every type attribute.
    for idx, (name, attr) in enumerate(items):
        if idx in allow:
            result.decisions[(name, attr)] = allow[idx]
        elif idx in blocked:
            result.decisions[(name, attr)] = blocked[idx]
        else:
            result.decisions[(name, attr)] = _why_not(idx, items, nodes, cat, deny_parent,
                                                      deny_chain, kernel_ok, device, tname)
    for name, node in nodes.items():
        types = node_types(node)
        if types is None:
            result.node_codes[name] = Decision(False, "unknown_op",
                                               f"op {node.op!r} is not registered with TensorFlow "
                                               "(custom op or function): left as it is")
        elif not types.attrs:
            result.node_codes[name] = Decision(False, "no_type_attr",
                                               "op has no type attribute to change")
    return result


def _has_lowp_attr(items, idx, kernel_ok) -> bool:
    name = items[idx][0]
    return any(items[j][0] == name and kernel_ok(j) for j in range(len(items)))


def _reader_lowp(graph: Graph, tg: _TypeGraph, allow: dict[int, Decision], reader: str,
                 port: int) -> bool:
    types = node_types(graph.node(reader))
    if types is None or port >= len(types.inputs) or types.inputs[port].attr is None:
        return False
    return tg.index[(reader, types.inputs[port].attr)] in allow


def _why_not(idx, items, nodes, cat, deny_parent, deny_chain, kernel_ok, device, tname) -> Decision:
    name, attr = items[idx]
    node = nodes[name]
    if cat[idx] in ("allow", "infer", "clear") and not kernel_ok(idx):
        return Decision(False, "no_kernel",
                        f"{cat[idx]} op, but TensorFlow has no {tname} kernel for {node.op} on "
                        f"{device_type(node, device)}")
    if cat[idx] == "deny":
        return Decision(False, "deny_list", "deny op: unsafe in low precision")
    if idx in deny_parent:
        chain = deny_chain(idx)
        root = chain[0]
        through = chain[1:-1]
        text = f"{cat[idx]} op, downstream of deny op {nodes[root].op} `{root}`"
        if through:
            text += " through " + ", ".join(f"`{n}`" for n in through)
        return Decision(False, "deny_propagated", text, chain[:-1])
    if cat[idx] == "infer":
        return Decision(False, "infer_alone", "infer op not on a path between allow ops")
    if cat[idx] == "clear":
        return Decision(False, "clear_alone", "clear op with no low-precision neighbour")
    return Decision(False, "not_listed", f"op {node.op} is on no list")


def _force_loop_agreement(graph: Graph, tg: _TypeGraph, allow: dict[int, Decision],
                          blocked: dict[int, Decision]) -> None:
    """A NextIteration and the Merges it feeds share one dtype: a Cast cannot sit on a back edge."""
    for name in graph.names():
        if graph.node(name).op != "NextIteration":
            continue
        group = [(name, TypeAttr("T"))] + [(m, TypeAttr("T")) for m, _ in graph.consumers(name)
                                            if graph.node(m).op == "Merge"]
        idxs = [tg.index[t] for t in group if t in tg.index]
        outside = [i for i in idxs if i not in allow]
        if not outside or len(outside) == len(idxs):
            continue
        culprit = tg.items[outside[0]][0]
        for i in idxs:
            if i in allow:
                allow.pop(i)
                blocked[i] = Decision(False, "loop_match",
                                      f"loop back edge: NextIteration `{name}` and the Merge it "
                                      f"feeds share one dtype, and `{culprit}` stays float32",
                                      (culprit,))


def _add_tensorlist_edges(graph: Graph, tg: _TypeGraph) -> None:
    """Join the element_dtype of TensorList writers to that of readers of the same list."""
    for members, escapes in _tensorlist_clusters(graph):
        writers, readers = [], []
        for name in members:
            types = node_types(graph.node(name))
            attr = TypeAttr("element_dtype")
            if (name, attr) not in tg.index:
                continue
            if any(p.attr == attr for p in types.inputs):
                writers.append(tg.index[(name, attr)])
            if any(p.attr == attr for p in types.outputs):
                readers.append(tg.index[(name, attr)])
        for w in writers:
            for r in readers:
                if w != r:
                    tg.add_edge(w, r)


def _tensorlist_clusters(graph: Graph) -> list[tuple[list[str], bool]]:
    """Groups of TensorList ops joined by DT_VARIANT edges; ``escapes`` if a handle leaves them."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for ref, dst, _ in graph.data_edges():
        if output_dtype(graph.node(ref.node), ref.port) == types_pb2.DT_VARIANT:
            a, b = find(ref.node), find(dst)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[str, list[str]] = {}
    for name in graph.names():
        groups.setdefault(find(name), []).append(name)
    out = []
    for members in groups.values():
        lists = [m for m in members if "element_dtype" in graph.node(m).attr]
        if not lists:
            continue
        escapes = any(graph.node(m).op not in _VARIANT_PASSTHROUGH and "element_dtype" not in
                      graph.node(m).attr and not graph.node(m).op.startswith("TensorList")
                      for m in members)
        out.append((lists, escapes))
    return out


def _force_tensorlist_agreement(graph: Graph, tg: _TypeGraph, allow: dict[int, Decision],
                                blocked: dict[int, Decision], free, tname: str) -> None:
    """All TensorList ops of one list share the element dtype; list creators follow the rest."""
    attr = TypeAttr("element_dtype")
    for members, escapes in _tensorlist_clusters(graph):
        idxs = [tg.index[(m, attr)] for m in members if (m, attr) in tg.index]
        if not idxs:
            continue
        creators = [i for i in idxs if not any(p.attr == attr for p in
                                                (node_types(graph.node(tg.items[i][0])).inputs +
                                                 node_types(graph.node(tg.items[i][0])).outputs))]
        others = [i for i in idxs if i not in creators]
        ok = (not escapes and others and all(i in allow for i in others)
              and all(free(i) for i in creators))
        if ok:
            for i in creators:
                allow[i] = Decision(True, "tensorlist_match",
                                    f"creates a TensorList whose elements are {tname}",
                                    (tg.items[others[0]][0],))
            continue
        if escapes:
            why = "the TensorList handle leaves through an op that is not a TensorList op"
        else:
            out = [tg.items[i][0] for i in others if i not in allow] or [tg.items[idxs[0]][0]]
            why = f"TensorList op `{out[0]}` of the same list stays float32"
        for i in idxs:
            if i in allow:
                allow.pop(i)
            blocked[i] = Decision(False, "tensorlist_match", why)
