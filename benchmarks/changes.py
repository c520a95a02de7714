"""One change's effect on conversion time and memory: two checkouts side by side.

Builds the ``benchmarks/scaling.py`` graphs once, then converts each in fresh processes of two
checkouts of this repository, alternating (before, after, before, after ...), so drift in the
machine's speed falls on both; medians of ``--runs`` of each conversion's CPU time.
``--before`` is a revision (checked out in a temporary git worktree), ``--after`` a revision
or, by default, this working tree.
``--write LABEL`` adds a row per graph to the "Conversion speed, change by change" section of
BENCHMARKS.md (earlier rows are kept: the section is the change history).

Run: ``.venv/bin/python benchmarks/changes.py --before HEAD~1 --write "what changed"``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import scaling
from benchmd import BENCHMARKS, commit, provenance, write_section

SECTION = "## Conversion speed, change by change"


def checkout(rev: str, folder: Path) -> Path:
    path = folder / rev.replace("/", "_").replace("~", "_")
    subprocess.run(["git", "-C", str(scaling.ROOT), "worktree", "add", "--detach", "-q", str(path),
                    rev], check=True)
    if not (path / "amp_rewrite" / "rules").is_dir():
        # before the folder move the rule files were the package amp_rewrite.default_rules,
        # which only an install maps to rules/: the child imports the checkout by PYTHONPATH
        (path / "amp_rewrite" / "default_rules").symlink_to(Path("..") / "rules")
    return path


def compare(paths: dict[str, Path], graphs: dict[str, Path], runs: int) -> list[dict]:
    rows = []
    for graph, (file, who) in graphs.items():
        got: dict[str, list[dict]] = {side: [] for side in paths}
        for i in range(runs):
            sides = list(paths) if i % 2 == 0 else list(paths)[::-1]
            for side in sides:
                got[side].append(scaling.convert_in_child(file, who, cwd=paths[side]))
        row = {"graph": graph, "bytes": file.stat().st_size}
        for side, results in got.items():
            row[side + "_s"] = statistics.median(r["cpu_seconds"] for r in results)
            row[side + "_mb"] = statistics.median(r["peak_kib"] - r["base_kib"] for r in results) / 1024
        rows.append(row)
        print(row, flush=True)
    return rows


def lines(rows: list[dict], label: str, before: str, runs: int) -> list[str]:
    out = []
    for r in rows:
        mb = r["bytes"] / 2**20
        out.append(f"| {label} | {r['graph']} | {r['before_s']:.2f} -> {r['after_s']:.2f} "
                   f"({r['before_s'] / r['after_s']:.2f}x) | {r['before_mb']:.0f} -> "
                   f"{r['after_mb']:.0f} ({r['before_mb'] / mb:.1f}x -> {r['after_mb'] / mb:.1f}x "
                   f"the GraphDef) | {before} | {runs} |")
    return out


def write(new_lines: list[str], label: str, measured: str) -> None:
    """The section with ``new_lines`` added to its rows; the notes under its heading and the
    paragraphs that say where earlier rows were measured are kept, and one is added for these:
    ``measured`` (date, CPU, load as the run started, the command) and the commit measured as
    "after"."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else ""
    start = text.find(SECTION + "\n")
    old_rows, notes, rows_said = [], [], []
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        body = text[start:end if end >= 0 else len(text)]
        old_rows = [ln for ln in body.splitlines()
                    if ln.startswith("| ") and not ln.startswith(("| change ", "| ---"))]
        notes = [ln for ln in body.splitlines() if ln.startswith("*") and ln.endswith("*")]
        rows_said = [ln for ln in body.splitlines() if ln.startswith("Rows \"")]
    head = [f"{SECTION}\n", *(n + "\n" for n in notes),
            "`benchmarks/changes.py`: each change to the conversion, its parent commit against "
            "it, converting the same `benchmarks/scaling.py` graphs in fresh processes of the two "
            "checkouts in turn (median of the runs; in-process `convert(gd, target=\"bfloat16\", "
            "device=\"cpu\")`; peak memory above the process's baseline as in \"Conversion "
            f"speed\"). Measured on {platform.machine()}, {os.cpu_count()} cores "
            f"({scaling.hardware.describe()}), TensorFlow {scaling.tf.__version__}. The machine's "
            "speed drifts by a fifth between minutes: read single rows' seconds with that in "
            "mind; peak memory does not drift. Seconds are the conversion's wall time up to the "
            "rows of issue 41 item 5, its CPU time (`time.process_time`) from them on: on a "
            "machine other jobs share, its wall time moved by a third between two runs of the "
            "same rows.\n",
            "| change | graph | seconds before -> after | peak MB before -> after | before = | runs |",
            "| --- | --- | --- | --- | --- | --- |"]
    said = f'Rows "{label}": {measured} After = {commit()}.'
    write_section("\n".join(head + old_rows + new_lines) + "\n\n"
                  + "\n\n".join(rows_said + [said]) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True, help="a revision, e.g. HEAD~1")
    p.add_argument("--after", help="a revision (default: this working tree)")
    p.add_argument("--graphs", nargs="+", default=["mlp:30000", "train:30000"],
                   help="kind:nodes of benchmarks/scaling.py graphs; kind:nodes:painted "
                        "converts with min_matrix_intensity=0, so every island is painted")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--write", metavar="LABEL", help="add the rows to BENCHMARKS.md under LABEL")
    args = p.parse_args()
    measured = provenance()   # the load as the run starts
    before = subprocess.run(["git", "-C", str(scaling.ROOT), "rev-parse", "--short", args.before],
                            capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = {"before": checkout(args.before, folder),
                 "after": checkout(args.after, folder) if args.after else scaling.ROOT}
        try:
            graphs, files = {}, {}
            for spec in args.graphs:
                kind, nodes, *painted = spec.split(":")
                if (kind, nodes) not in files:   # each graph built once
                    files[(kind, nodes)] = scaling.write_graph(kind, int(nodes), folder)
                graphs[f"{kind} {nodes}" + (" painted" if painted else "")] = (
                    files[(kind, nodes)], "ours-painted" if painted else "ours")
            rows = compare(paths, graphs, args.runs)
        finally:
            for side, path in paths.items():
                if path != scaling.ROOT:
                    subprocess.run(["git", "-C", str(scaling.ROOT), "worktree", "remove", "--force",
                                    str(path)], check=False)
    new = lines(rows, args.write or "(not written)", before, args.runs)
    print("\n".join(new))
    if args.write:
        write(new, args.write, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
