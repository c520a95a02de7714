"""Files: safe writes and path identity. Standard library only, so the CLI can check paths
before TensorFlow is imported.

A write goes to a temporary file in the target's own folder, is flushed to disk and renamed
over the target: a crash leaves at most a hidden ``.NAME.*.tmp`` beside it, never a
half-written output.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import InputError


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file (through symlinks, ``..`` and hard links)."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: Path, data: bytes, *, force: bool = False) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    path = Path(path)
    if path.exists() and not force:
        raise InputError(f"{path}: already exists; pass --force to replace it")
    if path.is_dir():
        raise InputError(f"{path}: is a directory")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{path}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would, or the
        # mode of the file it replaces
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None
        raise
