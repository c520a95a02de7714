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

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow.python.eager import def_function, wrap_function
from tensorflow.python.framework import ops
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
from tensorflow.python.saved_model import fingerprinting_utils
from tensorflow.python.trackable import resource as trackable_resource
from tensorflow.python.util import nest

from ..core.errors import InputError, UnsupportedGraphError

log = logging.getLogger(__name__)

#: the signature tf.saved_model.save adds to run a SavedModel's initializers: no signature to
#: freeze or to write (the new SavedModel gets its own)
INIT_SIGNATURE = "__saved_model_init_op"
#: the signature key served by default, frozen (and reported) first
DEFAULT_SIGNATURE = "serving_default"


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
    keyed as the signatures it serves), the signatures, the variables made Consts, and what
    the written SavedModel needs of the loaded one (its lookup tables, kept alive here)."""

    path: Path
    meta_graphs: list[meta_graph_pb2.MetaGraphDef]
    signatures: list[Signature]
    variables: int = 0
    tables: list = field(default_factory=list)   # the loaded tables the signatures read
    loaded: object = None                        # keeps the tables' resources alive
    methods: list[Method] = field(default_factory=list)   # carried into the output
    dropped: list[str] = field(default_factory=list)      # methods the output does not carry

    def summary(self, by_default: bool = False) -> dict:
        """The report's ``freeze`` entry (``by_default``: frozen without --freeze)."""
        shared = {}
        for sig in self.signatures:
            shared.setdefault(sig.graph, []).append(sig.key)
        keys = [s.key for s in self.signatures]
        graphs = len(self.meta_graphs)
        text = (f"{len(keys)} signature{'s' * (len(keys) != 1)} frozen ({', '.join(keys)}; "
                f"{graphs} graph{'s' * (graphs != 1)} converted), {self.variables} "
                f"variable{'s' * (self.variables != 1)} made Consts, folded (--fold-constants)"
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
                "variables": self.variables, "tables": len(self.tables),
                "methods": [m.name for m in self.methods], "dropped": list(self.dropped),
                "by_default": by_default, "summary": text}


def freeze(path: str | os.PathLike, meta_graphs) -> Frozen:
    """Freeze every serving signature of the SavedModel at ``path`` (its parsed MetaGraphDefs
    ``meta_graphs``, checked first)."""
    path = Path(path)
    if len(meta_graphs) != 1:
        tags = "; ".join(",".join(m.meta_info_def.tags) for m in meta_graphs)
        raise UnsupportedGraphError(f"{path}: --freeze takes a SavedModel with one MetaGraph, "
                                    f"this one has {len(meta_graphs)} ({tags})")
    if not serving_keys(meta_graphs[0]):
        raise UnsupportedGraphError(f"{path}: --freeze freezes a SavedModel's signatures, and "
                                    "it has none; export the model with a serving signature")
    loaded = _load(path)
    keys = sorted(loaded.signatures, key=lambda k: (k != DEFAULT_SIGNATURE, k))
    out = Frozen(path, [], [], loaded=loaded)
    seen: dict[bytes, int] = {}
    variables: set[int] = set()
    resources = _resources(loaded)
    for key in keys:
        fn = loaded.signatures[key]
        graph_def, inputs, outputs, tables, read = _freeze_one(path, key, fn, resources)
        variables |= read
        data = graph_def.SerializeToString(deterministic=True)
        if data not in seen:
            seen[data] = len(out.meta_graphs)
            out.meta_graphs.append(meta_graph_pb2.MetaGraphDef(graph_def=graph_def))
        index = seen[data]
        out.meta_graphs[index].signature_def[key].CopyFrom(_signature_def(fn, inputs, outputs))
        out.signatures.append(Signature(key, index, dict(fn.structured_input_signature[1]),
                                        dict(fn.structured_outputs), tables))
        for handle in tables.values():
            if not any(resources[id(handle)] is t for t in out.tables):
                out.tables.append(resources[id(handle)])
    out.variables = len(variables)
    out.methods, out.dropped = _methods(loaded, out.signatures)
    return out


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
        method = _serving_method(path, fn, callees) if "." not in path else None
        (carried.append(method) if method is not None else dropped.append(path))
    return carried, dropped


