"""What one run of a model records (:class:`Trace`), and how a refused run is reported.

Shared by the graph runners (:mod:`amp_rewrite.tools.runner`) and the replay of SavedModel
functions (:mod:`amp_rewrite.tools.replay`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import InputError


@dataclass
class TensorInfo:
    """A tensor :meth:`Runner.trace` records: its op, dtype (``float16`` ...), the tensors it
    is computed from (its op's inputs; for a function argument, what its callers passed; for a
    call's result, what its callee returned) and its place in execution order. Float tensors
    come with values; variant tensors (TensorLists) without, so that an error can be followed
    through the list a loop fills."""

    op: str
    dtype: str
    sources: set[str] = field(default_factory=set)
    order: int = 0


@dataclass
class Trace:
    """One run's float tensors: name -> the values it took (one per execution: a loop body's
    tensors take one per iteration), and what each tensor (float or variant) is."""

    values: dict[str, list[np.ndarray]]
    info: dict[str, TensorInfo]


@contextlib.contextmanager
def run_errors(path):
    """A run that TensorFlow refuses (shapes that do not fit, a failed assertion ...) is the
    input's problem: one line naming the model and TensorFlow's reason."""
    import tensorflow as tf
    try:
        yield
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        raise InputError(f"{path}: TensorFlow could not run the model: {reason(exc)} "
                         "(check --shape / --inputs)") from None


_NOISE = ("Graph execution error", "Detected at node", "Node:", "Original stack trace", "File ",
          "[[", "(most recent call last)")


def reason(exc: Exception) -> str:
    """The line of a TensorFlow error that says what went wrong, not where."""
    text = getattr(exc, "message", None) or str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(_NOISE) and "defined at" not in line:
            return line
    return type(exc).__name__


def tensor_name(name: str) -> str:
    return name if ":" in name else f"{name}:0"
