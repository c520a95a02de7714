"""``amp-rewrite bench ORIG CONVERTED``: both models timed as each is served, side by side.

Each model is loaded and timed in a process of its own (:func:`time_apart`), as a server runs
one model: in one process two models share TensorFlow's thread pools, oneDNN's cache of
compiled kernels and the allocator, and their times there differ from either served alone
(a small BERT read 0.84x interleaved in one process and 1.13x timed apart). The processes
take turns in rounds, one at a time, the order reversed every other round (ABBA), so drift
in clock speed or load falls on all alike: each round a process makes ``--runs`` / rounds
timed calls in a row, after ``--warmup`` untimed ones in its first round and one in each
later round (the other process's round has taken the caches). The speed-up is the
original's median latency over the converted one's, over all timed calls; its spread, the
p10-p90 of the ratio of the two medians round by round.

Both compute the outputs verify compares (:func:`amp_rewrite.tools.runner.open_pair`: a
training graph's forward outputs and unscaled gradients, never a variable update) on the
same inputs: the original's process makes them (``--inputs``, or random data) and hands
them to the others. A graph fed by a tf.data iterator is timed on one batch of it, fed to
both (:func:`~amp_rewrite.tools.verify.feed_sets`): the models' work, not the input
pipeline's. Throughput is the batch (the first input's leading dimension; a RaggedTensor's
or SparseTensor's rows) over the median latency.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..core.errors import AmpRewriteError, InputError, RunError
from ..io.files import SAVED_MODEL_FILES
from .composites import feed_batch
from .runner import GraphRunner, open_converted, open_model
from .verify import feed_sets

log = logging.getLogger(__name__)

#: the most rounds a run is split into (fewer where there are fewer timed runs)
ROUNDS = 5


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    throughput: float   # samples per second at the median latency


@dataclass
class BenchResult:
    runs: int
    warmup: int
    batch: int
    original: Timing
    converted: Timing
    round_speedups: list[float]   # original / converted median time within each round
    rounds: int = 0

    @property
    def speedup(self) -> float:
        """How many times faster the converted model is (original / converted median latency)."""
        return self.original.median_ms / self.converted.median_ms

    def speedup_range(self) -> tuple[float, float]:
        """p10 and p90 of the per-round ratios: how much the ratio moved during the run."""
        return spread(self.round_speedups)

    def method(self) -> str:
        """How the two were timed, in the words the output and the JSON say it."""
        return method_text(self.rounds)

    def to_dict(self) -> dict:
        low, high = self.speedup_range()
        return {"runs": self.runs, "warmup": self.warmup, "batch": self.batch,
                "rounds": self.rounds, "method": self.method(),
                "original": asdict(self.original), "converted": asdict(self.converted),
                "speedup": self.speedup, "speedup_p10": low, "speedup_p90": high}


def method_text(rounds: int) -> str:
    return (f"each model in its own process, {rounds} alternating round"
            f"{'s' if rounds != 1 else ''}")


@dataclass
class Timed:
    """Models timed apart (:func:`time_apart`): each one's seconds per timed call, round by
    round, and the batch they ran."""

    seconds: dict[str, list[list[float]]]
    batch: int
    warmup: int = 0
    pids: dict[str, int] = field(default_factory=dict)   # the process each ran in

    def timing(self, name: str) -> Timing:
        return _timing([s for block in self.seconds[name] for s in block], self.batch)

    def round_ratios(self, first: str, second: str) -> list[float]:
        """``first``'s median time over ``second``'s, round by round."""
        return [statistics.median(a) / statistics.median(b)
                for a, b in zip(self.seconds[first], self.seconds[second])]

    def result(self, first: str, second: str) -> BenchResult:
        """``first`` against ``second`` as :func:`bench` reports them."""
        runs = sum(len(block) for block in self.seconds[first])
        return BenchResult(runs, self.warmup, self.batch, self.timing(first),
                           self.timing(second), self.round_ratios(first, second),
                           len(self.seconds[first]))


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The p10 and p90 of ``values`` (of one value, that value twice)."""
    q = _deciles(list(values))
    return q[0], q[-1]


