"""The next command an HTML page suggests, read off what the command that wrote it found.

Each page ends its first screen with the command to run next, with the paths the user gave:
after convert, verify the numbers (or, where the cost model estimates that freezing gains,
convert with ``--freeze``; where it kept every matrix op float32, time it painted whole with
``--measure``); after verify, time it with bench, or tune it where it
failed; after bench, check the numbers where it ran faster, look at the kernels where it did
not. Nothing here runs a model or reads one: a :class:`Given` says what the command was
given, the report and result dicts (``Report.to_dict()``, ``VerifyResult.to_dict()``,
``BenchResult.to_dict()``) what it found.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePath

from ..core.ops import MATRIX_OPS
from ..rules.loader import builtin_rules_dir

PROG = "amp-rewrite"
#: stands for a file of real inputs where the command was given none (tune needs one)
DATA = "DATA.npz"


@dataclass(frozen=True)
class Given:
    """What the command that writes a page was given, as the user typed it: the float32 model,
    the converted one, input files (``--inputs``, or convert's ``--calibration``), ``--shape``
    and ``--signature``."""

    original: str
    converted: str
    inputs: tuple[str, ...] = ()
    shapes: tuple[str, ...] = ()
    signature: str | None = None

    def run_flags(self) -> list[str]:
        """The flags that feed a model the same data: the first input file, shapes, signature."""
        flags = ["--inputs", self.inputs[0]] if self.inputs else []
        return flags + self.shape_flags() + (["--signature", self.signature] if self.signature
                                             else [])

    def shape_flags(self) -> list[str]:
        """``--shape`` for each shape given."""
        return [f for shape in self.shapes for f in ("--shape", shape)]


@dataclass(frozen=True)
class Step:
    """A command to run next (``argv`` without the program) and why."""

    why: str
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        """The command line, quoted for a POSIX shell."""
        return shlex.join((PROG, *self.argv))


def after_convert(report: dict, given: Given) -> list[Step]:
    """What to run after a conversion, most useful first: where the cost model estimates that
    freezing the SavedModel gains (its ``freezing`` hint names ``--freeze``), the conversion
    again with ``--freeze``; where no matrix op runs in 16 bits, ``--measure`` if the cost
    model kept them (bfloat16 on a CPU), else ``explain`` of one; otherwise verify, then bench."""
    s = report["summary"]
    if report.get("freezing", {}).get("summary", "").startswith("convert with --freeze"):
        return [Step("the cost model estimates that freezing the weights gains: convert again "
                     "with --freeze, which writes a SavedModel serving the same signatures "
                     "(add any --keep you converted with)",
                     (*_again(report, given), "--freeze", "--force"))]
    if s["matrix_total"] and not matrix_in_16_bits(s):
        cost = s["kept_float32_by_reason"].get("cost", 0)
        if cost and "measured" not in report:
            return [Step(f"the cost model kept the matrix work float32 ({cost} nodes, code "
                         "cost): time that against the model painted whole on this machine, "
                         "and keep the faster (add any --keep you converted with)",
                         (*_again(report, given), "--measure", "--force"))]
        kept = next((n["name"] for n in report["nodes"]
                     if n["op"] in MATRIX_OPS and n["precision"] == "float32"), None)
        if kept is not None:
            return [Step("no matrix op runs in 16 bits: see why one stayed float32",
                         ("explain", given.original, kept))]
    return [_verify(given, "check the converted model's outputs against the float32 model's"),
            _bench(given, "then time both on this machine")]


def _again(report: dict, given: Given) -> tuple[str, ...]:
    """The conversion as it ran, from what the report and ``given`` hold (not ``--keep``,
    which the report does not record as a flag)."""
    kept = report.get("freeze", {}).get("frozen") is False   # (frozen by default otherwise)
    return (given.original, "-o", given.converted, "--target", report["target"],
            "--device", report["device"].lower(), *_rule_flags(report),
            *(["--no-freeze"] if kept else []),
            *[f for path in given.inputs for f in ("--calibration", path)],
            *given.shape_flags())


def matrix_in_16_bits(summary: dict) -> int:
    """How many matrix ops compute in a 16-bit dtype (either, or both), by a report's summary
    (one written before ``matrix_by_dtype`` counted the target only)."""
    by_dtype = summary.get("matrix_by_dtype")
    if by_dtype is None:
        return summary["matrix_converted"]
    return sum(n for d, n in by_dtype.items() if d not in ("float32", "none"))


def after_verify(verify: dict, given: Given, report: dict | None = None) -> list[Step]:
    """What to run after verify: bench where it passed; tune where it failed (with a file of
    real inputs, which tune needs), and the per-node ranking if it was not asked for."""
    if verify["ok"]:
        return [_bench(given, "within tolerance: time both on this machine")]
    steps = [_tune(verify, given, report)]
    if not verify.get("per_node"):
        steps.append(Step("or rank the tensors by the error each adds",
                          ("verify", given.original, given.converted, *given.run_flags(),
                           "--per-node")))
    return steps


def after_bench(bench: dict, given: Given) -> list[Step]:
    """What to run after bench: verify where the converted model ran faster; where it did not,
    the kernels it ran (which 16-bit ops ran as such)."""
    if bench["speedup"] > 1.0:
        return [_verify(given, "faster here: check its outputs against the float32 model's")]
    return [Step("not faster here: see which kernels the converted model ran, and in which dtype",
                 ("kernels", given.converted, *given.run_flags()))]


def after_tune(tune: dict, given: Given) -> list[Step]:
    """What to run after tune wrote its result: time it against the float32 model, then
    verify it with every check (tune scored one metric)."""
    return [_bench(given, "within tolerance: time the tuned model against the float32 one"),
            _verify(given, f"then check it with all of verify's checks (tune scored "
                    f"{tune['metric']} only)")]


def _verify(given: Given, why: str) -> Step:
    return Step(why, ("verify", given.original, given.converted, *given.run_flags()))


def _bench(given: Given, why: str) -> Step:
    return Step(why, ("bench", given.original, given.converted, *given.run_flags()))


def _tune(verify: dict, given: Given, report: dict | None) -> Step:
    """tune of the float32 model for the dtype verify found, to a path beside the converted
    one; where verify was given no input file, :data:`DATA` stands for one."""
    target = verify.get("dtype", "float16")
    device = (report or {}).get("device", "CPU" if target == "bfloat16" else "GPU").lower()
    fed = dataclasses.replace(given, inputs=given.inputs[:1] or (DATA,))
    why = "out of tolerance: find the nodes to keep float32 that bring it within"
    if not given.inputs:
        why += f" ({DATA}: a file of real inputs, keyed by input name)"
    return Step(why, ("tune", given.original, "-o", tuned_path(given.converted), "--target",
                      target, "--device", device, *_rule_flags(report or {}),
                      *fed.run_flags()))


def _rule_flags(report: dict) -> list[str]:
    """``--rules`` for each rule file the conversion stacked on the built-in ones."""
    builtin = builtin_rules_dir().resolve()
    return [f for path in report.get("rules", [])
            if PurePath(path).parent != builtin and Path(path).resolve().parent != builtin
            for f in ("--rules", path)]


def tuned_path(converted: str) -> str:
    """Where a tuned model goes: beside ``converted``, ``_tuned`` before its suffix."""
    path = PurePath(converted)
    return str(path.with_name(f"{path.stem}_tuned{path.suffix}"))
