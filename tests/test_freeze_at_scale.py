"""``--freeze`` at any size (issue 42): the variables past what frozen graphs hold as Consts
(``amp_rewrite.io.frozen.CONST_BYTES``) stay variables of the output SavedModel, stored in the
dtype painting picks (bfloat16 where only bfloat16 matrix ops read them, so nothing is cast per
run; float32 where a float32 op reads them, a table a Gather reads), written by TensorFlow's
saver; the rest is frozen, folded and painted as ever.

The models are real: an embedding table read by a Gather, averaged and fed to ReLU layers, as
the issue's. Most tests lower the bound (a few hundred kilobytes) so a small model takes the
path a model past protobuf's 2 GB takes; one builds a table just past 2 GiB for real
(:func:`test_a_table_past_protobufs_2_gb_freezes_in_bounded_memory`, about a minute and 6 GB
free: skipped where the machine has less, saying so).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from graphs import rel_l2
from refusals import run_cli
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.python.training import py_checkpoint_reader

from amp_rewrite import convert_file
from amp_rewrite.core.ops import MATRIX_OPS
from amp_rewrite.io import frozen
from amp_rewrite.schema.functiondef import reachable

BF16 = ["--target", "bfloat16", "--device", "cpu"]
ROWS, DIM, WIDTH = 5000, 64, 256
TESTS = Path(__file__).resolve().parent


def _embedding_model(path: Path, rows=ROWS, dim=DIM, width=WIDTH, layers=3, signatures=1):
    """ids [None, 8] -> the rows of a table, averaged -> ``layers`` ReLU layers -> 10 logits."""
    rng = np.random.default_rng(0)
    m = tf.Module()
    m.table = tf.Variable(rng.normal(0, 1, (rows, dim)).astype(np.float32))
    m.kernels = [tf.Variable(rng.normal(0, (2 / (dim if i == 0 else width)) ** 0.5,
                                        (dim if i == 0 else width, width)).astype(np.float32))
                 for i in range(layers)]
    m.biases = [tf.Variable(rng.normal(0, 0.1, width).astype(np.float32)) for _ in range(layers)]
    m.head = tf.Variable(rng.normal(0, width ** -0.5, (width, 10)).astype(np.float32))

    def forward(ids):
        h = tf.reduce_mean(tf.gather(m.table, ids), axis=1)
        for k, b in zip(m.kernels, m.biases):
            h = tf.nn.relu(tf.matmul(h, k) + b)
        return tf.matmul(h, m.head)

    spec = [tf.TensorSpec([None, 8], tf.int32, name="ids")]
    m.serve = tf.function(lambda ids: {"logits": forward(ids)}, input_signature=spec)
    functions = {"serving_default": m.serve}
    if signatures > 1:   # a second signature reading the same variables
        m.scores = tf.function(lambda ids: {"scores": tf.nn.softmax(forward(ids))},
                               input_signature=spec)
        functions["scores"] = m.scores
    tf.saved_model.save(m, str(path), signatures=functions)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    ids = np.random.default_rng(1).integers(0, ROWS, (32, 8)).astype(np.int32)
    np.savez(root / "ids.npz", ids=ids)
    return _embedding_model(root / "fp32"), root / "ids.npz", ids


def _kernel_bytes():
    return WIDTH * WIDTH * 4


def _checkpoint_dtypes(folder: Path) -> dict[tuple[int, ...], list[str]]:
    """The variables the SavedModel's checkpoint holds: shape -> their dtypes, sorted."""
    reader = py_checkpoint_reader.NewCheckpointReader(str(folder / "variables" / "variables"))
    shapes, out = reader.get_variable_to_shape_map(), {}
    for key, dtype in reader.get_variable_to_dtype_map().items():
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            out.setdefault(tuple(shapes[key]), []).append(dtype.name)
    return {k: sorted(v) for k, v in out.items()}


