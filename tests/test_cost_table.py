"""The cost model's rates are data: the shipped table, a table measured on this CPU (found by
this machine's key in a per-user folder), or ``--costs FILE``; a conversion says which it
weighed with, and a malformed table is one line, exit 2.

Hermetic: conftest.py points ``AMP_REWRITE_COSTS_DIR`` at an empty folder of the suite's own,
and the tests that need a measured table point it at their ``tmp_path``."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from amp_rewrite.core.errors import InputError
from amp_rewrite.rules import cost_table
from amp_rewrite.rules.cost_table import (DIR_VARIABLE, RATES, UNFUSED, UNFUSED_OPS, choose,
                                          format_table, machine_key, measured_path, read_table,
                                          shipped)

ROOT = Path(__file__).resolve().parent.parent
# the shipped rates, as docs/decisions.md "The cost model" lists them (test_docs checks the page)
SHIPPED_RATES = {"saved_ps_per_flop": 0.9, "fp32_ps_per_flop": 2.0, "cast_ps_per_element": 150,
                 "folded_ps_per_element": 120}
SHIPPED_UNFUSED = {"Relu": 43, "Relu6": 218, "Elu": 476, "Selu": 832, "LeakyRelu": 101,
                   "Sigmoid": 706, "Tanh": 198, "Softplus": 886, "Erf": 235, "Exp": 163}


def _write(path: Path, rates=None, unfused=None, key=None, **measured) -> Path:
    """A table as ``costs measure`` writes it: the shipped rates, changed by ``rates`` and
    ``unfused``; ``key`` this machine's unless given."""
    meta = {"cpu": "a test CPU", "tensorflow": "2.21.0", "key": key or machine_key(), **measured}
    path.write_text(format_table({**SHIPPED_RATES, **(rates or {})},
                                 {**SHIPPED_UNFUSED, **(unfused or {})}, meta))
    return path


@pytest.mark.fast
def test_the_shipped_table_holds_every_rate_with_its_unit_and_where_it_was_measured():
    table = shipped()
    assert {name: getattr(table, name) for name in RATES} == SHIPPED_RATES
    assert dict(table.unfused_ps_per_element) == SHIPPED_UNFUSED
    assert (table.kind, table.path, table.cpu) == ("shipped", None, "AMD EPYC: AVX512-BF16, no AMX")
    assert cost_table.shipped_path().read_bytes() == (ROOT / "rules" / "costs.toml").read_bytes()
    text = (ROOT / "rules" / "costs.toml").read_text()
    lines = text.splitlines()
    for name in RATES:   # each rate says, just above it, its unit and where its number comes from
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name} ="))
        start = at
        while lines[start - 1].startswith("#"):
            start -= 1
        comment = " ".join(lines[start:at])
        assert comment.startswith("# ps ") and re.search(r"\d", comment), name


@pytest.mark.fast
@pytest.mark.parametrize("edit, line, says", [
    (lambda t: t + "\nnonsense = 1\n", 0, "unknown key 'nonsense'"),
    (lambda t: t.replace("cast_ps_per_element = 150", "cast_ps_per_element = -1"),
     "cast_ps_per_element", "a time, must be 0 or more"),
    (lambda t: t.replace("saved_ps_per_flop = 0.9", 'saved_ps_per_flop = "fast"'),
     "saved_ps_per_flop", "must be a finite number"),
    (lambda t: t.replace("saved_ps_per_flop = 0.9", "saved_ps_per_flop = nan"),
     "saved_ps_per_flop", "must be a finite number"),
    (lambda t: t.replace("folded_ps_per_element = 120\n", ""), "[rates]", "has no folded_ps_per_element"),
    (lambda t: t.replace("Relu6 = 218", "Gelu = 218"), "Gelu", "unknown key 'Gelu'"),
    (lambda t: t.replace('cpu = "a test CPU"\n', ""), "[measured]", "has no cpu"),
    (lambda t: t.replace("[rates]", "[rate]"), "[rate]", "unknown key 'rate'"),
    (lambda t: t.replace("quick = false", "quick = 1"), "quick", "must be a bool"),
    (lambda t: t.replace("quick = false", "quick = fals"), "quick", "not valid TOML"),
])
def test_a_malformed_table_is_one_error_naming_the_file_and_the_line(tmp_path, edit, line, says):
    good = _write(tmp_path / "good.toml", quick=False).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(good))
    with pytest.raises(InputError) as caught:
        read_table(bad)
    message = str(caught.value)
    assert says in message and "\n" not in message, message
    if line:   # the line of the key it names
        lines = bad.read_text().splitlines()
        number = next(i for i, text in enumerate(lines, 1) if text.startswith(line))
        assert message.startswith(f"{bad}:{number}: "), message


