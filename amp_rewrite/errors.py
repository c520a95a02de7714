"""The one exception hierarchy of amp-rewrite.

Every error the library raises on purpose is an :class:`AmpRewriteError`. The CLI maps
:class:`InputError` (and its subclasses) to exit code 2 and everything else to exit code 1,
printing only the message unless ``-v`` is given. Messages name the file, node, op and dtypes
involved and, where there is one, what the user can do about it.
"""

from __future__ import annotations


class AmpRewriteError(Exception):
    """Base class of every error amp-rewrite raises on purpose."""

    #: exit code the CLI uses for this error
    exit_code = 1


class InputError(AmpRewriteError):
    """The user's input (a file, a flag, a graph) cannot be used as given."""

    exit_code = 2


class RuleError(InputError):
    """A rule file is malformed or names an op TensorFlow does not know."""


class UnsupportedGraphError(InputError):
    """A valid graph that amp-rewrite cannot convert as asked (e.g. loss scaling without a seed)."""


class LintError(AmpRewriteError):
    """The converted graph failed the post-conversion lint: an amp-rewrite bug, nothing is written."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        head = problems[0] if problems else "unknown problem"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"internal error: converted graph failed lint: {head}{more}")
