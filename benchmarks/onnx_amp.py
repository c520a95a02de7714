"""ONNX baseline for the `amp-rewrite tune` benchmark.

Converts a frozen FP32 TensorFlow GraphDef to ONNX with tf2onnx, then runs
onnxconverter-common's accuracy-driven `auto_convert_mixed_precision` (which
bisects over segments of the node list, rebuilding and re-running the model
with onnxruntime for every trial) and reports how many nodes it had to keep in
FP32, how many trials it took, and how long.

This script does not import amp_rewrite and is meant to run in its own venv,
which reuses the project's TensorFlow through a .pth file (tf2onnx needs TF to
read a GraphDef):

    python3.11 -m venv /work/onnx-venv
    echo /work/main/.venv/lib/python3.11/site-packages \
        > /work/onnx-venv/lib/python3.11/site-packages/zz_amp_project_site.pth
    /work/onnx-venv/bin/pip install tf2onnx==1.17.0 onnx==1.23.2 \
        onnxruntime==1.32.0 onnxconverter-common==1.16.0

(The .pth path comes after the venv's own site-packages, so pip sees numpy,
protobuf, flatbuffers, requests, ... as already satisfied by the project venv
and installs only the four packages above; `pip check` is clean.)

benchmarks/tune_vs_onnx.py now runs this script with /work/benchvenv/bin/python, the
venv benchmarks/range_aware.py sets up (the same packages, onnx 1.21.0 and
onnxruntime 1.24.4 there); any venv holding these packages serves, named with
--onnx-python.

Usage:

    /work/onnx-venv/bin/python benchmarks/onnx_amp.py MODEL.pb \
        --inputs FEEDS.npz --output NAME:0 [--output NAME:0 ...] \
        --tolerance T --metric rel_l2|max_abs --json OUT.json

FEEDS.npz holds one array per placeholder, keyed by its name ("x" feeds "x:0").

Metrics, per output, computed in float64 over the elements where the FP32
reference is finite:
  rel_l2  = ||conv - ref||_2 / ||ref||_2 (inf if a converted value there is
            non-finite; 0/0 counts as 0)
  max_abs = max |conv - ref| (inf likewise)
A trial passes when every output's metric is <= T.

Known onnxconverter-common 1.16 behaviour worth knowing when reading results:
if a node that produces a graph output is kept in FP32, convert_float_to_float16
still appends a Cast to float16 and retypes that graph output as float16, even
with keep_io_types=True (see "output_dtypes").  So outputs are rounded to fp16
and a tolerance below fp16 output rounding (rel_l2 ~ 5e-4) can fail even with
every node in FP32 ("ValueError: validation failed for final fp16 model").

Node counts of the final model (dtypes from ONNX shape inference, filled in by
running onnxruntime for any tensor it leaves untyped):
  total_nodes : all nodes of the graph, Casts included.
  cast_nodes  : Cast nodes (mostly the ones the conversion inserted).
  A node's compute type is the float type (float32/float16) of its float
  outputs or, if it has none, of its float inputs.  Nodes with no float input
  or output (shape arithmetic, integer ops) and the non-computing ops Cast,
  Constant, Shape and Size are left out.  Then
  fp32_nodes  : nodes whose compute type is float32 (a node with both float32
                and float16 float outputs counts as float32) = "nodes kept in
                FP32";
  fp16_nodes  : nodes whose compute type is float16.

--runtime: the library always runs models with onnxruntime's CPU provider
(the default here, "ort").  On x86 CPU, onnxruntime has no float16 kernels for
most ops: it computes them in float32 and even drops the model's own
fp32->fp16->fp32 Cast pairs, so only the fp16 rounding of weights is visible
and an fp16 overflow (|x| > 65504) in an intermediate tensor never shows up.
"reference" swaps the library's runner for onnx.reference.ReferenceEvaluator
(numpy, with real float16 tensors; matmuls accumulate in float32 and round the
result), which is slow but shows what fp16 hardware would compute.  The
reference run, metric_before and metric_after use the same runtime.

"trials" counts validate_fn calls on a converted model: the bisection trials
plus the final re-validation of the chosen model; the library's initial
sanity call validate(ref, ref) is not counted.  "seconds" is the wall time of
the whole auto_convert_mixed_precision call (shape inference, the dtype
discovery run, the reference run and all trials).  The library's progress
prints go to stderr.
"""

import argparse
import contextlib
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxconverter_common  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402
from onnxconverter_common import auto_mixed_precision, float16  # noqa: E402

FLOAT_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
NON_COMPUTE_OPS = {"Cast", "Constant", "Shape", "Size"}


def metric(name, ref, conv):
    ref = np.asarray(ref, np.float64)
    conv = np.asarray(conv, np.float64)
    mask = np.isfinite(ref)
    ref, conv = ref[mask], conv[mask]
    if not np.all(np.isfinite(conv)):
        return float("inf")
    diff = conv - ref
    if name == "max_abs":
        return float(np.max(np.abs(diff))) if diff.size else 0.0
    num, den = float(np.linalg.norm(diff)), float(np.linalg.norm(ref))
    return 0.0 if num == 0.0 else (num / den if den > 0 else float("inf"))


def worst(metric_name, refs, convs):
    return max(metric(metric_name, r, c) for r, c in zip(refs, convs))


RUNTIME = "ort"