@pytest.mark.fast
def test_a_conversion_takes_the_named_table_else_this_machines_else_the_shipped(
        tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path / "measured"))
    assert choose() is shipped() and choose("shipped") is shipped()
    # this machine's table, where conversions look for it
    mine = measured_path()
    assert mine.parent == tmp_path / "measured" and mine.name.startswith("costs-")
    mine.parent.mkdir()
    _write(mine, rates={"saved_ps_per_flop": 9.5})
    found = choose()
    assert (found.kind, found.path, found.saved_ps_per_flop) == ("measured", str(mine), 9.5)
    # --costs names a table, whatever this machine has
    other = _write(tmp_path / "other.toml", rates={"saved_ps_per_flop": 3.0}, key="another CPU")
    assert (choose(other).kind, choose(other).saved_ps_per_flop) == ("file", 3.0)
    assert choose("shipped") is shipped()
    # a table in this machine's place that says it is another's: copied there, or the
    # machine changed (another TensorFlow): refused, naming it
    _write(mine, key="another CPU | avx2 | tensorflow 2.0.0")
    with pytest.raises(InputError, match="measured for 'another CPU"):
        choose()
    # the key holds the CPU model, its flags and TensorFlow's version; the place follows it
    assert measured_path("a | b | tensorflow 1") != measured_path("a | b | tensorflow 2")


@pytest.mark.fast
def test_measured_tables_live_in_the_users_cache_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv(DIR_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cost_table.costs_dir() == tmp_path / "xdg" / "amp-rewrite"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cost_table.costs_dir() == Path.home() / ".cache" / "amp-rewrite"
    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path / "mine"))
    assert cost_table.costs_dir() == tmp_path / "mine"


def test_costs_measure_quick_writes_a_table_a_conversion_reads(tmp_path, capsys):
    """The command end to end, in seconds: the table it writes is read back as this machine's
    measurement (quick, its key), every rate a number; --quick refuses to write where
    conversions look for this CPU's table."""
    from amp_rewrite.cli.run import main
    out = tmp_path / "quick.toml"
    assert main(["costs", "measure", "--quick", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}\ncost table: the cost table {out} (--costs;")
    table = read_table(out)
    data = tomllib.loads(out.read_text())
    assert data["measured"]["key"] == machine_key() and data["measured"]["quick"] is True
    assert table.quick and set(table.unfused_ps_per_element) == set(UNFUSED_OPS)
    assert main(["costs", "measure", "--quick"]) == 2
    assert "writes only where -o FILE says" in capsys.readouterr().err
    assert not measured_path().exists()
    assert main(["costs", "measure", "--quick", "-o", str(out)]) == 2   # exists: --force
    assert "already exists" in capsys.readouterr().err


def test_a_conversion_weighs_with_this_cpus_measured_table_and_says_so(tmp_path, monkeypatch,
                                                                        capsys):
    """The inverted residual block stays float32 by the shipped rates (its Relu6 lose more than
    its convolutions save); with a table measured here where matrix work saves 30 times as
    much (an AMX CPU's kind of figure), it paints, and the report and the summary say which
    table decided. --costs shipped takes the defaults back; a malformed measured table is one
    line, exit 2."""
    from test_costs import inverted_residual

    from amp_rewrite.cli.run import main
    src = tmp_path / "block.pb"
    src.write_bytes(inverted_residual().SerializeToString())
    flags = ["--target", "bfloat16", "--device", "cpu", "--force"]

    def convert(*more):
        code = main([str(src), "-o", str(tmp_path / "out.pb"), *flags,
                     "--report", str(tmp_path / "r.json"), *more])
        out = capsys.readouterr()
        report = json.loads((tmp_path / "r.json").read_text()) if code == 0 else None
        return code, out, report

    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path / "measured"))
    _, out, shipped_report = convert()
    expand = lambda r: next(n for n in r["nodes"] if n["name"] == "expand")  # noqa: E731
    assert expand(shipped_report)["code"] == "cost"
    assert shipped_report["cost_model"]["costs"]["table"] == "shipped"
    assert "cost_model: islands weighed at an open batch as 1, with the shipped cost table" in out.out

    mine = measured_path()
    mine.parent.mkdir()
    _write(mine, rates={"saved_ps_per_flop": 27.0})
    _, out, measured = convert()
    assert expand(measured)["precision"] == "bfloat16"
    costs = measured["cost_model"]["costs"]
    assert (costs["table"], costs["path"], costs["rates"]["saved_ps_per_flop"]) == (
        "measured", str(mine), 27.0)
    assert f"with the cost table measured on this CPU ({mine})" in out.out

    _, _, back = convert("--costs", "shipped")
    assert expand(back)["code"] == "cost" and back["cost_model"]["costs"]["table"] == "shipped"

    mine.write_text(mine.read_text().replace("Relu = 43", "Relu = fast"))
    code, out, _ = convert()
    assert code == 2 and out.err.count("\n") == 1 and f"{mine}:" in out.err, out.err
    assert "not valid TOML" in out.err


