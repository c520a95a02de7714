"""Range-aware precision, side by side: amp-rewrite's calibration and tune (with and without
the range margin) against NVIDIA Model Optimizer's AutoCast and onnxconverter-common's
``auto_convert_mixed_precision``, on the same frozen FP32 models and the same data.

Each model is a frozen FP32 GraphDef with inputs drawn so that float16 overflows (or, for the
softmax over biased scores, loses the differences that matter) on some batches: the tune tests'
graphs (``tests/tune_graphs.py``; the scaled softmax with its logits at half of 65504 on the
calibration batches, as ``tests/test_tune_margin.py`` builds it), a small Keras CNN trained on
scikit-learn's digits and a small Keras Transformer encoder, fed rows scaled by a factor drawn
per row (log-uniformly; log-normally for the scaled softmax). Two calibration batches of 16
rows and 8 held-out batches of 64 rows come from the same distribution (fixed seeds): a small
calibration set, as the tune tests tune on 16 rows, and held-out batches whose largest rows
reach past what it saw.

Methods (each gets the same calibration batches, two but for the scaled softmax's one; none sees
the held-out ones, except the AutoCast ``data_max`` search, which picks its value *on* them and
so is favoured):

* amp-rewrite, through its CLI (``/work/main/.venv/bin/python -m amp_rewrite``, this tree on
  ``PYTHONPATH``): plain ``convert``; ``convert --calibration`` (one flag per batch, default
  headroom); ``tune`` with the range margin off (``--headroom 1``, where the flag exists: the
  "unguarded" tune), ``tune --headroom H`` (``H`` = ``amp_rewrite.core.dtypes.HEADROOM``) and
  that with the precision margin ``--error-margin 2`` and ``4`` (trials pass on the samples at
  the tolerance / 2 or / 4), each tuning on the two batches as two ``--inputs`` samples. A flag the CLI does not have yet
  shows as "n/a".
* The ONNX tools, after one tf2onnx export of the FP32 GraphDef (opset 17, time in the
  "export" column): AutoCast (``modelopt.onnx.autocast.convert_to_mixed_precision``,
  ``keep_io_types=True``, ``calibration_data`` an ``.npz`` of both batches) at its default
  ``data_max`` (512) and at the largest power of two from 2 to 65536 whose conversion passes
  all 8 held-out batches (searched over every power, the fewest float32 nodes first: AutoCast's
  best showing); onnxconverter-common's ``auto_convert_mixed_precision(model, feed_dict,
  validate_fn, keep_io_types=True)`` with the same checks as its ``validate_fn`` on the
  calibration batches, once as the library runs (its trials on onnxruntime) and once with its
  trials on onnx's reference evaluator (real float16 arithmetic; see below).

Columns: "matrix ops float16": MatMul/BatchMatMul/Conv/Einsum ops (ONNX: MatMul, Gemm, Conv,
Einsum) computing in float16, of all; "float32 nodes": compute nodes of the result computing in
float32 (casts, constants, inputs, identities and nodes with no float type left out; ONNX
dtypes from shape inference, as ``benchmarks/onnx_amp.py`` counts them). tf2onnx fuses and
rewrites ops (MatMul + BiasAdd, a Keras LayerNormalization's ops), so node counts compare
within a side, not across; the matrix ops match one to one. "held-out pass":
batches of the 8 on which every output passes ``verify``'s float16 default checks (rel_l2 <=
1e-2, top-1 >= 0.99 on batches of scores with near-ties agreeing, a non-finite value where
FP32 is finite fails). Our results are judged by :func:`amp_rewrite.tools.verify.verify` on
TensorFlow's CPU float16 kernels; the ONNX results by the same checks
(:class:`amp_rewrite.tools.verify.ErrorStats`) against the FP32 TensorFlow outputs, run two
ways: onnx's reference evaluator (numpy, real float16 tensors: what float16 hardware computes,
the headline number) and onnxruntime's CPU provider, which computes most float16 ops in float32
and so shows no overflow (the number in brackets). "time": wall time of the conversion or
search (ours: the whole CLI command, interpreter and TensorFlow start included, a constant
given under the table).

Set up the venv for the ONNX tools once (it reuses the project's TensorFlow, numpy and
protobuf through a ``.pth`` file, and never touches ``/work/main/.venv``)::

    python3.11 -m venv /work/benchvenv
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /work/benchvenv/lib/python3.11/site-packages/zz_amp_project_site.pth
    /work/benchvenv/bin/pip install tf2onnx==1.17.0 onnxconverter-common==1.16.0 \\
        'nvidia-modelopt[onnx]==0.47.0'

(``nvidia-modelopt[onnx]`` brings onnx 1.21.0, onnxruntime-gpu 1.24.4, whose CPU provider is
what runs here, and a CUDA build of torch with its CUDA libraries: about 6 GB in the venv.)

Run, from the repository root::

    PYTHONPATH=$PWD /work/benchvenv/bin/python benchmarks/range_aware.py [--write] [--only NAME]

(about 9 minutes on 2 cores, most of it the AutoCast ``data_max`` search on the encoder, 16
conversions each run on 8 batches by numpy; ``--write`` puts the tables in BENCHMARKS.md). It is
no test and the ONNX tools are no dependency of the project: benchmarks only.

tf2onnx 1.17 converts TensorFlow 2.21's frozen GraphDefs with ``from_graph_def`` at opset 17
as it is; the one op it cannot export here is ``Erfc``, which Keras's exact GELU lowers to, so
the encoder uses the tanh GELU (as BERT and GPT-2 do).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxconverter_common  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402
from onnxconverter_common import auto_mixed_precision  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from tensorflow.python.framework.convert_to_constants import (  # noqa: E402
    convert_variables_to_constants_v2,
)

import modelopt  # noqa: E402
from modelopt.onnx.autocast import configure_logging, convert_to_mixed_precision  # noqa: E402

import tune_graphs  # noqa: E402
from benchmd import publish  # noqa: E402

from amp_rewrite.core.dtypes import FLOAT, HALF, HEADROOM  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402
from amp_rewrite.tools.verify import ErrorStats, _judge, criteria, verify  # noqa: E402

SECTION = "## Range-aware precision"
PROJECT_PYTHON = "/work/main/.venv/bin/python"
OPSET = 17
# rows per batch: calibration sets are small (two batches of 16, as the tune tests tune on 16
# rows), held-out batches larger, so their largest rows reach past what calibration saw
CALIBRATION_ROWS = 16
HELDOUT_ROWS = 64
CALIBRATION_SEEDS = (1, 2)
HELDOUT_SEEDS = tuple(range(100, 108))
REL_L2 = 1e-2                      # verify's float16 default
CRITERIA = criteria(HALF, rel_l2=REL_L2)
NOT_COMPUTE_TF = {"Cast", "Const", "Placeholder", "Identity", "NoOp"}
NOT_COMPUTE_ONNX = {"Cast", "Constant", "Shape", "Size", "Identity"}
MATRIX_ONNX = {"MatMul", "Gemm", "Conv", "Einsum"}
FLOAT_ONNX = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
F16_MAX = 65504.0
DATA_MAX_POWERS = tuple(2 ** k for k in range(1, 17))


# ----------------------------------------------------------------------------- models and data

@dataclass
class Case:
    """A frozen FP32 model and its data: feeds keyed by input name (no ``:0``)."""

    name: str
    graph_def: tf.compat.v1.GraphDef
    outputs: list[str]
    calibration: list[dict]
    heldout: list[dict]
    refs: list[list[np.ndarray]] = field(default_factory=list)   # FP32 outputs per held-out batch


def _row_scales(rng, n, low, high):
    """Per-row factors drawn log-uniformly from [10**low, 10**high]: some batches hold a row
    large enough to overflow float16 somewhere, others not."""
    return (10.0 ** rng.uniform(low, high, n)).astype(np.float32)


def _vectors(width, low, high):
    def sample(seed, rows):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((rows, width)).astype(np.float32)
        return {"x": x * _row_scales(rng, rows, low, high)[:, None]}
    return sample


def _images(seed, rows):
    return tune_graphs.images(rows, seed)


def _scaled_softmax():
    """:func:`tune_graphs.scaled_softmax` as ``tests/test_tune_margin.py`` builds it: rows of
    :func:`tune_graphs.loud_rows` (each row's amplitude log-normal), one calibration batch (16
    rows, seed 3, the test's tuning batch) and logits scaled so that its largest is half of
    65504."""
    def sample(seed, rows):
        return tune_graphs.loud_rows(rows, seed=seed)
    seeds = (3,)
    calibration = concat([sample(s, CALIBRATION_ROWS) for s in seeds])
    largest = np.abs(tf_run(tune_graphs.scaled_softmax(1.0), calibration, ["logits:0"])[0]).max()
    return tune_graphs.scaled_softmax(F16_MAX / 2 / largest), ["probs:0"], sample, seeds


def _digits_cnn():
    """A small Keras CNN trained for a few epochs on digits 0..1399 (inputs 0..1), frozen with a
    free batch dimension; the data: held-out digits (1400 on) scaled per row by 10**U(1, 4)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:1400], y[:1400], epochs=8, batch_size=64, verbose=0)
    fn = tf.function(lambda t: model(t, training=False))
    frozen = convert_variables_to_constants_v2(
        fn.get_concrete_function(tf.TensorSpec([None, 8, 8, 1], tf.float32, name="x")))
    pool = x[1400:]

    def sample(seed, rows):
        rng = np.random.default_rng(seed)
        picked = pool[rng.choice(len(pool), rows, replace=False)]
        return {"x": picked * _row_scales(rng, rows, 1.0, 4.0)[:, None, None, None]}
    return frozen.graph.as_graph_def(), [t.name for t in frozen.outputs], sample


