"""The cost model weighs with the rates of the CPU at hand: one shipped table per CPU class
(AMX-BF16, AVX512-BF16 without AMX, no bfloat16 unit), chosen by the CPU's flags where no table
was measured on it, each held to the benchmark that measured it; each kind of matrix op at its
own rate (docs/decisions.md "The cost model")."""

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from test_costs import chain

from amp_rewrite import convert
from amp_rewrite.core import hardware
from amp_rewrite.core.errors import InputError
from amp_rewrite.rules import cost_table
from amp_rewrite.rules.cost_table import SAVED_BY_OP, SAVED_KINDS, choose, read_table, shipped

ROOT = Path(__file__).resolve().parent.parent
v1 = tf.compat.v1


@pytest.mark.fast
@pytest.mark.parametrize("flags, cls", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx-bf16"),
    ({"avx2", "avx512f", "avx512_bf16"}, "avx512-bf16"),
    ({"avx2", "avx512f", "avx512bw"}, "avx2"),    # AVX-512 without BF16: no bfloat16 unit
    ({"avx2", "fma"}, "avx2"),
])
def test_a_cpu_is_classed_by_its_bfloat16_unit(flags, cls):
    assert hardware.cpu_class(frozenset(flags)) == cls


@pytest.mark.fast
def test_each_class_gets_its_shipped_table_and_amx_says_whose_rates_stand_in(monkeypatch):
    for cls in hardware.CPU_CLASSES:
        monkeypatch.setenv(hardware.CLASS_VARIABLE, cls)
        table = choose(None)
        assert table is shipped() and table.kind == "shipped"
        assert (table.stands_in_for or table.cpu_class) == cls
    monkeypatch.setenv(hardware.CLASS_VARIABLE, "amx-bf16")
    amx = choose(None)
    assert amx.stands_in_for == "amx-bf16" and amx.cpu_class == "avx512-bf16"
    assert "no table is measured on amx-bf16 CPUs yet" in amx.summary()
    assert choose("avx2").saves_nothing() and not choose("avx512-bf16").saves_nothing()
    assert choose("shipped").stands_in_for == "amx-bf16"   # this CPU's class's


def _bench_rows(title: str) -> dict[str, str]:
    section = (ROOT / "BENCHMARKS.md").read_text().split(f"## {title}\n", 1)[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and re.match(r"^-?\d", cells[1]):
            rows[cells[0]] = cells[3]
    return rows


@pytest.mark.fast
def test_the_table_without_a_bfloat16_unit_is_the_benchmarks_and_saves_nothing():
    """rules/costs-avx2.toml holds what BENCHMARKS.md "Op costs in bfloat16 without a
    bfloat16 unit" measured: each kind's saving per FLOP, every one at 0 or below."""
    table = shipped("avx2")
    assert table.source == 'BENCHMARKS.md "Op costs in bfloat16 without a bfloat16 unit"'
    rows = _bench_rows("Op costs in bfloat16 without a bfloat16 unit")

    def saves(op):
        return float(re.match(r"saves (-?[\d.]+) ps per FLOP", rows[op]).group(1))

    conv = (saves("Conv2D 1x1") + saves("Conv2D 3x3")) / 2
    by_op = table.saved_ps_per_flop_by_op
    assert by_op["Conv2D"] == pytest.approx(conv, abs=0.01)
    assert by_op["DepthwiseConv2dNative"] == pytest.approx(saves("DepthwiseConv2dNative 3x3"), rel=0.01)
    assert by_op["MatMul"] == pytest.approx(saves("MatMul"), abs=0.01)
    assert table.saves_nothing()
    for op in cost_table.UNFUSED_OPS:
        cost = int(re.match(r"costs (-?\d+) ps per element", rows[op]).group(1))
        assert table.unfused_ps_per_element[op] == pytest.approx(cost, abs=1), op


def test_without_a_bfloat16_unit_every_island_stays_float32(monkeypatch):
    """The chain of 256-wide MatMuls gains on an AVX512-BF16 CPU; with the rates of a CPU with
    no bfloat16 unit every island stays float32 (code cost), the output computes what the input
    does, and --costs names the class converted for."""
    gd = chain([256, 256, 256])
    _, avx512 = convert(gd, target="bfloat16", device="cpu")
    assert avx512.node("mm1").precision == "bfloat16"
    monkeypatch.setenv(hardware.CLASS_VARIABLE, "avx2")
    out, report = convert(gd, target="bfloat16", device="cpu")
    for name in ("mm0", "mm1"):
        node = report.node(name)
        assert (node.precision, node.code) == ("float32", "cost")
        assert "saves nothing on a CPU of this class" in node.reason
    assert not any(a.type == tf.bfloat16.as_datatype_enum for n in out.node for a in n.attr.values())
    _, told = convert(gd, target="bfloat16", device="cpu", costs="avx512-bf16")
    assert told.node("mm1").precision == "bfloat16"


def _depthwise_block():
    """x -> depthwise 3x3 (multiplier 4) -> BiasAdd -> Relu6 (which TensorFlow fuses): an
    island with no unfused activation and no variable weight, its matrix op its only cost."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 32, 32, 64], name="x")
        k = tf.constant(r.normal(0, 0.1, (3, 3, 64, 4)).astype(np.float32))
        y = tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "SAME", name="dw")
        y = tf.nn.bias_add(y, tf.constant(r.normal(0, 0.1, 256).astype(np.float32)))
        tf.identity(tf.nn.relu6(y), name="out")
    return g.as_graph_def()


def test_each_kind_of_matrix_op_is_weighed_at_its_own_rate(tmp_path):
    """A depthwise convolution that saves nothing by the table (as on AMX) stays float32 even
    in an island that loses nothing else; at the shipped rate (1.80 ps a FLOP) it is painted.
    (Its intensity, 14 FLOPs an element, is under the default least: 1 lets the weighing
    decide.)"""
    gd = _depthwise_block()
    _, shipped_report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=1)
    assert shipped_report.node("dw").precision == "bfloat16"
    text = (ROOT / "rules" / "costs.toml").read_text().replace(
        "DepthwiseConv2dNative = 1.80", "DepthwiseConv2dNative = -0.5")
    (tmp_path / "t.toml").write_text(text)
    assert read_table(tmp_path / "t.toml").saved("DepthwiseConv2dNative") == -0.5
    _, report = convert(gd, target="bfloat16", device="cpu", costs=tmp_path / "t.toml",
                        min_matrix_intensity=1)
    node = report.node("dw")
    assert (node.precision, node.code) == ("float32", "cost")
    assert "matrix work run slower in bfloat16 than in float32 on this CPU" in node.reason


@pytest.mark.fast
def test_a_kind_no_table_knows_is_one_error_naming_its_line(tmp_path):
    text = (ROOT / "rules" / "costs.toml").read_text().replace(
        "DepthwiseConv2dNative = 1.80", "Conv4D = 1.80")
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(InputError) as err:
        read_table(tmp_path / "t.toml")
    line = text.splitlines().index("Conv4D = 1.80") + 1
    assert f"t.toml:{line}:" in str(err.value) and f"[rates.{SAVED_BY_OP}] unknown key 'Conv4D'" in str(err.value)
    assert set(SAVED_KINDS) == {"Conv2D", "DepthwiseConv2dNative", "MatMul"}
