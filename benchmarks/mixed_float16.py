"""Keras models trained in mixed_float16, served on this CPU: their float16 export against
amp-rewrite's bfloat16 and float32 conversions of it, in one run.

Each model is built twice with the same weights (moved off their initial values): under Keras's
``mixed_float16`` policy (float32 variables, float16 compute, a float32 head) and in float32
(its twin), and both are exported with ``model.export``. The float16 export is converted with
``convert_file(..., target="bfloat16", device="cpu", shapes={input: (batch, ...)})`` (told the
batch, as ``--shape``) and with ``target="float32"``. The four SavedModels (float16 export,
bfloat16, float32, the twin) are loaded into TF1 sessions and, after a warm-up run each, timed
round-robin (``--rounds`` rounds, the order rotating), in a process of the model's own
(``--one NAME``), every model in one run of the script. The table gives medians, speed as float16
export time / variant time, the relative L2 error of each variant's outputs against the twin's,
and the TFLite flatbuffer each converts to (``tf.lite.TFLiteConverter.from_saved_model``).

Run: ``.venv/bin/python benchmarks/mixed_float16.py [--rounds 15] [--batch 32] [--write]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402
from train_step import session_config, time_round_robin  # noqa: E402

from amp_rewrite import convert_file  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402

v1 = tf.compat.v1
SECTION = "## Models trained in mixed_float16"
HERE = Path(__file__).resolve().parent
VARIANTS = ("float16 export", "bfloat16", "float32", "float32 twin")


def models() -> dict:
    """name -> (builder taking nothing, the input shape without the batch)."""
    import keras
    L = keras.layers

    def cnn():
        x = keras.Input((32, 32, 3), name="inputs")
        h = x
        for width in (64, 128, 128):
            h = L.Conv2D(width, 3, padding="same", use_bias=False)(h)
            h = L.ReLU()(L.BatchNormalization()(h))
            h = L.MaxPooling2D()(h)
        h = L.GlobalAveragePooling2D()(h)
        return keras.Model(x, L.Dense(10, activation="softmax", dtype="float32")(h))

    def mlp():
        x = keras.Input((784,), name="inputs")
        h = L.LayerNormalization()(L.Dense(512, activation="gelu")(x))
        h = L.LayerNormalization()(L.Dense(512, activation="gelu")(h))
        return keras.Model(x, L.Dense(10, activation="softmax", dtype="float32")(h))

    def transformer():
        x = keras.Input((64, 128), name="inputs")
        a = L.MultiHeadAttention(4, 32)(x, x)
        h = L.LayerNormalization()(x + a)
        f = L.Dense(128)(L.Dense(512, activation="gelu")(h))
        h = L.LayerNormalization()(h + f)
        h = L.GlobalAveragePooling1D()(h)
        return keras.Model(x, L.Dense(10, activation="softmax", dtype="float32")(h))

    return {"CNN (32x32x3, 3 conv 64-128-128 with batch norms)": (cnn, (32, 32, 3)),
            "MLP (784-512-512-10, GELU, LayerNormalization)": (mlp, (784,)),
            "transformer block (64 tokens x 128, 4 heads, FFN 512)": (transformer, (64, 128))}


def built(build, policy: str, weights=None):
    import keras
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = build()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if weights is not None:
        model.set_weights(weights)
    return model


def _load(path: Path):
    g = tf.Graph()
    sess = v1.Session(graph=g, config=session_config(False))
    with g.as_default():
        meta = v1.saved_model.loader.load(sess, ["serve"], str(path))
    sig = meta.signature_def["serving_default"]
    return sess, next(iter(sig.inputs.values())).name, next(iter(sig.outputs.values())).name


def _tflite(path: Path) -> str:
    """The TFLite flatbuffer's size in KiB, or why the converter refused."""
    try:
        return f"{len(tf.lite.TFLiteConverter.from_saved_model(str(path)).convert()) / 1024:.0f} KiB"
    except Exception as exc:  # noqa: BLE001 - a refusal is a cell of the table
        ops = sorted(set(re.findall(r"'tf\.(\w+)' op is neither a custom op nor a flex op",
                                    str(exc))))
        return (f"fails: no TFLite op for float16 {', '.join(ops[:3])}"
                + (f" and {len(ops) - 3} more" if len(ops) > 3 else "")) if ops else (
            f"fails: {type(exc).__name__}")


