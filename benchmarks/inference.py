"""Inference speed of bfloat16-converted graphs against their FP32 originals, on this CPU.

Run ``.venv/bin/python benchmarks/inference.py [--write]`` (a few minutes on 2 cores). For each model it
writes the FP32 GraphDef, converts it with ``amp-rewrite --target bfloat16 --device cpu``, and
runs the three commands a user would run: ``verify`` (how far the numbers moved), ``kernels``
(share of the MatMul/Conv work oneDNN ran on 16-bit matrix units) and ``bench`` (each model in
its own process, in alternating rounds; the ratio of their medians). ``--write`` puts the results in the
"Inference" section of BENCHMARKS.md. The script fails (exit 1) if the conv net's bfloat16 graph is not
faster than its FP32 original, which is this project's claim for CPUs with AVX512-BF16 or AMX.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402

from amp_rewrite.tools.runner import parse_shapes  # noqa: E402
from amp_rewrite.tools.verify import verify  # noqa: E402

v1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cnn_fp32.pb"
SECTION = "## Inference"


def resnet_like(size=56, channels=64, blocks=4) -> tf.compat.v1.GraphDef:
    """A stem convolution, residual 3x3 conv + batch-norm blocks, global pooling and a classifier."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, size, size, 3], name="images")
        stem = r.normal(0, 0.2, (3, 3, 3, channels)).astype(np.float32)
        y = tf.nn.relu(tf.nn.conv2d(x, tf.constant(stem), 1, "SAME", name="stem"))
        for i in range(blocks):
            with tf.name_scope(f"block{i}"):
                k = r.normal(0, (2 / (9 * channels)) ** 0.5, (3, 3, channels, channels))
                z = tf.nn.conv2d(y, tf.constant(k.astype(np.float32)), 1, "SAME", name="conv")
                z = tf.raw_ops.FusedBatchNormV3(
                    x=z, scale=tf.ones([channels]), offset=tf.zeros([channels]),
                    mean=tf.zeros([channels]), variance=tf.ones([channels]), is_training=False,
                    name="bn")[0]
                y = tf.nn.relu(z + y, name="relu")
        y = tf.reduce_mean(y, [1, 2], name="pool")
        w = r.normal(0, 0.1, (channels, 10)).astype(np.float32)
        tf.nn.softmax(tf.matmul(y, tf.constant(w), name="fc"), name="probabilities")
    return g.as_graph_def()


def mlp(width=1024, depth=3) -> tf.compat.v1.GraphDef:
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        y = v1.placeholder(tf.float32, [None, width], name="features")
        for i in range(depth):
            w = r.normal(0, width ** -0.5, (width, width)).astype(np.float32)
            y = tf.nn.relu(tf.matmul(y, tf.constant(w), name=f"fc{i}"))
        tf.identity(y, name="out")
    return g.as_graph_def()


def amp_rewrite(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "amp_rewrite", *args, "-q"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def measure(label: str, fp32: Path, shape: str, runs: int, work: Path) -> dict:
    name = fp32.stem
    conv = work / f"{name}_bf16.pb"
    done = amp_rewrite(str(fp32), "-o", str(conv), "--target", "bfloat16", "--device", "cpu",
                       "--force")
    if done.returncode:
        raise SystemExit(f"convert {name} failed: {done.stderr}")
    v = verify(fp32, conv, samples=2, shapes=parse_shapes([shape]))
    kernels_json, bench_json = work / f"{name}_kernels.json", work / f"{name}_bench.json"
    for cmd, out in ((["kernels", str(conv), "--device", "cpu", "--shape", shape], kernels_json),
                     (["bench", str(fp32), str(conv), "--shape", shape, "--runs", str(runs),
                       "--warmup", "3"], bench_json)):
        done = amp_rewrite(*cmd, "--json", str(out))
        if done.returncode:
            raise SystemExit(f"{cmd[0]} {name} failed: {done.stderr}")
    k, b = json.loads(kernels_json.read_text()), json.loads(bench_json.read_text())
    return {"name": label, "shape": shape, "bench": b, "share": k["share"],
            "rel_l2": max(o.rel_l2 for o in v.outputs), "verify_ok": v.ok}


def section(results: list[dict]) -> str:
    method = results[0]["bench"]["method"] if results else "each model in its own process"
    lines = [SECTION, "", f"*Timing method: {method} (`amp-rewrite bench`).*", "",
             f"`benchmarks/inference.py`: FP32 GraphDef vs the same graph after "
             f"`amp-rewrite --target bfloat16 --device cpu`, timed by `amp-rewrite bench` "
             f"({method}, 3 warm-up runs, median of the timed runs). {provenance()}",
             "",
             "| model | input | FP32 median (ms) | bf16 median (ms) | speed-up | bf16 samples/s "
             "| matrix work on 16-bit units | output rel. L2 error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        b = r["bench"]
        share = "-" if r["share"] is None else f"{100 * r['share']:.0f}%"
        lines.append(f"| {r['name']} | `{r['shape']}` | {b['original']['median_ms']:.2f} | "
                     f"{b['converted']['median_ms']:.2f} | **{b['speedup']:.2f}x** "
                     f"({b['speedup_p10']:.2f}-{b['speedup_p90']:.2f}) | "
                     f"{b['converted']['throughput']:.0f} | {share} | {r['rel_l2']:.1e} |")
    lines += ["", "Speed-up is the FP32 median latency over the bfloat16 one, measured side by "
              "side in one run; in brackets, the p10-p90 of the ratio within single rounds (the "
              "machine is shared with other jobs, so absolute times are noisy and the ratio moves "
              "between runs of the script; alternating rounds spread that load over both sides); "
              "\"matrix work on 16-bit units\" is the share of MatMul/Conv "
              "multiply-accumulates that oneDNN's verbose log shows on `avx512_core_bf16` or "
              "`amx` kernels (`amp-rewrite kernels`).", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        resnet, dense = work / "resnet_like.pb", work / "mlp.pb"
        resnet.write_bytes(resnet_like().SerializeToString())
        dense.write_bytes(mlp().SerializeToString())
        results = [measure("resnet-like conv net", resnet, "images=16,56,56,3", 20, work),
                   measure("MLP 3x1024", dense, "features=256,1024", 30, work),
                   measure("examples/cnn_fp32.pb", EXAMPLE, "images=256,8,8,1", 30, work)]
    publish(section(results), args.write)
    conv_net = results[0]
    if not conv_net["verify_ok"] or conv_net["bench"]["speedup"] <= 1.0:
        print(f"FAIL: the conv net's bfloat16 graph is not faster (speed-up "
              f"{conv_net['bench']['speedup']:.2f}x) or not within tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
