"""The version of amp-rewrite, written here only: the wheel's metadata (pyproject.toml),
``amp_rewrite.__version__`` and ``amp-rewrite --version`` all read it."""

__version__ = "0.1.0"
