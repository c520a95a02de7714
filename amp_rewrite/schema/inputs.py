"""A model's inputs and the one rule for naming them: what an ``.npz`` key, a ``--shape`` name
or a feed dict's key may call an input by, and the message when it names none.

The runner (:mod:`amp_rewrite.tools.runner`) builds its :class:`InputSpec` list from the graph
it runs; a conversion, which runs nothing, from the MetaGraph (:func:`meta_graph_inputs`). Both
match names with :func:`match_inputs` and check a given shape with :func:`fitting_shape`.

A TF2 signature takes a ``tf.RaggedTensor`` or ``tf.SparseTensor`` argument as its component
tensors, one input each (``ids`` and ``ids_1`` for a RaggedTensor ``ids``): its
:class:`Composite`, read off the function the signature calls (:func:`signature_composites`),
names them as what they are (``ids.values``, ``ids.row_splits``; ``x.indices``, ``x.values``,
``x.dense_shape``), and a ``--shape`` by the argument's name gives its shape as a whole
(:func:`split_whole_shapes`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import dtypes
from tensorflow.python.saved_model import nested_structure_coder

from ..core.errors import InputError
from ..core.ir import Graph
from ..core.ops import CALL_OPS, PLACEHOLDER_OPS


@dataclass(frozen=True)
class Composite:
    """A signature argument TensorFlow passes as several tensors: a ``tf.RaggedTensor``
    (``values`` and ``row_splits``; ``flat_values`` and ``nested_row_splits.0`` ... from two
    ragged dimensions on), a ``tf.SparseTensor`` (``indices``, ``values``, ``dense_shape``),
    or another composite (its components numbered ``0``, ``1`` ...)."""

    name: str                                # the argument's name
    kind: str                                # "RaggedTensor", "SparseTensor", ...
    dtype: int                               # its values' dtype (types_pb2 enum)
    shape: tuple[int | None, ...] | None     # its shape as a whole (None: unknown rank)
    parts: tuple[str, ...]                   # its components, in the signature's order
    ragged_rank: int = 0

    def keys(self) -> str:
        """The ``.npz`` keys that give it: ``ids.values and ids.row_splits``."""
        keys = [f"{self.name}.{part}" for part in self.parts]
        return ", ".join(keys[:-1]) + " and " + keys[-1]

    def text(self) -> str:
        """``RaggedTensor ids (int32 [?,?])``."""
        return f"{self.kind} {self.name} ({dtype_text(self.dtype)} {shape_text(self.shape)})"


@dataclass(frozen=True)
class InputSpec:
    """One model input: the user-facing ``name``, the tensor fed, its dtype and static shape."""

    name: str
    tensor: str
    dtype: int                        # types_pb2 enum
    shape: tuple[int | None, ...] | None  # None: unknown rank
    #: for an output of a tf.data iterator, that output (``IteratorGetNext:0``, also the
    #: name; ``tensor`` is the placeholder the model reads it through): fed the user's array,
    #: else a batch drawn from it (``tools.runner.fill_iterator_inputs``), never random data.
    #: "" for other inputs
    iterator: str = ""
    #: the RaggedTensor or SparseTensor argument this input is a component of, and which
    #: (``"row_splits"``); None and "" for a plain tensor
    composite: Composite | None = None
    part: str = ""

    def label(self) -> str:
        """How messages name the input: ``'ids.row_splits' (signature key 'ids_1')`` for a
        composite's component, else ``'name'``."""
        if self.composite is None:
            return repr(self.name)
        whole = f"{self.composite.name}.{self.part}"
        return f"{whole!r} (signature key {self.name!r})"


def input_keys(spec: InputSpec) -> tuple[str, ...]:
    """The names an ``.npz`` key or a ``--shape`` may give ``spec`` by: its name, its tensor,
    and for either, of port 0, its node (port 1 of an iterator is not its node); a composite's
    component also by ``argument.part`` (``ids.row_splits``)."""
    keys = [spec.name, spec.tensor]
    for name in (spec.name, spec.tensor):
        node, _, port = name.rpartition(":")
        if port == "0":
            keys.append(node)
    if spec.composite is not None:
        keys.insert(0, f"{spec.composite.name}.{spec.part}")
    return tuple(dict.fromkeys(keys))


def composite_arguments(specs: Sequence[InputSpec]) -> dict[str, Composite]:
    """The composite arguments (RaggedTensor, SparseTensor ...) among ``specs``, by name, in
    order."""
    return {s.composite.name: s.composite for s in specs if s.composite is not None}


def shape_text(shape) -> str:
    if shape is None:
        return "<unknown rank>"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def dtype_text(dtype: int) -> str:
    return dtypes.as_dtype(dtype).name


