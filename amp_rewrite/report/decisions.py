"""The conversion report: per-node decisions with reasons, counts, and ``explain`` chains.

Decisions and reasons are read off what painting recorded; nothing is recomputed. Precisions
and counts are read off the converted graph: what the output holds, whoever put it there (a
node converted before counts in the dtype it holds, never as the target unless it is). The
functions only a SavedModel's saver runs are reported node by node, not counted. The JSON
schema (``Report.to_dict``) is documented in docs/report.md and versioned by
``schema_version``.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from ..core.dtypes import BFLOAT16, FLOAT, HALF, dtype_name
from ..core.ir import Graph
from ..core.ops import MATRIX_OPS
from ..paint import Painting
from ..schema.opdefs import get_dtype, node_types
from ..schema.snapshot import Before

SCHEMA_VERSION = 1
_LOWP_NAMES = {HALF: "float16", BFLOAT16: "bfloat16"}
# the same, as NodeReport.attrs spells the dtypes (TensorFlow's short names)
_ATTR_LOWP = {dtype_name(d): name for d, name in _LOWP_NAMES.items()}

# How explain shows a decision's ``via`` nodes, by code: what they are to the node. A deny
# path is a real data path (deny spreads along data edges); the others are not paths.
_VIA = {
    "deny_propagated": "deny path",
    "between_allow": "between",
    "clear_spread": "next to (painted)",
    "follows_allow": "fed by (painted)",
    "loop_match": "tied through the loop back edge to",
    "tensorlist_match": "same TensorList as",
    "tensorlist_float32": "same TensorList as",
}


@dataclass
class NodeReport:
    name: str
    op: str
    precision: str          # what the output holds: "float32", "float16", "bfloat16", "mixed", "none"
    code: str               # the decision code (docs/report.md: "Decision codes")
    reason: str             # the sentence explain prints
    via: list[str] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)   # type attr -> dtype after conversion
    # a matrix op's FLOPs at the graph's shapes (paint.costs.matrix_flops; None: not known);
    # written for matrix ops only
    flops: int | None = None

    def to_dict(self) -> dict:
        """The node as the JSON report holds it: ``flops`` only on matrix ops."""
        data = asdict(self)
        if self.op not in MATRIX_OPS:
            del data["flops"]
        return data


@dataclass
class Report:
    """What a conversion did to each node, and why: what :func:`~amp_rewrite.convert`,
    :func:`~amp_rewrite.convert_file` and :func:`~amp_rewrite.tune` return (``result.report``)
    and ``--report`` writes as JSON.

    Its promises:

    * :attr:`nodes` holds one :class:`NodeReport` per node of the converted graph and of each
      function body painted (``function/node``; a SavedModel's second and later MetaGraphs'
      as ``[tags]/node``): the precision the output holds, read off the output whoever put it
      there, and the decision code and reason painting recorded (docs/report.md "Decision
      codes"); nothing is recomputed.
    * :meth:`summary` and :meth:`format_summary` count what the output holds, the nodes of the
      functions only a SavedModel's saver runs left out (counted apart), and each of the
      model's ops once: a body that repeats another (:meth:`repeats`) is painted and
      reported, not counted again.
    * :meth:`to_dict` / :meth:`to_json` follow the schema of docs/report.md, versioned by
      ``schema_version``; :attr:`warnings` are the conversion's warnings (also logged), and
      :attr:`extra` the sections later passes add (``fusion``, ``calibration`` ...).
    * Looking a node up: :meth:`node` takes a node's exact name and returns None for any other,
      never raising (``if report.node(name) is None``); :meth:`find` and :meth:`explain` also
      take a name that is unique inside a function or MetaGraph, and raise :class:`LookupError`
      (one line, with the closest names) for a name that is no node's or is ambiguous.
    """

    target: str
    device: str
    rules: list[str]
    env: list[str]
    level: str
    nodes: list[NodeReport]
    casts_added: list[str] = field(default_factory=list)
    casts_removed: list[str] = field(default_factory=list)
    consts_converted: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    scopes: list[str] = field(default_factory=list)   # prefixes of merged nodes: functions, [tags]
    # the scopes of functions only a SavedModel's saver runs: their nodes are reported, not counted
    saver_functions: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)   # sections added by later passes (loss scaling ...)
    # nodes the input already held in a 16-bit dtype, left as they are (one warning tells)
    low_precision_input: list[str] = field(default_factory=list)

    # ------------------------------------------------------------- nodes by name
    def node(self, name: str) -> NodeReport | None:
        """The node of that exact name (``function/node`` inside functions), or None for any
        other name: a test, never an error. :meth:`find` (and :meth:`explain`) also take a
        name unique inside a function, and raise :class:`LookupError` naming the closest."""
        return self._by_name().get(name)

    def find(self, name: str) -> NodeReport:
        """The node ``name`` means: its exact name, else the one node that has this name inside
        a function or MetaGraph (``__inference_call_123/dense/MatMul`` for ``dense/MatMul``).
        Raises :class:`LookupError` with a one-line message: ambiguous, or close names."""
        found = self.node(name)
        if found is not None:
            return found
        scoped = [self._by_name()[f"{scope}/{name}"] for scope in self.scopes
                  if f"{scope}/{name}" in self._by_name()]
        if len(scoped) == 1:
            return scoped[0]
        if scoped:
            raise LookupError(f"{name!r} names a node in {len(scoped)} places: "
                              + ", ".join(n.name for n in scoped[:5]) + "; give the full name")
        raise LookupError(f"no node named {name!r}" + self._suggest(name))

    def _suggest(self, name: str) -> str:
        return did_you_mean(name, list(self._by_name()), self.scopes)

    def _by_name(self) -> dict[str, NodeReport]:
        # passes append nodes; rebuild the index when the list grew
        cached = self.__dict__.get("_index")
        if cached is None or cached[0] != len(self.nodes):
            cached = (len(self.nodes), {n.name: n for n in self.nodes})
            self.__dict__["_index"] = cached
        return cached[1]

    # ------------------------------------------------------------- counts
    def summary(self) -> dict:
        """Counts of what the output holds, leaving out the nodes of the saver's functions
        (counted apart as ``saver_functions`` and ``saver_nodes``) and those of the bodies that
        repeat another (:meth:`repeats`; ``functions`` counts every body painted,
        ``functions_repeated`` those). ``*_converted`` count the nodes that compute in the
        target dtype; ``*_by_dtype`` count the nodes by the dtype they compute in
        (:func:`computes_in`), so a node in the other 16-bit dtype is never counted as the
        target."""
        counted, saver = self._counted()
        matrix = [n for n in counted if n.op in MATRIX_OPS]
        floats = [n for n in counted if n.op not in MATRIX_OPS and n.precision != "none"]
        kept = Counter(n.code for n in counted if n.precision == "float32")
        return {
            "nodes_converted": sum(1 for n in counted if computes_in(n) == self.target),
            "nodes_total": len(counted),
            "matrix_converted": sum(1 for n in matrix if computes_in(n) == self.target),
            "matrix_total": len(matrix),
            "matrix_by_dtype": _by_dtype(matrix),
            "matrix_flops_by_dtype": _flops_by_dtype(matrix),
            "matrix_flops_unknown": sum(1 for n in matrix if n.flops is None),
            "float_ops_converted": sum(1 for n in floats if computes_in(n) == self.target),
            "float_ops_total": len(floats),
            "float_ops_by_dtype": _by_dtype(floats),
            "plumbing": sum(1 for n in counted if n.precision == "none"),
            "casts_added": len(self.casts_added),
            "casts_removed": len(self.casts_removed),
            "consts_converted": len(self.consts_converted),
            "functions": len(self.functions()),
            "saver_functions": len(self.saver_functions),
            "saver_nodes": saver,
            "kept_float32_by_reason": dict(sorted(kept.items())),
            **({"functions_repeated": len(repeated)} if (repeated := self.repeats()) else {}),
        }

    def float32_model(self) -> str | None:
        """Where the output has MatMul/Conv-family ops and none computes in a 16-bit dtype
        (calibration, the cost model, the rules or ``keep`` kept them all float32), the
        sentence saying it is a float32 model and the codes that kept them, most first; else
        None. The summary prints it, and a conversion warns it."""
        matrix = [n for n in self._counted()[0] if n.op in MATRIX_OPS]
        if self.target == "float32" or not matrix or any(
                computes_in(n) not in ("float32", "none") for n in matrix):
            return None   # (a float32 model is what --target float32 asks for)
        codes = Counter(n.code for n in matrix).most_common()
        return (f"the output is a float32 model: none of its {len(matrix)} MatMul/Conv-family "
                f"ops computes in {self.target} (kept float32: "
                + ", ".join(f"{code} {count}" for code, count in codes) + ")")

    def _counted(self) -> tuple[list[NodeReport], int]:
        """The nodes the counts take, and how many nodes of the saver's functions they leave
        out (the nodes of repeated bodies are left out too, not counted there)."""
        repeated = self.repeats()
        if not self.saver_functions and not repeated:
            return self.nodes, 0
        saver = tuple(f"{scope}/" for scope in self.saver_functions)
        ours = [n for n in self.nodes if not (saver and n.name.startswith(saver))]
        counted = ours
        if repeated:
            scope_of = _scope_finder(self.functions())
            counted = [n for n in ours if scope_of(n.name) not in repeated]
        return counted, len(self.nodes) - len(ours)

    def repeats(self) -> dict[str, str]:
        """The function bodies painted that repeat another, each with the first it repeats
        (in :attr:`scopes` order): the same function traced again, and painted the same way.
        Two bodies repeat each other when, under the same graph (the model's, or one
        MetaGraph's), their names are equal but for TensorFlow's trace number and our copy
        for one call site (``__inference_serve_413``, ``__inference_serve_422``,
        ``__inference_serve_413_amp1``), and they hold the same nodes (names and ops) with
        the same dtypes. A SavedModel holds such twins: a signature's trace of a method and
        the restored object's, or one per signature that calls it. Their ops are the model's
        once: the counts take the first body (docs/report.md "Counted once")."""
        functions = self.functions()
        scope_of = _scope_finder(functions)
        bodies: dict[str, list[tuple]] = {}
        for n in self.nodes:
            scope = scope_of(n.name)
            if scope is not None:
                bodies.setdefault(scope, []).append(
                    (n.name[len(scope) + 1:], n.op, n.precision, tuple(sorted(n.attrs.items()))))
        first: dict[tuple, str] = {}
        found = {}
        for scope in functions:
            parent, _, name = scope.rpartition("/")
            key = (parent, _untraced(name), tuple(sorted(bodies.get(scope, ()))))
            if key in first:
                found[scope] = first[key]
            else:
                first[key] = scope
        return found

    def functions(self) -> list[str]:
        """The function bodies painted whose nodes the report counts: scopes that are neither
        [tags] nor functions only the saver runs (:attr:`saver_functions`)."""
        saver = set(self.saver_functions)
        return [s for s in self.scopes if not s.startswith("[") and s not in saver]

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
            "functions": self.functions(),
            "saver_functions": self.saver_functions,
            **({"repeated_functions": repeated} if (repeated := self.repeats()) else {}),
            "casts_added": self.casts_added,
            "casts_removed": self.casts_removed,
            "consts_converted": self.consts_converted,
            "nodes": [n.to_dict() for n in self.nodes],
            **self.extra,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    def format_summary(self) -> str:
        """What the CLI prints: the matrix ops first, then the other float ops, plumbing apart;
        each count names the dtype it counts, and any op in another precision beside it."""
        s, t = self.summary(), self.target
        where = "" if t == "float32" else f" on {self.device.lower()}"   # float32 runs anywhere
        lines = [f"target {t}{where}: {s['matrix_converted']}/{s['matrix_total']} "
                 f"MatMul/Conv-family ops in {t}" + _besides(s["matrix_by_dtype"], t),
                 f"other float ops: {s['float_ops_converted']}/{s['float_ops_total']} in {t}"
                 + _besides(s["float_ops_by_dtype"], t) + f"; {s['plumbing']} nodes without "
                 "a float type (variables, shapes, control) are plumbing",
                 f"casts added: {s['casts_added']}"
                 + (f", original casts removed: {s['casts_removed']}" if s["casts_removed"] else "")
                 + (f", Consts stored in {t}: {s['consts_converted']}" if s["consts_converted"] else "")]
        if float32_model := self.float32_model():
            lines.insert(1, float32_model)
        if s["kept_float32_by_reason"]:
            lines.append("kept float32: " + ", ".join(f"{k} {v}" for k, v in
                                                       s["kept_float32_by_reason"].items()))
        functions = self.functions()
        if functions:
            shown = ", ".join(functions[:4]) + (f" and {len(functions) - 4} more" if len(functions) > 4 else "")
            lines.append(f"functions painted: {len(functions)} ({shown}); explain takes their "
                         "nodes as function/node, or without the function where unique")
        if repeated := self.repeats():
            lines.append(f"of them, {len(repeated)} repeat another's trace, painted the same "
                         "(counted once above: " + ", ".join(
                             f"{body} as {first}" for body, first in list(repeated.items())[:3])
                         + (" ..." if len(repeated) > 3 else "") + ")")
        if self.saver_functions:
            lines.append(f"saver functions: {s['saver_functions']} ({s['saver_nodes']} nodes), not "
                         "counted above: they only save and restore the variables")
        if self.env:
            lines.append("grappler variables honoured: " + ", ".join(self.env))
        for key, value in self.extra.items():
            if isinstance(value, dict) and "summary" in value:
                lines.append(f"{key}: {value['summary']}")
        return "\n".join(lines)

    def explain(self, name: str) -> str:
        """The decision for one node, as ``amp-rewrite explain`` prints it; ``name`` as
        :meth:`find` takes it (a :class:`LookupError` with the closest names for an unknown
        one, where :meth:`node` returns None)."""
        node = self.find(name)
        verdict = _VERDICTS.get(node.code) or ("kept float32" if node.precision == "float32" else (
            f"runs in {node.precision}" if node.precision != "none" else "no float type"))
        text = f"{node.name} ({node.op}): {verdict}: {node.reason}"
        if node.attrs:
            text += "\n  types: " + ", ".join(f"{k}={v}" for k, v in node.attrs.items())
        if node.via:
            text += "\n  " + _via(self, node)
        return text


_TRACE_NUMBER = re.compile(r"(_\d+)?(_amp\d+)?$")


def _untraced(function: str) -> str:
    """A function's name without TensorFlow's trace number and our call-site copy's suffix:
    ``__inference_serve_413_amp1`` -> ``__inference_serve``."""
    return _TRACE_NUMBER.sub("", function)


def _scope_finder(scopes):
    """``name -> the longest of scopes that holds it (scope/...), or None``."""
    known = set(scopes)

    def scope_of(name: str) -> str | None:
        cut = name.rfind("/")
        while cut > 0:
            if name[:cut] in known:
                return name[:cut]
            cut = name.rfind("/", 0, cut)
        return None
    return scope_of


def computes_in(node: NodeReport) -> str:
    """The dtype the summary counts ``node`` in: its precision, except that a node holding
    float32 and one 16-bit dtype (a Cast to it) counts in that 16-bit dtype; ``mixed`` is left
    for a node holding both 16-bit dtypes."""
    if node.precision != "mixed":
        return node.precision
    low = {_ATTR_LOWP[d] for d in node.attrs.values() if d in _ATTR_LOWP}
    return low.pop() if len(low) == 1 else "mixed"


def _by_dtype(nodes: list[NodeReport]) -> dict[str, int]:
    return dict(sorted(Counter(computes_in(n) for n in nodes).items()))


def _flops_by_dtype(matrix: list[NodeReport]) -> dict[str, int]:
    """The FLOPs of the matrix ops whose FLOPs are known, by the dtype they compute in."""
    found: Counter = Counter()
    for n in matrix:
        if n.flops is not None:
            found[computes_in(n)] += n.flops
    return dict(sorted(found.items()))


def _besides(by_dtype: dict[str, int], target: str) -> str:
    """``"; 3 in float16"``: the ops of a count in the other 16-bit dtype or in both, if any."""
    others = [f"{n} {'in both 16-bit dtypes' if d == 'mixed' else 'in ' + d}"
              for d, n in by_dtype.items() if d not in ("float32", "none", target)]
    return "; " + ", ".join(others) if others else ""


# what explain says of a node whose code is not about keeping it float32: --target float32
# asked for it, or the node is gone (conversion.widening)
_VERDICTS = {"target_float32": "runs in float32", "cast_removed": "removed"}

_KERAS_SUFFIX = re.compile(r"_\d+$")
_TENSOR_SUFFIX = re.compile(r":\d+$")


def _key(parts) -> tuple[str, ...]:
    # Keras numbers the scopes of a traced model (tiny_1/predictions_1) but not its layers
    return tuple(_KERAS_SUFFIX.sub("", p) for p in parts)


def near_names(name: str, names: list[str], scopes=(), most: int = 5) -> tuple[list[str], int]:
    """The node names nearest ``name`` (at most ``most``, shortest first) and how many more
    there were, for a name that is no node's.

    A user types the layer path Keras showed (``predictions/Softmax``, ``tiny/predictions``);
    the graph holds it under a prefix (``StatefulPartitionedCall/tiny_1/predictions_1/Softmax``
    in a frozen TF2 graph, ``__inference_serving_default_90/...`` in a SavedModel's functions),
    with Keras's ``_1`` scope suffixes. So path components are matched before spelling, the
    first kind that finds any wins: names ending in the typed path; ending in it with the
    ``_N`` suffixes ignored; sharing its last components with them ignored, the most first
    and at least two (a prefix in the typed name that the graph lacks); holding it as consecutive
    components anywhere (a layer named without its op). Only when none of these finds a name,
    the closest spellings of as many trailing components, of the name inside its function or
    MetaGraph, and of the whole name."""
    parts = tuple(p for p in _TENSOR_SUFFIX.sub("", name).split("/") if p)
    if not parts:
        return [], 0
    split = {n: tuple(n.split("/")) for n in names}
    keyed = {n: _key(s) for n, s in split.items()}
    want, k = _key(parts), len(parts)
    shared = max(1, min(2, k))
    kinds = [lambda n: split[n][-k:] == parts, lambda n: keyed[n][-k:] == want]
    kinds += [lambda n, j=j: keyed[n][-j:] == want[-j:] for j in range(k - 1, shared - 1, -1)]
    kinds.append(lambda n: any(keyed[n][i:i + k] == want for i in range(len(keyed[n]) - k + 1)))
    for matches in kinds:
        found = [n for n in names if matches(n)]
        if found:
            found.sort(key=lambda n: (len(split[n]), n))
            return found[:most], max(0, len(found) - most)
    return _spelled_like(name, parts, names, split, scopes, most), 0


def did_you_mean(name: str, names: list[str], scopes=()) -> str:
    """``; did you mean 'a', 'b' or 'c'?`` (one line) for the nodes :func:`near_names` finds
    for ``name`` among ``names``, else nothing."""
    close, more = near_names(name, names, scopes)
    if not close:
        return ""
    shown = [repr(c) for c in close]
    listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
    return f"; did you mean {listed}" + (f" ({more} more match)" if more else "") + "?"


def _spelled_like(name, parts, names, split, scopes, most) -> list[str]:
    """The names whose last components, own name inside a scope, or whole name are spelt
    nearest ``name`` (difflib's ratio, at least 0.6)."""
    by_text: dict[str, list[str]] = {}
    tail = len(parts)
    for n in names:
        by_text.setdefault("/".join(split[n][-tail:]), []).append(n)
        for scope in scopes:
            if n.startswith(scope + "/"):
                by_text.setdefault(n[len(scope) + 1:], []).append(n)
        by_text.setdefault(n, []).append(n)
    found: list[str] = []
    for text in difflib.get_close_matches("/".join(parts), list(by_text), n=most, cutoff=0.6):
        found.extend(n for n in sorted(by_text[text], key=len) if n not in found)
    return found[:most]


def _via(report: Report, node: NodeReport) -> str:
    label = _VIA.get(node.code, "because of")
    if node.code == "deny_propagated":
        return f"{label}: " + " -> ".join(_deny_path(report, node))
    if node.code == "between_allow" and len(node.via) == 2:
        upstream, downstream = node.via
        return f"{label}: {upstream} -> ... -> {node.name} -> ... -> {downstream}"
    return f"{label}: " + ", ".join(node.via)


def _deny_path(report: Report, node: NodeReport, most: int = 12) -> list[str]:
    """The data path deny took to ``node``, walked back through each node's recorded neighbour
    (long paths keep their ends, ``...`` between)."""
    root, path = node.via[0], [node.name]
    cur = node.via[-1]
    while cur != root:
        path.append(cur)
        step = report.node(cur)
        if step is None or step.code != "deny_propagated" or step.via[0] != root:
            break   # a node deny reached through another of its type attributes
        cur = step.via[-1]
    path.append(root)
    path.reverse()
    return path if len(path) <= most else path[:3] + ["..."] + path[-(most - 4):]


def build_report(graph: Graph, original: Before, painting: Painting, *, target: str, device: str,
                 rules) -> Report:
    """Assemble the report of one conversion from the painting, the converted graph and the
    record of what it was (a node the conversion removed is reported as it was)."""
    nodes = []
    # (op, attrs, dtypes) -> (precision, attrs named): a graph has few such combinations
    described: dict[tuple, tuple[str, dict[str, str]]] = {}
    for name, op in original.nodes():
        if name in graph:
            after = graph.node(name)
            types = node_types(after)
            attrs = () if types is None else types.attrs
            key = (op, attrs, tuple(get_dtype(after, a) for a in attrs))
        else:
            held = original.dtypes(name)
            key = (op, tuple(held), tuple(held.values()))
        if key not in described:
            dtypes = dict(zip(key[1], key[2]))
            described[key] = (_precision(op, dtypes) if dtypes else "none",
                              {str(a): dtype_name(d) for a, d in dtypes.items()})
        precision, named = described[key]
        decision = painting.node_decision(name)
        nodes.append(NodeReport(name, op, precision, decision.code if decision else "none",
                                decision.text if decision else "",
                                list(decision.via) if decision else [], dict(named),
                                painting.flops.get(name)))
    return Report(target=target, device=device, rules=list(rules.sources), env=list(rules.env),
                  level=rules.level, nodes=nodes, warnings=list(painting.warnings))


def precision_of(node) -> str:
    """What a node computes in, read off its type attributes: ``float32``, ``float16``,
    ``bfloat16``, ``mixed``, or ``none`` (no float type, or an op TensorFlow does not know)."""
    types = node_types(node)
    if types is None:
        return "none"
    return _precision(node.op, {a: get_dtype(node, a) for a in types.attrs})


def _precision(op: str, dtypes: dict) -> str:
    """:func:`precision_of` for a node of ``op`` whose type attributes hold ``dtypes``."""
    held = set(dtypes.values())
    low = sorted(_LOWP_NAMES[d] for d in held if d in _LOWP_NAMES)
    if not low:
        return "float32" if FLOAT in held else "none"
    if len(low) > 1 or (FLOAT in held and not _only_fixed_float(op)):
        return "mixed"
    return low[0]


def _only_fixed_float(op: str) -> bool:
    # FusedBatchNormV3 keeps U=float by design (scale/offset/mean/variance): still "in target"
    return op.startswith("FusedBatchNorm") or op == "_FusedBatchNormEx"
