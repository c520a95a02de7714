"""Conversion time and memory against graph size, beside grappler's AMP pass on the same graph.

Two families of graphs, built at several sizes:

* ``mlp``: a deep residual MLP inference graph (frozen weights, a layer norm every four blocks);
* ``train``: the same MLP with a softmax cross-entropy loss, its backward pass (tf.gradients)
  and a Momentum optimizer (resource variables).

For each graph, in one process, interleaved: ``amp_rewrite.convert(gd, target="bfloat16",
device="cpu")`` (in memory, no files) and grappler's ``auto_mixed_precision_onednn_bfloat16``
pass alone (``tf_optimizer.OptimizeGraph``, every other pass off), the median of ``--runs``
each; the ratio is ours over grappler's. Peak memory is measured in a child process per graph
(``ru_maxrss`` after the conversion minus after building the graph and importing TensorFlow).
``--write`` replaces the "Conversion speed" section of BENCHMARKS.md.

Run: ``.venv/bin/python benchmarks/scaling.py --sizes 10000 30000 100000 300000 --write``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# grappler's bfloat16 pass runs only where TensorFlow's oneDNN ops are on (hardware.py)
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402
from tensorflow.core.protobuf import meta_graph_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

from amp_rewrite import convert  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.transforms.constfold import grappler_alone  # noqa: E402

v1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Conversion speed"
WIDTH = 32
NODES_PER_BLOCK = {"mlp": 8.75, "train": 61.0}   # measured, to aim at a node count


def build(kind: str, blocks: int, seed: int = 0):
    """The ``kind`` graph with ``blocks`` residual blocks (see the module doc)."""
    r = np.random.default_rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, WIDTH], name="x")
        h = x
        for b in range(blocks):
            with tf.name_scope(f"block{b}"):
                init = r.normal(0, 0.1, (WIDTH, WIDTH)).astype(np.float32)
                w = (tf.constant(init) if kind == "mlp"
                     else v1.get_variable(f"w{b}", initializer=init, use_resource=True))
                h = h + tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w), tf.zeros([WIDTH])))
                if b % 4 == 3:
                    mean, var = tf.nn.moments(h, [1], keepdims=True)
                    h = (h - mean) * tf.math.rsqrt(var + 1e-5)
        out = tf.identity(h, name="out")
        if kind == "train":
            y = v1.placeholder(tf.int32, [None], name="y")
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out),
                                  name="loss")
            v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train")
    return g.as_graph_def()


def grappler_amp(graph_def, fetch: str):
    meta = meta_graph_pb2.MetaGraphDef(graph_def=graph_def)
    meta.collection_def["train_op"].node_list.value.append(fetch)
    config = grappler_alone("auto_mixed_precision_onednn_bfloat16")
    config.graph_options.rewrite_options.disable_model_pruning = False   # grappler's default
    return tf_optimizer.OptimizeGraph(config, meta)


def _seconds(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def blocks(kind: str, nodes: int) -> int:
    """How many blocks give about ``nodes`` nodes."""
    return max(1, round(nodes / NODES_PER_BLOCK[kind]))


def fetch_node(kind: str) -> str:
    """The node grappler is told the graph runs for (its pruning keeps what that needs)."""
    return "train" if kind == "train" else "out"


def measure_time(kind: str, path: Path, runs: int) -> dict:
    gd = graph_pb2.GraphDef.FromString(path.read_bytes())
    fetch = fetch_node(kind)
    ours, theirs = [], []
    for i in range(runs):   # interleaved, so load on the machine falls on both
        order = [("ours", lambda: convert(gd, target="bfloat16", device="cpu")),
                 ("grappler", lambda: grappler_amp(gd, fetch))]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            (ours if name == "ours" else theirs).append(_seconds(fn))
    return {"kind": kind, "nodes": len(gd.node), "bytes": gd.ByteSize(),
            "ours_s": statistics.median(ours), "grappler_s": statistics.median(theirs)}


# Run in a child by file path, so it measures whichever checkout it is started from
# (benchmarks/changes.py runs it in two); argv: GraphDef file, "ours", "ours-painted" (every
# island painted, however small: min_matrix_intensity=0) or grappler's fetch node.
# Prints one JSON line.
CHILD = ("import gc, json, os, sys, time\n"
         "os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')\n"
         "from tensorflow.core.framework import graph_pb2\n"
         "def status(key):\n"
         "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key))\n"
         "gd = graph_pb2.GraphDef(); gd.ParseFromString(open(sys.argv[1], 'rb').read())\n"
         "if sys.argv[2] in ('ours', 'ours-painted'):\n"
         "    from amp_rewrite import convert\n"
         "    kw = {'min_matrix_intensity': 0} if sys.argv[2] == 'ours-painted' else {}\n"
         "    run = lambda: convert(gd, target='bfloat16', device='cpu', **kw)\n"
         "else:\n"
         "    sys.path.insert(0, 'benchmarks'); import scaling\n"
         "    run = lambda: scaling.grappler_amp(gd, sys.argv[2])\n"
         "gc.collect(); open('/proc/self/clear_refs', 'w').write('5')\n"
         "base = status('VmRSS:')\n"
         "start, cpu = time.perf_counter(), time.process_time()\n"
         "run()\n"
         "seconds, cpu = time.perf_counter() - start, time.process_time() - cpu\n"
         "print(json.dumps({'base_kib': base, 'peak_kib': status('VmHWM:'), 'seconds': seconds,\n"
         "                  'cpu_seconds': cpu}))\n")


def convert_in_child(path: Path, who: str = "ours", cwd: Path = ROOT) -> dict:
    """Convert the GraphDef at ``path`` in a fresh process of the checkout at ``cwd``, by
    amp-rewrite (``who="ours"``; ``"ours-painted"`` with ``min_matrix_intensity=0``, so the
    small layers of these graphs are painted and cast too) or grappler's pass (``who``: the
    node to fetch): resident
    memory before converting (KiB), the peak while converting, and the seconds it took (wall
    and, as ``cpu_seconds``, the process's CPU time, which other jobs disturb less). The
    peak is reset first (``/proc/self/clear_refs``), so TensorFlow's import, whose own peak is
    higher than many conversions, does not hide it."""
    env = dict(os.environ, PYTHONPATH=str(cwd))
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), who], capture_output=True,
                         text=True, check=True, cwd=cwd, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_graph(kind: str, nodes: int, folder: Path) -> Path:
    path = folder / f"{kind}_{nodes}.pb"
    path.write_bytes(build(kind, blocks(kind, nodes)).SerializeToString())
    return path


def measure_memory(kind: str, path: Path) -> dict:
    """Peak memory of one conversion of the graph at ``path``, ours and grappler's, each in a
    child (see :func:`convert_in_child`)."""
    ours = convert_in_child(path)
    theirs = convert_in_child(path, fetch_node(kind))
    return {"base_kib": ours["base_kib"], "peak_kib": ours["peak_kib"],
            "grappler_extra_kib": theirs["peak_kib"] - theirs["base_kib"]}


def _wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def measure_cli(path: Path, runs: int) -> dict:
    """The CLI end to end on ``path`` (``amp-rewrite IN -o OUT --target bfloat16 --device
    cpu``: start-up, load, conversion, save) beside a bare ``import tensorflow`` in a fresh
    interpreter and the in-process conversion alone, interleaved, medians."""
    cli = str(Path(sys.executable).parent / "amp-rewrite")
    out = path.with_suffix(".amp.pb")
    cmds = {"cli": [cli, str(path), "-o", str(out), "--force", "--target", "bfloat16",
                    "--device", "cpu"],
            "import": [sys.executable, "-c", "import tensorflow"],
            # the same without the interpreter's teardown, as the command ends (cli.console)
            "import_only": [sys.executable, "-c", "import os, tensorflow; os._exit(0)"]}
    got: dict[str, list[float]] = {k: [] for k in ("cli", "import", "import_only", "convert")}
    for i in range(runs):
        for name in (list(cmds) if i % 2 == 0 else list(cmds)[::-1]):
            got[name].append(_wall(cmds[name]))
        got["convert"].append(convert_in_child(path)["seconds"])
    out.unlink()
    return {k: statistics.median(v) for k, v in got.items()}


def cli_lines(label: str, result: dict) -> list[str]:
    rest = result["cli"] - result["convert"]
    return [f"\nThe CLI end to end on {label} (`amp-rewrite IN -o OUT --target bfloat16 "
            f"--device cpu`): {result['cli']:.2f} s, of which the conversion alone, timed inside a "
            f"fresh process, takes "
            f"{result['convert']:.2f} s; the other {rest:.2f} s (start-up, load, save) against "
            f"{result['import']:.2f} s for a bare `python -c 'import tensorflow'` "
            f"({result['import_only']:.2f} s of it before the interpreter's teardown at exit, "
            "which the command skips once everything is written), medians of the same "
            "interleaved runs."]


def fit(xs, ys) -> tuple[float, float]:
    """Exponent and factor of ys = a * xs^b, by least squares on logs (b = 1: linear)."""
    b, log_a = np.polyfit(np.log(xs), np.log(ys), 1)
    return float(b), float(np.exp(log_a))


def table(rows: list[dict], runs: int, measured: str = "") -> str:
    """The section: ``measured`` (benchmd.provenance, taken as the run started: it names the
    commit), what was timed and how, the table and the fits."""
    lines = [f"{SECTION}\n",
             f"{measured or provenance()}\n",
             f"`benchmarks/scaling.py`: in-process `amp_rewrite.convert(gd, target=\"bfloat16\", "
             f"device=\"cpu\")` against grappler's `auto_mixed_precision_onednn_bfloat16` pass "
             f"alone on the same GraphDef (`tf_optimizer.OptimizeGraph`), median of {runs} runs "
             f"each, interleaved in one process, on {platform.machine()} with {os.cpu_count()} "
             f"cores ({hardware.describe()}), TensorFlow {tf.__version__}. Peak memory: a child "
             "process's peak RSS during the conversion above what it held after building the "
             "graph (TensorFlow, the GraphDef); grappler's the same way in its own child. The "
             "issue's memory aim reads as: our peak no more than 3x the GraphDef's size above "
             "grappler's (last column).\n",
             "| graph | nodes | GraphDef MB | amp-rewrite s | grappler s | ours / grappler | "
             "peak memory above baseline MB | / GraphDef size | grappler's MB | "
             "(ours - grappler's) / GraphDef size |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        extra = r["peak_kib"] - r["base_kib"]
        theirs = r["grappler_extra_kib"]
        lines.append(f"| {r['kind']} | {r['nodes']} | {r['bytes'] / 1e6:.1f} | {r['ours_s']:.2f} | "
                     f"{r['grappler_s']:.2f} | {r['ours_s'] / r['grappler_s']:.1f}x | "
                     f"{extra / 1024:.0f} | {extra * 1024 / r['bytes']:.1f}x | {theirs / 1024:.0f} | "
                     f"{(extra - theirs) * 1024 / r['bytes']:.1f}x |")
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        if len(mine) >= 2:
            bt, at = fit([r["nodes"] for r in mine], [r["ours_s"] for r in mine])
            bm, _ = fit([r["nodes"] for r in mine], [max(r["peak_kib"] - r["base_kib"], 1) for r in mine])
            bg, _ = fit([r["nodes"] for r in mine], [r["grappler_s"] for r in mine])
            lines.append(f"\n{kind}: time grows as nodes^{bt:.2f} ({at * 1e6:.1f} µs per node at "
                         f"exponent {bt:.2f}), peak memory as nodes^{bm:.2f} (fit of log time and "
                         f"log memory on log nodes; 1.00 is linear); grappler's time on the same "
                         f"graphs as nodes^{bg:.2f}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[10000, 30000, 100000])
    p.add_argument("--kinds", nargs="+", default=["mlp", "train"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cli-graph", default="mlp:100000", help="kind:nodes for the CLI end to end")
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    measured = provenance()   # the load as the run starts
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}   # each graph built once (a 300k-node training graph takes a minute)
        for kind in args.kinds:
            for nodes in args.sizes:
                path = paths[(kind, nodes)] = write_graph(kind, nodes, Path(tmp))
                row = measure_time(kind, path, args.runs)
                row.update(measure_memory(kind, path))
                rows.append(row)
                print(json.dumps(row), flush=True)
        kind, nodes = args.cli_graph.split(":")
        path = paths.get((kind, int(nodes))) or write_graph(kind, int(nodes), Path(tmp))
        cli = measure_cli(path, args.runs)
        print(json.dumps(cli), flush=True)
        extra = cli_lines(f"the {kind} graph of about {nodes} nodes", cli)
    text = table(rows, args.runs, measured) + "\n".join(extra) + "\n"
    return publish(text, args.write)


if __name__ == "__main__":
    sys.exit(main())