def _gelu(t):
    # tanh GELU (BERT's, GPT-2's): Keras's exact one lowers to Erfc, which tf2onnx 1.17 cannot
    # export ("Unsupported ops: Erfc")
    return keras.activations.gelu(t, approximate=True)


def _encoder():
    """A small Keras Transformer encoder (seeded random weights; 2 blocks of 4-head attention
    and a GELU feed-forward, post-LayerNorm, 16 tokens of 32 features, 10 classes), frozen with a
    free batch dimension; rows scaled by 10**U(0, 2.5)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((16, 32))
    h = keras.layers.Dense(64)(tokens)
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(4, 16)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(64)(keras.layers.Dense(128, activation=_gelu)(h))
        h = keras.layers.LayerNormalization()(h + f)
    model = keras.Model(tokens, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
    fn = tf.function(lambda t: model(t, training=False))
    frozen = convert_variables_to_constants_v2(
        fn.get_concrete_function(tf.TensorSpec([None, 16, 32], tf.float32, name="x")))

    def sample(seed, rows):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((rows, 16, 32)).astype(np.float32)
        return {"x": x * _row_scales(rng, rows, 0.0, 2.5)[:, None, None]}
    return frozen.graph.as_graph_def(), [t.name for t in frozen.outputs], sample


def _sign_flip():
    """:func:`tune_graphs.sign_flip_softmax`: ``softmax(40 * x @ W) @ V``, each row with one
    score whose float16 value overflows. On the calibration batches (seeds 1, 2) that score is
    negative (-inf, which the softmax turns into float32's zeros: the overflow looks
    harmless); on the held-out batches its sign alternates (even seeds positive: +inf, NaN)."""
    def sample(seed, rows):
        sign = -1.0 if seed < 100 or seed % 2 else 1.0
        return tune_graphs.hot_rows(rows, sign, seed=seed)
    return tune_graphs.sign_flip_softmax(), ["y:0"], sample


def cases() -> dict:
    """name -> builder of (graph_def, output tensors, sample(seed, rows) -> feeds[, calibration
    seeds if not CALIBRATION_SEEDS])."""
    return {
        "large sum (tune_graphs.large_sum), rows x 10^U(0, 1)":
            lambda: (tune_graphs.large_sum(), ["logits:0"], _vectors(64, 0.0, 1.0)),
        "softmax over biased scores (tune_graphs.attention_softmax)":
            lambda: (tune_graphs.attention_softmax(), ["out:0"], _vectors(32, 0.0, 0.0)),
        "deep MLP, one loud layer (tune_graphs.deep_mlp)":
            lambda: (tune_graphs.deep_mlp(), ["out:0"], _vectors(64, 0.0, 0.5)),
        "CNN, one loud conv (tune_graphs.deep_cnn)":
            lambda: (tune_graphs.deep_cnn(), ["out:0"], _images),
        "softmax over scaled logits (tune_graphs.scaled_softmax), loud rows": _scaled_softmax,
        "Keras CNN on digits, rows x 10^U(1, 4)": _digits_cnn,
        "Keras Transformer encoder, rows x 10^U(0, 2.5)": _encoder,
        "softmax(40 x @ W), the overflow's sign flips (tune_graphs.sign_flip_softmax)": _sign_flip,
    }


def build(name: str, builder) -> Case:
    graph_def, outputs, sample, *seeds = builder()
    case = Case(name, graph_def, outputs,
                [sample(s, CALIBRATION_ROWS) for s in (seeds[0] if seeds else CALIBRATION_SEEDS)],
                [sample(s, HELDOUT_ROWS) for s in HELDOUT_SEEDS])
    case.refs = [tf_run(graph_def, feed, outputs) for feed in case.heldout]
    return case


def tf_run(graph_def, feed: dict, outputs: list[str]) -> list[np.ndarray]:
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        return sess.run(outputs, {f"{k}:0": v for k, v in feed.items()})


def concat(feeds: list[dict]) -> dict:
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


# ----------------------------------------------------------------------------- amp-rewrite (CLI)

def cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    start = time.perf_counter()
    proc = subprocess.run([PROJECT_PYTHON, "-m", "amp_rewrite", *args], capture_output=True,
                          text=True, env=env)
    return time.perf_counter() - start, proc


def cli_flags() -> dict:
    """Which of the range-aware flags this tree's CLI has (they land separately)."""
    _, main_help = cli("--help")
    _, tune_help = cli("tune", "--help")
    return {"calibration": "--calibration" in main_help.stdout,
            "tune_headroom": "--headroom" in tune_help.stdout,
            "tune_error_margin": "--error-margin" in tune_help.stdout}


