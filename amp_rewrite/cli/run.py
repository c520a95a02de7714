"""The ``amp-rewrite`` command line: parse, check paths, report errors. No TensorFlow here.

``amp-rewrite IN -o OUT [options]`` converts; ``amp-rewrite COMMAND ...`` runs ``explain``,
``rules``, ``verify``, ``kernels``, ``bench``, ``tune``, ``ranges`` or ``costs``. Every flag is defined in this module and every
path is checked before TensorFlow is imported (that takes seconds), so a usage or path error
answers at once. Then :mod:`amp_rewrite.cli.commands`, which imports TensorFlow, runs the command.

Exit codes: 0 ok, 1 ``verify`` found an output out of tolerance (``tune``: could not meet it), 2 bad input or usage
(:data:`~amp_rewrite.core.errors.INPUT_EXIT`), 70 a bug in amp-rewrite
(:data:`~amp_rewrite.core.errors.INTERNAL_EXIT`). Errors are one line; ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from ..core.errors import INPUT_EXIT, INTERNAL_EXIT, AmpRewriteError, InputError, flags_in_messages
from ..io.files import (
    already_exists,
    check_container,
    is_keras_file,
    is_saved_model,
    not_freezable,
    refuse_graph_file_options,
    same_file,
    tune_rules_path,
)
from ..core.hardware import CPU_CLASSES
from ..rules.cost_table import SHIPPED, read_table
from ..training.config import scale_config
from ..version import __version__

PROG = "amp-rewrite"
COMMANDS = ("explain", "rules", "verify", "kernels", "bench", "tune", "ranges", "costs")
#: the module that runs the commands; loaded only once the arguments are checked (it imports
#: TensorFlow), which is why it is named here instead of imported
RUNNER_MODULE = "amp_rewrite.cli.commands"
_LOSS_SCALE_DEFAULTS = "start 32768, interval 2000, factor 2"
#: what --headroom's help names as its default: amp_rewrite.core.dtypes.HEADROOM (not imported
#: here: that module imports TensorFlow's protos; tests/test_ranges.py holds the two equal)
HEADROOM_DEFAULT = "32"
#: the batch --shape's help says an open one counts as: amp_rewrite.paint.costs.DEFAULT_BATCH
#: (not imported here, for the same reason; tests/test_costs.py holds the two equal)
BATCH_DEFAULT = "1"
#: TF_CPP_MIN_LOG_LEVEL without -v: TensorFlow's C++ log shows fatal errors only
QUIET_TF_LOG_LEVEL = "3"
#: what every command's model argument takes (a Keras file as its serving function's SavedModel)
MODEL_FORMATS = "GraphDef, MetaGraph, SavedModel dir or Keras file"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2
        self.exit(INPUT_EXIT, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, where an unrecognized option also names the closest one this command
        has (``--targt``: did you mean --target?)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._closest_option(extras)}")
        return namespace

    def _closest_option(self, extras: list[str]) -> str:
        known = sorted(s for s in self._option_string_actions if s.startswith("--"))
        for arg in extras:
            if arg.startswith("-") and not re.fullmatch(r"-\d*\.?\d+", arg):   # not -1.5
                close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


# ----------------------------------------------------------------- flags
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log each step and show tracebacks")
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")


def _rule_flags(p: argparse.ArgumentParser, float32: bool = False) -> None:
    """``--target``, ``--device``, ``--rules``; ``float32``: the command also takes
    ``--target float32`` (convert and explain: a model that computes in 16 bits moved back)."""
    if float32:
        p.add_argument("--target", choices=["float16", "bfloat16", "float32"], default="float16",
                       help="low-precision dtype (default float16, for Tensor Cores), or "
                            "float32: a model that computes in 16 bits (a Keras mixed_float16 "
                            "export, a converted model) moved back to float32 whole")
    else:
        p.add_argument("--target", choices=["float16", "bfloat16"], default="float16",
                       help="low-precision dtype (default float16, for Tensor Cores)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="device unplaced nodes run on; decides which kernels exist (default gpu)")
    p.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="rule file stacked on the defaults (repeatable, applied in order)")


def _costs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", metavar="FILE|shipped|CLASS",
                   help="the rates the cost model of bfloat16 on cpu weighs with: a table "
                        "'amp-rewrite costs measure' wrote, 'shipped' for the shipped table "
                        "of this CPU's class, or a class's (" + ", ".join(CPU_CLASSES) + "), "
                        "to convert for a CPU of that class (default: the table measured on "
                        "this CPU where there is one, else the shipped one of its class; "
                        "'amp-rewrite costs show' says which)")


def _painting_flags(p: argparse.ArgumentParser) -> None:
    """What painting keeps, for convert, explain and tune alike."""
    p.add_argument("--keep", action="append", default=[], metavar="NAME",
                   help="node whose dtypes must not change (repeatable)")
    p.add_argument("--lowp-io", action="store_true",
                   help="let graph inputs and outputs take the low-precision dtype too")
    p.add_argument("--min-matrix-intensity", type=float, metavar="X",
                   help="least matrix work (FLOPs per element an op reads and writes) the "
                        "biggest MatMul/Conv of a 16-bit island needs, else the island stays "
                        "float32 (default 128 for bfloat16 on cpu, else 0)")


def _folding_flags(p: argparse.ArgumentParser) -> None:
    """What the conversion does to a model before painting, for convert and explain alike."""
    p.add_argument("--fold-constants", action=argparse.BooleanOptionalAction,
                   help="fold Const-only float32 subgraphs before painting, and batch norms "
                        "into the convolutions they follow (graphs without variables): fewer "
                        "casts, one rounding per folded value, convolutions TensorFlow fuses "
                        "with their activations (default: on for bfloat16 on cpu)")
    p.add_argument("--freeze", action=argparse.BooleanOptionalAction,
                   help="a SavedModel or Keras file: freeze every serving signature (variables "
                        "to Consts), fold constants as --fold-constants does and convert; writes "
                        "a SavedModel serving the same signatures and the methods that serve "
                        "them (default: for bfloat16 on cpu, a SavedModel that only serves is "
                        "frozen where nothing it holds would be lost; --no-freeze keeps the "
                        "variables)")


def _batch_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...",
                   help="the shape input NAME runs at (repeatable; its first dimension is the "
                        "batch), for the cost model of bfloat16 on cpu, which weighs casts of "
                        "variable weights (once a run) against matrix savings (per sample), "
                        "here and in the function bodies the input is passed to; without it "
                        f"an open batch counts as a batch of {BATCH_DEFAULT}")


def _convert_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Convert an FP32 TensorFlow graph to mixed precision "
                f"('{PROG} convert IN -o OUT' says the same). Other commands: " + ", ".join(sorted(COMMANDS)) + " (amp-rewrite CMD -h).")
    p.add_argument("input", help="GraphDef (.pb/.pbtxt), MetaGraphDef (.meta), SavedModel "
                   "directory, or Keras file (.keras/.h5: converts to a SavedModel directory)")
    p.add_argument("-o", "--output", required=True, help="where to write the converted graph")
    _rule_flags(p, float32=True)
    _painting_flags(p)
    p.add_argument("--emulate", action="store_true",
                   help="write float16's float32 emulation (float16 rules, but each float16 op "
                        "computes in float32 on values rounded to float16): to see float16's "
                        "numbers without a GPU (a SavedModel's function bodies included)")
    _folding_flags(p)
    p.add_argument("--cost-aware", action="store_true",
                   help="never slower than float32 on this machine, for --device cpu --target "
                        "bfloat16: on a CPU with no bfloat16 matrix unit (AVX2 only) every "
                        "island stays float32 (code cost), whatever --costs says; on one with a "
                        "unit the conversion is timed against float32 as --measure times it, "
                        "and the fastest written")
    _batch_flag(p)
    _costs_flag(p)
    p.add_argument("--measure", action="store_true",
                   help="bfloat16 on cpu: time the float32 input, the cost model's conversion "
                        "and, where it kept nodes float32, the one painted whole on this "
                        "machine, each in its own process as bench times (inputs as bench "
                        "feeds them, --shape for open dimensions), and write the fastest (the "
                        "input unconverted where float32 ran fastest)")
    _calibration_flags(p)
    p.add_argument("--report", metavar="FILE.json", help="write every node's decision as JSON")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output, --report file or --html file")
    p.add_argument("--in-place", action="store_true", help="allow the output to be the input")
    g = p.add_argument_group("training graphs")
    g.add_argument("--loss-scale", metavar="dynamic|none|N",
                   help="loss scaling for training graphs (default: dynamic for float16, "
                        "none for bfloat16; a number is a static scale)")
    g.add_argument("--loss-scale-start", type=float, metavar="S", help="first dynamic scale")
    g.add_argument("--loss-scale-interval", type=int, metavar="STEPS",
                   help="finite steps before the scale grows")
    g.add_argument("--loss-scale-factor", type=float, metavar="F",
                   help=f"growth and shrink factor (defaults: {_LOSS_SCALE_DEFAULTS})")
    g.add_argument("--loss", metavar="NAME", help="the loss tensor whose backprop seed to scale")
    g.add_argument("--grad", action="append", default=[], metavar="NAME",
                   help="a backprop seed (the gradient fed to tf.gradients / the tape), repeatable")
    p.add_argument("--html", metavar="REPORT.html",
                   help="also write a self-contained HTML report of the conversion")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write the converted graph as a TensorBoard event file into DIR")
    _common(p)
    return p


def _calibration_flags(p: argparse.ArgumentParser) -> None:
    """Range-aware precision: the float32 model run on data first (docs/ranges.md)."""
    g = p.add_argument_group("calibration (docs/ranges.md)")
    g.add_argument("--calibration", action="append", default=[], metavar="DATA.npz",
                   help="run the float32 model on these inputs (arrays keyed by input name; "
                   "repeatable) and keep float32 every node whose inputs or outputs come within "
                   "--headroom of the 16-bit dtype's largest value (code range)")
    _headroom_flag(g)
    g.add_argument("--checkpoint", metavar="PREFIX",
                   help="restore a MetaGraph's variables from this checkpoint for the "
                   "calibration run (default: their initializers)")
    _nonfinite_flag(g, "calibrate")


def _nonfinite_flag(p, what: str) -> None:
    """A verdict, a tuning or a calibration needs the float32 model's values finite on the
    data given; this flag goes ahead anyway."""
    p.add_argument("--allow-nonfinite-reference", action="store_true",
                   help=f"{what} even where the float32 model itself gives inf or NaN on the "
                   "data (refused by default, exit 2: there is no finite reference)")


def _headroom_flag(p) -> None:
    p.add_argument("--headroom", type=float, metavar="H",
                   help="the safety factor: a tensor whose largest magnitude reaches the 16-bit "
                   f"dtype's largest value / H is too close (default {HEADROOM_DEFAULT}: "
                   "float16 tensors from 2047 on)")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by verify and bench: which inputs, shapes, signature, outputs, weights."""
    p.add_argument("original", help=f"the FP32 model ({MODEL_FORMATS})")
    p.add_argument("converted", help="the converted model (the same formats)")
    _run_flags(p)
    p.add_argument("--output", action="append", default=[], metavar="TENSOR",
                   help="graph output to compare (repeatable; default the signature's "
                   "outputs, else the nodes nothing reads)")
    p.add_argument("--checkpoint", metavar="PREFIX",
                   help="restore the original MetaGraph's variables from this checkpoint "
                   "(default: run its initializers); the converted graph gets the same values")
    _init_op_flag(p)


