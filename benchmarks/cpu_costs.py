"""What a bfloat16 op costs or saves on this CPU against float32: the basis of the runtime cost
model (:mod:`amp_rewrite.paint.costs`, docs/decisions.md "The cost model").

The measuring is the package's own (:mod:`amp_rewrite.tools.op_costs`, which ``amp-rewrite costs
measure`` runs to write this CPU's cost table): each op on a tensor computed in the graph, once
in float32 and once in bfloat16, the same graph without the op timed beside it and subtracted;
``rounds`` runs each, interleaved in one process, medians. This script prints every op's
times as BENCHMARKS.md shows them, and the cost table they make: picoseconds saved per FLOP
(matrix ops) and picoseconds lost per element (elementwise ops, negative: bfloat16 faster).
The shipped table (``rules/costs.toml``) came from a run of it on an AMD EPYC.

Run: ``.venv/bin/python benchmarks/cpu_costs.py --write``
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from benchmd import publish  # noqa: E402

from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.tools import op_costs  # noqa: E402

SECTION = "## Op costs in bfloat16 on this CPU"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=op_costs.ROUNDS)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    found = op_costs.measure(rounds=args.rounds,
                             progress=lambda done, total: print(f"{done}/{total}", flush=True))
    rows = []
    for name, (t, _) in found.matrix.items():
        rows.append((name, t, f"saves {found.per_unit(name):.2f} ps per FLOP"))
    for name, t in found.elementwise.items():
        verb = "takes" if name == op_costs.CAST else "costs"
        rows.append((name, t, f"{verb} {found.per_unit(name):.0f} ps per element"))
    rates = found.rates()
    text = "\n".join([
        f"{SECTION}\n",
        f"`benchmarks/cpu_costs.py` (`amp_rewrite/tools/op_costs.py`): each op alone on a "
        f"{'x'.join(map(str, found.shape))} tensor computed in the graph, in float32 and in "
        f"bfloat16, less the same graph without it, {args.rounds} runs each interleaved in one "
        f"process, medians, on {platform.machine()} with {os.cpu_count()} cores "
        f"({hardware.describe()}), TensorFlow {tf.__version__}. Matrix ops: time saved per "
        "FLOP; elementwise ops: time bfloat16 adds per element it writes (negative: bfloat16 "
        "is faster); the cast: its float32 time per element. The cost model's rates "
        "(`rules/costs.toml`) come from this table: "
        + ", ".join(f"{name} {value:.3g}" for name, value in rates.items()) + ".\n",
        "| op | float32 ms | bfloat16 ms | per unit |",
        "| --- | --- | --- | --- |",
        *(f"| {n} | {t['float32'] * 1e3:.2f} | {t['bfloat16'] * 1e3:.2f} | {u} |"
          for n, t, u in rows)]) + "\n"
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