def ours(case: Case, tmp: Path, flags: dict) -> dict:
    pb = tmp / "model.pb"
    calib = [tmp / f"calib{i}.npz" for i in range(len(case.calibration))]
    heldout = [tmp / f"heldout{i}.npz" for i in range(len(case.heldout))]
    inputs = [a for p in calib for a in ("--inputs", str(p))]
    calibration = [a for p in calib for a in ("--calibration", str(p))]
    headroom_off = ["--headroom", "1"] if flags["tune_headroom"] else []
    methods = {   # key -> (label, CLI arguments or None where the flag is missing)
        "convert": ("amp-rewrite convert", [str(pb)]),
        "calibration": ("amp-rewrite convert --calibration",
                        [str(pb), *calibration] if flags["calibration"] else None),
        "tune": ("amp-rewrite tune" + (" --headroom 1 (no margin)" if headroom_off else ""),
                 ["tune", str(pb), *inputs, *headroom_off]),
        "tune_margin": (f"amp-rewrite tune --headroom {HEADROOM:g}",
                        ["tune", str(pb), *inputs, "--headroom", f"{HEADROOM:g}"]
                        if flags["tune_headroom"] else None),
        **{f"tune_error{margin}": (
            f"amp-rewrite tune --headroom {HEADROOM:g} --error-margin {margin}",
            ["tune", str(pb), *inputs, "--headroom", f"{HEADROOM:g}", "--error-margin",
             str(margin)] if flags["tune_error_margin"] else None) for margin in (2, 4)},
    }
    rows = {}
    for key, (label, args) in methods.items():
        if args is None:
            rows[key] = {"label": label, "error": "n/a: flag not on this tree yet"}
            continue
        out = tmp / f"{key}.pb"
        seconds, proc = cli(*args, "-o", str(out), "--force")
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
            rows[key] = {"label": label, "seconds": seconds,
                         "error": f"exit {proc.returncode}: {' '.join(last)[:100]}"}
            continue
        converted = tf.compat.v1.GraphDef()
        converted.ParseFromString(out.read_bytes())
        passed = sum(verify(str(pb), str(out), inputs=str(h), rel_l2=REL_L2).ok for h in heldout)
        rows[key] = {"label": label, **tf_counts(converted), "seconds": seconds, "passed": passed}
    return rows