def _init_op_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init-op", action="append", default=[], metavar="NAME",
                   help="an op to run once in each model before the first run, after the "
                   "variables and the table and iterator initializers found by themselves "
                   "(repeatable; graph files)")


def _run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inputs", metavar="DATA.npz", help="input arrays keyed by input name")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...",
                   help="shape of an input with unknown dimensions (repeatable)")
    p.add_argument("--signature", help="signature key of a MetaGraph or SavedModel "
                   "(default serving_default, else the first)")


def _command_parser(command: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} {command}")
    if command == "explain":
        p.add_argument("input", help=f"the FP32 model to explain ({MODEL_FORMATS})")
        p.add_argument("node", nargs="+", help="node name(s) to explain")
        _rule_flags(p, float32=True)
        _painting_flags(p)
        _folding_flags(p)
        _batch_flag(p)
        _costs_flag(p)
        _calibration_flags(p)
    elif command == "rules":
        p.add_argument("action", choices=["show"], help="show the effective op lists")
        _rule_flags(p)
    elif command == "verify":
        _model_flags(p)
        p.add_argument("--samples", type=int, default=1, metavar="N",
                       help="random input sets to run (default 1; ignored with --inputs)")
        p.add_argument("--check", action="append", default=[],
                       choices=["rel_l2", "top1", "allclose", "max_abs"],
                       help="how to judge each output (repeatable; default rel_l2 and top1, "
                       "plus each check whose threshold is given)")
        p.add_argument("--rel-l2", type=float, metavar="X", help="largest relative L2 error "
                       "||conv-orig||/||orig|| per output (default by the converted graph's "
                       "dtype: float16 0.01, bfloat16 0.05)")
        p.add_argument("--grad-rel-l2", type=float, metavar="X", help="the same for the "
                       "gradients a training graph's outputs include (default 0.1; 1e-5 when "
                       "nothing is 16-bit)")
        p.add_argument("--top1", type=float, metavar="X", help="least share of rows whose "
                       "argmax agrees, on outputs that are batches of scores (default 0.99; "
                       "near-ties count as agreeing)")
        p.add_argument("--rtol", type=float, help="allclose check: relative tolerance per "
                       "element (default float16 0.01, bfloat16 0.05)")
        p.add_argument("--atol", type=float, help="allclose check: absolute tolerance per "
                       "element (default float16 0.001, bfloat16 0.01)")
        p.add_argument("--max-abs", type=float, metavar="X",
                       help="max_abs check: largest absolute error (no default)")
        _nonfinite_flag(p, "compare")
        p.add_argument("--per-node", action="store_true",
                       help="rank the tensors inside both models (a SavedModel's function "
                       "bodies included) by the error each adds")
        p.add_argument("--emulate", action="store_true",
                       help="run a float16 model as its float32 emulation (each float16 "
                       "op computes in float32 on values rounded to float16): float16's "
                       "numbers at float32 speed, on any CPU")
        p.add_argument("--top", type=int, default=10, metavar="N",
                       help="tensors to list with --per-node (default 10)")
        p.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report")
        p.add_argument("--report", metavar="FILE.json",
                       help="the convert command's JSON report, to include its decisions in --html")
        _force_flag(p, "--html")
    elif command == "tune":
        _tune_flags(p)
    elif command == "ranges":
        p.add_argument("model", help=f"the FP32 model ({MODEL_FORMATS})")
        p.add_argument("--inputs", action="append", required=True, metavar="DATA.npz",
                       help="input arrays keyed by input name, one run each (repeatable)")
        p.add_argument("--signature", help="signature key of a MetaGraph or SavedModel "
                       "(default serving_default, else the first)")
        p.add_argument("--checkpoint", metavar="PREFIX",
                       help="restore a MetaGraph's variables from this checkpoint (default: "
                       "their initializers)")
        p.add_argument("--top", type=int, default=20, metavar="N",
                       help="tensors to list, largest magnitude first (default 20)")
        p.add_argument("--target", choices=["float16", "bfloat16"], default="float16",
                       help="the 16-bit dtype whose largest value the tensors are measured "
                       "against, as --calibration with that --target keeps them (default "
                       "float16: 65504; bfloat16: 3.39e38)")
        _headroom_flag(p)
        p.add_argument("--json", metavar="FILE", help="also write every tensor's range as JSON")
        _force_flag(p, "--json")
    elif command == "kernels":
        p.add_argument("model", help=f"the converted model ({MODEL_FORMATS})")
        p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                       help="where to run it (default: gpu if TensorFlow sees one, else cpu)")
        _run_flags(p)
        p.add_argument("--json", metavar="FILE", help="also write the findings as JSON")
        _force_flag(p, "--json")
    elif command == "costs":
        _costs_command_flags(p)
    elif command == "bench":
        _model_flags(p)
        p.add_argument("--runs", type=int, default=20, help="timed runs of each (default 20)")
        p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
        p.add_argument("--json", metavar="FILE", help="also write the timings as JSON")
        p.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report")
        _force_flag(p, "--json", "--html")
    _common(p)
    return p


