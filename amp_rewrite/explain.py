"""``amp-rewrite explain IN NODE`` and ``amp-rewrite rules show``: why, and with what rules."""

from __future__ import annotations

from .cli import add_rule_args


def add_arguments(parser, command: str) -> None:
    if command == "explain":
        parser.add_argument("input", help="the FP32 model to explain")
        parser.add_argument("node", nargs="+", help="node name(s) to explain")
        add_rule_args(parser)
        parser.add_argument("--keep", action="append", default=[], metavar="NAME")
        parser.add_argument("--lowp-io", action="store_true")
    else:
        parser.add_argument("action", choices=["show"], help="show the effective op lists")
        add_rule_args(parser)


def run(args, command: str) -> int:
    from .errors import InputError
    if command == "rules":
        from .rules import LISTS, load_rules
        rules = load_rules(args.target, args.rules)
        print(f"# target {rules.target}, level {rules.level}")
        print("# from: " + ", ".join(rules.sources))
        if rules.env:
            print("# grappler variables: " + ", ".join(rules.env))
        print(f"# infer_follows_allow: {str(rules.infer_follows_allow).lower()}")
        for name in LISTS:
            ops = sorted(rules.effective(name))
            print(f"{name} ({len(ops)}): " + " ".join(ops))
        for rule in rules.node_rules:
            print(f"override: {rule.pattern} -> {rule.action} ({rule.source})")
        return 0
    from .pipeline import Options, convert_model
    from .load import load
    model = load(args.input)
    # Decisions do not depend on loss scaling, so a training graph is explained without it
    # (and without its hints, which explain has no flags for).
    report = convert_model(model, Options(target=args.target, device=args.device, rules=args.rules,
                                          keep=args.keep, lowp_io=args.lowp_io, loss_scale="none"),
                           train=False)
    status = 0
    for name in args.node:
        try:
            print(report.explain(name))
        except KeyError:
            raise InputError(f"{args.input}: no node named {name!r}") from None
    return status
