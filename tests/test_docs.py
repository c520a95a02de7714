"""The README and the guide in docs/ say what is true: every ``bash`` and ``python`` block runs
(or says, with a reason checked here, why it cannot), every relative link, path, module, test
and section named exists (in BENCHMARKS.md too), the decision codes listed are the ones the code
emits, and every number quoted comes from the test, benchmark or constant named beside it; one
quoted from BENCHMARKS.md stands in the section named, as that section is now."""

import ast
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

# ``convert`` first: the package's lazy ``convert`` function and its ``conversion/`` folder share
# the name, and once the folder is imported (the CLI does) before the function was asked for,
# ``from amp_rewrite import convert`` hands out the folder (reported; not this suite's to fix)
from amp_rewrite import cli, convert  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cnn_fp32.pb"
KERAS_EXPORT = ROOT / "tests" / "data" / "keras_export"
# the files this suite holds to these rules (docs/architecture.md has its own: tests/test_layers.py)
OWN_DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
                                  if p.name != "architecture.md")
ALL_DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
# every document whose links, paths, modules, tests and cited sections must exist: the guide and
# BENCHMARKS.md (its numbers are the source others quote, held by CLAIMS below)
NAMING_DOCS = ALL_DOCS + ["BENCHMARKS.md"]
# the README's first two blocks, as a fresh machine runs them (.ci/run runs the second)
SETUP = ("python3.11 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/amp-rewrite "
         "examples/cnn_fp32.pb -o /tmp/cnn_amp.pb --force",
         "python3.11 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
         ".venv/bin/python -m pytest -q")
SUBCOMMANDS = {"explain", "rules", "verify", "kernels", "bench", "tune", "ranges", "costs"}


def _text(doc: str) -> str:
    return (ROOT / doc).read_text()


def _prose(doc: str) -> str:
    """The document without its fenced blocks (each replaced by a blank line, so paragraphs
    keep their bounds)."""
    return re.sub(r"^```.*?^```", "\n", _text(doc), flags=re.S | re.M)


# ----------------------------------------------------------------- the blocks
@dataclass
class Block:
    doc: str
    line: int
    lang: str
    text: str
    not_run: str | None     # the reason after "<!-- not run: ", if the block is marked


def blocks(doc: str) -> list[Block]:
    found, lines = [], _text(doc).splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = lines.index("```", i + 1)
        before = next((l for l in reversed(lines[:i]) if l.strip()), "")
        mark = re.match(r"<!-- not run: (.+?) -->$", before.strip())
        found.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           mark.group(1) if mark else None))
        i = end + 1
    return found


# Why a block may stay unrun, each with what must hold of the block for the reason to be true.
NOT_RUN = {
    "suite": lambda b: re.search(r"\bpytest\b", b.text) is not None,   # runs the tests themselves
}


def test_every_block_has_a_language_and_a_kind_this_suite_runs():
    for doc in ALL_DOCS:
        for b in blocks(doc):
            assert b.lang in ("bash", "python", "toml"), f"{doc}:{b.line}: ```{b.lang}"
            if b.not_run is not None:
                key, _, why = b.not_run.partition(":")
                assert key in NOT_RUN and why.strip(), f"{doc}:{b.line}: not run: {b.not_run!r}"
                assert NOT_RUN[key](b), f"{doc}:{b.line}: the reason {key!r} does not hold"


def test_readme_starts_with_the_two_setup_commands_and_stays_short():
    readme = _text("README.md")
    first = blocks("README.md")[:2]
    assert [b.text.strip() for b in first] == list(SETUP)
    assert readme.index("```") > readme.index("# amp-rewrite") and "##" not in readme[:readme.index("```")]
    assert len(readme.splitlines()) <= 150
    for heading in ("## What it does", "## Commands", "## Python API", "## Which TensorFlow",
                    "## Read on"):
        assert heading in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/pip install -q -e '.[test]'" in ci and ".venv/bin/python -m pytest -q" in ci