def _costs_command_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show", "measure"],
                   help="show: the cost table a conversion on this CPU weighs with, where it "
                        "comes from, and its rates; measure: time the single ops the rates "
                        "come from on this CPU (about a minute) and write its table where "
                        "conversions on this CPU find it")
    p.add_argument("--costs", metavar="FILE|shipped",
                   help="show: this table instead of the one a conversion would choose")
    p.add_argument("-o", "--output", metavar="FILE.toml",
                   help="measure: write the table here instead (then give it with --costs)")
    p.add_argument("--quick", action="store_true",
                   help="measure: small tensors and 3 rounds, in seconds: checks the command; "
                        "its rates are not this CPU's, so it needs -o")
    p.add_argument("--rounds", type=int, metavar="N",
                   help="measure: timed rounds of each op (default 30)")
    p.add_argument("--force", action="store_true", help="measure: replace an existing -o file")


def _force_flag(p: argparse.ArgumentParser, *flags: str) -> None:
    """--force, naming the files it replaces: those of ``flags``, the command's outputs."""
    p.add_argument("--force", action="store_true",
                   help=f"replace an existing {' or '.join(flags)} file")


def _tune_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help=f"the FP32 model ({MODEL_FORMATS})")
    p.add_argument("-o", "--output", required=True, help="where to write the tuned conversion")
    p.add_argument("--inputs", action="append", default=[], metavar="DATA.npz",
                   help="a sample: input arrays keyed by input name (repeatable; every sample "
                   "must meet the tolerance; required unless tf.data iterators alone feed the "
                   "model, whose first batch is then the sample)")
    p.add_argument("--holdout", action="append", default=[], metavar="DATA.npz",
                   help="a held-out sample, never tuned on: the result must pass on it too, "
                   "else exit 1 and nothing written")
    p.add_argument("--allow-holdout-failure", action="store_true",
                   help="write the result even where it fails on --holdout samples (warned)")
    _nonfinite_flag(p, "tune")
    # the default is core.dtypes.HEADROOM, which tune applies: importing it here would
    # import TensorFlow before a usage error could answer
    p.add_argument("--headroom", type=float, metavar="H",
                   help="keep float32 every tensor whose largest magnitude on the samples "
                   "comes within a factor H of the target's largest value (default: "
                   "HEADROOM in amp_rewrite/core/dtypes.py, as convert; 1: only those past it)")
    p.add_argument("--error-margin", type=float, default=1.0, metavar="F",
                   help="pass a trial on the samples only at the tolerance / F, so the result "
                   "keeps within the tolerance on batches it was not tuned on (default 1: no "
                   "margin; --holdout is judged against the tolerance itself)")
    p.add_argument("--metric", choices=["rel_l2", "max_abs", "top1"], default="rel_l2",
                   help="worst over the outputs: relative L2 error, largest absolute error, or "
                   "share of rows whose argmax moved (default rel_l2)")
    p.add_argument("--tolerance", type=float, metavar="X", help="largest metric a sample may "
                   "give (default what verify accepts: rel_l2 0.01 float16, 0.05 bfloat16; "
                   "top1 0.01; max_abs has none)")
    p.add_argument("--max-trials", type=int, default=50, metavar="N",
                   help="conversions to try at most (default 50)")
    p.add_argument("--relax", action="store_true", help="then also move into low precision "
                   "the nodes next to low-precision ones that only the rule lists kept "
                   "float32, where the tolerance holds (force_lowp overrides)")
    p.add_argument("--rules-out", metavar="FILE.toml", help="where to write the overrides "
                   "chosen (default OUTPUT.tune.toml)")
    _rule_flags(p)
    _painting_flags(p)
    _batch_flag(p)
    _costs_flag(p)
    p.add_argument("--signature", help="signature key of a MetaGraph or SavedModel "
                   "(default serving_default, else the first)")
    p.add_argument("--output-tensor", action="append", default=[], metavar="TENSOR",
                   help="graph output to score (repeatable; default the signature's outputs, "
                   "else the nodes nothing reads)")
    _init_op_flag(p)
    p.add_argument("--report", metavar="FILE.json", help="write every node's decision as JSON")
    p.add_argument("--html", metavar="REPORT.html",
                   help="also write a self-contained HTML report of the tuned conversion")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output, rules file, --report or --html file")


