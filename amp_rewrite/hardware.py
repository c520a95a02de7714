"""What this machine's CPU, and TensorFlow on it, can do with 16-bit matrix work.

Three kinds of x86 CPU run this project, and TensorFlow treats them differently:

* AMX-BF16 (Sapphire Rapids and later): oneDNN runs bfloat16 MatMul/Conv on tile units;
* AVX512-BF16 (Cooper Lake, Zen 4 and later): oneDNN runs them with ``vdpbf16ps``;
* AVX2 only: no 16-bit matrix unit; bfloat16 runs slower than float32. TensorFlow also leaves
  its oneDNN ops off there by default (it turns them on only for CPUs with AVX512-VNNI,
  AVX512-BF16, AVX-VNNI or AMX), and with them grappler's bfloat16 AMP pass, unless
  ``TF_ENABLE_ONEDNN_OPTS=1`` is set before TensorFlow starts.

Nothing here imports TensorFlow at module level; :func:`onednn_enabled` asks the running one.
"""

from __future__ import annotations

import functools
from pathlib import Path

# the CPU flags (as /proc/cpuinfo names them) behind each 16-bit matrix path oneDNN takes
BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")
FP16_MATRIX_FLAGS = ("amx_fp16", "avx512_fp16")
# TensorFlow's DefaultOneDnnPolicy on Linux x86: oneDNN ops are on by default with any of these
ONEDNN_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_matrix_unit() -> str | None:
    """``"amx_bf16"`` or ``"avx512_bf16"``: the CPU's bfloat16 matrix unit, or None."""
    return next((f for f in BF16_MATRIX_FLAGS if f in cpu_flags()), None)


def onednn_on_by_default() -> bool:
    """Whether TensorFlow turns its oneDNN ops on without ``TF_ENABLE_ONEDNN_OPTS`` on this CPU."""
    return any(f in cpu_flags() for f in ONEDNN_DEFAULT_FLAGS)


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN ops (and grappler's bfloat16 AMP pass) are on in this process.

    TensorFlow decides once per process, from the CPU and ``TF_ENABLE_ONEDNN_OPTS``.
    """
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())


def describe() -> str:
    """One line for reports and benchmark tables: the CPU's 16-bit matrix support."""
    unit = bf16_matrix_unit()
    if unit == "amx_bf16":
        return "AMX-BF16"
    if unit == "avx512_bf16":
        return "AVX512-BF16, no AMX"
    if "avx512f" in cpu_flags():
        return "AVX-512 without BF16"
    return "AVX2 only" if "avx2" in cpu_flags() else "no AVX2"