def _deciles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 9
    return statistics.quantiles(sorted(values), n=10, method="inclusive")


def _timing(seconds: list[float], batch: int) -> Timing:
    ms = sorted(s * 1e3 for s in seconds)
    q = _deciles(ms)
    median = statistics.median(ms)
    return Timing(median, q[0], q[-1], batch / (median / 1e3))


def schedule(names: Sequence[str], runs: int, warmup: int, rounds: int | None = None
             ) -> list[tuple[str, int, int]]:
    """The turns of :func:`time_apart`: ``(model, untimed calls, timed calls)`` in order.
    ``runs`` timed calls of each split into ``rounds`` (default: ``runs``, at most
    :data:`ROUNDS`), the order of the models reversed every other round; ``warmup`` untimed
    calls before a model's first round, one before each later one."""
    rounds = min(runs, ROUNDS) if rounds is None else rounds
    sizes = [runs // rounds + (1 if r < runs % rounds else 0) for r in range(rounds)]
    turns = []
    for r, size in enumerate(sizes):
        for name in (names if r % 2 == 0 else list(reversed(names))):
            turns.append((name, warmup if r == 0 else 1, size))
    return turns


def bench(original_path, converted_path, *, runs: int = 20, warmup: int = 3,
          shapes: Mapping | None = None, inputs: str | None = None, signature: str | None = None,
          outputs: Sequence[str] = (), checkpoint: str | None = None,
          progress: Callable[[int, int], None] | None = None,
          init_ops: Sequence[str] = ()) -> BenchResult:
    """Time both models on the same inputs, each in its own process (see the module
    docstring; ``init_ops``: ``--init-op``)."""
    if runs < 1 or warmup < 0:
        raise InputError("--runs must be at least 1 and --warmup at least 0")
    timed = time_apart({"original": original_path, "converted": converted_path}, runs=runs,
                       warmup=warmup, shapes=shapes, inputs=inputs, signature=signature,
                       outputs=outputs, checkpoint=checkpoint, init_ops=init_ops,
                       progress=progress)
    return timed.result("original", "converted")


def time_apart(models: Mapping[str, str | os.PathLike], *, runs: int = 20, warmup: int = 3,
               shapes: Mapping | None = None, inputs: str | None = None,
               signature: str | None = None, outputs: Sequence[str] = (),
               checkpoint: str | None = None, init_ops: Sequence[str] = (),
               progress: Callable[[int, int], None] | None = None) -> Timed:
    """Each of ``models`` (name -> path) loaded in a process of its own and timed there in
    turns (:func:`schedule`), one process running at a time. The first is the reference:
    its process makes the inputs (``inputs``, ``shapes``: as verify's), which the others
    are fed, and the others are opened against it (:func:`~.runner.open_converted`: the
    same inputs and outputs; a graph's weights copied from it). A process that ends
    unexpectedly is our error; one that refuses its model or inputs, the user's."""
    names = list(models)
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-bench-") as tmp:
        said: set = set()
        workers = {name: _Worker(name, Path(tmp), said) for name in names}
        try:
            opened = _open_all(workers, models, Path(tmp) / "feeds.pickle", dict(
                signature=signature, outputs=list(outputs), checkpoint=checkpoint,
                init_ops=list(init_ops), inputs=None if inputs is None else str(inputs),
                shapes={k: list(v) for k, v in (shapes or {}).items()}))
            turns = schedule(names, runs, warmup)
            seconds: dict[str, list[list[float]]] = {name: [] for name in names}
            for done, (name, untimed, calls) in enumerate(turns, 1):
                seconds[name].append(workers[name].ask({"op": "time", "untimed": untimed,
                                                        "calls": calls})["seconds"])
                if progress:
                    progress(done, len(turns))
        finally:
            for worker in workers.values():
                worker.close()
    return Timed(seconds, opened["batch"], warmup, opened["pids"])


def _open_all(workers: Mapping[str, "_Worker"], models: Mapping, feeds: Path,
              options: dict) -> dict:
    """Open the reference (the first model), which writes the inputs to ``feeds``, then
    the others against it; each one's inputs and outputs must be the reference's."""
    names = list(models)
    reference = str(models[names[0]])
    pair = str(models[names[1]]) if len(names) > 1 else None
    first = workers[names[0]].ask({"op": "open", "model": reference, "feeds": str(feeds),
                                   "reference": None, "pair": pair, **options})
    for name in names[1:]:
        workers[name].send({"op": "open", "model": str(models[name]), "feeds": str(feeds),
                            "reference": reference, **options})
    pids = {names[0]: first["pid"]}
    for name in names[1:]:
        other = workers[name].receive()
        pids[name] = other["pid"]
        if other["inputs"] != first["inputs"]:
            raise InputError(f"the two models take different inputs: {first['inputs']} and "
                             f"{other['inputs']}")
        if len(other["outputs"]) != len(first["outputs"]):
            raise InputError(f"the two models give different outputs: {first['outputs']} and "
                             f"{other['outputs']}")
    return {**first, "pids": pids}


class _Worker:
    """One model's process: requests and replies as JSON lines on its stdin and stdout; its
    stderr (TensorFlow's logs) kept in a file, its last line told if it ends unexpectedly;
    its log records said here, each once among the processes sharing ``said``."""

    def __init__(self, name: str, folder: Path, said: set):
        self.name, self.said = name, said
        self.errors = open(folder / f"{name}.stderr", "w+b")   # noqa: SIM115 -- closed in close()
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        level = logging.getLogger("amp_rewrite").getEffectiveLevel()
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from amp_rewrite.tools.bench import worker; "
             f"worker({level})"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.errors, env=env, text=True)

    def send(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise AmpRewriteError(f"bench: the process timing the {self.name} model ended "
                                  f"unexpectedly (exit code {self.process.returncode}): "
                                  f"{self._last_error()}")
        reply = json.loads(line)
        for level, name, text in reply.get("logs", []):
            if (level, name, text) not in self.said:
                self.said.add((level, name, text))
                logging.getLogger(name).log(level, "%s", text)
        if "error" in reply:
            if reply["user"]:
                raise RunError(reply["message"]) if reply["error"] == "RunError" else \
                    InputError(reply["message"])
            raise AmpRewriteError(f"bench: timing the {self.name} model failed in its "
                                  f"process: {reply['message']}\n{reply['traceback']}")
        return reply

    def ask(self, request: dict) -> dict:
        self.send(request)
        return self.receive()

    def _last_error(self) -> str:
        self.errors.seek(0)
        lines = [ln.strip() for ln in self.errors.read().decode(errors="replace").splitlines()]
        return next((ln for ln in reversed(lines) if ln), "no message")

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.process.stdin.close()
                try:
                    self.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        finally:
            self.errors.close()


def worker(level: int = logging.WARNING) -> None:
    """A model's process (started by :class:`_Worker`): answers ``open`` (load the model;
    the reference also makes the inputs) and ``time`` (run it, untimed then timed) until its
    stdin ends, then exits at once. Only replies are written to its stdout; whatever else writes there goes to
    stderr. Its log records (the inputs' warnings ...) travel with the replies."""
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    records = _Records()
    package = logging.getLogger("amp_rewrite")
    package.setLevel(level)
    package.addHandler(records)
    package.propagate = False
    state: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _answer(request, state)
        except AmpRewriteError as exc:
            reply = {"error": type(exc).__name__, "message": str(exc),
                     "user": isinstance(exc, InputError), "traceback": traceback.format_exc()}
        except Exception as exc:   # relayed, never swallowed: the parent raises it as ours
            reply = {"error": type(exc).__name__, "message": str(exc), "user": False,
                     "traceback": traceback.format_exc()}
        reply["logs"], records.kept = records.kept, []
        channel.write(json.dumps(reply) + "\n")
        channel.flush()
    # nothing is left to write: skip TensorFlow's teardown at exit (seconds), which the
    # parent would wait for
    os._exit(0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.kept: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.kept.append((record.levelno, record.name, record.getMessage()))


def _answer(request: dict, state: dict) -> dict:
    if request["op"] == "open":
        return _open(request, state)
    call, feed = state["call"], state["feed"]
    for _ in range(request["untimed"]):
        call(feed)
    seconds = []
    for _ in range(request["calls"]):
        start = time.perf_counter()
        call(feed)
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds}


def _open(request: dict, state: dict) -> dict:
    """Open the model of ``request``: the reference with its weights, making the inputs;
    another against the reference (a graph's pairing with it needs the reference open for a
    moment: its outputs, gradients and weights), fed the reference's inputs."""
    common = dict(signature=request["signature"], outputs=request["outputs"])
    feeds = Path(request["feeds"])
    if request["reference"] is None:
        runner = open_model(request["model"], checkpoint=request["checkpoint"],
                            init_ops=request["init_ops"], **common)
        _pair(runner, request["pair"], common)
        shapes = {k: tuple(v) for k, v in request["shapes"].items()}
        feed = feed_sets(runner, request["inputs"], 1, shapes)[0]
        with open(feeds, "wb") as f:
            pickle.dump(feed, f)
    else:
        runner = _open_against(request, common)
        with open(feeds, "rb") as f:
            feed = pickle.load(f)   # noqa: S301 -- written by this run's reference process
    state["runner"], state["call"], state["feed"] = runner, runner.callable(), feed
    return {"inputs": [s.name for s in runner.inputs], "outputs": list(runner.outputs),
            "batch": feed_batch(runner.inputs, feed), "pid": os.getpid()}


def _pair(reference, other: str | None, common: dict) -> None:
    """A graph reference takes the outputs :func:`~.runner.open_converted` gives it against
    ``other`` (a training graph's gradients, where both compute them): opened against it
    for a moment, as ``other``'s process opens it against the reference."""
    if other is None or not isinstance(reference, GraphRunner) or _saved_model(Path(other)):
        return
    open_converted(reference, other, **common).close()


def _saved_model(path: Path) -> bool:
    return path.is_dir() or path.name in SAVED_MODEL_FILES


def _open_against(request: dict, common: dict):
    """A model other than the reference, opened as :func:`~.runner.open_pair` opens the
    converted one; a SavedModel needs nothing of the reference (its signature says its
    inputs and outputs; :func:`_open_all` compares them), so the reference is not loaded."""
    path = Path(request["model"])
    if _saved_model(path):
        return open_model(path, **common)
    with open_model(request["reference"], checkpoint=request["checkpoint"],
                    init_ops=request["init_ops"], **common) as reference:
        return open_converted(reference, path, **common)


def format_result(result: BenchResult) -> str:
    rows = [("original", result.original), ("converted", result.converted)]
    lines = [f"{result.runs} timed runs each after {result.warmup} warm-up, "
             f"{result.method()}, batch {result.batch}"]
    for name, t in rows:
        lines.append(f"{name:<9}  median {t.median_ms:9.3f} ms  (p10 {t.p10_ms:.3f}, p90 "
                     f"{t.p90_ms:.3f})  {t.throughput:10.1f} samples/s")
    low, high = result.speedup_range()
    lines.append(f"speed-up (original / converted median latency): {result.speedup:.2f}x "
                 f"(per round p10-p90 {low:.2f}-{high:.2f}x)")
    return "\n".join(lines)