# ----------------------------------------------------------------- checks before any work
def _inside(path: str, folder: str) -> bool:
    return Path(folder).resolve() in Path(path).resolve().parents


def _check_output(path: str, what: str, *, force: bool, inputs=(), outputs=(),
                  folder: bool = False) -> None:
    """Refuse an output the command could not write, or must not: one that is an input or
    another output or lies inside one (a SavedModel directory), an existing one without
    ``force`` (``folder``: a TensorBoard folder, which takes a new file, must be a folder), a
    file output that is a directory, a folder that is missing or not writable. Checked for
    every output before the work starts, so that none is written unless all can be."""
    for other, whose in [(p, "the input") for p in inputs] + [(p, "an output") for p in outputs]:
        if same_file(path, other):
            raise InputError(f"{path}: the {what} would overwrite {other} ({whose})")
        if _inside(path, other):
            raise InputError(f"{path}: the {what} would be written inside {other} ({whose})")
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(f"{path}: not a folder, which the {what} must be")
    if not folder and os.path.isdir(path):
        raise InputError(f"{path}: is a directory")
    if not folder and os.path.lexists(path) and not force:
        raise InputError(already_exists(path))
    parent = path if folder and os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"{path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{path}: cannot write in {parent}: permission denied")


def _check_paths(command: str, args) -> None:
    """Refuse, before TensorFlow is imported, a missing input and an output that cannot be
    written (or would clobber the input, another output or an existing file)."""
    inputs = {"convert": [args.input] if command == "convert" else [],
              "explain": [getattr(args, "input", None)],
              "verify": [getattr(args, "original", None), getattr(args, "converted", None)],
              "bench": [getattr(args, "original", None), getattr(args, "converted", None)],
              "kernels": [getattr(args, "model", None)],
              "ranges": [getattr(args, "model", None)],
              "tune": [getattr(args, "input", None)]}.get(command, [])
    inputs += list(getattr(args, "rules", []) or [])
    inputs += list(getattr(args, "calibration", []) or [])
    given = getattr(args, "inputs", None)
    inputs += given if isinstance(given, list) else [given] if given else []
    inputs += list(getattr(args, "holdout", []) or [])
    if getattr(args, "costs", None) not in (None, SHIPPED, *CPU_CLASSES):
        inputs.append(args.costs)
    if command == "verify" and args.report:
        inputs.append(args.report)
    for path in inputs:
        if not os.path.exists(path):
            raise InputError(f"{path}: no such file")
    _check_calibration_flags(command, args)
    _check_costs(command, args, inputs)
    if command == "tune":
        _check_tune_outputs(args, inputs)
    if command == "convert":
        _check_convert_outputs(args, inputs)
        scale_config(args.loss_scale, args.target, args.loss_scale_options)  # conflicts, ranges
        saved = is_saved_model(args.input) or is_keras_file(args.input)
        if args.freeze:
            _check_freeze_flags(args, saved)
        if saved:   # before a Keras export
            refuse_graph_file_options(args.input, {
                "lowp_io": args.lowp_io, "fold_constants": args.fold_constants and not args.freeze,
                **args.loss_scale_options})
    written = []
    for flag in ("html", "json"):
        path = getattr(args, flag, None)
        if path and command not in ("convert", "tune"):   # (theirs are checked with theirs)
            _check_output(path, f"--{flag} file", force=args.force, inputs=inputs, outputs=written)
            written.append(path)


