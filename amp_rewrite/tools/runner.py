"""Running a model: the one place where verify, kernels and bench execute graphs.

A :class:`Runner` wraps a GraphDef or MetaGraphDef (imported into a v1 Session) or a
SavedModel signature (loaded with ``tf.saved_model.load``) behind the same small interface:
``inputs`` (name, dtype, shape), ``outputs`` (names), ``callable()`` and ``trace()`` (the
tensors inside, for ``verify --per-node``). Inputs are named as the user sees them: signature
keys for MetaGraphs and SavedModels, placeholder names for GraphDefs; a placeholder nothing
reads (the ``unused_control_flow_input`` placeholders ``convert_variables_to_constants_v2``
leaves) is no input: it needs no data. Random inputs follow each input's dtype and shape;
unknown dimensions come from ``shapes`` (``--shape name=2,8,8,1``) or default to 1 with a
warning.

A graph fed by tf.data iterators takes their outputs as inputs too, named by tensor
(``IteratorGetNext:0``): the user's arrays where given, else the batches the original model's
own iterator yields (:func:`fill_iterator_inputs`: sample *i* is its *i*-th batch), fed to
both models alike, so an original and its conversion compute on the same batch whatever
their own iterators would give (a one-shot iterator starts again in every session). The
initializable iterators' initializers, and the ops named with ``--init-op``, run once per
session after the variables and the lookup tables, before its first run, fed with the first
sample's values of the inputs they read (a dataset built from a placeholder).

A runner never writes a variable, and it knows a graph only through its
:class:`~amp_rewrite.tools.analysis.Analysis`: the copy it imports (the control edges that would
make a fetch run a variable write dropped, unseeded random ops seeded), the endpoints, what a
fetch cannot reach, what only sets variables up, the training parts. A tensor that *reads* a
written value is never fetched. The runner creates the session, initializes or restores the
variables, feeds, fetches and traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import meta_graph_pb2

from ..core.dtypes import BOOL, FLOATING
from ..core.errors import InputError
from ..core.ir import copy_except
from ..core.ops import TABLE_INITIALIZERS
from ..io.load import SAVED_MODEL_FILES, Model, load
from ..io.save import write_linked
from ..schema.inputs import (
    InputSpec,
    composite_arguments,
    fitting_shape,
    input_keys,
    match_inputs,
    shape_text,
    signature_composites,
    split_whole_shapes,
)
from ..transforms.emulate import emulate_float16
from . import composites
from .analysis import UNSCALED_SUFFIX, Analysis, own_variables
from .replay import SignatureReplay, saved_state, serving_meta_graph, signature_call
from .traces import TensorInfo, Trace, reason, replay_errors, run_errors, tensor_name

log = logging.getLogger(__name__)


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["x=2,8,8,1"]`` -> ``{"x": (2, 8, 8, 1)}``; a malformed item is an InputError."""
    shapes = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip() != "")
        except ValueError:
            raise InputError(f"--shape {item!r}: expected NAME=D1,D2,... (e.g. images=8,8,8,1)") from None
        if any(d < 0 for d in shapes[name]):
            raise InputError(f"--shape {item!r}: dimensions must be non-negative")
        if 0 in shapes[name]:
            # an empty tensor: a cost model weighs nothing of it, a run compares nothing
            raise InputError(f"--shape {item!r}: a dimension of 0 makes an empty tensor (a "
                             "batch of 0 samples), with nothing to weigh, run or compare; give "
                             "the sizes you run, each at least 1")
    return shapes


