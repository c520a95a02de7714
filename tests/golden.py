"""The golden corpus: the graphs the tests build, converted, with what came out.

A redesign of the converter must change no decision. ``python tests/golden.py write`` converts
every case below and records, per case, the SHA-256 of the input, of the output (a SavedModel's
files but ``fingerprint.pb``, which holds a random uuid) and of the JSON report, the report's
summary and its per-node decisions (``node: "precision code"``), or the error a refused case
raised; ``tests/test_golden.py`` runs ``python tests/golden.py check`` in a fresh process
(TensorFlow numbers functions by a per-process counter, so the inputs are only the same in a
process that built the same things before) and fails on any difference, printing which nodes'
decisions moved. ``python tests/golden.py diff`` prints that per-node diff between the
recording and a fresh run without failing; ``write`` prints it too, then records. A change that
is meant to change decisions rewrites ``tests/golden.json`` in its own commit, whose message
carries that diff.

Every case declares what it is meant to do (``PAINTS``, ``FLOAT32``, ...), and ``check`` holds
the fresh run to it from the conversion's own data (nodes converted, input and output bytes):
a recording cannot freeze a case that stopped painting. bfloat16 cases run with
``min_matrix_intensity=0`` (suffix ``_i0``): at the default, the cost model keeps most of these
small graphs float32 on a CPU, and a case whose output is its input guards nothing. A few cases
(``_bf16`` and ``train_..._bfloat16`` without ``_i0``, ``inverted_residual*``) keep the cost
model's defaults, to guard what it decides.

The recorded decisions leave out nodes without a float type (precision ``none``: shapes,
handles, control) and variable ops (``float32 variable``: master weights always stay float32):
neither is a decision that can move without a node appearing in the diff (a node that gains a
float type or a painted variable shows up as ``(not recorded) -> ...``), and they are half
of all nodes (about 400 of the Keras SavedModel's 633): recording them would double the file.
The report's hash still covers every node.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# the cost model's rates are the shipped ones, whatever table this user measured on this CPU
# (amp_rewrite.rules.cost_table.DIR_VARIABLE: where measured tables are looked for)
_NO_MEASURED_COSTS = tempfile.TemporaryDirectory(prefix="amp-rewrite-golden-costs-")
os.environ["AMP_REWRITE_COSTS_DIR"] = _NO_MEASURED_COSTS.name
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import graphs  # noqa: E402
import grappler_graphs as gg  # noqa: E402
import tensorflow as tf  # noqa: E402
import training_graphs as tg  # noqa: E402

from amp_rewrite import convert_file  # noqa: E402
from amp_rewrite.core.errors import AmpRewriteError  # noqa: E402
from amp_rewrite.rules.loader import builtin_rules_dir  # noqa: E402

ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "cnn_fp32.pb"
RULE_EXAMPLES = sorted((ROOT / "rules" / "examples").glob("*.toml"))
GOLDEN = HERE / "golden.json"
KERAS_EXPORT = HERE / "data" / "keras_export"
F16 = {"target": "float16"}
# bfloat16 paints as grappler does: the cost model's default (128 on a CPU) would keep most of
# these small graphs float32, and an output equal to its input guards no bfloat16 painting
BF16 = {"target": "bfloat16", "device": "cpu", "min_matrix_intensity": 0}
BF16_COSTED = {"target": "bfloat16", "device": "cpu"}   # the cost model decides, as by default

# what a case is meant to do, checked on every fresh run against the conversion's own data
PAINTS = "to paint"   # some node changes dtype: nodes converted, output bytes differ
FLOAT32 = "to stay float32"   # no node changes dtype and the output is the input, byte for byte
SCALED_ONLY = "to stay float32 but loss-scaled"   # no node changes dtype, loss scaling does
REFUSED = "to be refused"   # the conversion raises an AmpRewriteError


def _write_graph_def(folder: Path, name: str, graph_def) -> Path:
    path = folder / f"{name}.pb"
    path.write_bytes(graph_def.SerializeToString(deterministic=True))
    return path


def _write_meta(folder: Path, name: str, meta) -> Path:
    path = folder / f"{name}.meta"
    path.write_bytes(meta.SerializeToString(deterministic=True))
    return path


def _saved(folder: Path, name: str, module, signatures) -> Path:
    path = folder / name
    tf.saved_model.save(module, str(path), signatures=signatures)
    return path


def _keras_export(folder: Path) -> Path:
    """A copy of tests/data/keras_export: Keras' export is not byte-identical between processes
    (its variables differ), so the golden case converts this one, made by :func:`make_keras`."""
    import shutil
    path = folder / "keras"
    shutil.copytree(KERAS_EXPORT, path)
    return path


def make_keras(path: Path) -> None:
    """What tests/data/keras_export holds: test_savedmodel's Keras model, exported."""
    import test_savedmodel
    test_savedmodel.keras_model().export(str(path), verbose=False)


