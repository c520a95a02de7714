"""What each command of the ``amp-rewrite`` CLI does, once :mod:`amp_rewrite.cli` has parsed
and checked its arguments. This half imports TensorFlow; with :mod:`amp_rewrite.cli` it is the
only code that prints (the library logs).

A command makes all its outputs in memory (the model, reports, pages) and then writes them as
one :class:`~amp_rewrite.io.files.OutputSet`: every file, or (on any error) none.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..conversion.graph import Options
from ..conversion.pipeline import convert_model, convert_path
from ..core import hardware
from ..core.dtypes import HEADROOM, TARGETS
from ..core.errors import InputError
from ..io.files import OutputSet, atomic_write, is_keras_file
from ..io.keras_files import saved_models
from ..io.load import load
from ..io.save import stage
from ..report import html, tensorboard
from ..report.steps import Given
from ..rules import cost_table
from ..rules.loader import LISTS, load_rules
from ..tools import bench as bench_mod
from ..tools import kernels as kernels_mod
from ..tools import measured as measured_mod
from ..tools import op_costs
from ..tools import ranges as ranges_mod
from ..tools import tuning
from ..tools import verify as verify_mod
from ..tools.runner import init_devices, parse_shapes

log = logging.getLogger(__name__)


__all__ = ["init_devices", "run"]


#: the arguments of each command that name a model, any of which may be a Keras file (tune
#: takes one itself, to name it in its rules file)
_MODEL_ARGS = {"convert": ("input",), "explain": ("input",), "verify": ("original", "converted"),
               "bench": ("original", "converted"), "kernels": ("model",), "ranges": ("model",)}


def run(command: str, args) -> int:
    """Run ``command`` (``"convert"`` or one of the CLI's commands) with parsed ``args``; a
    Keras file among its models runs as the SavedModel of its serving function, exported for
    the command and removed after it."""
    keras_args = [name for name in _MODEL_ARGS.get(command, ())
                  if is_keras_file(getattr(args, name))]
    if not keras_args:
        return _COMMANDS[command](args)
    with saved_models([getattr(args, name) for name in keras_args]) as exports:
        # the pages name the models as the user typed them (their next command runs the
        # Keras file again), not the export that lives as long as this command
        args = argparse.Namespace(**vars(args), typed={n: getattr(args, n) for n in keras_args})
        for name, path in zip(keras_args, exports):
            setattr(args, name, str(path))
        return _COMMANDS[command](args)


def _typed(args, name: str) -> str:
    """The path argument ``name`` as the user typed it (a Keras file, not its export)."""
    return getattr(args, "typed", {}).get(name, getattr(args, name))


def _where(target: str | None) -> str:
    """The pages' line on this machine: the CPU and what ``target`` means on it, or that
    TensorFlow runs the models on a GPU here."""
    if hardware.gpu_visible():
        return "TensorFlow sees a GPU here, and runs the models on it"
    return hardware.machine_line(target)


def convert(args) -> int:
    options = _options(args)
    # --cost-aware promises a model never slower than float32 on this machine: where the CPU
    # has no bfloat16 unit every island stays float32 (painting_target); where it has one,
    # only a timing can say it, so the conversion is measured against float32 (--measure)
    if args.measure or (options.cost_aware and options.weighed() and not options.slower_here()):
        model, report, _ = measured_mod.measured_conversion(
            args.input, args.output, options, shapes=parse_shapes(args.shape))
    else:
        model, report = convert_path(args.input, options)
    with OutputSet() as outputs:
        stage(model, args.output, outputs, force=args.force or args.in_place)
        if args.report:
            outputs.add_file(args.report, report.to_json().encode("utf-8"), force=args.force)
        if args.html:
            given = Given(_typed(args, "input"), args.output, tuple(args.calibration or ()),
                          tuple(args.shape))
            page = html.convert_page(report.to_dict(), where=_where(args.target), given=given)
            outputs.add_file(args.html, page.encode("utf-8"), force=args.force)
        if args.tensorboard:
            event = tensorboard.stage_tensorboard(outputs, args.tensorboard, model.graph_def)
        outputs.commit()
    if args.tensorboard:
        log.info("wrote the converted graph for TensorBoard to %s", event)
    if not args.quiet:
        print(f"wrote {args.output}")
        print(report.format_summary())
        if not (options.slower_here() or hardware.gpu_visible()):   # (a warning said that)
            print(hardware.machine_line(args.target))
    return 0


def _options(args) -> Options:
    """The conversion the convert command's arguments ask for (the CLI checked the paths)."""
    options = Options(
        target=args.target, device=args.device, rules=args.rules, keep=args.keep,
        lowp_io=args.lowp_io, fold_constants=args.fold_constants, loss_scale=args.loss_scale,
        loss_scale_options=args.loss_scale_options,
        min_matrix_intensity=args.min_matrix_intensity, emulate=args.emulate,
        cost_aware=args.cost_aware, shapes=parse_shapes(args.shape), freeze=args.freeze,
        costs=args.costs)
    return _calibrated(options, args)


def _calibrated(options: Options, args) -> Options:
    """``options`` with the calibration ``--calibration`` asks for: the float32 model run on
    each file first (checked before the run, which takes a while), its tensors' largest
    magnitudes recorded (:func:`amp_rewrite.tools.ranges.calibrate`)."""
    if not args.calibration:
        return options
    options.headroom = HEADROOM if args.headroom is None else args.headroom
    options.check()
    found = ranges_mod.calibrate(args.input, args.calibration, checkpoint=args.checkpoint)
    if not args.allow_nonfinite_reference:
        found.check_finite()
    if not args.quiet:
        missed = f"; {len(found.unrecorded)} not recorded" if found.unrecorded else ""
        print(f"calibration: {found.samples} sample(s), {len(found.tensors)} float tensors "
              f"recorded{missed} (amp-rewrite ranges lists them)")
    options.calibration = found.maxima()
    return options


def explain(args) -> int:
    # Decisions do not depend on loss scaling, so a training graph is explained without it
    # (and without its hints, which explain has no flags for).
    options = Options(target=args.target, device=args.device, rules=args.rules, keep=args.keep,
                      lowp_io=args.lowp_io, loss_scale="none",
                      min_matrix_intensity=args.min_matrix_intensity,
                      shapes=parse_shapes(args.shape), costs=args.costs,
                      fold_constants=args.fold_constants, freeze=args.freeze)
    _, report = convert_model(load(args.input), _calibrated(options, args))
    for name in args.node:
        try:
            print(report.explain(name))
        except LookupError as exc:  # no such node (with close names), or ambiguous
            raise InputError(f"{args.input}: {exc.args[0]}") from None
    return 0


def rules(args) -> int:
    rule_set = load_rules(args.target, args.rules)
    print(f"# target {rule_set.target}, level {rule_set.level}")
    print("# from: " + ", ".join(rule_set.sources))
    if rule_set.env:
        print("# grappler variables: " + ", ".join(rule_set.env))
    print(f"# infer_follows_allow: {str(rule_set.infer_follows_allow).lower()}")
    for name in LISTS:
        ops = sorted(rule_set.effective(name))
        print(f"{name} ({len(ops)}): " + " ".join(ops))
    for rule in rule_set.node_rules:
        print(f"override: {rule.pattern} -> {rule.action} ({rule.source})")
    return 0


def verify(args) -> int:
    result = verify_mod.verify(args.original, args.converted, inputs=args.inputs,
                               samples=args.samples, shapes=parse_shapes(args.shape),
                               checks=args.check, rel_l2=args.rel_l2,
                               grad_rel_l2=args.grad_rel_l2, top1=args.top1,
                               rtol=args.rtol, atol=args.atol, max_abs=args.max_abs,
                               nodes=args.per_node,
                               signature=args.signature, outputs=args.output,
                               checkpoint=args.checkpoint, emulate=args.emulate,
                               init_ops=args.init_op,
                               nonfinite_reference=args.allow_nonfinite_reference)
    if not args.quiet:
        if not hardware.gpu_visible():
            print(hardware.machine_line(html.sixteen_bit(result.criteria.dtype)))
        print(verify_mod.format_result(result, args.top))
    if args.html:
        page = html.verify_page(result, args.converted, args.report,
                                where=_where(html.sixteen_bit(result.criteria.dtype)),
                                given=_given_models(args))
        atomic_write(Path(args.html), page.encode("utf-8"), force=args.force)
    return 0 if result.ok else 1


def kernels(args) -> int:
    report = kernels_mod.kernel_report(args.model, device=args.device,
                                       shapes=parse_shapes(args.shape), inputs=args.inputs,
                                       signature=args.signature)
    if args.json:
        atomic_write(Path(args.json), _json_bytes(report.to_dict()), force=args.force)
    if not args.quiet:
        print(hardware.machine_line(_model_target(args.model) if report.device == "CPU" else None))
        print(kernels_mod.format_report(report))
    return 0


def bench(args) -> int:
    result = bench_mod.bench(args.original, args.converted, runs=args.runs, warmup=args.warmup,
                             shapes=parse_shapes(args.shape), inputs=args.inputs,
                             signature=args.signature, outputs=args.output,
                             checkpoint=args.checkpoint, init_ops=args.init_op,
                             progress=None if args.quiet else _progress_bar)
    # the page and the CPU line both name the converted model's dtype: read it off the model once
    target = _model_target(args.converted) if args.html or not args.quiet else None
    with OutputSet() as outputs:
        if args.json:
            outputs.add_file(args.json, _json_bytes(result.to_dict()), force=args.force)
        if args.html:
            page = html.bench_page(result, args.converted, where=_where(target),
                                   given=_given_models(args))
            outputs.add_file(args.html, page.encode("utf-8"), force=args.force)
        outputs.commit()
    if not args.quiet:
        print(hardware.machine_line(None if hardware.gpu_visible() else target))
        print(bench_mod.format_result(result))
    return 0


def tune(args) -> int:
    bar = None if args.quiet or not sys.stderr.isatty() else _tune_progress
    result = tuning.tune(args.input, args.output, feeds=args.inputs, metric=args.metric,
                           tolerance=args.tolerance, max_trials=args.max_trials,
                           holdout=args.holdout, rules_out=args.rules_out,
                           signature=args.signature, outputs=args.output_tensor,
                           force=args.force, relax=args.relax, progress=bar,
                           target=args.target,
                           device=args.device, rules=args.rules, keep=args.keep,
                           lowp_io=args.lowp_io, min_matrix_intensity=args.min_matrix_intensity,
                           shapes=parse_shapes(args.shape), costs=args.costs,
                           report=args.report, init_ops=args.init_op,
                           allow_holdout_failure=args.allow_holdout_failure,
                           nonfinite_reference=args.allow_nonfinite_reference,
                           error_margin=args.error_margin, pages=_tune_pages(args),
                           **({} if args.headroom is None else {"headroom": args.headroom}))
    if bar is not None:
        sys.stderr.write("\n")
    if not result.ok:
        print(f"amp-rewrite: tolerance not met, nothing written: {result.message}", file=sys.stderr)
        if not args.quiet:
            print(result.summary())
        return 1
    float32 = result.float32_model()
    if float32 and result.matrix_before.get("lowp"):   # tune's keeps made it so: even with -q
        print(f"amp-rewrite: warning: {float32}", file=sys.stderr)
    elif result.mostly_float32:       # tuned, but no clean success: say so even with -q
        m = result.matrix_after
        print(f"amp-rewrite: warning: the tuned model runs {m['lowp']} of {m['total']} matrix "
              f"ops in {result.target}: mostly float32 ({result.start_line()})", file=sys.stderr)
    if result.holdout_failure:      # --allow-holdout-failure: written, but said
        print(f"amp-rewrite: warning: held-out samples: {result.holdout_failure}; written "
              "anyway (--allow-holdout-failure)", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {args.output} and {result.rules_file}")
        print(result.summary())
    return 0


def _tune_pages(args) -> dict:
    """tune's ``--html``: the page of the tuned conversion, made once tune passed."""
    if not args.html:
        return {}
    given = Given(args.input, args.output, tuple(args.inputs), tuple(args.shape), args.signature)
    return {args.html: lambda result: html.tune_page(
        result.to_dict(), result.report.to_dict(), where=_where(result.target),
        given=given).encode("utf-8")}


def costs(args) -> int:
    """``costs show``: the table a conversion here weighs with; ``costs measure``: time this
    CPU's ops and write its table (where conversions find it, or ``-o``)."""
    if args.action == "show":
        print(op_costs.format_table(cost_table.choose(args.costs)))
        return 0
    bar = None if args.quick or args.quiet or not sys.stderr.isatty() else _op_progress
    found = op_costs.measure(quick=args.quick, rounds=args.rounds, progress=bar)
    path = Path(args.output) if args.output else cost_table.measured_path()
    if not args.output:   # this CPU's table, in the folder conversions look in: replaced
        path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, found.table_text().encode("utf-8"), force=args.force or not args.output)
    if not args.quiet:
        print(f"wrote {path}")
        print(op_costs.format_table(cost_table.read_table(path, "file" if args.output
                                                          else "measured")))
    return 0


def _op_progress(done: int, total: int) -> None:
    _draw_bar(done, total, f"{done}/{total} ops")
    if done == total:
        sys.stderr.write("\n")
        sys.stderr.flush()


def ranges(args) -> int:
    found = ranges_mod.calibrate(args.model, args.inputs, signature=args.signature,
                                 checkpoint=args.checkpoint)
    headroom = HEADROOM if args.headroom is None else args.headroom
    target = TARGETS[args.target]
    if args.json:
        atomic_write(Path(args.json), _json_bytes(found.to_dict(headroom, target)),
                     force=args.force)
    if not args.quiet:
        print(ranges_mod.format_ranges(found, args.top, headroom, target))
    return 0


def _given_models(args) -> Given:
    """What verify or bench was given, for the pages' next command."""
    return Given(_typed(args, "original"), _typed(args, "converted"),
                 (args.inputs,) if args.inputs else (), tuple(args.shape), args.signature)


def _model_target(path) -> str | None:
    """The 16-bit dtype a converted model computes in (bfloat16 first), or None."""
    return html.model_target(html.graph_precision(path))


def _tune_progress(done: int, budget: int, metric: float, kept: int) -> None:
    """The trial budget used, the last metric, nodes kept (the caller ends the line)."""
    _draw_bar(done, budget, f"trial {done}/{budget}  metric {metric:.3g}  kept {kept} in float32   ")


def _json_bytes(data: dict) -> bytes:
    return (json.dumps(data, indent=1) + "\n").encode()


def _progress_bar(done: int, total: int) -> None:
    _draw_bar(done, total, f"{done}/{total} rounds")
    if done == total:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _draw_bar(done: int, total: int, text: str) -> None:
    """Redraw the progress line on stderr: a bar of ``done`` out of ``total``, then ``text``."""
    width = 30
    filled = min(width, width * done // total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
    sys.stderr.flush()


_COMMANDS = {"convert": convert, "explain": explain, "rules": rules, "verify": verify,
             "kernels": kernels, "bench": bench, "tune": tune, "ranges": ranges,
             "costs": costs}