def run(model, feeds, output_names=None):
    """Runs `model` with onnxruntime (CPU) or, for --runtime reference, onnx's numpy evaluator."""
    if RUNTIME == "reference":
        with np.errstate(all="ignore"):
            return ReferenceEvaluator(model).run(output_names, feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(output_names, feeds)


def run_for_library(model, input_feed, output_names=None, sess_options=None):
    """Stand-in for auto_mixed_precision.get_tensor_values_using_ort (--runtime reference)."""
    if output_names is None:
        return run(model, input_feed)
    saved = list(model.graph.output)  # like the original: expose intermediates as outputs
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in output_names)
    try:
        return run(model, input_feed)
    finally:
        del model.graph.output[:]
        model.graph.output.extend(saved)


def count_nodes(model, feeds):
    """Counts as defined in the module docstring."""
    typed = onnx.shape_inference.infer_shapes(model)
    with contextlib.redirect_stdout(sys.stderr):
        typed = auto_mixed_precision.add_missing_dtypes_using_ort(typed, feeds)
    g = typed.graph
    dtype = {t.name: t.data_type for t in g.initializer}
    for v in [*g.input, *g.output, *g.value_info]:
        dtype[v.name] = v.type.tensor_type.elem_type
    counts = {"fp32_nodes": 0, "fp16_nodes": 0, "total_nodes": len(g.node),
              "cast_nodes": sum(n.op_type == "Cast" for n in g.node)}
    for node in g.node:
        if node.op_type in NON_COMPUTE_OPS:
            continue
        kinds = [FLOAT_TYPES[dtype[t]] for t in node.output if dtype.get(t) in FLOAT_TYPES]
        if not kinds:
            kinds = [FLOAT_TYPES[dtype[t]] for t in node.input if dtype.get(t) in FLOAT_TYPES]
        if kinds:
            counts["fp32_nodes" if "float32" in kinds else "fp16_nodes"] += 1
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="frozen FP32 GraphDef (binary .pb)")
    p.add_argument("--inputs", required=True, help=".npz, one array per placeholder name")
    p.add_argument("--output", action="append", required=True, help="output tensor, e.g. y:0")
    p.add_argument("--tolerance", type=float, required=True)
    p.add_argument("--metric", choices=["rel_l2", "max_abs"], default="rel_l2")
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--runtime", choices=["ort", "reference"], default="ort",
                   help="what runs every model: onnxruntime CPU (the library's own choice; "
                        "computes most fp16 ops in fp32) or onnx.reference (true fp16 tensors)")
    args = p.parse_args(argv)
    global RUNTIME
    RUNTIME = args.runtime
    if RUNTIME == "reference":
        auto_mixed_precision.get_tensor_values_using_ort = run_for_library

    graph_def = tf.compat.v1.GraphDef()
    with open(args.model, "rb") as f:
        graph_def.ParseFromString(f.read())
    npz = np.load(args.inputs)
    feeds = {f"{k}:0": npz[k] for k in npz.files}
    with contextlib.redirect_stdout(sys.stderr):
        model, _ = tf2onnx.convert.from_graph_def(
            graph_def, input_names=list(feeds), output_names=args.output, opset=args.opset)
    ref = run(model, feeds)

    result = {"model": args.model, "metric": args.metric, "tolerance": args.tolerance,
              "opset": args.opset, "runtime": args.runtime,
              "onnx_nodes_fp32_model": len(model.graph.node),
              "trials": 0, "seconds": None, "fp32_nodes": None, "fp16_nodes": None,
              "total_nodes": None, "cast_nodes": None, "metric_after": None,
              "metric_before": None, "error": None}
    try:
        all_fp16 = float16.convert_float_to_float16(model, keep_io_types=True)
        result["metric_before"] = worst(args.metric, ref, run(all_fp16, feeds))
    except Exception as e:  # noqa: BLE001 - record and go on
        result["metric_before_error"] = f"{type(e).__name__}: {e}"

    def validate_fn(res_fp32, res_converted):
        if res_fp32 is res_converted:  # the library's sanity check on the reference
            return True
        result["trials"] += 1
        return worst(args.metric, res_fp32, res_converted) <= args.tolerance

    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            final = auto_mixed_precision.auto_convert_mixed_precision(
                model, feeds, validate_fn=validate_fn, keep_io_types=True)
    except Exception as e:  # noqa: BLE001 - e.g. tolerance cannot be met
        final = None
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = time.perf_counter() - start

    if final is not None:
        result.update(count_nodes(final, feeds))
        result["metric_after"] = worst(args.metric, ref, run(final, feeds))
        # float16 here despite keep_io_types=True means the library's output-cast bug hit
        result["output_dtypes"] = {o.name: onnx.helper.tensor_dtype_to_np_dtype(
            o.type.tensor_type.elem_type).name for o in final.graph.output}

    for key in ("metric_before", "metric_after"):  # keep the JSON strict: inf -> "inf"
        if isinstance(result[key], float) and not np.isfinite(result[key]):
            result[key] = str(result[key])
    result["versions"] = {
        "python": platform.python_version(), "tensorflow": tf.__version__,
        "tf2onnx": tf2onnx.__version__, "onnx": onnx.__version__,
        "onnxruntime": ort.__version__, "onnxconverter_common": onnxconverter_common.__version__,
        "numpy": np.__version__}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps({k: result[k] for k in ("trials", "seconds", "fp32_nodes", "fp16_nodes",
                                             "total_nodes", "metric_before", "metric_after",
                                             "error")}))
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
