"""The HTML report (``--html``) of convert, verify, bench and tune.

The HTML report is one self-contained file (inline CSS, an inline SVG chart, a few lines of
script to sort and filter tables; nothing fetched). Its first screen says what ran where (the
target and what it means on this CPU), the share of the matrix FLOPs in 16 bits, the speed
where it is known (measured, or the cost model's estimate), verify's or tune's verdict, and
the command to run next (:mod:`.steps`). Below it: every count, the results of the command,
the matrix
work by op type (by FLOPs), the nodes kept float32 ordered by what a user acts on, the casts
added; plumbing (ops that compute nothing) folded behind one count. Everything is read off the
report, the results and the converted graph: nothing is decided here.
"""

from __future__ import annotations

import json
from collections import Counter
from html import escape
from pathlib import Path

from ..core import hardware
from ..core.errors import InputError
from ..core.ir import Node
from ..core.ops import MATRIX_OPS, PLUMBING_OPS
from ..io.load import load
from ..schema.functiondef import saver_functions
from . import steps
from ..paint.costs import microseconds
from .decisions import precision_of
from .steps import Given, Step

PRECISIONS = ("float32", "float16", "bfloat16", "mixed", "none")
COLOURS = {"float32": "#4e79a7", "float16": "#f28e2b", "bfloat16": "#e15759", "mixed": "#b07aa1",
           "none": "#bab0ac"}


# -- pages ----------------------------------------------------------------------------------------
# Each is made in full before the command writes anything, and written with the command's
# other outputs as one set (io.files.OutputSet). ``where`` is the line saying what this
# machine is and what the dtype means on it (default: :func:`hardware.machine_line`);
# ``given`` what the command was given, for the next command (none without it).

def convert_page(report: dict, *, where: str | None = None, given: Given | None = None) -> str:
    """The HTML report of one conversion (``report`` is ``Report.to_dict()``)."""
    return render("amp-rewrite conversion report", report=report,
                  where=_where(where, report["target"]),
                  next_steps=steps.after_convert(report, given) if given else [])


def verify_page(result, converted_path, report_json=None, *, where: str | None = None,
                given: Given | None = None) -> str:
    """The HTML report of a verify run; the convert JSON report adds the decisions."""
    report = _read_report(report_json) if report_json else None
    precision = None if report else graph_precision(converted_path)
    verify = result.to_dict()
    return render("amp-rewrite verify report", report=report, precision=precision,
                  verify=verify, where=_where(where, sixteen_bit(verify.get("dtype"))),
                  next_steps=steps.after_verify(verify, given, report) if given else [])


def bench_page(result, converted_path, *, where: str | None = None,
               given: Given | None = None) -> str:
    """The HTML report of a bench run (precision read off the converted model's dtypes)."""
    precision = graph_precision(converted_path)
    bench = result.to_dict()
    return render("amp-rewrite bench report", precision=precision, bench=bench,
                  where=_where(where, model_target(precision)),
                  next_steps=steps.after_bench(bench, given) if given else [])


def tune_page(tune: dict, report: dict, *, where: str | None = None,
              given: Given | None = None) -> str:
    """The HTML report of what tune wrote: its conversion (``report``) and its verdict
    (``tune``, ``TuneResult.to_dict()``)."""
    return render("amp-rewrite tune report", report=report, tune=tune,
                  where=_where(where, report["target"]),
                  next_steps=steps.after_tune(tune, given) if given else [])


def _where(given: str | None, target: str | None) -> str:
    return given if given is not None else hardware.machine_line(target)


def sixteen_bit(dtype: str | None) -> str | None:
    """``"float16"`` or ``"bfloat16"``, else None (float32: no 16-bit target)."""
    return dtype if dtype in ("float16", "bfloat16") else None