def cases(folder: Path):
    """``(name, input path, options, what it is meant to do)`` for every case, built into
    ``folder`` in a fixed order (new inputs go last: building one shifts TensorFlow's function
    counter for every input built after it)."""
    out = []
    for name, opts, expect in (("f16", F16, PAINTS), ("bf16_i0", BF16, PAINTS),
                               ("bf16_fold_i0", {**BF16, "fold_constants": True}, PAINTS),
                               ("bf16", BF16_COSTED, PAINTS)):
        out.append((f"example_{name}", EXAMPLE, opts, expect))
    for rules in RULE_EXAMPLES:
        out.append((f"example_rules_{rules.stem}", EXAMPLE, {**F16, "rules": [str(rules)]}, PAINTS))
    out.append(("example_keep_lowp_io", EXAMPLE, {**F16, "keep": ["head/fc1"], "lowp_io": True},
                PAINTS))

    grappler = {"conv_bn": gg.conv_bn, "conv_pool": gg.conv_pool, "multi_paths": gg.multi_paths}
    for spec in [("w", "c", "w"), ("c", "c", "w"), ("w", "g", "w"), ("w", "gbg", "cb"),
                 ("b", "gwc", "c"), ("b", "cwcg", "c"), ("c", "cwcg", "c"), ("c", "cwgcg", "c"),
                 ("w", "gbg", "w"), ("w", "ggg", "w")]:
        grappler["loop_" + "_".join(spec)] = lambda s=spec: gg.simple_loop(*s)
    for name, build in grappler.items():
        graph_def, _ = build()
        path = _write_graph_def(folder, f"grappler_{name}", graph_def)
        keep = [n.name for n in graph_def.node if n.name in ("output", "grad_output")]
        out.append((f"grappler_{name}_bf16_i0", path, {**BF16, "keep": keep}, PAINTS))
        out.append((f"grappler_{name}_f16", path, F16, PAINTS))

    for build in (graphs.mlp, graphs.conv_bn, graphs.conv_bias_relu_pool, graphs.attention,
                  graphs.while_v1, graphs.tensorarray_lstm, graphs.functional_while):
        path = _write_graph_def(folder, build.__name__, build()[0])
        out.append((f"{build.__name__}_f16", path, F16, PAINTS))
        out.append((f"{build.__name__}_bf16_i0", path, BF16, PAINTS))
        if build is graphs.mlp:   # its matrix ops do 43 FLOPs per element moved, under 128
            out.append(("mlp_bf16", path, BF16_COSTED, FLOAT32))

    import test_functions as tfn
    for build in (tfn.control_flow_graph, tfn.shared_callee_graph):
        path = _write_graph_def(folder, build.__name__, build())
        out.append((f"{build.__name__}_f16", path, F16, PAINTS))
        out.append((f"{build.__name__}_bf16_i0", path, BF16, PAINTS))

    path = _write_graph_def(folder, "training_mlp", graphs.training_mlp()[0])
    out.append(("training_mlp_pb_f16", path, F16, PAINTS))
    out.append(("training_mlp_pb_bf16_i0", path, BF16, PAINTS))
    for model, optimizer, kwargs, opts in (
            ("mlp", "sgd", {}, F16), ("mlp", "adam", {}, F16), ("cnn", "momentum", {}, F16),
            ("embedding", "adam", {}, F16), ("mlp", "sgd", {"backprop": "tape"}, F16),
            ("mlp", "sgd", {"backprop": "grad_ys"}, {**F16, "loss_scale_options": {"grads": ["seed"]}}),
            ("mlp", "sgd", {"backprop": "manual"}, F16),
            ("mlp", "sgd", {"backprop": "all_reduce"}, F16),
            ("mlp", "sgd", {"backprop": "step_in_group"}, F16),
            ("mlp", "momentum", {"resource": False}, F16),
            ("mlp", "sgd", {}, {**F16, "loss_scale": "1024"}),
            ("mlp", "sgd", {}, {**F16, "loss_scale": "none"}),
            ("cnn", "adam", {}, BF16_COSTED)):
        tag = "_".join([model, optimizer] + [f"{v}" for v in kwargs.values()]
                       + [str(opts.get("loss_scale", opts["target"]))])
        path = _write_meta(folder, f"train_{tag}", tg.build(model, optimizer, **kwargs))
        if opts is BF16_COSTED:   # its matrix ops do 20 FLOPs per element moved, under 128
            out.append((f"train_{tag}", path, opts, FLOAT32))
            out.append((f"train_{tag}_i0", path, BF16, PAINTS))
        else:   # the embedding bag has no matrix op to paint: loss scaling only
            expect = SCALED_ONLY if model == "embedding" else PAINTS
            out.append((f"train_{tag}", path, opts, expect))

    import test_savedmodel as tsm
    loop = tsm.LoopAndBranch()
    path = _saved(folder, "loop_module", loop, loop.__call__)
    out.append(("saved_loop_f16", path, F16, PAINTS))
    out.append(("saved_loop_bf16_i0", path, BF16, PAINTS))
    trainer = tsm.Trainer()
    path = _saved(folder, "trainer", trainer, {"train": trainer.train, "predict": trainer.predict})
    out.append(("saved_trainer_bf16_i0", path, BF16, PAINTS))
    out.append(("saved_trainer_f16", path, F16, PAINTS))
    out.append(("saved_trainer_f16_no_scaling", path, {**F16, "loss_scale": "none"}, PAINTS))
    shared = tsm.SharedInner()
    path = _saved(folder, "shared_inner", shared, shared.__call__)
    out.append(("saved_shared_inner_f16", path, F16, PAINTS))
    path = _keras_export(folder)
    out.append(("saved_keras_f16", path, F16, PAINTS))
    out.append(("saved_keras_bf16_i0", path, BF16, PAINTS))
    path = folder / "tf1_train_serve"
    tsm._tf1_train_and_serve(path)
    out.append(("saved_tf1_train_serve_bf16_i0", path, BF16, PAINTS))
    out.append(("saved_tf1_train_serve_f16_refused", path, F16, REFUSED))

    # the cost model's runtime estimate: MobileNetV2's block at 14x14 loses more in its two
    # unfused bfloat16 Relu6 than its convolutions save; with biases TensorFlow fuses them
    import test_costs
    for name, bias, expect in (("inverted_residual_bf16", None, FLOAT32),
                               ("inverted_residual_bias_bf16", "random", PAINTS)):
        path = _write_graph_def(folder, name, test_costs.inverted_residual(bias))
        out.append((name, path, BF16_COSTED, expect))

    # TensorLists, painted whole or kept float32 whole (grappler's cases; E and G keep theirs)
    for case in "ABCDEGI":
        graph_def, _ = gg.tensorlist(case)
        path = _write_graph_def(folder, f"grappler_tensorlist_{case}", graph_def)
        keep = [n.name for n in graph_def.node if n.name in ("output", "output2")]
        out.append((f"grappler_tensorlist_{case}_bf16_i0", path, {**BF16, "keep": keep}, PAINTS))
        out.append((f"grappler_tensorlist_{case}_f16", path, F16, PAINTS))
    return out