def match_inputs(names: Iterable[str], specs: Sequence[InputSpec], what: str) -> dict[str, InputSpec]:
    """Each of ``names`` (the keys of an ``.npz`` file, the names of ``--shape``) with the input
    it names: its name (a signature key, a placeholder), its tensor (``x:0``) or its tensor's
    node. The one rule for input names: a name that names no input is an InputError (``what``
    says whose name it is) listing the model's inputs, with the closest names; never ignored,
    as a name mistyped would leave its input fed with made-up data."""
    by_name: dict[str, InputSpec] = {}
    for spec in specs:
        for key in input_keys(spec):
            by_name.setdefault(key, spec)
    matched = {}
    for name in names:
        if name not in by_name:
            # each input once: a Keras export's signatures serve and serving_default both
            # take its inputs, under the same keys
            named = list(dict.fromkeys(key for s in specs for key in (
                input_keys(s)[0], s.composite.name if s.composite else s.name)))
            close = difflib.get_close_matches(name, named, n=3, cutoff=0.5)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise InputError(f"{what} {name!r} names no input of the model{hint}; its inputs: "
                             f"{inputs_text(specs)}")
        matched[name] = by_name[name]
    twice = _named_twice(matched)
    if twice:
        raise InputError(f"{what} {' and '.join(map(repr, twice[1]))} name the same input "
                         f"{twice[0]!r}: give one")
    return matched


def inputs_text(specs: Sequence[InputSpec]) -> str:
    """The model's inputs as messages list them: each with its dtype and shape, a composite
    argument once, with the keys that give it."""
    items = []
    for spec in specs:
        if spec.composite is None:
            items.append(f"{spec.name} ({dtype_text(spec.dtype)} {shape_text(spec.shape)})")
        else:
            items.append(f"{spec.composite.name} (a {spec.composite.kind}, "
                         f"{dtype_text(spec.composite.dtype)} {shape_text(spec.composite.shape)}"
                         f": {spec.composite.keys()})")
    return ", ".join(dict.fromkeys(items)) or "none"