def _served_nodes(folder: Path, key="serving_default") -> list:
    """The nodes of the function bodies signature ``key`` of the SavedModel runs."""
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((folder / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0].graph_def
    nodes = {n.name: n for n in graph.node}
    called = [nodes[i.name.split(":")[0]]
              for i in saved.meta_graphs[0].signature_def[key].outputs.values()]
    bodies = {f.signature.name: f for f in graph.library.function}
    return [n for name in reachable(called, graph.library) for n in bodies[name].node_def]


def _origin(nodes: dict, ref: str):
    """The node whose output ``ref`` (a function body's input) is, through Identity nodes."""
    node = nodes[ref.lstrip("^").split(":")[0]]
    while node.op == "Identity":
        node = nodes[node.input[0].split(":")[0]]
    return node


def _logits(folder: Path, ids: np.ndarray, key="serving_default", out="logits") -> np.ndarray:
    return tf.saved_model.load(str(folder)).signatures[key](ids=tf.constant(ids))[out].numpy()


def test_variables_past_the_bound_stay_variables_stored_as_painted(model, tmp_path, capsys,
                                                                   monkeypatch):
    """With room for the biases, the head and the first two kernels as Consts, the last
    kernel and the table stay variables: the kernel, which only a bfloat16 MatMul reads,
    stored in bfloat16 (nothing cast per run), the table, which a float32 Gather reads, in
    float32; the output restores them from its own variables/, serves the same signature and
    gives FP32's logits to bfloat16's precision."""
    src, feeds, ids = model
    monkeypatch.setattr(frozen, "CONST_BYTES", 2 * _kernel_bytes() + 64 * 1024)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, [src, "-o", out, "--freeze", *BF16, "--min-matrix-intensity",
                                         "0", "--report", tmp_path / "r.json"])
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    kept = {k["name"]: k for k in report["freeze"]["kept"]}
    assert {name: k["stored"] for name, k in kept.items()} == {
        "kernels/2": ["bfloat16"], "table": ["float32"]}
    assert report["freeze"]["variables"] == 6   # 3 biases, 2 kernels, the head: Consts
    assert "2 variables (1.5 MiB) kept as variables" in stdout and "1 in bfloat16, 1 in float32" in stdout
    # painting weighed and stored them as it stores Consts, each with its reason
    codes = {n["code"] for n in report["nodes"] if n["op"] == "Placeholder" and n["name"] != "ids"}
    assert codes == {"variable_stored", "variable"}
    assert report["summary"]["matrix_converted"] == report["summary"]["matrix_total"] == 4
    # written by TensorFlow's saver, in the dtypes painted
    assert _checkpoint_dtypes(out) == {(WIDTH, WIDTH): ["bfloat16"], (ROWS, DIM): ["float32"]}
    # nothing cast per run: one MatMul reads a bfloat16 variable as it is (through Identity
    # only), the other three bfloat16 Consts; the Gather reads the float32 table
    nodes = {n.name: n for n in _served_nodes(out)}
    reads = sorted(tf.as_dtype(n.attr["dtype"].type).name for n in nodes.values()
                   if n.op == "ReadVariableOp")
    assert reads == ["bfloat16", "float32"]
    weights = [_origin(nodes, n.input[1]) for n in nodes.values() if n.op == "MatMul"]
    assert sorted((w.op, tf.as_dtype(w.attr["dtype"].type).name) for w in weights) == [
        ("Const", "bfloat16"), ("Const", "bfloat16"), ("Const", "bfloat16"),
        ("ReadVariableOp", "bfloat16")]
    (gather,) = [n for n in nodes.values() if n.op == "GatherV2"]
    table = _origin(nodes, gather.input[0])
    assert (table.op, table.attr["dtype"].type) == ("ReadVariableOp", tf.float32.as_datatype_enum)
    # the SavedModel holds each large Const once, written after TensorFlow's save, and a
    # fingerprint of the saved_model.pb that stands
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((out / "saved_model.pb").read_bytes())
    library = saved.meta_graphs[0].graph_def.library.function
    consts = [n for f in library for n in f.node_def
              if n.op == "Const" and len(n.attr["value"].tensor.tensor_content) >= 1 << 16]
    assert sorted(tuple(d.size for d in n.attr["value"].tensor.tensor_shape.dim) for n in consts) == [
        (WIDTH, WIDTH)]
    assert not [n for f in library for n in f.node_def if "_amp_hollow" in n.attr]
    from tensorflow.core.protobuf import fingerprint_pb2
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
    written, again = fingerprint_pb2.FingerprintDef(), fingerprint_pb2.FingerprintDef()
    written.ParseFromString((out / "fingerprint.pb").read_bytes())
    again.ParseFromString(fingerprinting.CreateFingerprintDef(str(out)))
    assert written.saved_model_checksum == again.saved_model_checksum != 0
    # it serves the same signature, restoring its own variables, with FP32's logits
    served = tf.saved_model.load(str(out))
    assert {v.dtype.name for v in served.amp_variables} == {"bfloat16", "float32"}
    want, got = _logits(src, ids), _logits(out, ids)
    assert rel_l2(got, want) < 2e-2 and (got.argmax(1) == want.argmax(1)).mean() >= 0.9
    code, _, err = run_cli(capsys, ["verify", src, out, "--inputs", feeds])
    assert code == 0, err


