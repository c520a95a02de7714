"""SavedModel directories: load ``saved_model.pb``, paint every reachable function, save a copy.

Promises:

* only ``saved_model.pb`` is parsed and rewritten; ``variables/``, ``assets/`` and every other
  file are copied byte for byte, so the weights stay float32 on disk and a model whose weights
  exceed protobuf's 2 GiB limit converts (its weights never enter a protobuf message);
* signatures and the functions the object graph restores keep their float32 inputs and
  outputs; every function reachable from them is painted (see :mod:`amp_rewrite.functions`);
* the new directory is written beside the output and renamed into place: no half-written
  output, and an existing output is replaced only with ``force``;
* a training function (gradients and variable updates inside a ``tf.function``) is converted
  only where no loss scaling is needed (bfloat16, or loss scaling turned off); otherwise the
  conversion is refused with hints.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from google.protobuf import message, text_format
from tensorflow.core.protobuf import saved_model_pb2

from . import functions
from .errors import InputError, UnsupportedGraphError
from .ir import Graph
from .load import PROTOBUF_LIMIT, Model
from .report import Report
from .save import serialize

log = logging.getLogger(__name__)

_PROTO_FILES = ("saved_model.pb", "saved_model.pbtxt")
_FINGERPRINT = "fingerprint.pb"


def load_saved_model(path: Path) -> Model:
    """Parse the SavedModel in directory ``path`` (its variables are not read)."""
    path = Path(path)
    found = [path / name for name in _PROTO_FILES if (path / name).is_file()]
    if not found:
        raise InputError(f"{path}: a directory, but not a SavedModel (no saved_model.pb in it)")
    proto_path = found[0]
    if proto_path.stat().st_size > PROTOBUF_LIMIT:
        raise InputError(f"{proto_path}: over protobuf's 2 GiB limit; keep the weights in "
                         "variables/ rather than as constants in the graph")
    saved = saved_model_pb2.SavedModel()
    try:
        data = proto_path.read_bytes()
        if proto_path.suffix == ".pbtxt":
            text_format.Parse(data.decode("utf-8"), saved)
        else:
            saved.ParseFromString(data)
    except OSError as exc:
        raise InputError(f"{proto_path}: cannot read: {exc.strerror or exc}") from None
    except (message.DecodeError, text_format.ParseError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{proto_path}: not a valid SavedModel: {exc}") from None
    if not saved.meta_graphs or not any(len(m.graph_def.node) for m in saved.meta_graphs):
        raise InputError(f"{proto_path}: the SavedModel holds no graph")
    meta = saved.meta_graphs[0]
    return Model(path, "savedmodel", proto_path.suffix == ".pbtxt", meta.graph_def, meta,
                 extra={"saved_model": saved})


def convert_saved_model(model: Model, options) -> Report:
    """Convert every MetaGraph of the SavedModel in ``model``; returns the report.

    Nodes of the second and later MetaGraphs appear in the report as ``[tags]/name``.
    """
    options.check()
    rules = options.rule_set()
    saved = model.extra["saved_model"]
    for meta in saved.meta_graphs:
        _refuse_untrainable(model.path, meta, options)
    report = None
    for meta in saved.meta_graphs:
        model.meta_graph = meta
        sub = _convert_meta_graph(model, options, rules)
        if report is None:
            report = sub
        else:
            functions.merge_report(report, "[" + ",".join(meta.meta_info_def.tags) + "]", sub)
    model.meta_graph = saved.meta_graphs[0]
    model.graph_def = model.meta_graph.graph_def
    functions.warn_unmatched(rules, report)
    return report


def _convert_meta_graph(model: Model, options, rules) -> Report:
    """Convert ``model.meta_graph`` in place: its nodes (signature tensors kept float32), then
    its library (the object graph's concrete functions keep their signatures)."""
    from .pipeline import convert_graph

    meta = model.meta_graph
    filled, added = functions.graph_def_with_defaults(meta.graph_def)
    graph = Graph.from_graph_def(filled)
    keep = model.signature_tensors() | functions.direct_call_feeders(graph, filled.library)
    work, report = convert_graph(graph, functions.main_options(options, graph, filled.library),
                                 functions.rules_for(rules, graph.names()), extra_keep=keep)
    graph_def = work.to_graph_def(filled)
    functions.strip_graph_defaults(graph_def, added)
    roots = sorted(meta.object_graph_def.concrete_functions)
    functions.paint_library(graph_def, options, rules, report, extra_roots=roots,
                            interface=model.signature_tensors())
    meta.graph_def.CopyFrom(graph_def)
    return report


def _refuse_untrainable(path: Path, meta, options) -> None:
    """Refuse a float16 conversion of a training SavedModel, which would need loss scaling.

    Loss scaling adds state variables; a SavedModel restores only the variables its checkpoint
    holds, and its functions cannot grow new captured variables, so it is not done here.
    """
    from .loss_scaling import scale_config
    from .training.detect import training_parts

    if scale_config(options.loss_scale, options.target, dict(options.loss_scale_options)) is None:
        return
    train = training_parts(meta.graph_def)
    if train:
        raise UnsupportedGraphError(
            f"{path}: {train[0]} trains (gradients and variable updates); float16 training "
            "needs loss scaling, which amp-rewrite adds to GraphDef/MetaGraph training graphs "
            "but not to SavedModels (the checkpoint holds no loss-scale state). Convert with "
            "--target bfloat16 (no loss scaling needed), or with --loss-scale none (small "
            "gradients may underflow to zero), or save the training step as a MetaGraph "
            "(.meta) and convert that")


# ----------------------------------------------------------------- saving
def save_saved_model(model: Model, out_path: Path, *, force: bool = False) -> None:
    """Write the converted SavedModel to directory ``out_path`` (atomically, see module doc)."""
    out_path = Path(out_path)
    if out_path.exists() and not force:
        raise InputError(f"{out_path}: already exists; pass --force to replace it")
    if out_path.exists() and not out_path.is_dir():
        raise InputError(f"{out_path}: is a file; a SavedModel is written as a directory")
    if out_path.is_dir() and any(out_path.iterdir()) and not any(
            (out_path / name).is_file() for name in _PROTO_FILES):
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
        if entry.name in _PROTO_FILES or entry.name == _FINGERPRINT:
            continue
        if entry.is_dir():
            shutil.copytree(entry, folder / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, folder / entry.name)
    name = "saved_model.pbtxt" if model.text else "saved_model.pb"
    data = serialize(model.extra["saved_model"], model.text)
    with open(folder / name, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if (src / _FINGERPRINT).is_file():
        _write_fingerprint(folder)


def _write_fingerprint(folder: Path) -> None:
    """A fingerprint of the new saved_model.pb (the input's would name the old graph's hash)."""
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

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
