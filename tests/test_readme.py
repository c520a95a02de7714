"""The README's first command works from a shell on the bundled example, and the example is what
its script makes (tests/test_docs.py runs every other block of the README and of docs/)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from amp_rewrite.cli.run import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_bundled_example_is_reproducible():
    sys.path.insert(0, str(ROOT / "examples"))
    import make_example
    built = make_example.build().SerializeToString(deterministic=True)
    assert built == (ROOT / "examples" / "cnn_fp32.pb").read_bytes()
    assert len(built) < 1_000_000


@pytest.mark.parametrize("extra", [[], ["--target", "bfloat16", "--device", "cpu",
                                         "--min-matrix-intensity", "0"]])
def test_convert_command_on_bundled_example(tmp_path, capsys, extra):
    out = tmp_path / "cnn_amp.pb"
    report = tmp_path / "r.json"
    assert main([str(ROOT / "examples" / "cnn_fp32.pb"), "-o", str(out), "--report", str(report)]
                + extra) == 0
    printed = capsys.readouterr().out
    assert "4/4 MatMul/Conv-family ops" in printed
    assert out.stat().st_size < (ROOT / "examples" / "cnn_fp32.pb").stat().st_size
    import json
    data = json.loads(report.read_text())
    assert data["schema_version"] == 1 and data["summary"]["matrix_converted"] == 4
    assert {n["name"] for n in data["nodes"]} >= {"block1/conv", "head/fc2", "probabilities"}


def test_first_readme_command_works_from_a_shell(tmp_path):
    first = re.search(r"```bash\n(.*?)\n```", README, re.S).group(1)
    assert "examples/cnn_fp32.pb" in first
    convert = first.split("&&")[-1].strip().replace(".venv/bin/amp-rewrite", str(Path(sys.executable).parent / "amp-rewrite"))
    convert = convert.replace("/tmp/cnn_amp.pb", str(tmp_path / "cnn_amp.pb"))
    done = subprocess.run(convert, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # what it wrote is the example converted to float16 (the default target)
    from tensorflow.core.framework import graph_pb2, types_pb2
    written = graph_pb2.GraphDef.FromString((tmp_path / "cnn_amp.pb").read_bytes())
    matrix = [n for n in written.node if n.op in ("Conv2D", "MatMul")]
    assert len(matrix) == 4 and all(n.attr["T"].type == types_pb2.DT_HALF for n in matrix)
