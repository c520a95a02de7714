"""amp-rewrite beside its peers on frozen Keras models: grappler's bfloat16 pass and Intel Neural
Compressor 2.6's bf16 ``mix_precision``, against FP32, in one run.

Models: Keras applications (``weights=None``, batch norms given trained-like statistics by
``keras_models.set_batch_norms``, small images: ``--size``, default 160x160) and the BERT-style
encoder of ``benchmarks/keras_models.py`` (token and position Embedding, 4 Transformer blocks of
MultiHeadAttention, LayerNormalization and a GELU Dense feed-forward layer; 256 wide, seq 128),
each frozen with ``convert_variables_to_constants_v2`` at batch ``--batch`` (default 8). Four
graphs per model:

* ``FP32``: the frozen graph;
* ``amp-rewrite``: ``amp-rewrite frozen.pb -o out.pb --target bfloat16 --device cpu
  --fold-constants --shape x=BATCH,...`` (``convert(..., fold_constants=True, shapes=...)``);
* ``grappler``: the FP32 graph in a session with grappler's ``auto_mixed_precision_onednn_bfloat16``
  pass on (``train_step.session``), as the other benchmarks run it;
* ``INC``: ``neural_compressor.mix_precision.fit(graph_def, MixedPrecisionConfig(device="cpu",
  precisions=["bf16"], inputs=[...], outputs=[...]))``, its ``graph_def`` written out.

Each conversion runs in a fresh process of its own (INC's in INC's venv), timed around the
conversion call alone (TensorFlow's and INC's imports left out), with its peak resident memory
above that process's baseline; grappler's is its bfloat16 pass alone on the same graph
(``tf_optimizer.OptimizeGraph``, ``scaling.grappler_amp``), which a session runs again each time
it is created. If INC fails on a model, its row says why and the others are still measured.

The four graphs then run in this one process, in TF1 sessions: ``--rounds`` rounds after two
warm-up rounds, round-robin with the order rotating every round (``train_step.time_round_robin``),
so load from other jobs on the shared cores falls on all four alike. Speed is FP32's median over
the variant's; in brackets the p10-p90 of the per-round ratios (each round runs all four back to
back). Errors are against FP32 over ``--eval`` batches of other inputs (images uniform in 0-1,
tokens uniform): the logits' relative L2 error and the share of samples whose top-1 class agrees.
Op counts are of each graph after grappler's passes as its session sets them
(``train_step.runtime_ops``: constant folding, arithmetic and layout passes, grappler's bfloat16
pass for its own column; before placement, so without the oneDNN fusions a session adds): matrix
ops (``amp_rewrite.core.ops.MATRIX_OPS``) in bfloat16 of all, compute ops in bfloat16 of all
(every op with a float type but Const, Cast, Identity, Placeholder and NoOp), and the Casts.

Intel Neural Compressor is no dependency of this project; it runs in a venv of its own that
reuses the project's TensorFlow (no second TensorFlow is installed) through a ``.pth`` file::

    python3.11 -m venv /work/incvenv
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /work/incvenv/lib/python3.11/site-packages/zz_amp_project_site.pth
    /work/incvenv/bin/pip install neural-compressor==2.6
    /work/incvenv/bin/pip uninstall -y numpy

2.6 is the last release with TensorFlow ``mix_precision`` (3.x dropped it). It pins
``numpy<2.0``, but TensorFlow 2.21's ``ml_dtypes`` needs numpy 2: with numpy 1.26 in the venv
``import tensorflow`` fails, so the venv's numpy is removed and the project's numpy 2 serves
(``pip check`` then reports the pin; the bf16 conversion runs). It needs no torch. On TensorFlow
2.21 INC picks its op lists for the nearest version it knows (2.13): bf16 for Conv2D, Conv3D,
DepthwiseConv2dNative, MatMul, BatchMatMul, MaxPool and AvgPool, float32 for everything else, a
Cast before and after each painted op (its ITEX list, which paints activations too, applies to
Intel's TensorFlow extension only). It also folds batch norms into the convolutions and constant
subgraphs away before painting.

Run, from the repository root (about 8 minutes on 2 cores)::

    .venv/bin/python benchmarks/peers.py --inc-python /work/incvenv/bin/python [--write]

``--only NAME`` runs the models whose names hold NAME. It is no test: benchmarks only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTION = "## Peers: grappler and Intel Neural Compressor"
TOOLS = ("amp-rewrite", "grappler", "INC")
NOT_COMPUTE = {"Const", "Cast", "Identity", "Placeholder", "NoOp"}
BF16, FLOAT = 14, 1   # DataType enum values


# ----------------------------------------------------------------- conversions, each in a child
def _rss(key: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))


def child(who: str, src: str, dst: str, inputs: str, outputs: str, shape: str) -> int:
    """One conversion in this fresh process: ``who`` converts the GraphDef at ``src`` and
    writes it to ``dst`` (grappler: nothing written); prints seconds and memory as JSON."""
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef.FromString(Path(src).read_bytes())
    if who == "amp-rewrite":
        from amp_rewrite import convert
        shapes = {inputs: tuple(int(d) for d in shape.split(","))}

        def run():
            return convert(gd, target="bfloat16", device="cpu", fold_constants=True,
                           shapes=shapes)[0]
    elif who == "grappler":
        sys.path.insert(0, str(HERE))
        import scaling

        def run():
            scaling.grappler_amp(gd, outputs)
    else:
        import logging
        from neural_compressor import mix_precision
        from neural_compressor.config import MixedPrecisionConfig
        logging.getLogger("neural_compressor").setLevel(logging.WARNING)
        conf = MixedPrecisionConfig(device="cpu", precisions=["bf16"], inputs=[inputs],
                                    outputs=[outputs])

        def run():
            return mix_precision.fit(gd, conf).graph_def
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    base = _rss("VmRSS:")
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    peak = _rss("VmHWM:")
    if out is not None:
        Path(dst).write_bytes(out.SerializeToString())
    print(json.dumps({"seconds": seconds, "mb": (peak - base) / 1024}))
    return 0


def convert_in_child(python: str, who: str, src: Path, dst: Path, inp: str, out: str,
                     shape) -> dict:
    """Run :func:`child` under ``python``; its JSON, or ``{"error": reason}``."""
    env = dict(os.environ)
    if who == "amp-rewrite":
        env["PYTHONPATH"] = str(ROOT)
    try:
        done = subprocess.run([python, str(Path(__file__).resolve()), "--child", who, str(src),
                               str(dst), inp, out, ",".join(map(str, shape))],
                              capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(),
                              timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 30 minutes"}
    if done.returncode:
        lines = [l for l in done.stderr.strip().splitlines() if l.strip()]
        reason = next((l for l in reversed(lines) if "Error" in l or "error" in l), lines[-1] if lines else "")
        return {"error": reason.strip()[:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- models
def models(size: int):
    """name -> (builder, input kind)."""
    import keras
    from keras_models import bert_encoder, set_batch_norms
    apps = keras.applications

    def app(cls):
        return lambda: set_batch_norms(cls(weights=None, input_shape=(size, size, 3),
                                           classifier_activation=None))
    return {"ResNet50": (app(apps.ResNet50), "images"),
            "MobileNetV2": (app(apps.MobileNetV2), "images"),
            "DenseNet121": (app(apps.DenseNet121), "images"),
            "EfficientNetB0": (app(apps.EfficientNetB0), "images"),
            "ConvNeXtTiny": (app(apps.ConvNeXtTiny), "images"),
            "BERT-style encoder (4 layers, 256 wide, seq 128)": (bert_encoder, "tokens")}


def freeze(model, kind: str, batch: int, size: int):
    """The frozen GraphDef, its input and output tensor names, the input shape, and a function
    drawing a batch of inputs from a seed."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    if kind == "images":
        shape, dtype = (batch, size, size, 3), tf.float32

        def draw(seed):
            return np.random.default_rng(seed).uniform(0, 1, shape).astype(np.float32)
    else:
        shape, dtype = (batch, 128), tf.int32

        def draw(seed):
            return np.random.default_rng(seed).integers(0, 8000, shape).astype(np.int32)
    fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec(shape, dtype, name="x"))
    frozen = convert_variables_to_constants_v2(fn)
    return frozen.graph.as_graph_def(), frozen.inputs[0].name, frozen.outputs[0].name, shape, draw


