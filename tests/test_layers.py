"""The package's imports run one way: the layers README.md's "Layout" table declares, and
inside each subpackage the order :data:`INTERNAL_LAYERS` declares.

Read from the source with ``ast`` (nothing is imported): every module is in the tables; no
module imports a module of a higher layer, by the README's table or by its subpackage's order;
the imports form no cycle, between top-level units or between modules; no package import sits
inside a function; a package module is loaded by name (``importlib``) only where the README
says so.
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
# Each subpackage's modules, lowest layer first; a module imports only modules of its own
# layer or below (the subpackage's __init__, its public face, is the top).
INTERNAL_LAYERS = {
    "paint": [
        {"decisions"},      # Decision, Painting: what painting produces
        {"typegraph"},      # the graph painting walks: type attributes joined by data edges
        {"state"},          # PaintState: the graph, the rules, what is allowed or blocked
        {"propagation", "islands", "overrides", "agreement", "feeders", "reasons"},   # the steps
        {"__init__"},       # paint(): the steps in order
    ],
    "training": [
        {"nodes", "detect"},        # node builders; finding the backward pass
        {"state"},                  # the loss-scale state variables
        {"scaling", "saved_step"},  # loss scaling of a graph; of TF2 train-step functions
        {"__init__"},               # add_loss_scaling and friends
    ],
}


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
    return module_of(path).split(".")[0]


def module_of(path: Path) -> str:
    """A source file's module inside the package: ``paint/state.py`` -> ``paint.state``,
    ``paint/__init__.py`` -> ``paint``, ``ir.py`` -> ``ir``."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__") or "__init__"


def _is_module(dotted: list[str]) -> bool:
    """Whether ``dotted`` (inside the package) names a module or subpackage."""
    where = PACKAGE.joinpath(*dotted)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def package_imports(path: Path):
    """``(imported module, line, inside a function)`` for every package import of a file; the
    module inside the package, dotted (``paint.state``; ``paint`` for its ``__init__``)."""
    tree = ast.parse(path.read_text())
    here = module_of(path).split(".") if module_of(path) != "__init__" else []
    if path.name != "__init__.py":
        here = here[:-1]    # the package the module sits in
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "amp_rewrite":
                base = node.module.split(".")[1:]
            else:
                continue
            # from . import x: x is a module where one exists, else a name of the package
            targets = [".".join(base + [a.name]) if _is_module(base + [a.name]) else ".".join(base)
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("amp_rewrite.")]
        for target in targets:
            yield target or "__init__", node.lineno, id(node) in inside


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


def internal_layer(module: str) -> int | None:
    """The layer of a subpackage's module inside it (its ``__init__`` for the subpackage
    itself); None for a top-level module."""
    package, _, name = module.partition(".")
    if package not in INTERNAL_LAYERS:
        return None
    return next(i for i, names in enumerate(INTERNAL_LAYERS[package]) if (name or "__init__") in names)


def test_every_module_is_in_the_layout_table():
    layers = declared_layers()
    units = {unit_of(p) for p in sources()}
    assert units - set(layers) == set(), "modules missing from README's Layout table"
    assert set(layers) - units == set(), "README's Layout table names modules that do not exist"


def test_every_subpackage_module_has_an_internal_layer():
    packages = {p.parent.name for p in sources() if p.parent != PACKAGE}
    assert packages == set(INTERNAL_LAYERS) and packages >= {"paint", "training"}
    for package, layers in INTERNAL_LAYERS.items():
        declared = [name for names in layers for name in names]
        present = sorted(p.stem for p in (PACKAGE / package).glob("*.py"))
        assert sorted(declared) == present, f"{package}/: INTERNAL_LAYERS against its files"


def test_no_import_of_a_higher_layer_inside_a_subpackage():
    problems = []
    for path in sources():
        me = module_of(path)
        for target, line, _ in package_imports(path):
            if unit_of(path) != target.split(".")[0] or internal_layer(me) is None:
                continue     # between top-level units: the README's table decides
            if internal_layer(target) > internal_layer(me):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {me} (layer "
                                f"{internal_layer(me)}) imports {target} "
                                f"(layer {internal_layer(target)})")
    assert problems == []


def test_no_import_of_a_higher_layer_and_none_inside_a_function():
    layers = declared_layers()
    problems = []
    for path in sources():
        me = unit_of(path)
        for module, line, in_function in package_imports(path):
            target = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}"
            if in_function:
                problems.append(f"{where}: imports {module} inside a function")
            if target != me and layers[target] > layers[me]:
                problems.append(f"{where}: {me} (layer {layers[me]}) imports {target} "
                                f"(layer {layers[target]})")
    assert problems == []


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` (node -> the nodes it imports) as a path that returns to its
    start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    return next((c for node in sorted(edges) if node not in state and (c := visit(node))), None)


@pytest.mark.parametrize("level", ["unit", "module"])
def test_no_import_cycle(level):
    """Between top-level units (``paint`` as a whole), and between modules (inside a
    subpackage too)."""
    name = unit_of if level == "unit" else module_of
    edges: dict[str, set[str]] = {}
    for path in sources():
        me = name(path)
        imported = {t.split(".")[0] if level == "unit" else t for t, _, _ in package_imports(path)}
        edges.setdefault(me, set()).update(imported - {me})
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_what_they_check():
    """The import reader resolves each kind of import the package uses, and the cycle finder
    finds a cycle (checks that could pass on an empty list of imports or edges would say
    nothing)."""
    seen = {m for p in sources() for m, _, _ in package_imports(p)}
    assert {"paint.state", "paint.decisions", "training.nodes", "consts", "hardware", "ir"} <= seen
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


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