def test_the_largest_variables_are_kept_first_and_each_signature_counts(model, tmp_path,
                                                                        monkeypatch):
    """What stays a variable is chosen by size, the smallest made Consts first, each counted
    once for every signature that reads it (two signatures over the same weights hold two
    frozen graphs); with room for everything nothing is kept, as before."""
    src, _, ids = model
    two = _embedding_model(tmp_path / "two", signatures=2)
    room = 2 * _kernel_bytes() + 100 * 1024   # one signature's Consts but the table fit
    monkeypatch.setattr(frozen, "CONST_BYTES", room)
    one = convert_file(src, tmp_path / "a", freeze=True, min_matrix_intensity=0, target="bfloat16",
                       device="cpu")
    assert [k["name"] for k in one.extra["freeze"]["kept"]] == ["table"]
    both = convert_file(two, tmp_path / "b", freeze=True, min_matrix_intensity=0, target="bfloat16",
                        device="cpu")
    assert [k["name"] for k in both.extra["freeze"]["kept"]] == [
        "kernels/1", "kernels/2", "table"]
    assert both.extra["freeze"]["graphs"] == [["serving_default"], ["scores"]]
    # the two signatures' graphs read the same kept variables: each written once
    assert _checkpoint_dtypes(tmp_path / "b") == {(WIDTH, WIDTH): ["bfloat16", "bfloat16"],
                                                  (ROWS, DIM): ["float32"]}
    want = tf.nn.softmax(_logits(src, ids)).numpy()
    assert rel_l2(_logits(tmp_path / "b", ids, "scores", "scores"), want) < 2e-2
    monkeypatch.setattr(frozen, "CONST_BYTES", 1 << 40)
    everything = convert_file(src, tmp_path / "c", freeze=True, target="bfloat16", device="cpu")
    assert everything.extra["freeze"]["kept"] == [] and "kept as variables" not in (
        everything.extra["freeze"]["summary"])
    assert _checkpoint_dtypes(tmp_path / "c") == {}


def test_kept_variables_are_weighed_as_stored_not_as_cast_every_run(tmp_path, monkeypatch):
    """The cost model weighs a kept variable as a Const: stored in the dtype painted, not cast
    on every run. At a batch of one, the SavedModel's conversion keeps its two 1024-wide
    MatMuls float32 for their weights' casts (code cost); frozen with every variable kept,
    they go to bfloat16, their weights stored so."""
    rng = np.random.default_rng(4)
    m = tf.Module()
    m.k = [tf.Variable(rng.normal(0, 1024 ** -0.5, (1024, 1024)).astype(np.float32))
           for _ in range(2)]
    m.serve = tf.function(lambda x: {"y": tf.matmul(tf.nn.relu(tf.matmul(x, m.k[0])), m.k[1])},
                          input_signature=[tf.TensorSpec([None, 1024], tf.float32, name="x")])
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.serve})
    as_is = convert_file(tmp_path / "src", tmp_path / "as_is", freeze=False, target="bfloat16",
                         device="cpu")
    assert as_is.summary()["matrix_converted"] == 0
    assert as_is.summary()["kept_float32_by_reason"]["cost"] > 0
    monkeypatch.setattr(frozen, "CONST_BYTES", 0)
    kept = convert_file(tmp_path / "src", tmp_path / "kept", freeze=True, target="bfloat16",
                        device="cpu")
    assert kept.extra["freeze"]["variables"] == 0
    assert kept.summary()["matrix_converted"] == kept.summary()["matrix_total"] == 2
    assert "cost" not in kept.summary()["kept_float32_by_reason"]
    assert [k["stored"] for k in kept.extra["freeze"]["kept"]] == [["bfloat16"], ["bfloat16"]]
    assert _checkpoint_dtypes(tmp_path / "kept") == {(1024, 1024): ["bfloat16", "bfloat16"]}


def test_a_kept_variable_past_float16s_range_stays_float32(tmp_path, monkeypatch):
    """For float16, a kept variable is stored in it only where its values fit (the largest
    finite magnitude, measured a slice at a time): one past 65504 stays float32, said in a
    warning, as a Const would."""
    rng = np.random.default_rng(2)
    m = tf.Module()
    m.small = tf.Variable(rng.normal(0, 0.1, (128, 128)).astype(np.float32))
    m.large = tf.Variable(rng.normal(0, 0.1, (128, 128)).astype(np.float32))
    m.large[3, 5].assign(1e5)
    m.large[4, 6].assign(np.inf)   # not finite: not what decides
    m.serve = tf.function(lambda x: {"y": tf.matmul(tf.matmul(x, m.small), m.large)},
                          input_signature=[tf.TensorSpec([None, 128], tf.float32, name="x")])
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.serve})
    monkeypatch.setattr(frozen, "CONST_BYTES", 0)
    report = convert_file(tmp_path / "src", tmp_path / "out", freeze=True, target="float16")
    stored = {k["name"]: k["stored"] for k in report.extra["freeze"]["kept"]}
    assert stored == {"small": ["float16"], "large": ["float32"]}
    assert any("variable `" in w and "beyond float16's range" in w for w in report.warnings)
    assert _checkpoint_dtypes(tmp_path / "out") == {(128, 128): ["float16", "float32"]}


