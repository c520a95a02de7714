"""What the painting steps share: the type graph, each item's list, and what is decided so far.

Items are the type graph's numbered (node, type attribute) pairs. Three maps fill up as the
steps run: ``blocked`` (can never be painted, with why), ``allow`` (painted, with why) and
``deny_parent`` (reached by deny propagation, with the item it came from; ``deny_root`` the
deny op it started at).
"""

from __future__ import annotations

from typing import Mapping

from ..core.dtypes import FLOAT, RESOURCE, TARGET_NAMES, dtype_name
from ..core.ir import Graph, Node
from ..core.ops import PLACEHOLDER_OPS, STORED_VARIABLE, VARIABLE_OPS
from ..rules.cost_table import CostTable, shipped
from ..rules.loader import RuleSet
from ..schema.opdefs import device_type, get_dtype, kernel_supports, node_types, output_dtype
from ..schema.shapes import Shapes
from .costs import Estimate, FreezeGain
from .decisions import Decision
from .typegraph import TypeGraph


class PaintState:
    """One painting in progress (see the module doc)."""

    def __init__(self, graph: Graph, rules: RuleSet, *, target: int, device: str,
                 keep: Mapping[str, tuple[str, str]], lowp_io: bool, min_intensity: float = 0.0,
                 input_shapes: Mapping[str, tuple[int, ...]] | None = None,
                 batch: int | None = None, costs: CostTable | None = None):
        self.graph, self.rules, self.target, self.device = graph, rules, target, device
        self.lowp_io, self.min_intensity = lowp_io, min_intensity
        # what the model runs at, for the cost model (paint.islands): placeholder shapes and
        # the batch an open first dimension stands for (None: costs.DEFAULT_BATCH)
        self.input_shapes, self.batch = dict(input_shapes or {}), batch
        self.costs = costs or shipped()   # the cost model's rates (rules.cost_table)
        self.tname = TARGET_NAMES.get(target, dtype_name(target))
        order = graph.topological_order()
        self.nodes: dict[str, Node] = {name: graph.node(name) for name in order}
        self.interface = interface_names(graph, keep, lowp_io)
        self.tg = TypeGraph(graph, order)
        self.items = self.tg.items
        of_op: dict[str, str | None] = {}   # a graph has a few hundred ops, 1e5 items
        nodes = self.nodes
        self.cat = [of_op[op] if op in of_op else of_op.setdefault(op, rules.category(op))
                    for op in (nodes[name].op for name, _ in self.items)]
        self.blocked: dict[int, Decision] = {}
        self.allow: dict[int, Decision] = {}
        self.deny_parent: dict[int, int | None] = {}
        self.deny_root: dict[int, int] = {}   # the deny op each deny-reached item came from
        self.warnings: list[str] = []
        # matrix ops the runtime estimate kept float32 for activations that folded batch norms
        # could make fusable (paint.islands; the --fold-constants hint)
        self.unfused_kept = 0
        # (matrix ops, least batch that would pay) of islands kept float32 for weight casts an
        # open batch shares (paint.islands; the --shape hint)
        self.batch_kept: list[tuple[int, int]] = []
        # what freezing the variables and --fold-constants would gain (paint.islands; the
        # freezing hint of a SavedModel's conversion)
        self.freezing = FreezeGain()
        # static shapes, worked out on demand: for the islands the cost model weighs and the
        # FLOPs the report records (paint.reasons); the graph does not change while painting
        self.shapes = Shapes(graph, self.input_shapes)
        # the islands the cost model weighed (names, estimate), None where it weighed none
        # (paint.islands; the report's estimate for the whole graph)
        self.weighed: list[tuple[set[str], Estimate | None]] | None = None
        self._kernel: dict[int, bool] = {}
        self._reads_ref: dict[str, bool] = {}

    def kernel_ok(self, idx: int) -> bool:
        """Whether TensorFlow has a kernel for the item's node with the item in the target dtype."""
        if idx not in self._kernel:
            name, attr = self.items[idx]
            node = self.nodes[name]
            self._kernel[idx] = kernel_supports(node, {attr: self.target},
                                                device_type(node, self.device))
        return self._kernel[idx]

    def reads_ref(self, name: str) -> bool:
        """Whether the node reads a ref (VariableV2) tensor: painting it would break the
        variable's reads. Asked of few nodes (clear ops next to painted ones): found on demand."""
        if name not in self._reads_ref:
            self._reads_ref[name] = _reads_ref(self.graph, self.nodes[name])
        return self._reads_ref[name]

    def free(self, idx: int) -> bool:
        """Not blocked, float32, and TensorFlow has a kernel for it in the target dtype."""
        return idx not in self.blocked and self.kernel_ok(idx)

    def node_of(self, idx: int) -> Node:
        return self.nodes[self.items[idx][0]]

    def block_fixed(self, by_device: bool = True) -> None:
        """Block what no rule may paint: state, nodes placed on another device type than the
        conversion's (grappler processes only nodes on its target device; not with
        ``by_device`` False: a float32 target moves no node to 16 bits on any device),
        non-float32 types, user keeps, the interface."""
        # whether a node holds state depends on its op and port layout alone, and nodes of
        # one layout share one NodeTypes (signatures): asked once per layout
        of_layout: dict[tuple[str, int], bool] = {}
        # one Decision per reason, shared by the items it blocks (frozen: a value); the
        # node's facts asked once for its items, which are numbered consecutively
        said: dict[tuple, Decision] = {}
        node_rule = self.rules.node_rule if self.rules.node_rules else lambda name: None
        last = None
        for idx, (name, attr) in enumerate(self.items):
            if name != last:
                last, node = name, self.nodes[name]
                key = (node.op, id(node_types(node)))
                holds = of_layout.get(key)
                if holds is None:
                    holds = of_layout[key] = holds_state(node)
                rule = node_rule(name)
                placed = self.device in device_type(node, self.device)
            if by_device and not placed:   # XLA_CPU counts as CPU, as in grappler
                why = ("other_device", node.device)
            elif holds:
                why = ("variable",)
            elif get_dtype(node, attr) != FLOAT:
                why = ("not_float32", attr, get_dtype(node, attr))
            elif rule is not None and rule.action == "keep_fp32":
                why = ("user_keep", rule.pattern, rule.source)
            elif name in self.interface:
                why = ("interface",) + self.interface[name]
            else:
                continue
            decision = said.get(why)
            if decision is None:
                decision = said[why] = self._fixed(why)
            self.blocked[idx] = decision

    def _fixed(self, why: tuple) -> Decision:
        """The Decision :meth:`block_fixed` gives for ``why``: a code and what its text says."""
        code = why[0]
        if code == "other_device":
            return Decision(False, "other_device", f"placed on {why[1]}, not on the "
                            f"{self.device} the conversion is for: left as it is")
        if code == "variable":
            return Decision(False, "variable", "variable op: master weights stay float32")
        if code == "not_float32":
            return Decision(False, "not_float32", f"type {why[1]} is {dtype_name(why[2])}, not "
                            "float32")
        if code == "user_keep":
            return Decision(False, "user_keep", f"kept float32 by override {why[1]} ({why[2]})")
        return Decision(False, *why[1:])   # the interface's (code, reason)


