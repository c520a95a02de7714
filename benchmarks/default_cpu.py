"""The default conversion on this CPU: Keras SavedModels as users export them, converted with
no flag but ``--target bfloat16 --device cpu --shape``, beside the FP32 SavedModel, grappler's
run-time bfloat16 pass, ``--freeze`` and the conversion that keeps the variables (issue 41
item 6).

Models (random weights, no downloads; batch norms given trained-looking statistics,
``keras_models.set_batch_norms``): CNNs with depthwise and squeeze-excite blocks
(EfficientNetV2B0, MobileNetV2, Xception), DenseNet121, a ResNet50 whose convolutions carry
trained (non-zero) biases before their batch norms, a BERT-style encoder, a small ViT, a speech
model (STFT and log-mel in the signature, Conv1D, GRU) and a Mixture-of-Experts block (top-2
gating, einsum dispatch). Each is exported as users do (``model.export``, or
``tf.saved_model.save`` of a ``tf.Module`` for the two written by hand).

Every variant is timed as a server runs it: in a process of its own
(``benchmarks/serve_worker.py``: the SavedModel in a TF1 session as TF Serving loads it), both
batches in the same process, ``--rounds`` rounds with the variants' order rotating each round
so the machine's drift falls on all alike. A variant's time is the median over rounds of its
processes' median call; its ratio is FP32's over it (above 1: faster than FP32), and in
brackets the lowest and highest of the per-round ratios (FP32's time in a round over the
variant's in the same round). The estimate is the one the default conversion's report prints
(``estimate`` in ``--report``): its speed-up where the cost model could weigh the model, else
what it says it could not weigh.

Run: ``.venv/bin/python benchmarks/default_cpu.py [--rounds 3] [--only NAME] [--json FILE]
[--write]``; ``--render FILE --write`` writes the section again from a ``--json`` file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish, save_results  # noqa: E402
from keras_models import set_batch_norms  # noqa: E402

HERE = Path(__file__).resolve().parent
SECTION = "## The default conversion on this CPU"
BATCHES = (1, 16)
VARIANTS = ("fp32", "grappler", "default", "freeze", "variables")
LABELS = {"fp32": "FP32", "grappler": "grappler's pass", "default": "default",
          "freeze": "--freeze", "variables": "variables kept"}


# ---------------------------------------------------------------- models

def _app(cls, size, **kw):
    def build():
        import keras
        image = keras.Input((size, size, 3), name="image")
        return set_batch_norms(cls(weights=None, input_tensor=image, classifier_activation=None,
                                   **kw))
    return build


def trained_biases(model):
    """``model`` with every convolution's bias drawn non-zero, as a trained network's are."""
    import keras
    rng = np.random.default_rng(1)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D) and layer.use_bias:
            kernel, bias = layer.get_weights()
            layer.set_weights([kernel, rng.normal(0, 0.05, bias.shape).astype(np.float32)])
    return model


def resnet_biased(size):
    def build():
        import keras
        image = keras.Input((size, size, 3), name="image")
        return trained_biases(set_batch_norms(keras.applications.ResNet50(
            weights=None, input_tensor=image, classifier_activation=None)))
    return build


def bert():
    """The BERT-style encoder of BENCHMARKS.md "Serving SavedModels" (4 post-norm blocks 256
    wide, 4 heads, the padding mask, GELU feed-forward 1024, 128 token ids)."""
    from serving import bert as encoder
    return encoder


def vit(size=224, patch=16, layers=4, width=256, heads=4):
    def build():
        import keras
        L = keras.layers
        image = keras.Input((size, size, 3), name="image")
        h = L.Conv2D(width, patch, strides=patch)(image)
        tokens = (size // patch) ** 2
        h = L.Reshape((tokens, width))(h)
        h = h + L.Embedding(tokens, width)(keras.ops.arange(tokens))
        for _ in range(layers):
            n = L.LayerNormalization()(h)
            h = h + L.MultiHeadAttention(heads, width // heads)(n, n)
            n = L.LayerNormalization()(h)
            h = h + L.Dense(width)(L.Dense(4 * width, activation="gelu")(n))
        pooled = L.GlobalAveragePooling1D()(L.LayerNormalization()(h))
        return keras.Model(image, L.Dense(10)(pooled))
    return build


def speech():
    """A keyword spotter, exported as Keras exports: 1 s of 16 kHz audio -> STFT (512/160) ->
    40 log-mel bands, computed in the model (so in the signature) -> two Conv1D (ReLU) -> a GRU
    of 128 -> 12 classes."""
    import keras
    L = keras.layers

    class LogMel(L.Layer):
        def call(self, audio):
            spec = tf.abs(tf.signal.stft(audio, 512, 160, 512)) ** 2
            mel = tf.signal.linear_to_mel_weight_matrix(40, 257, 16000, 20.0, 7600.0)
            return tf.math.log(tf.matmul(spec, mel) + 1e-6)

    audio = keras.Input((16000,), name="audio")
    h = L.Conv1D(128, 5, padding="same", activation="relu")(LogMel()(audio))
    h = L.Conv1D(128, 5, strides=2, padding="same", activation="relu")(h)
    return keras.Model(audio, L.Dense(12)(L.GRU(128)(h)))


class MoE(tf.Module):
    """A Mixture-of-Experts feed-forward block over 64 tokens of 256: a gate picks the top 2 of
    8 experts per token (``tf.math.top_k``), each expert 256 -> 1024 (GELU) -> 256 computed for
    every token by einsum, combined by the softmax of the two chosen gate logits; LayerNorm and
    a residual around it, mean-pooled into 10 logits."""

    def __init__(self, width=256, hidden=1024, experts=8):
        super().__init__()
        init = tf.keras.initializers.GlorotUniform(seed=5)
        self.gate = tf.Variable(init([width, experts]))
        self.w1 = tf.Variable(tf.stack([init([width, hidden]) for _ in range(experts)]))
        self.w2 = tf.Variable(tf.stack([init([hidden, width]) for _ in range(experts)]))
        self.head = tf.Variable(init([width, 10]))
        self.experts = experts

    @tf.function(input_signature=[tf.TensorSpec([None, 64, 256], tf.float32, name="tokens")])
    def serve(self, tokens):
        mean, var = tf.nn.moments(tokens, [-1], keepdims=True)
        x = (tokens - mean) * tf.math.rsqrt(var + 1e-5)
        top = tf.math.top_k(tf.einsum("btd,de->bte", x, self.gate), k=2)
        weights = tf.nn.softmax(top.values)                                        # [b, t, 2]
        route = tf.reduce_sum(tf.one_hot(top.indices, self.experts) * weights[..., None], 2)
        h = tf.nn.gelu(tf.einsum("btd,edh->bteh", x, self.w1))
        y = tf.einsum("bteh,ehd->bted", h, self.w2)
        out = tokens + tf.einsum("bted,bte->btd", y, route)
        return {"logits": tf.matmul(tf.reduce_mean(out, 1), self.head)}


def models():
    """name -> (builder, input key, input shape without the batch, value range). A builder
    returns a Keras model (exported with ``model.export``) or a ``tf.Module`` with ``serve``."""
    import keras
    apps = keras.applications
    return {
        "EfficientNetV2B0 224": (_app(apps.EfficientNetV2B0, 224), "image", (224, 224, 3), 255.0),
        "MobileNetV2 224": (_app(apps.MobileNetV2, 224), "image", (224, 224, 3), 1.0),
        "Xception 160": (_app(apps.Xception, 160), "image", (160, 160, 3), 1.0),
        "DenseNet121 128": (_app(apps.DenseNet121, 128), "image", (128, 128, 3), 1.0),
        "ResNet50 160, trained biases": (resnet_biased(160), "image", (160, 160, 3), 1.0),
        "BERT-style encoder 4x256, seq 128": (bert(), "tokens", (128,), None),
        "ViT 4x256, 224/16": (vit(), "image", (224, 224, 3), 1.0),
        "speech: STFT, log-mel, Conv1D, GRU": (speech, "audio", (16000,), 0.5),
        "MoE block, top-2 of 8": (MoE, "tokens", (64, 256), 1.0),
    }


FROZEN_BATCH = 8


def frozen_models():
    """name -> (builder, input shape without the batch, value range): Keras models frozen to a
    GraphDef at batch FROZEN_BATCH, as a TF1 server or a converter's user holds one."""
    import keras
    apps = keras.applications
    return {"MobileNetV2 224": (_app(apps.MobileNetV2, 224), (224, 224, 3), 1.0),
            "EfficientNetB0 224": (_app(apps.EfficientNetB0, 224), (224, 224, 3), 255.0),
            "ResNet50 160, trained biases": (resnet_biased(160), (160, 160, 3), 1.0)}