def _check_costs(command: str, args, inputs: list[str]) -> None:
    """``--costs FILE`` is a cost table (read and checked here, before TensorFlow); ``costs
    measure`` writes where it may, with --quick only to a file of its own."""
    given = getattr(args, "costs", None)
    if given is not None and given not in (SHIPPED, *CPU_CLASSES):
        read_table(given)
    if command != "costs":
        return
    flags = {"show": [("-o", args.output), ("--quick", args.quick), ("--rounds", args.rounds),
                      ("--force", args.force)],
             "measure": [("--costs", args.costs)]}[args.action]
    for flag, value in flags:
        if value:
            raise InputError(f"costs {args.action} takes no {flag}")
    if args.action != "measure":
        return
    if args.quick and not args.output:
        raise InputError("costs measure --quick: its rates are not this CPU's (small tensors, "
                         "3 rounds), so it writes only where -o FILE says, never where "
                         "conversions look for this CPU's table")
    if args.rounds is not None and args.rounds < 1:
        raise InputError(f"--rounds {args.rounds}: must be at least 1")
    if args.output:
        _check_output(args.output, "cost table", force=args.force, inputs=inputs)


def _check_freeze_flags(args, saved: bool) -> None:
    """--freeze takes a SavedModel or Keras file, and not the options that name what freezing
    changes (--calibration's tensors) or retype the signatures (--lowp-io)."""
    if not saved:
        raise InputError(not_freezable(args.input))
    for flag, given in (("--calibration", args.calibration), ("--lowp-io", args.lowp_io)):
        if given:
            raise InputError(f"{flag} and --freeze: --freeze does not take {flag} (docs/"
                             "savedmodels.md \"--freeze\"); drop one")


