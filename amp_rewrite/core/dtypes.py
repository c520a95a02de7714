"""Dtypes as TensorFlow's ``types_pb2.DataType`` enums (never strings), and the names they print.

The dtypes a precision rewrite moves between are float32 and the two 16-bit targets; TensorFlow
names them ``float``, ``half`` and ``bfloat16``, users ``float16`` and ``bfloat16``.
"""

from __future__ import annotations

import functools

from tensorflow.core.framework import types_pb2

FLOAT = types_pb2.DT_FLOAT
HALF = types_pb2.DT_HALF
BFLOAT16 = types_pb2.DT_BFLOAT16
DOUBLE = types_pb2.DT_DOUBLE
BOOL = types_pb2.DT_BOOL
INT32 = types_pb2.DT_INT32
INT64 = types_pb2.DT_INT64
RESOURCE = types_pb2.DT_RESOURCE
VARIANT = types_pb2.DT_VARIANT
INVALID = types_pb2.DT_INVALID

#: the 16-bit targets
LOW_PRECISION = (HALF, BFLOAT16)
#: what a conversion moves between: a cast is inserted only between two of these
CONVERTIBLE = (FLOAT, HALF, BFLOAT16)
#: every floating dtype a model's outputs may have (verify compares these)
FLOATING = (FLOAT, HALF, BFLOAT16, DOUBLE)

#: the user's name of each target
TARGETS = {"float16": HALF, "bfloat16": BFLOAT16}
TARGET_NAMES = {dtype: name for name, dtype in TARGETS.items()}
#: what a conversion can be for: a 16-bit target, or float32 (a model that computes in 16 bits
#: moved back whole: docs/convert.md "Converting a converted model")
CONVERSION_TARGETS = (*TARGETS, "float32")

_REF_OFFSET = 100  # DT_FLOAT_REF == DT_FLOAT + 100 in types.proto


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: int) -> str:
    """``DT_HALF`` -> ``"half"``: the short name TensorFlow prints (``"dtype 34"`` for a value
    no DataType has: a damaged file names what it holds, the message does not crash)."""
    try:
        return types_pb2.DataType.Name(dtype)[3:].lower()
    except ValueError:
        return f"dtype {dtype}"


def base_dtype(dtype: int) -> int:
    """Strip the reference flag: ``DT_FLOAT_REF`` -> ``DT_FLOAT``."""
    return dtype - _REF_OFFSET if dtype > _REF_OFFSET else dtype


#: the largest finite value of each 16-bit target: a float32 value past it becomes ±inf there
LARGEST = {HALF: 65504.0, BFLOAT16: 3.3895313892515355e38}
#: the default safety factor of range-aware precision (``--headroom``): a tensor whose observed
#: magnitude reaches ``LARGEST[target] / HEADROOM`` stays float32 (float16: 2047). The smallest
#: power of two above every spread measured between a calibration batch's maximum and that of
#: up to 1024 later batches, heavy-tailed data included (26.2; BENCHMARKS.md "Range headroom",
#: docs/ranges.md "Why the headroom is 32"); kept here so convert, ranges and tune agree.
HEADROOM = 32.0


def near_limit(max_abs: float, target: int, headroom: float = HEADROOM) -> bool:
    """Whether a tensor whose largest observed magnitude is ``max_abs`` comes within
    ``headroom`` of ``target``'s largest finite value (a non-finite maximum always does)."""
    return not max_abs < LARGEST[target] / headroom


#: the smallest positive normal value of each 16-bit target: below it a value keeps fewer
#: significant bits (a subnormal)
SMALLEST_NORMAL = {HALF: 2.0 ** -14, BFLOAT16: 2.0 ** -126}
#: the smallest positive subnormal of each 16-bit target: a magnitude at or below half of it
#: rounds to zero there (float16 2**-25, bfloat16 2**-134; TensorFlow's casts keep subnormals)
SMALLEST_SUBNORMAL = {HALF: 2.0 ** -24, BFLOAT16: 2.0 ** -133}


def held(node_def) -> set[int]:
    """The dtypes a NodeDef's attrs hold: its type attrs and type-list attrs, whatever their
    names (``T``, ``DstT``, ``Tin`` ...)."""
    out: set[int] = set()
    for value in node_def.attr.values():
        kind = value.WhichOneof("value")
        if kind == "type":
            out.add(value.type)
        elif kind == "list":
            out.update(value.list.type)
    return out
