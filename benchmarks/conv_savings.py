"""What bfloat16 saves on each convolution inside a whole model, against what the cost model
estimates: oneDNN's own timings of every convolution primitive, FP32 and grappler's bfloat16
painting of the same frozen Keras model, in one run.

The cost model (``amp_rewrite/paint/costs.py``) credits a convolution in bfloat16 with
``saved_ps_per_flop`` a FLOP (the shipped table, ``rules/costs.toml``), measured on one op alone (BENCHMARKS.md "Op costs in bfloat16 on
this CPU"). Inside MobileNetV2 the convolutions have few channels and move much data per FLOP;
this measures what they save there. Each variant runs in a child process with
``ONEDNN_VERBOSE=1`` (oneDNN then prints each primitive's shape and milliseconds), ``--rounds``
runs after three warm-up runs; per convolution the median over the runs. The two variants run
the same convolutions in the same order (their shapes are checked to match). The table gives
the totals, the cost model's estimate of the saving, and a least-squares fit of the saving
per convolution as ``a`` ps a FLOP plus ``b`` ps an element read or written.

Run: ``.venv/bin/python benchmarks/conv_savings.py [--rounds 5] [--write]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import functools
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import publish  # noqa: E402

from amp_rewrite.conversion.graph import Options  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.tools.measured import measured_conversion  # noqa: E402
from amp_rewrite.rules.cost_table import shipped  # noqa: E402

SAVED_PS_PER_FLOP = shipped().saved_ps_per_flop

SECTION = "## Convolution savings inside a model"
MODELS = ("MobileNetV2", "MobileNetV2, batch norms set")
MARK = "CONV_SAVINGS_RUN"


def child(name: str, variant: str, rounds: int) -> None:
    """Run the frozen model (``variant`` "fp32" or "grappler") and mark each timed run."""
    import keras
    from keras_models import freeze, models
    from train_step import session
    keras.utils.set_random_seed(0)
    build, kind = models()[name]
    gd, inp, out, value = freeze(build(), kind)
    sess = session(gd, variant == "grappler")
    for _ in range(3):
        sess.run(out, {inp: value})
    for _ in range(rounds):
        sys.stdout.flush()
        os.write(1, f"{MARK}\n".encode())
        sess.run(out, {inp: value})
    sys.stdout.flush()


def convolutions(name: str, variant: str, rounds: int) -> list[tuple[dict, float]]:
    """Each convolution of one run, in order: its shape (oneDNN's descriptor, by letter) and
    its median milliseconds over ``rounds`` runs."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    text = subprocess.run([sys.executable, __file__, "--child", name, variant, str(rounds)],
                          env=env, capture_output=True, text=True, check=True).stdout
    runs = []
    for chunk in text.split(MARK + "\n")[1:]:
        runs.append([(line.split(",")[-2], float(line.split(",")[-1]))
                     for line in chunk.splitlines()
                     if ",exec," in line and ",convolution," in line])
    descs = [d for d, _ in runs[0]]
    assert all([d for d, _ in r] == descs for r in runs), "runs differ in their convolutions"
    return [(_shape(d), statistics.median(r[i][1] for r in runs)) for i, d in enumerate(descs)]


def _shape(desc: str) -> dict:
    groups = re.match(r"g(\d+)", desc)
    dims = dict((k, int(v)) for k, v in re.findall(r"([a-z]+)(\d+)", desc[groups.end():]
                                                   if groups else desc))
    dims["g"] = int(groups.group(1)) if groups else 1
    return dims


def with_measure(name: str, rounds: int) -> dict:
    """``convert --measure`` on the frozen model: what it wrote, and that conversion timed
    round-robin against grappler's painting of the FP32 graph."""
    import keras
    from keras_models import freeze, models
    from train_step import session, time_round_robin
    keras.utils.set_random_seed(0)
    build, kind = models()[name]
    gd, inp, out, value = freeze(build(), kind)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "frozen.pb"
        path.write_bytes(gd.SerializeToString())
        model, _, found = measured_conversion(path, "out.pb",
                                              Options(target="bfloat16", device="cpu"))
    sessions = {"measured": session(model.graph_def, False), "grappler": session(gd, True)}
    times = time_round_robin({k: functools.partial(s.run, out, {inp: value})
                              for k, s in sessions.items()}, max(rounds, 9), warmup=1)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    return {"chosen": found.chosen, "measured_ms": med["measured"], "grappler_ms": med["grappler"]}


