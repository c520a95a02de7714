"""Range-aware precision: ``--calibration`` runs the FP32 model on data and keeps float32 (code
``range``) exactly the nodes that compute or read a tensor within the headroom of float16's
largest value, in every format (GraphDef, MetaGraph with its checkpoint, SavedModel function
bodies); ``amp-rewrite ranges`` lists the tensors closest to the limit, largest first.

Each model is a small MLP whose middle layer ``loud`` has large weights: on unit data its output
reaches a few thousand (within 65504 / 32 = 2047 of the limit, far from overflowing), on data
100 times smaller a few tens; its readers are ``relu2`` and then ``dense3``, whose small weights
bring the values back to order one.
"""

import json
import math

import numpy as np
import pytest
import tensorflow as tf
from refusals import assert_refused, run_cli, snapshot

from amp_rewrite import cli, convert
from amp_rewrite.cli import run as cli_run
from amp_rewrite.conversion.pipeline import convert_file
from amp_rewrite.core.dtypes import BFLOAT16, HALF, HEADROOM, LARGEST
from amp_rewrite.io.load import Model
from amp_rewrite.tools.ranges import calibrate
from amp_rewrite.tools.verify import format_result, verify

v1 = tf.compat.v1
LOUD = {"loud", "relu2", "dense3"}      # produce or read loud:0 / relu2:0
LIMIT = LARGEST[HALF] / HEADROOM


def _weights(seed=0):
    r = np.random.default_rng(seed)
    return (r.normal(0, 0.3, (16, 32)).astype(np.float32),
            (r.normal(0, 0.3, (32, 32)) * 1000).astype(np.float32),
            (r.normal(0, 0.3, (32, 4)) / 1000).astype(np.float32))


def _layers(x, w1, w2, w3):
    h = tf.nn.relu(tf.matmul(x, w1, name="dense1"), name="relu1")
    h = tf.nn.relu(tf.matmul(h, w2, name="loud"), name="relu2")
    return tf.identity(tf.matmul(h, w3, name="dense3"), name="out")


