"""Rule sets: the allow / infer / clear / deny op lists, the level, and per-node overrides.

Rule sets are data. The defaults live in ``rules/float16.toml`` and ``rules/bfloat16.toml``
(shipped in the wheel as ``amp_rewrite.rules.defaults``). A user file can::

    extends = "float16"            # a built-in name or a path; else it edits what came before
    level = "tensor_cores_only"    # or "treat_infer_as_deny", "unsafe_force_all", "default"

    [allow]
    add = ["Conv2DBackpropInput"]  # moves the op here from any other list
    remove = ["Einsum"]
    # ops = [...]                  # replaces the whole list

    [painting]
    infer_follows_allow = true     # an infer op fed by an allow op (and no deny op) is allowed

    [[override]]
    glob = "head/*"                # or regex = "^head/.*"
    action = "keep_fp32"           # or "force_lowp"

Files given with ``--rules`` stack in order. Grappler's environment variables
(``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_*``) are applied last, so users of grappler keep
their settings. Every op name is checked against TensorFlow's registry; a bad file is a
:class:`RuleError` naming the file and the line of the bad key or value, and quoting it.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib.resources
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from tensorflow.python.framework.versions import VERSION as TF_VERSION

from ..core.dtypes import TARGETS
from ..core.errors import RuleError
from ..schema.opdefs import all_op_names
from .tomlfile import read_toml

LISTS = ("allow", "infer", "clear", "deny")
LEVELS = ("default", "tensor_cores_only", "treat_infer_as_deny", "unsafe_force_all")
ACTIONS = ("keep_fp32", "force_lowp")
_ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
# grappler reads both the current and the pre-2.4 names of its lists
_ENV_LISTS = {"ALLOWLIST": "allow", "WHITELIST": "allow", "INFERLIST": "infer",
              "GRAYLIST": "infer", "CLEARLIST": "clear", "DENYLIST": "deny", "BLACKLIST": "deny"}
# grappler variables that do not change decisions (LOG_PATH: where grappler dumps debug logs)
_ENV_IGNORED = {"LOG_PATH"}
_TOP_KEYS = {"target", "extends", "level", "painting", "override", *LISTS}
_PAINTING_KEYS = {"infer_follows_allow"}


@dataclass(frozen=True)
class NodeRule:
    """A per-node override: ``action`` for every node whose name matches ``glob`` or ``regex``."""

    action: str
    glob: str | None
    regex: str | None
    source: str  # "file:line"

    def matches(self, name: str) -> bool:
        if self.glob is not None:
            return fnmatch.fnmatchcase(name, self.glob)
        return re.search(self.regex, name) is not None

    @property
    def pattern(self) -> str:
        return f"glob {self.glob!r}" if self.glob is not None else f"regex {self.regex!r}"


@dataclass
class RuleSet:
    """The effective rules of one conversion."""

    target: str
    lists: dict[str, frozenset[str]]
    level: str = "default"
    infer_follows_allow: bool = False
    node_rules: list[NodeRule] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)  # grappler variables that were applied

    def category(self, op: str) -> str | None:
        """``"allow"``, ``"infer"``, ``"clear"``, ``"deny"`` or None, with the level applied."""
        for name in LISTS:
            if op in self.effective(name):
                return name
        return None

    def effective(self, list_name: str) -> frozenset[str]:
        """One list as painting sees it, after the level preset."""
        if self.level in ("tensor_cores_only",) and list_name != "allow":
            return frozenset()
        if self.level == "treat_infer_as_deny":
            if list_name == "infer":
                return frozenset()
            if list_name == "deny":
                return self.lists["deny"] | self.lists["infer"]
        return self.lists[list_name]

    def node_rule(self, name: str) -> NodeRule | None:
        """The last override matching ``name`` (later rules win)."""
        found = None
        for rule in self.node_rules:
            if rule.matches(name):
                found = rule
        return found


def builtin_rules_dir() -> Path:
    return Path(str(importlib.resources.files("amp_rewrite.rules.defaults")))


# a TOML table header ([name] or [[name]]) and a key's first line (bare or quoted key)
_HEADER = re.compile(r'^\s*(\[\[?)\s*("?)([^\]"]+)\2\s*\]\]?\s*(#.*)?$')
_KEY = re.compile(r'^\s*(["\']?)([A-Za-z0-9_.-]+)\1\s*=')


def _key_line(text: str, key: str, table: str | None = None, index: int = 0) -> int | None:
    """The line (1-based) where ``key`` is set in ``[table]`` (its ``index``-th occurrence for
    ``[[table]]``; ``table`` None: the top level), or None. tomllib gives no positions, so the
    text is scanned: headers switch tables, ``key =`` (or ``key.sub =``) starts a key."""
    current: tuple[str, int] | None = None
    seen: dict[str, int] = {}
    wanted = None if table is None else (table, index)
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            name = header.group(3).strip()
            seen[name] = seen.get(name, -1) + 1 if header.group(1) == "[[" else 0
            current = (name, seen[name])
            continue
        found = _KEY.match(line)
        if found and current == wanted and found.group(2).split(".")[0] == key:
            return number
    return None


def _header_line(text: str, table: str, index: int = 0) -> int | None:
    """The line of the ``index``-th ``[table]`` or ``[[table]]`` header, or None."""
    count = -1
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header and header.group(3).strip() == table:
            count += 1
            if count == index:
                return number
    return None


def _line_after(text: str, start: int, *needles: str) -> int:
    """The first line from ``start`` on holding one of ``needles`` (an op in a list written
    over several lines), else ``start``."""
    for number, line in enumerate(text.splitlines()[start - 1:], start):
        if any(needle in line for needle in needles):
            return number
    return start


def _shown(value, most: int = 60) -> str:
    """A value as an error quotes it, cut at ``most`` characters: strings as the other
    messages quote names (``'keep_f32'``), the rest as TOML writes them (``true``, ``[1, 2]``,
    ``{ a = 1 }``, ``1979-05-27``)."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, list):
        text = "[" + ", ".join(_shown(v, most) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{k} = {_shown(v, most)}" for k, v in value.items()) + " }" \
            if value else "{}"
    elif hasattr(value, "isoformat"):
        text = value.isoformat()
    else:
        text = str(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def _suggest(op: str) -> str:
    names = all_op_names()
    lower = {n.lower(): n for n in names}
    if op.lower() in lower:
        return f"; did you mean {lower[op.lower()]!r}?"
    close = difflib.get_close_matches(op, names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class _Source:
    """A rule file being read: every error names its path and the line of what it is about."""

    path: Path
    text: str

    def line(self, key: str | None = None, table: str | None = None, index: int = 0) -> int:
        """The line where ``key`` is set in ``table`` (see :func:`_key_line`); else the
        table's header; else where the table is set as a key of the top level (``allow =
        "x"``, ``override = [...]``, or an unknown key); else 1."""
        for found in (_key_line(self.text, key, table, index) if key else None,
                      _header_line(self.text, table, index) if table else None,
                      _key_line(self.text, table) if table else None):
            if found is not None:
                return found
        return 1

    def fail(self, message: str, key: str | None = None, table: str | None = None,
             index: int = 0, line: int | None = None) -> RuleError:
        """A :class:`RuleError` for ``message`` at ``line``, or at ``key`` of ``table``."""
        where = self.line(key, table, index) if line is None else line
        return RuleError(f"{self.path}:{where}: {message}")


class _Loader:
    """Reads rule files for one target, each on top of the rule set before it."""

    def __init__(self, target: str):
        if target not in TARGETS:
            raise RuleError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
        self.target = target
        self.known = set(all_op_names())

    def builtin(self, name: str, stack: tuple[Path, ...]) -> RuleSet:
        path = builtin_rules_dir() / f"{name}.toml"
        if not path.is_file():
            raise RuleError(f"no built-in rule set named {name!r} (built-in: {', '.join(TARGETS)})")
        return self.file(path, None, stack)

    def file(self, path: Path, base: RuleSet | None, stack: tuple[Path, ...] = ()) -> RuleSet:
        """The rule set ``path`` makes of ``base`` (or of what it ``extends``)."""
        src, data = _read(Path(path), stack)
        for key in data:
            if key not in _TOP_KEYS:
                raise src.fail(f"unknown key {key!r}{_close(key, _TOP_KEYS)} (known: "
                               f"{', '.join(sorted(_TOP_KEYS))})", table=key)
        target = data.get("target")
        if target is not None and target != self.target:
            raise src.fail(f"this rule file is for target {_shown(target)}, but the conversion "
                           f"targets {self.target!r}", "target")
        rules = self._start(src, data, base, stack + (src.path.resolve(),))
        rules.sources.append(str(src.path))
        self._lists(src, data, rules)
        _level(src, data, rules)
        _painting(src, data, rules)
        rules.node_rules.extend(_overrides(src, data))
        return rules

    def _start(self, src: _Source, data: dict, base: RuleSet | None,
               stack: tuple[Path, ...]) -> RuleSet:
        """What the file edits: what it ``extends``, else a copy of ``base``, else nothing."""
        if "extends" not in data:
            if base is None:
                return RuleSet(self.target, {name: frozenset() for name in LISTS})
            return dataclasses.replace(base, lists=dict(base.lists),
                                       node_rules=list(base.node_rules), sources=list(base.sources))
        ext = data["extends"]
        if not isinstance(ext, str):
            raise src.fail(f"extends = {_shown(ext)}: must be a string, a built-in name "
                           f"({', '.join(TARGETS)}) or a path", "extends")
        if ext in TARGETS:
            if ext != self.target:
                raise src.fail(f"extends {ext!r}, but the conversion targets {self.target!r}",
                               "extends")
            return self.builtin(ext, stack)
        target_file = src.path.parent / ext
        if not target_file.exists():
            raise src.fail(f"extends {ext!r}: neither a built-in rule set "
                           f"({', '.join(TARGETS)}) nor a file ({target_file})", "extends")
        return self.file(target_file, None, stack)

    def _lists(self, src: _Source, data: dict, rules: RuleSet) -> None:
        """Apply ``[allow]``/``[infer]``/``[clear]``/``[deny]``; an op added to one list leaves
        every other list ("add" means "move here")."""
        seen: dict[str, str] = {}
        for list_name in LISTS:
            section = data.get(list_name)
            if section is None:
                continue
            if not isinstance(section, dict):
                raise src.fail(f"{list_name} = {_shown(section)}: [{list_name}] must be a "
                               "table with ops / add / remove", list_name)
            for key in section:
                if key not in ("ops", "add", "remove"):
                    raise src.fail(f"unknown key {key!r} in [{list_name}]"
                                   f"{_close(key, ('ops', 'add', 'remove'))} (use ops, add, remove)",
                                   key, list_name)
            for key in ("ops", "add", "remove"):
                self._check_ops(src, list_name, key, section.get(key, []), seen)
            current = set(rules.lists[list_name])
            if "ops" in section:
                current = set(section["ops"])
            current |= set(section.get("add", []))
            current -= set(section.get("remove", []))
            rules.lists[list_name] = frozenset(current)
        for op, list_name in seen.items():
            for other in LISTS:
                if other != list_name and op in rules.lists[other]:
                    rules.lists[other] = rules.lists[other] - {op}

    def _check_ops(self, src: _Source, list_name: str, key: str, ops, seen: dict[str, str]) -> None:
        if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
            raise src.fail(f"[{list_name}] {key} = {_shown(ops)}: must be a list of op names "
                           "(strings)", key, list_name)
        start = src.line(key, list_name)
        for op in ops:
            at = _line_after(src.text, start, f'"{op}"', f"'{op}'")
            if op not in self.known:
                raise src.fail(f"[{list_name}] {key}: TensorFlow has no op {op!r}{_suggest(op)}",
                               line=at)
            if key != "remove":
                if op in seen and seen[op] != list_name:
                    raise src.fail(f"op {op!r} is in both [{seen[op]}] and [{list_name}]", line=at)
                seen[op] = list_name


def _read(path: Path, stack: tuple[Path, ...]) -> tuple[_Source, dict]:
    if path.resolve() in stack:
        raise RuleError(f"{path}: 'extends' makes a cycle")
    text, data = read_toml(path, "rule file", RuleError)
    return _Source(path, text), data



def _level(src: _Source, data: dict, rules: RuleSet) -> None:
    if "level" in data:
        if data["level"] not in LEVELS:
            raise src.fail(f"unknown level {_shown(data['level'])}"
                           f"{_close(data['level'], LEVELS)} (known: {', '.join(LEVELS)})", "level")
        rules.level = data["level"]


def _painting(src: _Source, data: dict, rules: RuleSet) -> None:
    """``[painting]`` settings: true, false, or ``"tensorflow"`` (as the installed TensorFlow's
    grappler pass does for this target, see :func:`grappler_default`)."""
    painting = data.get("painting", {})
    if not isinstance(painting, dict):
        raise src.fail(f"painting = {_shown(painting)}: [painting] must be a table", "painting")
    for key, value in painting.items():
        if key not in _PAINTING_KEYS:
            raise src.fail(f"unknown key {key!r} in [painting]{_close(key, _PAINTING_KEYS)} "
                           f"(known: {', '.join(sorted(_PAINTING_KEYS))})", key, "painting")
        if not (isinstance(value, bool) or value == "tensorflow"):
            raise src.fail(f"[painting] {key} = {_shown(value)}: must be true, false or "
                           "\"tensorflow\"", key, "painting")
        setattr(rules, key, grappler_default(key, rules.target) if value == "tensorflow" else value)


def grappler_default(key: str, target: str) -> bool:
    """What grappler's pass of the installed TensorFlow does for ``key`` on ``target``.

    ``infer_follows_allow``: grappler paints an infer op fed directly by an allow op (and by
    no deny op) in its bfloat16 mode since TensorFlow 2.8; TensorFlow 2.21 does it in its CUDA
    float16 mode too (checked by running 2.21's pass; the published source before it limits the
    step to bfloat16 mode, and the exact release that lifted the limit was not pinned down, so
    versions before 2.21 are taken to be bfloat16-only).
    """
    if key == "infer_follows_allow":
        return target == "bfloat16" or tuple(int(p) for p in TF_VERSION.split(".")[:2]) >= (2, 21)
    raise KeyError(key)


def _overrides(src: _Source, data: dict) -> list[NodeRule]:
    """The ``[[override]]`` tables: each a glob or a regex (a string) and an action. An error
    quotes the bad value and points at its line (the table's header for what is missing)."""
    overrides = data.get("override", [])
    if not isinstance(overrides, list):
        raise src.fail(f"override = {_shown(overrides)}: use [[override]] tables for node "
                       "overrides", table="override")
    out = []
    for i, item in enumerate(overrides):
        if not isinstance(item, dict):
            # override = ["head/*"]: a list of strings, not of tables
            raise src.fail(f"override = {_shown(overrides)}: each override is a table: write "
                           "[[override]] with glob or regex, and action", table="override")
        out.append(_override(src, item, i))
    return out


def _override(src: _Source, item: dict, i: int) -> NodeRule:
    """The ``i``-th ``[[override]]`` table, checked."""
    def fail(message: str, key: str | None = None) -> RuleError:
        return src.fail(message, key, "override", i)

    for key in item:
        if key not in ("glob", "regex", "action"):
            raise fail(f"unknown key {key!r} in [[override]]"
                       f"{_close(key, ('glob', 'regex', 'action'))} (use glob or regex, and "
                       "action)", key)
    if "glob" in item and "regex" in item:
        raise fail(f"an [[override]] needs exactly one of glob or regex, not both (glob = "
                   f"{_shown(item['glob'])}, regex = {_shown(item['regex'])})", "regex")
    if "glob" not in item and "regex" not in item:
        raise fail("an [[override]] needs exactly one of glob or regex (the node names it "
                   "matches)")
    kind = "glob" if "glob" in item else "regex"
    if not isinstance(item[kind], str):
        raise fail(f"{kind} = {_shown(item[kind])}: an override's {kind} must be a string", kind)
    if "action" not in item:
        raise fail(f"an [[override]] needs an action ({' or '.join(ACTIONS)})")
    action = item["action"]
    if action not in ACTIONS:
        raise fail(f"action = {_shown(action)}: override action must be one of "
                   f"{', '.join(ACTIONS)}" + (_close(action, ACTIONS) if isinstance(action, str)
                                              else ""), "action")
    if kind == "regex":
        try:
            re.compile(item["regex"])
        except re.error as exc:
            raise fail(f"bad regex {_shown(item['regex'])}: {exc}", "regex") from None
    return NodeRule(action, item.get("glob"), item.get("regex"),
                    f"{src.path}:{src.line(table='override', index=i)}")


def _close(value: str, known) -> str:
    """``; did you mean 'x'?`` for the known name nearest a misspelt one, else nothing."""
    close = difflib.get_close_matches(str(value), sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _apply_env(rules: RuleSet, env: Mapping[str, str], known: set[str]) -> None:
    for var in sorted(env):
        if not var.startswith(_ENV_PREFIX):
            continue
        rest = var[len(_ENV_PREFIX):]
        value = env[var].strip()
        if rest in _ENV_IGNORED:
            continue
        if rest == "LEVEL":
            level = value.lower()
            if level and level not in LEVELS:
                raise RuleError(f"{var}={value!r}: unknown level (known: "
                                f"{', '.join(l.upper() for l in LEVELS)})")
            if level:
                rules.level = level
                rules.env.append(f"{var}={value}")
            continue
        list_key, _, action = rest.rpartition("_")
        if list_key not in _ENV_LISTS or action not in ("ADD", "REMOVE"):
            raise RuleError(f"{var}: not a variable grappler knows")
        list_name = _ENV_LISTS[list_key]
        ops = [o.strip() for o in value.split(",") if o.strip()]
        for op in ops:
            if op not in known:
                raise RuleError(f"{var}: TensorFlow has no op {op!r}{_suggest(op)}")
        if action == "ADD":
            for other in LISTS:
                rules.lists[other] = rules.lists[other] - set(ops)
            rules.lists[list_name] = rules.lists[list_name] | set(ops)
        else:
            rules.lists[list_name] = rules.lists[list_name] - set(ops)
        if ops:
            rules.env.append(f"{var}={value}")


def load_rules(target: str = "float16", files: Sequence[str | os.PathLike] = (),
               env: Mapping[str, str] | None = None) -> RuleSet:
    """The effective rule set for ``target``: the built-in file, then ``files`` in order, then env.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore grappler's variables.
    """
    loader = _Loader(target)
    rules = loader.builtin(target, ())
    for path in files:
        rules = loader.file(Path(path), rules)
    _apply_env(rules, os.environ if env is None else env, loader.known)
    return rules
