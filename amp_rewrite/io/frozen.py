"""``--freeze``: a SavedModel's serving signatures frozen to GraphDefs, and the converted graphs
written back as a SavedModel that serves the same signatures.

:func:`freeze` loads the SavedModel with ``tf.saved_model.load`` (TensorFlow restores the
variables and runs the model's own restore and table-initializer functions: graph ops, never
Python) and freezes each signature with TensorFlow's ``convert_variables_to_constants_v2``, as
TF-TRT's ``TrtGraphConverterV2`` does: every variable a signature reads becomes a Const, and
the functions it calls are inlined. Each frozen graph is a MetaGraphDef whose ``signature_def``
names its inputs and outputs by the signature's keys, so the conversion keeps them float32 and
``--shape`` finds them; signatures that freeze to the same graph (a Keras export's ``serve``
and ``serving_default``) share one. A lookup table a signature reads (a vocabulary) stays a
table: its handle is a resource placeholder of the frozen graph, fed the loaded table.

:func:`write` writes the converted graphs as a new SavedModel (``tf.saved_model.save``), each
signature a function of the original's structured inputs (keys, dtypes, shapes) returning its
outputs under the original keys; the tables go with it, with their initializers and asset
files. Refused in one line (:class:`UnsupportedGraphError`): a SavedModel with no signature or
with more than one MetaGraph, a signature TensorFlow cannot freeze or that writes a variable
(a train step; :mod:`amp_rewrite.conversion.pipeline` refuses those by their gradients before
anything is loaded), and one whose resource is neither a variable nor a lookup table.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow.python.eager import def_function, wrap_function
from tensorflow.python.framework import ops
from tensorflow.python.trackable import resource as trackable_resource
from tensorflow.python.util import nest

from ..core.errors import InputError, IRError, UnsupportedGraphError
from ..core.ir import unused_name
from ..core.ops import STORED_VARIABLE
from .freezing import KEPT_INDEX, StandIn, freeze_function, hollowed

log = logging.getLogger(__name__)

#: the signature tf.saved_model.save adds to run a SavedModel's initializers: no signature to
#: freeze or to write (the new SavedModel gets its own)
INIT_SIGNATURE = "__saved_model_init_op"
#: the signature key served by default, frozen (and reported) first
DEFAULT_SIGNATURE = "serving_default"
#: The bytes of variables --freeze makes Consts, smallest first (read by every signature that
#: reads them, counted for each); the larger ones stay variables (:class:`KeptVariable`), stored
#: in the dtype painting picks. A Const is a protobuf message and the SavedModel's graphs are one
#: (2 GB at most, so a larger tensor or graph cannot be frozen at all), and each Const's bytes
#: are copied several times on their way (read, written as a Const, imported again, folded,
#: saved), where a kept variable is read once and written by TensorFlow's saver: the bound
#: keeps the conversion's memory at about twice the weights (docs/decisions.md "Frozen and
#: folded by default")
CONST_BYTES = 256 << 20


@dataclass(frozen=True)
class Signature:
    """One serving signature, frozen: its key, the frozen graph it runs (an index into
    :attr:`Frozen.meta_graphs`), its structured inputs (key -> ``tf.TensorSpec``) and outputs
    (key -> ``tf.TensorSpec``), and the resource placeholders of its graph fed a loaded lookup
    table (placeholder node -> the table's handle)."""

    key: str
    graph: int
    inputs: dict
    outputs: dict
    tables: dict = field(default_factory=dict)


@dataclass(frozen=True)
class KeptVariable:
    """A variable the frozen graphs keep (past :data:`CONST_BYTES`): the loaded variable, and
    the stand-in its readers read in the frozen graphs (:mod:`amp_rewrite.io.freezing`)."""

    variable: object
    name: str
    stand_in: StandIn

    @property
    def bytes(self) -> int:
        return int(np.prod(self.stand_in.shape)) * tf.as_dtype(self.stand_in.dtype).size


@dataclass(frozen=True)
class Method:
    """A ``tf.function`` method of the SavedModel's root that serves a frozen signature (a
    Keras export's ``serve``, a module's ``serve`` behind its ``serving_default``): written
    again as a method over that signature's frozen graph, so ``loaded.NAME(...)`` still works.
    ``inputs`` are its arguments' specs as traced (``(args, kwargs)``), ``in_keys`` the
    signature input key of each flattened argument, ``outputs`` its output structure and
    ``out_keys`` the signature output key of each flattened output."""

    name: str
    key: str
    inputs: tuple
    in_keys: tuple[str, ...]
    outputs: object
    out_keys: tuple[str, ...]


@dataclass
class Frozen:
    """A SavedModel's signatures, frozen: the graphs (one MetaGraphDef each, ``signature_def``
    keyed as the signatures it serves), the signatures, the variables made Consts and those
    kept, and what the written SavedModel needs of the loaded one (its lookup tables and kept
    variables, alive here)."""

    path: Path
    meta_graphs: list[meta_graph_pb2.MetaGraphDef]
    signatures: list[Signature]
    variables: int = 0
    tables: list = field(default_factory=list)   # the loaded tables the signatures read
    loaded: object = None                        # keeps the tables' resources alive
    methods: list[Method] = field(default_factory=list)   # carried into the output
    dropped: list[str] = field(default_factory=list)      # methods the output does not carry
    kept: list[KeptVariable] = field(default_factory=list)   # variables, not Consts
    const_bytes: int = 0   # the bound on Consts that kept them (CONST_BYTES)

    def summary(self, by_default: bool = False, graphs=None) -> dict:
        """The report's ``freeze`` entry (``by_default``: frozen without --freeze; ``graphs``:
        the converted frozen graphs, which say the dtype each kept variable is stored in)."""
        shared = {}
        for sig in self.signatures:
            shared.setdefault(sig.graph, []).append(sig.key)
        keys = [s.key for s in self.signatures]
        graphs_n = len(self.meta_graphs)
        stored = stored_dtypes(graphs if graphs is not None else self.meta_graphs)
        kept = [{"name": k.name, "shape": list(k.stand_in.shape), "bytes": k.bytes,
                 "stored": sorted(tf.as_dtype(d).name for d in stored.get(i, ()))}
                for i, k in enumerate(self.kept)]
        text = (f"{len(keys)} signature{'s' * (len(keys) != 1)} frozen ({', '.join(keys)}; "
                f"{graphs_n} graph{'s' * (graphs_n != 1)} converted), {self.variables} "
                f"variable{'s' * (self.variables != 1)} made Consts, folded (--fold-constants)"
                + _kept_text(kept, self.const_bytes)
                + (f"; {len(self.tables)} lookup table{'s' * (len(self.tables) != 1)} kept"
                   if self.tables else "")
                + (f"; methods carried: {', '.join(m.name for m in self.methods)}"
                   if self.methods else "")
                + (f"; NOT carried into the output: method{'s' * (len(self.dropped) > 1)} "
                   f"{', '.join(self.dropped)} (only the signatures and the methods that "
                   "serve them are)" if self.dropped else "")
                + ("; frozen by default: a SavedModel that only serves runs faster frozen on "
                   "a CPU, --no-freeze keeps the variables" if by_default else ""))
        return {"signatures": keys, "graphs": [shared[i] for i in sorted(shared)],
                "variables": self.variables, "kept": kept, "tables": len(self.tables),
                "methods": [m.name for m in self.methods], "dropped": list(self.dropped),
                "by_default": by_default, "summary": text}


def _kept_text(kept: list[dict], bound: int) -> str:
    """The summary's words for the variables kept: how many, their bytes, the dtypes."""
    if not kept:
        return ""
    size = sum(k["bytes"] for k in kept)
    by = {}
    for k in kept:
        for name in k["stored"]:
            by[name] = by.get(name, 0) + 1
    dtypes = ", ".join(f"{n} in {name}" for name, n in sorted(by.items()))
    return (f"; {len(kept)} variable{'s' * (len(kept) != 1)} ({_size(size)}) kept as "
            f"variables, past the {_size(bound)} frozen graphs hold as Consts, stored "
            f"{dtypes}")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def stored_dtypes(meta_graphs) -> dict[int, set[int]]:
    """The dtypes each kept variable (by its index in :attr:`Frozen.kept`) is read in by the
    frozen graphs ``meta_graphs``: the dtype of its stand-ins, as painted."""
    out: dict[int, set[int]] = {}
    for meta in meta_graphs:
        for node in meta.graph_def.node:
            if node.op == "Placeholder" and STORED_VARIABLE in node.attr:
                index = int(node.attr[KEPT_INDEX].i)
                out.setdefault(index, set()).add(node.attr["dtype"].type)
    return out


def freeze(path: str | os.PathLike, meta_graphs, *, measure: bool = False,
           const_bytes: int | None = None) -> Frozen:
    """Freeze every serving signature of the SavedModel at ``path`` (its parsed MetaGraphDefs
    ``meta_graphs``, checked first): its variables Consts, but for those past ``const_bytes``
    (None: :data:`CONST_BYTES`), which stay variables (:func:`kept_variables`). ``measure``:
    find the largest finite magnitude each kept variable holds (float16's range needs it)."""
    path = Path(path)
    check_freezable(path, meta_graphs)
    loaded = _load(path)
    keys = sorted(loaded.signatures, key=lambda k: (k != DEFAULT_SIGNATURE, k))
    out = Frozen(path, [], [], loaded=loaded,
                 const_bytes=CONST_BYTES if const_bytes is None else const_bytes)
    seen: dict[bytes, int] = {}
    variables: set[int] = set()
    resources = _resources(loaded)
    functions = [loaded.signatures[key] for key in keys]
    out.kept = kept_variables(functions, resources, _paths(loaded), out.const_bytes, measure)
    for key, fn in zip(keys, functions):
        meta = meta_graph_pb2.MetaGraphDef()
        inputs, outputs, tables, read = _freeze_one(path, key, fn, resources, out.kept,
                                                    meta.graph_def)
        variables |= read
        digest = _digest(meta.graph_def)
        if digest not in seen:
            seen[digest] = len(out.meta_graphs)
            out.meta_graphs.append(meta)
        del meta
        index = seen[digest]
        out.meta_graphs[index].signature_def[key].CopyFrom(_signature_def(fn, inputs, outputs))
        out.signatures.append(Signature(key, index, dict(fn.structured_input_signature[1]),
                                        dict(fn.structured_outputs), tables))
        for handle in tables.values():
            if not any(resources[id(handle)] is t for t in out.tables):
                out.tables.append(resources[id(handle)])
    out.variables = len(variables - {id(k.variable) for k in out.kept})
    out.methods, out.dropped = _methods(loaded, out.signatures)
    if not out.tables:   # the values made Consts, read: the loaded model's copy goes
        out.loaded = None
        del loaded, resources, functions, fn
        gc.collect()
    return out


def check_freezable(path: str | os.PathLike, meta_graphs) -> None:
    """Refuse (:class:`UnsupportedGraphError`) a SavedModel --freeze cannot take, by its parsed
    MetaGraphDefs: more than one MetaGraph, or no serving signature; each says what to do."""
    if len(meta_graphs) != 1:
        tags = "; ".join(",".join(m.meta_info_def.tags) for m in meta_graphs)
        raise UnsupportedGraphError(f"{path}: --freeze takes a SavedModel with one MetaGraph, "
                                    f"this one has {len(meta_graphs)} ({tags}); convert "
                                    "without --freeze, or export the serving MetaGraph alone")
    if not serving_keys(meta_graphs[0]):
        raise UnsupportedGraphError(f"{path}: --freeze freezes a SavedModel's signatures, and "
                                    "it has none; export the model with a serving signature, "
                                    "or convert without --freeze")


def _digest(graph_def) -> bytes:
    """A digest of ``graph_def``'s deterministic bytes, a node at a time (not all at once)."""
    h = hashlib.sha256()
    for field, value in graph_def.ListFields():
        if field.name != "node":
            h.update(field.name.encode() + value.SerializeToString(deterministic=True))
    for node in graph_def.node:
        h.update(node.SerializeToString(deterministic=True))
    return h.digest()


def kept_variables(functions, resources: dict, paths: dict, const_bytes: int,
                   measure: bool = False) -> list[KeptVariable]:
    """The variables the signatures' ``functions`` read that stay variables: made Consts
    smallest first (by bytes, then attribute path: ``paths``), each counted once for every
    signature that reads it, while their total stays within ``const_bytes``; all the larger
    ones are kept, in that order. ``measure``: each kept one's largest finite magnitude, in
    slices (no copy of it)."""
    reads: dict[int, int] = {}
    found: dict[int, tf.Variable] = {}
    for fn in functions:
        for external, _ in fn.graph.captures:
            owner = resources.get(id(external))
            if isinstance(owner, tf.Variable):
                found[id(owner)] = owner
                reads[id(owner)] = reads.get(id(owner), 0) + 1
    order = sorted(found.values(), key=lambda v: (_bytes(v), paths.get(id(v), v.name)))
    total, kept = 0, []
    for var in order:
        total += _bytes(var) * reads[id(var)]
        if total > const_bytes or kept:
            spec = StandIn(len(kept), var.dtype.as_datatype_enum, tuple(var.shape.as_list()),
                           _largest(var) if measure else -1.0)
            kept.append(KeptVariable(var, paths.get(id(var), var.name.split(":")[0]), spec))
    return kept


def _bytes(var) -> int:
    return int(np.prod(var.shape.as_list())) * var.dtype.size


#: the bytes of a slice :func:`_largest` reads at once
_SLICE_BYTES = 64 << 20


def _largest(var) -> float:
    """The largest finite magnitude ``var`` holds (0 for no float), a slice at a time."""
    if not var.dtype.is_floating:
        return 0.0
    shape = var.shape.as_list()
    if not shape:
        values = [var.read_value()]
    else:
        rows = max(1, _SLICE_BYTES // max(1, _bytes(var) // max(1, shape[0])))
        values = (var[i:i + rows] for i in range(0, shape[0], rows))
    largest = 0.0
    for chunk in values:
        finite = tf.where(tf.math.is_finite(chunk), tf.abs(chunk), tf.zeros_like(chunk))
        largest = max(largest, float(tf.reduce_max(finite)) if tf.size(chunk) else 0.0)
    return largest


def _methods(loaded, signatures: list[Signature]) -> tuple[list[Method], list[str]]:
    """The ``tf.function`` methods of the loaded SavedModel: those of its root that serve one
    of the frozen ``signatures`` (traced once, the signature's wrapper calling that trace,
    its flattened arguments named as the signature's inputs, its outputs the signature's by
    key or as ``output_0``, ``output_1`` ... in order), and the names of all the others."""
    callees = {}
    for sig in signatures:
        fn = loaded.signatures[sig.key]
        for nd in fn.function_def.node_def:
            if "f" in nd.attr and nd.attr["f"].func.name:
                callees.setdefault(nd.attr["f"].func.name, sig)
    carried, dropped = [], []
    for path, fn in _functions(loaded):
        method = (_serving_method(path, fn, callees)
                  if "." not in path and isinstance(fn, def_function.Function) else None)
        (carried.append(method) if method is not None else dropped.append(path))
    return carried, dropped


def _functions(root) -> list[tuple[str, object]]:
    """Every ``tf.function`` the object graph under ``root`` holds, by its attribute path, and
    every concrete function it holds bare (``m.f = fn.get_concrete_function(...)``)."""
    found, seen, stack = [], {id(root)}, [("", root)]
    while stack:
        prefix, obj = stack.pop()
        for name, child in sorted(obj._trackable_children().items()):
            if name == "signatures" or id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{name}"
            if isinstance(child, (def_function.Function, tf.types.experimental.ConcreteFunction)):
                found.append((path, child))
            elif not isinstance(child, (tf.Variable, trackable_resource.CapturableResource)):
                stack.append((path + ".", child))
    return sorted(found, key=lambda pf: pf[0])


def _serving_method(name: str, fn, callees: dict) -> Method | None:
    """``fn`` (the root's method ``name``) as a :class:`Method`, or None where it serves no
    frozen signature in a way the output can say again."""
    traces = fn._list_all_concrete_functions_for_serialization()
    if len(traces) != 1 or traces[0].name.decode() not in callees:
        return None
    trace, sig = traces[0], callees[traces[0].name.decode()]
    specs = nest.flatten(trace.structured_input_signature)
    if not all(isinstance(s, tf.TensorSpec) for s in specs) \
            or sorted(s.name for s in specs) != sorted(sig.inputs):
        return None
    outs, keys = nest.flatten(trace.structured_outputs), sorted(sig.outputs)
    if isinstance(trace.structured_outputs, dict) and sorted(trace.structured_outputs) == keys:
        out_keys = keys                                   # flattened by sorted key, as here
    elif keys == sorted(f"output_{i}" for i in range(len(outs))):
        out_keys = [f"output_{i}" for i in range(len(outs))]   # a Keras export's serve
    else:
        return None
    return Method(name, sig.key, trace.structured_input_signature,
                  tuple(s.name for s in specs), trace.structured_outputs, tuple(out_keys))


def serving_keys(meta: meta_graph_pb2.MetaGraphDef) -> list[str]:
    """The signature keys of ``meta`` --freeze freezes: all but the initializers'."""
    return sorted(k for k in meta.signature_def if k != INIT_SIGNATURE)


def _load(path: Path):
    try:
        return tf.saved_model.load(str(path))
    except (tf.errors.OpError, OSError, ValueError, IndexError) as exc:
        # what TensorFlow's loader raises for a damaged or incomplete SavedModel: its status
        # errors (an OpError, or as its bindings map the codes: ValueError for
        # INVALID_ARGUMENT, IndexError for OUT_OF_RANGE, a truncated variables file), an
        # OSError for a missing file; anything else is not known to be the input's (exit 70)
        raise InputError(f"{path}: TensorFlow could not load the SavedModel to freeze it: "
                         f"{_first_line(exc)}") from None


def _freeze_one(path: Path, key: str, fn, resources: dict, kept: list[KeptVariable], out):
    """``fn`` (signature ``key``) frozen into the GraphDef ``out``, the variables ``kept``
    left as stand-ins: its data input and output tensors (in the order of the flattened
    structured inputs and outputs), the placeholders fed a lookup table (node -> the loaded
    handle) and the ids of the variables it reads."""
    args, kwargs = fn.structured_input_signature
    if args:
        raise UnsupportedGraphError(f"{path}: signature {key!r} takes positional inputs; a "
                                    "signature takes its inputs by name")
    captured = {internal.name: external for external, internal in fn.graph.captures}
    variables = {id(resources[id(external)]) for external, _ in fn.graph.captures
                 if isinstance(resources.get(id(external)), tf.Variable)}
    by_id = {id(k.variable): k for k in kept}
    stand_ins = {internal.name.split(":")[0]: by_id[id(resources[id(external)])].stand_in
                 for external, internal in fn.graph.captures
                 if id(resources.get(id(external))) in by_id}
    try:
        frozen_inputs, frozen_outputs = freeze_function(fn, stand_ins, out)
    except (ValueError, KeyError, tf.errors.OpError) as exc:
        # the refusal of the signature's graph by TensorFlow's freezing (ValueError, a
        # KeyError for what it cannot find, grappler's status errors, the import's); its
        # RuntimeError and NotImplementedError mean it was misused: ours (exit 70)
        raise UnsupportedGraphError(f"{path}: signature {key!r} cannot be frozen: "
                                    f"{_first_line(exc)}; convert without --freeze (or with "
                                    "--no-freeze: the variables kept)") from None
    data = len(fn.inputs) - len(fn.captured_inputs)
    names = {t.name for t in fn.inputs[:data]}
    inputs = [name for name in frozen_inputs if name in names]
    tables = {}
    for name in frozen_inputs:
        if name in names or name.split(":")[0] in stand_ins:
            continue
        external = captured.get(name)
        if external is None or external.dtype != tf.resource:
            raise UnsupportedGraphError(f"{path}: signature {key!r}: freezing left input "
                                        f"{name} unfed")
        owner = resources.get(id(external))
        if isinstance(owner, tf.Variable):
            raise UnsupportedGraphError(
                f"{path}: signature {key!r} writes variable {owner.name!r} (or passes its "
                "handle on): its value changes as the model runs, so it cannot be frozen; "
                "convert without --freeze")
        if owner is None:
            raise UnsupportedGraphError(
                f"{path}: signature {key!r} reads a resource the SavedModel does not track as "
                f"a variable or table ({name}); --freeze cannot keep it: convert without "
                "--freeze")
        tables[name.split(":")[0]] = external
    if len(inputs) != data:
        raise UnsupportedGraphError(f"{path}: signature {key!r}: an input was lost in freezing")
    _canonical(out.node, {name.split(":")[0] for name in frozen_inputs})
    return inputs, list(frozen_outputs), tables, variables


def _canonical(nodes, fed: set[str]) -> None:
    """Make ``nodes`` (a GraphDef's or a function body's) the same in every run, in place:
    without the Placeholders nothing reads and nothing in ``fed`` feeds, nor the
    ``_has_manual_control_dependencies`` marks, in name order.

    Freezing prunes the function through ``lift_to_graph``, which walks a set: the order of
    the nodes it copies changes from one Python process to the next, and so does the number
    of ``unused_control_flow_input`` placeholders it puts in for loop inputs not copied yet
    (then rewires their readers to the copies), marking the nodes it gives control inputs
    that way for tf.function's automatic control dependencies, which a frozen graph imported
    whole never meets. A conversion is deterministic (tests/test_determinism.py): the frozen
    graph is put in one order, those dropped. (In place: its Consts may hold gigabytes.)"""
    _drop_dead_placeholders(nodes, fed)
    nodes.sort(key=lambda node: node.name)
    for node in nodes:
        if _MANUAL_CONTROL in node.attr:
            del node.attr[_MANUAL_CONTROL]


_MANUAL_CONTROL = "_has_manual_control_dependencies"


def _drop_dead_placeholders(nodes, fed: set[str]) -> None:
    """Delete from ``nodes`` (a GraphDef's or a function body's) the Placeholders nothing
    among them reads and that are not in ``fed``: the ones ``lift_to_graph`` leaves (see
    :func:`_canonical`)."""
    read = set()
    for node in nodes:
        read.update(name.lstrip("^").split(":")[0] for name in node.input)
    dead = [i for i, node in enumerate(nodes)
            if node.op == "Placeholder" and node.name not in read and node.name not in fed]
    for i in reversed(dead):
        del nodes[i]


def _signature_def(fn, inputs: list[str], outputs: list[str]) -> meta_graph_pb2.SignatureDef:
    """The SignatureDef of the frozen graph for ``fn``: its keys, on the frozen tensors."""
    sig = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    in_specs = fn.structured_input_signature[1]
    for key, name in zip(sorted(in_specs), inputs):
        sig.inputs[key].CopyFrom(_info(name, in_specs[key]))
    out_specs = fn.structured_outputs
    for key, name in zip(sorted(out_specs), outputs):
        sig.outputs[key].CopyFrom(_info(name, out_specs[key]))
    return sig


def _info(name: str, spec) -> meta_graph_pb2.TensorInfo:
    info = meta_graph_pb2.TensorInfo(name=name, dtype=spec.dtype.as_datatype_enum)
    info.tensor_shape.CopyFrom(tf.TensorShape(spec.shape).as_proto())
    return info


def _paths(root) -> dict[int, str]:
    """Each object under ``root`` by id: its first attribute path, breadth first (``w/0``)."""
    paths, queue = {id(root): ""}, [root]
    for obj in queue:
        for name, child in sorted(obj._trackable_children().items()):
            if id(child) not in paths:
                paths[id(child)] = f"{paths[id(obj)]}/{name}".lstrip("/")
                queue.append(child)
    return paths


def _resources(loaded) -> dict[int, object]:
    """The variables and other resources (lookup tables) the loaded SavedModel tracks, by the
    id of their handle (the tensor a signature captures)."""
    seen, stack, out = set(), [loaded], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        handle = _handle(obj)
        if handle is not None:
            out[id(handle)] = obj
        stack.extend(obj._trackable_children().values())
    return out


def _handle(obj):
    try:
        if isinstance(obj, trackable_resource.CapturableResource):   # a table, restored or not
            return obj.resource_handle
        if isinstance(obj, tf.Variable):
            return obj.handle
    except (AttributeError, ValueError, TypeError, RuntimeError):
        pass
    return None


def write(frozen: Frozen, meta_graphs, folder: str | os.PathLike) -> None:
    """Write the converted frozen graphs ``meta_graphs`` (in :attr:`Frozen.meta_graphs`'
    order) as a SavedModel in the new, empty ``folder``: each signature of ``frozen`` with its
    keys, dtypes and shapes, its lookup tables tracked (with their initializers and assets),
    each kept variable a variable of the dtype its stand-in was painted (its value cast once,
    here), written by TensorFlow's saver into ``variables/``. Signatures that run the same
    graph on the same tensors share its function, so its weights are written once.

    TensorFlow holds a function's Consts once for each graph that calls it, and four or five
    times more as it saves (thirteen times their bytes in all, on a frozen model's weights):
    the SavedModel is written with its large Consts' values left out
    (:func:`~amp_rewrite.io.freezing.hollowed`), and ``saved_model.pb`` then written again
    with them, once (:func:`_finish`); its ``fingerprint.pb`` goes, to be written again for the
    bytes that stand (:func:`amp_rewrite.io.save` does)."""
    # the functions traced here are numbered on from TensorFlow's process-wide counter, which
    # freezing and pruning (lift_to_graph) move on by a number that changes from run to run
    first = ops.uid()
    module = tf.Module()
    module.amp_lookup_tables = list(frozen.tables)
    functions, signatures, stored, values = {}, {}, {}, []
    for sig in frozen.signatures:
        meta = meta_graphs[sig.graph]
        sd = meta.signature_def[sig.key]
        in_keys, out_keys = sorted(sig.inputs), sorted(sig.outputs)
        tensors = (tuple(sd.inputs[k].name for k in in_keys),
                   tuple(sd.outputs[k].name for k in out_keys))
        if (sig.graph, tensors) not in functions:
            graph_def, handles = _serving_graph(meta.graph_def, frozen.kept, stored, values)
            functions[sig.graph, tensors] = wrap_function.function_from_graph_def(
                graph_def, list(tensors[0]), list(tensors[1]), {**sig.tables, **handles})
        signatures[sig.key] = _serving_function(sig, functions[sig.graph, tensors])
    module.amp_variables = [stored[k] for k in sorted(stored)]
    for method in frozen.methods:
        setattr(module, method.name, _method_function(method, signatures[method.key]))
    # a frozen graph serves: no custom gradient is saved (nor any gradient function traced)
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    tf.saved_model.save(module, str(folder), signatures=signatures, options=options)
    del functions, signatures, module
    _finish(Path(folder), values, first)


def _finish(folder: Path, values: list, first: int) -> None:
    """The SavedModel TensorFlow wrote at ``folder`` finished, read and written once: the
    large Consts' values put in (``values``: each Const's node, by the index its hollow copy
    carries in :data:`_HOLLOW`), once each, and the model made the same in every run: its
    functions, and their nodes, in name order, without the placeholders nothing reads and the
    ``_has_manual_control_dependencies`` marks (``function_from_graph_def`` copies a graph's
    nodes in the order it walks a set, which changes from one Python process to the next),
    the functions traced since TensorFlow's counter stood at ``first`` numbered 0, 1, ... in
    the order they were traced (the counter moves on between them by as much as those walks
    take), where that names no function twice. Its ``fingerprint.pb`` goes, to be written
    again for the bytes that stand (:func:`amp_rewrite.io.save` does)."""
    path = folder / "saved_model.pb"
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString(path.read_bytes())
    filled = set()
    for meta in saved.meta_graphs:
        library = meta.graph_def.library
        for nodes in [meta.graph_def.node] + [f.node_def for f in library.function]:
            for node in nodes:
                if _HOLLOW in node.attr:
                    index = node.attr[_HOLLOW].i
                    node.attr["value"].tensor.CopyFrom(values[index].attr["value"].tensor)
                    del node.attr[_HOLLOW]
                    filled.add(index)
        for function in library.function:
            returned = set(function.ret.values()) | set(function.control_ret.values())
            _canonical(function.node_def, {r.split(":")[0] for r in returned})
        names = {f.signature.name for f in library.function}
        traced = []
        for name in names:
            stem, _, number = name.rpartition("_")
            if name.startswith("__inference_") and number.isdigit() and int(number) >= first:
                traced.append((int(number), stem, name))
        renamed = {name: f"{stem}_{rank}" for rank, (_, stem, name) in enumerate(sorted(traced))}
        if renamed and len(set(renamed.values()) | (names - set(renamed))) == len(names):
            _rename_functions(meta, renamed)
        library.function.sort(key=lambda f: f.signature.name)
    if len(filled) != len(values):   # a Const TensorFlow did not write: ours to know
        raise IRError(f"{len(values) - len(filled)} of the frozen graphs' {len(values)} large "
                      "Consts are not in the SavedModel TensorFlow wrote")
    data = saved.SerializeToString(deterministic=True)
    del saved
    path.write_bytes(data)
    (folder / "fingerprint.pb").unlink(missing_ok=True)   # the hollow graph's


def _rename_functions(meta: meta_graph_pb2.MetaGraphDef, renamed: dict[str, str]) -> None:
    """Every function of ``meta`` named in ``renamed`` called by its new name, wherever a
    SavedModel names one: the library, its gradients, function attrs of graph and function
    nodes, the object graph's concrete functions."""
    library = meta.graph_def.library
    for function in library.function:
        function.signature.name = renamed.get(function.signature.name, function.signature.name)
    for gradient in library.gradient:
        gradient.function_name = renamed.get(gradient.function_name, gradient.function_name)
        gradient.gradient_func = renamed.get(gradient.gradient_func, gradient.gradient_func)

    def attrs(value):
        if value.HasField("func"):
            value.func.name = renamed.get(value.func.name, value.func.name)
            for inner in value.func.attr.values():
                attrs(inner)
        elif value.HasField("list"):
            for func in value.list.func:
                func.name = renamed.get(func.name, func.name)

    for nodes in [meta.graph_def.node] + [f.node_def for f in library.function]:
        for node in nodes:
            for value in node.attr.values():
                attrs(value)
    objects = meta.object_graph_def
    for old, new in renamed.items():
        if old in objects.concrete_functions:
            objects.concrete_functions[new].CopyFrom(objects.concrete_functions[old])
            del objects.concrete_functions[old]
    for obj in objects.nodes:
        if obj.HasField("function"):
            names = [renamed.get(n, n) for n in obj.function.concrete_functions]
            del obj.function.concrete_functions[:]
            obj.function.concrete_functions.extend(names)
        elif obj.HasField("bare_concrete_function"):
            bare = obj.bare_concrete_function
            bare.concrete_function_name = renamed.get(bare.concrete_function_name,
                                                      bare.concrete_function_name)


#: the attr of a large Const written without its values: the index of its node in the list
#: :func:`_finish` puts them back from
_HOLLOW = "_amp_hollow"


def _serving_graph(graph_def, kept: list[KeptVariable], stored: dict, values: list):
    """``graph_def`` as it is served, without its large Consts' values
    (:func:`~amp_rewrite.io.freezing.hollowed`: each marked :data:`_HOLLOW` with its index in
    ``values``, where its node is added): without the custom-gradient marks its nodes carry
    (Keras' swish: a frozen graph serves, and a loader would warn that their gradients were
    not saved), and each stand-in a ``ReadVariableOp`` of its name and dtype reading a new
    resource placeholder; returns it and the handles those placeholders capture (placeholder
    -> the handle of the variable in ``stored``, (index, dtype) -> variable, made here)."""
    out, held = hollowed(graph_def)
    for node in out.node:
        if node.name in held:
            node.attr[_HOLLOW].i = len(values)
            values.append(held[node.name])
    for nodes in [out.node] + [f.node_def for f in out.library.function]:
        for node in nodes:
            if _CUSTOM_GRADIENT in node.attr:
                del node.attr[_CUSTOM_GRADIENT]
    names = {n.name for n in out.node}
    handles = {}
    for node in [n for n in out.node if n.op == "Placeholder" and STORED_VARIABLE in n.attr]:
        index, dtype = int(node.attr[KEPT_INDEX].i), node.attr["dtype"].type
        if (index, dtype) not in stored:
            stored[index, dtype] = _stored_variable(kept[index], dtype)
        handle = unused_name(f"{node.name}/amp_variable", names)
        names.add(handle)
        placeholder = out.node.add(name=handle, op="Placeholder")
        placeholder.attr["dtype"].type = tf.resource.as_datatype_enum
        placeholder.attr["shape"].shape.CopyFrom(tf.TensorShape([]).as_proto())
        placeholder.attr["_handle_dtypes"].list.type.append(dtype)
        placeholder.attr["_handle_shapes"].list.shape.add().CopyFrom(node.attr["shape"].shape)
        node.op = "ReadVariableOp"
        node.input.append(handle)
        for attr in (STORED_VARIABLE, KEPT_INDEX, "shape"):
            del node.attr[attr]
        handles[handle] = stored[index, dtype].handle
    return out, handles


def _stored_variable(kept: KeptVariable, dtype: int):
    """The variable of ``dtype`` holding ``kept``'s value: the loaded one, or a new one of its
    value cast once (not trained: a frozen graph serves)."""
    if kept.variable.dtype.as_datatype_enum == dtype:
        return kept.variable
    return tf.Variable(tf.cast(kept.variable, tf.as_dtype(dtype)), trainable=False,
                       name=kept.name)


_CUSTOM_GRADIENT = "_gradient_op_type"


def _serving_function(sig: Signature, graph_fn):
    """Signature ``sig`` as a concrete function over its converted graph ``graph_fn`` (which
    takes and returns the tensors of its sorted input and output keys): called by the input
    keys, returning its outputs by their keys."""
    in_keys, out_keys = sorted(sig.inputs), sorted(sig.outputs)

    def serve(**inputs):
        results = graph_fn(*[inputs[k] for k in in_keys])
        return dict(zip(out_keys, nest.flatten(results)))

    return tf.function(serve).get_concrete_function(**sig.inputs)


def _method_function(method: Method, serving) -> object:
    """``method`` again, over ``serving`` (its signature's concrete function in the new
    SavedModel): traced with the original's arguments, returning its output structure."""

    def call(*args, **kwargs):
        results = serving(**dict(zip(method.in_keys, nest.flatten((args, kwargs)))))
        return nest.pack_sequence_as(method.outputs, [results[k] for k in method.out_keys])

    fn = tf.function(call)
    args, kwargs = method.inputs
    fn.get_concrete_function(*args, **kwargs)
    return fn


def _first_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + " ..."