def model_target(precision: list[dict]) -> str | None:
    """The 16-bit dtype a converted model computes in (bfloat16 first), or None; ``precision``
    as :func:`graph_precision` gives it."""
    held = {node["precision"] for node in precision}
    return next((t for t in ("bfloat16", "float16") if t in held), None)


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
           verify: dict | None = None, bench: dict | None = None, tune: dict | None = None,
           where: str = "", next_steps: list[Step] = ()) -> str:
    """The whole page. Its first screen (:func:`_lead`) says what ran where, how much of the
    matrix work is in 16 bits, the speed where known, the verdict, and the command to run next;
    below it the details. ``report`` (a convert report dict) or ``precision`` (nodes with their
    precision) gives the graph sections; ``verify``, ``bench`` and ``tune`` add their results."""
    nodes = _counted(report) if report else (precision or [])
    parts = [f"<h1>{escape(title)}</h1>",
             _lead(report, nodes, verify=verify, tune=tune, bench=bench, where=where,
                   next_steps=next_steps)]
    if report:
        parts.append(_summary(report))
    if tune:
        parts.append(_tune(tune))
    if verify:
        parts.append(_verify(verify))
    if bench:
        parts.append(_bench(bench))
    if nodes:
        parts.append(_by_op_type(nodes, _flops_hint(verify) if not report else ""))
    if report:
        parts.append(_kept(report))
        parts.append(_folded_list("Casts added", report.get("casts_added", []), "casts"))
        if report.get("warnings"):
            parts.append(_list("Warnings", report["warnings"]))
    return _PAGE.format(title=escape(title), style=_STYLE, body="\n".join(parts), script=_SCRIPT)


