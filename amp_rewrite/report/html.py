"""The HTML report (``--html``) of convert, verify and bench.

The HTML report is one self-contained file (inline CSS, an inline SVG chart, a few lines of
script to sort tables; nothing fetched): the conversion summary, precision by op type as a
table and a chart, the nodes kept float32 with their reasons, the casts added, and the
verify / bench results when the command that wrote it has them.
"""

from __future__ import annotations

import json
from collections import Counter
from html import escape
from pathlib import Path

from ..core.errors import InputError
from ..core.ir import Node
from ..core.ops import MATRIX_OPS, VARIABLE_OPS
from ..io.load import load
from ..schema.functiondef import saver_functions
from .decisions import precision_of

PRECISIONS = ("float32", "float16", "bfloat16", "mixed", "none")
COLOURS = {"float32": "#4e79a7", "float16": "#f28e2b", "bfloat16": "#e15759", "mixed": "#b07aa1",
           "none": "#bab0ac"}


# -- pages ----------------------------------------------------------------------------------------
# Each is made in full before the command writes anything, and written with the command's
# other outputs as one set (io.files.OutputSet).

def convert_page(report: dict) -> str:
    """The HTML report of one conversion (``report`` is ``Report.to_dict()``)."""
    return render("amp-rewrite conversion report", report=report)


def verify_page(result, converted_path, report_json=None) -> str:
    """The HTML report of a verify run; the convert JSON report adds the decisions."""
    report = _read_report(report_json) if report_json else None
    precision = None if report else graph_precision(converted_path)
    return render("amp-rewrite verify report", report=report, precision=precision,
                  verify=result.to_dict())


def bench_page(result, converted_path) -> str:
    return render("amp-rewrite bench report", precision=graph_precision(converted_path),
                  bench=result.to_dict())


def _read_report(path) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable amp-rewrite JSON report: {exc}") from None
    if not isinstance(report, dict) or "nodes" not in report:
        raise InputError(f"{path}: not an amp-rewrite JSON report (no 'nodes')")
    return report


def graph_precision(path) -> list[dict]:
    """Each node of a converted model with the precision its dtypes show (no reasons): the
    graph's nodes and those of every function in its library (``function/node``) but the
    functions only a SavedModel's saver runs, for every MetaGraph of a SavedModel (the second
    and later as ``[tags]/...``)."""
    out = []
    for i, meta in enumerate(load(path).meta_graphs):
        scope = "" if i == 0 else "[" + ",".join(meta.meta_info_def.tags) + "]/"
        saver = set(saver_functions(meta))
        bodies = [("", meta.graph_def.node)] + [(f.signature.name + "/", f.node_def)
                                                for f in meta.graph_def.library.function
                                                if f.signature.name not in saver]
        for prefix, nodes in bodies:
            out.extend({"name": scope + prefix + nd.name, "op": nd.op,
                        "precision": precision_of(Node(nd))} for nd in nodes)
    return out


# -- rendering ---------------------------------------------------------------------------------

def render(title: str, *, report: dict | None = None, precision: list[dict] | None = None,
           verify: dict | None = None, bench: dict | None = None) -> str:
    """The whole page. ``report`` (a convert report dict) or ``precision`` (nodes with their
    precision) gives the graph sections; ``verify`` and ``bench`` add their results."""
    nodes = _counted(report) if report else (precision or [])
    parts = [f"<h1>{escape(title)}</h1>"]
    if report:
        parts.append(_summary(report))
    if verify:
        parts.append(_verify(verify))
    if bench:
        parts.append(_bench(bench))
    if nodes:
        parts.append(_by_op_type(nodes))
    if report:
        parts.append(_kept(report))
        parts.append(_list("Casts added", report.get("casts_added", [])))
        if report.get("warnings"):
            parts.append(_list("Warnings", report["warnings"]))
    return _PAGE.format(title=escape(title), style=_STYLE, body="\n".join(parts), script=_SCRIPT)


