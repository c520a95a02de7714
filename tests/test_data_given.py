"""The data the tools are given (issue 35): a corrupt file is the user's error, a non-finite
reference is said, an empty batch is refused. Through the command line, on the bundled example
CNN and its float16 conversion."""

import ast
from pathlib import Path

import numpy as np
import pytest

from refusals import run_cli

ROOT = Path(__file__).resolve().parent.parent
CNN = ROOT / "examples" / "cnn_fp32.pb"


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    from amp_rewrite import convert_file
    out = tmp_path_factory.mktemp("cnn") / "cnn_f16.pb"
    convert_file(CNN, out, target="float16")
    return out


def _corrupt_files(folder: Path) -> dict[str, Path]:
    np.savez(folder / "good.npz", images=np.zeros((4, 8, 8, 1), np.float32))
    data = (folder / "good.npz").read_bytes()
    files = {"truncated": data[: len(data) // 2], "png": b"\x89PNG\r\n\x1a\n" + bytes(64),
             "text": b"images,1,2,3\n", "empty": b""}
    out = {}
    for kind, content in files.items():
        (folder / f"{kind}.npz").write_bytes(content)
        out[kind] = folder / f"{kind}.npz"
    np.save(folder / "single.npy", np.zeros(3))
    out["npy"] = (folder / "single.npy").rename(folder / "single.npz")
    return out


def _commands(data: Path, f16: Path, out: Path) -> dict[str, list]:
    return {"convert --calibration": [CNN, "-o", out / "c.pb", "--calibration", data],
            "tune --inputs": ["tune", CNN, "-o", out / "t.pb", "--inputs", data],
            "ranges --inputs": ["ranges", CNN, "--inputs", data],
            "kernels --inputs": ["kernels", f16, "--inputs", data],
            "verify --inputs": ["verify", CNN, f16, "--inputs", data]}


@pytest.mark.parametrize("kind, says", [("truncated", "truncated or damaged"),
                                        ("png", "a PNG image"), ("text", "is text"),
                                        ("empty", "is empty"), ("npy", "single .npy array")])
def test_a_file_that_is_no_npz_archive_is_the_users_error(tmp_path, capsys, f16, kind, says):
    bad = _corrupt_files(tmp_path)[kind]
    before = bad.read_bytes()
    for command, argv in _commands(bad, f16, tmp_path).items():
        code, out, err = run_cli(capsys, argv)
        lines = [ln for ln in err.splitlines() if ln.startswith("amp-rewrite")]
        assert code == 2, (command, err)
        assert len(lines) == 1 and str(bad) in lines[0] and says in lines[0], (command, err)
        assert "internal error" not in err and "Traceback" not in err
    assert not any((tmp_path / name).exists() for name in ("c.pb", "t.pb"))
    assert bad.read_bytes() == before


def test_npz_files_are_read_in_one_place():
    """Every command reads its data through tools.runner.read_npz: np.load appears there
    alone."""
    found = []
    for path in (ROOT / "amp_rewrite").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "load" and \
                    isinstance(node.value, ast.Name) and node.value.id == "np":
                found.append(path.relative_to(ROOT).as_posix())
    assert found == ["amp_rewrite/tools/runner.py"]


def _nonfinite(folder: Path) -> dict[str, Path]:
    np.savez(folder / "nan.npz", images=np.full((4, 8, 8, 1), np.nan, np.float32))
    np.savez(folder / "huge.npz", images=np.full((4, 8, 8, 1), 3e38, np.float32))
    return {"nan": folder / "nan.npz", "huge": folder / "huge.npz"}


def test_a_nonfinite_reference_is_said_not_judged(tmp_path, capsys, f16):
    data = _nonfinite(tmp_path)
    # all-NaN inputs: every command that judges needs a finite float32 reference
    for command in ("convert --calibration", "tune --inputs"):
        code, _, err = run_cli(capsys, _commands(data["nan"], f16, tmp_path)[command])
        assert code == 2 and "input images:0 holds 256 of 256 value(s) as inf or NaN" in err, err
        assert "--allow-nonfinite-reference" in err
    # inputs near float32's largest value: the float32 model's own outputs are NaN
    code, out, err = run_cli(capsys, ["verify", CNN, f16, "--inputs", data["huge"]])
    assert code == 2, out + err
    assert "the float32 model itself gives 40 of 40 element(s) of output probabilities:0 as " \
           "inf or NaN" in err and "FAIL" not in out
    # asked to compare anyway: judged, and a NaN on both sides agrees
    code, out, err = run_cli(capsys, ["verify", CNN, f16, "--inputs", data["huge"],
                                      "--allow-nonfinite-reference"])
    assert code in (0, 1) and "inf/NaN in float32 itself" in out, out + err
    assert not (tmp_path / "c.pb").exists() and not (tmp_path / "t.pb").exists()


def test_a_batch_of_zero_is_refused(tmp_path, capsys, f16):
    for argv in ([CNN, "-o", tmp_path / "c.pb", "--target", "bfloat16", "--device", "cpu",
                  "--shape", "images=0,8,8,1"],
                 ["verify", CNN, f16, "--shape", "images=0,8,8,1"],
                 ["bench", CNN, f16, "--shape", "images=0,8,8,1"]):
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and "a dimension of 0 makes an empty tensor" in err, err
    assert not (tmp_path / "c.pb").exists()