def _data(scale, seed=1, rows=16):
    return {"x": (np.random.default_rng(seed).standard_normal((rows, 16)) * scale).astype(np.float32)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranges")
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        _layers(x, *(tf.constant(w) for w in _weights()))
    (folder / "mlp.pb").write_bytes(g.as_graph_def().SerializeToString())
    np.savez(folder / "loud.npz", **_data(1.0))
    np.savez(folder / "quiet.npz", **_data(0.01))
    np.savez(folder / "huge.npz", **_data(100.0, seed=2))   # deployed: past 65504 in loud
    np.savez(folder / "typo.npz", X=_data(1.0)["x"])
    return folder


def _range_nodes(report) -> set[str]:
    return {n["name"] if isinstance(n, dict) else n.name for n in
            (report["nodes"] if isinstance(report, dict) else report.nodes)
            if (n["code"] if isinstance(n, dict) else n.code) == "range"}


def test_calibration_keeps_exactly_the_nodes_near_the_limit(files, capsys):
    out = files / "cal.pb"
    assert cli.main([str(files / "mlp.pb"), "-o", str(out), "--calibration",
                     str(files / "loud.npz"), "--report", str(files / "cal.json")]) == 0
    said = capsys.readouterr().out
    assert "calibration: 1 sample(s)" in said and "3 nodes kept float32 (code range)" in said
    report = json.loads((files / "cal.json").read_text())
    assert _range_nodes(report) == LOUD
    precision = {n["name"]: n["precision"] for n in report["nodes"]}
    assert precision["dense1"] == precision["relu1"] == "float16"   # upstream: the usual rules
    assert {precision[n] for n in LOUD} == {"float32"}
    assert report["calibration"]["kept"] == 3 and report["calibration"]["limit"] == LIMIT
    # the reason names the tensor, its maximum (the float32 model's, computed here) and the limit
    want = float(np.abs(np.maximum(np.maximum(_data(1.0)["x"] @ _weights()[0], 0)
                                   @ _weights()[1], 0)).max())
    assert 0.5 * LARGEST[HALF] / HEADROOM < want < LARGEST[HALF] / 4
    loud = next(n for n in report["nodes"] if n["name"] == "loud")
    assert f"`loud:0` reached max |x| {want:.4g}" in loud["reason"]
    assert f"(limit {LIMIT:.4g})" in loud["reason"]
    dense3 = next(n for n in report["nodes"] if n["name"] == "dense3")
    assert "its input `relu2:0`" in dense3["reason"]
    # and on data past float16's range the calibrated model stays finite; the plain one does not
    plain = files / "plain.pb"
    assert cli.main([str(files / "mlp.pb"), "-o", str(plain), "-q"]) == 0
    huge = str(files / "huge.npz")
    assert verify(files / "mlp.pb", out, inputs=huge).ok
    assert math.isinf(verify(files / "mlp.pb", plain, inputs=huge).outputs[0].rel_l2)


def test_without_the_flag_or_on_quiet_data_nothing_is_kept(files):
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString((files / "mlp.pb").read_bytes())
    _, plain = convert(graph_def)
    assert not _range_nodes(plain) and "calibration" not in plain.to_dict()
    assert {plain.node(n).precision for n in ("loud", "relu2", "dense3")} == {"float16"}
    quiet = calibrate(Model.of_graph_def(graph_def), [str(files / "quiet.npz")])
    _, report = convert(graph_def, calibration=quiet.maxima())
    assert not _range_nodes(report) and report.extra["calibration"]["kept"] == 0
    # a smaller headroom puts the limit above the loud data's maximum (about 1e3 to 16376)
    loud = calibrate(Model.of_graph_def(graph_def), [str(files / "loud.npz")])
    _, report = convert(graph_def, calibration=loud.maxima(), headroom=4)
    assert not _range_nodes(report)
    _, report = convert(graph_def, calibration=loud.maxima())
    assert _range_nodes(report) == LOUD


def test_explain_prints_the_observed_maximum(files, capsys):
    assert cli.main(["explain", str(files / "mlp.pb"), "relu2", "--calibration",
                     str(files / "loud.npz")]) == 0
    said = capsys.readouterr().out
    assert "relu2 (Relu): kept float32: calibration: its output `relu2:0` reached max |x|" in said
    assert f"float16's largest value 65504 (limit {LIMIT:.4g})" in said


def test_a_force_lowp_override_lifts_range(files, tmp_path):
    rules = tmp_path / "force.toml"
    rules.write_text('[[override]]\nglob = "loud"\naction = "force_lowp"\n')
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString((files / "mlp.pb").read_bytes())
    found = calibrate(Model.of_graph_def(graph_def), [str(files / "loud.npz")])
    _, report = convert(graph_def, calibration=found.maxima(), rules=[str(rules)])
    assert report.node("loud").code == "user_force"
    assert _range_nodes(report) == LOUD - {"loud"}


def test_metagraph_calibrates_with_its_checkpoint(tmp_path):
    """The variables' initializers give small weights; the checkpoint holds the loud ones: only
    a calibration run that restores it finds the nodes near the limit."""
    w1, w2, w3 = _weights()
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        ws = [v1.get_variable(f"w{i}", w.shape, initializer=v1.zeros_initializer(),
                              use_resource=True) for i, w in enumerate((w1, w2, w3), 1)]
        out = _layers(x, *ws)
        sig = v1.saved_model.predict_signature_def({"x": x}, {"out": out})
        saver = v1.train.Saver()
        meta = v1.train.export_meta_graph(graph=g)
        with v1.Session(graph=g) as sess:
            for var, value in zip(ws, (w1, w2, w3)):
                var.load(value, sess)
            ckpt = saver.save(sess, str(tmp_path / "ckpt"))
    meta.signature_def["serving_default"].CopyFrom(sig)
    (tmp_path / "m.meta").write_bytes(meta.SerializeToString())
    np.savez(tmp_path / "loud.npz", **_data(1.0))
    report = convert_file(tmp_path / "m.meta", tmp_path / "m16.meta",
                          calibration=calibrate(tmp_path / "m.meta", [str(tmp_path / "loud.npz")],
                                                checkpoint=ckpt).maxima())
    assert _range_nodes(report) == LOUD
    assert cli.main([str(tmp_path / "m.meta"), "-o", str(tmp_path / "cli.meta"), "--calibration",
                     str(tmp_path / "loud.npz"), "--checkpoint", ckpt, "--report",
                     str(tmp_path / "cli.json"), "-q"]) == 0
    assert _range_nodes(json.loads((tmp_path / "cli.json").read_text())) == LOUD
    untrained = calibrate(tmp_path / "m.meta", [str(tmp_path / "loud.npz")])
    assert untrained.tensors["loud:0"].max_abs == 0.0


class _Model(tf.Module):
    """The MLP as a SavedModel: the loud layer in a function of its own, which the signature's
    function calls."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = (tf.Variable(w) for w in _weights())

    @tf.function
    def block(self, h):
        return tf.nn.relu(tf.matmul(h, self.w2, name="loud"), name="relu2")

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    def __call__(self, x):
        h = tf.nn.relu(tf.matmul(x, self.w1, name="dense1"), name="relu1")
        return {"out": tf.matmul(self.block(h), self.w3, name="dense3")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    module = _Model()
    tf.saved_model.save(module, str(folder / "fp32"),
                        signatures=module.__call__.get_concrete_function())
    np.savez(folder / "loud.npz", **_data(1.0))
    np.savez(folder / "quiet.npz", **_data(0.01))
    return folder


def test_savedmodel_function_bodies(saved):
    assert cli.main([str(saved / "fp32"), "-o", str(saved / "cal"), "--calibration",
                     str(saved / "loud.npz"), "--report", str(saved / "cal.json"), "-q"]) == 0
    report = json.loads((saved / "cal.json").read_text())
    kept = _range_nodes(report)
    functions = {name.rsplit("/", 1)[0] for name in kept}
    block = {f for f in functions if f.startswith("__inference_block_")}
    caller = {f for f in functions if f.startswith("__inference___call___")}
    # loud and relu2 in the block's body (its result passing through its Identity), dense3 in
    # the function that calls it: in the signature's trace of each, and in the restored
    # object's traces of the same methods, which the signature does not run
    assert block and caller and functions == block | caller
    assert {n for n in kept if n.rsplit("/", 1)[0] in block} == \
        {f"{f}/{n}" for f in block for n in ("loud", "relu2", "Identity")}
    assert {n for n in kept if n.rsplit("/", 1)[0] in caller} == {f"{f}/dense3" for f in caller}
    assert {p["precision"] for p in report["nodes"] if p["name"].endswith("/dense1")} == {"float16"}
    assert cli.main([str(saved / "fp32"), "-o", str(saved / "quiet"), "--calibration",
                     str(saved / "quiet.npz"), "--report", str(saved / "quiet.json"), "-q"]) == 0
    assert not _range_nodes(json.loads((saved / "quiet.json").read_text()))
    # on data past float16's range, both ways of calling the calibrated model stay finite
    huge = tf.constant(_data(100.0, seed=2)["x"])
    want = tf.saved_model.load(str(saved / "fp32"))(huge)["out"].numpy()
    for folder, finite in (("cal", True), ("quiet", False)):
        loaded = tf.saved_model.load(str(saved / folder))
        for got in (loaded(huge)["out"], loaded.signatures["serving_default"](x=huge)["out"]):
            got = got.numpy().astype(np.float64)
            assert np.isfinite(got).all() == finite, folder
            assert not finite or np.abs(got - want).max() < 1e-2 * np.abs(want).max()


def test_ranges_lists_the_largest_first(files, capsys, tmp_path):
    assert cli.main(["ranges", str(files / "mlp.pb"), "--inputs", str(files / "loud.npz"),
                     "--inputs", str(files / "quiet.npz"), "--top", "4",
                     "--json", str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("10 float tensors over 2 sample(s); 2 within the headroom 32")
    rows = [line for line in lines[2:6]]
    assert [row.split()[-1] for row in rows[:2]] == ["loud:0", "relu2:0"]
    assert all(row.startswith("*") for row in rows[:2]) and not rows[2].startswith("*")
    ratios = [float(row.lstrip("* ").split()[0]) for row in rows]
    assert ratios == sorted(ratios, reverse=True) and len(rows) == 4
    data = json.loads((tmp_path / "r.json").read_text())
    maxima = [t["max_abs"] for t in data["tensors"]]
    assert maxima == sorted(maxima, reverse=True) and len(maxima) == 10
    x = next(t for t in data["tensors"] if t["tensor"] == "x:0")
    assert x["max_abs"] == float(np.abs(_data(1.0)["x"]).max())       # the larger sample's
    assert x["values"] == 2 * 16 * 16 and x["ratio"] == x["max_abs"] / 65504


def test_verify_per_node_names_the_largest_tensors(files):
    result = verify(files / "mlp.pb", files / "mlp.pb", inputs=str(files / "loud.npz"), nodes=True)
    assert [t.tensor for t in result.ranges[:2]] == ["loud:0", "relu2:0"] and len(result.ranges) == 3
    assert "in the original (amp-rewrite ranges lists more): loud:0 (MatMul) max |x| 3.62e+03" \
        in format_result(result)
    assert result.to_dict()["ranges"][0]["within_headroom"] is True


def test_bfloat16s_range_is_named_for_bfloat16(files, capsys, tmp_path):
    """ranges --target bfloat16 and verify --per-node of a bfloat16 model measure against
    bfloat16's largest value (3.39e38), never float16's 65504."""
    top = LARGEST[BFLOAT16]
    assert cli.main(["ranges", str(files / "mlp.pb"), "--inputs", str(files / "loud.npz"),
                     "--target", "bfloat16", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        f"10 float tensors over 1 sample(s); 0 within the headroom 32 of bfloat16's largest "
        f"value {top:.6g} ")
    assert "65504" not in out and "float16's" not in out.replace("bfloat16's", "")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["target"] == "bfloat16" and data["largest"] == top
    loud = next(t for t in data["tensors"] if t["tensor"] == "loud:0")
    assert loud["ratio"] == loud["max_abs"] / top and loud["within_headroom"] is False
    bf16 = tmp_path / "mlp_bf16.pb"
    convert_file(files / "mlp.pb", bf16, target="bfloat16", device="cpu", min_matrix_intensity=0)
    text = format_result(verify(files / "mlp.pb", bf16, inputs=str(files / "loud.npz"),
                                nodes=True))
    line = next(ln for ln in text.splitlines() if "in the original" in ln)
    assert line.startswith(f"closest to bfloat16's largest value {top:.6g} in the original "
                           "(amp-rewrite ranges --target bfloat16 lists more): loud:0"), line
    assert "65504" not in text


def test_bad_calibration_data_is_refused_and_nothing_is_written(files, capsys):
    before = snapshot(files)
    never = str(files / "never.pb")
    code, _, err = run_cli(capsys, [files / "mlp.pb", "-o", never, "--calibration",
                                    files / "typo.npz"])
    assert_refused(code, err, "typo.npz", files, before)
    assert "array 'X' names no input of the model; its inputs: x (float32 [?,16])" in err
    code, _, err = run_cli(capsys, ["ranges", files / "mlp.pb", "--inputs", files / "typo.npz"])
    assert_refused(code, err, "typo.npz", files, before)
    for args, says in ((["--headroom", "8"], "--headroom: only for the calibration run"),
                       (["--calibration", files / "loud.npz", "--headroom", "0.5"],
                        "--headroom 0.5: must be a number of at least 1"),
                       (["--calibration", files / "absent.npz"], "absent.npz: no such file")):
        code, _, err = run_cli(capsys, [files / "mlp.pb", "-o", never, *args])
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(files) == before


def test_the_help_names_the_default_headroom():
    assert float(cli_run.HEADROOM_DEFAULT) == HEADROOM


def test_infinities_of_the_float32_model_are_no_maximum(capsys, tmp_path):
    """A log of zeros is -inf in float32 already, and the same in float16: it is counted apart,
    and the largest magnitude is that of the finite values, which keeps nothing float32."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        logs = tf.math.log(tf.nn.relu(x, name="relu"), name="log")
        tf.identity(tf.add(logs, 1.0, name="shift"), name="out")
    data = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=data)
    (tmp_path / "log.pb").write_bytes(g.as_graph_def().SerializeToString())
    found = calibrate(tmp_path / "log.pb", [str(tmp_path / "x.npz")])
    log = found.tensors["log:0"]
    positive = data[data > 0]
    assert log.nonfinite == int((data <= 0).sum()) > 0
    assert log.max_abs == pytest.approx(float(np.abs(np.log(positive)).max()), rel=1e-6)
    _, report = convert(g.as_graph_def(), calibration=found.maxima())
    assert not _range_nodes(report)
    assert cli.main(["ranges", str(tmp_path / "log.pb"), "--inputs", str(tmp_path / "x.npz")]) == 0
    assert f"({log.nonfinite} inf/nan in float32 itself)" in capsys.readouterr().out