def concrete_shape(spec: InputSpec, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape to feed for ``spec``: the user's ``--shape``, else the static shape with an
    unknown leading dimension set to the batch of the shapes given (else 1) and other unknown
    dimensions set to 1 (logged, so the user knows to pass ``--shape``)."""
    for key in input_keys(spec):
        if key in shapes:
            return fitting_shape(key, shapes[key], spec)
    if spec.shape is None:
        raise InputError(f"input {spec.name!r} has unknown rank: pass --shape {spec.name}=D1,D2,...")
    batch = next((dims[0] for dims in shapes.values() if dims), 1)
    shape = tuple((batch if i == 0 else 1) if d is None else d for i, d in enumerate(spec.shape))
    if shape != spec.shape:
        log.warning("input %s has shape %s: fed as %s (pass --shape %s=...)", spec.name,
                    shape_text(spec.shape), shape_text(shape), spec.name)
    return shape


def input_shapes(specs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]] | None
                 ) -> dict[str, tuple[int, ...]]:
    """``--shape`` keyed by input name, each name checked by :func:`match_inputs`."""
    return {spec.name: tuple(shapes[key])
            for key, spec in match_inputs(shapes or {}, specs, "--shape").items()}


def input_feeds(specs: Sequence[InputSpec], inputs: str | os.PathLike | None = None,
                samples: int = 1, shapes: Mapping[str, tuple[int, ...]] | None = None,
                seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Where ``--inputs`` and ``--shape`` become feeds, for every command that runs a model:
    the ``.npz`` file's arrays once (:func:`load_inputs`), or ``samples`` random sets
    (:func:`random_inputs`, seeds ``seed``, ``seed + 1`` ...). Every ``--shape`` name must name
    an input, with or without ``--inputs``; with it, an array must have the shape given (a
    RaggedTensor's or SparseTensor's arrays, the shape as a whole). An iterator's output is
    never random: without an array it is left out, for :func:`fill_iterator_inputs` (and a
    ``--shape`` cannot set its batches' shape)."""
    whole, shapes = _split_shapes(specs, shapes, given=bool(inputs))
    feeds = load_inputs(inputs, specs) if inputs else None
    made = [spec for spec in specs if not spec.iterator]
    for name, given in shapes.items():
        if name not in (feeds if inputs else {spec.name for spec in made}):
            raise InputError(f"--shape {name}: its batches come from the model's iterator, "
                             "in the dataset's shape; feed them from --inputs to choose")
        if inputs and feeds[name].shape != given:
            raise InputError(f"--shape {name}={','.join(map(str, given))}: {inputs} holds "
                             f"{name} with shape {shape_text(feeds[name].shape)}")
    if inputs:
        _check_whole_shapes(whole, specs, feeds, inputs)
        return [feeds]
    batch = next((dims[0] for dims in [*shapes.values(), *whole.values()] if dims), 1)
    fixed = {spec.name: concrete_shape(spec, shapes) for spec in made  # warns once
             if spec.composite is None}
    fixed |= {name: composites.whole_shape(c, whole, batch)
              for name, c in composite_arguments(made).items()}
    return [random_inputs(made, fixed, seed + i) for i in range(samples)]


def _split_shapes(specs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]] | None,
                  given: bool) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """``--shape`` split into the composite arguments' shapes as a whole (by argument) and the
    other inputs' (by input name, each name checked by :func:`match_inputs`). A component's own
    shape is refused where data is made (random components are no valid argument), and only
    checked against its array where ``--inputs`` gives one (``given``)."""
    whole, rest = split_whole_shapes(shapes or {}, specs)
    rest = input_shapes(specs, rest)
    part = next((s for s in specs if s.name in rest and s.composite is not None), None)
    if part is not None and not given:
        raise InputError(f"--shape {part.name}: input {part.label()} is part of "
                         f"{part.composite.text()}, made whole: give the argument's shape, "
                         f"--shape {part.composite.name}=D1,D2,... (docs/verify.md \"Ragged and "
                         "sparse inputs\")")
    return whole, rest


def _check_whole_shapes(whole: Mapping[str, tuple[int, ...]], specs: Sequence[InputSpec],
                        feeds: Mapping[str, np.ndarray], inputs) -> None:
    for name, given in whole.items():
        composite = composite_arguments(specs)[name]
        held = composites.bounding_shape(composite, _parts(specs, name), feeds)
        if held is not None and held != tuple(given):
            raise InputError(f"--shape {name}={','.join(map(str, given))}: {inputs} holds "
                             f"{composite.kind} {name} with shape {shape_text(held)}")


def _parts(specs: Sequence[InputSpec], name: str) -> list[InputSpec]:
    return [s for s in specs if s.composite is not None and s.composite.name == name]


def random_inputs(specs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]] | None = None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds, one per input: normal floats, small non-negative ints, random bools
    (``shapes``: ``--shape``, checked by :func:`input_shapes`); a RaggedTensor or SparseTensor
    argument drawn whole and fed as its components (:func:`~.composites.random_composite`, at
    ``shapes``' entry for its name, its shape as a whole)."""
    rng = np.random.default_rng(seed)
    whole, rest = _split_shapes(specs, shapes, given=False)
    batch = next((dims[0] for dims in [*rest.values(), *whole.values()] if dims), 1)
    feeds = {}
    for spec in specs:
        if spec.composite is None:
            feeds[spec.name] = random_array(spec.dtype, concrete_shape(spec, rest), rng,
                                            spec.name)
        elif spec.name not in feeds:
            name = spec.composite.name
            shape = composites.whole_shape(spec.composite, whole, batch)
            feeds |= composites.random_composite(spec.composite, _parts(specs, name), shape, rng,
                                                 random_array)
    return feeds


def random_array(dtype: int, shape: tuple[int, ...], rng: np.random.Generator,
                 name: str = "") -> np.ndarray:
    """Random values of ``dtype``: normal floats, small non-negative ints (integer inputs are
    usually indices or lengths), random bools; another dtype is an InputError naming input
    ``name``."""
    np_dtype = tf.dtypes.as_dtype(dtype).as_numpy_dtype
    if dtype in FLOATING:
        return rng.standard_normal(shape).astype(np_dtype)
    if dtype == BOOL:
        return rng.random(shape) < 0.5
    if tf.dtypes.as_dtype(dtype).is_integer:
        return rng.integers(0, 4, shape).astype(np_dtype)
    raise InputError(f"input {name!r} has dtype {tf.dtypes.as_dtype(dtype).name}: cannot make "
                     "random data for it; pass --inputs data.npz")


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file at ``path``, by its key: the one reader of the data
    files every command takes (``--inputs``, ``--calibration``, ``--holdout``). A file that is
    not an archive ``np.savez`` wrote (a truncated download, another format renamed, a ``.npy``
    file), a damaged member or an array of Python objects (never unpickled) is the user's
    error: an :class:`InputError` naming the file and what it is not."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        raise InputError(f"{path}: not an .npz archive (np.savez writes a zip archive; this "
                         f"file {_looks_like(head)})")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"{path}: not a readable .npz archive (truncated or damaged: "
                         f"{_first_line(exc)})") from None
    with data:
        return {key: _array(data, key, path) for key in data.files}


