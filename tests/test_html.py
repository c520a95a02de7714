"""The HTML report rendered by headless Chromium, and the TensorBoard event file read back."""

import json
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
import tensorflow as tf

from amp_rewrite import cli

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


class _Dom(HTMLParser):
    """Tables (class -> list of body rows, each a list of cell texts), SVG rects, <html> attrs."""

    def __init__(self):
        super().__init__()
        self.tables, self.rects, self.root, self.items = {}, 0, {}, 0
        self._table = self._row = self._cell = None
        self._in_body = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "html":
            self.root = attrs
        elif tag == "table":
            self._table = self.tables.setdefault(attrs.get("class", "").split()[-1], [])
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = ""
        elif tag == "rect":
            self.rects += 1
        elif tag == "li":
            self.items += 1

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._table.append(self._row)
            self._row = None
        elif tag == "tbody":
            self._in_body = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _render(page: Path) -> _Dom:
    """Load ``page`` in headless Chromium; the DOM after its script ran, and a screenshot."""
    with tempfile.TemporaryDirectory() as profile:
        flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={profile}"]
        dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True,
                             text=True, timeout=120)
        shot = page.with_suffix(".png")
        subprocess.run(flags + ["--window-size=1200,900", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert shot.stat().st_size > 10_000   # a blank page is a few hundred bytes
    parsed = _Dom()
    parsed.feed(dom.stdout)
    return parsed


@needs_chromium
def test_convert_html_report_renders(tmp_path):
    out, page, js = tmp_path / "cnn.pb", tmp_path / "report.html", tmp_path / "report.json"
    assert cli.main([str(EXAMPLE), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--min-matrix-intensity", "0",
                     "--html", str(page), "--report", str(js), "-q"]) == 0
    report = json.loads(js.read_text())
    dom = _render(page)
    # the page's script ran to its end (it counts the tables it made sortable)
    assert int(dom.root["data-ready"]) == len(dom.tables) == 3
    kept = [n for n in report["nodes"] if n["precision"] == "float32"]
    assert sorted(r[0] for r in dom.tables["kept"]) == sorted(n["name"] for n in kept)
    by_op = {r[0]: r for r in dom.tables["by-op"]}
    assert set(by_op) == {n["op"] for n in report["nodes"]}
    assert sum(int(r[-1]) for r in by_op.values()) == len(report["nodes"])
    assert dom.items == report["summary"]["casts_added"]
    assert dom.rects >= len(by_op)   # at least one bar per op type


@needs_chromium
def test_verify_html_report_renders(tmp_path):
    out, page = tmp_path / "cnn.pb", tmp_path / "verify.html"
    assert cli.main([str(EXAMPLE), "-o", str(out), "-q"]) == 0
    assert cli.main(["verify", str(EXAMPLE), str(out), "--per-node", "--html", str(page), "-q"]) == 0
    dom = _render(page)
    assert int(dom.root["data-ready"]) == len(dom.tables)
    (row,) = dom.tables["verify"]
    assert row[0] == "probabilities:0" and float(row[2]) > 0 and row[-1] == "yes"
    ranked = [float(r[4]) for r in dom.tables["per-node"]]
    assert ranked and ranked == sorted(ranked, reverse=True)
    half = [r for r in dom.tables["by-op"] if r[0] == "Conv2D"]
    assert half and int(half[0][-1]) == 2


def test_tensorboard_event_holds_the_converted_graph(tmp_path):
    out, logdir = tmp_path / "cnn.pb", tmp_path / "tb"
    assert cli.main([str(EXAMPLE), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--min-matrix-intensity", "0",
                     "--tensorboard", str(logdir), "-q"]) == 0
    (event_file,) = logdir.glob("events.out.tfevents.*")
    graphs = []
    for event in tf.compat.v1.train.summary_iterator(str(event_file)):
        if event.graph_def:
            gd = tf.compat.v1.GraphDef()
            gd.ParseFromString(event.graph_def)
            graphs.append(gd)
    (gd,) = graphs
    written = tf.compat.v1.GraphDef()
    written.ParseFromString(out.read_bytes())
    assert {n.name: n.op for n in gd.node} == {n.name: n.op for n in written.node}
    convs = [n for n in gd.node if n.op == "Conv2D"]
    assert len(convs) == 2 and all(n.attr["T"].type == tf.bfloat16.as_datatype_enum for n in convs)
