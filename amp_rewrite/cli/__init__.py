"""The ``amp-rewrite`` command: :mod:`.run` parses and checks the arguments without TensorFlow,
then loads :mod:`.commands`, which runs them."""

from .run import console, main

__all__ = ["console", "main"]
