"""How far a tensor's largest magnitude on new batches lies from what calibration saw: the spread
``--headroom`` must cover (docs/ranges.md "Why the headroom is 32").

Calibration records each float tensor's largest finite magnitude on a few batches; a model is
then run on many more. A tensor whose calibrated maximum sits just under ``65504 / H`` stays
float16 and overflows on a later batch exactly when that batch's maximum is more than ``H``
times the calibrated one. So for each model and kind of data this script draws batches of 16
rows from one distribution, calibrates on ``k`` of them (1 or 4) and measures, per float tensor,
the *spread*: the largest magnitude over the next 16 batches divided by the calibrated one.
It repeats that over independent draws (``TRIALS``) and reports the median, 99th percentile and
largest spread over every (tensor, trial). Consts (the same every batch) and tensors that are
zero in calibration are left out.

It also counts, over every value the float32 models computed, the nonzero values below each
16-bit dtype's smallest normal and those that round to zero there (bfloat16's question:
its range is float32's, so only values below 2^-126 could be lost).

Every run uses amp-rewrite's own tracing (:meth:`amp_rewrite.tools.runner.Runner.trace`, as
``--calibration`` and ``amp-rewrite ranges`` do) and :class:`amp_rewrite.tools.ranges.Ranges`.

Run: ``.venv/bin/python benchmarks/headroom.py [--write]`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import tune_graphs  # noqa: E402
from benchmd import publish  # noqa: E402

from amp_rewrite.conversion.graph import Options  # noqa: E402
from amp_rewrite.conversion.pipeline import convert_model  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.dtypes import HEADROOM  # noqa: E402
from amp_rewrite.io.load import Model, load  # noqa: E402
from amp_rewrite.tools.ranges import Ranges  # noqa: E402
from amp_rewrite.tools.runner import open_model  # noqa: E402

SECTION = "## Range headroom"
ROWS = 16            # rows per batch
DEPLOYED = 16        # batches run after calibration
TRIALS = 6           # independent (calibration, deployment) draws per model and data
CALIBRATED = (1, 4)  # batches calibrated on
HEADROOMS = (2, 4, 8, 16, 32, 128)
GROWTH = (16, 64, 256, 1024)   # batches deployed, for the growth of the spread
GROWTH_TRIALS = 12             # draws for it (heavy tails vary from draw to draw)
COSTS = (4, 16, 32, 128)           # headrooms whose cost (nodes kept float32) is counted
#: the models whose spread is followed over :data:`GROWTH`
GROWN = ("deep MLP, 32 ReLU layers", "scaled logits, softmax")


def gaussian(width):
    return lambda rng: {"x": rng.standard_normal((ROWS, width)).astype(np.float32)}


def student_t(width, dof=3):
    """Heavy tails: a Student t with 3 degrees of freedom (finite variance, rare large rows),
    scaled to unit variance."""
    scale = np.sqrt((dof - 2) / dof)
    return lambda rng: {"x": (rng.standard_t(dof, (ROWS, width)) * scale).astype(np.float32)}


def uniform_images(rng):
    return {"images": rng.uniform(0, 1, (ROWS, 16, 16, 3)).astype(np.float32)}


def digits():
    """The 8x8 digits of scikit-learn in a fixed random order, 16 at a time (real data: 1797
    images, 112 batches; a draw takes disjoint batches)."""
    from sklearn.datasets import load_digits
    images = (load_digits().images / 16.0).astype(np.float32)[..., None]
    order = np.random.default_rng(0).permutation(len(images))
    batches = [images[order[i:i + ROWS]] for i in range(0, len(images) - ROWS + 1, ROWS)]
    state = {"next": 0}

    def draw(rng):
        batch = batches[state["next"] % len(batches)]
        state["next"] += 1
        return {"images": batch}
    return draw


def scaled_logits(seed=0, width=32, classes=16, scale=2000.0):
    """The issue's case: a dense layer whose logits are scaled (a temperature of 1/2000) before
    a softmax."""
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        w = tf.constant((rng.standard_normal((width, classes)) / np.sqrt(width)).astype(np.float32))
        logits = tf.multiply(tf.matmul(x, w, name="dense"), scale, name="scaled")
        tf.nn.softmax(logits, name="probs")
    return g.as_graph_def()


# (model, its builder (None: the bundled example), data, the data's batch maker: called once,
# it returns a function of a numpy Generator giving one batch)
CASES = [
    ("large sum (Square, 256-wide MatMul)", tune_graphs.large_sum, "normal", lambda: gaussian(64)),
    ("large sum (Square, 256-wide MatMul)", tune_graphs.large_sum, "Student t, 3 dof",
     lambda: student_t(64)),
    ("softmax over biased scores", tune_graphs.attention_softmax, "normal", lambda: gaussian(32)),
    ("scaled logits, softmax", scaled_logits, "normal", lambda: gaussian(32)),
    ("scaled logits, softmax", scaled_logits, "Student t, 3 dof", lambda: student_t(32)),
    ("deep MLP, 32 ReLU layers", tune_graphs.deep_mlp, "normal", lambda: gaussian(64)),
    ("deep MLP, 32 ReLU layers", tune_graphs.deep_mlp, "Student t, 3 dof", lambda: student_t(64)),
    ("CNN, 8 conv layers", tune_graphs.deep_cnn, "uniform images", lambda: uniform_images),
    ("examples/cnn_fp32.pb", None, "digits (scikit-learn)", digits),
]


def batch_ranges(runner, feeds) -> list[Ranges]:
    """One :class:`Ranges` per batch."""
    out = []
    for feed in feeds:
        r = Ranges()
        r.add(runner.trace(feed))
        out.append(r)
    return out


def spreads(batches: list[Ranges], k: int) -> list[float]:
    """Per tensor: the largest magnitude over the :data:`DEPLOYED` batches after the first
    ``k``, over the largest in the first ``k`` (Consts and tensors zero there left out)."""
    calib, deployed = batches[:k], batches[k:k + DEPLOYED]
    out = []
    for name, first in calib[0].tensors.items():
        if first.op == "Const":
            continue
        seen = max(b.tensors[name].max_abs for b in calib)
        later = max(b.tensors[name].max_abs for b in deployed)
        if seen > 0:
            out.append(later / seen)
    return out


def measure(model, maker, totals: dict) -> dict:
    """Spreads for each number of batches calibrated on, over :data:`TRIALS` draws; the
    small-value counts go into ``totals``."""
    found = {k: [] for k in CALIBRATED}
    make = maker()
    with open_model(model) as runner:
        for trial in range(TRIALS):
            rng = np.random.default_rng(1000 + trial)
            feeds = [make(rng) for _ in range(max(CALIBRATED) + DEPLOYED)]
            batches = batch_ranges(runner, feeds)
            for k in CALIBRATED:
                found[k].extend(spreads(batches, k))
            for b in batches:
                for t in b.tensors.values():
                    totals["nonzero"] += t.nonzero
                    for dtype in ("float16", "bfloat16"):
                        totals[f"{dtype} subnormal"] += t.subnormal.get(dtype, 0)
                        totals[f"{dtype} zero"] += t.flushed.get(dtype, 0)
    return found


def growth(model, maker) -> dict[int, float]:
    """The largest spread over the tensors, calibrated on one batch, against the number of
    batches deployed (:data:`GROWTH`), over :data:`GROWTH_TRIALS` draws."""
    make = maker()
    worst = {n: 0.0 for n in GROWTH}
    with open_model(model) as runner:
        for trial in range(GROWTH_TRIALS):
            rng = np.random.default_rng(2000 + trial)
            calib = batch_ranges(runner, [make(rng)])[0]
            running = {name: 0.0 for name in calib.tensors}
            for i in range(1, max(GROWTH) + 1):
                later = batch_ranges(runner, [make(rng)])[0]
                for name in running:
                    running[name] = max(running[name], later.tensors[name].max_abs)
                if i in worst:
                    worst[i] = max([worst[i]] + [running[n] / t.max_abs for n, t in
                                                 calib.tensors.items()
                                                 if t.op != "Const" and t.max_abs > 0])
    return worst


def costs(model, maker) -> dict[int, int]:
    """Nodes a conversion keeps float32 with code ``range`` when calibrated on one batch, by
    headroom (:data:`COSTS`)."""
    make = maker()
    found = Ranges()
    with open_model(model) as runner:
        found.add(runner.trace(make(np.random.default_rng(3000))))
    out = {}
    for h in COSTS:
        _, report = convert_model(model, Options(calibration=found.maxima(), headroom=h))
        out[h] = report.extra["calibration"]["kept"]
    return out


def mobilenet():
    """Keras's MobileNetV2 (64x64, ``weights=None``) frozen to a GraphDef with input ``x``, and
    its data: pixels 0-255, as an unnormalized image pipeline feeds them."""
    import keras
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    keras.utils.set_random_seed(0)
    net = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3))
    fn = tf.function(lambda x: net(x, training=False))
    frozen = convert_variables_to_constants_v2(
        fn.get_concrete_function(tf.TensorSpec([None, 64, 64, 3], tf.float32, name="x")))
    return frozen.graph.as_graph_def()


def pixels(rng):
    return {"x": rng.uniform(0, 255, (ROWS, 64, 64, 3)).astype(np.float32)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    totals = {"nonzero": 0, "float16 subnormal": 0, "float16 zero": 0, "bfloat16 subnormal": 0,
              "bfloat16 zero": 0}
    rows, every, cost_rows, growth_rows = [], {k: [] for k in CALIBRATED}, [], []
    models = {}
    for name, build, data, maker in CASES:
        if name not in models:
            models[name] = load(ROOT / "examples" / "cnn_fp32.pb") if build is None else \
                Model.of_graph_def(build())
            kept = costs(models[name], maker)
            cost_rows.append(f"| {name} | {data} | " + " | ".join(str(kept[h]) for h in COSTS) + " |")
        found = measure(models[name], maker, totals)
        for k in CALIBRATED:
            s = np.array(found[k])
            every[k].extend(found[k])
            rows.append(f"| {name} | {data} | {k} | {len(s) // TRIALS} | {np.median(s):.2f} | "
                        f"{np.percentile(s, 99):.2f} | {s.max():.2f} |")
        if name in GROWN:
            worst = growth(models[name], maker)
            growth_rows.append(f"| {name} | {data} | " + " | ".join(f"{worst[n]:.2f}" for n in GROWTH)
                               + " |")
    kept = costs(Model.of_graph_def(mobilenet()), lambda: pixels)
    cost_rows.append("| Keras MobileNetV2 (64x64, weights=None) | pixels 0-255 | "
                     + " | ".join(str(kept[h]) for h in COSTS) + " |")
    machine = (f"{hardware.describe()}, {os.cpu_count()} cores, TensorFlow {_tf_version()}, "
               f"Python {platform.python_version()}")
    lines = [SECTION, "",
             f"`benchmarks/headroom.py`: batches of {ROWS} rows drawn from one distribution; "
             f"calibrate on the first k, run the next {DEPLOYED}, and per float tensor divide the "
             "largest magnitude the later batches reach by the calibrated one (the *spread*; "
             "Consts left out); median, 99th percentile and largest over every tensor of "
             f"{TRIALS} independent draws. Measured with amp-rewrite's own tracing on {machine}.",
             "", "| model | data | batches calibrated | tensors | median spread | p99 | largest |",
             "| --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             "Tensors (all models and draws) whose spread a headroom does not cover, i.e. that "
             "would overflow float16 on the later batches had calibration put them just under "
             "65504 / headroom:", "",
             "| headroom | " + " | ".join(f"calibrated on {k}" for k in CALIBRATED) + " |",
             "| --- | " + " | ".join("---" for _ in CALIBRATED) + " |"]
    for h in HEADROOMS:
        cells = [f"{sum(1 for s in every[k] if s > h)} of {len(every[k])}" for k in CALIBRATED]
        lines.append(f"| {h}{' (default)' if h == HEADROOM else ''} | " + " | ".join(cells) + " |")
    lines += ["", "The spread grows with the data deployed: the largest spread over the tensors, "
              f"calibrated on one batch of {ROWS} rows, against the number of batches run after "
              f"it ({GROWTH_TRIALS} draws):", "",
              "| model | data | " + " | ".join(f"{n} batches" for n in GROWTH) + " |",
              "| --- | --- | " + " | ".join("---" for _ in GROWTH) + " |", *growth_rows, "",
              f"What a headroom costs: nodes kept float32 (code `range`) when calibrated on one "
              f"batch of {ROWS} rows (the deep MLP and the 8-layer CNN overflow float16 by "
              "construction, one layer's weights scaled up; the others do not):", "",
              "| model | data | " + " | ".join(f"headroom {h}" for h in COSTS) + " |",
              "| --- | --- | " + " | ".join("---" for _ in COSTS) + " |", *cost_rows]
    n = totals["nonzero"]
    lines += ["", f"Small values, over all {n} nonzero values the float32 models computed in the "
              f"spread runs: below float16's smallest normal (2^-14) "
              f"{_share(totals['float16 subnormal'], n)}, rounding to zero in float16 "
              f"{_share(totals['float16 zero'], n)}; below bfloat16's smallest normal (2^-126) "
              f"{_share(totals['bfloat16 subnormal'], n)}, rounding to zero in bfloat16 "
              f"{_share(totals['bfloat16 zero'], n)}."]
    return publish("\n".join(lines), args.write)


def _share(count: int, total: int) -> str:
    return f"{count} ({100 * count / total:.2g}%)" if count else "0"


def _tf_version() -> str:
    import tensorflow as tf
    return tf.__version__


if __name__ == "__main__":
    sys.exit(main())
