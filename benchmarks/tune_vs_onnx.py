"""``amp-rewrite tune`` against onnxconverter-common's ``auto_convert_mixed_precision`` on the
same models, sample and tolerance: trials, wall time, nodes left in float32.

Each model is a frozen FP32 GraphDef that fails in float16 out of the box
(``tests/tune_graphs.py``). Our side runs :func:`amp_rewrite.tools.tuning.tune` in this process; the
ONNX side runs ``benchmarks/onnx_amp.py`` in its own venv (tf2onnx export, then the search;
see that script's docstring for the venv). Both get one sample and ``rel_l2 <= 1e-2`` on
every output.

The ONNX side runs with ``--runtime reference`` (onnx's numpy evaluator, real float16
arithmetic): onnxruntime's CPU provider, the library's default, computes most float16 ops in
float32, so there a search sees no overflow and keeps everything in float16 (the "ort" column
shows what it accepts that way). Our side runs TensorFlow's float16 CPU kernels.

"float32 compute ops": ops of the result that compute in float32, leaving out casts, constants,
inputs, identities and ops with no float type (``onnx_amp.py`` counts the ONNX side the same
way; tf2onnx fuses some ops, e.g. MatMul + BiasAdd into Gemm, so totals differ).

Run: ``.venv/bin/python benchmarks/tune_vs_onnx.py [--write]`` (needs the ONNX tools' venv,
``/work/benchvenv`` as ``benchmarks/range_aware.py`` sets it up, or ``--onnx-python PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import tune_graphs  # noqa: E402
from benchmd import provenance, publish  # noqa: E402

from amp_rewrite.io.load import Model  # noqa: E402
from amp_rewrite.tools.tuning import tune  # noqa: E402

SECTION = "## Accuracy-driven tuning vs onnxconverter-common"
TOLERANCE = 1e-2
NOT_COMPUTE = {"Cast", "Const", "Placeholder", "Identity", "NoOp"}

# name -> (graph builder, sample, output tensor)
MODELS = {
    "large sum (Square then a 256-wide MatMul)":
        (tune_graphs.large_sum, lambda: tune_graphs.inputs(64, scale=10.0), "logits:0"),
    "softmax over biased scores":
        (tune_graphs.attention_softmax, lambda: tune_graphs.inputs(32), "out:0"),
    "deep MLP, 32 layers, one overflowing":
        (tune_graphs.deep_mlp, lambda: tune_graphs.inputs(64), "out:0"),
    "CNN, 8 conv layers on 16x16x3, one overflowing":
        (tune_graphs.deep_cnn, tune_graphs.images, "out:0"),
    "Keras MobileNetV2 (64x64, weights=None, frozen), images scaled to 1e5":
        (lambda: _mobilenet()[0], lambda: {"x": _mobilenet()[1]}, "Identity:0"),
}


def _mobilenet(cache={}):
    """Keras's MobileNetV2 frozen to a GraphDef (input ``x``, output ``Identity``), and a batch
    of 4 images of uniform noise scaled to 1e5 (past float16's range at the input)."""
    if not cache:
        import keras
        import tensorflow as tf
        from tensorflow.python.framework.convert_to_constants import (
            convert_variables_to_constants_v2,
        )
        keras.utils.set_random_seed(0)
        model = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3))
        fn = tf.function(lambda x: model(x, training=False))
        frozen = convert_variables_to_constants_v2(
            fn.get_concrete_function(tf.TensorSpec([4, 64, 64, 3], tf.float32, name="x")))
        assert frozen.inputs[0].name == "x:0" and frozen.outputs[0].name == "Identity:0"
        images = np.random.default_rng(0).uniform(0, 1, (4, 64, 64, 3)).astype(np.float32)
        cache["model"] = (frozen.graph.as_graph_def(), images * 1e5)
    return cache["model"]


def ours(graph_def, feed, relax: bool) -> dict:
    start = time.perf_counter()
    # tf2onnx folds Const-only subgraphs on export (a frozen Keras model's batch norms are
    # Rsqrt/Mul/Sub on constants); fold them here too, or they count as float32 ops
    result = tune(Model.of_graph_def(graph_def), feeds=[feed], tolerance=TOLERANCE, relax=relax,
                  fold_constants=True)
    seconds = time.perf_counter() - start
    fp32 = sum(1 for n in result.report.nodes
               if n.precision == "float32" and n.op not in NOT_COMPUTE)
    return {"trials": result.trials, "seconds": seconds, "kept": len(result.kept),
            "forced": len(result.forced), "fp32_nodes": fp32, "before": result.before,
            "metric_after": result.after, "ok": result.ok}


