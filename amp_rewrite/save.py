"""Saving every format: deterministic bytes, written beside the output and renamed into place.

A failed or interrupted save leaves no half-written output behind, and an existing output is
only replaced when the caller says so. A SavedModel is written as a new directory: only
``saved_model.pb`` is new, ``variables/``, ``assets/`` and every other file are copied byte for
byte, so the weights stay float32 on disk and a model whose weights exceed protobuf's 2 GiB
limit converts (its weights never enter a protobuf message).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from google.protobuf import text_format
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

from .errors import InputError
from .files import SAVED_MODEL_FILES, TEXT_SUFFIXES, atomic_write
from .load import Model

log = logging.getLogger(__name__)

_FINGERPRINT = "fingerprint.pb"


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
        proto = model.meta_graph
    elif suffix == ".meta":
        proto = meta_graph_pb2.MetaGraphDef(graph_def=model.graph_def)
    else:
        proto = model.graph_def
    return proto, text


def save(model: Model, out_path: str | os.PathLike, *, force: bool = False) -> None:
    """Write ``model`` (already converted) to ``out_path``, in the input's container."""
    out_path = Path(out_path)
    if model.kind == "savedmodel":
        save_saved_model(model, out_path, force=force)
        return
    proto, text = output_proto(model, out_path)
    atomic_write(out_path, serialize(proto, text), force=force)


# ----------------------------------------------------------------- SavedModel directories
def save_saved_model(model: Model, out_path: Path, *, force: bool = False) -> None:
    """Write the SavedModel to directory ``out_path``: built as a hidden folder beside it and
    renamed into place; an existing output is moved aside first, and only with ``force``."""
    out_path = Path(out_path)
    if out_path.exists() and not force:
        raise InputError(f"{out_path}: already exists; pass --force to replace it")
    if out_path.exists() and not out_path.is_dir():
        raise InputError(f"{out_path}: is a file; a SavedModel is written as a directory")
    if out_path.is_dir() and any(out_path.iterdir()) and not any(
            (out_path / name).is_file() for name in SAVED_MODEL_FILES):
        # --force replaces a SavedModel, never a folder of something else
        raise InputError(f"{out_path}: a directory that is not a SavedModel and not empty; "
                         "--force only replaces a SavedModel, so choose another output")
    parent = out_path.parent if str(out_path.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{out_path}: folder {parent} does not exist")
    if Path(model.path).resolve() in parent.resolve().parents or \
            Path(model.path).resolve() == parent.resolve():
        raise InputError(f"{out_path}: inside the input SavedModel {model.path}; write it elsewhere")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=parent))
    except OSError as exc:
        raise InputError(f"{out_path}: cannot write: {exc.strerror or exc}") from None
    try:
        shutil.copymode(model.path, tmp)  # mkdtemp's 0700 would hide the model from others
        _write_tree(model, tmp)
        _swap_into_place(tmp, out_path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise InputError(f"{out_path}: cannot write: {exc.strerror or exc}") from None
        raise


def _write_tree(model: Model, folder: Path) -> None:
    """Copy the input directory's other files unchanged, write the new saved_model.pb(txt)."""
    src = Path(model.path)
    for entry in sorted(src.iterdir()):
        if entry.name in SAVED_MODEL_FILES or entry.name == _FINGERPRINT:
            continue
        if entry.is_dir():
            shutil.copytree(entry, folder / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, folder / entry.name)
    saved = saved_model_pb2.SavedModel()
    saved.CopyFrom(model.saved_model)
    del saved.meta_graphs[:]
    saved.meta_graphs.extend(model.meta_graphs)
    name = "saved_model.pbtxt" if model.text else "saved_model.pb"
    with open(folder / name, "wb") as fh:
        fh.write(serialize(saved, model.text))
        fh.flush()
        os.fsync(fh.fileno())
    if (src / _FINGERPRINT).is_file():
        _write_fingerprint(folder)


def _write_fingerprint(folder: Path) -> None:
    """A fingerprint of the new saved_model.pb (the input's would name the old graph's hash)."""
    try:
        data = fingerprinting.CreateFingerprintDef(str(folder))
    except fingerprinting.FingerprintException as exc:
        log.warning("no fingerprint.pb written: %s", exc)
        return
    (folder / _FINGERPRINT).write_bytes(data)


def _swap_into_place(tmp: Path, out_path: Path) -> None:
    """Rename ``tmp`` to ``out_path``; an existing output is moved aside first, then deleted."""
    if not out_path.exists():
        os.rename(tmp, out_path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", suffix=".old", dir=tmp.parent))
    old.rmdir()
    os.rename(out_path, old)
    try:
        os.rename(tmp, out_path)
    except OSError:
        os.rename(old, out_path)
        raise
    shutil.rmtree(old, ignore_errors=True)