def digest(path: Path) -> str:
    """SHA-256 of a file, or of a directory's files (relative name and bytes) but fingerprint.pb."""
    h = hashlib.sha256()
    if path.is_file():
        h.update(path.read_bytes())
        return h.hexdigest()
    for p in sorted(q for q in path.rglob("*") if q.is_file() and q.name != "fingerprint.pb"):
        h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def decisions(report) -> dict[str, str]:
    """``node name -> "precision code"`` for the report's nodes that have a float type, but
    variable ops (see the module's docstring)."""
    return {n.name: f"{n.precision} {n.code}" for n in report.nodes
            if n.precision != "none" and (n.precision, n.code) != ("float32", "variable")}


def run_case(path: Path, opts: dict, out_dir: Path, name: str) -> tuple[dict, bool | None]:
    """The case's record, and whether its output's bytes differ from its input's (None when
    refused)."""
    dst = out_dir / (name + (path.suffix if path.is_file() else ""))
    record = {"input": digest(path)}
    try:
        report = convert_file(path, dst, **opts)
    except AmpRewriteError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}".replace(str(path), "<input>")
        return record, None
    # paths of the input and of rule files depend on where the checkout and package are
    text = (report.to_json().replace(str(path), "<input>")
            .replace(str(ROOT / "rules" / "examples"), "<rule examples>")
            .replace(str(builtin_rules_dir()), "<built-in rules>").replace(str(ROOT), "<checkout>"))
    output = digest(dst)
    if not opts.get("fold_constants"):
        # folded values are computed on this CPU, whose vector units may round the last bit
        # differently (AVX2 vs AVX-512): the decisions are compared, not the folded bytes
        record["output"] = output
    record["report"] = hashlib.sha256(text.encode()).hexdigest()
    record["summary"] = report.summary()
    record["decisions"] = decisions(report)
    return record, output != record["input"]


