"""The HTML report rendered by headless Chromium, and the TensorBoard event file read back."""

import json
import shlex
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
import tensorflow as tf

from amp_rewrite import cli
from amp_rewrite.cli.run import parse
from amp_rewrite.core import hardware
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.tools.verify import verify

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


def _render(page: Path, *, width: int = 1280, height: int = 800, probe: str = "") -> _Dom:
    """Load ``page`` in headless Chromium at ``width`` x ``height`` (a laptop's screen): the DOM
    after its script ran and, where ``probe`` (a script) is given, after it ran too; a
    screenshot beside the page (``.png``)."""
    if probe:   # a copy: the page itself stays as the command wrote it
        text = page.read_text().replace("</body>", f"<script>{probe}</script></body>")
        page = page.with_name(page.stem + "_probed.html")
        page.write_text(text)
    with tempfile.TemporaryDirectory() as profile:
        flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                 "--hide-scrollbars"]
        dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True,
                             text=True, timeout=120)
        shot = page.with_suffix(".png")
        subprocess.run(flags + [f"--screenshot={shot}", page.as_uri()], capture_output=True,
                       timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert shot.stat().st_size > 10_000   # a blank page is a few hundred bytes
    parsed = _Dom()
    parsed.feed(dom.stdout)
    return parsed


# what the first screen must show: each element's box in the viewport and its text, recorded
# on <html> as JSON once the page's own script ran
_FIRST_SCREEN = ("where", "share", "speed", "verdict", "next-command", "plumbing-count",
                 "plumbing-total")
GEOMETRY = """
(function () {
  var boxes = {};
  %s.forEach(function (id) {
    var e = document.getElementById(id);
    if (!e) { return; }
    var r = e.getBoundingClientRect();
    boxes[id] = {left: r.left, top: r.top, right: r.right, bottom: r.bottom,
                 text: e.textContent.replace(/\\s+/g, " ").trim()};
  });
  document.documentElement.dataset.geometry = JSON.stringify(
    {width: window.innerWidth, height: window.innerHeight, boxes: boxes});
})();
""" % json.dumps(_FIRST_SCREEN)


# each bar of the chart: its width by its title's op and precision
BARS = """
(function () {
  var bars = {};
  document.querySelectorAll("svg.chart rect").forEach(function (r) {
    var title = r.querySelector("title");
    if (!title) { return; }
    var words = title.textContent.split(" ");
    bars[words[0] + " " + words[words.length - 1]] = parseFloat(r.getAttribute("width"));
  });
  document.documentElement.dataset.bars = JSON.stringify(bars);
})();
"""


def _geometry(dom: _Dom) -> dict:
    return json.loads(dom.root["data-geometry"])


def _above_the_fold(geometry: dict, ids) -> None:
    """Each element is on the first screen, whole: inside the viewport, nothing to scroll to."""
    for name in ids:
        box = geometry["boxes"][name]
        assert 0 <= box["top"] < box["bottom"] <= geometry["height"], (name, box)
        assert 0 <= box["left"] < box["right"] <= geometry["width"], (name, box)


def _next_command(geometry: dict) -> list[str]:
    """The page's next command, split as a shell would; it must be one the CLI parses."""
    argv = shlex.split(geometry["boxes"]["next-command"]["text"])
    assert argv[0] == "amp-rewrite"
    parse(argv[1:])   # a usage error exits 2: SystemExit fails the test
    return argv[1:]


@needs_chromium
def test_convert_html_report_renders(tmp_path):
    out, page, js = tmp_path / "cnn.pb", tmp_path / "report.html", tmp_path / "report.json"
    assert cli.main([str(EXAMPLE), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--html", str(page), "--report", str(js), "-q"]) == 0
    report = json.loads(js.read_text())
    dom = _render(page, probe=GEOMETRY)
    # the page's script ran to its end (it counts the tables it made sortable)
    assert int(dom.root["data-ready"]) == len(dom.tables) == 5
    kept = [n for n in report["nodes"] if n["precision"] == "float32"]
    listed = dom.tables["kept"] + dom.tables["kept-plumbing"]
    assert sorted(r[0] for r in listed) == sorted(n["name"] for n in kept)
    by_op = {r[0]: r for r in dom.tables["by-op"]}
    plumbing = {r[0]: r for r in dom.tables["plumbing"]}
    assert set(by_op) | set(plumbing) == {n["op"] for n in report["nodes"]}
    assert sum(int(r[-1]) for r in [*by_op.values(), *plumbing.values()]) == len(report["nodes"])
    assert dom.items == report["summary"]["casts_added"]
    assert dom.rects >= len([op for op in by_op if op in MATRIX_OPS])   # a bar per matrix op type
    # every Const is plumbing, folded away: none in the table of ops that compute
    assert "Const" in plumbing and "Const" not in by_op
    # all four matrix ops in bfloat16, by FLOPs and by count, and the cost model's estimate
    geometry = _geometry(dom)
    assert geometry["boxes"]["share"]["text"].startswith("100% of the matrix FLOPs in 16 bits")
    assert "4 of 4 matrix ops" in geometry["boxes"]["share"]["text"]
    # the estimate is what the cost model decided with, not a speed it predicts (issue 41
    # item 2: on whole models it was off by up to a factor of two)
    est = report["estimate"]
    saved = f"saves {est['saved_us'] - est['lost_us']:.2f} µs"
    assert geometry["boxes"]["speed"]["text"].startswith("not predicted")
    assert saved in geometry["boxes"]["speed"]["text"]
    assert "bench measures it" in geometry["boxes"]["speed"]["text"]
    # whose rates: the CPU the cost table was measured on, and whether it is this one
    costs = report["cost_model"]["costs"]
    assert f"measured on {costs['cpu']}" in geometry["boxes"]["speed"]["text"]
    assert ("not on this CPU" in geometry["boxes"]["speed"]["text"]) == (costs["table"] != "measured")
    assert _next_command(geometry) == ["verify", str(EXAMPLE), str(out)]


@needs_chromium
def test_the_share_in_16_bits_is_of_the_matrix_flops_not_of_the_ops(tmp_path):
    """One big convolution kept float32 (--keep) of four matrix ops: three of four ops run in
    bfloat16, but a ninth of the FLOPs; the page says the FLOPs' share first, the count beside
    it, and lists the kept convolution first."""
    out, page, js = tmp_path / "cnn.pb", tmp_path / "report.html", tmp_path / "report.json"
    assert cli.main([str(EXAMPLE), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--min-matrix-intensity", "0", "--keep", "block2/conv",
                     "--html", str(page), "--report", str(js), "-q"]) == 0
    matrix = [n for n in json.loads(js.read_text())["nodes"] if n["op"] in MATRIX_OPS]
    low = sum(n["flops"] for n in matrix if n["precision"] == "bfloat16")
    share = 100 * low / sum(n["flops"] for n in matrix)
    assert 5 < share < 50   # far from the ops' 75%
    dom = _render(page, probe=GEOMETRY + BARS)
    text = _geometry(dom)["boxes"]["share"]["text"]
    assert text.startswith(f"{share:.0f}% of the matrix FLOPs in 16 bits")
    assert "3 of 4 matrix ops in 16 bits" in text
    assert dom.tables["kept"][0][:3] == ["block2/conv", "Conv2D", "user_keep"]
    # the chart's bars are as long as their FLOPs: Conv2D's float32 part (the kept
    # convolution) against its bfloat16 part (the other), not one op against one
    bars = json.loads(dom.root["data-bars"])
    flops = {p: sum(n["flops"] for n in matrix if n["op"] == "Conv2D" and n["precision"] == p)
             for p in ("float32", "bfloat16")}
    assert bars["Conv2D: float32"] / bars["Conv2D: bfloat16"] == pytest.approx(
        flops["float32"] / flops["bfloat16"], rel=0.05)


@needs_chromium
def test_verify_html_report_renders(tmp_path):
    out, page = tmp_path / "cnn.pb", tmp_path / "verify.html"
    assert cli.main([str(EXAMPLE), "-o", str(out), "-q"]) == 0
    assert cli.main(["verify", str(EXAMPLE), str(out), "--per-node", "--html", str(page), "-q"]) == 0
    dom = _render(page, probe=GEOMETRY)
    assert int(dom.root["data-ready"]) == len(dom.tables)
    (row,) = dom.tables["verify"]
    assert row[0] == "probabilities:0" and float(row[2]) > 0 and row[-1] == "yes"
    ranked = [float(r[4]) for r in dom.tables["per-node"]]
    assert ranked and ranked == sorted(ranked, reverse=True)
    half = [r for r in dom.tables["by-op"] if r[0] == "Conv2D"]
    assert half and int(half[0][-1]) == 2
    # the first screen: the verdict, and bench to run next on the same models
    geometry = _geometry(dom)
    _above_the_fold(geometry, ("where", "share", "verdict", "next-command"))
    assert geometry["boxes"]["verdict"]["text"].startswith("within tolerance")
    assert "float16" in geometry["boxes"]["where"]["text"]
    assert _next_command(geometry) == ["bench", str(EXAMPLE), str(out)]


@needs_chromium
def test_a_failed_verify_says_so_first_and_suggests_tune(tmp_path):
    """Out of tolerance: the verdict is on the first screen, and the next command tunes the
    float32 model for the dtype verify found, to a path beside the converted model; verify had
    no input file, so the command names the one tune needs."""
    out, page = tmp_path / "cnn.pb", tmp_path / "verify.html"
    assert cli.main([str(EXAMPLE), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--min-matrix-intensity", "0", "-q"]) == 0
    assert cli.main(["verify", str(EXAMPLE), str(out), "--rel-l2", "1e-9", "--html", str(page),
                     "-q"]) == 1
    geometry = _geometry(_render(page, probe=GEOMETRY))
    _above_the_fold(geometry, ("where", "verdict", "next-command"))
    assert geometry["boxes"]["verdict"]["text"].startswith("OUT OF TOLERANCE")
    assert "probabilities:0 fails rel_l2" in geometry["boxes"]["verdict"]["text"]
    assert _next_command(geometry) == ["tune", str(EXAMPLE), "-o", str(tmp_path / "cnn_tuned.pb"),
                                       "--target", "bfloat16", "--device", "cpu",
                                       "--inputs", "DATA.npz"]


@needs_chromium
def test_the_tune_page_leads_with_its_verdict_and_suggests_bench(tmp_path):
    """tune --html: the tuned conversion's page, tune's verdict on the first screen, and the
    tuned model timed next, fed the samples it was tuned on."""
    import numpy as np

    data, out, page = tmp_path / "in.npz", tmp_path / "tuned.pb", tmp_path / "tune.html"
    np.savez(data, images=np.random.default_rng(0).normal(size=(16, 8, 8, 1)).astype("float32"))
    assert cli.main(["tune", str(EXAMPLE), "-o", str(out), "--inputs", str(data), "--target",
                     "bfloat16", "--device", "cpu", "--min-matrix-intensity", "0",
                     "--max-trials", "3", "--html", str(page), "-q"]) == 0
    geometry = _geometry(_render(page, probe=GEOMETRY))
    _above_the_fold(geometry, ("where", "share", "verdict", "next-command"))
    # the metric tune scored is the number verify measures on the same sample
    measured = verify(str(EXAMPLE), str(out), inputs=str(data)).outputs[0].rel_l2
    verdict = geometry["boxes"]["verdict"]["text"]
    assert verdict.startswith(f"within tolerance tune, rel_l2 {measured:.3g} against 0.05 on 1 "
                              "sample(s)")
    assert geometry["boxes"]["where"]["text"].startswith("bfloat16 for CPU (level default), tuned here")
    assert _next_command(geometry) == ["bench", str(EXAMPLE), str(out), "--inputs", str(data)]


# ----------------------------------------------------------------- a Keras application
@pytest.fixture(scope="module")
def keras_app(tmp_path_factory):
    """A Keras application as a user has it (MobileNetV2, small), exported with
    ``model.export`` and converted to bfloat16 for this CPU by the command line, as it is: the
    cost model keeps its matrix ops float32 (their variable weights' casts and unfused Relu6,
    tests/test_keras_apps.py), so the page has kept matrix ops to order."""
    import keras

    folder = tmp_path_factory.mktemp("keras_app")
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(alpha=0.35, input_shape=(96, 96, 3), weights=None)
    src, out = folder / "mobilenet_v2", folder / "mobilenet_v2_bf16"
    model.export(str(src), verbose=False)
    page, js = folder / "report.html", folder / "report.json"
    # (its variables kept: a model that only serves is frozen by default, and frozen the cost
    # model paints it; this page is of one with matrix ops kept float32)
    assert cli.main([str(src), "-o", str(out), "--target", "bfloat16", "--device", "cpu",
                     "--no-freeze", "--html", str(page), "--report", str(js), "-q"]) == 0
    return src, out, page, json.loads(js.read_text())


@pytest.fixture(scope="module")
def keras_page(keras_app):
    """The page rendered at 1280 x 800, the first screen's boxes recorded."""
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    return _render(keras_app[2], probe=GEOMETRY)


def test_the_first_screen_says_where_how_much_and_what_next(keras_app, keras_page):
    """At a laptop's 1280 x 800, before any scrolling: the target with what it means on this
    CPU, the share of the matrix FLOPs in 16 bits (as the report's FLOPs add up), the speed,
    and the next command, one the CLI takes, naming the model as given."""
    src, out, _, report = keras_app
    geometry = _geometry(keras_page)
    # headless Chromium's viewport is the window less its own bars, as a laptop's browser is
    assert geometry["width"] == 1280 and 600 <= geometry["height"] <= 800
    _above_the_fold(geometry, ("where", "share", "speed", "next-command"))
    where = geometry["boxes"]["where"]["text"]
    assert where.startswith("bfloat16 for CPU")
    if not hardware.gpu_visible():
        assert hardware.machine_line("bfloat16") in where
    matrix = [n for n in report["nodes"] if n["op"] in MATRIX_OPS]
    low = sum(n["flops"] for n in matrix if n["precision"] == "bfloat16")
    total = sum(n["flops"] for n in matrix)
    assert total and all(n["flops"] for n in matrix)   # every shape known: FLOPs, no guesses
    share = geometry["boxes"]["share"]["text"]
    assert share.startswith(f"{100 * low / total:.0f}% of the matrix FLOPs in 16 bits")
    assert f"of {len(matrix)} matrix ops in 16 bits" in share and "unknown" not in share
    argv = _next_command(geometry)
    # the Keras export's batch norms read variables: frozen they fold (the freezing hint),
    # else the cost model kept its matrix work float32 and --measure times it painted whole
    frozen = report.get("freezing", {}).get("summary", "").startswith("convert with --freeze")
    assert argv[:3] == [str(src), "-o", str(out)] and ("--freeze" if frozen else "--measure") in argv


def test_the_plumbing_count_is_the_plumbing_sections(keras_app, keras_page):
    """The count on the first screen is the folded section's, node for node: the Consts,
    Identity, variables and nodes without a float type it lists (not the report's count of
    nodes without a float type, which leaves the variables out)."""
    _, _, _, report = keras_app
    boxes = _geometry(keras_page)["boxes"]
    section = sum(int(row[-1]) for row in keras_page.tables["plumbing"])
    assert int(boxes["plumbing-count"]["text"]) == int(boxes["plumbing-total"]["text"]) == section
    ops = {row[0] for row in keras_page.tables["plumbing"]}
    assert {"Const", "VarHandleOp", "ReadVariableOp"} <= ops
    assert not ops & {row[0] for row in keras_page.tables["by-op"] if row[1] == "matrix"}
    computing = sum(int(row[-1]) for row in keras_page.tables["by-op"])
    assert computing + section == report["summary"]["nodes_total"]


ACTED_ON = ("cost", "range", "deny_list", "deny_propagated", "user_keep", "update")


def test_the_kept_table_lists_the_matrix_ops_then_what_a_user_acts_on(keras_app, keras_page):
    """Matrix ops first, the most FLOPs first; then the nodes kept for a reason a user acts on
    (cost, range, deny, an override, an update); then the rest. Plumbing is not among them."""
    _, _, _, report = keras_app
    nodes = {n["name"]: n for n in report["nodes"]}
    rows = keras_page.tables["kept"]
    ranks = [0 if row[1] in MATRIX_OPS else 1 if row[2] in ACTED_ON else 2 for row in rows]
    assert ranks == sorted(ranks) and {0, 1, 2} <= set(ranks)
    flops = [nodes[row[0]]["flops"] for row, rank in zip(rows, ranks) if rank == 0]
    assert flops == sorted(flops, reverse=True)
    assert len(flops) == report["summary"]["matrix_total"]   # the cost model kept them all
    assert not {row[1] for row in rows} & {"Const", "Identity", "VarHandleOp", "ReadVariableOp"}


FILTER = """
(function () {
  var kind = document.getElementById("kept-kind"), words = document.getElementById("kept-filter");
  function visible() {
    return Array.from(document.querySelectorAll("table.kept tbody tr"))
      .filter(function (r) { return !r.hidden; }).map(function (r) { return r.cells[0].textContent; });
  }
  var seen = {};
  kind.value = "matrix"; kind.dispatchEvent(new Event("change")); seen.matrix = visible();
  kind.value = ""; words.value = "Relu6 cost"; words.dispatchEvent(new Event("input"));
  seen.words = visible();
  document.documentElement.dataset.filtered = JSON.stringify(seen);
})();
"""


@needs_chromium
def test_the_kept_table_filters_by_kind_and_by_words(keras_app):
    """The page's own script: choosing "matrix ops" leaves the matrix rows; words leave the rows
    holding every one of them."""
    _, _, page, report = keras_app
    dom = _render(page, probe=FILTER)
    seen = json.loads(dom.root["data-filtered"])
    rows = dom.tables["kept"]
    assert seen["matrix"] == [r[0] for r in rows if r[1] in MATRIX_OPS] and seen["matrix"]
    wanted = [r[0] for r in rows if all(w in " ".join(r).lower() for w in ("relu6", "cost"))]
    assert seen["words"] == wanted and 0 < len(wanted) < len(rows)


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