def _painted(graph_def, fetch: str, grappler: bool) -> dict:
    """Matrix and compute ops in bfloat16 and casts, after grappler's passes; the op types in
    bfloat16."""
    from train_step import runtime_ops

    from amp_rewrite.core.ops import MATRIX_OPS
    counts = runtime_ops(graph_def, [fetch], grappler)
    floats = {(op, types): n for (op, types), n in counts.items()
              if op not in NOT_COMPUTE and any(t in (BF16, FLOAT) for _, t in types)}
    low = {(op, types): n for (op, types), n in floats.items() if any(t == BF16 for _, t in types)}
    by_type = {}
    for (op, _), n in low.items():
        by_type[op] = by_type.get(op, 0) + n
    return {"matrix": sum(n for (op, _), n in low.items() if op in MATRIX_OPS),
            "matrix_total": sum(n for (op, _), n in floats.items() if op in MATRIX_OPS),
            "compute": sum(low.values()), "compute_total": sum(floats.values()),
            "casts": sum(n for (op, _), n in counts.items() if op == "Cast"), "types": by_type}


def measure(name: str, build, kind: str, args) -> dict:
    import keras
    import numpy as np
    from tensorflow.core.framework import graph_pb2
    from train_step import session, time_round_robin
    keras.utils.set_random_seed(0)
    gd, inp, out, shape, draw = freeze(build(), kind, args.batch, args.size)
    fetch = out.split(":")[0]
    graphs, conversions = {"FP32": gd}, {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "fp32.pb"
        src.write_bytes(gd.SerializeToString())
        for who in TOOLS:
            dst = Path(tmp) / f"{who}.pb"
            python = args.inc_python if who == "INC" else sys.executable
            conversions[who] = convert_in_child(python, who, src, dst, inp.split(":")[0], fetch,
                                                shape)
            print(name, who, conversions[who], file=sys.stderr, flush=True)
            if who != "grappler" and "error" not in conversions[who]:
                graphs[who] = graph_pb2.GraphDef.FromString(dst.read_bytes())
    runs = {"FP32": session(gd, False)}
    for who in TOOLS:
        if who == "grappler":
            runs[who] = session(gd, True)
        elif who in graphs:
            runs[who] = session(graphs[who], False)
    results = {who: {**conversions.get(who, {})} for who in runs}
    for who, sess in list(runs.items()):
        try:
            sess.run(out, {inp: draw(0)})
        except Exception as exc:  # noqa: BLE001 - a graph that does not run is a row saying so
            results[who] = {"error": f"does not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            sess.close()
            del runs[who]
    for who in runs:
        results[who].update(_painted(graphs.get(who, gd), fetch, who == "grappler"))
    # errors against FP32 on batches none of the tools saw
    outs = {who: [np.asarray(s.run(out, {inp: draw(100 + i)}), np.float64) for i in range(args.eval)]
            for who, s in runs.items()}
    ref = np.concatenate(outs["FP32"])
    for who in runs:
        got = np.concatenate(outs[who])
        results[who]["rel_l2"] = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
        results[who]["top1"] = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
        results[who]["samples"] = len(ref)
    value = draw(1)
    times = time_round_robin({who: (lambda s=s: s.run(out, {inp: value})) for who, s in runs.items()},
                             args.rounds, warmup=2)
    for s in runs.values():
        s.close()
    for who, t in times.items():
        results[who]["ms"] = float(np.median(t) * 1000)
        ratios = np.asarray(times["FP32"]) / np.asarray(t)
        results[who]["speed"] = float(np.median(times["FP32"]) / np.median(t))
        results[who]["p10"], results[who]["p90"] = (float(x) for x in np.percentile(ratios, [10, 90]))
    return {"name": name, "nodes": len(gd.node), "input": "x".join(map(str, shape)),
            "results": results}


# ----------------------------------------------------------------- the section
def _cells(r: dict, who: str) -> str:
    if "error" in r:
        return f"| {who} | failed: {r['error'].replace('|', '/')} | | | | | | |"
    conv = "-" if who == "FP32" else f"{r['seconds']:.2f} s, {r['mb']:.0f} MB"
    speed = "1.00x" if who == "FP32" else f"**{r['speed']:.2f}x** ({r['p10']:.2f}-{r['p90']:.2f})"
    return (f"| {who} | {r['matrix']}/{r['matrix_total']} | {r['compute']}/{r['compute_total']} | "
            f"{r['casts']} | {r['ms']:.1f} | {speed} | {r['rel_l2']:.1e}, "
            f"{100 * r['top1']:.0f}% of {r['samples']} | {conv} |")


def section(rows: list[dict], args) -> str:
    from benchmd import provenance
    lines = [SECTION, "",
             "`benchmarks/peers.py`: frozen Keras models (`weights=None`, batch norms set as "
             f"trained, {args.size}x{args.size}x3 images; the BERT-style encoder of \"Keras "
             f"models\"), batch {args.batch}: FP32; amp-rewrite `--target bfloat16 --device cpu "
             "--fold-constants --shape` (the batch); grappler's "
             "`auto_mixed_precision_onednn_bfloat16` pass on the FP32 graph in its session; Intel "
             "Neural Compressor 2.6 `mix_precision.fit(graph_def, MixedPrecisionConfig(device="
             "\"cpu\", precisions=[\"bf16\"], ...))`. The four run in one process, "
             f"{args.rounds} rounds after 2 warm-up rounds, round-robin, medians. "
             f"{provenance(prefix='')}",
             "",
             "| model, input | tool | matrix ops in bf16 | compute ops in bf16 | casts | ms | "
             "speed vs FP32 (p10-p90 of rounds) | error vs FP32: rel. L2, top-1 agreeing | "
             "conversion: time, peak memory |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    types = {who: {} for who in TOOLS}
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error']} | | | | | | | |")
            continue
        for i, (who, r) in enumerate(row["results"].items()):
            label = f"{row['name']}, {row['input']}" if i == 0 else ""
            lines.append(f"| {label} " + _cells(r, who))
            for op, n in r.get("types", {}).items():
                if who in types:
                    types[who][op] = types[who].get(op, 0) + n
        for who in TOOLS:
            if who not in row["results"]:
                lines.append(f"| | {who} | not run | | | | | | |")
    lines += ["", "What each tool ran in bfloat16, over all the models above (op: count, after "
              "grappler's passes):", "", "| tool | ops in bfloat16 |", "| --- | --- |"]
    for who in TOOLS:
        ops = sorted(types[who].items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append(f"| {who} | {', '.join(f'{op} {n}' for op, n in ops) or 'none'} |")
    lines += ["", "Speed is FP32's median time over the tool's, measured side by side in one "
              "process; in brackets the p10-p90 of the same ratio round by round (the cores are "
              "shared with other jobs, so single rounds move). \"Matrix ops\" are MatMul, "
              "BatchMatMul, Einsum, Conv2D and DepthwiseConv2dNative; \"compute ops\" every op with "
              "a float type but Const, Cast, Identity, Placeholder and NoOp; both counted in the "
              "graph grappler's passes leave (`train_step.runtime_ops`, before oneDNN's fusions "
              "on placement), so amp-rewrite's and INC's graphs are counted after the constant "
              "folding a session does too. Errors: relative L2 of the logits and the share of "
              f"samples whose top-1 class is FP32's, over {args.eval} batches none of the tools "
              "converted with. Conversion: one conversion each in a fresh process, the call "
              "alone (imports left out), peak resident memory above the process's baseline; "
              "grappler's is its bfloat16 pass alone, which it repeats whenever a session is "
              "created."]
    return "\n".join(lines + findings(rows)) + "\n"


def findings(rows: list[dict]) -> list[str]:
    """What the table shows, tool by tool, with its figures taken from ``rows``; written for the
    six models of :func:`models` run together (nothing when one is missing or failed)."""
    by = {row["name"].split(" ")[0]: row["results"] for row in rows if "error" not in row}
    need = ("ResNet50", "MobileNetV2", "DenseNet121", "EfficientNetB0", "ConvNeXtTiny", "BERT-style")
    if any(m not in by or any(w not in by[m] or "error" in by[m][w] for w in ("FP32",) + TOOLS)
           for m in need):
        return []

    def x(model, who):
        return f"{by[model][who]['speed']:.2f}x"

    def ops(model, who, key="compute"):
        r = by[model][who]
        return f"{r[key]}/{r[key + '_total']}"
    r50, mn, dn, eb, cx, bert = (by[m] for m in need)
    conv = {who: [by[m][who]["seconds"] for m in need] for who in TOOLS}
    mem = {who: [by[m][who]["mb"] for m in need] for who in TOOLS}
    errs = {who: [by[m][who]["rel_l2"] for m in need] for who in TOOLS}
    top1 = min(by[m][who]["top1"] for m in need for who in TOOLS)
    slowest = sum(1 for m in need if by[m]["INC"]["speed"] < min(by[m]["amp-rewrite"]["speed"],
                                                                  by[m]["grappler"]["speed"]))

    def within(model):
        a, g = by[model]["amp-rewrite"], by[model]["grappler"]
        return g["p10"] <= a["speed"] <= g["p90"] or a["p10"] <= g["speed"] <= a["p90"]
    same = ("each one's median within the other's p10-p90" if all(map(within, need[::2][:2]))
            else "which moves the medians beyond the rounds' p10-p90 here")

    more = sum(1 for m in need if by[m]["amp-rewrite"]["mb"] > by[m]["grappler"]["mb"])
    lower = sum(1 for m in need[::2][:2]
                if by[m]["amp-rewrite"]["speed"] < by[m]["grappler"]["speed"])

    def spread(model, who):
        r = by[model][who]
        return f"{x(model, who)} ({r['p10']:.2f}-{r['p90']:.2f})"
    return [
        "",
        "**What each tool paints.** amp-rewrite and grappler's pass put every matrix op of every "
        "model in bfloat16 and, with them, nearly all the ops between (activations, bias adds, "
        "LayerNormalization's arithmetic, softmax), on the CNNs with just a Cast at each end of the graph. They "
        "differ where amp-rewrite's lists keep an op float32 that grappler paints: the GELU's "
        "Erfc (grappler runs it in bfloat16 in the BERT-style encoder and ConvNeXtTiny, amp-"
        f"rewrite keeps it float32 with a Cast each side: {bert['amp-rewrite']['casts']} casts "
        f"against {bert['grappler']['casts']} in the encoder), and the Mul that follows it; "
        "counted op by op apart from this table, that is the whole difference between their "
        "graphs after grappler's passes on the encoder and on ConvNeXtTiny "
        f"({ops('ConvNeXtTiny', 'amp-rewrite')} compute ops in bfloat16 against grappler's "
        f"{ops('ConvNeXtTiny', 'grappler')}: 18 Erfc and 18 Mul; the other half of "
        "ConvNeXtTiny's compute ops, LayerNormalizations among them, stays float32 in both). "
        "With `--fold-constants` "
        "amp-rewrite also folds each batch norm into its convolution's weights and a bias, so "
        f"its graphs have fewer ops (MobileNetV2 {mn['amp-rewrite']['compute_total']} against "
        f"{mn['grappler']['compute_total']}, EfficientNetB0 {eb['amp-rewrite']['compute_total']} "
        f"against {eb['grappler']['compute_total']}). Intel Neural Compressor paints only the ops "
        "of its list: Conv2D, DepthwiseConv2dNative, MatMul and the pools, each between Casts "
        f"(ResNet50: {r50['INC']['compute']} ops in bfloat16, {r50['INC']['casts']} casts), "
        "and leaves every bias add, activation, batch norm, "
        "normalization and softmax float32. In the BERT-style encoder it paints the "
        f"feed-forward MatMuls alone ({ops('BERT-style', 'INC', 'matrix')} matrix ops): the "
        "attention's Einsum and BatchMatMulV2 are not on its list.",
        "",
        "**Why the speeds differ.** On ResNet50 and DenseNet121 amp-rewrite and grappler "
        "paint the same ops, so any difference between their speeds is noise of this shared "
        f"machine ({same}): ResNet50 "
        f"{spread('ResNet50', 'amp-rewrite')} against {spread('ResNet50', 'grappler')}, "
        f"DenseNet121 {spread('DenseNet121', 'amp-rewrite')} against "
        f"{spread('DenseNet121', 'grappler')}; amp-rewrite's median is the lower on {lower} "
        "of 2 in this run. On MobileNetV2 "
        f"({x('MobileNetV2', 'amp-rewrite')} against {x('MobileNetV2', 'grappler')}) and "
        f"EfficientNetB0 ({x('EfficientNetB0', 'amp-rewrite')} against "
        f"{x('EfficientNetB0', 'grappler')}) amp-rewrite is faster because of the folded batch "
        "norms: each convolution is followed by a bias that TensorFlow fuses with it and its "
        "activation, where grappler's graph keeps a batch norm's Mul after each depthwise "
        f"convolution (MobileNetV2: {mn['grappler']['types'].get('Mul', 0)} Muls; as in BENCHMARKS.md \"Keras models\", MobileNetV2 with batch norms set). "
        f"On the BERT-style encoder amp-rewrite runs at {x('BERT-style', 'amp-rewrite')} and "
        f"grappler at {x('BERT-style', 'grappler')}, though after grappler's passes the two "
        "graphs differ only in the GELU, which amp-rewrite keeps float32; these counts are taken "
        "before placement and do not explain the gap, and this run did not look further. INC "
        f"is the slowest of the three on {slowest} of the 6 models and slower than FP32 on "
        f"MobileNetV2 ({x('MobileNetV2', 'INC')}) and EfficientNetB0 ({x('EfficientNetB0', 'INC')}): "
        "its casts sit between each convolution and what follows it, so no convolution fuses "
        "with its bias and activation, and the batch norm's scale stays a float32 Mul instead "
        f"of folding into the weights (ResNet50: {r50['INC']['compute_total']} compute ops "
        f"against FP32's {r50['FP32']['compute_total']}). It gains where the convolutions "
        f"dominate: ResNet50 {x('ResNet50', 'INC')}, DenseNet121 {x('DenseNet121', 'INC')}, "
        f"the encoder {x('BERT-style', 'INC')} from its MatMuls alone. ConvNeXtTiny takes "
        f"about {cx['FP32']['ms'] / 1000:.1f} s a batch in all four graphs "
        f"({cx['FP32']['ms'] / r50['FP32']['ms']:.0f} times ResNet50's FP32 time) and each tool "
        f"gains little: amp-rewrite {spread('ConvNeXtTiny', 'amp-rewrite')}, grappler "
        f"{spread('ConvNeXtTiny', 'grappler')}, INC {spread('ConvNeXtTiny', 'INC')}. Its 18 "
        "depthwise 7x7 "
        "convolutions are Keras grouped convolutions, each a call of a function XLA must "
        "compile (`_conv_xla`, `_XlaMustCompile`), outside the counts above (they count the "
        "graph's own nodes, not function bodies; amp-rewrite paints the Conv2D inside each body "
        "between two Casts, what the others do there was not counted).",
        "",
        f"**Error.** The logits' relative L2 error against FP32 is {min(errs['amp-rewrite']):.1e} "
        f"to {max(errs['amp-rewrite']):.1e} for amp-rewrite, {min(errs['grappler']):.1e} to "
        f"{max(errs['grappler']):.1e} for grappler and {min(errs['INC']):.1e} to "
        f"{max(errs['INC']):.1e} for INC, which rounds fewer tensors to bfloat16; "
        f"{'every' if top1 == 1 else 'not every'} sample's top-1 class agrees with FP32's for "
        "every tool (`weights=None`: untrained models, so top-1 agreement here says little about "
        "a trained model's accuracy).",
        "",
        f"**Conversion.** grappler's pass alone takes {min(conv['grappler']):.2f}-"
        f"{max(conv['grappler']):.2f} s, amp-rewrite (with `--fold-constants`, which evaluates "
        f"the constant subgraphs) {min(conv['amp-rewrite']):.2f}-{max(conv['amp-rewrite']):.2f} s "
        f"and INC {min(conv['INC']):.2f}-{max(conv['INC']):.2f} s; peak memory "
        f"{min(mem['grappler']):.0f}-{max(mem['grappler']):.0f} MB, "
        f"{min(mem['amp-rewrite']):.0f}-{max(mem['amp-rewrite']):.0f} MB and "
        f"{min(mem['INC']):.0f}-{max(mem['INC']):.0f} MB. grappler's pass is the fastest and the "
        "smallest, but it runs again in every session and writes nothing to keep. amp-rewrite "
        f"needs more memory than grappler on {more} of the 6 and as much as INC (within 5%) or more on "
        f"{sum(1 for m in need if by[m]['amp-rewrite']['mb'] >= 0.95 * by[m]['INC']['mb'])} of "
        "the 6 (its figure includes folding the constants).",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inc-python", default="/work/incvenv/bin/python",
                   help="the python of a venv with neural-compressor==2.6")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=160, help="image side of the Keras applications")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--eval", type=int, default=4, help="batches the errors are measured on")
    p.add_argument("--only", action="append", default=[], help="model names to run")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    sys.path[:0] = [str(HERE)]
    from benchmd import publish
    rows = []
    for name, (build, kind) in models(args.size).items():
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            rows.append(measure(name, build, kind, args))
        except Exception as exc:  # noqa: BLE001 - a model that fails is a row saying so
            rows.append({"name": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
        print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
    return publish(section(rows, args), args.write)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(*sys.argv[2:]))
    sys.exit(main())