def measure(name: str, rounds: int, batch: int) -> dict:
    """One model: exports, conversions, times and errors (run in a process of its own)."""
    build, shape = models()[name]
    mixed = built(build, "mixed_float16")
    rng = np.random.default_rng(0)
    mixed.set_weights([w + rng.normal(0, 0.02, w.shape).astype(w.dtype)
                       for w in mixed.get_weights()])
    twin = built(build, "float32", mixed.get_weights())
    value = rng.normal(0, 1, (batch, *shape)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: Path(tmp) / v.replace(" ", "_") for v in VARIANTS}
        mixed.export(str(paths["float16 export"]), verbose=False)
        twin.export(str(paths["float32 twin"]), verbose=False)
        bf16 = convert_file(paths["float16 export"], paths["bfloat16"], target="bfloat16",
                            device="cpu", shapes={"inputs": value.shape})
        convert_file(paths["float16 export"], paths["float32"], target="float32")
        runs = {v: _load(p) for v, p in paths.items()}
        outputs = {v: np.asarray(s.run(o, {i: value}), np.float64) for v, (s, i, o) in runs.items()}
        times = time_round_robin({v: functools.partial(s.run, o, {i: value})
                                  for v, (s, i, o) in runs.items()}, rounds, warmup=1)
        for s, _, _ in runs.values():
            s.close()
        tflite = {v: _tflite(paths[v]) for v in ("float16 export", "float32")}
    ref = outputs["float32 twin"]
    matrix = [n for n in bf16.nodes if n.op in MATRIX_OPS
              and n.name.split("/")[0] not in bf16.saver_functions]
    return {"name": name, "ms": {v: statistics.median(t) * 1000 for v, t in times.items()},
            "err": {v: float(np.linalg.norm(outputs[v] - ref) / np.linalg.norm(ref))
                    for v in VARIANTS[:3]},
            "bf16_matrix": f"{sum(n.precision == 'bfloat16' for n in matrix)}/{len(matrix)}",
            "tflite": tflite}


def run(rounds: int, batch: int) -> str:
    measured = provenance()   # the load average as it starts
    rows = []
    for name in models():
        done = subprocess.run([sys.executable, __file__, "--one", name, "--rounds", str(rounds),
                               "--batch", str(batch)], capture_output=True, text=True)
        if done.returncode:
            rows.append({"name": name, "error": done.stderr.strip().splitlines()[-1][:160]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr, flush=True)
    return _section(rows, rounds, batch, measured)


def _section(rows, rounds: int, batch: int, measured: str) -> str:
    lines = [SECTION, "",
             "`benchmarks/mixed_float16.py`: Keras models built under the `mixed_float16` "
             "policy (float32 variables, float16 compute, a float32 softmax head) and exported "
             "with `model.export`, against amp-rewrite's conversions of that export: `--target "
             f"bfloat16 --device cpu --shape inputs={batch},...` (the cost model told the batch) "
             "and `--target float32`; the float32 twin is the same model built in float32 with "
             "the same weights. Each model in a process of its own, its four SavedModels loaded "
             f"into TF1 sessions and timed round-robin at batch {batch}, {rounds} rounds after a "
             "warm-up run, medians; every model in one run. This CPU is an AMD EPYC (Zen 4) with "
             "AVX512-BF16, no AMX and no AVX512-FP16: TensorFlow runs float16 there on Eigen's "
             "kernels, slowly, and bfloat16 MatMul/Conv work on oneDNN's AVX512-BF16 kernels. "
             f"The machine was shared with other jobs while it ran. {measured} Speed: float16 "
             "export time / variant time. Error: relative L2 of the outputs against the float32 "
             "twin's. TFLite: the flatbuffer `tf.lite.TFLiteConverter.from_saved_model` makes "
             "(default options).",
             "",
             "| model | float16 export ms | bfloat16 ms (speed) | float32 ms (speed) | float32 twin "
             "ms (speed) | MatMul/Conv in bf16 | error: float16 export / bfloat16 / float32 | "
             "TFLite: float16 export / float32 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | |")
            continue
        ms, base = r["ms"], r["ms"]["float16 export"]
        cells = [f"{ms[v]:.2f} ({base / ms[v]:.2f}x)" for v in VARIANTS[1:]]
        err = " / ".join(f"{r['err'][v]:.1e}" if r["err"][v] else "0" for v in VARIANTS[:3])
        lines.append(f"| {r['name']} | {base:.2f} | " + " | ".join(cells)
                     + f" | {r['bf16_matrix']} | {err} | {r['tflite']['float16 export']} / "
                       f"{r['tflite']['float32']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--one", help=argparse.SUPPRESS)   # one model, in this process: prints JSON
    p.add_argument("--write", action="store_true", help="replace the section in BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.rounds, args.batch)))
        return 0
    return publish(run(args.rounds, args.batch), args.write)


if __name__ == "__main__":
    sys.exit(main())