def theirs(python: str, pb: Path, npz: Path, output: str, runtime: str) -> dict:
    out = pb.with_suffix(f".{runtime}.json")
    proc = subprocess.run([python, str(ROOT / "benchmarks" / "onnx_amp.py"), str(pb),
                           "--inputs", str(npz), "--output", output, "--tolerance",
                           str(TOLERANCE), "--metric", "rel_l2", "--runtime", runtime,
                           "--json", str(out)], capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"onnx_amp.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    p.add_argument("--onnx-python", default="/work/benchvenv/bin/python")
    args = p.parse_args()
    rows = []
    versions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (build, sample, output) in MODELS.items():
            graph_def = build()
            feed = sample()
            pb, npz = Path(tmp) / "model.pb", Path(tmp) / "feed.npz"
            pb.write_bytes(graph_def.SerializeToString())
            np.savez(npz, **feed)
            a = ours(graph_def, feed, relax=False)
            r = ours(graph_def, feed, relax=True)
            b = theirs(args.onnx_python, pb, npz, output, "reference")
            c = theirs(args.onnx_python, pb, npz, output, "ort")
            versions = b["versions"]
            rows.append((name, a, r, b, c))
    lines = [SECTION, "",
             f"`benchmarks/tune_vs_onnx.py`: the same frozen FP32 GraphDef, one sample, "
             f"`rel_l2 <= {TOLERANCE:g}` on the output, searched by `amp-rewrite tune` "
             "(TensorFlow's float16 CPU kernels) and by onnxconverter-common "
             f"{versions.get('onnxconverter_common')} `auto_convert_mixed_precision` after a "
             f"tf2onnx {versions.get('tf2onnx')} export (onnx {versions.get('onnx')}), one "
             f"after the other in one run of the script. {provenance()} Their search runs with "
             "onnx's reference evaluator (real float16 arithmetic); see the last column for its "
             "default runtime.",
             "",
             "| model | metric out of the box (painted / all-fp16 ONNX) | tune: trials, time, "
             "kept, float32 ops | tune --relax: trials, time, float32 ops | "
             "onnxconverter-common: trials, time, float32 ops | time theirs / tune --relax | "
             "metric after (tune --relax / theirs) | theirs on onnxruntime CPU: float32 ops, "
             "all-fp16 metric it sees |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, a, r, b, c in rows:
        ratio = b["seconds"] / r["seconds"] if b.get("seconds") else float("nan")
        after_b = b["metric_after"] if b["error"] is None else f"failed: {_short(b['error'])}"
        lines.append(
            f"| {name} | {_num(a['before'])} / {_num(b['metric_before'])} | {a['trials']}, "
            f"{a['seconds']:.2f} s, {a['kept']}, {a['fp32_nodes']} | {r['trials']}, "
            f"{r['seconds']:.2f} s, {r['fp32_nodes']} | {b['trials']}, {b['seconds']:.2f} s, "
            f"{b['fp32_nodes']} | {ratio:.2g}x | {_num(r['metric_after'])} / {_num(after_b)} | "
            + (f"{c['fp32_nodes']}, {_num(c['metric_before'])} |" if c["error"] is None
               else f"failed: {_short(c['error'])} |"))
    lines += ["", "Trials: conversions evaluated (tune counts trial 0, the painted graph; "
              "onnxconverter-common counts calls of its validation, not its check of the "
              "reference against itself). \"kept\": `keep_fp32` overrides tune wrote. "
              "\"float32 ops\": ops of the result computing in float32, leaving out casts, "
              "constants, inputs and identities, so they include what the rule lists keep "
              "float32 (a Mean, a Softmax) unless `--relax` moved it; tf2onnx fuses some ops "
              "(MatMul + BiasAdd into Gemm), so the two sides' totals differ by a node or two "
              "for the same choice. Times are whole searches, one after the other in one "
              "process; theirs runs numpy's evaluator and ours TensorFlow's kernels, so the "
              "time ratio mixes the search with the runtime (on the tiny graphs our per-trial "
              "cost of converting and opening a session dominates), while trial counts do not. "
              "On onnxruntime's CPU provider, the library's default, float16 ops compute in "
              "float32: the all-fp16 model shows no overflow there (last column) and the search "
              "keeps (nearly) everything float16, a result that overflows on a GPU. On "
              "MobileNetV2 onnxconverter-common's first partial conversion is a model neither "
              "runtime loads (a Clip, from ReLU6, with float16 and float32 inputs), so it stops "
              "with that error. Before its search tune holds in float32 the tensors within "
              "`--headroom` of float16's range on the sample (counted in \"kept\"; "
              "[docs/tuning.md](docs/tuning.md)), so on the models that overflow the first "
              "trial after the painted graph passes. Its trials run the way `verify` runs a "
              "model (grappler on), so each trial's time includes grappler's optimization of "
              "its session."]
    return publish("\n".join(lines), args.write)


def _short(error: str) -> str:
    """An error message without its library prefixes, to 90 characters."""
    text = error.split("FAIL : ")[-1].replace("|", "/")
    return text[:90] + ("..." if len(text) > 90 else "")


def _num(value) -> str:
    return f"{value:.2g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
