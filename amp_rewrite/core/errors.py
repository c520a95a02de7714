"""The one exception hierarchy of amp-rewrite.

Every error the library raises on purpose is an :class:`AmpRewriteError`, and falls on one of
two sides:

* the user's: :class:`InputError` and its subclasses. The input (a file, a flag, a graph, a
  rule file) cannot be used as given; the message names the file, node, op and dtypes involved
  and what the user can do. The CLI prints it in one line and exits with 2.
* ours: :class:`IRError` (an IR primitive misused), :class:`LintError` (a converted graph
  that fails the lint) and :class:`ReplayError` (our replay of a model fails where TensorFlow
  runs it). Each means a bug in amp-rewrite. They are never caught as a user error
  nor turned into a warning; the CLI reports them, like any unexpected exception, as an
  internal error with exit code :data:`INTERNAL_EXIT`.
"""

from __future__ import annotations

import contextlib
import contextvars

#: exit code of the CLI for bad input or usage
INPUT_EXIT = 2
#: exit code of the CLI for a bug in amp-rewrite (sysexits.h's EX_SOFTWARE); ``verify`` keeps
#: exit code 1 for "out of tolerance"
INTERNAL_EXIT = 70


#: how messages name the options a user gives: ``"keyword"``, the Python API's (the default),
#: or ``"flag"``, while the command line runs (:func:`flags_in_messages`)
_SPELLING = contextvars.ContextVar("amp_rewrite_option_spelling", default="keyword")


def option(flag: str, keyword: str) -> str:
    """An option as an error message names it: ``flag`` (``--force``) where the command line
    runs, else ``keyword`` (``force=True``), as the Python API's caller gives it. The check
    that raises is the same for both; only the words differ."""
    return flag if _SPELLING.get() == "flag" else keyword


@contextlib.contextmanager
def flags_in_messages():
    """Within the block, :func:`option` names the command line's flags (the CLI runs in it)."""
    token = _SPELLING.set("flag")
    try:
        yield
    finally:
        _SPELLING.reset(token)


class AmpRewriteError(Exception):
    """Base class of every error amp-rewrite raises on purpose."""

    #: exit code the CLI uses for this error
    exit_code = INTERNAL_EXIT


class InputError(AmpRewriteError):
    """The user's input (a file, a flag, a graph) cannot be used as given."""

    exit_code = INPUT_EXIT


class RuleError(InputError):
    """A rule file is malformed or names an op TensorFlow does not know."""


class UnsupportedGraphError(InputError):
    """A valid graph that amp-rewrite cannot convert as asked (e.g. loss scaling without a seed)."""


class RunError(InputError):
    """TensorFlow refused to run a model on the inputs given (shapes that do not fit, a failed
    assertion ...): the input's problem, as long as it is TensorFlow's own run that refuses.
    Where TensorFlow ran the same model on the same inputs and only our replay of it fails, it
    becomes a :class:`ReplayError`. ``reason``: TensorFlow's own words, without the advice."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class IRError(AmpRewriteError):
    """An IR primitive was misused (a missing node or port, removing a node still read): a bug
    in amp-rewrite, never the user's input."""


class ReplayError(AmpRewriteError):
    """Our replay of a model (a SavedModel signature's function bodies run one at a time, for
    ``verify --per-node`` and ``tune``) failed on inputs on which TensorFlow ran the model
    itself: a bug in amp-rewrite, never the user's inputs."""


class LintError(AmpRewriteError):
    """The converted graph failed the post-conversion lint: an amp-rewrite bug, nothing is written."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        head = problems[0] if problems else "unknown problem"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"converted graph failed lint: {head}{more}")