def broken_promise(record: dict, changed: bool | None, expect: str) -> str | None:
    """Why a fresh run does not do what its case is meant to (``expect``), or None."""
    refused = "error" in record
    if refused or expect == REFUSED:
        if refused == (expect == REFUSED):
            return None
        return f"meant {expect}, but refused: {record['error']}" if refused else (
            f"meant {REFUSED}, but converted")
    painted = record["summary"]["nodes_converted"]
    kept = {PAINTS: bool(painted) and changed, FLOAT32: not painted and not changed,
            SCALED_ONLY: not painted and changed}[expect]
    return None if kept else (f"meant {expect}, but {painted} nodes changed dtype and the "
                              f"output {'differs from' if changed else 'is'} the input")


def collect() -> tuple[dict, list[str]]:
    """A fresh run: every case's record, and the cases that broke what they are meant to do."""
    results, broken = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folder, out_dir = Path(tmp) / "in", Path(tmp) / "out"
        folder.mkdir()
        out_dir.mkdir()
        for name, path, opts, expect in cases(folder):
            results[name], changed = run_case(path, opts, out_dir, name)
            why = broken_promise(results[name], changed, expect)
            if why:
                broken.append(f"{name}: {why}")
    return results, broken


def dumps(results: dict) -> str:
    """golden.json's text: sorted, a decision per line and the summary on one, so a moved
    decision is a one-line change in a review."""
    def value(key, v):
        if key != "decisions" or not v:
            return json.dumps(v, sort_keys=True)
        rows = ",\n".join(f"   {json.dumps(n)}: {json.dumps(d)}" for n, d in sorted(v.items()))
        return "{\n" + rows + "\n  }"

    cases_ = [f" {json.dumps(name)}: {{\n"
              + ",\n".join(f"  {json.dumps(k)}: {value(k, v)}" for k, v in sorted(rec.items()))
              + "\n }" for name, rec in sorted(results.items())]
    return "{\n" + ",\n".join(cases_) + "\n}\n"


UNRECORDED = "(not recorded)"


