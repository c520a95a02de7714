"""Keras applications and a BERT-style encoder: FP32 against amp-rewrite's bfloat16 and
grappler's own bfloat16 pass, on this CPU, in one run.

Each model (``weights=None``, batch 8, frozen to constants) runs three ways in one process:
the FP32 graph; ``amp_rewrite.convert(gd, target="bfloat16", device="cpu")``; and the FP32
graph in a session with grappler's ``auto_mixed_precision_onednn_bfloat16`` pass on (oneDNN's
bfloat16 mode, as ``TF_ENABLE_ONEDNN_OPTS=1`` turns on even on CPUs without AVX-512). After two
warm-up runs each, ``--rounds`` rounds run the three round-robin, the order rotating per round;
the table gives the medians and FP32 median / variant median. Conversion time and peak
memory are ours (``convert``) beside grappler's pass alone on the same graph
(``tf_optimizer.OptimizeGraph``), each in a fresh process (``scaling.convert_in_child``); the
logits' relative L2 error is against FP32 on the same images.

Run: ``.venv/bin/python benchmarks/keras_models.py [--rounds 7] [--write]`` (about 15 minutes
on 2 cores).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402
from scaling import convert_in_child  # noqa: E402
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2  # noqa: E402
from train_step import runtime_difference, session, time_round_robin  # noqa: E402

from amp_rewrite import convert  # noqa: E402

v1 = tf.compat.v1
SECTION = "## Keras models"
BATCH = 8


def bert_encoder(layers: int = 4, width: int = 256, heads: int = 4, seq: int = 128):
    import keras
    ids = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(8000, width)(ids)
    h = h + keras.layers.Embedding(seq, width)(keras.ops.arange(seq))
    for _ in range(layers):
        a = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(width, )(keras.layers.Dense(4 * width, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h + f)
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(ids, out)


def models():
    import keras
    apps = keras.applications
    return {
        "ResNet50": (lambda: apps.ResNet50(weights=None, classifier_activation=None), "images"),
        "MobileNetV2": (lambda: apps.MobileNetV2(weights=None, classifier_activation=None), "images"),
        "DenseNet121": (lambda: apps.DenseNet121(weights=None, classifier_activation=None), "images"),
        "EfficientNetB0": (lambda: apps.EfficientNetB0(weights=None, classifier_activation=None), "images"),
        "ConvNeXtTiny": (lambda: apps.ConvNeXtTiny(weights=None, classifier_activation=None), "images"),
        "BERT-style encoder (4 layers, 256 wide, seq 128)": (bert_encoder, "tokens"),
        # weights=None leaves every batch norm an identity (offset 0, scale 1/sqrt(1+eps)), which
        # constant folding removes; a trained one has offsets and scales (see set_batch_norms)
        "ResNet50, batch norms set": (lambda: set_batch_norms(apps.ResNet50(
            weights=None, classifier_activation=None)), "images"),
        "MobileNetV2, batch norms set": (lambda: set_batch_norms(apps.MobileNetV2(
            weights=None, classifier_activation=None)), "images"),
    }


def set_batch_norms(model):
    """``model`` with every batch norm's statistics and affine parameters drawn as a trained
    network's look (scale 0.5-1.5, offset and mean near 0, variance 0.5-1.5), seeded."""
    import keras
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            shapes = [w.shape for w in layer.get_weights()]
            gamma, beta, mean, var = (rng.uniform(0.5, 1.5, shapes[0]), rng.normal(0, 0.1, shapes[1]),
                                      rng.normal(0, 0.1, shapes[2]), rng.uniform(0.5, 1.5, shapes[3]))
            layer.set_weights([w.astype(np.float32) for w in (gamma, beta, mean, var)])
    return model


def freeze(model, kind: str):
    """The model as a frozen GraphDef, its input and output tensor names, and a feed."""
    rng = np.random.default_rng(0)
    if kind == "images":
        spec = tf.TensorSpec([BATCH, 224, 224, 3], tf.float32, name="x")
        value = rng.uniform(0, 1, (BATCH, 224, 224, 3)).astype(np.float32)
    else:
        spec = tf.TensorSpec([BATCH, 128], tf.int32, name="x")
        value = rng.integers(0, 8000, (BATCH, 128)).astype(np.int32)
    fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec)
    frozen = convert_variables_to_constants_v2(fn)
    return frozen.graph.as_graph_def(), frozen.inputs[0].name, frozen.outputs[0].name, value


