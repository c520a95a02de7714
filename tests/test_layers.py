"""The package's imports run one way: the layers README.md's "Layout" table declares.

Read from the source with ``ast`` (nothing is imported): every module is in the table; no module
imports one of a higher layer; the imports form no cycle; no package import sits inside a
function; a package module is loaded by name (``importlib``) only where the README says so.
"""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "amp_rewrite"
# the late loads the README names: cli loads commands (TensorFlow) after checking arguments,
# __init__ hands out the public API on first use
LATE_LOADERS = {"cli", "__init__"}


def declared_layers() -> dict[str, int]:
    """Top-level unit (module or subpackage) -> layer, from README.md's Layout table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    layers = {}
    for line in section.splitlines():
        row = re.match(r"^\| (\d+) \| ([^|]+) \|", line)
        if row:
            for name in re.findall(r"`([\w.]+)`", row.group(2)):
                layers[name] = int(row.group(1))
    return layers


def unit_of(path: Path) -> str:
    """The top-level unit a source file belongs to: ``paint/state.py`` -> ``paint``."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["amp_rewrite", *parts])


def package_imports(path: Path):
    """``(imported unit, line, inside a function)`` for every package import of a file."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                base = (node.module or "").split(".")
            if base[0] != "amp_rewrite":
                continue
            if len(base) == 1:  # from . import x, y: each name is a unit
                targets = [alias.name for alias in node.names]
            else:
                targets = [base[1]]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1] for a in node.names
                       if a.name.startswith("amp_rewrite.")]
        for target in targets:
            yield target, node.lineno, id(node) in inside


def late_loads(path: Path) -> list[str]:
    """Package units a file loads by name: strings ``"amp_rewrite.x"``, and the values of an
    ``_EXPORTS`` table (``__init__``'s public names, module by module)."""
    text = path.read_text()
    names = re.findall(r"""["']amp_rewrite\.(\w+)""", text)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            names += [v.value for v in node.value.values]
    return names


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_the_layout_table():
    layers = declared_layers()
    units = {unit_of(p) for p in sources()}
    assert units - set(layers) == set(), "modules missing from README's Layout table"
    assert set(layers) - units == set(), "README's Layout table names modules that do not exist"


def test_no_import_of_a_higher_layer_and_none_inside_a_function():
    layers = declared_layers()
    problems = []
    for path in sources():
        me = unit_of(path)
        for target, line, in_function in package_imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if in_function:
                problems.append(f"{where}: imports {target} inside a function")
            if target != me and layers[target] > layers[me]:
                problems.append(f"{where}: {me} (layer {layers[me]}) imports {target} "
                                f"(layer {layers[target]})")
    assert problems == []


def test_no_import_cycle():
    edges: dict[str, set[str]] = {}
    for path in sources():
        me = unit_of(path)
        edges.setdefault(me, set()).update(t for t, _, _ in package_imports(path) if t != me)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(unit: str):
        state[unit] = 1
        stack.append(unit)
        for nxt in sorted(edges.get(unit, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[unit] = 2

    for unit in sorted(edges):
        if unit not in state:
            visit(unit)


def test_late_loads_only_where_the_readme_says_and_downward():
    layers = declared_layers()
    for path in sources():
        me = unit_of(path)
        named = late_loads(path)
        if me not in LATE_LOADERS:
            # log names ("amp_rewrite.x" loggers) are not loads; only cli and __init__ load
            text = path.read_text()
            assert "import_module" not in text and "__import__" not in text, \
                f"{path.relative_to(ROOT)} loads modules late"
            continue
        for target in named:
            assert layers[target] <= layers[me], f"{me} loads {target} from a higher layer"
