"""The ``amp-rewrite`` command line.

``amp-rewrite IN -o OUT [options]`` converts; ``amp-rewrite COMMAND ...`` runs one of the
subcommands in :data:`SUBCOMMANDS` (each a module with ``add_arguments(parser)`` and
``run(args) -> int``). Exit codes: 0 ok, 2 bad input or usage, 1 internal error. Only this
module prints; the library logs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

# TensorFlow's C++ start-up chatter would bury our one-line messages; users can still set it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PROG = "amp-rewrite"
SUBCOMMANDS = {
    "explain": "amp_rewrite.explain",
    "rules": "amp_rewrite.explain",
    "verify": "amp_rewrite.verify",
    "kernels": "amp_rewrite.kernels",
    "bench": "amp_rewrite.bench",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log each step and show tracebacks")
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors only")


def add_rule_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", choices=["float16", "bfloat16"], default="float16",
                        help="low-precision dtype (default float16, for Tensor Cores)")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                        help="device unplaced nodes run on; decides which kernels exist (default gpu)")
    parser.add_argument("--rules", action="append", default=[], metavar="FILE",
                        help="rule file stacked on the defaults (repeatable, applied in order)")


def _convert_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Convert an FP32 TensorFlow graph to mixed precision. "
                "Other commands: " + ", ".join(sorted(set(SUBCOMMANDS))) + " (amp-rewrite CMD -h).")
    p.add_argument("input", help="GraphDef (.pb/.pbtxt), MetaGraphDef (.meta) or SavedModel directory")
    p.add_argument("-o", "--output", required=True, help="where to write the converted graph")
    add_rule_args(p)
    p.add_argument("--keep", action="append", default=[], metavar="NAME",
                   help="node whose dtypes must not change (repeatable)")
    p.add_argument("--lowp-io", action="store_true",
                   help="let graph inputs and outputs take the low-precision dtype too")
    p.add_argument("--fold-constants", action="store_true",
                   help="fold Const-only float32 subgraphs before painting (graphs without "
                        "variables): fewer casts, one rounding per folded value")
    p.add_argument("--report", metavar="FILE.json", help="write every node's decision as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("--in-place", action="store_true", help="allow the output to be the input")
    for hook in _convert_hooks():
        hook.add_convert_arguments(p)
    add_common(p)
    return p


def _convert_hooks():
    """Modules that add their own flags to the convert command (loss scaling, HTML report ...)."""
    mods = []
    for name in ("amp_rewrite.loss_scaling", "amp_rewrite.html"):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        if hasattr(mod, "add_convert_arguments"):
            mods.append(mod)
    return mods


def _setup_logging(args) -> None:
    level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    logger = logging.getLogger("amp_rewrite")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _check_paths(args) -> None:
    """Refuse, before any work, writes that would clobber the input or an existing file."""
    from .errors import InputError
    from .save import same_file

    # output = input is reported by convert_file, which names --in-place rather than --force
    if (os.path.exists(args.output) and not (args.force or args.in_place)
            and not same_file(args.input, args.output)):
        raise InputError(f"{args.output}: already exists; pass --force to replace it")
    if args.report:
        for other in (args.input, args.output):
            if same_file(args.report, other):
                raise InputError(f"{args.report}: the report would overwrite {other}")
        folder = os.path.dirname(os.path.abspath(args.report))
        if not os.path.isdir(folder):
            raise InputError(f"{args.report}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):  # found only after the output is written otherwise
            raise InputError(f"{args.report}: cannot write in {folder}: permission denied")


def run_convert(args) -> int:
    from .pipeline import convert_file
    from .save import atomic_write

    _check_paths(args)
    options = dict(target=args.target, device=args.device, rules=args.rules, keep=args.keep,
                   lowp_io=args.lowp_io, fold_constants=args.fold_constants)
    for hook in _convert_hooks():
        if hasattr(hook, "convert_options"):
            options.update(hook.convert_options(args))
    report = convert_file(args.input, args.output, force=args.force, in_place=args.in_place,
                               **options)
    if args.report:
        atomic_write(args.report, report.to_json().encode("utf-8"), force=True)
    for hook in _convert_hooks():
        if hasattr(hook, "after_convert"):
            hook.after_convert(args, report)
    if not args.quiet:
        print(f"wrote {args.output}")
        print(report.format_summary())
    return 0


def _import_tensorflow_quietly(verbose: bool) -> None:
    """Import TensorFlow with its C++ start-up lines (printed before absl logging is set up, so
    no environment variable silences them) kept off stderr, unless -v asks to see everything."""
    if verbose or "tensorflow" in sys.modules:
        return
    try:
        saved = os.dup(2)
    except OSError:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _refuse_misspelled_command(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """``amp-rewrite verfy a.pb b.pb`` would otherwise complain about a missing -o."""
    import difflib
    if not argv or argv[0].startswith("-") or os.path.exists(argv[0]):
        return
    close = difflib.get_close_matches(argv[0], sorted(SUBCOMMANDS), n=1, cutoff=0.6)
    if close:
        parser.error(f"no file {argv[0]!r} and no command of that name; did you mean "
                     f"'{PROG} {close[0]}'? (commands: {', '.join(sorted(SUBCOMMANDS))})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _import_tensorflow_quietly("-v" in argv or "--verbose" in argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]])
        parser = _Parser(prog=f"{PROG} {argv[0]}")
        module.add_arguments(parser, argv[0])
        add_common(parser)
        args = parser.parse_args(argv[1:])
        runner = lambda: module.run(args, argv[0])  # noqa: E731
    else:
        parser = _convert_parser()
        _refuse_misspelled_command(argv, parser)
        args = parser.parse_args(argv)
        runner = lambda: run_convert(args)  # noqa: E731
    _setup_logging(args)
    from .errors import AmpRewriteError
    try:
        return runner()
    except AmpRewriteError as exc:
        if args.verbose:
            traceback.print_exc()
        one_line = " ".join(str(exc).split())  # messages quoting parsers may hold newlines
        print(f"{PROG}: error: {one_line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # our bug: one line unless -v
        if args.verbose:
            traceback.print_exc()
        print(f"{PROG}: internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