def _functions(root) -> list[tuple[str, object]]:
    """Every ``tf.function`` the object graph under ``root`` holds, by its attribute path."""
    found, seen, stack = [], {id(root)}, [("", root)]
    while stack:
        prefix, obj = stack.pop()
        for name, child in sorted(obj._trackable_children().items()):
            if name == "signatures" or id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{name}"
            if isinstance(child, def_function.Function):
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


def _freeze_one(path: Path, key: str, fn, resources: dict):
    """``fn`` (signature ``key``) frozen: its GraphDef, its data input and output tensors (in
    the order of the flattened structured inputs and outputs), the placeholders fed a lookup
    table (node -> the loaded handle) and the ids of the variables made Consts."""
    args, kwargs = fn.structured_input_signature
    if args:
        raise UnsupportedGraphError(f"{path}: signature {key!r} takes positional inputs; a "
                                    "signature takes its inputs by name")
    captured = {internal.name: external for external, internal in fn.graph.captures}
    variables = {id(external) for external, _ in fn.graph.captures
                 if isinstance(resources.get(id(external)), tf.Variable)}
    try:
        frozen = convert_variables_to_constants_v2(fn)
    except (ValueError, KeyError, tf.errors.OpError) as exc:
        # convert_variables_to_constants_v2's refusal of the signature's graph (ValueError,
        # a KeyError for what it cannot find, grappler's status errors); its RuntimeError
        # and NotImplementedError mean it was misused: ours (exit 70)
        raise UnsupportedGraphError(f"{path}: signature {key!r} cannot be frozen: "
                                    f"{_first_line(exc)}") from None
    data = len(fn.inputs) - len(fn.captured_inputs)
    names = {t.name for t in fn.inputs[:data]}
    inputs = [t.name for t in frozen.inputs if t.name in names]
    tables = {}
    for t in frozen.inputs:
        if t.name in names:
            continue
        external = captured.get(t.name)
        if external is None or external.dtype != tf.resource:
            raise UnsupportedGraphError(f"{path}: signature {key!r}: freezing left input "
                                        f"{t.name} unfed")
        owner = resources.get(id(external))
        if isinstance(owner, tf.Variable):
            raise UnsupportedGraphError(
                f"{path}: signature {key!r} writes variable {owner.name!r} (or passes its "
                "handle on): its value changes as the model runs, so it cannot be frozen; "
                "convert without --freeze")
        if owner is None:
            raise UnsupportedGraphError(
                f"{path}: signature {key!r} reads a resource the SavedModel does not track as "
                f"a variable or table ({t.name}); --freeze cannot keep it: convert without "
                "--freeze")
        tables[t.name.split(":")[0]] = external
    if len(inputs) != data:
        raise UnsupportedGraphError(f"{path}: signature {key!r}: an input was lost in freezing")
    outputs = [t.name for t in frozen.outputs]
    fed = {name.split(":")[0] for name in inputs} | set(tables)
    return _canonical(frozen.graph.as_graph_def(), fed), inputs, outputs, tables, variables


