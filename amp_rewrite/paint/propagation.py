"""The list-driven steps of painting, in the order they run (grappler's order):

1. :func:`seed_allow`: allow ops are painted where a kernel exists;
2. :func:`propagate_deny`: deny spreads forward through infer/clear ops that lie upstream of
   other infer/deny ops;
3. :func:`paint_between_allow`: infer/clear ops on a path between two allow ops are painted;
4. :func:`paint_infer_after_allow`: (rule ``infer_follows_allow``) an infer op fed by an allow
   op and by no deny op is painted;
5. :func:`spread_through_clear`: allow spreads both ways through clear ops, but never into a
   read of a ref variable.

Then :mod:`.islands` drops what is too small to pay for its casts (bfloat16 on a CPU).
"""

from __future__ import annotations

from .decisions import Decision
from .state import PaintState

_MATRIX_HINT = {"GPU": "Tensor Cores", "CPU": "AMX/AVX512 matrix units"}


def seed_allow(s: PaintState) -> None:
    """Step 1: allow ops (every op but Const and Cast at level ``unsafe_force_all``)."""
    force_all = s.rules.level == "unsafe_force_all"
    unit = _MATRIX_HINT.get(s.device, s.device)
    for idx, (name, _) in enumerate(s.items):
        listed = s.cat[idx] == "allow"
        if (listed or (force_all and s.nodes[name].op not in ("Const", "Cast"))) and s.free(idx):
            text = f"allow op: runs in {s.tname} on {unit}" if listed else "level unsafe_force_all"
            s.allow[idx] = Decision(True, "allow_list", text)


def propagate_deny(s: PaintState) -> None:
    """Step 2: mark, with the item each came from, what deny reaches (none at unsafe_force_all)."""
    if s.rules.level == "unsafe_force_all":
        return
    cat, tg = s.cat, s.tg
    upstream: set[int] = set()
    roots = [i for i in range(len(s.items)) if cat[i] in ("deny", "infer")]
    tg.dfs(roots, "in",
           lambda i, root: i == root or (i not in upstream and cat[i] == "clear"),
           lambda i, parent, root: upstream.add(i))
    for root in (i for i in range(len(s.items)) if cat[i] == "deny"):
        if root in s.deny_parent:
            continue
        tg.dfs([root], "out",
               lambda i, r: i == r or (i not in s.deny_parent and i in upstream),
               lambda i, parent, r: _reached(s, i, parent, r))


def _reached(s: PaintState, idx: int, parent: int | None, root: int) -> None:
    s.deny_parent.setdefault(idx, parent)
    s.deny_root.setdefault(idx, root)


def paint_between_allow(s: PaintState) -> None:
    """Step 3: infer and clear items reachable downstream of one allow item and upstream of
    another are painted, naming both."""
    cat, allow = s.cat, s.allow
    downstream: dict[int, int] = {}
    roots = sorted(allow)
    s.tg.dfs(roots, "out",
             lambda i, root: i == root or (i not in downstream and i not in allow
                                           and i not in s.deny_parent
                                           and cat[i] in ("clear", "infer") and s.free(i)),
             lambda i, parent, root: downstream.setdefault(i, root))
    upstream_of_allow: set[int] = set()

    def between(i: int, r: int) -> None:
        if i == r:
            return
        upstream_of_allow.add(i)
        if i not in allow:
            a, b = s.items[downstream[i]][0], s.items[r][0]
            allow[i] = Decision(True, "between_allow",
                                f"{cat[i]} op on a path from allow op `{a}` to allow op `{b}`", (a, b))

    s.tg.dfs(roots, "in",
             lambda i, r: i == r or (i not in upstream_of_allow and i in downstream),
             lambda i, parent, r: between(i, r))


def paint_infer_after_allow(s: PaintState) -> None:
    """Step 4: an infer item fed by a painted item and by no deny-reached one is painted."""
    for idx in range(len(s.items)):
        if s.cat[idx] != "infer" or idx in s.allow or idx in s.deny_parent or not s.free(idx):
            continue
        fanin = sorted(s.tg.fanin[idx])
        if any(f in s.deny_parent for f in fanin):
            continue
        feeders = [f for f in fanin if f in s.allow]
        if feeders:
            src = s.items[feeders[0]][0]
            s.allow[idx] = Decision(True, "follows_allow",
                                    f"infer op fed by low-precision `{src}` and by no deny op", (src,))


def spread_through_clear(s: PaintState) -> None:
    """Step 5: from every painted item, paint the clear items next to it, both ways."""
    allow = s.allow

    def spread(i: int, parent: int | None) -> None:
        if parent is None or i in allow:
            return
        src = s.items[parent][0]
        allow[i] = Decision(True, "clear_spread", f"clear op next to low-precision `{src}`", (src,))

    s.tg.dfs(sorted(allow), "both",
             lambda i, r: i == r or (i not in allow and i not in s.deny_parent
                                     and s.cat[i] == "clear"
                                     and not s.reads_ref(s.items[i][0]) and s.free(i)),
             lambda i, parent, r: spread(i, parent))
