"""Feeding a signature's RaggedTensor and SparseTensor arguments: random ones that TensorFlow
accepts, their shape as a whole, and the batch they hold.

A TF2 signature takes such an argument as its components, one input each
(:class:`~amp_rewrite.schema.inputs.Composite`). Random components, each drawn on its own, do
not make a valid argument (row splits that start at 0, never decrease and end at the number of
values; sparse indices inside the dense shape, in row-major order): the model's own checks
refuse them. :func:`random_composite` draws the argument whole, from its shape as a whole
(``--shape ids=ROWS,LONGEST``, :func:`whole_shape`), and splits it into its components.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from ..core.errors import InputError
from ..schema.inputs import Composite, InputSpec, shape_text

log = logging.getLogger(__name__)

#: the share of a random SparseTensor's entries that hold a value (at least one entry does)
SPARSE_DENSITY = 0.1

#: ``(dtype enum, shape, rng) -> array``: random values of one dtype (the runner's)
Draw = Callable[[int, tuple, np.random.Generator], np.ndarray]


def whole_shape(composite: Composite, given: Mapping[str, tuple[int, ...]], batch: int
                ) -> tuple[int, ...]:
    """The shape ``composite`` is drawn at: ``--shape``'s for its name (``given``, checked by
    :func:`~amp_rewrite.schema.inputs.split_whole_shapes`), else its static shape with an
    unknown leading dimension set to ``batch`` and other unknown dimensions set to 1 (logged,
    so the user knows to pass ``--shape``). For a RaggedTensor the dimensions are the rows,
    each ragged dimension's longest row, then the values' own; for a SparseTensor, its dense
    shape."""
    if composite.name in given:
        return tuple(given[composite.name])
    if composite.shape is None:
        raise InputError(f"input {composite.name!r} is a {composite.kind} of unknown rank: pass "
                         f"--shape {composite.name}=D1,D2,... (its shape as a whole)")
    shape = tuple((batch if i == 0 else 1) if d is None else d
                  for i, d in enumerate(composite.shape))
    if shape != composite.shape:
        log.warning("input %s (a %s) has shape %s: fed as %s (pass --shape %s=...)",
                    composite.name, composite.kind, shape_text(composite.shape),
                    shape_text(shape), composite.name)
    return shape


def random_composite(composite: Composite, parts: Sequence[InputSpec], shape: tuple[int, ...],
                     rng: np.random.Generator, draw: Draw) -> dict[str, np.ndarray]:
    """A random ``composite`` of ``shape`` (:func:`whole_shape`), as its components by input
    name (``parts``: its components' specs): a RaggedTensor's rows each hold 1 to the
    longest row's values (a row that is empty would make a mean of nothing); a SparseTensor
    holds values at :data:`SPARSE_DENSITY` of its entries, distinct, in row-major order.
    ``draw`` makes the values."""
    spec = {s.part: s for s in parts}
    if composite.kind == "RaggedTensor":
        arrays = _ragged(composite, spec, shape, rng, draw)
    elif composite.kind == "SparseTensor":
        arrays = _sparse(composite, spec, shape, rng, draw)
    else:
        raise InputError(f"input {composite.name!r} is a {composite.kind}: cannot make random "
                         f"data for it; pass --inputs data.npz with {composite.keys()}")
    return {spec[part].name: value for part, value in arrays.items()}


def _ragged(composite: Composite, spec: Mapping[str, InputSpec], shape: tuple[int, ...],
            rng: np.random.Generator, draw: Draw) -> dict[str, np.ndarray]:
    rank = composite.ragged_rank
    splits_parts, values_part = composite.parts[1:], composite.parts[0]
    rows, arrays = shape[0], {}
    for part, longest in zip(splits_parts, shape[1:rank + 1]):
        lengths = rng.integers(1, longest + 1, rows)
        splits = np.concatenate([[0], np.cumsum(lengths)])
        arrays[part] = splits.astype(_numpy(spec[part].dtype))
        rows = int(splits[-1])
    arrays[values_part] = draw(spec[values_part].dtype, (rows, *shape[rank + 1:]), rng)
    return arrays


def _sparse(composite: Composite, spec: Mapping[str, InputSpec], shape: tuple[int, ...],
            rng: np.random.Generator, draw: Draw) -> dict[str, np.ndarray]:
    total = int(np.prod(shape, dtype=np.int64))
    count = min(total, max(1, int(total * SPARSE_DENSITY)))
    flat = np.sort(rng.choice(total, size=count, replace=False))
    indices = np.stack(np.unravel_index(flat, shape), axis=1) if shape else np.zeros((count, 0))
    return {"indices": indices.astype(_numpy(spec["indices"].dtype)),
            "values": draw(spec["values"].dtype, (count,), rng),
            "dense_shape": np.asarray(shape, _numpy(spec["dense_shape"].dtype))}


def bounding_shape(composite: Composite, parts: Sequence[InputSpec],
                   feeds: Mapping[str, np.ndarray]) -> tuple[int, ...] | None:
    """The shape as a whole of the ``composite`` that ``feeds`` give (its components by
    input name): a RaggedTensor's rows, longest rows and values' dimensions; a SparseTensor's
    dense shape; None for another kind."""
    array = {s.part: np.asarray(feeds[s.name]) for s in parts}
    if composite.kind == "SparseTensor":
        return tuple(int(d) for d in array["dense_shape"])
    if composite.kind != "RaggedTensor":
        return None
    splits = [array[part] for part in composite.parts[1:]]
    longest = [int(np.diff(s).max(initial=0)) for s in splits]
    return (len(splits[0]) - 1, *longest, *array[composite.parts[0]].shape[1:])


def feed_batch(specs: Sequence[InputSpec], feeds: Mapping[str, np.ndarray]) -> int:
    """The batch ``feeds`` hold: the first input's leading dimension; for a RaggedTensor or
    SparseTensor argument, its rows (1 for a scalar)."""
    first = next((s for s in specs if s.name in feeds), None)
    if first is None:
        return 1
    if first.composite is not None and first.composite.kind in ("RaggedTensor", "SparseTensor"):
        parts = [s for s in specs if s.composite == first.composite]
        if all(s.name in feeds for s in parts):
            shape = bounding_shape(first.composite, parts, feeds)
            return int(shape[0]) if shape else 1
    value = np.asarray(feeds[first.name])
    return int(value.shape[0]) if value.ndim else 1


def _numpy(dtype: int):
    return tf.dtypes.as_dtype(dtype).as_numpy_dtype