def _table(headers, rows, cls="") -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(_fmt(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="sortable {cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _counted(report: dict) -> list[dict]:
    """The report's nodes the page counts: those of the saver's functions left out, as in the
    summary (a report written before they were named has none)."""
    prefixes = tuple(f"{scope}/" for scope in report.get("saver_functions", []))
    return [n for n in report["nodes"] if not (prefixes and n["name"].startswith(prefixes))]


def _summary(report: dict) -> str:
    s, target = report["summary"], report["target"]
    rows = [(f"MatMul/Conv-family ops in {target}", f"{s['matrix_converted']} of {s['matrix_total']}"),
            *_other_dtypes("MatMul/Conv-family ops", s.get("matrix_by_dtype", {}), target),
            (f"other float ops in {target}", f"{s['float_ops_converted']} of {s['float_ops_total']}"),
            *_other_dtypes("other float ops", s.get("float_ops_by_dtype", {}), target),
            ("plumbing (no float type: variables, shapes, control)", s["plumbing"]),
            ("target", report["target"]), ("device", report["device"]), ("level", report["level"]),
            ("functions painted", s["functions"]),
            ("saver functions (not counted)", s.get("saver_functions", 0)),
            ("casts added", s["casts_added"]), ("original casts removed", s["casts_removed"]),
            (f"Consts stored in {report['target']}", s["consts_converted"]),
            ("rule files", ", ".join(report.get("rules", [])) or "defaults")]
    rows += [(f"kept float32: {code}", n) for code, n in s["kept_float32_by_reason"].items()]
    rows += [(key, value["summary"]) for key, value in report.items()
             if isinstance(value, dict) and "summary" in value and key != "summary"]
    return "<h2>Summary</h2>" + _table(("what", "value"), rows, "summary")


def _other_dtypes(what: str, by_dtype: dict, target: str) -> list[tuple[str, int]]:
    """Rows for the ops of a count in a 16-bit dtype other than the target, or in both."""
    return [(f"{what} in {'both 16-bit dtypes' if d == 'mixed' else d}", n)
            for d, n in by_dtype.items() if d not in ("float32", "none", target)]


def _by_op_type(nodes: list[dict]) -> str:
    """Precision by op type: the MatMul/Conv family first, then the other float ops; variable
    plumbing and ops without a float type apart, so they do not bury the math."""
    counts: dict[str, Counter] = {}
    for n in nodes:
        counts.setdefault(n["op"], Counter())[n["precision"]] += 1
    plumbing = {op for op, c in counts.items()
                if op in VARIABLE_OPS or set(c) == {"none"}}
    present = [p for p in PRECISIONS if any(c[p] for c in counts.values())]
    math_ops = sorted(set(counts) - plumbing,
                      key=lambda op: (op not in MATRIX_OPS, -sum(counts[op].values()), op))
    rows = [(op, "matrix" if op in MATRIX_OPS else "other", *(counts[op][p] for p in present),
             sum(counts[op].values())) for op in math_ops]
    kept = sorted(plumbing, key=lambda op: (-sum(counts[op].values()), op))
    apart = [(op, *(counts[op][p] for p in present), sum(counts[op].values())) for op in kept]
    return ("<h2>Precision by op type</h2>" + (_chart(math_ops, counts, present) if math_ops else "")
            + _table(("op type", "kind", *present, "total"), rows, "by-op")
            + "<h3>Plumbing: variables, shapes, control (no float math to convert)</h3>"
            + (_table(("op type", *present, "total"), apart, "plumbing") if apart else "<p>none</p>"))


def _chart(ops, counts, present) -> str:
    """A horizontal stacked bar per op type, as inline SVG."""
    bar_h, label_w, width = 18, 190, 420
    biggest = max(sum(c.values()) for c in counts.values())
    rows = []
    for i, op in enumerate(ops):
        y, x = 24 + i * (bar_h + 4), label_w
        rows.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{escape(op)}</text>')
        for p in present:
            w = width * counts[op][p] / biggest
            if w:
                rows.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                            f'fill="{COLOURS[p]}"><title>{escape(op)}: {counts[op][p]} {p}</title></rect>')
                x += w
    legend = "".join(f'<rect x="{label_w + 100 * i}" y="2" width="12" height="12" fill="{COLOURS[p]}"/>'
                     f'<text x="{label_w + 100 * i + 16}" y="13">{p}</text>'
                     for i, p in enumerate(present))
    height = 30 + len(ops) * (bar_h + 4)
    return (f'<svg class="chart" role="img" aria-label="precision by op type" '
            f'width="{label_w + width + 20}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'{legend}{"".join(rows)}</svg>')


def _kept(report: dict) -> str:
    rows = [(n["name"], n["op"], n["code"], n["reason"], ", ".join(n.get("via", [])))
            for n in _counted(report) if n["precision"] == "float32" and n["op"] not in VARIABLE_OPS]
    if not rows:
        return "<h2>Nodes kept float32</h2><p>none</p>"
    return (f"<h2>Nodes kept float32 ({len(rows)})</h2>"
            + _table(("node", "op", "code", "reason", "because of"), rows, "kept"))


def _list(title: str, items) -> str:
    if not items:
        return f"<h2>{escape(title)}</h2><p>none</p>"
    return (f"<h2>{escape(title)} ({len(items)})</h2><ul>"
            + "".join(f"<li>{escape(str(i))}</li>" for i in items) + "</ul>")


def _verify(v: dict) -> str:
    failed = v.get("failed", {})
    verdict = "within tolerance" if v["ok"] else "OUT OF TOLERANCE"
    if failed:
        verdict += ": " + "; ".join(f"{name} fails {', '.join(c)}" for name, c in failed.items())
    described = {
        "rel_l2": lambda c: f"relative L2 error ≤ {c['threshold']:g}"
                            + (f" (gradients ≤ {c['gradients']:g})" if "gradients" in c else ""),
        "top1": lambda c: f"top-1 agreement ≥ {100 * c['threshold']:g}% on outputs with a "
                          "class axis, by position (near-ties count as agreeing; integer "
                          "outputs by exact match)",
        "allclose": lambda c: f"every element within {c['atol']:g} + {c['rtol']:g}·|original|",
        "max_abs": lambda c: f"largest absolute error ≤ {c['threshold']:g}"}
    # a result written before checks existed held only the per-element tolerance
    checks = v.get("checks") or [{"check": "allclose", "rtol": v["rtol"], "atol": v["atol"]}]
    rows = [(o["name"] + (f" (vs {o['converted']})" if o.get("converted") else ""),
             o["max_abs"], o["rel_l2"], "–" if o.get("top1") is None else 100 * o["top1"],
             100 * o["out_of_tolerance"], o["elements"], o["nonfinite"],
             ", ".join(o.get("failed", [])) or "–", "yes" if o["ok"] else "NO")
            for o in v["outputs"]]
    parts = [f'<h2>Verify: <span class="{"ok" if v["ok"] else "fail"}">{escape(verdict)}</span></h2>',
             f"<p>{v['samples']} sample(s); checks ({escape(v.get('dtype', 'float32'))} defaults "
             "unless given): " + escape("; ".join(described[c["check"]](c) for c in checks))
             + "; every element finite where float32's is.</p>",
             _table(("output", "max abs error", "relative L2", "top-1 agreement (%)",
                     "outside atol+rtol·|x| (%)", "elements", "non-finite", "failed checks", "ok"),
                    rows, "verify")]
    if v.get("nodes"):
        parts.append(f"<h3>Per node: the {min(len(v['nodes']), 50)} tensors adding the most error "
                     f"(of {v['nodes_compared']} compared)</h3>")
        parts.append(_table(("rank", "tensor", "op", "dtype", "error added", "relative L2"),
                            [(i, n["tensor"], n["op"], n["dtype"], n["added"], n["rel_l2"])
                             for i, n in enumerate(v["nodes"][:50], 1)], "per-node"))
    if v.get("uncompared"):
        total = sum(u["count"] for u in v["uncompared"])
        parts.append(f"<h3>Per node: {total} tensors not compared</h3>")
        parts.append(_table(("tensors", "why", "for example"),
                            [(u["count"], u["why"], ", ".join(u["tensors"]))
                             for u in v["uncompared"]], "uncompared"))
    return "\n".join(parts)


def _bench(b: dict) -> str:
    rows = [(name, b[name]["median_ms"], b[name]["p10_ms"], b[name]["p90_ms"], b[name]["throughput"])
            for name in ("original", "converted")]
    return (f"<h2>Bench: {b['speedup']:.2f}× speed-up</h2>"
            f"<p>{b['runs']} timed runs each after {b['warmup']} warm-up, interleaved, "
            f"batch {b['batch']}; the ratio within single rounds ran from {b['speedup_p10']:.2f}× "
            f"(p10) to {b['speedup_p90']:.2f}× (p90).</p>"
            + _table(("model", "median (ms)", "p10 (ms)", "p90 (ms)", "samples/s"), rows, "bench"))


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3;cursor:pointer}
td:not(:first-child){font-variant-numeric:tabular-nums}.ok{color:#2a7d2a}.fail{color:#b22}
svg.chart text{font-size:12px;fill:#222}
"""

# click a header to sort by it; then mark the page ready (the test reads this mark)
_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var body = table.tBodies[0], rows = Array.from(body.rows);
      var asc = th.dataset.asc !== "1"; th.dataset.asc = asc ? "1" : "0";
      rows.sort(function (a, b) {
        var x = a.cells[col].textContent, y = b.cells[col].textContent;
        var nx = parseFloat(x), ny = parseFloat(y);
        var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
document.documentElement.dataset.ready = String(document.querySelectorAll("table").length);
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head>
<body>
{body}
<script>{script}</script>
</body></html>
"""