def _check_calibration_flags(command: str, args) -> None:
    """--headroom is a number of at least 1; with convert and explain it and --checkpoint
    shape the calibration run, so they need --calibration; ranges' --top lists at least one."""
    headroom = getattr(args, "headroom", None)
    if headroom is not None and not 1 <= headroom < float("inf"):
        raise InputError(f"--headroom {headroom:g}: must be a number of at least 1 (the 16-bit "
                         "dtype's largest value is divided by it)")
    margin = getattr(args, "error_margin", None)
    if margin is not None and not 1 <= margin < float("inf"):
        raise InputError(f"--error-margin {margin:g}: must be a number of at least 1 (the "
                         "tolerance is divided by it on the tuning samples)")
    if command in ("convert", "explain") and not args.calibration:
        given = [flag for flag, value in (("--headroom", headroom),
                                          ("--checkpoint", args.checkpoint)) if value is not None]
        if given:
            raise InputError(f"{' and '.join(given)}: only for the calibration run; add "
                             "--calibration DATA.npz (docs/ranges.md)")
    if command == "ranges" and args.top < 1:
        raise InputError(f"--top {args.top}: must be at least 1")


def _check_tune_outputs(args, inputs: list[str]) -> None:
    _check_model_output(args.input, args.output, force=args.force, inputs=inputs)
    written = [args.output]
    rules_out = args.rules_out or str(tune_rules_path(args.output))
    for path, what in ((rules_out, "rules file"), (args.report, "--report file"),
                       (args.html, "--html file")):
        if path:
            _check_output(path, what, force=args.force, inputs=inputs, outputs=written)
            written.append(path)


