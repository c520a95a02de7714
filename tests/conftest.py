import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Grappler's bfloat16 AMP pass, which the parity tests compare against, and oneDNN's kernel log,
# which the kernels tests read, run only where TensorFlow's oneDNN ops are on. TensorFlow turns
# them on by default only on CPUs with AVX512-VNNI/AVX512-BF16/AMX, and decides once per
# process, so AVX2-only machines need the switch before TensorFlow is imported. A value the
# user set wins; tests that need oneDNN then skip, saying why (tests/machine.py).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# grappler's variables would change the default rules under the tests' feet
for var in list(os.environ):
    if var.startswith("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"):
        del os.environ[var]

# the cost model's measured tables are looked for in a folder of the suite's own, empty: no test
# reads the user's (amp_rewrite.rules.cost_table.DIR_VARIABLE); a test of a measured table
# points the variable at its own tmp_path
_NO_MEASURED_COSTS = tempfile.TemporaryDirectory(prefix="amp-rewrite-test-costs-")
os.environ["AMP_REWRITE_COSTS_DIR"] = _NO_MEASURED_COSTS.name

# conversions weigh with the shipped cost table of this CPU's class (amp_rewrite.core.hardware
# .cpu_class); the suite's expectations are the AVX512-BF16 table's on every machine, AVX2 and
# AMX hosts included: the tests of the class choice set the variable themselves
os.environ["AMP_REWRITE_CPU_CLASS"] = "avx512-bf16"

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _package_logger_as_at_import():
    """The CLI's main() gives the package logger its own stderr handler and stops propagation
    (amp_rewrite.cli.run._setup_logging): after a test that ran it in-process, caplog, which
    listens at the root, would hear nothing. Each test starts with the logger as imported."""
    logger = logging.getLogger("amp_rewrite")
    yield
    logger.handlers[:] = []
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
