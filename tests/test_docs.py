"""The README and the guide in docs/ say what is true: every ``bash`` and ``python`` block runs
(or says, with a reason checked here, why it cannot), every relative link, path, module and test
named exists, the decision codes listed are the ones the code emits, and every number quoted
comes from the test, benchmark or constant named beside it."""

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

# ``convert`` first: the package's lazy ``convert`` function and its ``convert/`` folder share
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
# the README's first two blocks, as a fresh machine runs them (.ci/run runs the second)
SETUP = ("python3.11 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/amp-rewrite "
         "examples/cnn_fp32.pb -o /tmp/cnn_amp.pb --force",
         "python3.11 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && "
         ".venv/bin/python -m pytest -q")
SUBCOMMANDS = {"explain", "rules", "verify", "kernels", "bench", "tune"}


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
                "kernels": ["CPU:"], "bench": ["speed-up"], "tune": ["trials"]}[command]
    for text in expected:
        assert text in out, f"{command} printed no {text!r}:\n{out}"
    written = [_option(args, "--json"), _option(args, "--html")]
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


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_every_block_runs_and_makes_what_it_says(doc, tmp_path, capsys, monkeypatch):
    """The blocks of one document, in order, in one scratch folder (a block may read what an
    earlier one wrote, as a reader following along would)."""
    runnable = [b for b in blocks(doc) if b.not_run is None and b.text.strip() not in SETUP]
    if not runnable:
        pytest.skip(f"{doc} has no block to run")
    folder = _workspace(tmp_path, doc)
    monkeypatch.chdir(folder)
    for block in runnable:
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


@pytest.mark.parametrize("doc", ALL_DOCS)
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


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_every_path_module_and_test_named_exists(doc):
    text = _text(doc)
    for path in re.findall(r"(?<![\w/.])((?:amp_rewrite|tests|benchmarks|examples|rules|docs|\.ci)"
                           r"/[\w./-]*\w)(?:::(\w+))?", text):
        file, test = path
        assert (ROOT / file).exists(), f"{doc}: {file} does not exist"
        if test:
            assert re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M), f"{doc}: {file}::{test}"
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in re.findall(r"`(test_\w+)`", text):
        assert re.search(rf"^def {name}\(", tests, re.M), f"{doc}: no test {name}"
    for dotted in set(re.findall(r"\bamp_rewrite(?:\.\w+)+", text)):
        assert _resolves(dotted), f"{doc}: {dotted} does not resolve"