def _looks_like(head: bytes) -> str:
    """What a file that is no zip archive starts like, in words."""
    known = {b"\x93NUMPY": "is a single .npy array: save arrays by input name with np.savez",
             b"\x89PNG": "is a PNG image", b"\xff\xd8\xff": "is a JPEG image",
             b"\x1f\x8b": "is gzip-compressed", b"PK": "is a damaged zip archive"}
    for magic, what in known.items():
        if head.startswith(magic):
            return what
    if not head:
        return "is empty"
    if all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        return "is text"
    return "starts with other bytes"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_inputs(path: str | os.PathLike, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """Feeds from an ``.npz`` file (:func:`read_npz`) whose keys are input names (or tensor
    names; a RaggedTensor's or SparseTensor's components also as ``ids.values``,
    ``ids.row_splits``: :func:`~amp_rewrite.schema.inputs.input_keys`): one array for every
    input, and every key names one (:func:`match_inputs`); an
    iterator's output it lacks is left for :func:`fill_iterator_inputs`. Each input fed is
    logged with the shape of its array."""
    data = read_npz(path)
    matched = match_inputs(list(data), specs, f"{path}: array")
    feeds = {spec.name: data[key] for key, spec in matched.items()}
    for spec in specs:
        if spec.name not in feeds:
            if spec.iterator:
                continue
            whole = "" if spec.composite is None else (
                f"; give {spec.composite.text()} as {spec.composite.keys()}")
            raise InputError(f"{path}: no array for input {spec.label()}{whole} (keys: "
                             f"{', '.join(data) or 'none'})")
        log.info("input %s: %s %s from %s", spec.name, feeds[spec.name].dtype,
                 shape_text(feeds[spec.name].shape), path)
    return {spec.name: feeds[spec.name] for spec in specs if spec.name in feeds}


def _array(data, key: str, path) -> np.ndarray:
    try:
        return data[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if "allow_pickle" in str(exc):   # an object array (Python strings): never unpickled
            raise InputError(f"{path}: array {key!r} holds Python objects, which are not read "
                             "(no pickle); save strings as a NumPy string array, "
                             "np.array(words, dtype=str)") from None
        raise InputError(f"{path}: cannot read array {key!r} (truncated or damaged archive: "
                         f"{_first_line(exc)})") from None


def fill_iterator_inputs(runner: Runner, feeds: Sequence[Mapping[str, np.ndarray]]
                         ) -> list[dict[str, np.ndarray]]:
    """``feeds`` with the iterator outputs each lacks (:attr:`InputSpec.iterator`) taken from
    ``runner``'s own iterators, a batch per feed set in order (the initializers run first,
    with the first feed set's values: :meth:`GraphRunner.start`); called once per model
    opened, the next call goes on with the next batches. One iterator's outputs come all from
    the user or all from the iterator: a feed set giving some of them only is an InputError
    (the batch would be half the user's, half the dataset's)."""
    groups: dict[str, list[InputSpec]] = {}
    names = {spec.name for spec in runner.inputs}
    for spec in runner.inputs:
        if spec.iterator:
            groups.setdefault(spec.iterator.rpartition(":")[0], []).append(spec)
    out = []
    for feed in feeds:
        wanted = []
        for node, specs in groups.items():
            given = [s.name for s in specs if s.name in feed]
            if given and len(given) < len(specs):
                missing = [s.name for s in specs if s.name not in feed]
                raise InputError(f"the inputs give {', '.join(given)} but not "
                                 f"{', '.join(missing)}: feed all of iterator {node}'s "
                                 "outputs, or none (then they come from the iterator)")
            if not given:
                wanted += specs
        merged = {**feed, **(runner.next_batch(wanted, feeds[0]) if wanted else {})}
        # in the inputs' order, so the first is one a batch goes through (bench's batch size)
        out.append({s.name: merged[s.name] for s in runner.inputs if s.name in merged}
                   | {k: v for k, v in merged.items() if k not in names})
    return out


@functools.lru_cache(maxsize=1)
def init_devices() -> None:
    """Let TensorFlow enumerate its devices once, before the first Session or SavedModel load.

    On a machine without a GPU driver this is where TensorFlow's C++ layer logs a CUDA error
    line that no environment variable silences; it means nothing for a CPU run, so it is kept
    off stderr unless amp-rewrite logs at DEBUG level (``-v``).
    """
    if log.isEnabledFor(logging.DEBUG):
        tf.config.list_physical_devices()
        return
    try:
        saved = os.dup(2)
    except OSError:
        tf.config.list_physical_devices()
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class Runner:
    """A model ready to run. Subclasses: :class:`GraphRunner`, :class:`SavedModelRunner`."""

    inputs: list[InputSpec]
    outputs: list[str]
    #: the outputs (by this runner's names) that are gradients, not results of the forward pass
    gradients: frozenset[str] = frozenset()

    def callable(self) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
        """A function from feeds (by input name) to the outputs, in ``self.outputs`` order."""
        raise NotImplementedError

    def trace(self, feeds: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> Trace:
        """One run recording the float tensors inside the model (``names`` of them, where the
        runner needs to be told which: see :meth:`comparable`)."""
        raise NotImplementedError

    def comparable(self) -> list[str] | None:
        """The tensors :meth:`trace` can record, or None when a trace finds them itself."""
        return None

    def uncomparable(self) -> dict[str, str]:
        """The float tensors of the model's computation that :meth:`trace` cannot record, each
        with why (see :meth:`~amp_rewrite.tools.analysis.Analysis.uncomparable`); empty where
        a trace finds its own."""
        return {}

    def decision_shares(self) -> frozenset[str]:
        """The outputs that are shares of yes/no decisions (an accuracy: the mean of a cast
        ``Equal(ArgMax(...), labels)``), which move by whole decisions, not by rounding; empty
        where the runner cannot see the graph."""
        return frozenset()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GraphRunner(Runner):
    """A GraphDef or MetaGraphDef imported into its own graph and Session, as its
    :class:`~amp_rewrite.tools.analysis.Analysis` prepared it (``analysis.runnable``); what to
    feed, fetch and compare is the analysis's, running is this class's.

    Variables (MetaGraphs) are restored from ``checkpoint`` when one is given, else run through
    their initializers (``initialize=False`` leaves that to :func:`share_weights`);
    :meth:`variable_values` / :meth:`load_variables` copy them between two runners so an
    original and its conversion compute with the same weights; the lookup tables are filled
    then too. The iterators' initializers, and ``init_ops`` named by the user
    (:meth:`Analysis.init_ops`), run once, before the first run (:meth:`start`).
    """

    def __init__(self, analysis: Analysis, outputs: Sequence[str] = (),
                 checkpoint: str | None = None, *, initialize: bool = True,
                 init_ops: Sequence[str] = ()):
        init_devices()
        self.analysis = analysis
        self.model, self.path = analysis.model, analysis.path
        self.graph = tf.Graph()
        self._saver = self._import()
        # a MetaGraph without a saver gets one built on import: its save and restore ops
        self._built = {op.name for op in self.graph.get_operations()
                       if op.name not in analysis.graph}
        self.has_signature = analysis.signature is not None
        #: the initializers to run (:meth:`start`), and those of them the user named
        self.init_ops, self.named_init_ops = analysis.init_ops(init_ops), tuple(init_ops)
        self._started, self._batches = False, 0
        self._unfetched: dict[str, str] = {}    # what trace() could not fetch, and why
        self.inputs = [self._spec(name, tensor) for name, tensor in analysis.inputs]
        if not (outputs or analysis.outputs):
            raise InputError(f"{self.path}: no graph outputs found; name them with --output")
        self.outputs = list(analysis.outputs)
        self.set_outputs(outputs or analysis.outputs)
        self.session = tf.compat.v1.Session(graph=self.graph)
        if initialize:
            self.initialize(checkpoint)
        elif checkpoint:
            raise ValueError("a checkpoint is restored by initialize()")

    def _import(self):
        """Import the analysis's runnable copy; returns the MetaGraph's saver (None for a
        GraphDef)."""
        with self.graph.as_default():
            if self.model.meta_graph is None:
                tf.graph_util.import_graph_def(self.analysis.runnable, name="")
                return None
            meta = type(self.model.meta_graph)()
            copy_except(self.model.meta_graph, meta, "graph_def")
            meta.graph_def.CopyFrom(self.analysis.runnable)
            return tf.compat.v1.train.import_meta_graph(meta, clear_devices=True)

    # -- structure: the analysis's, checked against the imported graph -------------------------
    def set_outputs(self, names: Sequence[str]) -> None:
        """Compare ``names``: each must exist and be computed before any variable write."""
        names = [tensor_name(n) for n in names]
        for name in names:
            op = self.tensor(name).op
            if op.name in self.analysis.after_writes:
                raise InputError(f"{self.path}: {name} is computed after a variable write "
                                 f"({op.type}): fetching it would change the variables; compare "
                                 "a tensor computed before the updates")
        self.outputs = names

    def decision_shares(self) -> frozenset[str]:
        return frozenset(name for name in self.outputs if self.analysis.is_decision_share(name))

    def _spec(self, name: str, tensor_name: str) -> InputSpec:
        t = self.tensor(tensor_name)
        shape = None if t.shape.rank is None else tuple(t.shape.as_list())
        return InputSpec(name, t.name, t.dtype.as_datatype_enum, shape,
                         name if name in self.analysis.iterator_inputs else "")

    def tensor(self, name: str):
        try:
            return self.graph.get_tensor_by_name(tensor_name(name))
        except (KeyError, ValueError):
            raise InputError(f"{self.path}: no tensor named {name!r}") from None

    def setup_ops(self) -> set[str]:
        """Ops that only set variables up (:attr:`Analysis.setup`), and the saver the import
        built for a MetaGraph without one."""
        return self.analysis.setup | self._built

    def comparable(self) -> list[str]:
        return self.analysis.comparable()

    def uncomparable(self) -> dict[str, str]:
        """The analysis's (:meth:`Analysis.uncomparable`), and the tensors a :meth:`trace` could
        not fetch (``fetch_failed``), so that a tensor left out is counted, never dropped."""
        return {**self._unfetched, **self.analysis.uncomparable()}

    # -- variables ---------------------------------------------------------------------------
    def _variables(self):
        found = {}
        for key in ("variables", "local_variables"):
            for var in self.graph.get_collection(key):
                found.setdefault(var.op.name, var)
        return list(found.values())

    def initialize(self, checkpoint: str | None = None, skip: Mapping | set = ()) -> None:
        """Restore the variables from ``checkpoint``, else run the initializers of those not
        in ``skip`` (local variables, which checkpoints do not hold, always)."""
        variables = self._variables()
        if checkpoint:
            if self._saver is None:
                raise InputError(f"{self.path}: --checkpoint needs a MetaGraph with a saver")
            try:
                with self.graph.as_default():
                    self._saver.restore(self.session, checkpoint)
            except (tf.errors.OpError, ValueError) as exc:
                raise InputError(f"{checkpoint}: cannot restore: {str(exc).splitlines()[0]}") from None
            local = {v.op.name for v in self.graph.get_collection("local_variables")}
            variables = [v for v in variables if v.op.name in local]
        variables = [v for v in variables if v.op.name not in skip]
        if variables:
            with self.graph.as_default():
                init = tf.compat.v1.variables_initializer(variables)
            with run_errors(self.path):
                self.session.run(init)
        self._fill_tables()

    def _fill_tables(self) -> None:
        """Run the graph's lookup-table initializers, as ``tables_initializer`` and a
        SavedModel's main op do before the first lookup (a table is no variable: neither a
        checkpoint nor the variables' initializers fill it). A SavedModel's vocabulary files
        are fed from its ``assets/`` folder, as its loader feeds them. The saver's own
        imports (restoring a mutable table) are left to a checkpoint's restore."""
        setup = self.setup_ops()
        ops = [op for op in self.graph.get_operations()
               if op.type in TABLE_INITIALIZERS and op.name not in setup]
        if ops:
            with run_errors(self.path):
                self.session.run(ops, self._asset_feeds())

    def _asset_feeds(self) -> dict[str, str]:
        """Asset tensor -> its file in ``assets/``, read where TensorFlow's loader reads them:
        the MetaGraph's ``asset_file_def``, else (a TF1 builder's) its ``saved_model_assets``
        collection."""
        meta, folder = self.model.meta_graph, Path(self.path) / "assets"
        if meta is None or not folder.is_dir():
            return {}
        assets = list(meta.asset_file_def)
        if not assets and "saved_model_assets" in meta.collection_def:
            for packed in meta.collection_def["saved_model_assets"].any_list.value:
                assets.append(meta_graph_pb2.AssetFileDef())
                packed.Unpack(assets[-1])
        names = {op.name for op in self.graph.get_operations()}
        return {a.tensor_info.name: str(folder / a.filename) for a in assets
                if a.tensor_info.name.split(":")[0] in names}

    def variable_values(self) -> dict[str, np.ndarray]:
        variables = self._variables()
        with run_errors(self.path):
            return dict(zip((v.op.name for v in variables), self.session.run(variables)))

    def load_variables(self, values: Mapping[str, np.ndarray]) -> int:
        """Set the variables that ``values`` names; returns how many were set."""
        count = 0
        with self.graph.as_default(), run_errors(self.path):
            for var in self._variables():
                if var.op.name in values:
                    # feeding the initial value works for ref and resource variables alike
                    self.session.run(var.initializer, {var.initial_value: values[var.op.name]})
                    count += 1
        return count

    # -- initializers and iterators ---------------------------------------------------------------
    def start(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Run the initializers (:attr:`init_ops`), in order, once in this session: fed with
        the values ``feeds`` gives the placeholders among the inputs (an iterator over a
        dataset built from a placeholder reads it here)."""
        if self._started:
            return
        feed_dict = {s.tensor: feeds[s.name] for s in self.inputs
                     if not s.iterator and s.name in feeds}
        for op in self.init_ops:
            try:
                self.session.run(op, feed_dict)
            except (tf.errors.OpError, ValueError, TypeError) as exc:
                raise InputError(f"{self.path}: initializer {op} failed: {reason(exc)} (check "
                                 "--inputs / --init-op)") from None
        self._started = True

    def next_batch(self, specs: Sequence[InputSpec], feeds: Mapping[str, np.ndarray]) -> dict:
        """The next batch of the iterators whose outputs ``specs`` are, by input name, read in
        one run (after :meth:`start` with ``feeds``): each call takes the next batch."""
        self.start(feeds)
        names = ", ".join(s.name for s in specs)
        try:
            values = self.session.run([s.iterator for s in specs])
        except tf.errors.OutOfRangeError:
            raise InputError(f"{self.path}: the dataset ran out after {self._batches} batch(es) "
                             "(each sample takes the next batch): ask for fewer samples, or "
                             f"feed {names} from --inputs") from None
        except tf.errors.OpError as exc:
            raise InputError(f"{self.path}: cannot read a batch from the iterator: {reason(exc)} "
                             f"(name its initializer with --init-op NAME, or feed {names} from "
                             "--inputs)") from None
        self._batches += 1
        return {s.name: np.asarray(v) for s, v in zip(specs, values)}

    # -- running -----------------------------------------------------------------------------
    def callable(self, fetches: Sequence[str] | None = None):
        names = [spec.tensor for spec in self.inputs]
        fn = self.session.make_callable(list(fetches or self.outputs), names)
        keys = [spec.name for spec in self.inputs]

        def call(feeds):
            self.start(feeds)
            with run_errors(self.path):
                return [np.asarray(o) for o in fn(*[feeds[k] for k in keys])]
        return call

    def fetch(self, feeds: Mapping[str, np.ndarray], fetches: Sequence[str]) -> list[np.ndarray]:
        """Run once, fetching any tensors of the graph (not only the outputs); TensorFlow's
        own error (``tf.errors.OpError``) passes through, for callers that try again."""
        self.start(feeds)
        feed_dict = {spec.tensor: feeds[spec.name] for spec in self.inputs}
        return [np.asarray(o) for o in self.session.run(list(fetches), feed_dict)]

    def trace(self, feeds, names=None) -> Trace:
        """``names`` (default :meth:`comparable`) fetched in one run (if TensorFlow refuses one
        of them, each on its own, leaving out those that fail). In a loss-scaled graph the
        tensors that hold scaled values are divided by the scale, so they compare with the
        original's."""
        names = list(self.comparable() if names is None else names)
        scaled, scale = self.analysis.loss_scaled
        wanted = names + ([scale] if scale and scaled.intersection(names) else [])
        fetched = self._fetch_what_runs(feeds, wanted)
        self._unfetched.update((n, "fetch_failed") for n in names if n not in fetched)
        values, info = {}, {}
        for name in names:
            if name not in fetched:
                continue
            value = fetched[name]
            if name in scaled:
                if scale not in fetched:
                    continue
                value = value.astype(np.float64) / np.float64(fetched[scale])
            t = self.graph.get_tensor_by_name(name)
            values[name] = [value]
            info[name] = TensorInfo(t.op.type, t.dtype.name, {i.name for i in t.op.inputs},
                                    self.analysis.order.get(t.op.name, 0))
        info.update(self.analysis.variants)
        return Trace(values, info)

    def _fetch_what_runs(self, feeds, wanted: list[str]) -> dict[str, np.ndarray]:
        """``wanted`` fetched in one run, else one at a time, leaving out those that fail."""
        try:
            return dict(zip(wanted, self.fetch(feeds, wanted)))
        except tf.errors.OpError:
            log.info("fetching all tensors at once failed; fetching one at a time")
        fetched = {}
        for name in wanted:
            try:
                fetched[name] = self.fetch(feeds, [name])[0]
            except tf.errors.OpError:
                pass
        return fetched

    def close(self) -> None:
        self.session.close()


class SavedModelRunner(Runner):
    """One signature of a SavedModel, called eagerly through ``tf.saved_model.load``. A
    signature that writes variables (a train step) starts every run from the state the
    SavedModel saved (:class:`~amp_rewrite.tools.replay.SavedState`): one run is one step from
    the saved weights and optimizer state, whatever ran before."""

    def __init__(self, path: Path, signature: str | None = None):
        init_devices()
        try:
            loaded = tf.saved_model.load(str(path))
        except (OSError, ValueError, tf.errors.OpError) as exc:
            raise InputError(f"{path}: cannot load the SavedModel: {str(exc).splitlines()[0]}") from None
        sigs = loaded.signatures
        if not sigs:
            raise InputError(f"{path}: the SavedModel has no signatures to run")
        key = signature or ("serving_default" if "serving_default" in sigs else sorted(sigs)[0])
        if key not in sigs:
            raise InputError(f"{path}: no signature {key!r} (has: {', '.join(sorted(sigs))})")
        self.path, self.key, self._loaded, self.fn = path, key, loaded, sigs[key]
        specs = self.fn.structured_input_signature[1]
        parts = self._composites() if len(specs) > 1 else {}
        self.inputs = [InputSpec(k, k, s.dtype.as_datatype_enum,
                                 None if s.shape.rank is None else tuple(s.shape.as_list()),
                                 composite=parts.get(k, (None, ""))[0],
                                 part=parts.get(k, (None, ""))[1])
                       for k, s in sorted(specs.items())]
        self.outputs = sorted(self.fn.structured_outputs)
        self._tracer: SignatureReplay | GraphRunner | None = None
        self._state = saved_state(self.fn)   # taken before any run: the checkpoint's values

    def _composites(self) -> dict:
        """The signature's inputs that are components of a RaggedTensor or SparseTensor
        argument (:func:`~amp_rewrite.schema.inputs.signature_composites`), read off the
        SavedModel's MetaGraph; none where our reader refuses a SavedModel TensorFlow loaded
        (the signature then runs as before, its inputs plain)."""
        try:
            meta = serving_meta_graph(load(self.path), self.key)
        except InputError as exc:
            log.info("%s: the signature's inputs read as plain tensors: %s", self.path, exc)
            return {}
        return signature_composites(meta, self.key)

    def callable(self):
        def call(feeds):
            if self._state is not None:
                self._state.restore()
            with run_errors(self.path):
                result = self.fn(**{k: tf.constant(feeds[k]) for k in (s.name for s in self.inputs)})
                return [result[k].numpy() for k in self.outputs]
        return call

    def trace(self, feeds, names=None) -> Trace:
        """Every float tensor of the signature's computation. A TF2 signature calls a library
        function: its body, and the bodies of the functions it calls (While and If bodies,
        PartitionedCalls), are run one at a time with the values their callers pass, and their
        tensors are named ``function/node:port`` as the conversion report names nodes. A TF1
        signature reads the MetaGraph's own nodes: they are fetched as in a graph file.

        The signature itself runs first: inputs it refuses are the user's (exit 2); once it has
        run, a failure of the replay is ours (:func:`~amp_rewrite.tools.traces.replay_errors`)."""
        expected = self.callable()(feeds)
        with replay_errors(self.path, f"signature {self.key!r}"):
            if self._tracer is None:
                self._tracer = self._make_tracer()
            if isinstance(self._tracer, GraphRunner):
                return self._tracer.trace(feeds)
            trace = self._tracer.run(feeds)
        self._check_replay(expected, trace)
        return trace

    def uncomparable(self) -> dict[str, str]:
        """A TF1 signature's tensors are fetched as in a graph file: what that leaves out
        (known once :meth:`trace` has run); a TF2 signature's replay records every tensor,
        and leaves out only loss-scaled ones it cannot unscale
        (:func:`~amp_rewrite.tools.replay.unscale`)."""
        if isinstance(self._tracer, GraphRunner):
            return self._tracer.uncomparable()
        return dict(self._tracer.uncomparable) if self._tracer is not None else {}

    def _make_tracer(self):
        model = load(self.path)
        meta, sig, call = signature_call(model, self.key)
        if call is None:
            # a TF1 SavedModel: the signature's tensors are nodes of the MetaGraph
            prefix = Path(self.path) / "variables" / "variables"
            saved = meta.HasField("saver_def") and prefix.with_suffix(".index").exists()
            return GraphRunner(Analysis(Model(self.path, "metagraph", False, (meta,)), self.key),
                               checkpoint=str(prefix) if saved else None)
        return SignatureReplay(self, meta, sig, call, self._state)

    def _check_replay(self, expected: list[np.ndarray], trace: Trace) -> None:
        # a body run on its own must give what the whole signature gives, or the tensors
        # recorded are not the ones the signature computes (a random or stateful op inside)
        for name, want, got in zip(self.outputs, expected, self._tracer.last_outputs):
            numeric = want.dtype.kind in "biuf" or want.dtype.name == "bfloat16"
            if want.shape != got.shape or (
                    not np.allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                    rtol=1e-4, atol=1e-6, equal_nan=True)
                    if numeric else not np.array_equal(got, want)):
                raise InputError(
                    f"{self.path}: running signature {self.key!r} function by function does not "
                    f"reproduce its output {name!r} (a random or stateful op in its functions?): "
                    "--per-node cannot compare its function bodies")

    def close(self) -> None:
        if isinstance(self._tracer, GraphRunner):
            self._tracer.close()


class EmulatedSavedModelRunner(SavedModelRunner):
    """A float16 SavedModel's signature run as its float32 emulation
    (:mod:`amp_rewrite.transforms.emulate`): the emulated model is written to a temporary
    folder, its variables and assets linked to the model's (:func:`~amp_rewrite.io.save.write_linked`),
    loaded from there, and the folder is removed on :meth:`close`."""

    def __init__(self, path: Path, signature: str | None = None):
        model = emulated_model(load(path))
        self._scratch = Path(tempfile.mkdtemp(prefix="amp_rewrite_emulated_"))
        try:
            folder = self._scratch / path.name   # messages name the model's own folder name
            write_linked(model, folder)
            super().__init__(folder, signature)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)


def emulated_model(model: Model) -> Model:
    """``model`` (a converted float16 model) with every MetaGraph replaced by its float32
    emulation, a SavedModel's restored functions keeping their signatures."""
    graphs = []
    for meta in model.meta_graphs:
        new = type(meta)()
        new.CopyFrom(meta)
        roots = meta.object_graph_def.concrete_functions
        new.graph_def.CopyFrom(emulate_float16(meta.graph_def, roots=roots).graph_def)
        graphs.append(new)
    return dataclasses.replace(model, meta_graphs=tuple(graphs))


def open_model(model: str | os.PathLike | Model, *, signature: str | None = None,
               outputs: Sequence[str] = (), checkpoint: str | None = None,
               initialize: bool = True, emulate: bool = False,
               init_ops: Sequence[str] = ()) -> Runner:
    """A :class:`Runner` for a GraphDef / MetaGraphDef file, a SavedModel directory, or a
    loaded :class:`~amp_rewrite.io.load.Model` (a SavedModel runs from its directory)
    (``initialize=False``: a graph's variables are left for :func:`share_weights`;
    ``emulate``: a float16 graph runs as its float32 emulation, :mod:`amp_rewrite.transforms.emulate`;
    ``init_ops``: ops to run once before the first run, after those found, ``--init-op``)."""
    loaded = model if isinstance(model, Model) else None
    path = Path(model) if loaded is None else loaded.path if loaded.kind == "savedmodel" else None
    if path is not None and (path.is_dir() or path.name in SAVED_MODEL_FILES):
        folder = path if path.is_dir() else path.parent
        if outputs or checkpoint or init_ops:
            raise InputError(f"{folder}: --output, --checkpoint and --init-op apply "
                             "to graph files, not SavedModels")
        if emulate:
            return EmulatedSavedModelRunner(folder, signature)
        return SavedModelRunner(folder, signature)
    model = loaded or load(path)
    if emulate:
        model = emulated_model(model)
    return GraphRunner(Analysis(model, signature), outputs, checkpoint, initialize=initialize,
                       init_ops=init_ops)


@contextlib.contextmanager
def open_pair(original, converted, *, signature: str | None = None, outputs: Sequence[str] = (),
              checkpoint: str | None = None, emulate: bool = False,
              init_ops: Sequence[str] = ()):
    """An original and its conversion, ready to compare: the same inputs and number of outputs,
    and the same weights (a checkpoint is restored into the original, or its initializers run,
    once; its variable values are then copied into the converted graph, whose own extra state,
    such as a loss scale, is initialized): :func:`open_model`, then :func:`open_converted`;
    ``init_ops`` run in both.
    """
    with open_model(original, signature=signature, outputs=outputs, checkpoint=checkpoint,
                    init_ops=init_ops) as a:
        with open_converted(a, converted, signature=signature, outputs=outputs,
                            emulate=emulate) as b:
            yield a, b


def open_converted(original: Runner, converted, *, signature: str | None = None,
                   outputs: Sequence[str] = (), emulate: bool = False) -> Runner:
    """``converted`` (a path or a loaded :class:`~amp_rewrite.io.load.Model`) opened to compare
    with ``original``, already open with its weights: the same inputs and number of outputs,
    and ``original``'s variable values (see :func:`open_pair`).

    Without ``outputs`` (the user's choice, as ``original`` was opened with), a graph file
    without signatures compares the original's forward outputs (see
    :class:`~amp_rewrite.tools.analysis.Analysis`) and, for a training graph, its gradients: in a
    loss-scaled conversion the original's gradient against the converted graph's unscaled one
    (``<gradient node>/amp_unscaled:0``). An output named with ``outputs`` that the conversion
    scales is compared unscaled too. ``emulate`` runs the converted graph as its float32
    emulation. The initializers ``original`` was opened with (``--init-op``) run in it too.
    """
    chosen = bool(outputs)
    if not outputs and isinstance(original, GraphRunner) and not original.has_signature:
        # the converted graph keeps node names; its own "nodes nothing reads" would also
        # list what the conversion added (loss-scale state and such)
        outputs = original.outputs
    named = original.named_init_ops if isinstance(original, GraphRunner) else ()
    b = open_model(converted, signature=signature, outputs=outputs, initialize=False,
                   emulate=emulate, init_ops=named)
    try:
        if isinstance(b, GraphRunner):
            _pair_gradients(original, b, chosen)
        check_same_interface(original, b)
        share_weights(original, b)
    except BaseException:
        b.close()
        raise
    return b


def _pair_gradients(a: Runner, b: GraphRunner, chosen: bool) -> None:
    """Point the converted graph's outputs at unscaled gradients; add the gradients of a
    training graph to the default outputs."""
    unscaled = b.analysis.unscaled_gradients
    if not isinstance(a, GraphRunner):
        return
    grads = list(unscaled) if unscaled else a.analysis.gradients
    if not (a.has_signature or chosen):
        fetchable_a, fetchable_b = set(a.analysis.fetchable()), set(b.analysis.fetchable())
        added = [g for g in grads if g in fetchable_a and unscaled.get(g, g) in fetchable_b
                 and g not in a.outputs]
        a.set_outputs(a.outputs + added)
        b.outputs = list(a.outputs)
    a.gradients = frozenset(set(grads) & set(a.outputs))
    mapped = [unscaled.get(name, name) for name in b.outputs]
    if mapped != b.outputs:
        log.info("comparing %d gradients unscaled (<gradient>%s:0)",
                 sum(m != n for m, n in zip(mapped, b.outputs)), UNSCALED_SUFFIX)
    b.set_outputs(mapped)
    b.gradients = frozenset(unscaled.get(g, g) for g in a.gradients)


def share_weights(original: Runner, converted: Runner) -> None:
    """Give ``converted`` the variable values of ``original`` (variables keep their names and
    dtypes through conversion), so random initializers cannot make the two differ; variables
    only the converted graph has (its loss-scale state) are initialized, each once."""
    if not isinstance(converted, GraphRunner):
        return
    values = original.variable_values() if isinstance(original, GraphRunner) else {}
    if values:
        n = converted.load_variables(values)
        log.info("copied %d of %d variables into the converted graph", n, len(values))
    own = own_variables(original.analysis if isinstance(original, GraphRunner) else None,
                        converted.analysis)
    if own:
        log.warning("%d variables of the converted graph are not in the original (%s): they run "
                    "their own initializers, so the two may compute with different weights",
                    len(own), ", ".join(own[:3]) + (" ..." if len(own) > 3 else ""))
    converted.initialize(skip=values)


def check_same_interface(a: Runner, b: Runner) -> None:
    """Both models must take the same inputs and give the same number of outputs."""
    names_a, names_b = [s.name for s in a.inputs], [s.name for s in b.inputs]
    if names_a != names_b:
        raise InputError(f"the two models take different inputs: {names_a} and {names_b}")
    if len(a.outputs) != len(b.outputs):
        raise InputError(f"the two models give different outputs: {a.outputs} and {b.outputs}")
