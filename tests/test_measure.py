"""convert --measure: the float32 input, the cost model's conversion and (where the estimate
kept nodes float32) the one painted whole are timed here, each in its own process, and the
fastest written. Which one is faster depends on the machine, so the tests hold what does not:
float32 is always among the candidates, the choice follows the medians, the output is the
chosen candidate byte for byte (the input itself where float32 won, said in the summary and
coded in the report), and other targets are refused."""

import json
import logging

import numpy as np
import pytest
import tensorflow as tf
from test_costs import inverted_residual

from amp_rewrite.cli.run import main
from amp_rewrite.conversion.graph import Options
from amp_rewrite.io.load import load
from amp_rewrite.io.save import save
from amp_rewrite.tools.bench import Timed
from amp_rewrite.tools.measured import measured_conversion, pick

FLAGS = ["--target", "bfloat16", "--device", "cpu"]


def two_blocks(batch=8):
    """Two inverted residual blocks on one input (``tests/test_costs.inverted_residual``),
    their means added: one with biases, whose activations TensorFlow fuses (the estimate
    paints it), one without (the estimate keeps it float32 for its unfused Relu6): the
    estimate's conversion, the one painted whole and the input all differ."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 14, 14, 128], name="x")
        outs = []
        for name, biased in (("fused", True), ("bare", False)):
            h = tf.nn.conv2d(x, tf.constant(r.normal(0, 0.1, (1, 1, 128, 768)).astype(
                np.float32)), 1, "SAME", name=f"{name}_expand")
            for step in range(2):
                if step:
                    h = tf.nn.depthwise_conv2d(h, tf.constant(r.normal(0, 0.1, (3, 3, 768, 1)).astype(
                        np.float32)), [1, 1, 1, 1], "SAME", name=f"{name}_dw")
                if biased:
                    h = tf.nn.bias_add(h, tf.constant(r.normal(0, 0.1, 768).astype(np.float32)))
                h = tf.nn.relu6(h)
            outs.append(tf.reduce_mean(h, [1, 2]))
        tf.identity(outs[0] + outs[1], name="out")
    return g.as_graph_def()


def _timed(ms: dict[str, float]) -> Timed:
    """Fixed timings: two rounds of one call each, every round at ``ms``."""
    return Timed({name: [[t / 1e3], [t / 1e3]] for name, t in ms.items()}, batch=8)


def test_the_medians_decide():
    assert pick({"float32": 10.0, "estimated": 9.0, "painted": 9.5}) == "estimated"
    assert pick({"float32": 10.0, "estimated": 9.0, "painted": 8.0}) == "painted"
    assert pick({"float32": 8.0, "estimated": 9.0, "painted": 8.5}) == "float32"
    # a tie keeps the estimate's, then painting whole, before the float32 model
    assert pick({"float32": 9.0, "estimated": 9.0, "painted": 9.0}) == "estimated"
    assert pick({"float32": 9.0, "painted": 9.0}) == "painted"


def _candidates(src, tmp_path) -> dict[str, bytes]:
    """What converting ``src`` writes with the estimate and painted whole, and the input."""
    out = {"float32": _saved(load(src), tmp_path / "float32.pb")}
    for name, least in (("estimated", None), ("painted", 0)):
        assert main([str(src), "-o", str(tmp_path / f"{name}.pb"), *FLAGS, "-q"]
                    + ([] if least is None else ["--min-matrix-intensity", str(least)])) == 0
        out[name] = (tmp_path / f"{name}.pb").read_bytes()
    return out


def _saved(model, path) -> bytes:
    save(model, path)
    return path.read_bytes()


@pytest.mark.parametrize("faster", ["estimated", "painted", "float32"])
def test_whichever_candidate_times_fastest_is_the_one_written(tmp_path, faster, caplog):
    """Each branch, whatever this CPU would pick: the timer (the seam ``time_apart`` fills in
    a real run) says which candidate ran fastest, and the model returned is that candidate,
    byte for byte as converting with that choice writes it (the input itself for float32);
    the three differ, so writing another would fail here. float32 is timed, the reference
    every candidate is fed from."""
    src = tmp_path / "blocks.pb"
    src.write_bytes(two_blocks().SerializeToString())
    ms = {"float32": 10.0, "estimated": 10.0, "painted": 10.0}
    ms[faster] = 9.0
    timed = []

    def timer(paths, **timing):
        timed.append({name: path.parent.name for name, path in paths.items()})
        return _timed(ms)

    model, report, found = measured_conversion(src, "m.pb", Options(target="bfloat16",
                                                                    device="cpu"), timer=timer)
    assert timed == [{"float32": "float32", "estimated": "estimated", "painted": "painted"}]
    assert list(timed[0])[0] == "float32"
    assert found.chosen == faster and report.extra["measured"]["chosen"] == faster
    assert report.extra["measured"]["ratio"] == ms["estimated"] / ms["painted"]
    candidates = _candidates(src, tmp_path)
    assert len(set(candidates.values())) == 3
    assert _saved(model, tmp_path / "m.pb") == candidates[faster]
    summary = report.extra["measured"]["summary"]
    assert "float32 10.00 ms" in summary or faster == "float32"
    if faster == "float32":
        # said plainly, coded node by node, and the report counts a float32 model
        assert summary.endswith("the float32 model ran fastest on this CPU: written unconverted")
        assert any("the float32 model ran fastest" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)
        codes = {n.code for n in report.nodes if n.precision == "float32"}
        assert "measured" in codes
        assert all(n.precision in ("float32", "none") for n in report.nodes)
        assert report.summary()["matrix_converted"] == 0 and report.casts_added == []
        assert report.summary()["kept_float32_by_reason"]["measured"] > 0
        assert report.float32_model() is not None
    else:
        assert "measured" not in {n.code for n in report.nodes}


def test_float32_is_timed_where_the_estimate_kept_nothing(tmp_path, capsys):
    """A block whose biases let TensorFlow fuse its activations: the estimate keeps nothing
    float32, so painting whole is the same conversion and is not timed; the float32 input
    still is, in its own process, and the summary says what ran and what was written."""
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual("random", batch=8).SerializeToString())   # fused: painted
    assert main([str(src), "-o", str(tmp_path / "m.pb"), *FLAGS, "--measure",
                 "--report", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    measured = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert set(measured["times_ms"]) == {"float32", "estimated"}
    assert measured["kept_by_estimate"] == 0 and measured["float32_ms"] > 0
    assert measured["method"].startswith("each model in its own process")
    assert f"measured: {measured['summary']}" in out.splitlines()
    assert measured["chosen"] == min(measured["times_ms"], key=lambda n: (
        measured["times_ms"][n], ["estimated", "float32"].index(n)))
    if measured["chosen"] == "float32":
        assert load(tmp_path / "m.pb").graph_def == load(src).graph_def
    else:
        assert main([str(src), "-o", str(tmp_path / "plain.pb"), *FLAGS, "-q"]) == 0
        assert (tmp_path / "m.pb").read_bytes() == (tmp_path / "plain.pb").read_bytes()


def test_measure_is_refused_where_no_cost_model_decides(tmp_path, capsys):
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual(batch=8).SerializeToString())
    assert main([str(src), "-o", str(tmp_path / "m.pb"), "--measure"]) == 2
    err = capsys.readouterr().err
    assert "--measure times the cost model of --target bfloat16 --device cpu" in err
    assert err.count("\n") == 1 and not (tmp_path / "m.pb").exists()
    assert tf.io.gfile.exists(str(src))


def test_an_estimate_that_changed_nothing_is_the_float32_model_timed_once(tmp_path):
    """The block the estimate keeps float32 whole (its unfused Relu6): its conversion is the
    input itself, so float32 is timed once, against painting whole; where float32 is faster,
    what is written is that conversion, with the estimate's reasons (code cost)."""
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual(batch=8).SerializeToString())
    timed = []

    def timer(paths, **timing):
        timed.append(list(paths))
        return _timed({"float32": 9.0, "painted": 10.0})

    model, report, found = measured_conversion(src, "m.pb", Options(target="bfloat16",
                                                                    device="cpu"), timer=timer)
    assert timed == [["float32", "painted"]]
    assert found.chosen == "estimated" and found.estimate_is_input
    assert found.times_ms["estimated"] == found.times_ms["float32"] == 9.0
    assert "the cost model's conversion is the float32 model (it changed no node)" in found.summary()
    assert model.graph_def == load(src).graph_def
    assert "cost" in {n.code for n in report.nodes} and "measured" not in {n.code for n in report.nodes}