def _table(headers, rows, cls="", kinds=None) -> str:
    """A sortable table; ``kinds``, one per row, marks each row for the filter (data-kind)."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    marks = [f' data-kind="{k}"' for k in kinds] if kinds else [""] * len(rows)
    body = "".join(f"<tr{mark}>" + "".join(f"<td>{escape(_fmt(c))}</td>" for c in row) + "</tr>"
                   for mark, row in zip(marks, rows))
    return f'<table class="sortable {cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "–" if value is None else str(value)


def _counted(report: dict) -> list[dict]:
    """The report's nodes the page counts: those of the saver's functions and of the bodies
    that repeat another left out, as in the summary (a report written before they were named
    has none)."""
    prefixes = tuple(f"{scope}/" for scope in [*report.get("saver_functions", []),
                                               *report.get("repeated_functions", {})])
    return [n for n in report["nodes"] if not (prefixes and n["name"].startswith(prefixes))]


def is_plumbing(node: dict) -> bool:
    """Whether the page folds ``node`` away as plumbing: an op that computes nothing
    (:data:`PLUMBING_OPS`: Consts, Identity, Reshape, variables, control) or a node without a
    float type. The one rule for the headline count, the Plumbing section and the kept table."""
    return node["precision"] == "none" or node["op"] in PLUMBING_OPS


# -- the first screen --------------------------------------------------------------------------

def _lead(report: dict | None, nodes: list[dict], *, verify: dict | None, tune: dict | None,
          bench: dict | None, where: str, next_steps: list[Step]) -> str:
    """What a reader needs before scrolling, in this order: the target and what it means on
    this CPU, the 16-bit share of the matrix work, the speed, the verdict (verify's or tune's),
    the next command, and the counts with plumbing folded away."""
    figures = [_share_figure(report, nodes, _flops_hint(verify)), _speed_figure(report, bench)]
    if verify or tune:
        figures.append(_verdict_figure(verify) if verify else _tune_figure(tune))
    return ('<section class="lead">' + _where_line(report, verify, tune, bench, where)
            + '<div class="figures">' + "".join(figures) + "</div>"
            + _next(next_steps) + _counts_line(report, nodes) + "</section>")


def _where_line(report: dict | None, verify: dict | None, tune: dict | None, bench: dict | None,
                where: str) -> str:
    done = ", verified here" if verify else ", tuned here" if tune else ""
    if report:
        what = (f"<b>{escape(report['target'])}</b> for {escape(report['device'])} "
                f"(level {escape(report['level'])}){done}")
    elif verify:
        what = f"verify ran the <b>{escape(verify.get('dtype', 'float32'))}</b> model here"
    else:
        what = "bench ran both models here" if bench else "the converted model"
    return f'<p id="where" class="where">{what} · {escape(where)}</p>'


def _figure(fid: str, big: str, text: str, cls: str = "") -> str:
    return (f'<div id="{fid}" class="figure {cls}"><span class="big">{escape(big)}</span>'
            f" <span>{text}</span></div>")


def _flops_hint(verify: dict | None) -> str:
    """Where a page without the convert report would find the FLOPs."""
    if verify:
        return "verify --report FILE.json, the convert command's report, adds them"
    return "the convert command's --report records them"


def _share_figure(report: dict | None, nodes: list[dict], hint: str) -> str:
    """The 16-bit share of the matrix FLOPs where any are known; else of the matrix ops, saying
    for how many the FLOPs are not known (never a guess)."""
    low_ops, ops, low, total, unknown = _matrix_share(report, nodes)
    if not ops:
        return _figure("share", "–", "no matrix ops (MatMul/Conv family) in the graph")
    counted = f"{low_ops} of {ops} matrix ops in 16 bits"
    if not total:
        why = "" if report else f" ({hint})"
        return _figure("share", f"{low_ops} of {ops}",
                       f"matrix ops in 16 bits; FLOPs unknown for {unknown}{why}")
    of = "the known matrix FLOPs" if unknown else "the matrix FLOPs"
    text = (f"of {of} in 16 bits ({_flops(low)} of {_flops(total)}); {counted}"
            + (f"; FLOPs unknown for {unknown}" if unknown else ""))
    return _figure("share", _percent(low, total), text)


def _matrix_share(report: dict | None, nodes: list[dict]) -> tuple[int, int, int, int, int]:
    """(matrix ops in 16 bits, matrix ops, their FLOPs, all known matrix FLOPs, ops whose FLOPs
    are not known): from the report's summary, else counted off the nodes' precision."""
    if report:
        s = report["summary"]
        by = s.get("matrix_flops_by_dtype")
        if by is not None:   # a report from before FLOPs were recorded has none
            low = sum(f for d, f in by.items() if d not in ("float32", "none"))
            return (steps.matrix_in_16_bits(s), s["matrix_total"], low, sum(by.values()),
                    s["matrix_flops_unknown"])
        return steps.matrix_in_16_bits(s), s["matrix_total"], 0, 0, s["matrix_total"]
    matrix = [n for n in nodes if n["op"] in MATRIX_OPS]
    low_ops = sum(1 for n in matrix if n["precision"] not in ("float32", "none"))
    return low_ops, len(matrix), 0, 0, len(matrix)


def _percent(part: float, whole: float) -> str:
    """A share as a reader takes it: never 0% or 100% unless it is."""
    share = 100 * part / whole
    if 0 < share < 1:
        return "<1%"
    if 99 < share < 100:
        return ">99%"
    return f"{share:.0f}%"


def _flops(value: float) -> str:
    for scale, unit in ((1e12, "TFLOPs"), (1e9, "GFLOPs"), (1e6, "MFLOPs"), (1e3, "kFLOPs")):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} FLOPs"


def _speed_figure(report: dict | None, bench: dict | None) -> str:
    """The speed: bench's measurement, else --measure's, else the cost model's estimate, else
    that it is not known."""
    if bench:
        return _figure("speed", f"{bench['speedup']:.2f}×",
                       f"the float32 model's speed, measured here (median of {bench['runs']} "
                       f"runs each, {bench['method']}, batch {bench['batch']})")
    measured = (report or {}).get("measured")
    if measured:
        return _figure("speed", "measured", escape(f"here, --measure: {measured['summary']}"))
    estimate = (report or {}).get("estimate")
    if estimate:
        return _estimate_figure(estimate, report.get("cost_model", {}).get("costs"))
    return _figure("speed", "not known", escape(_no_estimate(report)) + "; bench measures it",
                   "muted")


def _no_estimate(report: dict | None) -> str:
    """Why there is no estimate to show."""
    if report is None:
        return "no estimate: the convert command's --report holds the cost model's"
    if (report["target"], report["device"]) == ("bfloat16", "CPU"):
        return ("the cost model made no estimate (--min-matrix-intensity 0, or --cost-aware "
                "on a CPU without a bfloat16 unit)")
    return (f"no estimate for {report['target']} on {report['device']}: the cost model weighs "
            "bfloat16 on a CPU")


def _estimate_figure(est: dict, costs: dict | None) -> str:
    """The cost model's weighing, said as what it is: what it decided with, not the model's
    speed. Its rates are single ops'; a whole model's speed also holds what TensorFlow fuses,
    reorders and runs in parallel, and freezing's gain, which it does not count (BENCHMARKS.md
    "The default conversion on this CPU" has it beside the measurement)."""
    if est["unknown"]:
        return _figure("speed", "not predicted", f"the cost model could not weigh "
                       f"{est['unknown']} of the bfloat16 matrix ops (their FLOPs, or their "
                       "island's shapes, are not known); bench measures the speed", "muted")
    if not est["saved_us"]:
        return _figure("speed", "as float32", "nothing runs in bfloat16: the cost model expects "
                       "the float32 model's speed; bench measures it", "muted")
    net, us = est["saved_us"] - est["lost_us"], microseconds
    return _figure("speed", "not predicted",
                   f"the cost model weighed the bfloat16 matrix work to decide what to paint: it "
                   f"{'saves' if net >= 0 else 'loses'} {us(abs(net))} µs a run (a sample if the "
                   f"batch is open; {us(est['saved_us'])} µs saved, {us(est['lost_us'])} lost, "
                   f"of {us(est['fp32_us'])} µs in float32, {escape(_rates_from(costs))}); that "
                   "is not the model's speed, which holds what TensorFlow fuses and reorders "
                   "too: bench measures it", "muted")


def _rates_from(costs: dict | None) -> str:
    """Whose rates an estimate weighed with: a table measured on this CPU, or another CPU's."""
    if not costs:
        return "the shipped rates"
    if costs.get("table") == "measured":
        return f"rates measured on this CPU, {costs.get('cpu')}"
    return f"rates measured on {costs.get('cpu')}, not on this CPU: amp-rewrite costs measure"