def tf_precision(node) -> str:
    """float16 / float32 / none, read off a NodeDef's type attributes (a node holding both
    counts float32, but a batch norm's float32 statistics beside float16 data do not)."""
    held = set()
    for value in node.attr.values():
        kind = value.WhichOneof("value")
        held.update([value.type] if kind == "type" else value.list.type if kind == "list" else [])
    if HALF in held and (FLOAT not in held or node.op.startswith("FusedBatchNorm")):
        return "float16"
    return "float32" if FLOAT in held else "none"


def tf_counts(graph_def) -> dict:
    matrix = [n for n in graph_def.node if n.op in MATRIX_OPS]
    return {"matrix_fp16": sum(tf_precision(n) == "float16" for n in matrix),
            "matrix_total": len(matrix),
            "fp32_nodes": sum(tf_precision(n) == "float32" for n in graph_def.node
                              if n.op not in NOT_COMPUTE_TF)}


# ----------------------------------------------------------------------------- the ONNX tools

def onnx_feed(feed: dict) -> dict:
    return {f"{k}:0": v for k, v in feed.items()}


def onnx_run(model, feed: dict, runtime: str) -> list[np.ndarray]:
    if runtime == "reference":
        with np.errstate(all="ignore"):
            return ReferenceEvaluator(model).run(None, onnx_feed(feed))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, onnx_feed(feed))