def test_cost_aware_on_a_cpu_with_a_bfloat16_unit_times_the_conversion_against_float32(
        tmp_path, monkeypatch):
    """--cost-aware promises a model never slower than float32 here: on a CPU with a bfloat16
    unit the estimate cannot say it, so the command converts as --measure does (float32 among
    the candidates, the tests above; here the call is recorded, not timed), and on one without
    a unit it keeps every island float32 without timing anything (test_costs.py)."""
    from amp_rewrite.core import hardware
    from amp_rewrite.tools import measured as measured_mod
    calls = []
    real = measured_mod.measured_conversion

    def recorded(input_path, output_name, options, **kw):
        calls.append(options.cost_aware)
        return real(input_path, output_name, options,
                    timer=lambda models, **_: _timed({n: 1.0 for n in models}), **kw)

    monkeypatch.setattr(measured_mod, "measured_conversion", recorded)
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual("random", batch=8).SerializeToString())
    for unit, measured in (("avx512_bf16", [True]), (None, [])):
        monkeypatch.setattr(hardware, "bf16_matrix_unit", lambda unit=unit: unit)
        calls.clear()
        assert main([str(src), "-o", str(tmp_path / "m.pb"), *FLAGS, "--cost-aware", "-q",
                     "--force", "--report", str(tmp_path / "m.json")]) == 0
        assert calls == measured, unit
        report = json.loads((tmp_path / "m.json").read_text())
        assert ("measured" in report) == bool(measured)