def _loss_scale_options(args) -> dict:
    """The convert command's loss-scale numbers and hints, as ``Options.loss_scale_options``."""
    options = {key: value for key, value in (("start", args.loss_scale_start),
                                             ("interval", args.loss_scale_interval),
                                             ("factor", args.loss_scale_factor),
                                             ("loss", args.loss)) if value is not None}
    if args.grad:
        options["grads"] = list(args.grad)
    return options


def _check_convert_outputs(args, inputs: list[str]) -> None:
    """The converted model, then its side outputs."""
    if same_file(args.input, args.output) and not args.in_place:
        raise InputError(f"{args.output}: the output is the input; pass --in-place to overwrite it")
    _check_model_output(args.input, args.output, force=args.force or args.in_place,
                        inputs=[p for p in inputs if not same_file(p, args.output)])
    written = [args.output]
    for path, what, folder in ((args.report, "--report file", False),
                               (args.html, "--html file", False),
                               (args.tensorboard, "--tensorboard folder", True)):
        if path:
            _check_output(path, what, force=args.force, inputs=inputs, outputs=written,
                          folder=folder)
            written.append(path)


def _check_model_output(src: str, dst: str, *, force: bool, inputs: list[str]) -> None:
    """A converted model's path: a file, or a directory for a SavedModel or a Keras file (which
    saving checks further: it replaces only a SavedModel)."""
    if not is_saved_model(src) and not is_keras_file(src):
        _check_output(dst, "output", force=force, inputs=inputs)
        return
    check_container(src, dst)
    if os.path.lexists(dst) and not force:
        raise InputError(already_exists(dst))
    _check_output(dst, "output", force=True, inputs=inputs, folder=True)
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.access(folder, os.W_OK):   # a SavedModel is built beside its place, then renamed
        raise InputError(f"{dst}: cannot write in {folder}: permission denied")


