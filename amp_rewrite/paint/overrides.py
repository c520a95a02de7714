"""Step 6 of painting: rule-file overrides that force low precision (``force_lowp``).

An override lifts a ``cost`` decision (the cost model estimates; the user knows) and a ``range``
one (calibration saw a sample of the data; the user knows what the values mean: a -1e9 mask
that float16 holds as -inf). It cannot
move the graph's interface or a training graph's update (a warning says so), a functional op (While, If,
Case, a function call: its dtypes are its functions' signatures), nor an op TensorFlow has no
kernel for in the target dtype (the item is blocked with ``no_kernel`` and a warning). An
override that matches no node is warned about.
"""

from __future__ import annotations

from ..core.ops import FUNCTIONAL_OPS
from ..schema.opdefs import device_type
from .decisions import Decision
from .state import PaintState


def force_overrides(s: PaintState) -> None:
    refused: set[str] = set()
    for idx, (name, attr) in enumerate(s.items):
        rule = s.rules.node_rule(name)
        if rule is None or rule.action != "force_lowp" or idx in s.allow:
            continue
        op = s.nodes[name].op
        if op in FUNCTIONAL_OPS:
            # its dtypes are its functions' signatures: painting the bodies decides them
            if name not in refused:
                refused.add(name)
                s.warnings.append(f"force_lowp refused for `{name}` ({op}) by override "
                                  f"{rule.pattern} ({rule.source}): a {op} takes its dtypes "
                                  "from its functions' signatures; override the nodes inside "
                                  "its functions instead")
            continue
        if idx in s.blocked and s.blocked[idx].code in _LIFTED:
            del s.blocked[idx]   # an estimate, or a sample: an override is the user's word
        if idx in s.blocked:
            why = _REFUSED.get(s.blocked[idx].code)
            if why is not None and name not in refused:
                refused.add(name)
                s.warnings.append(f"force_lowp refused for `{name}` by override {rule.pattern} "
                                  f"({rule.source}): {s.blocked[idx].text}; {why}")
            continue
        if s.kernel_ok(idx):
            s.allow[idx] = Decision(True, "user_force",
                                    f"forced {s.tname} by override {rule.pattern} ({rule.source})")
        elif not _has_lowp_attr(s, name):
            node = s.nodes[name]
            msg = (f"force_lowp refused for `{name}` ({node.op}): no {s.tname} kernel on "
                   f"{device_type(node, s.device)} for type {attr}")
            s.blocked[idx] = Decision(False, "no_kernel", msg)
            s.warnings.append(msg)
    for rule in s.rules.node_rules:
        if not any(rule.matches(n) for n in s.nodes):
            s.warnings.append(f"override {rule.pattern} ({rule.source}) matches no node")


# blocked decisions an override lifts: the cost model's estimate, calibration's sample
_LIFTED = ("cost", "range")
# blocked decisions an override cannot lift, and what to tell the user
_REFUSED = {
    "interface": "its dtypes are the graph's interface (--lowp-io lets inputs and outputs go)",
    "user_keep": "--keep holds its dtypes",
    "update": "an update reads the gradients in float32 (docs/training.md \"Updates in float32\")",
}


def _has_lowp_attr(s: PaintState, name: str) -> bool:
    """Whether another type attribute of the node can take the target dtype."""
    return any(s.items[j][0] == name and s.kernel_ok(j) for j in range(len(s.items)))