def judged(names: list[str], refs, outs) -> bool:
    """verify's float16 default checks on every output (``CRITERIA``)."""
    for name, ref, out in zip(names, refs, outs):
        stats = ErrorStats(CRITERIA.rtol, CRITERIA.atol, CRITERIA.rel_l2)   # as verify: no inf agrees
        stats.update(ref, out)
        if not _judge(name, name, stats, False, CRITERIA).ok:
            return False
    return True


def heldout_passes(case: Case, model, runtime: str) -> int:
    return sum(judged(case.outputs, ref, onnx_run(model, feed, runtime))
               for feed, ref in zip(case.heldout, case.refs))


def onnx_counts(model, feed: dict) -> dict:
    typed = onnx.shape_inference.infer_shapes(model)
    with contextlib.redirect_stdout(io.StringIO()):
        typed = auto_mixed_precision.add_missing_dtypes_using_ort(typed, onnx_feed(feed))
    g = typed.graph
    dtype = {t.name: t.data_type for t in g.initializer}
    for v in [*g.input, *g.output, *g.value_info]:
        dtype[v.name] = v.type.tensor_type.elem_type
    counts = {"matrix_fp16": 0, "matrix_total": 0, "fp32_nodes": 0}
    for node in g.node:
        if node.op_type in NOT_COMPUTE_ONNX:
            continue
        kinds = [FLOAT_ONNX[dtype[t]] for t in node.output if dtype.get(t) in FLOAT_ONNX] or \
            [FLOAT_ONNX[dtype[t]] for t in node.input if dtype.get(t) in FLOAT_ONNX]
        if not kinds:
            continue
        precision = "float32" if "float32" in kinds else "float16"
        counts["fp32_nodes"] += precision == "float32"
        if node.op_type in MATRIX_ONNX:
            counts["matrix_total"] += 1
            counts["matrix_fp16"] += precision == "float16"
    return counts