def interface_names(graph: Graph, keep: Mapping[str, tuple[str, str]],
                    lowp_io: bool) -> dict[str, tuple[str, str]]:
    """Nodes whose dtypes must not change, with ``(code, reason)``: ``keep`` (the callers'
    reasons: ``--keep``, signature tensors ...), then the graph's inputs and outputs (code
    ``interface``), which ``lowp_io`` releases."""
    out = {name: why for name, why in keep.items() if name in graph}
    if lowp_io:
        return out
    for node in graph.nodes():
        if node.name in out:
            continue
        if node.op in PLACEHOLDER_OPS and STORED_VARIABLE not in node.attr:
            # (a stand-in for a variable --freeze keeps is a stored weight, not an input)
            out[node.name] = ("interface", "graph input (Placeholder)")
        elif not graph.is_read(node.name, data=True):
            types = node_types(node)
            if types and any(output_dtype(node, i) == FLOAT for i in range(len(types.outputs))):
                out[node.name] = ("interface", "graph output (nothing in the graph reads it)")
    return out


def _reads_ref(graph: Graph, node: Node) -> bool:
    """Whether a node reads a ref (VariableV2) tensor: painting it would break the variable's reads."""
    for ref in graph.inputs(node.name):
        types = node_types(graph.node(ref.node))
        if types and ref.port < len(types.outputs) and types.outputs[ref.port].is_ref:
            return True
    return False


def holds_state(node: Node) -> bool:
    """Whether ``node`` holds or moves state (a variable op, or a ref or resource port): its
    dtypes are the stored ones, which no conversion changes."""
    if node.op in VARIABLE_OPS:
        return True
    types = node_types(node)
    ports = (types.inputs + types.outputs) if types else ()
    return any(p.is_ref or (p.attr is None and p.fixed == RESOURCE) for p in ports)
