"""The converter's decisions and output bytes stay those recorded in tests/golden.json.

Guards refactors: every graph the tests build (and the bundled example) is converted in a fresh
process and compared with the recording (see tests/golden.py for how to rewrite it when a change
is meant to change decisions).
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_conversions_match_the_golden_recording():
    proc = subprocess.run([sys.executable, str(HERE / "golden.py"), "check"], capture_output=True,
                          text=True, timeout=900)
    differing = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0, "\n".join(differing[-40:]) + proc.stderr[-2000:]