def freeze_graph(build, shape, path: Path) -> tuple[str, str]:
    """The model frozen at batch FROZEN_BATCH into ``path``; its input and output tensors."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)
    model = build()
    fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec([FROZEN_BATCH, *shape], tf.float32, name="x"))
    frozen = convert_variables_to_constants_v2(fn)
    path.write_bytes(frozen.graph.as_graph_def().SerializeToString())
    return frozen.inputs[0].name, frozen.outputs[0].name


def measure_frozen(name: str, spec, rounds: int, seconds: float, tmp: Path) -> dict:
    """A frozen graph as it is (FP32), under grappler's pass, converted by default, and
    converted without folding (the default before issue 41), each timed in its own process."""
    build, shape, value = spec
    work = tmp / ("frozen_" + name.split()[0])
    work.mkdir(parents=True, exist_ok=True)
    src = work / "fp32.pb"
    x, y = freeze_graph(build, shape, src)
    feeds = work / "feeds.npz"
    np.savez(feeds, **{f"{x}@{FROZEN_BATCH}": feed(shape, value, FROZEN_BATCH)})
    conversions, paths = {}, {"fp32": (str(src), False), "grappler": (str(src), True)}
    for variant, extra in (("default", []), ("unfolded", ["--no-fold-constants"])):
        out, report = work / f"{variant}.pb", work / f"{variant}.json"
        p = amp(src, "-o", out, "--report", report, "--target", "bfloat16", "--device", "cpu",
                "--force", *extra)
        if p.returncode != 0:
            conversions[variant] = {"error": (p.stdout + p.stderr).strip().splitlines()[-1]}
            continue
        rep = json.loads(report.read_text())
        conversions[variant] = {"matrix": matrix(rep),
                                "fusion": rep.get("fusion", {}).get("summary", "")}
        paths[variant] = (str(out), False)
    times = time_variants(paths, feeds, rounds, seconds, fetch=y)
    row = {"name": name, "batch": FROZEN_BATCH, "conversions": conversions,
           "times": {v: t[FROZEN_BATCH] for v, t in times.items()}}
    print("frozen", name, summarize({"conversions": conversions, "times": row["times"]},
                                    ("grappler", "default", "unfolded")), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return row


def feed(shape, value, batch: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + batch)
    if value is None:   # token ids with padding (id 0) after lengths 16..seq
        seq = shape[0]
        ids = rng.integers(1, 8000, (batch, seq)).astype(np.int32)
        ids[np.arange(seq)[None, :] >= rng.integers(16, seq + 1, batch)[:, None]] = 0
        return ids
    low = 0.0 if value == 255.0 else -value
    return rng.uniform(low, value, (batch, *shape)).astype(np.float32)


def export(build, path: Path) -> None:
    made = build()
    if isinstance(made, tf.Module) and not hasattr(made, "export"):
        tf.saved_model.save(made, str(path), signatures={"serving_default": made.serve})
    else:
        made.export(str(path), verbose=False)


# ---------------------------------------------------------------- conversions and timing

def amp(*args) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "amp-rewrite"
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)


def convert(src: Path, work: Path, key: str, shape, batch: int) -> dict:
    """The conversions at ``batch`` (``amp-rewrite SRC -o OUT --target bfloat16 --device cpu
    --shape KEY=B,...`` as a user runs it): variant -> its output, the report's estimate and
    freeze entry, its matrix ops in bfloat16; ``--freeze`` is not run again where the default
    froze (the same conversion)."""
    flags = ["--target", "bfloat16", "--device", "cpu", "--force",
             "--shape", ",".join(map(str, [f"{key}={batch}", *shape]))]
    out = {}
    for variant, extra in (("default", []), ("variables", ["--no-freeze"]),
                           ("freeze", ["--freeze"])):
        if variant == "freeze" and out.get("default", {}).get("frozen"):
            out[variant] = {**out["default"], "same_as": "default"}
            continue
        path, report = work / f"{variant}_{batch}", work / f"{variant}_{batch}.json"
        p = amp(src, "-o", path, "--report", report, *flags, *extra)
        if p.returncode != 0:
            out[variant] = {"error": (p.stdout + p.stderr).strip().splitlines()[-1]}
            continue
        rep = json.loads(report.read_text())
        out[variant] = {"path": str(path), "estimate": rep.get("estimate"),
                        "frozen": rep.get("freeze", {}).get("frozen", True)
                        if "freeze" in rep else False,
                        "freeze": rep.get("freeze", {}).get("summary", ""),
                        "matrix": matrix(rep)}
    return out


def matrix(report: dict) -> str:
    from amp_rewrite.core.ops import MATRIX_OPS
    ops = [n for n in report.get("nodes", []) if n["op"] in MATRIX_OPS]
    return f"{sum(n['precision'] == 'bfloat16' for n in ops)}/{len(ops)}"


def time_variants(paths: dict, feeds: Path, rounds: int, seconds: float,
                  fetch: str | None = None) -> dict:
    """variant -> batch -> [per-round median seconds], each variant in a process of its own,
    the order rotating per round (``fetch``: frozen GraphDefs, the tensor to fetch)."""
    names = list(paths)
    times = {n: {} for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            path, grappler = paths[name]
            cmd = [sys.executable, str(HERE / "serve_worker.py"), path, str(feeds),
                   "--seconds", str(seconds)] + (["--grappler"] if grappler else []) + (
                      ["--fetch", fetch] if fetch else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{name}: {p.stderr.strip().splitlines()[-1:]}")
            got = json.loads(p.stdout.strip().splitlines()[-1])
            for batch, stats in got.items():
                times[name].setdefault(int(batch), []).append(stats["median"])
    return times


def measure(name: str, spec, rounds: int, seconds: float, tmp: Path) -> dict:
    build, key, shape, value = spec
    work = tmp / name.split()[0].replace(":", "").replace(",", "")
    work.mkdir(parents=True, exist_ok=True)
    src = work / "fp32"
    export(build, src)
    feeds = work / "feeds.npz"
    np.savez(feeds, **{f"{key}@{b}": feed(shape, value, b) for b in BATCHES})
    row = {"name": name, "batches": {}}
    for batch in BATCHES:
        conv = convert(src, work, key, shape, batch)
        paths = {"fp32": (str(src), False), "grappler": (str(src), True)}
        paths.update({v: (c["path"], False) for v, c in conv.items()
                      if "path" in c and "same_as" not in c})
        bfeeds = work / f"feeds_{batch}.npz"
        np.savez(bfeeds, **{f"{key}@{batch}": feed(shape, value, batch)})
        times = time_variants(paths, bfeeds, rounds, seconds)
        row["batches"][batch] = {"conversions": conv,
                                 "times": {v: t[batch] for v, t in times.items()}}
        print(name, batch, summarize(row["batches"][batch]), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return row


def ratio(times: dict, variant: str) -> tuple[float, float, float]:
    base, mine = times["fp32"], times[variant]
    if not mine:
        return float("nan"), float("nan"), float("nan")
    med = float(np.median(base) / np.median(mine))
    per_round = [b / m for b, m in zip(base, mine)]
    return med, min(per_round), max(per_round)


def estimate_text(est: dict | None) -> str:
    if not est:
        return "none"
    if est.get("unknown"):
        return f"could not weigh {est['unknown']}"
    if not est.get("saved_us"):
        return "as float32"
    fp32 = est.get("fp32_us") or 0.0
    net = est["saved_us"] - est["lost_us"]
    if fp32 and fp32 > net:
        return f"{fp32 / (fp32 - net):.2f}x"
    return f"saves {net:.0f} µs"


def _times(b: dict, variant: str) -> list[float]:
    """A variant's per-round times (the default's where it was the same conversion)."""
    same = b["conversions"].get(variant, {}).get("same_as")
    return b["times"].get(same or variant, [])


def summarize(b: dict, variants=VARIANTS[1:]) -> str:
    parts = [f"fp32 {np.median(b['times']['fp32']) * 1e3:.1f} ms"]
    for v in variants:
        if _times(b, v):
            b = {**b, "times": {**b["times"], v: _times(b, v)}}
            med, lo, hi = ratio(b["times"], v)
            parts.append(f"{v} {med:.2f}x ({lo:.2f}-{hi:.2f})")
        elif v in b["conversions"]:
            parts.append(f"{v}: {b['conversions'][v].get('error', '?')}")
    est = b["conversions"].get("default", {}).get("estimate")
    parts.append(f"estimate {estimate_text(est)}")
    return "; ".join(parts)


def _cell(b: dict, variant: str) -> str:
    if variant in b["conversions"] and "error" in b["conversions"][variant]:
        return "fails"
    times = _times(b, variant)
    if not times:
        return "-"
    med, lo, hi = ratio({"fp32": b["times"]["fp32"], variant: times}, variant)
    return f"{med:.2f}x ({lo:.2f}-{hi:.2f})"


def _estimate_cell(b: dict) -> str:
    """The default conversion's estimate: the matrix work's speed-up it weighed (float32 time
    over float32 less what bfloat16 saves net), or that it could not weigh some."""
    est = b["conversions"].get("default", {}).get("estimate")
    if not est:
        return "none"
    if est.get("unknown"):
        return f"not weighed ({est['unknown']} matrix ops)"
    net = est["saved_us"] - est["lost_us"]
    if not est.get("fp32_us") or net >= est["fp32_us"]:
        return "-"
    return f"{est['fp32_us'] / (est['fp32_us'] - net):.2f}x"


def geomean(values) -> float:
    values = [v for v in values if v == v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def done_when(result: dict) -> list[tuple[str, bool]]:
    """Issue 41's conditions on this table."""
    lows = [(r["name"], batch, ratio(b["times"], "default")[0])
            for r in result["rows"] for batch, b in r["batches"].items()]
    worst = min(lows, key=lambda x: x[2])
    checks = [(f"the default conversion at least 0.95x FP32 on every model and batch (lowest "
               f"{worst[2]:.2f}x: {worst[0]}, batch {worst[1]})", worst[2] >= 0.95)]
    frozen = [(r["name"], ratio(r["times"], "default")[0] / ratio(r["times"], "grappler")[0])
              for r in result.get("frozen", [])]
    if frozen:
        name, least = min(frozen, key=lambda x: x[1])
        checks.append((f"on frozen graphs the default conversion at least grappler's pass, "
                       f"within 5% (the rounds' noise; lowest {least:.2f}x grappler's speed: "
                       f"{name})", least >= 0.95))
    return checks


