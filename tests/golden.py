"""The golden corpus: the graphs the tests build, converted, with hashes of what came out.

A redesign of the converter must change no decision. ``python tests/golden.py write`` converts
every case below and records, per case, the SHA-256 of the input, of the output (a SavedModel's
files but ``fingerprint.pb``, which holds a random uuid) and of the JSON report, or the error a
refused case raised; ``tests/test_golden.py`` runs ``python tests/golden.py check`` in a fresh
process (TensorFlow numbers functions by a per-process counter, so the inputs are only the same
in a process that built the same things before) and fails on any difference. A change that is
meant to change decisions rewrites ``tests/golden.json`` in its own commit, saying why.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import graphs  # noqa: E402
import grappler_graphs as gg  # noqa: E402
import training_graphs as tg  # noqa: E402
from amp_rewrite import convert_file  # noqa: E402
from amp_rewrite.errors import AmpRewriteError  # noqa: E402
from amp_rewrite.rules import builtin_rules_dir  # noqa: E402

ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "cnn_fp32.pb"
RULE_EXAMPLES = sorted((ROOT / "rules" / "examples").glob("*.toml"))
GOLDEN = HERE / "golden.json"
KERAS_EXPORT = HERE / "data" / "keras_export"
F16 = {"target": "float16"}
BF16 = {"target": "bfloat16", "device": "cpu"}


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
    """``(name, input path, options)`` for every case, built into ``folder`` in a fixed order."""
    out = []
    for name, opts in (("f16", F16), ("bf16", BF16), ("bf16_fold", {**BF16, "fold_constants": True})):
        out.append((f"example_{name}", EXAMPLE, opts))
    for rules in RULE_EXAMPLES:
        out.append((f"example_rules_{rules.stem}", EXAMPLE, {**F16, "rules": [str(rules)]}))
    out.append(("example_keep_lowp_io", EXAMPLE, {**F16, "keep": ["head/fc1"], "lowp_io": True}))

    grappler = {"conv_bn": gg.conv_bn, "conv_pool": gg.conv_pool, "multi_paths": gg.multi_paths}
    for spec in [("w", "c", "w"), ("c", "c", "w"), ("w", "g", "w"), ("w", "gbg", "cb"),
                 ("b", "gwc", "c"), ("b", "cwcg", "c"), ("c", "cwcg", "c"), ("c", "cwgcg", "c"),
                 ("w", "gbg", "w"), ("w", "ggg", "w")]:
        grappler["loop_" + "_".join(spec)] = lambda s=spec: gg.simple_loop(*s)
    for name, build in grappler.items():
        graph_def, _ = build()
        path = _write_graph_def(folder, f"grappler_{name}", graph_def)
        keep = [n.name for n in graph_def.node if n.name in ("output", "grad_output")]
        out.append((f"grappler_{name}_bf16", path, {**BF16, "keep": keep}))
        out.append((f"grappler_{name}_f16", path, F16))

    for build in (graphs.mlp, graphs.conv_bn, graphs.conv_bias_relu_pool, graphs.attention,
                  graphs.while_v1, graphs.tensorarray_lstm, graphs.functional_while):
        path = _write_graph_def(folder, build.__name__, build()[0])
        out.append((f"{build.__name__}_f16", path, F16))
        out.append((f"{build.__name__}_bf16", path, BF16))

    import test_functions as tfn
    for build in (tfn.control_flow_graph, tfn.shared_callee_graph):
        path = _write_graph_def(folder, build.__name__, build())
        out.append((f"{build.__name__}_f16", path, F16))
        out.append((f"{build.__name__}_bf16", path, BF16))

    path = _write_graph_def(folder, "training_mlp", graphs.training_mlp()[0])
    out.append(("training_mlp_pb_f16", path, F16))
    out.append(("training_mlp_pb_bf16", path, BF16))
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
            ("cnn", "adam", {}, BF16)):
        tag = "_".join([model, optimizer] + [f"{v}" for v in kwargs.values()]
                       + [str(opts.get("loss_scale", opts["target"]))])
        path = _write_meta(folder, f"train_{tag}", tg.build(model, optimizer, **kwargs))
        out.append((f"train_{tag}", path, opts))

    import test_savedmodel as tsm
    loop = tsm.LoopAndBranch()
    path = _saved(folder, "loop_module", loop, loop.__call__)
    out.append(("saved_loop_f16", path, F16))
    out.append(("saved_loop_bf16", path, BF16))
    trainer = tsm.Trainer()
    path = _saved(folder, "trainer", trainer, {"train": trainer.train, "predict": trainer.predict})
    out.append(("saved_trainer_bf16", path, BF16))
    out.append(("saved_trainer_f16", path, F16))
    out.append(("saved_trainer_f16_no_scaling", path, {**F16, "loss_scale": "none"}))
    shared = tsm.SharedInner()
    path = _saved(folder, "shared_inner", shared, shared.__call__)
    out.append(("saved_shared_inner_f16", path, F16))
    path = _keras_export(folder)
    out.append(("saved_keras_f16", path, F16))
    out.append(("saved_keras_bf16", path, BF16))
    path = folder / "tf1_train_serve"
    tsm._tf1_train_and_serve(path)
    out.append(("saved_tf1_train_serve_bf16", path, BF16))
    out.append(("saved_tf1_train_serve_f16_refused", path, F16))
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


def run_case(path: Path, opts: dict, out_dir: Path, name: str) -> dict:
    dst = out_dir / (name + (path.suffix if path.is_file() else ""))
    record = {"input": digest(path)}
    try:
        report = convert_file(path, dst, **opts)
    except AmpRewriteError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}".replace(str(path), "<input>")
        return record
    # paths of the input and of rule files depend on where the checkout and package are
    text = (report.to_json().replace(str(path), "<input>")
            .replace(str(ROOT / "rules" / "examples"), "<rule examples>")
            .replace(str(builtin_rules_dir()), "<built-in rules>").replace(str(ROOT), "<checkout>"))
    if not opts.get("fold_constants"):
        # folded values are computed on this CPU, whose vector units may round the last bit
        # differently (AVX2 vs AVX-512): the decisions are compared, not the folded bytes
        record["output"] = digest(dst)
    record["report"] = hashlib.sha256(text.encode()).hexdigest()
    record["summary"] = report.summary()
    return record


def collect() -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, out_dir = Path(tmp) / "in", Path(tmp) / "out"
        folder.mkdir()
        out_dir.mkdir()
        for name, path, opts in cases(folder):
            results[name] = run_case(path, opts, out_dir, name)
    return results


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "check"
    results = collect()
    if mode == "write":
        GOLDEN.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(results)} cases to {GOLDEN}")
        return 0
    expected = json.loads(GOLDEN.read_text())
    bad = []
    for name in sorted(set(expected) | set(results)):
        want, got = expected.get(name), results.get(name)
        if want != got:
            bad.append(f"{name}:\n  expected {json.dumps(want, sort_keys=True)}\n"
                       f"  got      {json.dumps(got, sort_keys=True)}")
    for line in bad:
        print(line)
    print(f"{len(results)} cases, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
