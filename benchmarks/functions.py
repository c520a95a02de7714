"""A functional While loop on this CPU: FP32, bfloat16 with float32 loop boundaries, bfloat16
with the loop-carried value lowered (casts moved out of the loop).

    .venv/bin/python benchmarks/functions.py [--runs 30] [--warmup 3] [--write]

The model is a TF2 ``tf.function`` (control flow v2: a ``While`` op whose body is a library
function): ``steps`` iterations of ``h = tanh(h @ W + b)`` on a ``[batch, width]`` state. Three
GraphDefs, all run in default sessions in one process, timed round-robin (the order rotates
every round, so load from other jobs falls on all three alike):

* ``fp32``: the graph as traced;
* ``bf16, f32 boundary``: bodies painted, every function boundary kept float32 (the body casts
  the state to bfloat16 and back on every iteration);
* ``bf16, lowered``: what ``amp-rewrite --target bfloat16 --device cpu --min-matrix-intensity 0``
  writes (the loop carries the bfloat16 state; one cast before and one after the loop). With
  the default bar the 32-wide loop stays float32 (see "Small matrix ops").

Prints a Markdown table of median run times and ratios to FP32; ``--write`` also puts it in
BENCHMARKS.md under "## Functional loops" (only that section is replaced).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import publish  # noqa: E402

from amp_rewrite.conversion.library import paint_library  # noqa: E402
from amp_rewrite.conversion.pipeline import convert  # noqa: E402
from amp_rewrite.conversion.rewrite import Target, rewrite  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.ir import Graph  # noqa: E402
from amp_rewrite.rules.loader import load_rules  # noqa: E402

v1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Functional loops"
CASES = [(32, 256, 64), (8, 512, 64), (1024, 32, 64)]   # (batch, width, steps)


def loop_graph(batch: int, width: int, steps: int):
    """The traced GraphDef and a feed for it."""
    r = np.random.default_rng(0)
    w = r.normal(0, 1 / np.sqrt(width), (width, width)).astype(np.float32)
    b = r.normal(0, 0.1, width).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([batch, width], tf.float32)])
    def f(x):
        _, h = tf.while_loop(lambda i, h: i < steps,
                             lambda i, h: (i + 1, tf.tanh(tf.matmul(h, tf.constant(w)) + b)),
                             [tf.constant(0), x])
        return tf.identity(h, name="out")

    gd = f.get_concrete_function().graph.as_graph_def()
    return gd, {"x:0": r.normal(0, 1, (batch, width)).astype(np.float32)}


def unlowered(graph_def):
    """bfloat16 with every function boundary kept float32."""
    rules = load_rules("bfloat16")
    target = Target("bfloat16", "CPU")
    work = Graph.from_graph_def(graph_def)
    report, _ = rewrite(work, rules, target)
    out = work.to_graph_def(graph_def)
    paint_library(out, rules, report, target, lower=False)
    return out


def body_casts(graph_def) -> int:
    loop = next(n for n in graph_def.node if n.op in ("While", "StatelessWhile"))
    body = next(f for f in graph_def.library.function
                if f.signature.name == loop.attr["body"].func.name)
    return sum(nd.op == "Cast" for nd in body.node_def)


def session(graph_def):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return v1.Session(graph=g)


def measure(case, runs: int, warmup: int) -> dict:
    gd, feed = loop_graph(*case)
    variants = {"fp32": gd, "bf16, f32 boundary": unlowered(gd),
                # the mechanism is measured at every width: no island stays float32 for its size
                "bf16, lowered": convert(gd, target="bfloat16", device="cpu",
                                         min_matrix_intensity=0)[0]}
    sessions = {k: session(v) for k, v in variants.items()}
    outs = {k: s.run("out:0", feed) for k, s in sessions.items()}
    times = {k: [] for k in variants}
    names = list(variants)
    for i in range(warmup + runs):
        for k in names[i % 3:] + names[:i % 3]:
            start = time.perf_counter()
            sessions[k].run("out:0", feed)
            if i >= warmup:
                times[k].append(time.perf_counter() - start)
    ref = outs["fp32"].astype(np.float64)
    return {k: {"ms": 1e3 * statistics.median(t), "casts": body_casts(variants[k]),
                "err": float(np.linalg.norm(outs[k] - ref) / np.linalg.norm(ref))}
            for k, t in times.items()}


def table(results) -> str:
    lines = ["| batch x width, steps | FP32 ms | bf16, f32 boundary ms (ratio) | casts in body "
             "| bf16, lowered ms (ratio) | casts in body | lowered vs f32 boundary | rel. L2 error "
             "(f32 boundary / lowered) |", "| --- " * 8 + "|"]
    for (batch, width, steps), r in results:
        fp, plain, low = r["fp32"], r["bf16, f32 boundary"], r["bf16, lowered"]
        lines.append(
            f"| {batch} x {width}, {steps} | {fp['ms']:.2f} | {plain['ms']:.2f} "
            f"({fp['ms'] / plain['ms']:.2f}x) | {plain['casts']} | {low['ms']:.2f} "
            f"({fp['ms'] / low['ms']:.2f}x) | {low['casts']} | **{plain['ms'] / low['ms']:.2f}x** "
            f"| {plain['err']:.1e} / {low['err']:.1e} |")
    return "\n".join(lines)


def section(results, runs: int) -> str:
    return (f"{SECTION}\n\n`benchmarks/functions.py`: a TF2 `tf.function` whose `While` body runs "
            "`h = tanh(h @ W + b)`; FP32, bfloat16 with the loop boundary kept float32 (two "
            "casts per iteration), and amp-rewrite's output with `--min-matrix-intensity 0` (the "
            "loop carries bfloat16; by default the 32-wide loop stays float32), median "
            f"of {runs} runs each, interleaved round-robin in one process on {platform.machine()} "
            f"with {os.cpu_count()} cores ({hardware.describe()}), TensorFlow {tf.__version__}. "
            "Ratios are FP32 time / variant time; \"lowered vs f32 boundary\" is the time with "
            "float32 boundaries over amp-rewrite's.\n\n" + table(results) + "\n\n"
            "The machine is shared with other jobs, so absolute times are noisy; the ratios come "
            "from runs interleaved in one process, and still move between runs of the script "
            "(the 1024 x 32 case measured 1.2x to 1.7x lowered vs f32 boundary in three runs). "
            "The errors are identical: a lowered boundary only drops casts whose rounding the "
            "values went through anyway. The gain is largest where the loop is memory-bound "
            "(many rows, narrow state), where two casts per iteration cost as much as the MatMul "
            "and can cancel bfloat16's gain.\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    results = [(case, measure(case, args.runs, args.warmup)) for case in CASES]
    text = section(results, args.runs)
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
