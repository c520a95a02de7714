"""BENCHMARKS.md holds one section per benchmark script; each script replaces only its own."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def write_section(text: str, path: Path = BENCHMARKS) -> None:
    """Replace the section whose heading is ``text``'s first line (append it if new)."""
    heading = text.splitlines()[0].strip()
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(heading + "\n")
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
        return
    end = old.find("\n## ", start + len(heading))
    rest = old[end + 1:] if end >= 0 else ""
    path.write_text(old[:start] + text.rstrip("\n") + "\n" + ("\n" + rest if rest else ""))


def publish(text: str, write: bool) -> int:
    """Print a benchmark's section; with ``write`` (``--write``) also put it in BENCHMARKS.md.
    Returns the exit code."""
    print(text)
    if write:
        write_section(text)
    return 0
