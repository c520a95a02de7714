"""What one run of a model records (:class:`Trace`), and how a refused run is reported.

Shared by the graph runners (:mod:`amp_rewrite.tools.runner`) and the replay of SavedModel
functions (:mod:`amp_rewrite.tools.replay`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import tensorflow as tf

from ..core.errors import ReplayError, RunError


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


def upstream(name: str, sources: Callable[[str], Iterable[str]], wanted: Callable[[str], bool],
             through: Callable[[str], bool] = lambda _: True) -> set[str]:
    """The nearest tensors ``wanted`` accepts that ``name`` is computed from: its ``sources``,
    theirs in turn through the tensors ``through`` accepts, never past a wanted one, ``name``
    itself never. The one walk over what a trace records, with :func:`downstream` (a tensor's
    sources name tensors of other bodies, or none that ran: no graph of nodes, so not the IR's
    walk)."""
    found, seen, stack = set(), {name}, list(sources(name))
    while stack:
        source = stack.pop()
        if source in seen:
            continue
        seen.add(source)
        if wanted(source):
            found.add(source)
        elif through(source):
            stack.extend(sources(source))
    return found


def downstream(name: str, consumers: Callable[[str], Iterable[str]],
               through: Callable[[str], bool]) -> set[str]:
    """The tensors computed from ``name``: its ``consumers``, theirs in turn, each that
    ``through`` refuses included but not walked past; ``name`` itself not (:func:`upstream`'s
    other direction)."""
    found, stack = set(), list(consumers(name))
    while stack:
        tensor = stack.pop()
        if tensor in found or tensor == name:
            continue
        found.add(tensor)
        if through(tensor):
            stack.extend(consumers(tensor))
    return found


@contextlib.contextmanager
def run_errors(path):
    """A run that TensorFlow refuses (shapes that do not fit, a failed assertion ...) is the
    input's problem: one line naming the model and TensorFlow's reason (a
    :class:`~amp_rewrite.core.errors.RunError`)."""
    try:
        yield
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        why = reason(exc)
        raise RunError(f"{path}: TensorFlow could not run the model: {why} "
                       "(check --shape / --inputs)", why) from None


@contextlib.contextmanager
def replay_errors(path, what: str):
    """Inside, TensorFlow has already run the model on the same inputs (``what``: the run
    replayed, e.g. ``signature 'serving_default'``), so a failure of our replay of it is our
    bug: a :class:`~amp_rewrite.core.errors.ReplayError` (exit 70) with TensorFlow's reason,
    chained to the error itself (``-v`` shows it), never the "check --shape / --inputs" of
    :func:`run_errors`. Deliberate refusals (an :class:`InputError` other than a run
    TensorFlow refused) pass through."""
    head = (f"{path}: TensorFlow runs {what} on these inputs, but our replay of it (which "
            "records its tensors for verify --per-node and tune) failed")
    try:
        yield
    except RunError as exc:
        raise ReplayError(f"{head}: {exc.reason}") from exc
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        raise ReplayError(f"{head}: {reason(exc)}") from exc


#: the lines of a TensorFlow error that say where, not what: a loaded SavedModel's functions
#: carry no Python source, so its "defined at" traceback is the line "<stack traces
#: unavailable>", which would otherwise be the first line left
_NOISE = ("Graph execution error", "Detected at node", "Node:", "Original stack trace", "File ",
          "[[", "(most recent call last)", "<stack traces unavailable>")


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
