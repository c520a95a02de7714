"""Loading every format: GraphDef (.pb / .pbtxt) and MetaGraphDef (.meta), detected from the
content, and SavedModel directories.

Loading only parses protocol buffers: it never runs code from the model (no pickle, no Keras
deserialization), never reads a SavedModel's variables and never changes the input. Every
failure is an :class:`InputError` that names the file and what is wrong with it, a graph that
TensorFlow's importer refuses among them (:func:`~amp_rewrite.check.input.check_importable`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from ..check.input import check_importable
from ..core.errors import InputError
from ..core.ops import VARIABLE_CREATORS
from .files import SAVED_MODEL_FILES, TEXT_SUFFIXES, keras_file

# protobuf cannot parse a message of 2 GiB or more
PROTOBUF_LIMIT = 2**31 - 1



@dataclass(frozen=True)
class Model:
    """A loaded model: its graphs as MetaGraphDefs, and the container they came in.

    ``kind`` is ``"graphdef"`` (one GraphDef, wrapped in a MetaGraphDef that holds nothing
    else), ``"metagraph"`` or ``"savedmodel"`` (a MetaGraphDef per tag set; ``saved_model`` is
    the parsed ``saved_model.pb``); ``text`` tells whether the file was protobuf text format.
    ``added_variables`` (a converted SavedModel) maps an object of the root (``amp_loss_scale``)
    to the variables it holds and their starting values, which saving adds to the checkpoint.
    ``source`` is the file the user named where that is not ``path``: a Keras file, whose
    export (:mod:`amp_rewrite.io.keras_files`) ``path`` is. Kind ``"frozen"`` is a SavedModel's
    ``--freeze`` conversion: ``meta_graphs`` are its frozen, converted graphs and ``frozen``
    the :class:`~amp_rewrite.io.frozen.Frozen` they came from, which saving writes as a
    SavedModel with the input's signatures.
    """

    path: Path
    kind: str
    text: bool
    meta_graphs: tuple[meta_graph_pb2.MetaGraphDef, ...]
    saved_model: saved_model_pb2.SavedModel | None = field(default=None, compare=False)
    added_variables: dict = field(default_factory=dict, compare=False)
    source: Path | None = field(default=None, compare=False)
    frozen: object = field(default=None, compare=False)

    @classmethod
    def of_graph_def(cls, graph_def: graph_pb2.GraphDef, path: str | os.PathLike = "<graph_def>",
                     text: bool = False) -> "Model":
        """A model of ``graph_def``, copied into its wrapper (the caller's is not changed);
        an :class:`InputError` for a graph TensorFlow would not import."""
        check_importable(graph_def)
        return cls._wrapping(meta_graph_pb2.MetaGraphDef(graph_def=graph_def), path, text)

    @classmethod
    def of_serialized_graph_def(cls, data: bytes, path: str | os.PathLike = "<bytes>") -> "Model":
        """A model of the GraphDef ``data`` serializes (binary protobuf, as
        ``GraphDef.SerializeToString`` writes it); an :class:`InputError` for bytes that are
        not one, or a graph TensorFlow would not import."""
        wrapper = meta_graph_pb2.MetaGraphDef()
        try:
            wrapper.graph_def.ParseFromString(data)
            parsed = _valid_graph(wrapper.graph_def)
        except (message.DecodeError, RuntimeError, ValueError):
            parsed = False
        if not parsed:
            kind = keras_file(data)
            why = f"they are {kind}" if kind else "empty" if not data else "they do not parse as one"
            raise InputError(f"{path}: not a serialized GraphDef ({why}; one is the binary "
                             "protobuf GraphDef.SerializeToString() gives)")
        _check_file_graph(Path(path), wrapper.graph_def, data)
        return cls._wrapping(wrapper, path, text=False)

    @classmethod
    def _wrapping(cls, meta: meta_graph_pb2.MetaGraphDef, path: str | os.PathLike,
                  text: bool) -> "Model":
        # a GraphDef's model: a MetaGraphDef holding nothing but the graph
        return cls(Path(path), "graphdef", text, (meta,))

    @property
    def graph_def(self) -> graph_pb2.GraphDef:
        """The (first) graph."""
        return self.meta_graphs[0].graph_def

    @property
    def meta_graph(self) -> meta_graph_pb2.MetaGraphDef | None:
        """The (first) MetaGraph; None for a GraphDef."""
        return None if self.kind == "graphdef" else self.meta_graphs[0]


# Control bytes that never occur in protobuf text but fill binary protobufs (field tags, lengths).
_BINARY_BYTES = bytes(set(range(32)) - {9, 10, 12, 13})


def _looks_text(data: bytes) -> bool:
    if data[:4096].translate(None, _BINARY_BYTES) != data[:4096]:
        return False
    try:
        data[:4096].decode("utf-8")
    except UnicodeDecodeError:
        # a multi-byte character cut at the 4096th byte is still text
        try:
            data[:4090].decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def _valid_graph(gd: graph_pb2.GraphDef) -> bool:
    return len(gd.node) > 0 and all(n.name and n.op for n in gd.node)


def load(path: str | os.PathLike) -> Model:
    """Load a GraphDef or MetaGraphDef file, or a SavedModel directory."""
    path = Path(path)
    if path.is_dir():
        return _load_saved_model(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.name in SAVED_MODEL_FILES:
        return _load_saved_model(path.parent)
    if not path.is_file():  # a device or pipe has no size to check and may never end
        raise InputError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        if size > PROTOBUF_LIMIT:
            raise InputError(f"{path}: {size / 2**30:.1f} GiB is over protobuf's 2 GiB limit for one "
                             "graph; save the model as a SavedModel so its weights live in variables")
        data = path.read_bytes()
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse(data, path)


def _load_saved_model(path: Path) -> Model:
    """Parse the SavedModel in directory ``path`` (its variables are not read)."""
    found = [path / name for name in SAVED_MODEL_FILES if (path / name).is_file()]
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
    model = Model(path, "savedmodel", proto_path.suffix == ".pbtxt", tuple(saved.meta_graphs), saved)
    for meta in model.meta_graphs:
        _check_file_graph(proto_path, meta.graph_def)
    _check_checkpoint(model)
    return model


def _check_checkpoint(model: Model) -> None:
    """A SavedModel with variables must carry their checkpoint: the converted copy takes
    ``variables/`` as it is, and TensorFlow could not load it without."""
    metas = model.meta_graphs
    has_vars = any(n.WhichOneof("kind") == "variable" for m in metas for n in m.object_graph_def.nodes)
    has_vars = has_vars or any(nd.op in VARIABLE_CREATORS for m in metas for nd in m.graph_def.node)
    if not has_vars:
        return
    folder = model.path / "variables"
    if not (folder / "variables.index").is_file():
        raise InputError(f"{model.path}: the SavedModel has variables but no "
                         f"{folder / 'variables.index'}; copy the whole SavedModel directory")
    shards = sorted(folder.glob("variables.data-*-of-*"))
    want = shards[0].name.rpartition("-of-")[2] if shards else ""
    if not shards or not want.isdigit() or len(shards) != int(want):
        raise InputError(f"{model.path}: the SavedModel's variable data in {folder} is incomplete "
                         f"({len(shards)} of {want or 'its'} variables.data shards)")


def parse(data: bytes, path: Path) -> Model:
    """Detect and parse the bytes of a GraphDef or MetaGraphDef, binary or text."""
    if not data:
        raise InputError(f"{path}: file is empty")
    kind = keras_file(data)
    if kind is not None:  # never deserialized here: a Keras file can carry code
        raise InputError(f"{path}: {kind}, not a TensorFlow graph; convert_file and the "
                         "amp-rewrite commands take it directly, elsewhere export a SavedModel "
                         "from Keras and use that: model = keras.models.load_model(...); "
                         "model.export('model_dir')")
    if _looks_text(data) and (path.suffix in TEXT_SUFFIXES or not _binary_model(data)):
        return _parse_text(data, path)
    model = _binary_model(data)
    if model is None:
        raise InputError(f"{path}: not a TensorFlow GraphDef or MetaGraphDef (the bytes do not "
                         "parse as either; is the file truncated or another format?)")
    kind, meta = model
    # a GraphDef file's bytes are the GraphDef's: the importer reads them as they are
    _check_file_graph(path, meta.graph_def, data if kind == "graphdef" else None)
    if kind == "metagraph":
        return Model(path, "metagraph", False, (meta,))
    return Model._wrapping(meta, path, text=False)


def _binary_model(data: bytes):
    """``("metagraph", MetaGraphDef)``, ``("graphdef", a MetaGraphDef holding only it)``, or None."""
    meta = meta_graph_pb2.MetaGraphDef()
    try:
        meta.ParseFromString(data)
        if _valid_graph(meta.graph_def):
            return "metagraph", meta
    except (message.DecodeError, RuntimeError, ValueError):
        pass
    # parsed straight into its wrapper: copying a graph in costs as much as parsing it
    wrapper = meta_graph_pb2.MetaGraphDef()
    try:
        wrapper.graph_def.ParseFromString(data)
    except (message.DecodeError, RuntimeError, ValueError):
        return None
    return ("graphdef", wrapper) if _valid_graph(wrapper.graph_def) else None


def _parse_text(data: bytes, path: Path) -> Model:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text and not a binary GraphDef") from None
    # the first field name decides; comment lines (a "# proto-file:" header) come before it
    stripped = "\n".join(line for line in text.splitlines()
                         if line.strip() and not line.lstrip().startswith("#")).lstrip()
    is_meta = stripped.startswith(("meta_info_def", "graph_def", "saver_def", "collection_def",
                                   "signature_def", "object_graph_def", "asset_file_def"))
    wrapper = meta_graph_pb2.MetaGraphDef()
    proto = wrapper if is_meta else wrapper.graph_def   # a GraphDef parsed into its wrapper
    try:
        text_format.Parse(text, proto)
    except text_format.ParseError as exc:
        what = "MetaGraphDef" if is_meta else "GraphDef"
        # the parser quotes the offending token, which can be a whole tensor_content string
        detail = str(exc).splitlines()[0] if str(exc) else "syntax error"
        detail = detail if len(detail) <= 200 else detail[:200] + " ..."
        raise InputError(f"{path}: not a valid text {what}: {detail}") from None
    except RecursionError:  # the text parser recurses per nesting level; binary stops at 100
        raise InputError(f"{path}: messages nested too deeply to be a real graph") from None
    if is_meta:
        if not _valid_graph(proto.graph_def):
            raise InputError(f"{path}: the MetaGraphDef holds no graph nodes")
        _check_file_graph(path, proto.graph_def)
        return Model(path, "metagraph", True, (proto,))
    if not _valid_graph(proto):
        raise InputError(f"{path}: the GraphDef holds no nodes")
    _check_file_graph(path, proto)
    return Model._wrapping(wrapper, path, text=True)


# ----------------------------------------------------------------- what TensorFlow would refuse
def _check_file_graph(path: Path, graph_def: graph_pb2.GraphDef,
                      serialized: bytes | None = None) -> None:
    try:
        check_importable(graph_def, serialized)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