def painted_counts(record: dict) -> str:
    """``"paints 7 of 9 nodes (bfloat16 7)"``, or the error, for a case shown whole."""
    if "error" in record:
        return f"refused: {record['error']}"
    s = record["summary"]
    lowp = Counter(d.split()[0] for d in record.get("decisions", {}).values())
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(lowp.items()) if k != "float32")
    text = f"paints {s['nodes_converted']} of {s['nodes_total']} nodes"
    return text + (f" ({kinds})" if kinds else "")


def case_diff(old: dict | None, new: dict | None) -> list[str]:
    """What changed in one case, for a reader: new or removed case, error, per-node decisions
    (``node: old -> new``), summary counts, and which hashes moved."""
    if old == new:
        return []
    if old is None or new is None:
        return [f"{'new' if old is None else 'removed'} case: {painted_counts(new or old)}"]
    lines = []
    if old.get("error") != new.get("error"):
        lines.append(f"error: {old.get('error')} -> {new.get('error')}")
    if ("error" in old) != ("error" in new):   # its decisions all came or went: counts only
        converted = new if "error" in old else old
        return lines + [f"{'now' if converted is new else 'was'}: {painted_counts(converted)}"]
    was, now = old.get("decisions", {}), new.get("decisions", {})
    if "decisions" in new and "decisions" not in old:   # a recording from before they were
        lines.append(f"decisions: first recorded ({len(now)} nodes)")
        was = now
    for node in sorted(set(was) | set(now)):
        if was.get(node) != now.get(node):
            lines.append(f"{node}: {was.get(node, UNRECORDED)} -> {now.get(node, UNRECORDED)}")
    was, now = old.get("summary", {}), new.get("summary", {})
    moved = [f"{k} {json.dumps(was.get(k))} -> {json.dumps(now.get(k))}"
             for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    if moved:
        lines.append("summary: " + ", ".join(moved))
    hashes = [k for k in ("input", "output", "report") if old.get(k) != new.get(k)]
    if hashes:
        lines.append("differs: " + ", ".join(hashes)
                     + ("" if "input" not in hashes else " (the input changed: a test graph "
                        "builder, TensorFlow, or the order the inputs are built in)"))
    return lines


def diff(expected: dict, results: dict, limit: int | None = None) -> list[str]:
    """Per case that differs, its name then its :func:`case_diff` lines (``limit`` per case)."""
    out = []
    for name in sorted(set(expected) | set(results)):
        lines = case_diff(expected.get(name), results.get(name))
        if not lines:
            continue
        if len(lines) > 1:
            shown = lines if limit is None or len(lines) <= limit else (
                lines[:limit] + [f"... and {len(lines) - limit} more (golden.py diff)"])
            out += [f"{name}:"] + [f"  {line}" for line in shown]
        else:
            out.append(f"{name}: {lines[0]}")
    return out


def main(argv: list[str]) -> int:
    """``check`` (the default): exit 1 when a case breaks what it is meant to do or differs
    from the recording, printing why; ``diff``: print the differences only; ``write``: print
    them and record the fresh run, unless a case breaks what it is meant to do (exit 1)."""
    mode = argv[0] if argv else "check"
    if mode not in ("check", "diff", "write"):
        print(f"usage: golden.py [check|diff|write], not {mode!r}", file=sys.stderr)
        return 2
    results, broken = collect()
    expected = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    lines = diff(expected, results, limit=40 if mode == "check" else None)
    for line in broken + lines:
        print(line)
    differ = sum(1 for name in set(expected) | set(results)
                 if case_diff(expected.get(name), results.get(name)))
    print(f"{len(results)} cases, {differ} differ from the recording, {len(broken)} do not do "
          "what they are meant to")
    if mode == "write" and broken:   # a recording must not freeze a case that lost its point
        print(f"not written: fix those {len(broken)} cases, or what they are meant to do, first")
        return 1
    if mode == "write":
        GOLDEN.write_text(dumps(results))
        print(f"wrote {len(results)} cases to {GOLDEN}")
    return 1 if mode == "check" and (broken or differ) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