def measure(name: str, build, kind: str, rounds: int) -> dict:
    import keras
    keras.utils.set_random_seed(0)
    gd, inp, out, value = freeze(build(), kind)
    ours_gd, report = convert(gd, target="bfloat16", device="cpu")
    folded_gd, _ = convert(gd, target="bfloat16", device="cpu", fold_constants=True)
    with tempfile.TemporaryDirectory() as tmp:   # each conversion timed and its peak taken alone
        path = Path(tmp) / "frozen.pb"
        path.write_bytes(gd.SerializeToString())
        conversions = {"ours": convert_in_child(path),
                       "grappler": convert_in_child(path, out.split(":")[0])}
    sessions = {"fp32": session(gd, False), "ours": session(ours_gd, False),
                "folded": session(folded_gd, False), "grappler": session(gd, True)}
    feed = {inp: value}
    outputs = {k: np.asarray(s.run(out, feed), np.float64) for k, s in sessions.items()}
    times = time_round_robin({k: functools.partial(s.run, out, feed) for k, s in sessions.items()},
                             rounds, warmup=1)
    for s in sessions.values():
        s.close()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    ref = outputs["fp32"]

    def err(k):
        return float(np.linalg.norm(outputs[k] - ref) / max(np.linalg.norm(ref), 1e-30))

    summary = report.summary()
    return {"name": name, "nodes": len(gd.node), "fp32_ms": med["fp32"], "ours_ms": med["ours"],
            "folded_ms": med["folded"], "folded_err": err("folded"),
            "grappler_ms": med["grappler"], "ours_err": err("ours"), "grappler_err": err("grappler"),
            **{f"{who}_convert_s": c["seconds"] for who, c in conversions.items()},
            **{f"{who}_mb": (c["peak_kib"] - c["base_kib"]) / 1024 for who, c in conversions.items()},
            "matrix": f"{summary['matrix_converted']}/{summary['matrix_total']}",
            "differ": runtime_difference(ours_gd, gd, [out.split(":")[0]])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", action="append", default=[], help="model names to run")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    return publish(run(args.rounds, args.only), args.write)


def run(rounds: int = 7, only=()) -> str:
    """Every model (or those whose names contain one of ``only``) three ways; the section's
    Markdown."""
    rows = []
    for name, (build, kind) in models().items():
        if only and not any(o in name for o in only):
            continue
        try:
            rows.append(measure(name, build, kind, rounds))
        except Exception as exc:  # noqa: BLE001 - a model that fails is a row saying so
            rows.append({"name": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
        print(rows[-1], file=sys.stderr, flush=True)
    lines = [SECTION, "",
             "`benchmarks/keras_models.py`: Keras applications (`weights=None`, 224x224x3) and a "
             "BERT-style encoder, batch 8, frozen; FP32, amp-rewrite's bfloat16 conversion "
             "(`--device cpu`, default options, and with `--fold-constants`) and grappler's "
             "`auto_mixed_precision_onednn_bfloat16` on the FP32 graph, run round-robin in one "
             f"process, {rounds} rounds after 2 warm-up runs, medians. {provenance()} Ratios "
             "are FP32 time / variant time (above 1: faster than FP32); errors are the logits' "
             "relative L2 error against FP32.",
             "",
             "| model | nodes | MatMul/Conv in bf16 (ours) | FP32 ms | amp-rewrite ms (ratio) | "
             "with --fold-constants ms (ratio) | grappler ms (ratio) | ours / grappler speed | "
             "folded / grappler speed | ops that differ at run time | "
             "rel. L2 error ours / folded / grappler | conversion s: ours / grappler | "
             "conversion peak MB: ours / grappler |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['nodes']} | {r['matrix']} | {r['fp32_ms']:.0f} | "
            f"{r['ours_ms']:.0f} ({r['fp32_ms'] / r['ours_ms']:.2f}x) | {r['folded_ms']:.0f} "
            f"({r['fp32_ms'] / r['folded_ms']:.2f}x) | {r['grappler_ms']:.0f} "
            f"({r['fp32_ms'] / r['grappler_ms']:.2f}x) | {r['grappler_ms'] / r['ours_ms']:.2f}x | "
            f"{r['grappler_ms'] / r['folded_ms']:.2f}x | {r['differ']} | {r['ours_err']:.1e} / "
            f"{r['folded_err']:.1e} / {r['grappler_err']:.1e} | {r['ours_convert_s']:.2f} / "
            f"{r['grappler_convert_s']:.2f} | {r['ours_mb']:.0f} / {r['grappler_mb']:.0f} |")
    lines += ["", "The machine is shared with other jobs, so absolute times are noisy; the "
              "ratios come from runs interleaved in one process. \"ours / grappler speed\" above "
              "1 means amp-rewrite's graph ran faster than grappler's (\"folded\": with "
              "`--fold-constants`, which also folds batch norms into the convolutions so that "
              "TensorFlow fuses them with their activations); \"ops that differ at run "
              "time\" (of the default conversion) counts the ops (with their dtypes) that "
              "differ between the two bfloat16 graphs after grappler's passes "
              "(`train_step.runtime_difference`; before placement, so without the oneDNN fusions "
              "a session adds): 0 means the same ops in the same dtypes, so their speeds differ "
              "only by noise. A model with 0 matrix ops in bfloat16 was kept float32 whole by the "
              "cost model (docs/decisions.md \"Small matrix ops stay float32\": its unfused bfloat16 "
              "activations would lose more than its matrix ops save); its graph computes what the "
              "FP32 graph does, and its ratio is 1 within noise: the untrained MobileNetV2, whose "
              "batch norms fold away, so that no bias follows a convolution and its Relu6 run "
              "unfused. With its batch norms set, a batch norm computed from Consts is the bias "
              "TensorFlow fuses (grappler's constant folding computes it, the remapper fuses "
              "Conv2D + bias + Relu6), every matrix op goes to bfloat16 and the graph after "
              "grappler's passes is the one grappler's own pass makes (0 ops differ). "
              "The errors are relative to untrained models' logits, some near zero "
              "(MobileNetV2's largest is about 2.5e-11), where tiny differences weigh heavily. "
              "Conversion times are one "
              "conversion each, in a fresh process of its own (grappler's pass alone, without the "
              "session's other passes), with its peak memory above that process's baseline "
              "(`benchmarks/scaling.py`)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
