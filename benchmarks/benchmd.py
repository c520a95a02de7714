"""BENCHMARKS.md holds one section per benchmark script; each script replaces only its own.

Every table says when and where it was measured (:func:`provenance`): the date, the CPU's model
and its 16-bit matrix flags, whether other jobs shared the machine, the command that wrote it
and the commit it ran at, so a figure is never read without its CPU and its code.

A script whose section is rendered from what it measured keeps that in the repository:
:func:`save_results` writes ``benchmarks/results/NAME.json`` (with the commit), and
tests/test_docs.py renders the section again from it and holds BENCHMARKS.md to the result
(``RENDERED`` there lists the sections that do)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
ROOT = BENCHMARKS.parent
RESULTS = ROOT / "benchmarks" / "results"
# the CPU flags a bfloat16/float16 table depends on, in the order they are named
UNIT_FLAGS = ("amx_bf16", "avx512_bf16", "avx512_fp16")


def _relative(path: str) -> str:
    """``path`` from the repository root if it lies inside it (symlinks not followed: a
    venv's python stays the venv's)."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(ROOT))
    except ValueError:
        return path


def command(argv: list[str] | None = None, prefix: str = "") -> str:
    """The command line that ran this script, as a reader at the repository root retypes it."""
    argv = sys.argv if argv is None else argv
    return prefix + " ".join([_relative(sys.executable), _relative(argv[0]),
                              *map(shlex.quote, argv[1:])])


def cpu() -> str:
    """The CPU's model and which of its 16-bit matrix flags it has and lacks."""
    from amp_rewrite.core import hardware
    flags = hardware.cpu_flags()
    has = [f for f in UNIT_FLAGS if f in flags]
    lacks = [f"no {f}" for f in UNIT_FLAGS[:2] if f not in flags]
    return f"{hardware.cpu_model()} ({', '.join(has + lacks)})"


def commit() -> str:
    """The commit the checkout is at (12 hex digits), with ``+changes`` where tracked files
    differ from it; ``unknown`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def provenance(argv: list[str] | None = None, prefix: str = "", shared: bool = True) -> str:
    """One sentence for under a table's heading: date, CPU and flags, cores and whether other
    jobs shared them (with the load average when the script started), TensorFlow and Python,
    the command that wrote the table and the commit it ran at (:func:`commit`)."""
    import tensorflow as tf
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    where = (f"{os.cpu_count()} cores shared with other jobs (load average {load:.1f} as it started)"
             if shared else f"{os.cpu_count()} cores, no other jobs")
    return (f"Measured {datetime.date.today().isoformat()} on {cpu()}, {where}; TensorFlow "
            f"{tf.__version__}, Python {platform.python_version()}. Written by "
            f"`{command(argv, prefix)}` at commit `{commit()}`.")


def results_path(name: str) -> Path:
    """Where a script keeps what it measured for its section: ``benchmarks/results/NAME.json``."""
    return RESULTS / f"{name}.json"


def save_results(name: str, result: dict) -> Path:
    """Write ``result`` (with the commit it ran at, if it lacks one) to :func:`results_path`,
    the file tests/test_docs.py renders the script's section from; returns the path."""
    path = results_path(name)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"commit": commit(), **result}, indent=1) + "\n")
    return path


def write_section(text: str, path: Path = BENCHMARKS) -> None:
    """Replace the section whose heading is ``text``'s first line (append it if new)."""
    heading = text.splitlines()[0].strip()
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(heading + "\n")
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
        return
    end = old.find("\n## ", start + len(heading))
    rest = old[end + 1:] if end >= 0 else ""
    path.write_text(old[:start] + text.rstrip("\n") + "\n" + ("\n" + rest if rest else ""))


def publish(text: str, write: bool) -> int:
    """Print a benchmark's section; with ``write`` (``--write``) also put it in BENCHMARKS.md.
    Returns the exit code."""
    print(text)
    if write:
        write_section(text)
    return 0