def autocast(path: Path, calib: Path, data_max: float):
    # AutoCast logs every node it keeps; the table needs only the model
    with contextlib.redirect_stdout(io.StringIO()):
        return convert_to_mixed_precision(str(path), low_precision_type="fp16",
                                          data_max=data_max, keep_io_types=True,
                                          calibration_data=str(calib), providers=["cpu"])


def theirs(case: Case, tmp: Path) -> tuple[dict, float]:
    feeds = [onnx_feed(f) for f in case.calibration]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        model, _ = tf2onnx.convert.from_graph_def(
            case.graph_def, input_names=list(feeds[0]), output_names=case.outputs, opset=OPSET)
    export = time.perf_counter() - start
    path = tmp / "model.onnx"
    onnx.save(model, str(path))
    calib = tmp / "calibration_onnx.npz"
    np.savez(calib, **concat(feeds))
    sample = case.calibration[0]
    rows = {}

    def measure(key, label, make):
        start = time.perf_counter()
        try:
            result = make()
        except Exception as exc:  # noqa: BLE001 - a tool failing is a result to report
            rows[key] = {"label": label, "error": f"{type(exc).__name__}: {str(exc)[:90]}",
                         "seconds": time.perf_counter() - start}
            return None
        seconds = time.perf_counter() - start
        rows[key] = {"label": label, **onnx_counts(result, sample), "seconds": seconds,
                       "passed": heldout_passes(case, result, "reference"),
                       "passed_ort": heldout_passes(case, result, "ort")}
        return result

    measure("autocast", "AutoCast, data_max 512 (default)", lambda: autocast(path, calib, 512))

    # the largest power of two whose conversion passes every held-out batch (on float16
    # arithmetic): AutoCast's best trade, chosen on the held-out data itself
    best = None
    start = time.perf_counter()
    for data_max in reversed(DATA_MAX_POWERS):
        try:
            model_dm = autocast(path, calib, data_max)
        except Exception:  # noqa: BLE001 - a failing value just does not pass
            continue
        if heldout_passes(case, model_dm, "reference") == len(case.heldout):
            best = data_max
            break
    search = time.perf_counter() - start
    if best is None:
        rows["autocast_best"] = {"label": "AutoCast, largest passing data_max",
                                 "error": "no power of 2 passes", "seconds": search}
    else:
        measure("autocast_best", f"AutoCast, largest passing data_max ({best})",
                lambda: autocast(path, calib, best))
        rows["autocast_best"]["search_seconds"] = search

    def validate(res_fp32, res_converted):
        return judged(case.outputs, res_fp32, res_converted)

    joined = concat(feeds)
    with contextlib.redirect_stdout(io.StringIO()):
        measure("occ", "onnxconverter-common auto_convert_mixed_precision",
                lambda: auto_mixed_precision.auto_convert_mixed_precision(
                    model, joined, validate_fn=validate, keep_io_types=True))
        # its own runtime (onnxruntime CPU) sees no float16 overflow; the same search with
        # onnx's reference evaluator running its trials does
        with reference_trials():
            measure("occ_fp16", "onnxconverter-common, trials on float16 arithmetic",
                    lambda: auto_mixed_precision.auto_convert_mixed_precision(
                        model, joined, validate_fn=validate, keep_io_types=True))
    return rows, export