# ----------------------------------------------------------------- running them
def _images(seed: int, batch: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": rng.uniform(0, 1, (batch, 8, 8, 1)).astype(np.float32)}


def _meta_of_example() -> bytes:
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    graph_def = graph_pb2.GraphDef.FromString(EXAMPLE.read_bytes())
    return meta_graph_pb2.MetaGraphDef(graph_def=graph_def).SerializeToString()


def _train(**kw) -> bytes:
    import training_graphs
    return training_graphs.build("mlp", "adam", **kw).SerializeToString()


# What a block's placeholder names become: "your model" is one of ours under that name.
PROVIDED = {
    "model.pb": lambda p: shutil.copy(EXAMPLE, p),
    "model.meta": lambda p: p.write_bytes(_meta_of_example()),
    "data.npz": lambda p: np.savez(p, **_images(0)),
    "batch1.npz": lambda p: np.savez(p, **_images(1)),
    "batch2.npz": lambda p: np.savez(p, **_images(2)),
    "batch3.npz": lambda p: np.savez(p, **_images(3)),
    "train.meta": lambda p: p.write_bytes(_train()),
    "train.pb": lambda p: p.write_bytes(_graph_def_of(_train(backprop="grad_ys"))),
    "saved_model_dir": lambda p: shutil.copytree(KERAS_EXPORT, p),
}


def _graph_def_of(meta: bytes) -> bytes:
    from tensorflow.core.protobuf import meta_graph_pb2
    return meta_graph_pb2.MetaGraphDef.FromString(meta).graph_def.SerializeToString()


def _workspace(folder: Path, doc: str) -> Path:
    """A scratch checkout: the bundled example, the rule files and the tests' data, plus every
    placeholder file the document's blocks name; ``/tmp`` of the blocks is ``folder/tmp``."""
    for name in ("examples", "rules"):
        (folder / name).symlink_to(ROOT / name)
    (folder / "tests").mkdir()
    (folder / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    (folder / "tmp").mkdir()
    text = _text(doc)
    for name, make in PROVIDED.items():
        if re.search(rf"(?<![\w/.]){re.escape(name)}\b", text):
            make(folder / name)
    return folder


def _local(text: str, folder: Path) -> str:
    return re.sub(r"(?<![\w.])/tmp\b", f"{folder}/tmp", text)


def _commands(block: Block) -> list[tuple[str, int, str | None]]:
    """(command line, expected exit code, what it prints) per line: a comment ``# exit N``
    expects exit N, ``# prints TEXT`` that TEXT is in its output."""
    joined = block.text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            code = re.search(r"#.*\bexit (\d+)", line)
            said = re.search(r"#.*\bprints (.+)$", line)
            out.append((line, int(code.group(1)) if code else 0,
                        said.group(1).strip() if said else None))
    return out


def _run_command(line: str, folder: Path, capsys, monkeypatch) -> tuple[int, str, list[str]]:
    """One line of a bash block, in ``folder``: amp-rewrite in this process (TensorFlow is
    loaded once), anything else through bash with this environment's tools first on PATH."""
    tokens = shlex.split(line, comments=True)
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    if tokens[0] == "amp-rewrite":
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            capsys.readouterr()
            code = cli.main(tokens[1:])
            said = capsys.readouterr()
            return code, said.out + said.err, tokens[1:]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(line, shell=True, cwd=folder, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PATH=path))
    return done.returncode, done.stdout + done.stderr, []


def _option(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a in names:
            return args[i + 1]
    return None


def _check_convert(args: list[str], out: str, folder: Path) -> None:
    model = folder / _option(args, "-o", "--output")
    assert model.exists() and "MatMul/Conv-family ops" in out, out
    report = _option(args, "--report")
    if report:
        data = json.loads((folder / report).read_text())
        assert data["schema_version"] == 1 and data["nodes"]
    html = _option(args, "--html")
    if html:
        assert "<html" in (folder / html).read_text().lower()
    board = _option(args, "--tensorboard")
    if board:
        assert list((folder / board).glob("events.out.tfevents.*"))


def _check_products(args: list[str], out: str, folder: Path) -> None:
    """What an amp-rewrite command that succeeded must have printed and written."""
    command = args[0] if args[0] in SUBCOMMANDS else "convert"
    if command == "convert":
        return _check_convert(args, out, folder)
    positional = [a for i, a in enumerate(args[1:], 1)
                  if not a.startswith("-") and not args[i - 1].startswith("-")]
    expected = {"explain": positional[1:], "rules": ["allow ("], "verify": ["verdict:"],
                "kernels": ["CPU:"], "bench": ["speed-up"], "tune": ["trials"],
                "ranges": ["float tensors over"], "costs": ["cost table: "]}[command]
    for text in expected:
        assert text in out, f"{command} printed no {text!r}:\n{out}"
    written = [_option(args, "--json"), _option(args, "--html")]
    if command == "costs":
        written.append(_option(args, "-o", "--output"))
    if command == "tune":
        output = _option(args, "-o", "--output")
        written += [output, _option(args, "--rules-out") or f"{output}.tune.toml"]
    for path in filter(None, written):
        assert (folder / path).stat().st_size > 0, path


def _run_bash(block: Block, folder: Path, capsys, monkeypatch) -> None:
    for line, expected, said in _commands(block):
        line = _local(line, folder)
        code, out, args = _run_command(line, folder, capsys, monkeypatch)
        assert code == expected, f"{block.doc}:{block.line}: {line}\nexit {code}:\n{out}"
        assert said is None or said in out, f"{block.doc}:{block.line}: {said!r} not in:\n{out}"
        if args and code == 0:
            _check_products(args, out, folder)
        elif args:      # refused: nothing written
            output = _option(args, "-o", "--output")
            assert output is None or not (folder / output).exists()


def _run_python(block: Block, folder: Path, capsys) -> None:
    """Runs the block; every /tmp path it names then exists, and every ``# prints X`` comment
    on a line was printed."""
    saved = list(sys.path)
    capsys.readouterr()
    try:
        exec(compile(_local(block.text, folder), f"{block.doc}:{block.line}", "exec"), {})
    finally:
        sys.path[:] = saved
    out = capsys.readouterr().out
    for path in re.findall(r"[\"'](/tmp/[\w./-]+)[\"']", block.text):
        made = folder / path.lstrip("/")      # a file, a folder, or a checkpoint's prefix
        assert list(made.parent.glob(made.name + "*")), f"{block.doc}:{block.line}: no {path}"
    for said in re.findall(r"#.*\bprints (.+)$", block.text, re.M):
        assert said.strip() in out, f"{block.doc}:{block.line}: {said!r} not in:\n{out}"


def _run_toml(block: Block, folder: Path) -> None:
    from amp_rewrite import load_rules
    path = folder / f"block{block.line}.toml"
    path.write_text(block.text)
    rules = load_rules("float16", [path], env={})
    assert str(path) in " ".join(map(str, rules.sources))


def _runnable(doc: str) -> list[Block]:
    return [b for b in blocks(doc) if b.not_run is None and b.text.strip() not in SETUP]


@pytest.mark.parametrize("doc", [d for d in ALL_DOCS if _runnable(d)])
def test_every_block_runs_and_makes_what_it_says(doc, tmp_path, capsys, monkeypatch):
    """The blocks of one document, in order, in one scratch folder (a block may read what an
    earlier one wrote, as a reader following along would)."""
    folder = _workspace(tmp_path, doc)
    monkeypatch.chdir(folder)
    for block in _runnable(doc):
        if block.lang == "bash":
            _run_bash(block, folder, capsys, monkeypatch)
        elif block.lang == "python":
            _run_python(block, folder, capsys)
        else:
            _run_toml(block, folder)


# ----------------------------------------------------------------- links, paths, names
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc_path: Path) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", doc_path.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", prose, re.M)}


@pytest.mark.parametrize("doc", NAMING_DOCS)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(doc):
    for link in re.findall(r"\]\(([^)\s]+)\)", _prose(doc)):
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / doc).parent / path if path else ROOT / doc
        assert target.exists(), f"{doc}: {link} points at nothing"
        if anchor:
            assert anchor in _anchors(target), f"{doc}: {link}: no such heading"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _defines(path: Path, name: str) -> bool:
    """``path`` (a Python file) defines ``name`` at its top level: a function, class or name."""
    return re.search(rf"^(?:def {name}\(|class {name}\b|{name}\s*[:=])", path.read_text(), re.M) is not None


# the folders whose scripts and helpers the documents name as ``module.attribute``
SCRIPT_FOLDERS = ("benchmarks", "tests")
EXTENSIONS = {"md", "py", "pb", "pbtxt", "toml", "json", "npz", "html", "meta"}


@pytest.mark.parametrize("doc", NAMING_DOCS)
def test_every_path_module_and_test_named_exists(doc):
    text = _text(doc)
    for path in re.findall(r"(?<![\w/.])((?:amp_rewrite|tests|benchmarks|examples|rules|docs|\.ci)"
                           r"/[\w./-]*\w)(?:::(\w+))?", text):
        file, test = path
        module, _, attr = file.rpartition(".")
        if not (ROOT / file).exists() and (ROOT / f"{module}.py").is_file():
            # ``benchmarks/train_step.bench_savedmodel``: a script's function
            assert _defines(ROOT / f"{module}.py", attr), f"{doc}: {module}.py defines no {attr}"
            continue
        assert (ROOT / file).exists(), f"{doc}: {file} does not exist"
        if test:
            assert re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M), f"{doc}: {file}::{test}"
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in re.findall(r"`(test_\w+)`", text):
        assert re.search(rf"^def {name}\(", tests, re.M), f"{doc}: no test {name}"
    for dotted in set(re.findall(r"\bamp_rewrite(?:\.\w+)+", text)):
        assert _resolves(dotted), f"{doc}: {dotted} does not resolve"
    # ``train_step.runtime_difference``, ``tune_graphs.large_sum``: a benchmark's or a test
    # helper's name, by its module's file name
    scripts = {p.stem: p for folder in SCRIPT_FOLDERS for p in (ROOT / folder).glob("*.py")}
    for module, attr in set(re.findall(r"(?<![\w/.])(\w+)\.([A-Za-z_]\w*)\b(?!\.?\w*/)", _prose(doc))):
        if module in scripts and attr not in EXTENSIONS:
            assert _defines(scripts[module], attr), f"{doc}: {module}.{attr}: no such name"