def split_whole_shapes(shapes: Mapping[str, Sequence[int]], specs: Sequence[InputSpec]
                       ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """``--shape``'s entries split in two: those that give a composite argument's shape as a
    whole (named by the argument's name, with its rank: ``ids=4,8``, 4 rows of up to 8
    values), by argument, checked against its static shape; and the others, for
    :func:`match_inputs`. An argument's name is also its first component's signature key: an
    entry of another rank keeps that key's meaning (the component's shape)."""
    wholes = composite_arguments(specs)
    whole, rest = {}, {}
    for key, dims in shapes.items():
        composite = wholes.get(key)
        if composite is not None and (composite.shape is None
                                      or len(dims) == len(composite.shape)):
            if composite.shape is not None and any(
                    s is not None and s != d for s, d in zip(composite.shape, dims)):
                raise InputError(f"--shape {key}={','.join(map(str, dims))} does not fit "
                                 f"{composite.text()}")
            whole[key] = tuple(dims)
        else:
            rest[key] = tuple(dims)
    return whole, rest


def component_shapes(shapes: Mapping[str, Sequence[int]], specs: Sequence[InputSpec]
                     ) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each entry that gives a composite argument's shape as a whole
    (:func:`split_whole_shapes`) replaced by what it fixes of its components' shapes: a
    RaggedTensor's rows fix its outermost row splits' length (the rows plus one); the other
    components' lengths depend on the values, not on the shape."""
    whole, rest = split_whole_shapes(shapes, specs)
    for spec in specs:
        composite = spec.composite
        if composite is not None and composite.name in whole and spec.part in (
                "row_splits", "nested_row_splits.0"):
            rest.setdefault(spec.name, (whole[composite.name][0] + 1,))
    return rest


def _named_twice(matched: Mapping[str, InputSpec]):
    seen: dict[str, list[str]] = {}
    for name, spec in matched.items():
        seen.setdefault(spec.name, []).append(name)
    return next(((spec, names) for spec, names in seen.items() if len(names) > 1), None)


def fitting_shape(key: str, given: Sequence[int], spec: InputSpec) -> tuple[int, ...]:
    """``given`` (``--shape key=...``) where it fits ``spec``'s static shape (its rank, and
    every dimension the graph fixes); else an InputError."""
    if spec.shape is not None and (len(given) != len(spec.shape) or any(
            s is not None and s != g for s, g in zip(spec.shape, given))):
        raise InputError(f"--shape {key}={','.join(map(str, given))} does not fit the "
                         f"input's shape {shape_text(spec.shape)}")
    return tuple(given)


def meta_graph_inputs(meta: meta_graph_pb2.MetaGraphDef, graph: Graph) -> list[InputSpec]:
    """The inputs a MetaGraph is fed through without running it: its signatures' inputs (by
    their keys, with the composite argument each is a component of), else, a bare graph, its
    placeholders (resources aside: a function's variables)."""
    specs = []
    for sig_key, sig in meta.signature_def.items():
        parts = signature_composites(meta, sig_key)
        specs += [InputSpec(key, info.name, info.dtype, _static(info.tensor_shape),
                            composite=parts.get(key, (None, ""))[0],
                            part=parts.get(key, (None, ""))[1])
                  for key, info in sig.inputs.items()]
    if specs:
        return specs
    return [InputSpec(n.name, f"{n.name}:0", n.attr["dtype"].type,
                      _static(n.attr["shape"].shape) if "shape" in n.attr else None)
            for n in graph.nodes()
            if n.op in PLACEHOLDER_OPS and n.attr["dtype"].type != types_pb2.DT_RESOURCE]


def _static(shape) -> tuple[int | None, ...] | None:
    return None if shape.unknown_rank else tuple(None if d.size < 0 else d.size for d in shape.dim)


def signature_composites(meta: meta_graph_pb2.MetaGraphDef, key: str
                         ) -> dict[str, tuple[Composite, str]]:
    """Each input key of signature ``key`` that is a component of a composite argument (a
    ``tf.RaggedTensor``, ``tf.SparseTensor`` ...), with that argument and which component it
    is. A TF2 signature calls a wrapper that calls the function saved with the signature's
    structure (the object graph's ``canonicalized_input_signature``): its arguments flattened
    with their components in order are that call's inputs. Empty where the signature says
    nothing of the kind (a TF1 signature, a signature of plain tensors)."""
    sig = meta.signature_def.get(key)
    if sig is None or len(sig.inputs) < 2 or not meta.HasField("object_graph_def"):
        return {}
    arguments = _call_arguments(meta, sig)
    if arguments is None:
        return {}
    function, passed = arguments
    saved = meta.object_graph_def.concrete_functions.get(function)
    if saved is None:
        return {}
    try:
        structure = nested_structure_coder.decode_proto(saved.canonicalized_input_signature)
    except (ValueError, TypeError, LookupError):   # a TypeSpec this TensorFlow cannot read
        return {}
    found, position = {}, 0
    for leaf in tf.nest.flatten(structure):
        if not isinstance(leaf, tf.TypeSpec):
            continue      # a Python value the function was traced with: no input
        count = len(tf.nest.flatten(leaf, expand_composites=True))
        keys = passed[position:position + count]
        position += count
        if count > 1 and len(keys) == count and None not in keys:
            composite = _composite(keys[0], leaf, count)
            found.update((k, (composite, part)) for k, part in zip(keys, composite.parts))
    return found


def _call_arguments(meta: meta_graph_pb2.MetaGraphDef, sig) -> tuple[str, list] | None:
    """The function a TF2 signature's wrapper calls, and for each of that call's inputs the
    signature key passed there (None where it passes something else: a captured variable)."""
    by_node = {info.name.rpartition(":")[0]: k for k, info in sig.inputs.items()
               if info.name.endswith(":0")}

    def node_of(ref: str) -> str:
        node, _, port = ref.partition(":")
        return node if port in ("", "0") else ""

    outer = next((n for n in meta.graph_def.node if n.op in CALL_OPS
                  and any(node_of(i) in by_node for i in n.input)), None)
    library = {f.signature.name: f for f in meta.graph_def.library.function}
    wrapper = library.get(outer.attr["f"].func.name) if outer is not None else None
    if wrapper is None:
        return None
    data = [i for i in outer.input if not i.startswith("^")]
    args = {arg.name: by_node.get(node_of(ref))
            for arg, ref in zip(wrapper.signature.input_arg, data)}
    inner = next((n for n in wrapper.node_def if n.op in CALL_OPS
                  and any(args.get(i) for i in n.input)), None)
    if inner is None:
        return None
    return inner.attr["f"].func.name, [args.get(i) for i in inner.input if not i.startswith("^")]


def _composite(name: str, spec, count: int) -> Composite:
    shape = None if spec.shape.rank is None else tuple(spec.shape.as_list())
    dtype = spec.dtype.as_datatype_enum
    if isinstance(spec, tf.RaggedTensorSpec) and count == spec.ragged_rank + 1:
        rank = spec.ragged_rank
        parts = (("values", "row_splits") if rank == 1 else
                 ("flat_values",) + tuple(f"nested_row_splits.{i}" for i in range(rank)))
        return Composite(name, "RaggedTensor", dtype, shape, parts, rank)
    if isinstance(spec, tf.SparseTensorSpec):
        return Composite(name, "SparseTensor", dtype, shape, ("indices", "values", "dense_shape"))
    kind = type(spec).__name__.removesuffix("Spec")
    return Composite(name, kind, dtype, shape, tuple(str(i) for i in range(count)))
