"""What a bfloat16 op costs or saves on this CPU against float32: the basis of the runtime cost
model (:mod:`amp_rewrite.paint.costs`, docs/decisions.md "The cost model").

The measuring is the package's own (:mod:`amp_rewrite.tools.op_costs`, which ``amp-rewrite costs
measure`` runs to write this CPU's cost table): each op on a tensor computed in the graph, once
in float32 and once in bfloat16, the same graph without the op timed beside it and subtracted;
``rounds`` runs each, interleaved in one process, medians. This script prints every op's
times as BENCHMARKS.md shows them, and the cost table they make: picoseconds saved per FLOP
(matrix ops) and picoseconds lost per element (elementwise ops, negative: bfloat16 faster).

One shipped table per CPU class (``amp_rewrite.core.hardware.CPU_CLASSES``), each from a run
of this script: ``rules/costs.toml`` (AVX512-BF16, measured on an AMD EPYC) and, with
``--cpu-class avx2``, ``rules/costs-avx2.toml``: TensorFlow as it runs on a CPU with no
bfloat16 matrix unit, its oneDNN ops off (``TF_ENABLE_ONEDNN_OPTS=0``, TensorFlow's default on
such CPUs: Eigen's kernels, built for every x86-64 CPU, so the class's rates can be timed on a
CPU that has a unit). ``--table FILE`` also writes the rates as a cost table.

Run: ``.venv/bin/python benchmarks/cpu_costs.py [--cpu-class avx2] [--table FILE] --write``
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

CLASSES = {"native": ("## Op costs in bfloat16 on this CPU", "this CPU as it is"),
           "avx2": ("## Op costs in bfloat16 without a bfloat16 unit",
                    "TensorFlow's oneDNN ops off (TF_ENABLE_ONEDNN_OPTS=0), as TensorFlow runs "
                    "on a CPU with no bfloat16 matrix unit (AVX2 only, or AVX-512 without "
                    "BF16) by default: Eigen's kernels")}


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int)
    p.add_argument("--cpu-class", choices=sorted(CLASSES), default="native")
    p.add_argument("--table", help="also write the rates as a cost table here")
    p.add_argument("--write", action="store_true")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if ARGS is not None and ARGS.cpu_class == "avx2":   # decided once, when TensorFlow loads
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"

import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402

from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.rules import cost_table  # noqa: E402
from amp_rewrite.tools import op_costs  # noqa: E402


def main(args) -> int:
    section, how = CLASSES[args.cpu_class]
    rounds = args.rounds or op_costs.ROUNDS
    found = op_costs.measure(rounds=rounds,
                             progress=lambda done, total: print(f"{done}/{total}", flush=True))
    rows = []
    for name, (t, _) in found.matrix.items():
        rows.append((name, t, f"saves {found.per_unit(name):.2f} ps per FLOP"))
    for name, t in found.elementwise.items():
        verb = "takes" if name == op_costs.CAST else "costs"
        rows.append((name, t, f"{verb} {found.per_unit(name):.0f} ps per element"))
    rates = found.rates()
    text = "\n".join([
        f"{section}\n",
        provenance() + "\n",
        f"`benchmarks/cpu_costs.py` (`amp_rewrite/tools/op_costs.py`), {how}: each op alone on a "
        f"{'x'.join(map(str, found.shape))} tensor computed in the graph, in float32 and in "
        f"bfloat16, less the same graph without it, {rounds} runs each interleaved in one "
        f"process, medians, on {platform.machine()} with {os.cpu_count()} cores "
        f"({hardware.describe()}), TensorFlow {tf.__version__}. Matrix ops: time saved per "
        "FLOP; elementwise ops: time bfloat16 adds per element it writes (negative: bfloat16 "
        "is faster); the cast: its float32 time per element. The cost model's rates come from "
        "this table: " + ", ".join(f"{name} {value:.3g}" for name, value in rates.items()) + ".\n",
        "| op | float32 ms | bfloat16 ms | per unit |",
        "| --- | --- | --- | --- |",
        *(f"| {n} | {t['float32'] * 1e3:.2f} | {t['bfloat16'] * 1e3:.2f} | {u} |"
          for n, t, u in rows)]) + "\n"
    if args.table:
        unfused = found.unfused()
        title = section.lstrip("# ")
        measured = {"cpu": f"{hardware.describe()}, {how}", "tensorflow": tf.__version__,
                    "source": f'BENCHMARKS.md "{title}"', "rounds": rounds,
                    "shape": "x".join(map(str, found.shape))}
        with open(args.table, "w") as f:
            f.write(cost_table.format_table(rates, unfused, measured, found.saved_by_op()))
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main(ARGS))
