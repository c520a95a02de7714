"""Saving: deterministic bytes, written to a temporary file and renamed into place.

A failed or interrupted save leaves no half-written output behind, and an existing output is
only replaced when the caller says so.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from google.protobuf import text_format
from tensorflow.core.protobuf import meta_graph_pb2

from .errors import InputError
from .load import TEXT_SUFFIXES, Model


def serialize(proto, text: bool) -> bytes:
    """Deterministic bytes of a protobuf message: the same message always gives the same bytes."""
    if text:
        return text_format.MessageToString(proto).encode("utf-8")
    return proto.SerializeToString(deterministic=True)


def output_proto(model: Model, out_path: Path):
    """The message to write for ``model`` at ``out_path``, and whether to write it as text.

    The container stays the input's (a MetaGraphDef stays one); ``.meta`` on a GraphDef input
    wraps it in a MetaGraphDef. The encoding follows the output's extension: text for
    ``.pbtxt``-like names, binary for ``.pb`` / ``.meta``, else the input's encoding.
    """
    suffix = out_path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        text = True
    elif suffix in (".pb", ".meta"):
        text = False
    else:
        text = model.text
    if model.meta_graph is not None:
        proto = meta_graph_pb2.MetaGraphDef()
        proto.CopyFrom(model.meta_graph)
        proto.graph_def.CopyFrom(model.graph_def)
    elif suffix == ".meta":
        proto = meta_graph_pb2.MetaGraphDef(graph_def=model.graph_def)
    else:
        proto = model.graph_def
    return proto, text


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


def save(model: Model, out_path: str | os.PathLike, *, force: bool = False) -> None:
    """Write ``model`` (its ``graph_def`` already converted) to ``out_path``."""
    out_path = Path(out_path)
    if model.kind == "savedmodel":
        from .savedmodel import save_saved_model
        save_saved_model(model, out_path, force=force)
        return
    proto, text = output_proto(model, out_path)
    atomic_write(out_path, serialize(proto, text), force=force)