def _verdict_figure(v: dict) -> str:
    failed = "; ".join(f"{name} fails {', '.join(c)}" for name, c in v.get("failed", {}).items())
    return _figure("verdict", "within tolerance" if v["ok"] else "OUT OF TOLERANCE",
                   escape(f"verify, {v['samples']} sample(s)" + (f": {failed}" if failed else "")),
                   "ok" if v["ok"] else "fail")


def _tune_figure(t: dict) -> str:
    held = ""
    if t.get("holdout_after") is not None:
        held = f"; held-out {t['holdout_after']:.3g}" + (f" ({t['holdout_failure']})"
                                                         if t["holdout_failure"] else "")
    float32 = t["ok"] and t.get("float32_model")
    return _figure("verdict", "a float32 model" if float32 else
                   "within tolerance" if t["ok"] else "OUT OF TOLERANCE",
                   escape(f"tune, {t['metric']} {t['after']:.3g} against {t['tolerance']:g} on "
                          f"{t['samples']} sample(s){held}; {t['kept']} node(s) kept float32"
                          + (f": {float32}" if float32 else "")),
                   "muted" if float32 else "ok" if t["ok"] else "fail")


def _next(next_steps: list[Step]) -> str:
    if not next_steps:
        return ""
    first, rest = next_steps[0], next_steps[1:]
    more = "".join(f'<p class="then"><code>{escape(s.command)}</code> {escape(s.why)}</p>'
                   for s in rest)
    return (f'<div id="next" class="next"><p>Next: <code id="next-command">'
            f"{escape(first.command)}</code></p><p class=\"why\">{escape(first.why)}</p>"
            f"{more}</div>")


def _counts_line(report: dict | None, nodes: list[dict]) -> str:
    plumbing = sum(1 for n in nodes if is_plumbing(n))
    parts = []
    if report:
        s = report["summary"]
        parts.append(f"{s['nodes_converted']} of {s['nodes_total']} nodes compute in "
                     f"{escape(report['target'])}")
        parts.append(f"casts added: {s['casts_added']}")
        kept = sum(1 for n in nodes if n["precision"] == "float32" and not is_plumbing(n))
        parts.append(f"kept float32: {kept} (listed below)")
    parts.append(f'plumbing: <span id="plumbing-count">{plumbing}</span> nodes that compute '
                 "nothing (Consts, Identity, Reshape, variables, control), folded below")
    return '<p class="counts">' + " · ".join(parts) + "</p>"


# -- the details -------------------------------------------------------------------------------