# ----------------------------------------------------------------- decision codes
def _emitted_codes() -> set[str]:
    """Every code the package can put in a report, read from its source: the second argument
    of each ``Decision(...)``, and the codes of the ``(code, reason)`` pairs that functions
    returning ``dict[str, tuple[str, str]]`` hand to ``Decision(False, *pair)``."""
    codes = set()
    for path in (ROOT / "amp_rewrite").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Decision":
                code = node.args[1]
                if isinstance(code, ast.Starred):
                    continue          # a (code, reason) pair: collected below
                assert isinstance(code, ast.Constant), f"{path}:{node.lineno}: a computed code"
                codes.add(code.value)
            if (isinstance(node, ast.FunctionDef) and node.returns is not None
                    and ast.unparse(node.returns) == "dict[str, tuple[str, str]]"):
                codes |= {t.elts[0].value for t in ast.walk(node) if isinstance(t, ast.Tuple)
                          and len(t.elts) == 2 and isinstance(t.elts[0], ast.Constant)}
    return codes


def _documented_codes() -> dict[str, str]:
    section = _text("docs/report.md").split("## Decision codes", 1)[1]
    return dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M))


def test_the_documented_decision_codes_are_the_ones_the_code_emits():
    from amp_rewrite.paint.decisions import LOWP_CODES
    documented = _documented_codes()
    assert set(documented) == _emitted_codes()
    assert {c for c, p in documented.items() if p == "low"} == set(LOWP_CODES)
    # and every code the golden corpus recorded is among them
    golden = json.loads((ROOT / "tests" / "golden.json").read_text())
    seen = {d.split()[-1] for case in golden.values() for d in case.get("decisions", {}).values()}
    assert seen and seen <= set(documented)


# ----------------------------------------------------------------- sections cited
CITATION = re.compile(r'(README|BENCHMARKS\.md|docs/\w+\.md):? \(?"([^"]+)"')


