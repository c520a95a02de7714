"""Saving every format: deterministic bytes, written beside the output and renamed into place.

A failed or interrupted save leaves no half-written output behind, and an existing output is
only replaced when the caller says so. :func:`stage` writes a model as part of an
:class:`~amp_rewrite.io.files.OutputSet`, so a command's other outputs go in with it or not
at all. A SavedModel is written as a new directory: only
``saved_model.pb`` is new, ``variables/``, ``assets/`` and every other file are copied byte for
byte, so the weights stay float32 on disk and a model whose weights exceed protobuf's 2 GiB
limit converts (its weights never enter a protobuf message). A SavedModel that gained loss-scale
state gets a new ``variables/`` written by TensorFlow's own checkpoint ops (:func:`write_variables`):
the original tensors with their bytes, the new variables, a checkpoint object graph naming them.
A ``--freeze`` conversion is written by TensorFlow (:func:`amp_rewrite.io.frozen.write`), into
a hidden folder beside the output as well.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2, trackable_object_graph_pb2
from tensorflow.python.ops import gen_io_ops
from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
from tensorflow.python.training import py_checkpoint_reader

from ..core.errors import InputError, option
from .frozen import write as write_frozen
from .files import (
    SAVED_MODEL_FILES,
    TEXT_SUFFIXES,
    OutputSet,
    already_exists,
    check_file_destination,
)
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
    with OutputSet() as outputs:
        stage(model, out_path, outputs, force=force)
        outputs.commit()


def stage(model: Model, out_path: str | os.PathLike, outputs: OutputSet, *,
          force: bool = False) -> None:
    """Write ``model`` in full under a temporary name beside ``out_path``, for ``outputs`` to
    rename into place with the command's other outputs (an InputError where :func:`save`
    would raise one)."""
    out_path = Path(out_path)
    if model.kind in ("savedmodel", "frozen"):
        _stage_saved_model(model, out_path, outputs, force)
        return
    proto, text = output_proto(model, out_path)
    outputs.add_file(out_path, serialize(proto, text), force=force)


# ----------------------------------------------------------------- SavedModel directories
def check_destination(model: Model, out_path: str | os.PathLike, *, force: bool = False) -> None:
    """Raise the InputError :func:`save` would raise for ``out_path`` before writing anything,
    so that a command doing long work first can refuse at once."""
    out_path = Path(out_path)
    if model.kind in ("savedmodel", "frozen"):
        _check_saved_model_destination(model, out_path, force)
        return
    check_file_destination(out_path, force=force)


def _check_saved_model_destination(model: Model, out_path: Path, force: bool) -> None:
    if out_path.exists() and not force:
        raise InputError(already_exists(out_path))
    if out_path.exists() and not out_path.is_dir():
        raise InputError(f"{out_path}: is a file; a SavedModel is written as a directory")
    if out_path.is_dir() and any(out_path.iterdir()) and not any(
            (out_path / name).is_file() for name in SAVED_MODEL_FILES):
        # --force replaces a SavedModel, never a folder of something else
        raise InputError(f"{out_path}: a directory that is not a SavedModel and not empty; "
                         f"{option('--force', 'force=True')} only replaces a SavedModel, so "
                         "choose another output")
    parent = out_path.parent if str(out_path.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{out_path}: folder {parent} does not exist")
    if Path(model.path).resolve() in parent.resolve().parents or \
            Path(model.path).resolve() == parent.resolve():
        raise InputError(f"{out_path}: inside the input SavedModel {model.path}; write it elsewhere")


def _stage_saved_model(model: Model, out_path: Path, outputs: OutputSet, force: bool) -> None:
    """Build the SavedModel as a hidden folder beside ``out_path``; committing renames it into
    place (an existing output is moved aside first, and only with ``force``). A ``--freeze``
    conversion (:mod:`amp_rewrite.io.frozen`) is written by TensorFlow as a new SavedModel, any
    other as the input's tree with the converted graphs."""
    _check_saved_model_destination(model, out_path, force)
    tmp = outputs.temporary_folder(out_path)
    try:
        shutil.copymode(model.path, tmp)  # mkdtemp's 0700 would hide the model from others
        if model.kind == "frozen":
            write_frozen(model.frozen, model.meta_graphs, tmp)
        else:
            _write_tree(model, tmp)
    except OSError as exc:
        raise InputError(f"{out_path}: cannot write: {exc.strerror or exc}") from None
    outputs.add(tmp, out_path, replace=force)


def write_linked(model: Model, folder: str | os.PathLike) -> None:
    """Write SavedModel ``model`` to the new directory ``folder`` for running it, not for
    keeping: its own saved_model.pb, and every other file or folder of the input directory
    (``variables/``, ``assets/``) as a symbolic link to the input's, so a variant of a model
    (``verify --emulate``) runs without a copy of its weights. Where the file system refuses
    links, they are copied."""
    folder = Path(folder)
    try:
        folder.mkdir()
        _write_tree(model, folder, link=True)
    except OSError as exc:
        raise InputError(f"{folder}: cannot write: {exc.strerror or exc}") from None