def _summary(report: dict) -> str:
    """Every count of the report, folded: the first screen shows the ones a reader acts on."""
    s, target = report["summary"], report["target"]
    rows = [(f"MatMul/Conv-family ops in {target}", f"{s['matrix_converted']} of {s['matrix_total']}"),
            *_other_dtypes("MatMul/Conv-family ops", s.get("matrix_by_dtype", {}), target),
            (f"other float ops in {target}", f"{s['float_ops_converted']} of {s['float_ops_total']}"),
            *_other_dtypes("other float ops", s.get("float_ops_by_dtype", {}), target),
            ("nodes without a float type (variables' handles, shapes, control)", s["plumbing"]),
            ("target", report["target"]), ("device", report["device"]), ("level", report["level"]),
            ("functions painted", s["functions"]),
            ("of them repeating another's trace (counted once)", s.get("functions_repeated", 0)),
            ("saver functions (not counted)", s.get("saver_functions", 0)),
            ("casts added", s["casts_added"]), ("original casts removed", s["casts_removed"]),
            (f"Consts stored in {report['target']}", s["consts_converted"]),
            ("rule files", ", ".join(report.get("rules", [])) or "defaults")]
    rows += [(f"kept float32: {code}", n) for code, n in s["kept_float32_by_reason"].items()]
    rows += [(key, value["summary"]) for key, value in report.items()
             if isinstance(value, dict) and "summary" in value and key != "summary"]
    return ("<details><summary>Every count of the report</summary>"
            + _table(("what", "value"), rows, "summary") + "</details>")


def _other_dtypes(what: str, by_dtype: dict, target: str) -> list[tuple[str, int]]:
    """Rows for the ops of a count in a 16-bit dtype other than the target, or in both."""
    return [(f"{what} in {'both 16-bit dtypes' if d == 'mixed' else d}", n)
            for d, n in by_dtype.items() if d not in ("float32", "none", target)]


def _by_op_type(nodes: list[dict], hint: str) -> str:
    """Precision by op type: the chart weighs the matrix work (by FLOPs where the report holds
    them; ``hint``, where it is not there, says where they are); the table lists the ops that
    compute, matrix ops first; the plumbing folded apart."""
    plumbing = [n for n in nodes if is_plumbing(n)]
    math_nodes = [n for n in nodes if not is_plumbing(n)]
    present = _present(math_nodes)
    counts = _by_op(math_nodes)
    math_ops = sorted(counts, key=lambda op: (op not in MATRIX_OPS, -sum(counts[op].values()), op))
    rows = [(op, "matrix" if op in MATRIX_OPS else "other", *(counts[op][p] for p in present),
             sum(counts[op].values())) for op in math_ops]
    return ("<h2>Precision by op type</h2>" + _matrix_chart(math_nodes, hint)
            + (_table(("op type", "kind", *present, "total"), rows, "by-op") if rows else "")
            + _plumbing(plumbing, _present(plumbing)))


def _present(nodes: list[dict]) -> list[str]:
    """The precisions ``nodes`` hold, in :data:`PRECISIONS` order: the columns of a table."""
    held = {n["precision"] for n in nodes}
    return [p for p in PRECISIONS if p in held]


def _by_op(nodes: list[dict]) -> dict[str, Counter]:
    counts: dict[str, Counter] = {}
    for n in nodes:
        counts.setdefault(n["op"], Counter())[n["precision"]] += 1
    return counts


def _plumbing(nodes: list[dict], present: list[str]) -> str:
    counts = _by_op(nodes)
    ops = sorted(counts, key=lambda op: (-sum(counts[op].values()), op))
    rows = [(op, *(counts[op][p] for p in present), sum(counts[op].values())) for op in ops]
    return (f'<details class="plumbing"><summary>Plumbing: <span id="plumbing-total">'
            f"{len(nodes)}</span> nodes of {len(ops)} op types that compute nothing (Consts, "
            "Identity, Reshape, variables, control, nodes without a float type)</summary>"
            + (_table(("op type", *present, "total"), rows, "plumbing") if rows else "<p>none</p>")
            + "</details>")


def _matrix_chart(nodes: list[dict], hint: str) -> str:
    """A stacked bar per matrix op type, as long as its FLOPs (the ops whose FLOPs are known),
    or, where none is known, as its count of ops; nothing where the graph has no matrix op."""
    matrix = [n for n in nodes if n["op"] in MATRIX_OPS]
    weighed = [n for n in matrix if n.get("flops") is not None]
    if not matrix:
        return ""
    weights: dict[str, Counter] = {}
    for n in weighed or matrix:
        weights.setdefault(n["op"], Counter())[n["precision"]] += n["flops"] if weighed else 1
    left = len(matrix) - len(weighed)
    caption = ("Matrix work by op type and precision, in FLOPs"
               + (f" ({left} matrix ops whose FLOPs are not known left out)" if left else "")
               if weighed else "Matrix ops by op type and precision, by count (FLOPs not known"
               + (f": {hint}" if hint else "") + ")")
    ops = sorted(weights, key=lambda op: (-sum(weights[op].values()), op))
    unit = _flops if weighed else (lambda v: f"{v} ops")
    return (f'<p class="caption">{escape(caption)}</p>'
            + _chart(ops, weights, _present(weighed or matrix), unit))