def _cited_sections() -> set[tuple[str, str]]:
    """``(document, section title)`` the package, the benchmarks and the tests cite as
    ``docs/x.md "Title"`` (or ``README "Title"``, ``BENCHMARKS.md "Title"``), in strings
    (concatenated as Python reads them) and comments."""
    cited = set()
    for folder in ("amp_rewrite", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__):
                continue
            source = path.read_text()
            texts = [n.value for n in ast.walk(ast.parse(source))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            texts += [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                      if t.type == tokenize.COMMENT]
            for text in texts:
                cited |= set(CITATION.findall(" ".join(text.split())))
    return cited


def _headings(doc: str) -> set[str]:
    return {re.sub(r"[`*]", "", h).strip() for h in re.findall(r"^#+ (.+)$", _prose(doc), re.M)}


def test_every_section_the_code_cites_is_a_heading_of_the_document_it_names():
    cited = _cited_sections()
    assert {("docs/savedmodels.md", "Frozen graphs from a SavedModel"),
            ("docs/decisions.md", "Which CPUs gain from bfloat16"),
            ("BENCHMARKS.md", "Op costs in bfloat16 on this CPU")} <= cited
    for doc, title in cited:
        doc = "README.md" if doc == "README" else doc
        assert (ROOT / doc).is_file(), f"{doc} \"{title}\": no such document"
        assert any(h.startswith(title) for h in _headings(doc)), f"{doc} \"{title}\": no such heading"


@pytest.mark.parametrize("doc", NAMING_DOCS)
def test_every_section_a_document_cites_is_a_heading_of_the_document_it_names(doc):
    """``BENCHMARKS.md "Keras models"``, ``docs/decisions.md "The cost model"``: in the
    guide's prose and in BENCHMARKS.md's, each section cited is a heading there."""
    for named, title in set(CITATION.findall(" ".join(_prose(doc).split()))):
        named = "README.md" if named == "README" else named
        assert any(h.startswith(title) for h in _headings(named)), \
            f"{doc}: {named} \"{title}\": no such heading"


# ----------------------------------------------------------------- numbers and their sources
def _bench(section: str, *figures: str):
    """The figures appear in BENCHMARKS.md's section of that title."""
    def check():
        text = (ROOT / "BENCHMARKS.md").read_text().split(f"## {section}\n", 1)[1].split("\n## ")[0]
        return all(f in text for f in figures)
    check.sections = {section}
    return check


def _source(path: str, *snippets: str):
    """A test or module says it: each snippet appears in its source (whitespace aside)."""
    def check():
        text = " ".join((ROOT / path).read_text().split())
        return all(" ".join(s.split()) in text for s in snippets)
    return check


def _parity_graphs() -> bool:
    import test_grappler_parity as parity
    cases = parity.CASES
    loops = [c for c in cases if c.startswith("loop_")]
    lists = [c for c in cases if c.startswith("tensorlist_")]
    return (len(cases) + 1, len(loops), len(lists)) == (29, 10, 12)   # + the pinned graph


def _bfloat16_sums() -> bool:
    """TensorFlow's bfloat16 Sum accumulates in float32; summing in bfloat16 stalls at 256."""
    import ml_dtypes
    import tensorflow as tf
    ours = float(tf.reduce_sum(tf.ones([10000], tf.bfloat16)))
    running = ml_dtypes.bfloat16(0)
    for _ in range(10000):
        running = ml_dtypes.bfloat16(running + ml_dtypes.bfloat16(1))
    return (ours, float(running)) == (9984.0, 256.0)


def _costs() -> bool:
    from amp_rewrite.rules.cost_table import shipped
    table = shipped()
    unfused = table.unfused_ps_per_element
    return (table.saved_ps_per_flop, unfused["Relu6"], unfused["Relu"]) == (0.9, 218, 43)


def _verify_defaults() -> bool:
    from amp_rewrite.core.dtypes import BFLOAT16, FLOAT, HALF
    from amp_rewrite.tools import verify
    by = lambda table: tuple(table[d] for d in (HALF, BFLOAT16, FLOAT))  # noqa: E731
    return (by(verify.REL_L2), by(verify.GRAD_REL_L2), verify.TOP1, by(verify.ALLCLOSE)) == (
        (0.01, 0.05, 1e-5), (0.1, 0.1, 1e-5), 0.99, ((0.01, 0.001), (0.05, 0.01), (1e-5, 1e-6)))


def _help_says(command: str, *texts: str):
    def check():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            cli.main([command, "-h"])
        said = " ".join(out.getvalue().split())
        return all(t in said for t in texts)
    return check


def _all(*checks):
    def check():
        return all(c() for c in checks)
    sections = set().union(*(getattr(c, "sections", set()) for c in checks))
    if sections:
        check.sections = sections
    return check


def _headroom() -> bool:
    from amp_rewrite.core.dtypes import HALF, HEADROOM, LARGEST
    return HEADROOM == 32 and int(LARGEST[HALF] / HEADROOM) == 2047


RANGES = 'BENCHMARKS.md "Range headroom"'


def _float16_range() -> bool:
    return float(np.finfo(np.float16).max) == 65504 and float(np.float16(2.0 ** -24)) > 0 == float(np.float16(2.0 ** -26))


def _min_intensity() -> bool:
    from amp_rewrite.conversion.graph import DEFAULT_MIN_INTENSITY
    return DEFAULT_MIN_INTENSITY == {("bfloat16", "cpu"): 128.0}


def _loss_scale_defaults() -> bool:
    from amp_rewrite.training.config import DEFAULTS
    return DEFAULTS == {"start": 2.0 ** 15, "interval": 2000, "factor": 2.0}


def _memory_bound() -> bool:
    import test_bad_input
    return (test_bad_input.BYTES_FACTOR, test_bad_input.NODE_KIB) == (4, 6)


def _per_row(cell: str, saved: int, lost: int):
    """A frozen recurrent step of 128 units on 128 features (tests/test_frozen_loops.py) is
    kept float32 with these per-row figures in its reason."""
    def check():
        from test_shapes import frozen_recurrence
        from amp_rewrite import convert
        gd, _, _ = frozen_recurrence(cell, units=128, features=128)
        _, report = convert(gd, target="bfloat16", device="cpu")
        reasons = [n.reason for n in report.nodes if n.op == "MatMul"]
        return bool(reasons) and all(f"about {lost} ns per row" in r and f"the {saved} ns" in r
                                     for r in reasons)
    return check


def _protobuf_limit() -> bool:
    from amp_rewrite.io.load import PROTOBUF_LIMIT
    return PROTOBUF_LIMIT == 2 ** 31 - 1


KERAS = "tests/test_keras_apps.py"
TOL = _source(KERAS, 'TOL = {"float16": 5e-3, "bfloat16": 2e-2}')
# (document, the words that quote a number, what must be named in that paragraph or the one
# before it (None: a default the code holds, shown by the check), the check)
CLAIMS = [
    ("docs/decisions.md", "six Keras models frozen and converted ran at 2.36x the FP32 SavedModel at batch 1 by geometric mean, the conversion that kept their variables at 1.10x",
     'BENCHMARKS.md "Serving SavedModels"',
     _bench("Serving SavedModels", "| 1 | 0.89x | 1.10x | 1.35x | 2.36x | 1.75x |")),
    ("docs/decisions.md", "A GRU step of 128 units on 128 features saves about 177 ns a row and loses about 206",
     "tests/test_frozen_loops.py",
     _per_row("gru", 177, 206)),
    ("docs/decisions.md", "an LSTM's 236 against 322", "tests/test_frozen_loops.py", _per_row("lstm", 236, 322)),
    ("docs/decisions.md", "(GRU 3.23 against 2.62 ms, LSTM 4.77 against 2.67 ms)", 'BENCHMARKS.md "Keras SavedModels"',
     _bench("Keras SavedModels", "| GRU text classifier (seq 64, 128 units) | 0/5 / 0/3 | 3.42 |",
            "| 2.62 (1.30x) | 2.74 (1.25x) | 3.23 (1.06x) |", "| 2.67 (1.02x) | 2.58 (1.06x) | 4.77 (0.57x) |")),
    ("docs/decisions.md", "(2.74 and 2.58 ms;", 'BENCHMARKS.md "Keras SavedModels"',
     _bench("Keras SavedModels", "| 2.74 (1.25x) |", "| 2.58 (1.06x) |")),
    ("docs/decisions.md", "a sum of 10000 ones gives 9984, not bfloat16's 256", "tests/test_docs.py", _bfloat16_sums),
    ("docs/decisions.md", "on 29 graphs", "tests/test_grappler_parity.py", _parity_graphs),
    ("docs/decisions.md", "10 simple-loop colourings", "tests/test_grappler_parity.py", _parity_graphs),
    ("docs/decisions.md", "12 TensorList graphs", "tests/test_grappler_parity.py", _parity_graphs),
    ("docs/decisions.md", "under 5e-3 in float16 and 2e-2 in bfloat16", KERAS, TOL),
    ("docs/decisions.md", "at most 1.25 times grappler's + 1e-3", KERAS, _source(KERAS, "ours <= 1.25 * theirs + 1e-3")),
    ("docs/decisions.md", "at most 1.1 times grappler's + 1e-4", KERAS, _source(KERAS, "folded_err <= 1.1 * theirs + 1e-4")),
    ("docs/decisions.md", "need at most 8 casts", KERAS, _source(KERAS, 'report.summary()["casts_added"] <= 8')),
    ("docs/decisions.md", "Relu6 costs 218 ps per element more", 'BENCHMARKS.md "Op costs in bfloat16 on this CPU"',
     _all(_costs, _bench("Op costs in bfloat16 on this CPU", "| Relu6 | 0.33 | 1.12 | costs 218 ps per element |"))),
    ("docs/decisions.md", "Xception as a SavedModel painted whole runs at 0.62x FP32 at batch 1 and 1.77x at 32",
     'BENCHMARKS.md "Batch size and weight casts"',
     _all(_bench("Batch size and weight casts", "| Xception (71x71, weights=None) | 1 | 28.91 | 46.46 (0.62x) |"),
          _bench("Batch size and weight casts", "| Xception (71x71, weights=None) | 32 | 181.38 | 102.20 (1.77x) |"))),
    ("docs/decisions.md", "a GRU text classifier at 0.40x at batch 1 and 1.20x at 128", 'BENCHMARKS.md "Batch size and weight casts"',
     _all(_bench("Batch size and weight casts", "| GRU text classifier (seq 64, 128 units) | 1 | 2.03 | 5.13 (0.40x) |"),
          _bench("Batch size and weight casts", "| GRU text classifier (seq 64, 128 units) | 128 | 18.03 | 15.03 (1.20x) |"))),
    ("docs/decisions.md", "Xception at batch 2, which painted whole already runs at 1.34x", 'BENCHMARKS.md "Batch size and weight casts"',
     _bench("Batch size and weight casts", "| Xception (71x71, weights=None) | 2 | 72.17 | 53.67 (1.34x) | 75.68 (0.95x) | 0/75 |")),
    ("docs/decisions.md", "grappler at 1.12x FP32, amp-rewrite at 0.90x its speed",
     'BENCHMARKS.md "Untrained batch norms in bfloat16"',
     _bench("Untrained batch norms in bfloat16", "| 0/53 | 0 | 17 / 0 |", "(1.12x) | 0.90x |")),
    ("docs/decisions.md", "(painted whole 1.02x FP32, amp-rewrite 0.98x grappler's speed)",
     'BENCHMARKS.md "Untrained batch norms in bfloat16"',
     _bench("Untrained batch norms in bfloat16", "| 17 / 17 | 46.1 | 46.1 (1.00x) | 45.1 (1.02x) | 45.3 (1.02x) | 0.98x |")),
    ("docs/decisions.md", "from 1.07x FP32 (grappler's speed) to 2.41x FP32", 'BENCHMARKS.md "Keras models"',
     _bench("Keras models", "| MobileNetV2, batch norms set | 1052 | 53/53 | 79 | 74 (1.07x) | 33 (2.41x) | 73 (1.07x) |")),
    ("docs/decisions.md", "runs at 2.41x FP32", 'BENCHMARKS.md "Keras models"',
     _bench("Keras models", "| MobileNetV2, batch norms set | 1052 | 53/53 | 79 | 74 (1.07x) | 33 (2.41x) |")),
    ("docs/decisions.md", "(default 128, `amp_rewrite.conversion.graph.DEFAULT_MIN_INTENSITY`)", None, _min_intensity),
    ("docs/decisions.md", "about 0.9 ps per FLOP", "rules/costs.toml",
     _all(_costs, _bench("Op costs in bfloat16 on this CPU", "saves 0.95 ps per FLOP", "saves 0.93 ps per FLOP",
                         "saves 0.89 ps per FLOP"))),
    ("docs/decisions.md", "saving 2.59 ps a FLOP inside the model and 3.12 with its batch norms set, against the 0.9",
     'BENCHMARKS.md "Convolution savings inside a model"',
     _all(_costs, _bench("Convolution savings inside a model", "| 2.59 |", "| 3.12 |"))),
    ("docs/decisions.md", "(Relu6: 218 ps, Relu: 43 ps)", 'BENCHMARKS.md "Op costs in bfloat16 on this CPU"',
     _all(_costs, _bench("Op costs in bfloat16 on this CPU", "costs 218 ps per element", "costs 43 ps per element"))),
    ("docs/decisions.md", '"Keras models": 1.07x FP32 against grappler\'s 1.07x', 'BENCHMARKS.md "Keras models"',
     _bench("Keras models", "| MobileNetV2, batch norms set | 1052 | 53/53 | 79 | 74 (1.07x) |", "| 73 (1.07x) | 1.00x |")),
    ("docs/decisions.md", '"Small matrix ops": 0.92x at width 48, 1.08x at 64, 1.33x at 128', 'BENCHMARKS.md "Small matrix ops"',
     _bench("Small matrix ops", "| 48 | 0.92x |", "| 64 | 1.08x |", "| 128 | 1.33x |")),
    ("docs/decisions.md", '"Training step": grappler\'s bfloat16 painting of it 0.95x', 'BENCHMARKS.md "Training step"',
     _bench("Training step", "| small MLP (64-64-10, the tests' model), Adam, batch 64 | 0/6 | 0.6 | 0.6 (1.03x) | 0.6 (0.95x) |")),
    ("docs/decisions.md", '"Training step": 1.36x', 'BENCHMARKS.md "Training step"',
     _bench("Training step", "Adam, batch 16 | 132/132 | 146.9 | 108.2 (1.36x) |")),
    ("docs/verify.md", "`--rel-l2`: 0.01 / 0.05 / 1e-5; for gradients `--grad-rel-l2`: 0.1 / 0.1 / 1e-5",
     "amp_rewrite/tools/verify.py", _verify_defaults),
    ("docs/verify.md", "`--top1`: 0.99", "amp_rewrite/tools/verify.py", _verify_defaults),
    ("docs/verify.md", "`--rtol`: 0.01 / 0.05 / 1e-5, `--atol`: 0.001 / 0.01 / 1e-6", "amp_rewrite/tools/verify.py",
     _verify_defaults),
    ("docs/verify.md", "under 5e-3 and their bfloat16 logits under 2e-2", KERAS, TOL),
    ("docs/verify.md", "stays under 1e-3 in float16 with every one of 397 argmaxes kept", "tests/test_verify_checks.py",
     _source("tests/test_verify_checks.py", "assert 0 < out.rel_l2 < 1e-3", "(out.top1, out.rows, out.top1_disagree) == (1.0, 397, 0)")),
    ("docs/verify.md", "its bfloat16 conversion stays under 1e-2", "tests/test_verify_checks.py",
     _source("tests/test_verify_checks.py", "bf16.outputs[0].rel_l2 < 1e-2")),
    ("docs/verify.md", "the gradient bound of 0.1", "tests/test_verify_training.py",
     _all(_verify_defaults, _source("tests/test_verify_training.py", "max(n.rel_l2 for n in backward.values()) < 0.1"))),
    ("docs/verify.md", "default 10", None, _help_says("verify", "default 10")),
    ("docs/verify.md", "(`--warmup`, default 3)", None, _help_says("bench", "(default 3)")),
    ("docs/verify.md", "(`--runs`, default 20)", None, _help_says("bench", "(default 20)")),
    ("docs/verify.md", "over 65504 is inf, under 2^-24 is 0", None, _float16_range),
    ("docs/verify.md", "within half of each other", "tests/test_emulate.py",
     _source("tests/test_emulate.py", "assert abs(err(emu) - err(half)) < 0.5 * err(half)")),
    ("docs/verify.md", "to within a relative L2 of 1e-6", "tests/test_emulate.py",
     _source("tests/test_emulate.py", "assert graphs.rel_l2(ours, ref) <= 1e-6")),
    ("docs/ranges.md", "(`--headroom`, default 32: from 2047 on)", None,
     _all(_headroom, _help_says("ranges", "(default 32: float16 tensors from 2047 on)"))),
    ("docs/ranges.md", "at most 2.55 over the 16 batches after one calibrated batch, and 3.51 over 1024", RANGES,
     _bench("Range headroom", "| 2.55 |", "| 3.51 |")),
    ("docs/ranges.md", "up to 14.49 over 16 batches, 26.21 over 1024", RANGES,
     _bench("Range headroom", "| 14.49 |", "| 26.21 |")),
    ("docs/ranges.md", "3.62 instead of 5.15", RANGES, _bench("Range headroom", "| 3.62 |", "| 5.15 |")),
    ("docs/ranges.md", "none lies below 2^-126", RANGES,
     _bench("Range headroom", "below bfloat16's smallest normal (2^-126) 0, rounding to zero in bfloat16 0.")),
    ("docs/ranges.md", "`--top N` sets how many (default 20)", None, _help_says("ranges", "(default 20)")),
    ("docs/verify.md", "within 1e-6 in relative L2", "tests/test_emulate_functions.py",
     _source("tests/test_emulate_functions.py",
             'assert graphs.rel_l2(outputs["emu", signature], outputs["grappler", signature]) <= 1e-6',
             "assert graphs.rel_l2(ours, grappler) <= 1e-6")),
    ("docs/verify.md", "within 4 units in float16's last place per element and 2e-3 in relative L2",
     "tests/test_emulate_functions.py",
     _source("tests/test_emulate_functions.py", "assert graphs.rel_l2(emu, half) <= 2e-3",
             "assert _ulps(emu, half).max() <= 4",
             "assert graphs.rel_l2(ours, real) <= 2e-3 and _ulps(ours, real).max() <= 4")),
    ("docs/tuning.md", "rel_l2 0.01 float16, 0.05 bfloat16; top1 0.01", None,
     _all(_verify_defaults, _help_says("tune", "rel_l2 0.01 float16, 0.05 bfloat16; top1 0.01"))),
    ("docs/training.md", "start at 2^15, ×2 after 2000 finite steps", "amp_rewrite.training.config.DEFAULTS",
     _loss_scale_defaults),
    ("docs/training.md", "stay bit-identical", "test_mirrored_strategy_replicas_skip_the_same_steps_and_stay_identical",
     _source("tests/test_loss_scaling.py", 'assert all(s["identical"] for s in steps)')),
    ("docs/training.md", "keep their exact bits (tests/test_loss_scaling.py::test_overflow_step_is_skipped_bit_identically)",
     "test_overflow_step_is_skipped_bit_identically",
     _source("tests/test_loss_scaling.py", "assert np.array_equal(before[name], after[name]), name")),
    ("docs/training.md", "keep their exact bits (tests/test_saved_training.py::test_a_skipped_step_changes_no_bit",
     "test_a_skipped_step_changes_no_bit", _source("tests/test_saved_training.py", "assert bits(model) == before")),
    ("docs/training.md", "byte for byte: tests/test_saved_training.py::test_original_variables_keep_their_bytes",
     "test_original_variables_keep_their_bytes", _source("tests/test_saved_training.py", ".tobytes() == new.get_tensor(k).tobytes()")),
    ("docs/convert.md", "the float32 model built from the same weights, bit for bit",
     "tests/test_sixteen_bit_inputs.py", _source("tests/test_sixteen_bit_inputs.py",
                                                 'assert np.array_equal(serve(folder / f"{kind}_fp32", x), twin)')),
    ("docs/convert.md", "that model's bfloat16 conversion, bit for bit", "tests/test_sixteen_bit_inputs.py",
     _source("tests/test_sixteen_bit_inputs.py", 'assert np.array_equal(serve(folder / f"{kind}_bf16", x), '
                                                 'serve(folder / f"{kind}_twin_bf16", x))')),
    ("docs/convert.md", "float32's tolerance (1e-5", "amp_rewrite/tools/verify.py",
     _source("amp_rewrite/tools/verify.py", "REL_L2 = {BFLOAT16: 5e-2, HALF: 1e-2, FLOAT: 1e-5}")),
    ("docs/convert.md", "the float32 twin's losses, bit for bit", "tests/test_sixteen_bit_inputs.py",
     _source("tests/test_sixteen_bit_inputs.py", "assert sixteen_bit(converted.node) == [] and losses == twin")),
    ("docs/savedmodels.md", "copied byte for byte", "test_keras_export_converts_serves_and_keeps_weights",
     _source("tests/test_savedmodel.py", "filecmp.cmp(a / subdir / n, b / subdir / n, shallow=False)")),
    ("docs/savedmodels.md", "more than 2 GiB of weights", "test_weights_over_2_gib_convert_load_and_run",
     _source("tests/test_savedmodel.py", "assert weights > 2**31")),
    ("docs/savedmodels.md", "one with 2.3 GB", "test_weights_over_2_gib_convert_load_and_run",
     _source("tests/test_savedmodel.py", "2.3 GB of float32 weights")),
    ("docs/savedmodels.md", "a message holds at most 2 GiB", "amp_rewrite/io/load.py", _protobuf_limit),
    ("docs/savedmodels.md", "`CONST_BYTES` (256 MiB", "amp_rewrite/io/frozen.py",
     _source("amp_rewrite/io/frozen.py", "CONST_BYTES = 256 << 20")),
    ("docs/savedmodels.md", "converts a table past 2 GiB in at most twice its bytes of memory",
     "tests/test_freeze_at_scale.py",
     _source("tests/test_freeze_at_scale.py", "assert rows * dim * 4 > (1 << 31) - 1",
             "assert peak <= 2 * weights")),
    ("docs/savedmodels.md", "at least a tenth of the weighed islands' float32 matrix time, and at least 1 µs a sample",
     "amp_rewrite/conversion/graph.py", _source("amp_rewrite/conversion/graph.py", "FREEZE_HINT_SHARE = 0.1",
                                                "FREEZE_HINT_US = 1.0")),
    ("docs/reliability.md", "protobuf's 2 GiB limit", "amp_rewrite/io/load.py", _protobuf_limit),
    ("docs/reliability.md", "byte-identical output files", "tests/test_determinism.py",
     _source("tests/test_determinism.py", "def test_graph_files_and_reports_are_byte_identical(two_runs):",
             "assert graphs_first == graphs_second")),
    ("docs/reliability.md", "under 4 times the GraphDef's size plus 6 KiB per node", "tests/test_bad_input.py", _memory_bound),
    ("docs/reliability.md", "within a quarter of four times the smaller's", "tests/test_bad_input.py",
     _source("tests/test_bad_input.py", "assert 0.8 <= linearity <= 1.25, line")),
    ("docs/reliability.md", "up to about 300,000 nodes", 'BENCHMARKS.md "Conversion speed"',
     _bench("Conversion speed", "| mlp | 299999 |", "| train | 298757 |")),
]
# what reads as a measured or promised number: ratios, errors, sizes, times, counts, exactness
NUMBER = re.compile(r"\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? times\b|\b\d(?:\.\d+)?e-\d+\b"
                    r"|\b\d+(?:[.,]\d+)? ?(?:ms|µs|ps|s|MiB|MB|GiB|GB|KiB|%)(?![\w-])"
                    r"|\b\d+ (?:tests|graphs|seconds|minutes|models)\b|\b\d{3},\d{3}\b"
                    r"|\bbit[- ]for[- ]bit\b|\bbit-identical\b|\bexact bits\b|\bbyte[- ]for[- ]byte\b"
                    r"|\bbyte-identical\b")


def _paragraphs(doc: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", _prose(doc)) if p.strip()]


def _benchmarks_section(title: str) -> str | None:
    """The text of BENCHMARKS.md's section of that title (tables and prose), or None."""
    parts = re.split(r"^## ", (ROOT / "BENCHMARKS.md").read_text(), flags=re.M)
    return next((p.partition("\n")[2] for p in parts if p.partition("\n")[0].strip() == title), None)


# a number as the documents quote one: not the digit of a name (Relu6, MobileNetV2, float16)
QUOTED = re.compile(r"(?<![\w.^])\d+(?:[.,]\d+)*(?:e-\d+)?")


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c[0]}:{c[1][:40]}" for c in CLAIMS])
def test_each_number_matches_the_source_named_beside_it(claim):
    doc, words, source, check = claim
    paragraphs = _paragraphs(doc)
    found = [i for i, p in enumerate(paragraphs) if words in p]
    assert found, f"{doc} no longer says {words!r}: update CLAIMS with the text"
    for i in found:
        near = paragraphs[i] + (paragraphs[i - 1] if i else "")
        assert source is None or source in near, f"{doc}: {words!r} without {source} beside it"
    assert check(), f"{doc}: {words!r} does not match {source or 'the code'}"


@pytest.mark.parametrize("claim", [c for c in CLAIMS if (c[2] or "").startswith('BENCHMARKS.md "')],
                         ids=lambda c: f"{c[0]}:{c[1][:40]}")
def test_each_number_quoted_from_benchmarks_is_in_the_section_named(claim):
    """A check in CLAIMS holds a table's row as text, written beside the words that quote it;
    the words' own numbers are held here: each one the document quotes from BENCHMARKS.md
    "Section" stands in that section as it is now (a table cell or its prose), so a re-run that
    moves the figure fails until the document says the new one."""
    doc, words, source, check = claim
    title = re.match(r'BENCHMARKS\.md "([^"]+)"', source).group(1)
    section = _benchmarks_section(title)
    assert section is not None, f"{doc}: BENCHMARKS.md has no section {title!r}"
    assert title in getattr(check, "sections", {title}), f"{doc}: {words!r}: its check reads another section"
    figures = [float(f) for f in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", section.replace(",", ""))]
    for m in QUOTED.finditer(words):
        number = m.group()
        if words[:m.start()].endswith("about "):    # rounded: within 5% of a figure there
            value = float(number.replace(",", ""))
            assert any(abs(f - value) <= 0.05 * value for f in figures), \
                f"{doc}: about {number} ({words!r}): no such figure in BENCHMARKS.md \"{title}\""
            continue
        assert re.search(rf"(?<![\w.]){re.escape(number)}(?![\d])", section), \
            f"{doc}: {number} ({words!r}) is not in BENCHMARKS.md \"{title}\""


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_every_number_is_one_of_the_checked_claims(doc):
    """A number added to the text fails here until CLAIMS holds it to its source."""
    mine = [c[1] for c in CLAIMS if c[0] == doc]
    for paragraph in _paragraphs(doc):
        spans = [(m.start(), m.end()) for words in mine
                 for m in re.finditer(re.escape(words), paragraph)]
        for m in NUMBER.finditer(paragraph):
            assert any(a <= m.start() and m.end() <= b for a, b in spans), \
                f"{doc}: {m.group()!r} has no source: ...{paragraph[max(0, m.start() - 80):m.end() + 40]}..."


# ----------------------------------------------------------------- BENCHMARKS.md's sections
# A section a script renders from what it measured is held to that result, kept in the
# repository (benchmarks/benchmd.save_results: benchmarks/results/NAME.json, with the commit the
# run was at): rendered again, it must be the section word for word. Section -> (script in
# benchmarks/, its function from the result to the section's text, the result's name).
RENDERED = {"Serving SavedModels": ("serving", "table", "serving"),
            "The default conversion on this CPU": ("default_cpu", "table", "default_cpu"),
            "--freeze at scale": ("freeze_scale", "table", "freeze_scale")}
# sections whose result is lost, with why; their own tests hold what can be held without it
LOST = {"Serving SavedModels": "its run's --json file lived in /tmp/srv on the AMX machine that "
        "ran it (BENCHMARKS.md names the command) and was never committed; the next run keeps "
        "it in benchmarks/results/serving.json"}


def _section(title: str) -> str:
    return _text("BENCHMARKS.md").split(f"## {title}\n", 1)[1].split("\n## ")[0]


def _script(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("title", sorted(RENDERED))
def test_a_section_a_script_renders_is_its_kept_result_rendered_again(title):
    script, render, name = RENDERED[title]
    path = ROOT / "benchmarks" / "results" / f"{name}.json"
    if title in LOST:
        assert not path.exists(), f"{path} is back: drop {title!r} from LOST, the test renders it"
        return
    result = json.loads(path.read_text())
    assert result.get("commit"), f"{path}: no commit it ran at"
    text = getattr(_script(script), render)(result)
    assert f"## {title}\n" + _section(title).rstrip("\n") == text.rstrip("\n")


def _cells(row: str) -> list[str]:
    return [c.strip().strip("*") for c in row.strip().strip("|").split("|")]


def _tables(text: str) -> list[list[list[str]]]:
    """The section's markdown tables, each a list of rows of cells (header and rule left out)."""
    tables, rows = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            if rows is None:
                rows = []
                tables.append(rows)
                continue    # the header
            if not line.startswith("| ---"):
                rows.append(_cells(line))
        else:
            rows = None
    return tables


def _geomean(values) -> float:
    values = list(values)
    return float(np.exp(np.mean(np.log(values))))


class _Serving:
    """BENCHMARKS.md "Serving SavedModels" read back: its main table by model, batch and
    variant, and its geometric means."""

    VARIANTS = ("grappler", "default", "frozen_fp32", "freeze")

    def __init__(self, text: str):
        main, means = _tables(text)
        self.rows = {}
        for cells in main:
            ratios = {}
            for v, cell in zip(self.VARIANTS, cells[3:7]):
                m = re.fullmatch(r"(\d+\.\d\d)x \((\d+\.\d\d)-(\d+\.\d\d)\)", cell)
                ratios[v] = float(m.group(1))
            self.rows[cells[0], int(cells[1])] = {
                "ms": float(cells[2]), **ratios, "matrix": cells[7], "folds": cells[8],
                "hint": cells[9], "errors": [tuple(float(x) for x in c.split(", "))
                                             for c in cells[10:13]]}
        self.means = {int(c[0]): dict(zip(self.VARIANTS + ("ratio",),
                                          (float(x.rstrip("x")) for x in c[1:6])))
                      for c in means}

    def models(self) -> list[str]:
        return sorted({m for m, _ in self.rows})

    def bounds(self, batch: int, variant: str) -> tuple[float, float]:
        """The geometric mean over the models that the table's ratios, each rounded to 0.01,
        allow."""
        rs = [self.rows[m, batch][variant] for m in self.models()]
        return _geomean(r - 0.005 for r in rs), _geomean(r + 0.005 for r in rs)

    def row(self, model: str, batch: int) -> dict:
        return next(r for (m, b), r in self.rows.items() if m.startswith(model) and b == batch)


def test_serving_savedmodels_means_and_prose_are_its_tables():
    """What can be held of "Serving SavedModels" without its lost result (LOST): the geometric
    means are the main table's ratios' (within their rounding), and every ratio, error and time
    its prose quotes is a cell of the tables, computed from them, a threshold of the script, or
    one of the figures the prose says come from another run (listed here, with where)."""
    text = _section("Serving SavedModels")
    s = _Serving(text)
    assert len(s.models()) == 6 and set(s.means) == {1, 32}
    for b in (1, 32):
        for v in _Serving.VARIANTS:
            lo, hi = s.bounds(b, v)
            assert lo - 0.005 <= s.means[b][v] <= hi + 0.005, (b, v, s.means[b][v], lo, hi)
        (flo, fhi), (plo, phi) = s.bounds(b, "freeze"), s.bounds(b, "frozen_fp32")
        assert flo / phi - 0.005 <= s.means[b]["ratio"] <= fhi / plo + 0.005, b
    m, row = s.means, s.row
    x = lambda v: f"{v:.2f}x"   # noqa: E731
    freeze = [r["freeze"] for r in s.rows.values()]
    b1_grappler = [row(k, 1)["grappler"] for k in s.models() if not k.startswith("U-Net")]
    quiet = [r for r in s.rows.values() if r["hint"] == "no"]
    apart = [r["freeze"] / r["default"] for r in quiet]
    closest = [min((r["freeze"] + d) / (r["grappler"] - d) for r in s.rows.values())
               for d in (-0.005, 0.005)]    # what the rounded cells allow
    errors = [e[0] for r in s.rows.values() for e in (r["errors"][0], r["errors"][2])]
    held = [
        f"({x(m[32]['freeze'])} FP32 by geometric mean at batch 32, {x(m[1]['freeze'])} at batch 1)",
        f"gives {x(m[32]['frozen_fp32'])} and {x(m[1]['frozen_fp32'])} of that",
        f"(the last column: {x(m[32]['ratio'])} over frozen float32 at batch 32, "
        f"{x(m[1]['ratio'])} at batch 1)",
        f"but the U-Net ({x(min(b1_grappler))}-{x(max(b1_grappler))})",
        f"on MobileNetV2 at batch 32 ({x(row('MobileNetV2', 32)['grappler'])})",
        f"rows ({x(row('MobileNetV2', 32)['freeze'])} and {x(row('MobileNetV2', 32)['grappler'])} "
        f"at batch 32, {x(row('MobileNetV2', 1)['freeze'])} and "
        f"{x(row('MobileNetV2', 1)['grappler'])} at batch 1)",
        f"The U-Net gains most ({x(row('U-Net', 32)['freeze'])} at batch 32)",
        f"(default {x(row('U-Net', 32)['default'])}, grappler {x(row('U-Net', 32)['grappler'])})",
        f"freezing alone gains it nothing ({x(row('BERT', 32)['frozen_fp32'])} at batch 32), and "
        f"`--freeze` ({x(row('BERT', 32)['freeze'])}) is ahead of the default "
        f"({x(row('BERT', 32)['default'])})",
        f"EfficientNetV2B0 ({x(row('EfficientNetV2B0', 1)['freeze'])} against frozen fp32's "
        f"{x(row('EfficientNetV2B0', 1)['frozen_fp32'])})",
        f"MobileNetV2 ({x(row('MobileNetV2', 1)['freeze'])} against "
        f"{x(row('MobileNetV2', 1)['frozen_fp32'])})",
        f"(relative L2 {min(errors):.0e} to {max(errors):.1e}, as grappler's)".replace("e-0", "e-"),
        f"geometric mean over the {len(s.models())} models: {x(m[32]['freeze'])} FP32 (needs 1.5x)",
        f"never below 1.0x FP32 at batch 1 or 32 (lowest {x(min(freeze))})",
        f"(here {x(row('EfficientNetV2B0', 32)['freeze'])}, "
        f"{row('EfficientNetV2B0', 32)['folds'].replace(' / ', ' scales and ')} adds folded)",
        f"`--freeze` ran {min(apart):.1f}x-{max(apart):.1f}x the default's speed",
        f"moved from 1396 to {row('ResNet50', 32)['ms']:.0f} ms and its `--freeze` ratio from "
        f"2.55x to {x(row('ResNet50', 32)['freeze'])}, the batch-32 geometric mean from 3.36x to "
        f"{x(m[32]['freeze'])}",
        "rel. L2 5e-2",     # verify's bfloat16 default (tools/verify.REL_L2)
    ]
    prose = " ".join(line for line in text.splitlines() if not line.startswith("|"))
    for claim in held:
        assert claim in prose, claim
    said = re.search(r"\(closest: (\d\.\d\d)x grappler's speed\)", prose)
    assert closest[0] - 0.005 <= float(said.group(1)) <= closest[1] + 0.005, (said[0], closest)
    held.append(said[0])
    assert all(e[1] == 1.0 for r in s.rows.values() for e in r["errors"])   # every top-1 agreeing
    # figures the prose says come from elsewhere: not this run's, and held by nothing here
    elsewhere = ["2.25x", "2.63x",     # the side-by-side run of the bnfold fix
                 "2.91x", "0.77x",     # issue 36's hand-made check (2.91x also a mean above)
                 "1396", "2.55x", "3.36x"]   # the other full run (quoted in a held claim)
    figure = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x\b|\d+(?:\.\d+)?e-?\d+|\d+ ms\b")
    found = figure.findall(prose)
    accounted = figure.findall(" ".join(held)) + elsewhere
    for f in set(found):
        assert found.count(f) <= accounted.count(f), f"{f!r}: a figure no claim holds"


def test_a_kept_result_renders_a_section_that_names_its_commit_and_holds_its_means():
    """The mechanism a section joins RENDERED by, on a made-up result of benchmarks/serving.py:
    the section names the commit the run was at and its kept measurements, and its tables read
    back (as the test above reads BENCHMARKS.md's) give means the rows' ratios hold."""
    serving, benchmd = _script("serving"), _script("benchmd")
    rng = np.random.default_rng(0)
    rows = []
    for name in ("A", "B"):
        batches = {}
        for b in (1, 32):
            times = {v: list(rng.uniform(1, 2, 5) * (5 if v == "fp32" else 1))
                     for v in serving.VARIANTS}
            batches[str(b)] = {"times_ms": times,
                               "errors": {v: (1e-2, 1.0) for v in serving.VARIANTS}}
        info = {"frozen_fp32_fusion": {"scales_folded": 1, "bias_adds": 2}}
        for b in (1, 32):
            info[f"default_{b}"] = {"matrix": "1/1", "hint": False}
            info[f"freeze_{b}"] = {"matrix": "1/1"}
        checks = {b: {"signatures": True, "verify": {"serve": True}} for b in (1, 32)}
        rows.append({"name": name, "batches": batches, "info": info, "checks": checks})
    result = {"rows": rows, "rounds": {"1": 5, "32": 5}, "command": "made up",
              "commit": benchmd.commit(), "date": "2026-01-01", "load": [1.0], "cpu": "a CPU",
              "tf": "2.21.0", "python": "3.11"}
    text = serving.table(result)
    assert f"at commit `{benchmd.commit()}` (its measurements: " \
           "`benchmarks/results/serving.json`)" in text
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert benchmd.commit().split("+")[0] == head
    s = _Serving(text.split("\n", 1)[1])
    for b in (1, 32):
        want = _geomean(serving.ratios(r, b)["freeze"] for r in rows)
        assert abs(s.means[b]["freeze"] - want) <= 0.005
        lo, hi = s.bounds(b, "freeze")
        assert lo - 0.005 <= s.means[b]["freeze"] <= hi + 0.005
