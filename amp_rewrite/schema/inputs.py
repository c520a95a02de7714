"""A model's inputs and the one rule for naming them: what an ``.npz`` key, a ``--shape`` name
or a feed dict's key may call an input by, and the message when it names none.

The runner (:mod:`amp_rewrite.tools.runner`) builds its :class:`InputSpec` list from the graph
it runs; a conversion, which runs nothing, from the MetaGraph (:func:`meta_graph_inputs`). Both
match names with :func:`match_inputs` and check a given shape with :func:`fitting_shape`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import dtypes

from ..core.errors import InputError
from ..core.ir import Graph
from ..core.ops import PLACEHOLDER_OPS


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


def input_keys(spec: InputSpec) -> tuple[str, ...]:
    """The names an ``.npz`` key or a ``--shape`` may give ``spec`` by: its name, its tensor,
    and for either, of port 0, its node (port 1 of an iterator is not its node)."""
    keys = [spec.name, spec.tensor]
    for name in (spec.name, spec.tensor):
        node, _, port = name.rpartition(":")
        if port == "0":
            keys.append(node)
    return tuple(dict.fromkeys(keys))


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
            named = list(dict.fromkeys(s.name for s in specs))
            close = difflib.get_close_matches(name, named, n=3, cutoff=0.5)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            listing = ", ".join(dict.fromkeys(f"{s.name} ({dtype_text(s.dtype)} "
                                              f"{shape_text(s.shape)})" for s in specs)) or "none"
            raise InputError(f"{what} {name!r} names no input of the model{hint}; its inputs: "
                             f"{listing}")
        matched[name] = by_name[name]
    twice = _named_twice(matched)
    if twice:
        raise InputError(f"{what} {' and '.join(map(repr, twice[1]))} name the same input "
                         f"{twice[0]!r}: give one")
    return matched


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
    their keys), else, a bare graph, its placeholders (resources aside: a function's variables)."""
    specs = [InputSpec(key, info.name, info.dtype, _static(info.tensor_shape))
             for sig in meta.signature_def.values() for key, info in sig.inputs.items()]
    if specs:
        return specs
    return [InputSpec(n.name, f"{n.name}:0", n.attr["dtype"].type,
                      _static(n.attr["shape"].shape) if "shape" in n.attr else None)
            for n in graph.nodes()
            if n.op in PLACEHOLDER_OPS and n.attr["dtype"].type != types_pb2.DT_RESOURCE]


def _static(shape) -> tuple[int | None, ...] | None:
    return None if shape.unknown_rank else tuple(None if d.size < 0 else d.size for d in shape.dim)