def _canonical(graph_def: graph_pb2.GraphDef, fed: set[str]) -> graph_pb2.GraphDef:
    """``graph_def`` the same in every run: without the Placeholders nothing reads and nothing
    feeds, nor the ``_has_manual_control_dependencies`` marks, its nodes in name order.

    Freezing prunes the function through ``lift_to_graph``, which walks a set: the order of
    the nodes it copies changes from one Python process to the next, and so does the number
    of ``unused_control_flow_input`` placeholders it puts in for loop inputs not copied yet
    (then rewires their readers to the copies), marking the nodes it gives control inputs
    that way for tf.function's automatic control dependencies, which a frozen graph imported
    whole never meets. A conversion is deterministic (tests/test_determinism.py): the frozen
    graph is put in one order, those dropped."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    del out.node[:]
    out.node.extend(sorted(_live(graph_def.node, fed), key=lambda node: node.name))
    for node in out.node:
        if _MANUAL_CONTROL in node.attr:
            del node.attr[_MANUAL_CONTROL]
    return out


_MANUAL_CONTROL = "_has_manual_control_dependencies"


def _live(nodes, fed: set[str]) -> list:
    """``nodes`` (of a GraphDef or a function body) but the Placeholders nothing among them
    reads and that are not in ``fed``: the ones ``lift_to_graph`` leaves (see :func:`_canonical`)."""
    read = set()
    for node in nodes:
        read.update(name.lstrip("^").split(":")[0] for name in node.input)
    return [node for node in nodes
            if node.op != "Placeholder" or node.name in read or node.name in fed]


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
    keys, dtypes and shapes, its lookup tables tracked (with their initializers and assets).
    Signatures that run the same graph on the same tensors share its function, so its weights
    are written once."""
    # the functions traced here are numbered on from TensorFlow's process-wide counter, which
    # freezing and pruning (lift_to_graph) move on by a number that changes from run to run
    first = ops.uid()
    module = tf.Module()
    module.amp_lookup_tables = list(frozen.tables)
    functions, signatures = {}, {}
    for sig in frozen.signatures:
        meta = meta_graphs[sig.graph]
        sd = meta.signature_def[sig.key]
        in_keys, out_keys = sorted(sig.inputs), sorted(sig.outputs)
        tensors = (tuple(sd.inputs[k].name for k in in_keys),
                   tuple(sd.outputs[k].name for k in out_keys))
        if (sig.graph, tensors) not in functions:
            functions[sig.graph, tensors] = wrap_function.function_from_graph_def(
                _serving_graph(meta.graph_def), list(tensors[0]), list(tensors[1]),
                dict(sig.tables))
        signatures[sig.key] = _serving_function(sig, functions[sig.graph, tensors])
    for method in frozen.methods:
        setattr(module, method.name, _method_function(method, signatures[method.key]))
    # a frozen graph serves: no custom gradient is saved (nor any gradient function traced)
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    tf.saved_model.save(module, str(folder), signatures=signatures, options=options)
    _in_one_order(Path(folder), first)


def _in_one_order(folder: Path, first: int) -> None:
    """The SavedModel TensorFlow wrote in ``folder`` made the same in every run, its
    fingerprint written again for it: its functions, and their nodes, in name order, without
    the placeholders nothing reads and the ``_has_manual_control_dependencies`` marks
    (``function_from_graph_def`` copies a graph's nodes in the order it walks a set, which
    changes from one Python process to the next), the functions traced since TensorFlow's
    counter stood at ``first`` numbered 0, 1, ... in the order they were traced (the counter
    moves on between them by as much as the same sets' walks take: where that names no
    function twice). The same
    conversion writes the same bytes in every run, but the fingerprint's uuid."""
    path = folder / "saved_model.pb"
    model = saved_model_pb2.SavedModel()
    model.ParseFromString(path.read_bytes())
    for meta in model.meta_graphs:
        names = {f.signature.name for f in meta.graph_def.library.function}
        traced = []
        for name in names:
            stem, _, number = name.rpartition("_")
            if name.startswith("__inference_") and number.isdigit() and int(number) >= first:
                traced.append((int(number), stem, name))
        renamed = {name: f"{stem}_{rank}" for rank, (_, stem, name) in enumerate(sorted(traced))}
        if len(set(renamed.values()) | (names - set(renamed))) != len(names):
            renamed = {}
        for function in meta.graph_def.library.function:
            returned = set(function.ret.values()) | set(function.control_ret.values())
            nodes = sorted(_live(function.node_def, {r.split(":")[0] for r in returned}),
                           key=lambda node: node.name)
            del function.node_def[:]
            function.node_def.extend(nodes)
            for node in function.node_def:
                if _MANUAL_CONTROL in node.attr:   # marked as it walked: see _canonical
                    del node.attr[_MANUAL_CONTROL]
        if renamed:
            _rename_functions(meta, renamed)
        library = meta.graph_def.library
        functions = sorted(library.function, key=lambda f: f.signature.name)
        del library.function[:]
        library.function.extend(functions)
    path.write_bytes(model.SerializeToString(deterministic=True))
    fingerprinting_utils.write_fingerprint(str(folder))


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


def _serving_graph(graph_def):
    """``graph_def`` without the custom-gradient marks its nodes carry (Keras' swish): a frozen
    graph serves, and a loader would warn that their gradients were not saved."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for nodes in [out.node] + [f.node_def for f in out.library.function]:
        for node in nodes:
            if _CUSTOM_GRADIENT in node.attr:
                del node.attr[_CUSTOM_GRADIENT]
    return out


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
