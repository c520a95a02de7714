"""The package's imports run one way: the layers docs/architecture.md declares, between its
folders ("Folders") and inside each folder ("Inside each folder").

Read from the source with ``ast`` (nothing is imported): every module is in the tables and every
table row names modules that exist; no module imports a module of a higher layer, by the
folders' table or by its folder's own; the imports form no cycle, between folders or between
modules; no package import sits inside a function; a package module is loaded by name
(``importlib``) only where the architecture says so.
"""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "amp_rewrite"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# the late loads the architecture names: cli.run loads cli.commands (TensorFlow) after checking
# arguments, __init__ hands out the public API on first use
LATE_LOADERS = {"cli", "__init__"}


def _rows(text: str) -> list[tuple[int, list[str]]]:
    """``(layer, names)`` of each row of the Markdown tables in ``text``."""
    rows = []
    for line in text.splitlines():
        row = re.match(r"^\| (\d+) \| ([^|]+) \|", line)
        if row:
            rows.append((int(row.group(1)), re.findall(r"`([\w.]+)`", row.group(2))))
    return rows


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else None]


def declared_layers() -> dict[str, int]:
    """Top-level unit (folder or module) -> layer, from the architecture's "Folders" table."""
    text = ARCHITECTURE.read_text()
    return {name: layer for layer, names in _rows(_section(text, "## Folders")) for name in names}


def declared_internal_layers() -> dict[str, list[set[str]]]:
    """Folder -> its modules' layers, lowest first, from "Inside each folder"."""
    text = _section(ARCHITECTURE.read_text(), "## Inside each folder")
    out = {}
    for block in re.split(r"^### ", text, flags=re.M)[1:]:
        folder = re.match(r"`(\w+)/`", block).group(1)
        layers: dict[int, set[str]] = {}
        for layer, names in _rows(block):
            layers.setdefault(layer, set()).update(names)
        out[folder] = [layers[k] for k in sorted(layers)]
    return out


INTERNAL_LAYERS = declared_internal_layers()


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
    names = re.findall(r"""["']amp_rewrite\.([\w.]+)""", text)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            names += [v.value for v in node.value.values]
    return names


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def internal_layer(module: str) -> int | None:
    """The layer of a folder's module inside it (its ``__init__`` for the folder itself: the
    top when the table leaves it out, a face that only hands names on); None for a top-level
    module."""
    package, _, name = module.partition(".")
    if package not in INTERNAL_LAYERS:
        return None
    layers = INTERNAL_LAYERS[package]
    return next((i for i, names in enumerate(layers) if (name or "__init__") in names), len(layers))


def test_every_folder_and_module_is_in_the_folders_table():
    layers = declared_layers()
    units = {unit_of(p) for p in sources()}
    assert units - set(layers) == set(), "folders or modules missing from the Folders table"
    assert set(layers) - units == set(), "the Folders table names what does not exist"


def test_every_module_of_a_folder_has_a_layer_inside_it():
    packages = {p.parent.name for p in sources() if p.parent != PACKAGE}
    assert packages == set(INTERNAL_LAYERS) and packages >= {"core", "paint", "conversion"}
    for package, layers in INTERNAL_LAYERS.items():
        declared = [name for names in layers for name in names]
        present = sorted(p.stem for p in (PACKAGE / package).glob("*.py")
                         if p.stem != "__init__" or "__init__" in declared)
        assert sorted(declared) == present, f"{package}/: its table against its files"


def test_no_import_of_a_higher_layer_inside_a_subpackage():
    problems = []
    for path in sources():
        me = module_of(path)
        for target, line, _ in package_imports(path):
            if unit_of(path) != target.split(".")[0] or internal_layer(me) is None:
                continue     # between folders: the Folders table decides
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
    assert {"paint.state", "paint.decisions", "training.nodes", "schema.consts", "core.hardware",
            "core.ir", "check.lint"} <= seen
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_late_loads_only_where_the_architecture_says_and_downward():
    layers = declared_layers()
    for path in sources():
        me = unit_of(path)
        named = late_loads(path)
        if me not in LATE_LOADERS:
            # log names ("amp_rewrite.x" loggers) are not loads; only cli.run and __init__ load
            text = path.read_text()
            assert "import_module" not in text and "__import__" not in text, \
                f"{path.relative_to(ROOT)} loads modules late"
            continue
        for target in named:
            unit = target.split(".")[0]
            assert layers[unit] <= layers[me], f"{me} loads {target} from a higher layer"
