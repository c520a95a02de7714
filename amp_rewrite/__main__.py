"""``python -m amp_rewrite``: the ``amp-rewrite`` command."""

from .cli.run import console

console()
