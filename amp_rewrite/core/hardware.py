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
import os
from pathlib import Path

# the CPU flags (as /proc/cpuinfo names them) behind each 16-bit matrix path oneDNN takes
BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")
FP16_MATRIX_FLAGS = ("amx_fp16", "avx512_fp16")
# TensorFlow's DefaultOneDnnPolicy on Linux x86: oneDNN ops are on by default with any of these
ONEDNN_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


@functools.lru_cache(maxsize=None)
def _cpuinfo(field: str) -> str | None:
    """The value of ``field`` on the first processor of ``/proc/cpuinfo`` (None: not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == field:
            return value.strip()
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``."""
    return _cpuinfo("model name") or "unknown CPU"


def machine_line(target: str | None = None, flags: frozenset[str] | None = None,
                 model: str | None = None) -> str:
    """The CPU line of ``verify``, ``kernels`` and ``bench`` (and of ``convert`` where TensorFlow
    sees no GPU): the CPU, its 16-bit matrix units and, for a model in ``target``
    (``"float16"``, ``"bfloat16"``; None: float32), what that target means on it
    (:func:`target_note`), since what a converted model gains depends on them. ``flags`` and
    ``model`` describe another CPU (default this one's)."""
    flags = cpu_flags() if flags is None else flags
    units = [_unit_name(flag) for flag in BF16_MATRIX_FLAGS + FP16_MATRIX_FLAGS if flag in flags]
    note = target_note(target, flags)
    if units:
        held = ", ".join(units) + (f"; {note}" if note else "")
    else:
        held = "none: " + (note or "bfloat16 and float16 matrix work runs slower than float32 "
                                   "on this CPU")
    return f"CPU: {model or cpu_model()}; 16-bit matrix units: {held}"


def target_note(target: str | None, flags: frozenset[str] | None = None) -> str:
    """What a model in ``target`` does on a CPU with ``flags`` (default this one's); empty for
    float32 (None).

    float16 runs through oneDNN only where TensorFlow lets it (AVX512-BW with AVX512-FP16 or
    AMX-FP16, :data:`FP16_MATRIX_FLAGS`); elsewhere TensorFlow's float16 CPU kernels are Eigen's
    (slower than float32, and it logs "oneDNN supports DT_HALF only on platforms with
    AVX-512"), so such a model checks numbers only here, and bfloat16 is the target that runs
    faster where the CPU has a bfloat16 unit. bfloat16 names the unit that runs it, or that
    there is none (then it runs slower than float32)."""
    flags = cpu_flags() if flags is None else flags
    bf16 = next((_unit_name(f) for f in BF16_MATRIX_FLAGS if f in flags), None)
    fp16 = next((_unit_name(f) for f in FP16_MATRIX_FLAGS if f in flags), None)
    if target == "float16":
        if fp16 and "avx512bw" in flags:
            text = f"float16 runs on {fp16} here (oneDNN)"
            if bf16 == "AMX-BF16" and fp16 != "AMX-FP16":
                text += "; --target bfloat16 --device cpu runs on AMX-BF16, faster"
            return text
        text = ("float16 on this CPU checks numbers only (TensorFlow's float16 CPU kernels are "
                "slow)")
        if bf16:
            return text + f"; --target bfloat16 --device cpu runs faster here (on {bf16})"
        return text + ("; no bfloat16 matrix unit either (AMX-BF16 or AVX512-BF16): float32 "
                       "runs fastest on this CPU")
    if target == "bfloat16":
        if bf16:
            return f"bfloat16 runs on {bf16} here (oneDNN)"
        return ("bfloat16 has no matrix unit on this CPU (AMX-BF16 or AVX512-BF16): it runs "
                "slower than float32 here, and is for CPUs that have one")
    return ""


def _unit_name(flag: str) -> str:
    return flag.upper().replace("_", "-")   # amx_bf16 -> AMX-BF16


def bf16_matrix_unit() -> str | None:
    """``"amx_bf16"`` or ``"avx512_bf16"``: the CPU's bfloat16 matrix unit, or None."""
    return next((f for f in BF16_MATRIX_FLAGS if f in cpu_flags()), None)


#: the CPU classes whose bfloat16 costs differ (a shipped cost table each): a CPU with AMX
#: tiles, one with AVX512-BF16 and no AMX, and one with no bfloat16 matrix unit (AVX2 only, or
#: AVX-512 without BF16), where bfloat16 matrix work runs slower than float32
CPU_CLASSES = ("amx-bf16", "avx512-bf16", "avx2")
#: the environment variable that names the class conversions take this CPU for (tests pin it)
CLASS_VARIABLE = "AMP_REWRITE_CPU_CLASS"


def cpu_class(flags: frozenset[str] | None = None) -> str:
    """This CPU's class (one of :data:`CPU_CLASSES`) by its flags (``flags``: another CPU's),
    or ``$AMP_REWRITE_CPU_CLASS`` where it names one."""
    given = os.environ.get(CLASS_VARIABLE) if flags is None else None
    if given in CPU_CLASSES:
        return given
    unit = next((f for f in BF16_MATRIX_FLAGS if f in (cpu_flags() if flags is None else flags)),
                None)
    return {"amx_bf16": "amx-bf16", "avx512_bf16": "avx512-bf16"}.get(unit, "avx2")


def fp16_matrix_unit() -> str | None:
    """``"amx_fp16"`` or ``"avx512_fp16"`` where TensorFlow runs float16 through oneDNN on it
    (with AVX512-BW, :func:`target_note`), else None: Eigen's float16 CPU kernels then."""
    flags = cpu_flags()
    return next((f for f in FP16_MATRIX_FLAGS if f in flags), None) if "avx512bw" in flags else None


def onednn_on_by_default() -> bool:
    """Whether TensorFlow turns its oneDNN ops on without ``TF_ENABLE_ONEDNN_OPTS`` on this CPU."""
    return any(f in cpu_flags() for f in ONEDNN_DEFAULT_FLAGS)


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU in this process (models then run there, not on the CPU)."""
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN ops (and grappler's bfloat16 AMP pass) are on in this process.

    TensorFlow decides once per process, from the CPU and ``TF_ENABLE_ONEDNN_OPTS``.
    """
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())


def describe() -> str:
    """One line for reports and benchmark tables: the CPU's model and its 16-bit matrix support."""
    unit = bf16_matrix_unit()
    if unit == "amx_bf16":
        support = "AMX-BF16"
    elif unit == "avx512_bf16":
        support = "AVX512-BF16, no AMX"
    elif "avx512f" in cpu_flags():
        support = "AVX-512 without BF16"
    else:
        support = "AVX2 only" if "avx2" in cpu_flags() else "no AVX2"
    return f"{cpu_model()}: {support}"
