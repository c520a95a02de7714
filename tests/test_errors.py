"""Our bugs apart from the user's: an internal error is never reported as bad input, never
swallowed as a warning, and the CLI says it is a bug in amp-rewrite, with an exit code of its own.

A bug is simulated by making one of our own functions raise (TensorFlow is never mocked).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_functions

from amp_rewrite import cli, convert
from amp_rewrite.cli import commands
from amp_rewrite.conversion import library
from amp_rewrite.core.errors import INPUT_EXIT, INTERNAL_EXIT, InputError, IRError, LintError

pytestmark = pytest.mark.fast

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"


def _raise(exc):
    def bug(*args, **kwargs):
        raise exc
    return bug


@pytest.mark.parametrize("exc", [IRError("no node named 'x'"), LintError(["edge a -> b carries half"]),
                                 KeyError("oops")])
def test_an_internal_error_is_one_line_exit_70_and_says_it_is_our_bug(exc, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(commands, "convert_path", _raise(exc))
    code = cli.main([str(EXAMPLE), "-o", str(tmp_path / "out.pb")])
    err = capsys.readouterr().err
    assert code == INTERNAL_EXIT != INPUT_EXIT and code != 1   # 1 is verify's "out of tolerance"
    assert len(err.strip().splitlines()) == 1 and "bug in amp-rewrite" in err
    assert "Traceback" not in err
    assert cli.main([str(EXAMPLE), "-o", str(tmp_path / "out.pb"), "-v"]) == INTERNAL_EXIT
    assert "Traceback" in capsys.readouterr().err


def test_bad_input_is_exit_2_and_not_called_a_bug(tmp_path, capsys):
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\x00not a graph")
    assert cli.main([str(bad), "-o", str(tmp_path / "out.pb")]) == INPUT_EXIT
    err = capsys.readouterr().err
    assert "bug" not in err and len(err.strip().splitlines()) == 1


def test_an_ir_error_in_a_function_body_is_not_turned_into_a_warning(monkeypatch):
    graph_def = test_functions.control_flow_graph()
    # a body our IR cannot take as input is left as it is, with a warning ...
    monkeypatch.setattr(library, "function_to_graph", _raise(InputError("not a body we take")))
    _, report = convert(graph_def, target="bfloat16", device="cpu")
    assert any("left as it is" in w for w in report.warnings)
    # ... but a misused IR primitive is our bug and stops the conversion
    monkeypatch.setattr(library, "function_to_graph", _raise(IRError("no node named 'x'")))
    with pytest.raises(IRError):
        convert(graph_def, target="bfloat16", device="cpu")


@pytest.mark.parametrize("argv", [
    ["missing.pb", "-o", "out.pb"],
    ["explain", "missing.pb", "node"],
    ["verify", "missing.pb", "missing_amp.pb"],
    ["bench", str(EXAMPLE), "missing_amp.pb"],
    ["kernels", "missing.pb"],
    ["rules", "show", "--rules", "missing.toml"],
    [str(EXAMPLE), "-o", "no/such/folder/out.pb"],
    ["verify", str(EXAMPLE), str(EXAMPLE), "--html", "no/such/folder/r.html"],
    ["--target", "float8", str(EXAMPLE), "-o", "out.pb"],
])
def test_usage_and_path_errors_answer_before_tensorflow_is_imported(argv, tmp_path):
    """TensorFlow takes seconds to import: a typo must not wait for it."""
    code = ("import sys; from amp_rewrite.cli import main; rc = main(sys.argv[1:]); "
            "print('tensorflow' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == INPUT_EXIT, proc.stderr
    assert proc.stdout.strip() in ("", "False"), "TensorFlow was imported before the error"
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_command_writes_everything_before_its_fast_exit(tmp_path):
    """``amp-rewrite`` ends without the interpreter's teardown (cli.console): the output file,
    the report and the summary must all be complete."""
    out, report = tmp_path / "out.pb", tmp_path / "report.json"
    argv = [sys.executable, "-m", "amp_rewrite", str(EXAMPLE), "-o", str(out), "--report", str(report)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}\n") and "casts added" in proc.stdout
    assert imports_in_tensorflow(out) and '"nodes"' in report.read_text()


@pytest.mark.parametrize("stdout", ["unbuffered", "block-buffered"])
def test_a_closed_pipe_exits_141_and_is_not_a_bug(stdout, tmp_path):
    """A reader that went away (``| head``) gets exit 141, as a shell reports SIGPIPE, and no
    "internal error", however Python buffers stdout: unbuffered (``PYTHONUNBUFFERED``, ``-u``)
    or block-buffered, as it is into a pipe by default. The read end is closed before the
    command starts, so every write it makes meets the closed pipe."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if stdout == "unbuffered":
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "amp_rewrite", str(EXAMPLE), "-o",
                               str(tmp_path / "out.pb")], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=300)
    finally:
        os.close(write)
    assert "internal error" not in proc.stderr
    assert proc.returncode == 141, proc.stderr
    assert imports_in_tensorflow(tmp_path / "out.pb")   # written before the summary was printed


def imports_in_tensorflow(path: Path) -> bool:
    """Whether ``path`` holds a GraphDef TensorFlow imports."""
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef.FromString(path.read_bytes())
    with tf.Graph().as_default():
        tf.compat.v1.import_graph_def(gd, name="")
    return len(gd.node) > 0