def table(result: dict) -> str:
    """The section (rendered again from the kept result by tests/test_docs.py)."""
    lines = [SECTION, "", result["provenance"], "",
             "`benchmarks/default_cpu.py` (issue 41 item 6): Keras models as users export them "
             "(random weights, batch norms given trained-looking statistics), each converted as "
             "a user converts it, `amp-rewrite SAVEDMODEL -o OUT --target bfloat16 --device cpu "
             "--shape KEY=B,...` told the batch it is timed at (**default**), with "
             "`--no-freeze` (**variables kept**: the conversion before issue 41) and with "
             "`--freeze` (the same as the default where the default froze: every model here "
             "only serves); the FP32 SavedModel as exported, and under grappler's run-time "
             "`auto_mixed_precision_onednn_bfloat16` pass. **Each variant timed in a process of "
             f"its own**, as a server runs one model (`benchmarks/serve_worker.py`: a TF1 "
             f"session as TF Serving loads it, warm-up calls, then calls for "
             f"{result['seconds']:g} s), {result['rounds']} rounds with the order rotating; a "
             "variant's time is the median of its rounds, its ratio FP32's over it (above 1: "
             "faster than FP32), in brackets the lowest and highest of the per-round ratios. "
             "\"estimate\" is the default conversion's cost model: the speed-up of the matrix "
             "work it weighed, what it decides with (it leaves out fusions, layout, freezing's "
             "gain), not the model's speed.", "",
             "| model | batch | FP32 ms | grappler's pass | **default** | variables kept | "
             "--freeze | MatMul/Conv in bf16 (default) | estimate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        for batch, b in row["batches"].items():
            frozen = b["conversions"].get("freeze", {}).get("same_as") == "default"
            lines.append(
                f"| {row['name']} | {batch} | {np.median(b['times']['fp32']) * 1e3:.1f} | "
                f"{_cell(b, 'grappler')} | **{_cell(b, 'default')}** | {_cell(b, 'variables')} | "
                f"{'= default' if frozen else _cell(b, 'freeze')} | "
                f"{b['conversions'].get('default', {}).get('matrix', '-')} | {_estimate_cell(b)} |")
    lines += ["", "Geometric means over the models (ratios to FP32):", "",
              "| batch | grappler's pass | default | variables kept |", "| --- | --- | --- | --- |"]
    for batch in sorted({bt for r in result["rows"] for bt in r["batches"]}, key=int):
        cells = [geomean(ratio(r["batches"][batch]["times"], v)[0] for r in result["rows"]
                         if batch in r["batches"] and v in r["batches"][batch]["times"])
                 for v in ("grappler", "default", "variables")]
        lines.append(f"| {batch} | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")
    if result.get("frozen"):
        lines += ["", f"Frozen graphs (each model frozen to a GraphDef at batch {FROZEN_BATCH}, "
                  "as a TF1 server holds one; `amp-rewrite FROZEN.pb -o OUT.pb --target bfloat16 "
                  "--device cpu`, which folds constants and batch norms by default, and with "
                  "`--no-fold-constants`, the default before issue 41), timed the same way:", "",
                  "| model | batch | FP32 ms | grappler's pass | **default** | --no-fold-constants "
                  "| MatMul/Conv in bf16 (default) | folded (default) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in result["frozen"]:
            conv = row["conversions"].get("default", {})
            lines.append(f"| {row['name']} | {row['batch']} | "
                         f"{np.median(row['times']['fp32']) * 1e3:.1f} | {_cell(row, 'grappler')} "
                         f"| **{_cell(row, 'default')}** | {_cell(row, 'unfolded')} | "
                         f"{conv.get('matrix', '-')} | {conv.get('fusion') or 'nothing'} |")
    lines += ["", "Done when (issue 41), as this run found:", ""]
    lines += [f"- {'holds' if ok else 'FAILS'}: {text}" for text, ok in done_when(result)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--only", nargs="*", default=())
    ap.add_argument("--json")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    result = {"provenance": provenance(), "rounds": args.rounds, "seconds": args.seconds,
              "rows": []}
    with tempfile.TemporaryDirectory(prefix="default_cpu_") as tmp:
        for name, spec in models().items():
            if args.only and not any(o.lower() in name.lower() for o in args.only):
                continue
            result["rows"].append(measure(name, spec, args.rounds, args.seconds, Path(tmp)))
            if args.json:   # as it goes: a long run's rows survive its end
                Path(args.json).write_text(json.dumps(result, indent=1))
        result["frozen"] = []
        for name, spec in frozen_models().items():
            if args.only and not any(o.lower() in name.lower() for o in args.only):
                continue
            result["frozen"].append(measure_frozen(name, spec, args.rounds, args.seconds,
                                                   Path(tmp)))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    if args.write:
        save_results("default_cpu", result)
    return publish(table(result), args.write)


if __name__ == "__main__":
    sys.exit(main())
