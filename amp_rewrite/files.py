"""Files: safe writes, path identity and what a path holds, as far as its name and first bytes
tell. Standard library only, so the CLI can check paths before TensorFlow is imported.

A write goes to a temporary file in the target's own folder, is flushed to disk and renamed
over the target: a crash leaves at most a hidden ``.NAME.*.tmp`` beside it, never a
half-written output.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import InputError

#: the file that makes a directory a SavedModel
SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
#: names of protobuf text files
TEXT_SUFFIXES = (".pbtxt", ".pbtext", ".txt", ".prototxt")
#: names a GraphDef or MetaGraphDef file is written under
GRAPH_FILE_SUFFIXES = (".pb", ".meta") + TEXT_SUFFIXES
# first bytes of model files that are not TensorFlow graphs
_KERAS_MAGIC = {b"PK\x03\x04": "a Keras .keras archive", b"\x89HDF\r\n\x1a\n": "an HDF5 (.h5) file"}


def is_saved_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a SavedModel directory or its saved_model.pb(txt)."""
    path = Path(path)
    if path.name in SAVED_MODEL_FILES:
        return path.is_file()
    return path.is_dir() and any((path / name).is_file() for name in SAVED_MODEL_FILES)


def check_container(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A SavedModel converts to a SavedModel directory: refuse an output named like a graph file
    (``model_dir/saved_model.pb -o model.pb`` would write a directory called model.pb)."""
    dst = Path(dst)
    if is_saved_model(src) and dst.suffix.lower() in GRAPH_FILE_SUFFIXES and not dst.is_dir():
        raise InputError(f"{dst}: the input is a SavedModel, which converts to a SavedModel "
                         f"directory; name the output as a directory (e.g. {dst.with_suffix('')}), "
                         "or freeze a signature to a GraphDef first (README: \"Frozen graphs "
                         "from a SavedModel\") and convert that")


def keras_file(data: bytes) -> str | None:
    """What kind of Keras model file ``data`` starts like, or None."""
    return next((kind for magic, kind in _KERAS_MAGIC.items() if data.startswith(magic)), None)


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


def tune_rules_path(output: str | os.PathLike) -> Path:
    """Where ``tune`` writes its rules file by default: beside the output,
    ``<output>.tune.toml`` (the CLI checks it before TensorFlow loads, the library writes it)."""
    output = Path(output)
    return output.with_name(output.name + ".tune.toml")


def check_file_destination(path: Path, *, force: bool = False) -> Path:
    """The InputError :func:`atomic_write` would raise for ``path`` (it exists and ``force``
    is not set, it is a directory, its folder is missing); returns the folder."""
    if path.exists() and not force:
        raise InputError(f"{path}: already exists; pass --force to replace it")
    if path.is_dir():
        raise InputError(f"{path}: is a directory")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{path}: folder {folder} does not exist")
    return folder


def atomic_write(path: Path, data: bytes, *, force: bool = False) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    path = Path(path)
    folder = check_file_destination(path, force=force)
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
