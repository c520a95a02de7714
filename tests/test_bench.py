"""bench: each model timed in its own process, the processes taking turns in alternating
rounds on the same inputs, and the ratio of their medians with its spread round by round.

No speed is asserted here beyond "thousands of times the work is slower" (timed assertions
are flaky on a shared machine): the speed claim lives in benchmarks/inference.py and
BENCHMARKS.md. Few runs each: every bench call starts two processes that import TensorFlow.
"""

import html
import json
import os
import re
import shlex

import pytest
from test_verify import EXAMPLE, cnn_bf16  # noqa: F401  (the example CNN and its bf16 conversion)

from amp_rewrite import cli
from amp_rewrite.cli.run import parse
from amp_rewrite.tools.bench import Timed, bench, schedule, time_apart


@pytest.fixture(scope="module")
def light_and_heavy(tmp_path_factory):
    """Two GraphDefs of one interface (``x: [None, 256]`` -> ``y``): "light" adds a constant,
    "heavy" first runs 32 MatMuls by 256x256 weights, about 16000 times the FLOPs per row."""
    import numpy as np
    import tensorflow as tf
    folder = tmp_path_factory.mktemp("bench")
    r = np.random.default_rng(0)
    for name, depth in (("light", 0), ("heavy", 32)):
        g = tf.Graph()
        with g.as_default():
            h = tf.compat.v1.placeholder(tf.float32, [None, 256], name="x")
            for _ in range(depth):
                h = tf.matmul(h, tf.constant(r.normal(0, 256 ** -0.5, (256, 256)).astype(np.float32)))
            tf.identity(h + 1.0, name="y")
        (folder / f"{name}.pb").write_bytes(g.as_graph_def().SerializeToString())
    return folder / "light.pb", folder / "heavy.pb"


def test_the_model_doing_more_work_is_the_slower_one(light_and_heavy, tmp_path, capsys):
    """The speed-up says how many times faster the converted model (the second) is: under 1
    where it does thousands of times the work, above 1 the other way round, in every round.
    The printed figures are the JSON's."""
    light, heavy = light_and_heavy
    code = cli.main(["bench", str(light), str(heavy), "--shape", "x=512,256", "--runs", "6",
                     "--warmup", "2", "--json", str(tmp_path / "b.json"),
                     "--html", str(tmp_path / "b.html")])
    assert code == 0
    out = capsys.readouterr().out
    printed = set(re.findall(r"\d+\.\d+", out))
    r = json.loads((tmp_path / "b.json").read_text())
    assert (r["runs"], r["warmup"], r["batch"], r["rounds"]) == (6, 2, 512, 5)
    # the output says how the two were timed
    assert r["method"] == "each model in its own process, 5 alternating rounds"
    assert f"6 timed runs each after 2 warm-up, {r['method']}, batch 512" in out.splitlines()
    for side in ("original", "converted"):
        t = r[side]
        assert 0 < t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
        assert {f"{t['median_ms']:.3f}", f"{t['throughput']:.1f}"} <= printed
    assert r["converted"]["median_ms"] > r["original"]["median_ms"]
    assert r["converted"]["throughput"] < r["original"]["throughput"]
    assert 0 < r["speedup_p10"] <= r["speedup_p90"] < 1 and r["speedup"] < 1
    assert f"{r['speedup']:.2f}" in printed
    # not faster: the page's next command looks at the kernels the slower model ran, fed the
    # same shapes, and the CLI takes it
    page = (tmp_path / "b.html").read_text()
    command = re.search(r'<code id="next-command">([^<]*)</code>', page).group(1)
    argv = shlex.split(html.unescape(command))
    assert argv == ["amp-rewrite", "kernels", str(heavy), "--shape", "x=512,256"]
    assert parse(argv[1:])[0] == "kernels"
    swapped = bench(heavy, light, runs=3, warmup=1, shapes={"x": (512, 256)})
    assert swapped.speedup > 1 and min(swapped.round_speedups) > 1


def test_the_turns_alternate_and_split_the_runs():
    """ABBA: neither model always goes first; the timed runs split over the rounds (at most
    5), the warm-up before a model's first round and one untimed run before each later one."""
    assert schedule(["a", "b"], runs=6, warmup=2) == [
        ("a", 2, 2), ("b", 2, 2), ("b", 1, 1), ("a", 1, 1), ("a", 1, 1), ("b", 1, 1),
        ("b", 1, 1), ("a", 1, 1), ("a", 1, 1), ("b", 1, 1)]
    turns = schedule(["f", "e", "p"], runs=20, warmup=3)
    assert [name for name, _, _ in turns[:6]] == ["f", "e", "p", "p", "e", "f"]
    for name in "fep":
        assert sum(calls for n, _, calls in turns if n == name) == 20
    assert schedule(["a", "b"], runs=1, warmup=0) == [("a", 0, 1), ("b", 0, 1)]


def test_the_ratio_is_of_the_medians_and_its_spread_round_by_round():
    timed = Timed({"a": [[4.0, 4.0, 100.0], [2.0, 2.0, 2.0]], "b": [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]},
                  batch=8, warmup=1)
    result = timed.result("a", "b")
    assert (result.runs, result.rounds, result.batch) == (6, 2, 8)
    assert result.original.median_ms == 3000.0 and result.converted.median_ms == 2000.0
    assert result.speedup == 1.5 and result.round_speedups == [2.0, 1.0]
    assert result.speedup_range() == (1.1, 1.9)


def test_each_model_runs_in_a_process_of_its_own(light_and_heavy):
    """Neither model runs in the caller's process nor in the other's, and each process
    opened one model: what the times are of."""
    light, heavy = light_and_heavy
    timed = time_apart({"light": light, "heavy": heavy}, runs=2, warmup=0,
                       shapes={"x": (8, 256)})
    assert set(timed.pids) == {"light", "heavy"}
    assert len({*timed.pids.values(), os.getpid()}) == 3
    assert [len(rounds) for rounds in timed.seconds.values()] == [2, 2]


def test_bench_library_call_and_bad_input(cnn_bf16, tmp_path):
    result = bench(EXAMPLE, cnn_bf16, runs=3, warmup=1, shapes={"images": (2, 8, 8, 1)})
    assert result.batch == 2 and result.speedup > 0
    assert cli.main(["bench", str(EXAMPLE), str(cnn_bf16), "--runs", "0"]) == 2
    assert cli.main(["bench", str(EXAMPLE), str(tmp_path / "none.pb")]) == 2


def test_bench_names_the_cpu_and_its_16bit_units_first(cnn_bf16, capsys):
    # what a converted model gains depends on the CPU: the figures come under its name
    assert cli.main(["bench", str(EXAMPLE), str(cnn_bf16), "--runs", "1", "--warmup", "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                 if line.startswith("flags"))
    assert first.startswith(f"CPU: {model}; 16-bit matrix units: ")
    assert ("AVX512-BF16" in first) == ("avx512_bf16" in flags)
    assert ("AMX-BF16" in first) == ("amx_bf16" in flags)
    assert ("none:" in first) == (not {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"} & set(flags))