def _chart(ops, weights, present, unit) -> str:
    """A horizontal stacked bar per op type, as inline SVG; ``unit`` formats a weight."""
    bar_h, label_w, width = 18, 190, 420
    biggest = max(sum(c.values()) for c in weights.values()) or 1
    rows = []
    for i, op in enumerate(ops):
        y, x = 24 + i * (bar_h + 4), label_w
        rows.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{escape(op)}</text>')
        for p in present:
            w = width * weights[op][p] / biggest
            if w:
                rows.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                            f'fill="{COLOURS[p]}"><title>{escape(op)}: {unit(weights[op][p])} '
                            f"{p}</title></rect>")
                x += w
        rows.append(f'<text x="{x + 4:.1f}" y="{y + 13}">{escape(unit(sum(weights[op].values())))}</text>')
    legend = "".join(f'<rect x="{label_w + 100 * i}" y="2" width="12" height="12" fill="{COLOURS[p]}"/>'
                     f'<text x="{label_w + 100 * i + 16}" y="13">{p}</text>'
                     for i, p in enumerate(present))
    height = 30 + len(ops) * (bar_h + 4)
    return (f'<svg class="chart" role="img" aria-label="matrix work by op type" '
            f'width="{label_w + width + 110}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'{legend}{"".join(rows)}</svg>')


#: decision codes a user acts on (a cost estimate, a range, a deny op, an override, a training
#: update), listed in this order after the matrix ops, before every other code
ACTED_ON = ("cost", "range", "deny_list", "deny_propagated", "user_keep", "update")


def kept_order(node: dict) -> tuple:
    """Where a kept-float32 node goes in the table: matrix ops first (most FLOPs first), then
    the codes a user acts on (:data:`ACTED_ON`), then the rest by code; by name within."""
    if node["op"] in MATRIX_OPS:
        flops = node.get("flops")
        return (0, 0, -(flops or 0), flops is None, node["name"])
    if node["code"] in ACTED_ON:
        return (1, ACTED_ON.index(node["code"]), 0, False, node["name"])
    return (2, 0, 0, False, node["code"] + " " + node["name"])


def _kind(node: dict) -> str:
    return ("matrix" if node["op"] in MATRIX_OPS else
            "acted-on" if node["code"] in ACTED_ON else "other")


def _kept(report: dict) -> str:
    """The nodes kept float32, in :func:`kept_order`, with a filter; plumbing folded apart."""
    kept = [n for n in _counted(report) if n["precision"] == "float32"]
    listed = sorted((n for n in kept if not is_plumbing(n)), key=kept_order)
    folded = [n for n in kept if is_plumbing(n)]
    if not listed:
        return "<h2>Nodes kept float32</h2><p>none</p>" + _kept_plumbing(folded)
    rows = [(n["name"], n["op"], n["code"], _mflops(n), n["reason"], ", ".join(n.get("via", [])))
            for n in listed]
    return (f"<h2>Nodes kept float32 ({len(listed)})</h2>" + _FILTER
            + _table(("node", "op", "code", "MFLOPs", "reason", "because of"), rows, "kept",
                     kinds=[_kind(n) for n in listed])
            + _kept_plumbing(folded))


def _mflops(node: dict) -> float | None:
    flops = node.get("flops")
    return None if flops is None else round(flops / 1e6, 3)


def _kept_plumbing(nodes: list[dict]) -> str:
    if not nodes:
        return ""
    ops = Counter(n["op"] for n in nodes)
    shown = ", ".join(f"{op} {k}" for op, k in ops.most_common(4))
    rows = [(n["name"], n["op"], n["code"], n["reason"]) for n in nodes]
    return (f"<details><summary>and {len(nodes)} plumbing nodes kept float32 ({escape(shown)}"
            f"{', ...' if len(ops) > 4 else ''})</summary>"
            + _table(("node", "op", "code", "reason"), rows, "kept-plumbing") + "</details>")


_FILTER = ('<p class="filter"><label>show <select id="kept-kind"><option value="">all</option>'
           '<option value="matrix">matrix ops</option><option value="acted-on">cost, range, '
           'deny, user, update</option><option value="other">the rest</option></select></label> '
           '<label>containing <input id="kept-filter" type="search" placeholder="node, op, code, '
           'reason"></label> <span id="kept-shown"></span></p>')


def _list(title: str, items) -> str:
    if not items:
        return f"<h2>{escape(title)}</h2><p>none</p>"
    return (f"<h2>{escape(title)} ({len(items)})</h2><ul>"
            + "".join(f"<li>{escape(str(i))}</li>" for i in items) + "</ul>")


def _folded_list(title: str, items, cls: str) -> str:
    if not items:
        return f"<h2>{escape(title)}</h2><p>none</p>"
    return (f'<h2>{escape(title)} ({len(items)})</h2><details class="{cls}"><summary>the '
            f"{len(items)} nodes</summary><ul>"
            + "".join(f"<li>{escape(str(i))}</li>" for i in items) + "</ul></details>")


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


def _tune(t: dict) -> str:
    return (f"<h2>Tune: {t['trials']} trials, {t['kept']} node(s) kept float32</h2>"
            f'<pre class="tune">{escape(t["summary"])}</pre>')


def _bench(b: dict) -> str:
    rows = [(name, b[name]["median_ms"], b[name]["p10_ms"], b[name]["p90_ms"], b[name]["throughput"])
            for name in ("original", "converted")]
    return (f"<h2>Bench: {b['speedup']:.2f}× speed-up</h2>"
            f"<p>{b['runs']} timed runs each after {b['warmup']} warm-up, {b['method']}, "
            f"batch {b['batch']}; the ratio within single rounds ran from {b['speedup_p10']:.2f}× "
            f"(p10) to {b['speedup_p90']:.2f}× (p90).</p>"
            + _table(("model", "median (ms)", "p10 (ms)", "p90 (ms)", "samples/s"), rows, "bench"))


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em 2em;color:#222;max-width:1100px}
h1{font-size:1.4em;margin:.2em 0 .5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3;cursor:pointer;white-space:nowrap}
table.kept td:nth-child(3){white-space:nowrap}table.kept td:nth-child(1),table.kept td:nth-child(6),
table.kept-plumbing td:first-child{overflow-wrap:anywhere}
td:not(:first-child){font-variant-numeric:tabular-nums}.ok{color:#2a7d2a}.fail{color:#b22}
svg.chart text{font-size:12px;fill:#222}.caption{margin:.6em 0 0;color:#444}
.lead{border:1px solid #ccd;border-radius:6px;padding:.5em 1em .3em;background:#f7f8fa}
.lead p{margin:.35em 0}.figures{display:flex;gap:.8em;flex-wrap:wrap;margin:.4em 0}
.figure{flex:1 1 0;min-width:15em;background:#fff;border:1px solid #dde;border-radius:4px;
padding:.4em .8em}.figure .big{display:block;font-size:1.7em;font-weight:600}
.figure.muted .big{color:#777}.figure.ok .big{color:#2a7d2a}.figure.fail .big{color:#b22}
.next code,.then code{background:#1f2430;color:#e8e8e8;padding:2px 6px;border-radius:3px;
overflow-wrap:anywhere}.next .why,.then{color:#444}.counts{color:#444}
details{margin:.5em 0}summary{cursor:pointer;color:#333}
"""

# click a header to sort by it; filter the kept table by kind and words; then mark the page
# ready (the tests read this mark)
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
(function () {
  var words = document.getElementById("kept-filter"), kind = document.getElementById("kept-kind");
  if (!words) { return; }
  function filter() {
    var want = words.value.toLowerCase().split(/\\s+/).filter(Boolean), shown = 0;
    var rows = document.querySelectorAll("table.kept tbody tr");
    rows.forEach(function (r) {
      var text = r.textContent.toLowerCase();
      var show = (!kind.value || r.dataset.kind === kind.value) &&
          want.every(function (w) { return text.indexOf(w) >= 0; });
      r.hidden = !show; shown += show ? 1 : 0;
    });
    document.getElementById("kept-shown").textContent = shown + " of " + rows.length + " shown";
  }
  words.addEventListener("input", filter); kind.addEventListener("change", filter); filter();
})();
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
