"""--freeze at scale: serving SavedModels of an embedding table and wide ReLU layers, up to past
protobuf's 2 GB, frozen and converted to bfloat16 on this CPU (issue 42).

Each model takes int32 ids ``[None, 16]``, averages their rows of a float32 table (``tf.gather``,
``reduce_mean``), and runs six ReLU layers (``MatMul``, bias) of one width and a 10-wide head;
the table grows from 0.5 to 2 GiB (past what one protobuf message holds, 2^31 - 1 bytes), and
the issue's second model holds a 1 GiB table and five 8192x8192 layers (2.3 GiB in tensors under
2 GiB each). Every model is built in a process of its own (its variables filled a slice at a
time, so building takes the weights once), and for each:

* **convert**: ``convert_file(SRC, OUT, target="bfloat16", device="cpu", freeze=True)`` (what
  ``amp-rewrite SRC -o OUT --freeze --target bfloat16 --device cpu`` runs) in a fresh process:
  its wall time, and its peak resident memory (``ru_maxrss``, TensorFlow's import included;
  ``base`` is the peak of the same process converting a tiny model, the part any conversion
  takes), over the weights' bytes on disk;
* **error**: the relative L2 of the converted model's logits against FP32's, on the same 64
  rows of ids, each model in a process of its own;
* **speed**: each SavedModel served as TF Serving loads it (``benchmarks/serve_worker.py``, a
  process per model per round, signature ``serving_default``), at batch 1 and 16, ``--rounds``
  rounds with FP32 and ``--freeze`` alternating first; a time is the median over rounds of a
  process's median call, the ratio FP32's over ``--freeze``'s (above 1: faster than FP32).

Run: ``.venv/bin/python benchmarks/freeze_scale.py [--rounds 3] [--only NAME] [--write]`` (about
15 minutes on 2 cores, 6 GB of memory and 12 GB of disk in ``--tmp``); ``--write`` also keeps
the measurements in ``benchmarks/results/freeze_scale.json``, from which tests/test_docs.py
renders the section again and holds BENCHMARKS.md to it; ``--render FILE --write`` writes the
section again from such a file without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

HERE = Path(__file__).resolve().parent
SECTION = "## --freeze at scale"
BATCHES = (1, 16)
IDS = 16
# name -> (table rows, table width, layer width, layers): six ReLU layers, the first from the
# table's width, then five square ones
MODELS = {
    "table 2^18 x 512, six 4096-wide layers": (1 << 18, 512, 4096, 6),
    "table 2^19 x 512, six 4096-wide layers": (1 << 19, 512, 4096, 6),
    "table 2^20 x 512, six 4096-wide layers (issue 42)": (1 << 20, 512, 4096, 6),
    "table 2^19 x 512, six 8192-wide layers (issue 42)": (1 << 19, 512, 8192, 6),
}


# ------------------------------------------------------------------ children (one per process)
def build(path: str, rows: int, dim: int, width: int, layers: int) -> None:
    """The SavedModel of the module doc at ``path``, its variables filled a slice at a time
    (``scatter_update``: no copy of a variable while it is filled, nor when it is saved)."""
    import tensorflow as tf

    def variable(shape, seed, std):
        var = tf.Variable(tf.zeros(shape))
        step = max(1, (64 << 20) // (4 * shape[1]))
        for i in range(0, shape[0], step):
            n = min(step, shape[0] - i)
            var.scatter_update(tf.IndexedSlices(
                tf.random.stateless_normal([n, shape[1]], [seed, i], stddev=std),
                tf.range(i, i + n)))
        return var

    m = tf.Module()
    m.table = variable([rows, dim], 1, 1.0)
    m.kernels = [variable([dim if i == 0 else width, width], 10 + i,
                          (2.0 / (dim if i == 0 else width)) ** 0.5) for i in range(layers)]
    m.biases = [tf.Variable(tf.fill([width], 0.01)) for _ in range(layers)]
    m.head = variable([width, 10], 99, width ** -0.5)

    @tf.function(input_signature=[tf.TensorSpec([None, IDS], tf.int32, name="ids")])
    def serve(ids):
        h = tf.reduce_mean(tf.gather(m.table, ids), axis=1)
        for k, b in zip(m.kernels, m.biases):
            h = tf.nn.relu(tf.matmul(h, k) + b)
        return {"logits": tf.matmul(h, m.head)}

    m.serve = serve
    tf.saved_model.save(m, path, signatures={"serving_default": serve})


def convert(src: str, out: str) -> dict:
    """--freeze of ``src`` to ``out`` in this process: its seconds, peak memory and report."""
    from amp_rewrite.conversion.pipeline import convert_file   # (TensorFlow: not timed)
    start = time.perf_counter()
    report = convert_file(src, out, target="bfloat16", device="cpu", freeze=True, force=True)
    seconds = time.perf_counter() - start
    frozen = report.extra["freeze"]
    return {"seconds": seconds, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "kept": frozen["kept"], "variables": frozen["variables"],
            "matrix": f"{report.summary()['matrix_converted']}/{report.summary()['matrix_total']}"}


def outputs(path: str, ids: str, out: str) -> None:
    import numpy as np
    import tensorflow as tf
    served = tf.saved_model.load(path)
    logits = served.signatures["serving_default"](ids=tf.constant(np.load(ids)["ids"]))
    np.save(out, logits["logits"].numpy())


def _child(*args: str) -> str:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]}: {done.stderr.strip().splitlines()[-3:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


# ------------------------------------------------------------------------------ measuring
def _weights(folder: Path) -> int:
    return sum(f.stat().st_size for f in (folder / "variables").glob("variables.data-*"))


def _tiny(tmp: Path) -> Path:
    path = tmp / "tiny"
    if not path.exists():
        _child("--build", str(path), "64", "16", "32", "1")
    return path


def serve_times(paths: dict, feeds: Path, rounds: int, seconds: float) -> dict:
    """name -> batch -> the median over ``rounds`` of each process's median call (ms), the
    variants alternating which goes first."""
    times = {name: {} for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            got = json.loads(subprocess.run(
                [sys.executable, str(HERE / "serve_worker.py"), str(paths[name]), str(feeds),
                 "--seconds", str(seconds)], capture_output=True, text=True,
                check=True).stdout.strip().splitlines()[-1])
            for batch, stats in got.items():
                times[name].setdefault(batch, []).append(stats["median"] * 1e3)
    return {name: {b: statistics.median(v) for b, v in by.items()} for name, by in times.items()}


def measure(name: str, spec, tmp: Path, base_kib: int, rounds: int, seconds: float) -> dict:
    import numpy as np
    rows, dim, width, layers = spec
    work = tmp / name.split(",")[0].replace(" ", "_").replace("^", "")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src, out = work / "fp32", work / "bf16"
    _child("--build", str(src), str(rows), str(dim), str(width), str(layers))
    conv = json.loads(_child("--convert", str(src), str(out)))
    rng = np.random.default_rng(0)
    np.savez(work / "ids.npz", ids=rng.integers(0, rows, (64, IDS)).astype(np.int32))
    for variant, path in (("fp32", src), ("bf16", out)):
        _child("--outputs", str(path), str(work / "ids.npz"), str(work / f"{variant}.npy"))
    want, got = np.load(work / "fp32.npy"), np.load(work / "bf16.npy")
    np.savez(work / "feeds.npz", **{f"ids@{b}": rng.integers(0, rows, (b, IDS)).astype(np.int32)
                                    for b in BATCHES})
    speed = serve_times({"fp32": src, "bf16": out}, work / "feeds.npz", rounds, seconds)
    row = {"name": name, "weights": _weights(src), "largest": rows * dim * 4,
           "tensors_largest": max(rows * dim, width * width) * 4, "convert": conv,
           "base_kib": base_kib,
           "rel_l2": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
           "top1": float((got.argmax(1) == want.argmax(1)).mean()), "ms": speed,
           "converted_bytes": _weights(out) + (out / "saved_model.pb").stat().st_size}
    shutil.rmtree(work, ignore_errors=True)
    return row


def run(only, rounds: int, seconds: float, tmp: Path, command: str) -> dict:
    from benchmd import commit, provenance
    tmp.mkdir(parents=True, exist_ok=True)
    base = json.loads(_child("--convert", str(_tiny(tmp)), str(tmp / "tiny_out")))["peak_kib"]
    rows = []
    for name, spec in MODELS.items():
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        t = time.perf_counter()
        rows.append(measure(name, spec, tmp, base, rounds, seconds))
        print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return {"rows": rows, "rounds": rounds, "provenance": provenance(shlex.split(command)),
            "commit": commit()}


# ------------------------------------------------------------------------------- the section
def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _kept(row: dict) -> str:
    kept = row["convert"]["kept"]
    if not kept:
        return "none"
    by: dict[str, int] = {}
    for k in kept:
        for dtype in k["stored"]:
            by[dtype] = by.get(dtype, 0) + 1
    return (f"{len(kept)} ({_gib(sum(k['bytes'] for k in kept))}: "
            + ", ".join(f"{n} {d}" for d, n in sorted(by.items())) + ")")


def table(result: dict) -> str:
    rows = result["rows"]
    lines = [SECTION, "",
             result["provenance"] + " Its measurements: `benchmarks/results/freeze_scale.json`.",
             "",
             "Serving SavedModels of an embedding table (int32 ids `[None, 16]`, their rows "
             "averaged) and six ReLU layers with a 10-wide head, converted with `--freeze "
             "--target bfloat16 --device cpu`, each step in a process of its own "
             "(`benchmarks/freeze_scale.py`'s doc). *Weights*: the FP32 variables' bytes on "
             "disk; *kept*: the variables past `CONST_BYTES` (`amp_rewrite/io/frozen.py`) the "
             "output holds as variables, by the dtype painted (the table, which a float32 "
             "Gather reads, float32; the layers bfloat16); *convert*: the conversion's wall "
             "time; *peak*: the conversion process's peak resident memory, TensorFlow's import "
             "included, over the weights, and (*above base*) less a tiny model's conversion's "
             f"peak ({_gib(rows[0]['base_kib'] * 1024) if rows else '-'}, what any conversion "
             "takes) over the weights; *error*: the logits' relative L2 against FP32's; *batch "
             "1*, *batch 16*: FP32's median call in ms and `--freeze`'s, with FP32's over it, "
             f"the median of {result['rounds']} rounds of a process each "
             "(`benchmarks/serve_worker.py`).",
             "",
             "| model | weights | kept as variables | convert | peak | peak / weights "
             "| above base / weights | error | batch 1: FP32, --freeze | batch 16: FP32, --freeze |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r["convert"]
        peak = c["peak_kib"] * 1024
        cells = [f"{r['ms']['fp32'][str(b)]:.2f}, {r['ms']['bf16'][str(b)]:.2f} "
                 f"({_ratio(r, b):.2f}x)" for b in BATCHES]
        lines.append(f"| {r['name']} | {_gib(r['weights'])} | {_kept(r)} | {c['seconds']:.0f} s "
                     f"| {_gib(peak)} | {peak / r['weights']:.2f} | {_above(r):.2f} "
                     f"| {r['rel_l2']:.1e} | " + " | ".join(cells) + " |")
    if rows:
        per = [r["convert"]["seconds"] / (r["weights"] / (1 << 30)) for r in rows]
        big = [r for r in rows if r["weights"] > (1 << 31)]
        lines += ["", f"Every model converts, {len(big)} past 2 GiB among them; the peak above "
                  f"the base stays within {max(_above(r) for r in rows):.2f} times the weights "
                  f"(with the base, {max(_peak(r) for r in big):.2f} times past 2 GiB), the time "
                  f"per GiB of weights between {min(per):.0f} and {max(per):.0f} s, and "
                  f"`--freeze` runs at {min(_ratio(r, 1) for r in rows):.2f}x to "
                  f"{max(_ratio(r, 1) for r in rows):.2f}x FP32's speed at batch 1, "
                  f"{min(_ratio(r, 16) for r in rows):.2f}x to "
                  f"{max(_ratio(r, 16) for r in rows):.2f}x at 16."]
    return "\n".join(lines) + "\n"


def _ratio(row: dict, batch: int) -> float:
    return row["ms"]["fp32"][str(batch)] / row["ms"]["bf16"][str(batch)]


def _peak(row: dict) -> float:
    return row["convert"]["peak_kib"] * 1024 / row["weights"]


def _above(row: dict) -> float:
    return (row["convert"]["peak_kib"] - row["base_kib"]) * 1024 / row["weights"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="a serving process's timing")
    p.add_argument("--only", action="append", default=[], help="model names to run")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()) / "freeze_scale")
    p.add_argument("--render", type=Path, help="print the section from a results file, no run")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    p.add_argument("--build", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--convert", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--outputs", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build:
        build(args.build[0], *map(int, args.build[1:]))
        return 0
    if args.convert:
        print(json.dumps(convert(*args.convert)))
        return 0
    if args.outputs:
        outputs(*args.outputs)
        return 0
    sys.path.insert(0, str(HERE))
    from benchmd import publish, save_results
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        command = [sys.argv[0], *sys.argv[1:]]
        result = run(args.only, args.rounds, args.seconds, args.tmp, shlex.join(command))
        if args.write:
            save_results("freeze_scale", result)
    return publish(table(result), args.write)


if __name__ == "__main__":
    sys.exit(main())
