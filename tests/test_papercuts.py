"""Issue 37 item 4, the papercuts: each as a user meets it, through the command line (exit code
and message) or the Python API, on real models (the bundled example CNN, small Keras models)."""

import subprocess
import sys
from pathlib import Path

import pytest

from amp_rewrite.cli.run import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cnn_fp32.pb"
AMP = str(Path(sys.executable).parent / "amp-rewrite")


def _usage_error(argv, capsys) -> str:
    """The one line a usage error prints (exit 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.count("\n") == 1, err
    return err.strip()


# ----------------------------------------------------------------- the command line
@pytest.mark.fast
@pytest.mark.parametrize("argv, closest", [
    ([str(EXAMPLE), "-o", "x.pb", "--targt", "bfloat16"], "--target"),
    ([str(EXAMPLE), "-o", "x.pb", "--targt=bfloat16"], "--target"),
    ([str(EXAMPLE), "-o", "x.pb", "--fold-constant", "--lowpio"], "--lowp-io"),   # (a prefix is fine)
    (["verify", "a.pb", "b.pb", "--samles", "4"], "--samples"),
    (["kernels", "m.pb", "--devise", "cpu"], "--device"),
])
def test_a_misspelled_flag_names_the_closest_one(argv, closest, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = _usage_error(argv, capsys)
    assert said.startswith("amp-rewrite") and "error: unrecognized arguments: " in said
    assert said.endswith(f"; did you mean {closest}?")


@pytest.mark.fast
def test_an_unknown_flag_with_nothing_close_gets_no_guess(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = _usage_error([str(EXAMPLE), "-o", "x.pb", "--zzzzz", "-5"], capsys)
    assert said == "amp-rewrite: error: unrecognized arguments: --zzzzz -5"


def test_convert_is_a_command_word_as_its_help_says(tmp_path, capsys, monkeypatch):
    out = tmp_path / "x.pb"
    assert main(["convert", str(EXAMPLE), "-o", str(out)]) == 0
    assert out.is_file() and "4/4 MatMul/Conv-family ops in float16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["-h"])
    assert "'amp-rewrite convert IN -o OUT' says the same" in " ".join(capsys.readouterr().out.split())
    # a file named convert is still a model to convert
    monkeypatch.chdir(tmp_path)
    Path("convert").write_bytes(EXAMPLE.read_bytes())
    assert main(["convert", "-o", "y.pb", "-q"]) == 0 and Path("y.pb").is_file()


@pytest.mark.fast
def test_a_first_word_that_is_no_file_and_no_command_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = _usage_error(["frobnicate", "x"], capsys)
    assert said.startswith("amp-rewrite: error: no file 'frobnicate' and no command of that name")
    assert "commands: bench, convert, explain, kernels, ranges, rules, tune, verify" in said
    assert "-o" not in said.partition("(")[0]       # not "-o/--output is required"
    said = _usage_error(["convrt", "m.pb", "-o", "x.pb"], capsys)
    assert "did you mean 'amp-rewrite convert'?" in said
    # what looks like a path goes on to the usual checks
    assert main(["frob.pb", "-o", "x.pb"]) == 2
    assert capsys.readouterr().err == "amp-rewrite: error: frob.pb: no such file\n"
