"""``python -m amp_rewrite``: the ``amp-rewrite`` command."""

from .cli import console

console()