@contextlib.contextmanager
def reference_trials():
    """onnxconverter-common running its models with onnx's reference evaluator (real float16
    tensors) instead of onnxruntime's CPU provider, as ``benchmarks/onnx_amp.py --runtime
    reference`` does."""
    original = auto_mixed_precision.get_tensor_values_using_ort

    def run(model, input_feed, output_names=None, sess_options=None):
        if output_names is None:
            with np.errstate(all="ignore"):
                return ReferenceEvaluator(model).run(None, input_feed)
        saved = list(model.graph.output)   # as the original: intermediates exposed as outputs
        del model.graph.output[:]
        model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in output_names)
        try:
            with np.errstate(all="ignore"):
                return ReferenceEvaluator(model).run(output_names, input_feed)
        finally:
            del model.graph.output[:]
            model.graph.output.extend(saved)

    auto_mixed_precision.get_tensor_values_using_ort = run
    try:
        yield
    finally:
        auto_mixed_precision.get_tensor_values_using_ort = original


# ----------------------------------------------------------------------------- the table

def startup_seconds(runs: int = 3) -> float:
    """What every CLI run of ours pays before converting: the interpreter, TensorFlow, us
    (the median of ``runs``: on a shared machine one start varies by seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([PROJECT_PYTHON, "-c", "import amp_rewrite.cli.run, tensorflow"],
                       env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def cpu_line() -> str:
    name, flags = "unknown CPU", []
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        name = found.group(1).strip() if found else name
        have = set(re.search(r"^flags\s*:\s*(.+)$", text, re.M).group(1).split())
        flags = [f for f in ("avx2", "avx512f", "avx512_fp16", "avx512_bf16", "amx_bf16",
                             "amx_fp16") if f in have]
    return f"{name} ({', '.join(flags) or 'no AVX2'})"


def cell(row: dict, key: str) -> str:
    if "error" in row:
        return "n/a" if row["error"].startswith("n/a") else "failed"
    if key == "matrix":
        return f"{row['matrix_fp16']} / {row['matrix_total']}"
    if key == "passed":
        ort_part = f" ({row['passed_ort']}/8)" if "passed_ort" in row else ""
        return f"{row['passed']}/8{ort_part}"
    return str(row[key])


def table(results: list[tuple[str, dict, float]], flags: dict, startup: float) -> str:
    lines = [SECTION, "",
             "`benchmarks/range_aware.py`: the same frozen FP32 models and data for every "
             "method, one after the other in one run (see the script's docstring for the "
             "models, the data and how each column is measured). Measured "
             f"{datetime.date.today().isoformat()} on {cpu_line()}, "
             f"{os.cpu_count()} cores; TensorFlow {tf.__version__}, Python "
             f"{platform.python_version()}; tf2onnx {tf2onnx.__version__} (opset {OPSET}), "
             f"onnx {onnx.__version__}, onnxruntime {ort.__version__} (CPU provider), "
             f"nvidia-modelopt {modelopt.__version__}, onnxconverter-common "
             f"{onnxconverter_common.__version__}. Command: "
             "`PYTHONPATH=$PWD /work/benchvenv/bin/python benchmarks/range_aware.py --write`.",
             ""]
    for name, rows, export in results:
        lines += [f"**{name}** (tf2onnx export {export:.2f} s)", "",
                  "| method | matrix ops float16 | float32 nodes | held-out pass (onnxruntime "
                  "CPU) | time |",
                  "| --- | --- | --- | --- | --- |"]
        for row in rows.values():
            label = row["label"]
            if "error" in row and not row["error"].startswith("n/a"):
                lines.append(f"| {label} | failed: {row['error'].replace('|', '/')} | | | "
                             f"{row.get('seconds', 0):.2f} s |")
                continue
            seconds = f"{row['seconds']:.2f} s" if "seconds" in row else ""
            if "search_seconds" in row:
                seconds += f" (search {row['search_seconds']:.1f} s)"
            lines.append(f"| {label} | {cell(row, 'matrix')} | {cell(row, 'fp32_nodes')} | "
                         f"{cell(row, 'passed')} | {seconds} |")
        lines.append("")
    lines += summary(results)
    missing = [f for f, have in (("convert --calibration", flags["calibration"]),
                                 ("tune --headroom", flags["tune_headroom"]),
                                 ("tune --error-margin", flags["tune_error_margin"]))
               if not have]
    lines += [f"Our times are whole CLI commands: the interpreter, TensorFlow and amp-rewrite "
              f"start in about {startup:.1f} s of each (median of 3 starts). Held-out pass: "
              "ours on TensorFlow's float16 CPU kernels; the ONNX tools' on onnx's reference "
              "evaluator (real float16 tensors), "
              "in brackets on onnxruntime's CPU provider, which computes most float16 ops in "
              "float32 (no overflow shows there: onnxconverter-common, which validates with it, "
              "keeps almost everything float16)."]
    if missing:
        lines.append(f"Not on this tree yet: {', '.join(missing)} (n/a rows).")
    return "\n".join(lines)


SUMMARY = {"tune": "tune, no margin", "tune_margin": f"tune --headroom {HEADROOM:g}",
           "tune_error2": f"tune --headroom {HEADROOM:g} --error-margin 2",
           "tune_error4": f"tune --headroom {HEADROOM:g} --error-margin 4",
           "calibration": "convert --calibration", "autocast": "AutoCast 512",
           "autocast_best": "AutoCast, best data_max"}


def summary(results) -> list[str]:
    """The goal, per model: does ``tune --headroom`` pass as many held-out batches as AutoCast
    (default ``data_max``) with at least as many matrix ops in float16 as the unguarded tune?"""
    lines = ["**Summary**: matrix ops in float16, held-out batches passed (float16 arithmetic). "
             f"Goal met: `tune --headroom {HEADROOM:g}` passes as many held-out batches as "
             "AutoCast at its default `data_max` with at least as many matrix ops in float16 as "
             "the tune without the margin (the issue's goal).",
             "", "| model | " + " | ".join(SUMMARY.values()) + " | goal met |",
             "| --- |" + " --- |" * (len(SUMMARY) + 1)]
    for name, rows, _ in results:
        cells = []
        for key in SUMMARY:
            row = rows.get(key, {"error": "n/a"})
            cells.append("n/a" if row.get("error", "").startswith("n/a") else "failed"
                         if "error" in row else f"{row['matrix_fp16']}/{row['matrix_total']}, "
                         f"{row['passed']}/8")
        margin, plain, theirs_ = (rows.get(k, {}) for k in ("tune_margin", "tune", "autocast"))
        if any("passed" not in r for r in (margin, plain, theirs_)):
            goal = "n/a"
        else:
            goal = "yes" if (margin["passed"] >= theirs_["passed"]
                             and margin["matrix_fp16"] >= plain["matrix_fp16"]) else "no"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {goal} |")
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    p.add_argument("--only", action="append", default=[],
                   help="run only the models whose name contains this (repeatable)")
    args = p.parse_args()
    logging.getLogger("tf2onnx").setLevel(logging.ERROR)
    configure_logging(logging.ERROR)   # AutoCast logs every node it keeps, at INFO
    flags = cli_flags()
    startup = startup_seconds()
    results = []
    for name, builder in cases().items():
        if args.only and not any(o.lower() in name.lower() for o in args.only):
            continue
        case = build(name, builder)
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            (tmp / "model.pb").write_bytes(case.graph_def.SerializeToString())
            for i, feed in enumerate(case.calibration):
                np.savez(tmp / f"calib{i}.npz", **feed)
            for i, feed in enumerate(case.heldout):
                np.savez(tmp / f"heldout{i}.npz", **feed)
            rows = ours(case, tmp, flags)
            onnx_rows, export = theirs(case, tmp)
        results.append((name, {**rows, **onnx_rows}, export))
        print(f"done: {name}", file=sys.stderr, flush=True)
    return publish(table(results, flags, startup), args.write)


if __name__ == "__main__":
    sys.exit(main())