def test_costs_is_checked_before_any_work_and_only_where_a_cost_model_weighs(tmp_path, capsys):
    from amp_rewrite.cli.run import main
    src = ROOT / "examples" / "cnn_fp32.pb"
    bf16 = ["--target", "bfloat16", "--device", "cpu"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[rates]\nsaved_ps_per_flop = 1\n")
    cases = [([*bf16, "--costs", str(bad)], f"{bad}:1: no [measured] table"),
             ([*bf16, "--costs", str(tmp_path / "none.toml")], "no such file"),
             (["--costs", "shipped"], "a float16 conversion for gpu has no such cost model")]
    for flags, says in cases:
        assert main([str(src), "-o", str(tmp_path / "out.pb"), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.pb").exists()
    assert main(["costs", "show", "--quick"]) == 2
    assert "costs show takes no --quick" in capsys.readouterr().err
    assert main(["costs", "show", "--costs", str(_write(tmp_path / "t.toml"))]) == 0
    assert capsys.readouterr().out.startswith(f"cost table: the cost table {tmp_path / 't.toml'}")


def _op_costs_rows() -> dict[str, tuple[float, float, str]]:
    """BENCHMARKS.md "Op costs in bfloat16 on this CPU": op -> (float32 ms, bfloat16 ms, per unit)."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## Op costs in bfloat16 on this CPU\n", 1)[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and re.match(r"^-?\d", cells[1]):
            rows[cells[0]] = (float(cells[1]), float(cells[2]), cells[3])
    return rows


@pytest.mark.fast
def test_the_cost_model_page_states_the_shipped_rates_and_where_each_comes_from():
    """docs/decisions.md "The cost model" lists every rate with its unit and the shipped value,
    and the figures it derives them from are the benchmark's: each saving and loss as
    BENCHMARKS.md prints it, the float32 times per FLOP and per element worked out from its
    milliseconds (8x56x56x144 elements)."""
    page = (ROOT / "docs" / "decisions.md").read_text()
    section = page.split("## The cost model\n", 1)[1].split("\n## ")[0]
    listed = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            listed[cells[0].strip("`")] = cells[1:]
    assert set(listed) == set(RATES) | {UNFUSED, cost_table.SAVED_BY_OP}
    table = shipped()
    for name, (unit, *_) in RATES.items():
        assert listed[name][0] == unit and float(listed[name][1]) == getattr(table, name), name
    assert listed[UNFUSED][1] == ", ".join(f"{op} {v:g}" for op, v in SHIPPED_UNFUSED.items())
    assert listed[cost_table.SAVED_BY_OP][1] == ", ".join(
        f"{kind} {v:g}" for kind, v in table.saved_ps_per_flop_by_op.items())
    bench = _op_costs_rows()
    assert bench["DepthwiseConv2dNative 3x3"][2] == "saves 1.80 ps per FLOP"
    for op, rate in SHIPPED_UNFUSED.items():
        assert bench[op][2] == f"costs {rate} ps per element", op
    n = 8 * 56 * 56 * 144
    saves = {"Conv2D 1x1, 144 -> 144": 0.95, "Conv2D 3x3, 144 -> 144": 0.93,
             "MatMul 144 -> 576": 0.89}
    for op, saved in saves.items():
        assert bench[op][2] == f"saves {saved:.2f} ps per FLOP"
    assert "(0.95, 0.93, 0.89), rounded down" in listed["saved_ps_per_flop"][3]
    assert int(sorted(saves.values())[1] * 10) / 10 == table.saved_ps_per_flop
    flops = {"Conv2D 3x3, 144 -> 144": 2 * 9 * 144 * n, "Conv2D 1x1, 144 -> 144": 2 * 144 * n,
             "MatMul 144 -> 576": 2 * 144 * 576 * n // 144}
    fp32 = [round(bench[op][0] * 1e9 / f, 1) for op, f in flops.items()]
    assert f"({', '.join(map(str, fp32))})" in listed["fp32_ps_per_flop"][3]
    assert round(sorted(fp32)[1]) == table.fp32_ps_per_flop
    folded = [round(bench[op][0] * 1e9 / n) for op in ("Mul (per-channel vector)",
                                                      "AddV2 (per-channel vector)")]
    assert f"({folded[0]}, {folded[1]})" in listed["folded_ps_per_element"][3]
    assert round(sum(folded) / 2, -1) == table.folded_ps_per_element


def test_the_python_api_takes_a_table_too(tmp_path):
    from test_costs import inverted_residual

    from amp_rewrite import convert
    table = _write(tmp_path / "fast.toml", rates={"saved_ps_per_flop": 27.0})
    _, report = convert(inverted_residual(), target="bfloat16", device="cpu", costs=table)
    assert report.node("expand").precision == "bfloat16"
    assert report.extra["cost_model"]["costs"]["path"] == str(table)
    _, report = convert(inverted_residual(), target="bfloat16", device="cpu")
    assert report.node("expand").code == "cost"


# ----------------------------------------------------------------- the measured rates' units
@pytest.mark.fast
def test_the_rates_are_picoseconds_of_the_seconds_timed():
    """The arithmetic of costs measure on timings made up to give round rates: 2 ms in float32
    and 1 ms in bfloat16 over 1e9 FLOPs is 2 and 1 ps per FLOP (a saving of 1 ps); 1 ms over a
    million elements is 1000 ps per element."""
    from amp_rewrite.tools.op_costs import CAST, FOLDED_OPS, SAVING_OPS, Measurement
    found = Measurement(shape=(10, 100, 1000), rounds=1, quick=False)
    assert found.elements == 10 ** 6
    for name in SAVING_OPS:
        found.matrix[name] = ({"float32": 2e-3, "bfloat16": 1e-3}, 10 ** 9)
    for name in FOLDED_OPS:
        found.elementwise[name] = {"float32": 1e-3, "bfloat16": 3e-3}
    found.elementwise[CAST] = {"float32": 0.5e-3, "bfloat16": 0.0}
    for name in UNFUSED_OPS:
        found.elementwise[name] = {"float32": 1e-3, "bfloat16": 1.25e-3}
    assert found.rates() == pytest.approx({"saved_ps_per_flop": 1.0, "fp32_ps_per_flop": 2.0,
                                           "cast_ps_per_element": 500.0,
                                           "folded_ps_per_element": 1000.0})
    assert found.unfused() == pytest.approx({op: 250.0 for op in UNFUSED_OPS})


def test_a_measured_matmul_rate_agrees_with_a_matmul_timed_apart():
    """time_op's float32 MatMul, in ps per FLOP, against numpy's float32 matmul of the same
    FLOPs timed here: the same order of magnitude (a unit slip is a factor of 1000)."""
    import statistics
    import time

    import numpy as np

    from amp_rewrite.tools.op_costs import matrix_ops, time_op
    shape = (8, 32, 32, 128)
    fn, flops = matrix_ops(shape)["MatMul"]
    ps_per_flop = time_op(fn, 5, shape)["float32"] / flops * 1e12
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8 * 32 * 32, 128)).astype(np.float32)
    b = rng.normal(size=(128, 4 * 128)).astype(np.float32)
    assert 2 * a.shape[0] * a.shape[1] * b.shape[1] == flops
    times = []
    for _ in range(7):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    apart = statistics.median(times) / flops * 1e12
    assert apart / 10 < ps_per_flop < apart * 10, (ps_per_flop, apart)