def _refuse_unknown_command(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """A first argument that is no option, no file and no command (``amp-rewrite verfy a.pb
    b.pb``, ``amp-rewrite frobnicate x``) would otherwise be taken for a model to convert and
    get a complaint about a missing -o. One that looks like a path (a ``.`` or ``/`` in it) and
    is no command's misspelling goes on to the usual checks (``no such file``)."""
    if not argv or argv[0].startswith("-") or os.path.exists(argv[0]):
        return
    commands = ", ".join(sorted(COMMANDS + ("convert",)))
    close = difflib.get_close_matches(argv[0], sorted(COMMANDS + ("convert",)), n=1, cutoff=0.6)
    if close:
        parser.error(f"no file {argv[0]!r} and no command of that name; did you mean "
                     f"'{PROG} {close[0]}'? (commands: {commands})")
    if not any(c in argv[0] for c in "./" + os.sep):
        parser.error(f"no file {argv[0]!r} and no command of that name (commands: {commands}; "
                     f"a conversion is '{PROG} MODEL -o OUTPUT')")


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """The command (``"convert"`` for a conversion) and its arguments; usage errors exit 2.
    ``amp-rewrite convert IN -o OUT`` is ``amp-rewrite IN -o OUT`` (unless a file is named
    ``convert``): the word its help answers to."""
    converting = bool(argv) and argv[0] == "convert" and not os.path.exists(argv[0])
    if converting:
        argv = argv[1:]
    elif argv and argv[0] in COMMANDS:
        return argv[0], _command_parser(argv[0]).parse_args(argv[1:])
    parser = _convert_parser()
    if not converting:
        _refuse_unknown_command(argv, parser)
    args = parser.parse_args(argv)
    args.loss_scale_options = _loss_scale_options(args)
    return "convert", args


# ----------------------------------------------------------------- running
def _setup_logging(args) -> None:
    level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    logger = logging.getLogger("amp_rewrite")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _load_runner(verbose: bool):
    """Import :data:`RUNNER_MODULE` (and with it TensorFlow) and let TensorFlow find its
    devices, with the C++ lines both print (start-up notes, a CUDA error on machines without a
    GPU driver) kept off stderr unless ``-v``: no environment variable silences them all."""
    if verbose:
        module = importlib.import_module(RUNNER_MODULE)
        module.init_devices()
        return module
    try:
        saved = os.dup(2)
    except OSError:
        return importlib.import_module(RUNNER_MODULE)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        module = importlib.import_module(RUNNER_MODULE)
        module.init_devices()
        return module
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, args = parse(argv)
    if not args.verbose:
        # TensorFlow's C++ log would bury our one-line messages, its error level included: a
        # float16 graph run on a CPU logs "oneDNN supports DT_HALF only on ..." at that level
        # and runs fine, and a real failure reaches us as an exception, which we report. So
        # the level is 3 (fatal only) whatever the shell set (a common TF_CPP_MIN_LOG_LEVEL=2
        # lets that line through), for this process and the ones it starts; -v leaves the
        # variable as the user set it and shows the log.
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = QUIET_TF_LOG_LEVEL
    _setup_logging(args)
    try:
        with flags_in_messages():   # the library's messages name --force, not force=True
            _check_paths(command, args)
            code = _load_runner(args.verbose).run(command, args)
        # a reader that went away meets the summary here, where it is exit 141, and not in
        # the final flush of a block-buffered stdout (into a pipe), which cannot report it
        sys.stdout.flush()
        return code
    except AmpRewriteError as exc:
        if args.verbose:
            traceback.print_exc()
        one_line = " ".join(str(exc).split())  # messages quoting parsers may hold newlines
        internal = "" if isinstance(exc, InputError) else "internal error (a bug in amp-rewrite): "
        print(f"{PROG}: error: {internal}{one_line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # stdout's reader went away (| head): not a bug, and no one to tell
        return 141   # what a shell reports for a process SIGPIPE ended
    except Exception as exc:  # our bug: one line unless -v
        if args.verbose:
            traceback.print_exc()
        print(f"{PROG}: internal error (a bug in amp-rewrite): {type(exc).__name__}: {exc} "
              "(run with -v for the traceback)", file=sys.stderr)
        return INTERNAL_EXIT


def console() -> NoReturn:
    """The ``amp-rewrite`` command (and ``python -m amp_rewrite``): :func:`main`, then the
    process ends without tearing the interpreter down.

    Everything the command writes is complete by then (files through a rename, or closed;
    stdout, stderr and the log flushed here); what a normal exit would add is TensorFlow's
    teardown, about 1.2 s of every run (BENCHMARKS.md "Conversion speed"), done for a process
    that ends anyway. :func:`main` itself returns, for callers in a process that goes on.
    """
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe (| head): what was lost is lost either way
            pass
    os._exit(code)


if __name__ == "__main__":
    console()