def _write_tree(model: Model, folder: Path, link: bool = False) -> None:
    """Copy the input directory's other files unchanged (``link``: link them), write the new
    saved_model.pb(txt)."""
    src = Path(model.path)
    for entry in sorted(src.iterdir()):
        if entry.name in SAVED_MODEL_FILES or entry.name == _FINGERPRINT:
            continue
        if entry.name == "variables" and model.added_variables:
            write_variables(entry / "variables", folder / "variables", model.added_variables)
            continue
        if link and _linked(entry, folder / entry.name):
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


def _linked(entry: Path, link: Path) -> bool:
    """Whether ``link`` now links to ``entry``; False where the file system has no links."""
    try:
        link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    except (NotImplementedError, PermissionError):
        return False
    return True


_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def write_variables(src_prefix: Path, dst_dir: Path, added: dict) -> None:
    """Write ``dst_dir/variables.*``: the checkpoint at ``src_prefix`` plus ``added`` (object of
    the root -> {variable name: starting value}), with TensorFlow's own bundle writer.

    The original tensors are read and written again in the order the original saver wrote them
    (the checkpoint object graph's order), the new variables and the new object graph go to a
    second bundle, and ``MergeV2Checkpoints`` joins both under one index, as a sharded
    ``tf.train.Checkpoint`` save does (the old object graph is the one entry not copied: the
    merge refuses a key twice). A single-shard original then comes out as a byte-exact prefix of
    the new shard 0, and the original data file itself is installed in its place.
    """
    prefix = os.fspath(src_prefix)   # a prefix of another type is our bug, not a bad file
    try:
        reader = py_checkpoint_reader.NewCheckpointReader(prefix)
    except tf.errors.OpError as exc:
        # a missing or bad bundle: the reader translates every failure to an OpError
        # (py_checkpoint_reader.error_translator)
        raise InputError(f"{src_prefix}: cannot read the checkpoint: {str(exc).splitlines()[0]}") from None
    dtypes = reader.get_variable_to_dtype_map()
    if _OBJECT_GRAPH_KEY not in dtypes:
        raise InputError(f"{src_prefix}: the checkpoint has no object graph (not written by "
                         "tf.saved_model.save): loss-scale state cannot be added to it")
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH_KEY))
    # the order the original saver wrote: the object graph's, then anything else by name
    ordered = dict.fromkeys(attr.checkpoint_key for node in graph.nodes for attr in node.attributes
                            if attr.checkpoint_key in dtypes)
    keys = list(ordered) + sorted(k for k in dtypes if k not in ordered and k != _OBJECT_GRAPH_KEY)
    new = _add_to_object_graph(graph, added)
    clash = sorted(set(new) & set(dtypes))
    if clash:
        raise InputError(f"{src_prefix}: the checkpoint already holds {clash[0]}")
    dst_dir.mkdir()
    old = str(dst_dir / "amp_part_0")
    gen_io_ops.save_v2(old, keys, [""] * len(keys),
                       [tf.constant(reader.get_tensor(k), dtype=dtypes[k]) for k in keys])
    added_prefix = str(dst_dir / "amp_part_1")
    gen_io_ops.save_v2(added_prefix, sorted(new) + [_OBJECT_GRAPH_KEY], [""] * (len(new) + 1),
                       [tf.constant(new[k]) for k in sorted(new)]
                       + [tf.constant(graph.SerializeToString(), dtype=tf.string)])
    gen_io_ops.merge_v2_checkpoints([old, added_prefix], str(dst_dir / "variables"),
                                    delete_old_dirs=False)
    originals = sorted(src_prefix.parent.glob(src_prefix.name + ".data-*"))
    shard0 = dst_dir / "variables.data-00000-of-00002"
    if len(originals) == 1 and _is_prefix(shard0, originals[0]):
        shutil.copyfile(originals[0], shard0)   # the same bytes the index points at, and more


def _add_to_object_graph(graph, added: dict) -> dict[str, np.ndarray]:
    """Objects ``added`` (root child -> {variable: value}) into the checkpoint object graph
    ``graph``, in place; returns their values by checkpoint key."""
    new = {}
    for scope, variables in sorted(added.items()):
        parent = len(graph.nodes)
        graph.nodes.add().has_checkpoint_values.value = True
        for name, value in variables.items():
            key = f"{scope}/{name}/.ATTRIBUTES/VARIABLE_VALUE"
            child = graph.nodes.add()
            child.attributes.add(name="VARIABLE_VALUE", full_name=f"{scope}/{name}", checkpoint_key=key)
            child.has_checkpoint_values.value = True
            graph.nodes[parent].children.add(node_id=len(graph.nodes) - 1, local_name=name)
            new[key] = np.asarray(value)
        graph.nodes[0].children.add(node_id=parent, local_name=scope)
    return new


def _is_prefix(short: Path, long: Path, block: int = 1 << 24) -> bool:
    if short.stat().st_size > long.stat().st_size:
        return False
    with open(short, "rb") as a, open(long, "rb") as b:
        while True:
            x = a.read(block)
            if not x:
                return True
            if b.read(len(x)) != x:
                return False


def _write_fingerprint(folder: Path) -> None:
    """A fingerprint of the new saved_model.pb (the input's would name the old graph's hash)."""
    try:
        data = fingerprinting.CreateFingerprintDef(str(folder))
    except fingerprinting.FingerprintException as exc:
        log.warning("no fingerprint.pb written: %s", exc)
        return
    (folder / _FINGERPRINT).write_bytes(data)
