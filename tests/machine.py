"""Skip markers for tests that need something of this machine's CPU or TensorFlow's set-up.

A test never fails for the machine's sake: it sets what TensorFlow needs (conftest.py turns
oneDNN on) or skips with the reason.
"""

import pytest

from amp_rewrite.core import hardware

needs_onednn = pytest.mark.skipif(
    not hardware.onednn_enabled(),
    reason="TensorFlow's oneDNN ops are off in this process (TF_ENABLE_ONEDNN_OPTS=0 was set, "
           "or TensorFlow was built without oneDNN): grappler's bfloat16 pass and oneDNN's "
           "kernel log need them")

needs_bf16_units = pytest.mark.skipif(
    hardware.bf16_matrix_unit() is None,
    reason="this CPU has neither AMX-BF16 nor AVX512-BF16, so oneDNN has no bfloat16 matrix "
           "unit to use")

#: TensorFlow's float16 CPU kernels are oneDNN's here (AVX512-FP16 or AMX-FP16 with AVX512-BW,
#: and oneDNN on), not Eigen's: they round and accumulate their own way, so a comparison of
#: their numbers with float16's float32 emulation digit by digit holds only on other CPUs
onednn_float16 = hardware.fp16_matrix_unit() is not None and hardware.onednn_enabled()
