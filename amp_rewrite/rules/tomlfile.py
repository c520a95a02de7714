"""Reading a TOML file the user gives (rule files, cost tables): one error for each way it can
fail, naming the file, and for bad TOML the line and its text. It imports no TensorFlow:
the cost table's module is imported before the CLI has quietened TensorFlow's logging."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from ..core.errors import InputError


def _toml_error_line(exc: tomllib.TOMLDecodeError) -> int | None:
    # Python 3.11's TOMLDecodeError carries the position only in its message
    found = re.search(r"\(at line (\d+), column \d+\)", str(exc))
    return int(found.group(1)) if found else None


def read_toml(path: Path, what: str, error: type[InputError]) -> tuple[str, dict]:
    """The text of the TOML file ``path`` and what it holds. Where it cannot be read, is not
    UTF-8 or is not TOML: an ``error`` naming the file (``what`` says what it is), and for bad
    TOML the line and its text."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: {what} is not UTF-8 text") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = _toml_error_line(exc)
        lines = text.splitlines()
        quoted = f": {lines[line - 1].strip()[:80]!r}" if line and line <= len(lines) else ""
        raise error(f"{path}:{line or 1}: not valid TOML: {exc}{quoted}") from None
