"""``amp-rewrite kernels CONVERTED``: did the matrix work really run on 16-bit matrix units?

On CPU the model runs once in a child process with ``ONEDNN_VERBOSE=1``; oneDNN then prints one
line per executed primitive (its implementation, ISA, data types and problem size) on the
child's stdout. We keep the MatMul/Conv family (convolution, deconvolution, inner_product,
matmul), count each primitive's multiply-accumulates from its problem descriptor, and call it
*on a 16-bit unit* when its source data is bf16/f16 and the ISA oneDNN names in the
implementation has instructions for that type (:data:`SIXTEEN_BIT_ISA`: AMX tiles, AVX512-BF16
dot products, AVX512-FP16 or AVX-NE-CONVERT conversions), not oneDNN's emulation of it on an
ISA without them (``avx512_core``, ``avx2``). Where oneDNN converts the 16-bit data in hardware
and multiplies in float32 (float16 on ``avx10_1_512``, both types on ``avx2_vnni_2``), the
kernel's line says so. The share of the work (MACs) on such units is the headline number. A child that fails says on stderr whose failure it is: a
model TensorFlow cannot run (or cannot load, or inputs that do not fit) is the user's, reported
with TensorFlow's reason (exit 2); an exception in our worker code, or a child that dies without
saying, is an internal error (exit 70).

On GPU the model runs in-process with a full trace; kernel names with Tensor Core signatures
(``884``/``1688``/``16816`` tiles, ``hmma``, ``xmma``, ``tensorop``, ``wmma``) count as Tensor
Core work.

The static check: for float16 MatMul/Conv nodes, dimensions that are not multiples of 8 (which
keep cuBLAS/cuDNN off Tensor Cores) are listed by node; shapes come from the graph's shape
inference with the inputs' shapes filled in, or from a sample run where inference cannot tell.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from ..core import hardware
from ..core.errors import AmpRewriteError, InputError
from ..io.load import load
from .analysis import Analysis
from .runner import GraphRunner, fill_iterator_inputs, input_feeds, open_model, parse_shapes

log = logging.getLogger(__name__)

MATRIX_PRIMITIVES = ("convolution", "deconvolution", "inner_product", "matmul")
SIXTEEN_BIT_DATA = ("bf16", "f16")
_BF16_DOT, _BOTH_CVT = {"bf16": "bf16"}, {"bf16": "f32", "f16": "f32"}
_AVX10 = {"bf16": "bf16", "f16": "f32"}           # AVX512-BF16 dot products, AVX512-FP16 converts
_AMX_FP16 = {"bf16": "bf16", "f16": "f16"}        # tiles (tdpbf16ps, tdpfp16ps)
#: oneDNN's ISA names (the part of a verbose line's implementation after ``:``) whose
#: instructions take 16-bit data, each with the type its multiply-accumulates run in for the
#: 16-bit types it takes: ``bf16``/``f16`` (a 16-bit unit multiplies them) or ``f32`` (the
#: hardware converts them and multiplies in float32). From oneDNN's src/cpu/x64/cpu_isa_traits.hpp
#: (uxlfoundation/oneDNN, 2025: ``cpu_isa_t``, ``mayiuse``, ``JIT_IMPL_NAME_HELPER``, the names
#: verbose prints; ``get_mac_emu_data_type``: f16 on ``avx512_core_fp16`` and bf16/f16 on
#: ``avx2_vnni_2`` multiply in f32) and cpu_isa_traits.cpp (``avx512_core_fp16`` is
#: ``avx10_1_512``, ``avx512_core_amx`` ``avx10_1_512_amx``, ``avx512_core_amx_fp16``
#: ``avx10_1_512_amx_fp16``; v3.7, TensorFlow 2.21's, prints the avx10 names); the oneDNN 2.x
#: names (``avx512_core_amx_bf16``, ``avx512_core_amx_int8``, printed for
#: ``avx512_core_bf16_amx_*``) from its cpu_isa_traits.hpp. Not here, so not 16-bit:
#: ``sse41``, ``avx``, ``avx2``, ``avx2_vnni`` (int8 dot products only), ``avx512_core``,
#: ``avx512_core_vnni``, on which oneDNN emulates bf16 in software and has no f16.
SIXTEEN_BIT_ISA: dict[str, dict[str, str]] = {
    "avx2_vnni_2": _BOTH_CVT,                     # AVX-NE-CONVERT: converts only
    "avx512_core_bf16": _BF16_DOT,                # vdpbf16ps
    "avx512_core_amx_int8": _BF16_DOT,            # oneDNN 2.x: avx512_core_bf16 + AMX-INT8
    "avx512_core_amx_bf16": _BF16_DOT,            # oneDNN 2.x: avx512_core_bf16 + AMX-BF16
    "avx10_1_512": _AVX10, "avx512_core_fp16": _AVX10,
    # AMX-BF16 tiles; float16 through AVX512-FP16's converts (no AMX-FP16 tiles)
    "avx10_1_512_amx": _AVX10, "avx512_core_amx": _AVX10,
    "avx10_1_512_amx_fp16": _AMX_FP16, "avx512_core_amx_fp16": _AMX_FP16,
    # AVX10.2: vdpphps multiplies float16 pairs (get_mac_emu_data_type emulates nothing there)
    "avx10_2_512": _AMX_FP16, "avx10_2": _AMX_FP16,
    "avx10_2_512_amx_2": _AMX_FP16, "avx10_2_amx_2": _AMX_FP16,
}
TENSOR_CORE_KERNEL = re.compile(r"884|1688|16816|hmma|xmma|tensorop|wmma", re.IGNORECASE)
_BEGIN, _END = "amp-rewrite-kernels-begin", "amp-rewrite-kernels-end"
_ONEDNN = "amp-rewrite-kernels-onednn="
# the child's last stderr line when it fails: JSON {"kind": "user"|"internal", "message", ...}
_FAILED = "amp-rewrite-kernels-failed="
_CHILD_TIMEOUT = 600


@dataclass
class Kernel:
    """One executed matrix kernel (a oneDNN primitive, or a GPU kernel)."""

    kind: str            # convolution, matmul, inner_product, deconvolution, or "gpu"
    implementation: str  # e.g. brg_conv_fwd:avx512_core_bf16, or the GPU kernel name
    dtype: str           # source data type as oneDNN names it (f32, bf16, f16 ...)
    macs: int | None     # multiply-accumulates, from the problem descriptor (None: unknown)
    sixteen_bit: bool    # its 16-bit data ran on instructions for it (SIXTEEN_BIT_ISA)
    problem: str = ""
    # the type its multiply-accumulates run in where sixteen_bit: bf16/f16 on a 16-bit unit,
    # f32 where the hardware converts the 16-bit data first ("": not known, or not 16-bit)
    mac: str = ""


@dataclass
class KernelReport:
    """Which matrix kernels ran, and how much of the work ran on 16-bit matrix units."""

    device: str
    runtime: str = ""                 # e.g. "oneDNN v3.7.3, isa: Intel AVX-512 with ... bfloat16"
    onednn: bool | None = None        # CPU: whether TensorFlow's oneDNN ops were on in the run
    kernels: list[Kernel] = field(default_factory=list)
    misaligned: list[dict] = field(default_factory=list)   # float16 dims not multiples of 8

    @property
    def share(self) -> float | None:
        """Share of the MACs (or, where sizes are unknown, of the kernels) on 16-bit units."""
        return self._share(lambda k: k.sixteen_bit)

    @property
    def float32_math_share(self) -> float | None:
        """The part of :attr:`share` whose 16-bit data the CPU converts and multiplies in
        float32 (``Kernel.mac`` f32)."""
        return self._share(lambda k: k.sixteen_bit and k.mac == "f32")

    def _share(self, counted) -> float | None:
        if not self.kernels:
            return None
        if all(k.macs is not None for k in self.kernels):
            total = sum(k.macs for k in self.kernels)
            if total:
                return sum(k.macs for k in self.kernels if counted(k)) / total
        return sum(1 for k in self.kernels if counted(k)) / len(self.kernels)

    def groups(self) -> list[dict]:
        """Kernels grouped by (kind, implementation, dtype): count and MACs, largest first."""
        out: dict[tuple, dict] = {}
        for k in self.kernels:
            g = out.setdefault((k.kind, k.implementation, k.dtype), {
                "kind": k.kind, "implementation": k.implementation, "dtype": k.dtype,
                "count": 0, "macs": 0, "sixteen_bit": k.sixteen_bit, "mac": k.mac})
            g["count"] += 1
            g["macs"] += k.macs or 0
        return sorted(out.values(), key=lambda g: (-g["macs"], -g["count"], g["implementation"]))

    def to_dict(self) -> dict:
        return {"device": self.device, "runtime": self.runtime, "onednn": self.onednn,
                "share": self.share, "float32_math_share": self.float32_math_share,
                "kernels": [asdict(k) for k in self.kernels], "groups": self.groups(),
                "misaligned": self.misaligned}


# -- oneDNN verbose log ------------------------------------------------------------------------

def isa_of(implementation: str) -> str:
    """``brg_conv_fwd:avx512_core_bf16`` -> ``avx512_core_bf16``."""
    return implementation.split(":", 1)[1] if ":" in implementation else implementation


def mac_dtype(implementation: str, dtype: str) -> str:
    """The type a oneDNN kernel of 16-bit ``dtype`` data multiplies in on its ISA: ``bf16`` or
    ``f16`` (a 16-bit unit), ``f32`` (converted in hardware first), or "" where its ISA has no
    instruction for ``dtype`` (oneDNN emulates it) or the data is not 16-bit."""
    isa = isa_of(implementation)
    if isa not in SIXTEEN_BIT_ISA:   # a variant of a name (avx512_core_bf16_ymm): its base's
        isa = max((n for n in SIXTEEN_BIT_ISA if isa.startswith(n + "_")), key=len, default=isa)
    return SIXTEEN_BIT_ISA.get(isa, {}).get(dtype, "")


def parse_onednn_log(text: str) -> tuple[list[Kernel], str]:
    """The matrix primitives executed according to a oneDNN verbose log, and the runtime line."""
    kernels, info = [], []
    for line in text.splitlines():
        if not line.startswith(("onednn_verbose,", "dnnl_verbose,")):
            continue
        fields = line.strip().split(",")
        if "info" in fields and ("isa:" in line or "oneDNN v" in line):
            info.append(fields[-1].strip())
        if "exec" not in fields:
            continue
        rest = fields[fields.index("exec") + 1:]
        # engine, kind, implementation, prop_kind, memory descriptors, attrs, aux, problem, time
        if len(rest) < 9 or rest[1] not in MATRIX_PRIMITIVES:
            continue
        kind, impl, mds, problem = rest[1], rest[2], rest[4], rest[-2]
        dtype = _src_dtype(mds)
        mac = mac_dtype(impl, dtype)
        kernels.append(Kernel(kind, impl, dtype, macs_of(kind, problem), bool(mac), problem,
                              mac))
    return kernels, ", ".join(info)


def _src_dtype(mds: str) -> str:
    for md in mds.split():
        name, _, rest = md.partition(":")
        if name in ("src", "diff_src"):
            return rest.split(":", 1)[0]
        if name.startswith(("src_", "diff_src_")):  # oneDNN 2.x: src_bf16::blocked:...
            return name.rsplit("_", 1)[1]
    return ""


def macs_of(kind: str, problem: str) -> int | None:
    """Multiply-accumulates of one primitive from oneDNN's problem descriptor (None: unknown)."""
    if kind == "matmul":
        return _matmul_macs(problem)
    dims = {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", problem)}
    if "mb" not in dims or "ic" not in dims or "oc" not in dims:
        return None
    get = lambda k: dims.get(k, 1)  # noqa: E731
    if kind == "inner_product":
        return get("mb") * get("ic") * get("oc") * get("id") * get("ih") * get("iw")
    kernel = get("kd") * get("kh") * get("kw")
    g = get("g")
    if kind == "deconvolution":
        return get("mb") * get("ic") * (get("oc") // g) * get("id") * get("ih") * get("iw") * kernel
    return get("mb") * (get("ic") // g) * get("oc") * get("od") * get("oh") * get("ow") * kernel


def _matmul_macs(problem: str) -> int | None:
    parts = problem.split(":")
    try:
        src, wei = ([int(d) for d in p.split("x")] for p in parts[:2])
    except ValueError:
        return None  # run-time dimensions ("*") or an unknown layout
    if len(src) < 2 or len(wei) < 2:
        return None
    m, k, n = src[-2], src[-1], wei[-1]
    try:
        batch = np.broadcast_shapes(tuple(src[:-2]), tuple(wei[:-2]))
    except ValueError:
        return None
    return math.prod(batch) * m * k * n


def onednn_kernels(path, *, shapes: Mapping | None = None, inputs: str | None = None,
                   signature: str | None = None) -> KernelReport:
    """Run the model once in a child process with ``ONEDNN_VERBOSE=1`` and parse its log."""
    cmd = [sys.executable, "-m", "amp_rewrite.tools.kernels", str(path)]
    for name, dims in (shapes or {}).items():
        cmd += ["--shape", f"{name}={','.join(map(str, dims))}"]
    if inputs:
        cmd += ["--inputs", str(inputs)]
    if signature:
        cmd += ["--signature", signature]
    # TensorFlow's log level is ours (the CLI's: quiet unless -v); the child's stderr is
    # read for its failure report, and shown with -v, where it holds TensorFlow's log
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=_CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise InputError(f"{path}: one run took over {_CHILD_TIMEOUT} s") from None
    if proc.stderr.strip():
        log.debug("the kernels run's stderr:\n%s", proc.stderr.rstrip())
    if proc.returncode != 0:
        raise _child_failure(path, proc.returncode, proc.stderr)
    out = proc.stdout
    if _BEGIN in out and _END in out:
        # only the measured run: the first one also executes constant folding and warm-up
        header = out.split(_BEGIN)[0]
        measured = out.split(_BEGIN, 1)[1].split(_END, 1)[0]
    else:
        header = measured = out
    kernels, _ = parse_onednn_log(measured)
    _, runtime = parse_onednn_log(header)
    flag = re.search(f"^{_ONEDNN}([01])$", header, re.MULTILINE)
    onednn = None if flag is None else flag.group(1) == "1"
    if not kernels:
        log.warning(_no_kernel_reason(onednn))
    return KernelReport("CPU", runtime, onednn=onednn, kernels=kernels)


def _no_kernel_reason(onednn: bool | None) -> str:
    if onednn is False:
        unit = ("" if hardware.bf16_matrix_unit() else
                " (this CPU has no bfloat16 matrix unit, so bfloat16 cannot run faster here)")
        return ("TensorFlow's oneDNN ops were off in the run (TF_ENABLE_ONEDNN_OPTS=0, or its "
                "default on a CPU without AVX512-VNNI/AVX512-BF16/AMX), so the matrix ops ran on "
                "Eigen kernels, which log nothing; set TF_ENABLE_ONEDNN_OPTS=1 to run them "
                "through oneDNN" + unit)
    return ("no oneDNN matrix primitive ran: the matrix ops ran on Eigen kernels, as float16 "
            "does on CPUs without AVX512-FP16")


def _child_failure(path, returncode: int, stderr: str) -> AmpRewriteError:
    """What a failed child process means: the model TensorFlow could not run (the child's
    InputError: the user's, exit 2), or a bug of ours (its report of any other exception, or
    a child that ended without one: a crash), an internal error."""
    reports = [line[len(_FAILED):] for line in stderr.splitlines() if line.startswith(_FAILED)]
    try:
        report = json.loads(reports[-1]) if reports else None
    except ValueError:
        report = None
    if isinstance(report, dict) and report.get("kind") == "user":
        return InputError(str(report.get("message")))
    if isinstance(report, dict):
        log.debug("the kernels child process's traceback:\n%s", report.get("traceback", ""))
        return AmpRewriteError(f"{path}: the process running the model for kernels failed: "
                               f"{report.get('message')}")
    if returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"ended with exit code {returncode}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    return AmpRewriteError(f"{path}: the process running the model for kernels {how} without "
                           "reporting an error" + (f" (its last words: {last.strip()})" if last else ""))


def _child(argv: Sequence[str]) -> int:
    """The child process: :func:`_run_child`; a failure ends it with exit code 1 after one
    line on stderr saying whose it is (:func:`_child_failure` reads it): ``user`` for an
    :class:`InputError` (the model, its inputs, a run TensorFlow refuses), ``internal`` for
    anything else."""
    try:
        return _run_child(argv)
    except InputError as exc:
        report = {"kind": "user", "message": str(exc)}
    except Exception as exc:    # our bug: the parent reports it as an internal error
        report = {"kind": "internal", "message": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, f"\n{_FAILED}{json.dumps(report)}\n".encode())
    return 1


def _run_child(argv: Sequence[str]) -> int:
    """Run the model twice, marking the second run on stdout."""
    import argparse
    import ctypes
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--shape", action="append", default=[])
    p.add_argument("--inputs")
    p.add_argument("--signature")
    args = p.parse_args(argv)
    libc = ctypes.CDLL(None)
    os.write(1, f"{_ONEDNN}{int(hardware.onednn_enabled())}\n".encode())
    with open_model(args.model, signature=args.signature) as runner:
        (feeds,) = fill_iterator_inputs(
            runner, input_feeds(runner.inputs, args.inputs, 1, parse_shapes(args.shape)))
        call = runner.callable()
        call(feeds)
        for marker in (_BEGIN, None, _END):
            if marker is None:
                call(feeds)
                continue
            # oneDNN writes through C stdio: flush it so the marker lands between its lines
            libc.fflush(None)
            sys.stdout.flush()
            os.write(1, f"{marker}\n".encode())
    libc.fflush(None)
    return 0


# -- GPU ---------------------------------------------------------------------------------------

def gpu_kernels(path, *, shapes: Mapping | None = None, inputs: str | None = None,
                signature: str | None = None) -> KernelReport:
    """Run a graph file once on the GPU with a full trace and classify the kernels it launched."""
    runner = open_model(path, signature=signature)
    if not isinstance(runner, GraphRunner):
        raise InputError(f"{path}: the GPU kernel trace needs a graph file (GraphDef or MetaGraph)")
    with runner:
        (feeds,) = fill_iterator_inputs(runner, input_feeds(runner.inputs, inputs, 1, shapes))
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        feed_dict = {s.tensor: feeds[s.name] for s in runner.inputs}
        runner.session.run(runner.outputs, feed_dict)
        runner.session.run(runner.outputs, feed_dict, options=options, run_metadata=metadata)
    return KernelReport("GPU", "TensorFlow step trace",
                        kernels=classify_gpu_kernels(metadata.step_stats))


def classify_gpu_kernels(step_stats) -> list[Kernel]:
    """GPU kernels of a trace whose names belong to matrix libraries; Tensor Core ones flagged."""
    kernels = []
    for dev in step_stats.dev_stats:
        if "stream" not in dev.device.lower():
            continue
        for ns in dev.node_stats:
            name = ns.timeline_label or ns.node_name
            if re.search(r"gemm|conv|cudnn|cutlass|xmma|hmma|884|1688|16816", name, re.IGNORECASE):
                kernels.append(Kernel("gpu", name, "", None, bool(TENSOR_CORE_KERNEL.search(name))))
    return kernels


# -- static Tensor Core alignment ----------------------------------------------------------------

_CHANNEL_FILTER_OPS = {"Conv2D": 1, "Conv3D": 1, "DepthwiseConv2dNative": 1, "Conv2DBackpropInput": 1}


def misaligned_dims(path, *, shapes: Mapping | None = None, signature: str | None = None,
                    inputs: str | None = None) -> list[dict]:
    """float16 MatMul/Conv nodes with a dimension that is not a multiple of 8, by node, on the
    inputs the run was given (the ``.npz`` file's arrays, else ``--shape``).

    Checked: a MatMul's K and N (its M is the batch, decided at run time), a batched matmul's
    K and N, and a convolution's input and output channels.
    """
    model = load(path)
    with GraphRunner(Analysis(model, signature)) as runner:
        (feeds,) = fill_iterator_inputs(runner, input_feeds(runner.inputs, inputs, 1, shapes))
        fixed = {s.tensor.split(":")[0]: feeds[s.name].shape for s in runner.inputs}
    for node in model.graph_def.node:
        if node.op == "Placeholder" and node.name in fixed:
            node.attr["shape"].shape.Clear()
            for d in fixed[node.name]:
                node.attr["shape"].shape.dim.add(size=d)
    found = []
    with GraphRunner(Analysis(model, signature)) as runner:
        ops = [op for op in runner.graph.get_operations()
               if "T" in op.node_def.attr and op.get_attr("T") == tf.float16 and _is_matrix(op)]
        sampled = _sample_shapes(runner, ops, feeds)
        for op in ops:
            dims = _matrix_dims(op, lambda t: sampled.get(t.name, _static(t)))
            if dims is None:
                log.info("%s: input shapes unknown, alignment not checked", op.name)
                continue
            bad = {k: v for k, v in dims.items() if v is not None and v % 8}
            if bad:
                found.append({"node": op.name, "op": op.type, "dims": dims, "not_multiple_of_8": bad})
    return found


def _sample_shapes(runner: GraphRunner, ops, feeds) -> dict[str, list[int]]:
    """Shapes of matrix-op inputs that shape inference left open, from one run on ``feeds``
    (where fetchable)."""
    wanted = sorted({t.name for op in ops for t in op.inputs[:2] if not t.shape.is_fully_defined()}
                    & set(runner.analysis.fetchable()))
    if not wanted:
        return {}
    values = runner.fetch(feeds, wanted)
    return {name: list(v.shape) for name, v in zip(wanted, values)}


def _is_matrix(op) -> bool:
    return op.type == "MatMul" or op.type.startswith("BatchMatMul") or op.type in _CHANNEL_FILTER_OPS


def _static(t):
    return t.shape.as_list() if t.shape.rank is not None else None


def _matrix_dims(op, shape=_static) -> dict | None:
    """The dimensions the alignment check looks at, by letter; None for other ops."""
    if op.type == "MatMul":
        a, b = shape(op.inputs[0]), shape(op.inputs[1])
        if a is None or b is None:
            return None
        k = a[0] if op.get_attr("transpose_a") else a[1]
        n = b[0] if op.get_attr("transpose_b") else b[1]
        return {"K": k, "N": n}
    if op.type.startswith("BatchMatMul"):
        a, b = shape(op.inputs[0]), shape(op.inputs[1])
        if a is None or b is None:
            return None
        k = a[-2] if op.get_attr("adj_x") else a[-1]
        n = b[-2] if op.get_attr("adj_y") else b[-1]
        return {"K": k, "N": n}
    if op.type in _CHANNEL_FILTER_OPS:
        f = shape(op.inputs[_CHANNEL_FILTER_OPS[op.type]])
        if f is None:
            return None
        if op.type == "DepthwiseConv2dNative":
            return {"C": f[-2]}
        return {"C": f[-2], "K": f[-1]}
    return None


# -- command line ------------------------------------------------------------------------------

def kernel_report(path, *, device: str = "auto", shapes: Mapping | None = None,
                  inputs: str | None = None, signature: str | None = None) -> KernelReport:
    """Run ``path`` once and report its matrix kernels, plus the float16 alignment check."""
    if device != "cpu":
        gpus = tf.config.list_physical_devices("GPU")
        if device == "gpu" and not gpus:
            raise InputError("--device gpu: TensorFlow sees no GPU on this machine")
        device = "gpu" if gpus else "cpu"
    if device == "gpu":
        report = gpu_kernels(path, shapes=shapes, inputs=inputs, signature=signature)
    else:
        report = onednn_kernels(path, shapes=shapes, inputs=inputs, signature=signature)
    if not Path(path).is_dir():
        report.misaligned = misaligned_dims(path, shapes=shapes, signature=signature,
                                            inputs=inputs)
    return report


def format_report(report: KernelReport) -> str:
    lines = [f"ran once on {report.device}" + (f" ({report.runtime})" if report.runtime else "")]
    if not report.kernels:
        lines.append("no matrix kernel was seen (see the warning above)")
    for g in report.groups():
        unit = ("not on a 16-bit unit" if not g["sixteen_bit"] else
                "16-bit unit, float32 math" if g["mac"] == "f32" else "16-bit matrix unit")
        macs = f"{g['macs'] / 1e6:.2f}M MACs" if g["macs"] else "size unknown"
        lines.append(f"  {g['count']:>3} x {g['kind']:<13} {g['implementation']:<32} "
                     f"{g['dtype'] or '-':<5} {macs:<16} {unit}")
    if report.share is not None:
        lines.append(_share_line(report))
    if report.misaligned:
        lines.append("float16 Tensor Core alignment: dimensions not a multiple of 8:")
        for m in report.misaligned:
            dims = ", ".join(f"{k}={v}" for k, v in m["not_multiple_of_8"].items())
            lines.append(f"  {m['node']} ({m['op']}): {dims}")
    return "\n".join(lines)


def _share_line(report: KernelReport) -> str:
    """The headline: the share of the work on 16-bit units and, where the CPU converted some
    of it to float32 to multiply it (float16 on AVX512-FP16 without AMX-FP16, AVX-NE-CONVERT),
    how much and on which ISAs."""
    on = sum(1 for k in report.kernels if k.sixteen_bit)
    line = (f"MatMul/Conv work on 16-bit units: {100 * report.share:.1f}% "
            f"({on} of {len(report.kernels)} kernels)")
    if report.float32_math_share:
        where = sorted({f"{k.dtype} on {isa_of(k.implementation)}" for k in report.kernels
                        if k.sixteen_bit and k.mac == "f32"})
        line += (f"; {100 * report.float32_math_share:.1f}% of the work is 16-bit data the CPU "
                 f"converts and multiplies in float32 ({', '.join(where)}: oneDNN has no "
                 "16-bit multiply for it there)")
    return line


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
