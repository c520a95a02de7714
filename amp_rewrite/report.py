"""The conversion report: per-node decisions with reasons, counts, and ``explain`` chains.

Everything here is read off the decisions recorded while painting; nothing is recomputed.
The JSON schema (``Report.to_dict``) is documented in README.md and versioned by
``schema_version``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from .dtypes import FLOAT, LOW_PRECISION, dtype_name
from .ir import Graph
from .paint import Painting
from .signatures import get_dtype, node_types

SCHEMA_VERSION = 1


@dataclass
class NodeReport:
    name: str
    op: str
    precision: str          # "float32", "float16", "bfloat16", "mixed" or "none"
    code: str               # the decision code (README: "Decision codes")
    reason: str             # the sentence explain prints
    via: list[str] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)   # type attr -> dtype after conversion


@dataclass
class Report:
    target: str
    device: str
    rules: list[str]
    env: list[str]
    level: str
    nodes: list[NodeReport]
    matrix_ops: list[str]
    casts_added: list[str] = field(default_factory=list)
    casts_removed: list[str] = field(default_factory=list)
    consts_converted: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)   # sections added by later passes (loss scaling ...)

    def node(self, name: str) -> NodeReport | None:
        for n in self.nodes:
            if n.name == name:
                return n
        return None

    def summary(self) -> dict:
        lowp = [n for n in self.nodes if n.precision in (self.target, "mixed")]
        matrix = [n for n in self.nodes if n.op in self.matrix_ops]
        kept = Counter(n.code for n in self.nodes if n.precision == "float32")
        return {
            "nodes_converted": len(lowp),
            "nodes_total": len(self.nodes),
            "matrix_converted": sum(1 for n in matrix if n.precision in (self.target, "mixed")),
            "matrix_total": len(matrix),
            "casts_added": len(self.casts_added),
            "casts_removed": len(self.casts_removed),
            "consts_converted": len(self.consts_converted),
            "kept_float32_by_reason": dict(sorted(kept.items())),
        }

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "target": self.target,
            "device": self.device,
            "rules": self.rules,
            "env": self.env,
            "level": self.level,
            "summary": self.summary(),
            "warnings": self.warnings,
            "casts_added": self.casts_added,
            "casts_removed": self.casts_removed,
            "consts_converted": self.consts_converted,
            "nodes": [asdict(n) for n in self.nodes],
            **self.extra,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    def format_summary(self) -> str:
        s = self.summary()
        lines = [
            f"target {self.target} on {self.device.lower()}: {s['nodes_converted']}/{s['nodes_total']} "
            f"nodes converted, {s['matrix_converted']}/{s['matrix_total']} MatMul/Conv-family ops "
            f"in {self.target}",
            f"casts added: {s['casts_added']}" + (f", original casts removed: {s['casts_removed']}"
                                                  if s["casts_removed"] else "")
            + (f", Consts stored in {self.target}: {s['consts_converted']}"
               if s["consts_converted"] else ""),
        ]
        if s["kept_float32_by_reason"]:
            lines.append("kept float32: " + ", ".join(f"{k} {v}" for k, v in
                                                       s["kept_float32_by_reason"].items()))
        if self.env:
            lines.append("grappler variables honoured: " + ", ".join(self.env))
        for key, value in self.extra.items():
            if isinstance(value, dict) and "summary" in value:
                lines.append(f"{key}: {value['summary']}")
        return "\n".join(lines)

    def explain(self, name: str) -> str:
        """The decision chain for one node, as ``amp-rewrite explain`` prints it."""
        node = self.node(name)
        if node is None:
            raise KeyError(name)
        verdict = "kept float32" if node.precision == "float32" else (
            f"runs in {node.precision}" if node.precision != "none" else "no float type")
        text = f"{node.name} ({node.op}): {verdict}: {node.reason}"
        if node.attrs:
            text += "\n  types: " + ", ".join(f"{k}={v}" for k, v in node.attrs.items())
        if node.via:
            text += "\n  chain: " + " -> ".join(node.via + [node.name])
        return text


def build_report(graph: Graph, original: Graph, painting: Painting, *, target: str, device: str,
                 rules, matrix_ops: frozenset[str]) -> Report:
    """Assemble the report of one conversion from the painting and the converted graph."""
    nodes = []
    for node in original.nodes():
        name = node.name
        after = graph.node(name) if name in graph else node
        types = node_types(after)
        attrs = {}
        if types is not None:
            attrs = {str(a): dtype_name(get_dtype(after, a)) for a in types.attrs}
        before_float = types is not None and any(get_dtype(node, a) == FLOAT for a in types.attrs)
        lowp = types is not None and any(get_dtype(after, a) in LOW_PRECISION and
                                         get_dtype(node, a) == FLOAT for a in types.attrs)
        still = types is not None and any(get_dtype(after, a) == FLOAT for a in types.attrs)
        precision = (("mixed" if still else target) if lowp else
                     "float32" if before_float else "none")
        if precision == "mixed" and types is not None and _only_fixed_float(after, types):
            precision = target
        decision = painting.node_decision(name)
        nodes.append(NodeReport(name, node.op, precision,
                                decision.code if decision else "none",
                                decision.text if decision else "",
                                list(decision.via) if decision else [], attrs))
    return Report(target=target, device=device, rules=list(rules.sources), env=list(rules.env),
                  level=rules.level, nodes=nodes, matrix_ops=sorted(matrix_ops),
                  warnings=list(painting.warnings))


def _only_fixed_float(node, types) -> bool:
    # FusedBatchNormV3 keeps U=float by design (scale/offset/mean/variance): still "in target"
    return node.op.startswith("FusedBatchNorm") or node.op == "_FusedBatchNormEx"
