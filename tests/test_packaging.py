"""What a user installs holds the whole package: every module and rule file of the checkout is
in the sdist and in the wheel built from it, under one version.

The suite itself runs on an editable install, whose finder maps the source folders whatever
the package list says: a subpackage missing from the wheel passed every test once. This builds
the real artefacts (sdist, then the wheel from the sdist, as ``pip install`` of a release does)
from a copy of the checkout and compares file lists. ``.ci/run`` also installs the wheel in a
fresh environment and runs the package from outside the checkout.
"""

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from amp_rewrite.version import __version__

ROOT = Path(__file__).resolve().parent.parent
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")


def _package_files() -> set[str]:
    """The files a wheel must hold, as their paths inside it."""
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "amp_rewrite").rglob("*.py")}
    rules = {"amp_rewrite/rules/defaults/" + str(p.relative_to(ROOT / "rules"))
             for p in (ROOT / "rules").rglob("*") if p.suffix in (".toml", ".py")}
    return modules | rules


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    """The sdist and wheel ``python -m build`` makes from a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, src / name)
    for folder in ("amp_rewrite", "rules"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # no isolation: the test environment has the build requirements (the [test] extra), and
    # CI's network-isolated build of the same files is checked by .ci/run
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                           str(tmp / "dist"), str(src)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    (wheel,) = (tmp / "dist").glob("*.whl")
    return sdist, wheel


def test_the_wheel_holds_every_module_and_rule_file(artefacts):
    _, wheel = artefacts
    with zipfile.ZipFile(wheel) as zf:
        held = {n for n in zf.namelist() if not n.split("/")[0].endswith(".dist-info")}
    want = _package_files()
    assert any(name.startswith("amp_rewrite/paint/") for name in want)   # subpackages exist
    assert want - held == set(), "files the wheel lacks"
    assert held - want == set(), "files the wheel holds that the checkout does not"


def test_the_sdist_holds_every_module_and_rule_file(artefacts):
    sdist, _ = artefacts
    with tarfile.open(sdist) as tar:
        top = f"amp_rewrite-{__version__}/"
        held = {n[len(top):] for n in tar.getnames()}
    modules = {p for p in _package_files() if not p.startswith("amp_rewrite/rules/defaults/")}
    rules = {str(p.relative_to(ROOT)) for p in (ROOT / "rules").rglob("*.toml")}
    assert (modules | rules | {"setup.py", "pyproject.toml", "README.md"}) - held == set()


def test_one_version_everywhere(artefacts):
    sdist, wheel = artefacts
    assert f"-{__version__}-" in wheel.name and sdist.name.endswith(f"-{__version__}.tar.gz")
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"amp_rewrite-{__version__}.dist-info/METADATA").decode()
        entry = zf.read(f"amp_rewrite-{__version__}.dist-info/entry_points.txt").decode()
    assert re.search(rf"^Version: {re.escape(__version__)}$", meta, re.M)
    assert re.search(r"^amp-rewrite = amp_rewrite\.cli:console$", entry, re.M)
    for extra in ("test", "tensorboard"):
        assert re.search(rf"^Provides-Extra: {extra}$", meta, re.M)
    proc = subprocess.run([sys.executable, "-m", "amp_rewrite", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"amp-rewrite {__version__}")


def test_tensorflow_is_pinned_to_the_release_the_suite_runs():
    """pyproject admits only the TensorFlow release CI tests (README "Which TensorFlow")."""
    import tensorflow as tf
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"tensorflow~=(\d+)\.(\d+)\.0"', text)
    assert pin, "tensorflow is pinned with ~=MAJOR.MINOR.0"
    assert tuple(int(x) for x in tf.__version__.split(".")[:2]) == tuple(map(int, pin.groups()))
