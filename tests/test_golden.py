"""The converter's decisions and output bytes stay those recorded in tests/golden.json, and
every golden case still does what it is meant to (paints, or stays float32).

Guards refactors: every graph the tests build (and the bundled example) is converted in a fresh
process and compared with the recording (see tests/golden.py for how to rewrite it when a change
is meant to change decisions).
"""

import json
import subprocess
import sys
from pathlib import Path

import golden
import graphs

HERE = Path(__file__).resolve().parent


def test_conversions_match_the_golden_recording():
    proc = subprocess.run([sys.executable, str(HERE / "golden.py"), "check"], capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    # the differences come first, a case then its nodes; the count line last
    shown = lines[:80] + (["..."] if len(lines) > 81 else []) + lines[-1:]
    assert proc.returncode == 0, "\n".join(shown) + proc.stderr[-2000:]


def test_a_case_that_stops_painting_breaks_its_promise_and_its_diff_names_the_nodes(tmp_path):
    """The guard itself, on real conversions of one graph: at the cost model's default the MLP
    stays float32 (its output is its input), at intensity 0 it paints. Each run keeps the
    promise it makes and breaks the other's, and their diff says which node moved how."""
    path = golden._write_graph_def(tmp_path, "mlp", graphs.mlp()[0])
    painted, changed = golden.run_case(path, golden.BF16, tmp_path, "painted")
    kept, kept_changed = golden.run_case(path, golden.BF16_COSTED, tmp_path, "kept")
    assert changed is True and kept_changed is False
    assert golden.broken_promise(painted, changed, golden.PAINTS) is None
    assert golden.broken_promise(kept, kept_changed, golden.FLOAT32) is None
    assert golden.broken_promise(kept, kept_changed, golden.PAINTS)
    assert golden.broken_promise(painted, changed, golden.FLOAT32)
    assert golden.broken_promise(painted, changed, golden.SCALED_ONLY)

    lines = golden.case_diff(painted, kept)
    assert "logits: bfloat16 allow_list -> float32 cost" in lines
    assert "w1: bfloat16 const_converted -> float32 not_listed" in lines
    assert not any(line.startswith(("x:", "probs:")) for line in lines)   # interface: unmoved
    # what write records reads back as what was run
    assert json.loads(golden.dumps({"painted": painted, "kept": kept})) == {
        "painted": painted, "kept": kept}
