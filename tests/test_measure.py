"""convert --measure: where the cost model kept nodes float32, the two conversions are timed
against each other here and the faster written. Which one is faster depends on the machine, so
the tests hold what does not: the choice follows the medians, the output is the chosen
conversion byte for byte, nothing is timed where nothing was kept, and other targets are
refused."""

import json

import pytest
import tensorflow as tf
from test_costs import inverted_residual

from amp_rewrite.cli.run import main
from amp_rewrite.conversion.graph import Options
from amp_rewrite.io.save import save
from amp_rewrite.tools.bench import BenchResult, Timing
from amp_rewrite.tools.measured import measured_conversion, pick


def _result(estimated_ms, painted_ms):
    return BenchResult(20, 3, 8, Timing(estimated_ms, 0, 0, 0), Timing(painted_ms, 0, 0, 0),
                       [estimated_ms / painted_ms])


def test_the_medians_decide():
    assert pick(_result(10.0, 9.0)) == "painted"
    assert pick(_result(9.0, 10.0)) == "estimated"
    assert pick(_result(10.0, 10.0)) == "estimated"   # a tie keeps the estimate's


def test_the_output_is_the_chosen_conversion(tmp_path, capsys):
    """The inverted residual block at batch 8, which the estimate keeps float32 for its unfused
    Relu6: both conversions timed, the report says which was written and with what times, and
    the output is byte for byte what converting with that choice writes."""
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual(batch=8).SerializeToString())
    flags = ["--target", "bfloat16", "--device", "cpu"]
    assert main([str(src), "-o", str(tmp_path / "m.pb"), *flags, "--measure",
                 "--report", str(tmp_path / "m.json")]) == 0
    summary = capsys.readouterr().out
    measured = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert measured["kept_by_estimate"] > 0 and measured["estimated_ms"] > 0
    assert measured["chosen"] == ("painted" if measured["ratio"] > 1 else "estimated")
    assert f"measured: {measured['summary']}" in summary.splitlines()
    again = [] if measured["chosen"] == "estimated" else ["--min-matrix-intensity", "0"]
    assert main([str(src), "-o", str(tmp_path / "again.pb"), *flags, *again]) == 0
    assert (tmp_path / "m.pb").read_bytes() == (tmp_path / "again.pb").read_bytes()


@pytest.mark.parametrize("faster", ["estimated", "painted"])
def test_whichever_candidate_times_faster_is_the_one_written(tmp_path, faster):
    """Each branch, whatever this CPU would pick: the timer (the seam ``bench`` fills in a real
    run) says which candidate ran faster, and the model returned is that candidate, byte for
    byte as converting with that choice writes it; the two candidates differ, so writing the
    other one would fail here."""
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual(batch=8).SerializeToString())
    ms = {"estimated": 9.0, "painted": 10.0} if faster == "estimated" else {
        "estimated": 10.0, "painted": 9.0}
    timed = []

    def timer(first, second, **timing):   # the estimate's conversion first, painted second
        timed.append((first.parent.name, second.parent.name))
        return _result(ms["estimated"], ms["painted"])

    options = Options(target="bfloat16", device="cpu")
    model, report, found = measured_conversion(src, "m.pb", options, timer=timer)
    assert timed == [("estimated", "painted")] and found.chosen == faster
    assert report.extra["measured"]["chosen"] == faster
    save(model, tmp_path / "m.pb")
    candidates = {}
    for name, least in (("estimated", None), ("painted", 0)):
        assert main([str(src), "-o", str(tmp_path / f"{name}.pb"), "--target", "bfloat16",
                     "--device", "cpu", "-q"]
                    + ([] if least is None else ["--min-matrix-intensity", str(least)])) == 0
        candidates[name] = (tmp_path / f"{name}.pb").read_bytes()
    assert candidates["estimated"] != candidates["painted"]
    assert (tmp_path / "m.pb").read_bytes() == candidates[faster]


def test_nothing_is_timed_where_the_estimate_kept_nothing(tmp_path, capsys):
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual("random", batch=8).SerializeToString())   # fused: painted
    flags = ["--target", "bfloat16", "--device", "cpu"]
    assert main([str(src), "-o", str(tmp_path / "m.pb"), *flags, "--measure",
                 "--report", str(tmp_path / "m.json")]) == 0
    assert "measured: nothing to measure" in capsys.readouterr().out
    measured = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert (measured["chosen"], measured["estimated_ms"], measured["painted_ms"]) == (
        "estimated", 0.0, 0.0)   # nothing ran
    assert main([str(src), "-o", str(tmp_path / "plain.pb"), *flags]) == 0
    assert (tmp_path / "m.pb").read_bytes() == (tmp_path / "plain.pb").read_bytes()


def test_measure_is_refused_where_no_cost_model_decides(tmp_path, capsys):
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual(batch=8).SerializeToString())
    assert main([str(src), "-o", str(tmp_path / "m.pb"), "--measure"]) == 2
    err = capsys.readouterr().err
    assert "--measure times the cost model of --target bfloat16 --device cpu" in err
    assert err.count("\n") == 1 and not (tmp_path / "m.pb").exists()
    assert tf.io.gfile.exists(str(src))