def measure(name: str, rounds: int) -> dict:
    import keras_models
    build, kind = keras_models.models()[name]
    whole = keras_models.measure(name, build, kind, max(rounds, 9))   # without the verbose log
    fp32 = convolutions(name, "fp32", rounds)
    bf16 = convolutions(name, "grappler", rounds)
    assert [s for s, _ in fp32] == [s for s, _ in bf16], "the variants differ in convolutions"
    flops, elems, saved = [], [], []
    for (d, t32), (_, t16) in zip(fp32, bf16):
        flops.append(2.0 * d["mb"] * d["oh"] * d["ow"] * d["kh"] * d["kw"] * d["ic"] * d["oc"]
                     / d["g"])
        elems.append(float(d["mb"] * (d["ih"] * d["iw"] * d["ic"] + d["oh"] * d["ow"] * d["oc"])))
        saved.append((t32 - t16) * 1e9)   # ps
    x, y = np.array([flops, elems]).T, np.array(saved)
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = x @ np.array([a, b])
    return {"name": name, "convs": len(saved), "fp32_ms": sum(t for _, t in fp32),
            "bf16_ms": sum(t for _, t in bf16), "saved_ms": y.sum() / 1e9,
            "estimate_ms": sum(flops) * SAVED_PS_PER_FLOP / 1e9, "gflops": sum(flops) / 1e9,
            "per_flop": y.sum() / sum(flops), "a": a, "b": b,
            "fit_err": float(np.abs(fitted - y).sum() / np.abs(y).sum()),
            "matrix": whole["matrix"], "whole": (whole["fp32_ms"], whole["ours_ms"],
                                                 whole["grappler_ms"]),
            "measure": with_measure(name, rounds)}


def run(rounds: int) -> str:
    rows = [measure(name, rounds) for name in MODELS]
    lines = [SECTION, "",
             "`benchmarks/conv_savings.py`: the frozen Keras models of `benchmarks/keras_models.py` "
             "(224x224x3, batch 8), FP32 and grappler's `auto_mixed_precision_onednn_bfloat16` "
             "painting, each in a child process with `ONEDNN_VERBOSE=1`; every convolution "
             f"primitive's milliseconds as oneDNN prints them, median of {rounds} runs after 3 "
             f"warm-up runs; on {hardware.describe()}, {os.cpu_count()} cores, TensorFlow "
             f"{tf.__version__}, Python {platform.python_version()}. \"Estimated\" is the cost "
             f"model's saving, {SAVED_PS_PER_FLOP} ps a FLOP (`saved_ps_per_flop`); the fit is "
             "the least-squares saving per convolution as a ps a FLOP + b ps an element it reads "
             "or writes, with its mean absolute error over the saving. \"Whole model\": the "
             "same models timed as `benchmarks/keras_models.py` does (no verbose log; FP32, "
             "amp-rewrite's default conversion, grappler's painting, round-robin in one process, "
             "medians of at least 9 rounds), with amp-rewrite's MatMul/Conv ops in bfloat16. "
             "\"--measure\": what `convert --measure` wrote on this machine (the cost model's "
             "conversion or the one painted whole, timed against each other), then timed "
             "round-robin against grappler's painting.",
             "",
             "| model | convolutions | FP32 ms | bfloat16 ms | saved ms | estimated ms | saved ps "
             "a FLOP | fit: a ps a FLOP + b ps an element | fit error | whole model: FP32 / "
             "amp-rewrite / grappler ms | amp-rewrite in bf16 | amp-rewrite / grappler speed | "
             "--measure wrote | --measure / grappler ms (speed) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['convs']} | {r['fp32_ms']:.1f} | {r['bf16_ms']:.1f} | "
                     f"{r['saved_ms']:.1f} | {r['estimate_ms']:.1f} | {r['per_flop']:.2f} | "
                     f"{r['a']:.2f} + {r['b']:.0f} | {r['fit_err']:.0%} | "
                     f"{' / '.join(f'{t:.0f}' for t in r['whole'])} | {r['matrix']} | "
                     f"{r['whole'][2] / r['whole'][1]:.2f}x | {r['measure']['chosen']} | "
                     f"{r['measure']['measured_ms']:.0f} / {r['measure']['grappler_ms']:.0f} "
                     f"({r['measure']['grappler_ms'] / r['measure']['measured_ms']:.2f}x) |")
    lines += ["", "Where the saved time is well above the estimate, the cost model undercounts "
              "what a painted island gains. On the untrained MobileNetV2, though, what makes "
              "grappler's painting faster than float32 is not its convolutions: its batch norms "
              "become Muls by ones in bfloat16, which grappler drops (BENCHMARKS.md \"Untrained "
              "batch norms in bfloat16\"); `--measure` settles such cases on the machine that "
              "runs the model (docs/decisions.md \"When the estimate is not enough\")."]
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    return publish(run(args.rounds), args.write)


if __name__ == "__main__":
    sys.exit(main())