def _enough_room(memory: int, disk: int, folder: Path) -> str | None:
    """Why the machine cannot run the 2 GB test (None: it can): free memory and disk."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if available < memory:
        return f"needs {memory >> 30} GiB of free memory, the machine has {available / (1 << 30):.1f}"
    free = shutil.disk_usage(folder).free
    if free < disk:
        return f"needs {disk >> 30} GiB of free disk, {folder} has {free / (1 << 30):.1f}"
    return None


_BUILD = """
import sys
import numpy as np, tensorflow as tf
rows, dim, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
m = tf.Module()
m.table = tf.Variable(tf.zeros([rows, dim]))   # zeros, then the rows the test reads
m.table[:4096].assign(tf.random.stateless_normal([4096, dim], [1, 2]))
m.kernel = tf.Variable(tf.random.stateless_normal([dim, 1024], [3, 4], stddev=dim ** -0.5))
m.head = tf.Variable(tf.random.stateless_normal([1024, 10], [5, 6], stddev=1024 ** -0.5))
@tf.function(input_signature=[tf.TensorSpec([None, 8], tf.int32, name="ids")])
def serve(ids):
    h = tf.nn.relu(tf.matmul(tf.reduce_mean(tf.gather(m.table, ids), axis=1), m.kernel))
    return {"logits": tf.matmul(h, m.head)}
m.serve = serve
tf.saved_model.save(m, path, signatures={"serving_default": serve})
"""

_RUN = """
import sys
import numpy as np, tensorflow as tf
ids = np.load(sys.argv[2])["ids"]
served = tf.saved_model.load(sys.argv[1])
np.save(sys.argv[3], served.signatures["serving_default"](ids=tf.constant(ids))["logits"].numpy())
"""


def _python(code: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_table_past_protobufs_2_gb_freezes_in_bounded_memory(tmp_path):
    """One table of 2 GiB and 8 KiB, past what one protobuf message holds (2^31 - 1 bytes),
    which TensorFlow's freezing refused after minutes: --freeze keeps it a float32 variable
    (a Gather reads it), freezes the rest, and the output serves FP32's logits. Built, converted
    and served each in a process of its own (about a minute; 6 GB of memory and 5 GB of disk,
    skipped where the machine lacks them): the conversion's peak above a warmed-up process is
    at most twice the weights' bytes (tests/freeze_memory_worker.py)."""
    why = _enough_room(6 << 30, 5 << 30, tmp_path)
    if why:
        pytest.skip(f"the 2 GB SavedModel test {why}")
    rows, dim = (1 << 20) + 4, 512
    src, out = tmp_path / "fp32", tmp_path / "out"
    _python(_BUILD, rows, dim, src)
    weights = sum(f.stat().st_size for f in (src / "variables").glob("variables.data-*"))
    assert rows * dim * 4 > (1 << 31) - 1 and weights > rows * dim * 4
    small = _embedding_model(tmp_path / "warm_up", rows=64, width=32, layers=1)
    done = subprocess.run([sys.executable, str(TESTS / "freeze_memory_worker.py"), small, src,
                           out, tmp_path / "r.json"], capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    peak = (memory["peak_kib"] - memory["base_kib"]) * 1024
    assert peak <= 2 * weights, f"{peak / (1 << 30):.2f} GiB above the base for {weights / (1 << 30):.2f} GiB"
    report = json.loads((tmp_path / "r.json").read_text())
    assert [(k["name"], k["stored"]) for k in report["freeze"]["kept"]] == [("table", ["float32"])]
    assert report["summary"]["matrix_converted"] == 2
    ids = np.random.default_rng(3).integers(0, 4096, (16, 8)).astype(np.int32)
    np.savez(tmp_path / "ids.npz", ids=ids)
    _python(_RUN, src, tmp_path / "ids.npz", tmp_path / "want.npy")
    _python(_RUN, out, tmp_path / "ids.npz", tmp_path / "got.npy")
    want, got = np.load(tmp_path / "want.npy"), np.load(tmp_path / "got.npy")
    assert rel_l2(got, want) < 2e-2
