"""Helpers for the reliability tests: run the CLI, snapshot a folder, drop root's file powers.

A refusal is checked the same way everywhere: exit code 2, one line on stderr naming the file,
no traceback, and the folder holding the input byte for byte as it was (nothing written, no
temporary file left behind, the input unchanged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from amp_rewrite import cli

AMP_REWRITE = str(Path(sys.executable).with_name("amp-rewrite"))


def snapshot(folder: Path) -> dict[str, object]:
    """Relative path -> sha256 (or ``<dir>``) of everything under ``folder``.

    Files over 64 MiB (the sparse "over 2 GiB" input) are identified by size and mtime instead.
    """
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        st = p.stat()
        if p.is_dir():
            out[str(p.relative_to(folder))] = "<dir>"
        elif not p.is_file():  # a named pipe: reading it would block
            out[str(p.relative_to(folder))] = ("<special>", st.st_mode)
        elif st.st_size > 64 << 20:
            out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
        else:
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """Run ``amp-rewrite argv`` in this process; returns ``(exit code, stdout, stderr)``."""
    # the CLI points the package logger at this test's captured stderr; later tests (and
    # their caplog) must see the logger as it was
    logger = logging.getLogger("amp_rewrite")
    saved = logger.handlers[:], logger.level, logger.propagate
    capsys.readouterr()
    try:
        code = cli.main([str(a) for a in argv])
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, err: str, names: str, folder: Path, before: dict[str, str]) -> None:
    """The refusal contract: exit 2, one error line naming ``names``' file, nothing changed."""
    lines = err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and "Traceback" not in err
    assert Path(names).name in lines[0]
    assert snapshot(folder) == before


def without_root_powers() -> list[str]:
    """A command prefix under which file permissions apply to this user.

    Root bypasses permission bits, so as root the command runs through ``setpriv`` with the
    DAC-override capabilities dropped. Empty when not root; None when root without setpriv.
    """
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


# Runs several CLI commands in one process (TensorFlow's import dominates a process's cost) and
# prints [exit code, stderr] per command as JSON.
_BATCH = """
import contextlib, io, json, sys
from amp_rewrite.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def run_batch(commands: list[list[str]], prefix: list[str] = (), env: dict | None = None
              ) -> list[tuple[int, str]]:
    """Run each ``amp-rewrite`` argument list in one fresh process; ``(exit code, stderr)`` each.

    ``env`` adds to (or overrides) this process's environment.
    """
    argv = json.dumps([[str(a) for a in c] for c in commands])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    proc = subprocess.run([*prefix, sys.executable, "-c", _BATCH, argv], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def run_process(argv: list[str], prefix: list[str] = (), cwd: Path | None = None
                ) -> subprocess.CompletedProcess:
    """Run the installed ``amp-rewrite`` as its own process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([*prefix, AMP_REWRITE, *map(str, argv)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)
