"""The cost model's rates as data: the shipped table, one measured on this CPU, or a file.

The cost model of bfloat16 on a CPU (:mod:`amp_rewrite.paint.costs`, docs/decisions.md "The
cost model") weighs what a low-precision island saves against what it loses with a few rates,
each timed on single ops: picoseconds a matrix op saves per FLOP, an unfused activation loses
per element, a weight's cast costs per element ... They are data, as the rule lists are:
``rules/costs.toml`` of the checkout, shipped as ``amp_rewrite.rules.defaults``, holds the
defaults, measured on one CPU (its ``[measured]`` table says which).

``amp-rewrite costs measure`` (:mod:`amp_rewrite.tools.op_costs`) times the same ops on the
CPU it runs on and writes a table of the same form into a per-user folder
(:func:`costs_dir`), named by a key of this CPU (:func:`machine_key`: its model, the ISA flags
that change what a bfloat16 op costs, and the TensorFlow version). A conversion takes, in
order: the table ``--costs FILE`` names (``--costs shipped``: the defaults), the measured table
whose key is this machine's, the shipped one (:func:`choose`). The report's ``cost_model``
entry says which decided.

A malformed table is an :class:`~amp_rewrite.core.errors.InputError` naming the file and the
line. Standard library only (and no TensorFlow import): the CLI checks ``--costs`` before it
loads TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.resources
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..core import hardware
from ..core.errors import InputError
from .tomlfile import read_toml

#: the activations the cost model weighs where TensorFlow runs them unfused in bfloat16
UNFUSED_OPS = ("Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus",
               "Erf", "Exp")
#: each rate of ``[rates]``: its unit and what it is
RATES = {
    "saved_ps_per_flop": ("ps per FLOP", "what a matrix op saves in bfloat16"),
    "fp32_ps_per_flop": ("ps per FLOP", "what a matrix op takes in float32"),
    "cast_ps_per_element": ("ps per element", "casting a float32 weight to bfloat16"),
    "folded_ps_per_element": ("ps per element", "a batch norm's Mul or AddV2 in float32"),
}
#: the table of ``[rates]`` the unfused activations' rates sit in (ps per element they write)
UNFUSED = "unfused_ps_per_element"
#: the table of ``[rates]`` (optional) that says what each kind of matrix op saves per FLOP
#: where it differs from ``saved_ps_per_flop``: on AMX a depthwise convolution can lose in
#: bfloat16 where a Conv2D gains, on a CPU without a bfloat16 unit a MatMul loses where Eigen's
#: convolutions break even
SAVED_BY_OP = "saved_ps_per_flop_by_op"
#: the kinds :data:`SAVED_BY_OP` names, and the ops each stands for (gradients, batched and
#: fused forms included: the same kernels)
SAVED_KINDS = {
    "Conv2D": ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
               "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "Conv3DBackpropInput",
               "Conv3DBackpropFilter", "_FusedConv2D"),
    "DepthwiseConv2dNative": ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                              "DepthwiseConv2dNativeBackpropFilter"),
    "MatMul": ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
               "_FusedMatMul"),
}
_KIND_OF = {op: kind for kind, ops in SAVED_KINDS.items() for op in ops}
#: rates that cannot be below 0 (times in float32, a cast); the others are differences
_NOT_NEGATIVE = ("fp32_ps_per_flop", "cast_ps_per_element", "folded_ps_per_element")
#: what ``[measured]`` may say: the CPU and TensorFlow, and how
_MEASURED_KEYS = {"cpu": str, "tensorflow": str, "source": str, "key": str, "cores": int,
                  "rounds": int, "shape": str, "quick": bool, "date": str}
#: the environment variable naming the folder measured tables are kept in (else
#: ``$XDG_CACHE_HOME/amp-rewrite``, else ``~/.cache/amp-rewrite``)
DIR_VARIABLE = "AMP_REWRITE_COSTS_DIR"
#: ``--costs``'s name for the shipped table of this CPU's class
SHIPPED = "shipped"
#: the shipped table of each CPU class (:data:`~amp_rewrite.core.hardware.CPU_CLASSES`), a file
#: of ``rules/``; None: no table measured on such a CPU yet, the class in
#: :data:`STAND_INS` stands in (and the summary says so)
SHIPPED_FILES = {"avx512-bf16": "costs.toml", "avx2": "costs-avx2.toml", "amx-bf16": None}
#: whose rates a class without a measured table takes: an AMX CPU saves more per FLOP than an
#: AVX512-BF16 one, so with its rates the estimate errs towards float32 there
STAND_INS = {"amx-bf16": "avx512-bf16"}
#: the CPU flags (as /proc/cpuinfo names them) that change what a bfloat16 op costs: the
#: matrix units and the vector widths oneDNN and Eigen pick their kernels by
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


@dataclass(frozen=True)
class CostTable:
    """The rates one conversion weighs islands with (see :data:`RATES`), and where they come
    from: ``kind`` ``"shipped"`` (the defaults), ``"measured"`` (this CPU's, found by its key)
    or ``"file"`` (``--costs``); ``path`` the file read (None for the shipped one, whose path
    is the installation's); ``cpu`` and ``tensorflow`` what they were measured on."""

    saved_ps_per_flop: float
    fp32_ps_per_flop: float
    cast_ps_per_element: float
    folded_ps_per_element: float
    unfused_ps_per_element: Mapping[str, float] = field(default_factory=dict)
    saved_ps_per_flop_by_op: Mapping[str, float] = field(default_factory=dict)
    kind: str = "shipped"
    path: str | None = None
    cpu: str = ""
    tensorflow: str = ""
    quick: bool = False
    key: str | None = None   # the machine a measured table was measured for (machine_key)
    source: str = ""         # where a table's rates are recorded ([measured] source)
    cpu_class: str = ""      # a shipped table: the CPU class it is for (hardware.CPU_CLASSES)
    stands_in_for: str = ""  # a shipped table taken for a class with none measured yet

    def saved(self, op: str) -> float:
        """ps per FLOP the matrix op ``op`` saves in bfloat16: its kind's rate where the table
        has one (:data:`SAVED_KINDS`), else ``saved_ps_per_flop``."""
        return self.saved_ps_per_flop_by_op.get(_KIND_OF.get(op, ""), self.saved_ps_per_flop)

    def saves_nothing(self) -> bool:
        """Whether no matrix op saves anything in bfloat16 by this table (a CPU without a
        bfloat16 matrix unit): every island then stays float32."""
        return max([self.saved_ps_per_flop, *self.saved_ps_per_flop_by_op.values()]) <= 0

    def slower(self, op: str) -> bool:
        """Whether ``op`` runs slower unfused in bfloat16 than in float32 by this table."""
        return self.unfused_ps_per_element.get(op, 0) > 0

    def cite(self) -> str:
        """Where the rates come from, as a reason says it."""
        if self.kind == "shipped":
            return self.source or f"the shipped cost table for {self.cpu_class} CPUs"
        where = "measured on this CPU" if self.kind == "measured" else "measured on " + self.cpu
        return f"the cost table {where}, {self.path}"

    def summary(self) -> str:
        """One line: which table decided, and what it was measured on."""
        if self.kind == "shipped":
            standing = (f"; no table is measured on {self.stands_in_for} CPUs yet, so these "
                        f"{self.cpu_class} rates stand in, which save less per FLOP: the "
                        "estimate errs towards float32" if self.stands_in_for else "")
            return (f"the shipped cost table for {self.stands_in_for or self.cpu_class} CPUs "
                    f"(measured on {self.cpu}, TensorFlow {self.tensorflow}{standing}; "
                    "amp-rewrite costs measure times this CPU's)")
        quick = ", --quick" if self.quick else ""
        if self.kind == "measured":
            return f"the cost table measured on this CPU ({self.path}{quick})"
        return (f"the cost table {self.path} (--costs; measured on {self.cpu}, TensorFlow "
                f"{self.tensorflow}{quick})")

    def to_dict(self) -> dict:
        """The report's record of the table: where it comes from and its rates."""
        return {"table": self.kind, "path": self.path, "cpu": self.cpu,
                "tensorflow": self.tensorflow, "cpu_class": self.cpu_class,
                "stands_in_for": self.stands_in_for,
                "rates": {**{name: getattr(self, name) for name in RATES},
                          UNFUSED: dict(self.unfused_ps_per_element),
                          SAVED_BY_OP: dict(self.saved_ps_per_flop_by_op)}}


# ----------------------------------------------------------------- reading
def shipped_path(cpu_class: str = "avx512-bf16") -> Path:
    """The shipped table of ``cpu_class`` (one with a file in :data:`SHIPPED_FILES`):
    ``rules/costs*.toml`` of the checkout, in the wheel's rule defaults."""
    return (Path(str(importlib.resources.files("amp_rewrite.rules.defaults")))
            / SHIPPED_FILES[cpu_class])


def shipped(cpu_class: str | None = None) -> CostTable:
    """The shipped table of ``cpu_class`` (default: this CPU's,
    :func:`~amp_rewrite.core.hardware.cpu_class`), read once."""
    return _shipped(cpu_class or hardware.cpu_class())


@functools.lru_cache(maxsize=None)
def _shipped(cpu_class: str) -> CostTable:
    if SHIPPED_FILES[cpu_class] is None:
        stand_in = STAND_INS[cpu_class]
        return dataclasses.replace(_shipped(stand_in), stands_in_for=cpu_class)
    return dataclasses.replace(read_table(shipped_path(cpu_class), "shipped"),
                               cpu_class=cpu_class)


def read_table(path, kind: str = "file") -> CostTable:
    """The table in ``path``, checked: ``[rates]`` holds every rate of :data:`RATES` and
    ``[rates.unfused_ps_per_element]`` every op of :data:`UNFUSED_OPS`, each a finite number
    (the float32 times and the cast at least 0), nothing else; ``[measured]`` says the CPU and
    the TensorFlow version. Else an :class:`InputError` naming the file and the line."""
    path = Path(path)
    text, data = read_toml(path, "cost table", InputError)
    fail = _Failing(path, text)
    _only(fail, data, {"measured", "rates"}, None)
    measured, rates = _table(fail, data, "measured"), _table(fail, data, "rates")
    _only(fail, rates, set(RATES) | {UNFUSED, SAVED_BY_OP}, "rates")
    unfused = _table(fail, rates, UNFUSED, "rates")
    _only(fail, unfused, set(UNFUSED_OPS), f"rates.{UNFUSED}")
    values = {name: _rate(fail, rates, name, "rates") for name in RATES}
    ops = {op: _rate(fail, unfused, op, f"rates.{UNFUSED}") for op in UNFUSED_OPS}
    by_op = _table(fail, rates, SAVED_BY_OP, "rates") if SAVED_BY_OP in rates else {}
    _only(fail, by_op, set(SAVED_KINDS), f"rates.{SAVED_BY_OP}")
    by_op = {kind: _rate(fail, by_op, kind, f"rates.{SAVED_BY_OP}") for kind in by_op}
    _only(fail, measured, set(_MEASURED_KEYS), "measured")
    for key, kind_of in _MEASURED_KEYS.items():
        if key in measured and not isinstance(measured[key], kind_of):
            raise fail(f"[measured] {key} = {measured[key]!r}: must be a {kind_of.__name__}", key)
    for key in ("cpu", "tensorflow"):
        if key not in measured:
            raise fail(f"[measured] has no {key}: say what the rates were measured on",
                       "measured")
    return CostTable(**values, unfused_ps_per_element=ops, saved_ps_per_flop_by_op=by_op,
                     kind=kind,
                     path=None if kind == "shipped" else str(path), cpu=measured["cpu"],
                     tensorflow=measured["tensorflow"], quick=measured.get("quick", False),
                     key=measured.get("key"), source=measured.get("source", ""))


class _Failing:
    """Builds the InputError of one file, with the line of the key it names."""

    def __init__(self, path: Path, text: str):
        self.path, self.lines = path, text.splitlines()

    def __call__(self, message: str, key: str | None = None) -> InputError:
        return InputError(f"{self.path}:{self.line(key)}: {message}")

    def line(self, key: str | None) -> int:
        """The first line that sets ``key`` or opens a table of that name (1 if none)."""
        if key is not None:
            pattern = re.compile(rf"^\s*(\[+\s*[\w.]*\b{re.escape(key)}\s*\]+|{re.escape(key)}\s*=)")
            for number, line in enumerate(self.lines, 1):
                if pattern.match(line):
                    return number
        return 1


def _table(fail: _Failing, data: dict, name: str, where: str | None = None) -> dict:
    value = data.get(name)
    full = f"{where}.{name}" if where else name
    if value is None:
        raise fail(f"no [{full}] table", where)
    if not isinstance(value, dict):
        raise fail(f"{name} = {value!r}: [{full}] must be a table", name)
    return value


def _only(fail: _Failing, data: dict, known: set[str], table: str | None) -> None:
    for key in data:
        if key not in known:
            where = f"[{table}] " if table else ""
            raise fail(f"{where}unknown key {key!r} (known: {', '.join(sorted(known))})", key)


def _rate(fail: _Failing, data: dict, name: str, table: str) -> float:
    if name not in data:
        raise fail(f"[{table}] has no {name}", table)
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(f"[{table}] {name} = {value!r}: must be a finite number", name)
    if name in _NOT_NEGATIVE and value < 0:
        raise fail(f"[{table}] {name} = {value!r}: a time, must be 0 or more", name)
    return float(value)


# ----------------------------------------------------------------- this CPU's table
def tensorflow_version() -> str:
    """The installed TensorFlow's version, without importing it where it is not yet."""
    loaded = sys.modules.get("tensorflow")
    if loaded is not None and hasattr(loaded, "__version__"):
        return loaded.__version__
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def machine_key() -> str:
    """What a measured table holds for: this CPU's model, the :data:`KEY_FLAGS` it has, and
    the TensorFlow version (its kernels decide what an op costs)."""
    flags = ",".join(f for f in KEY_FLAGS if f in hardware.cpu_flags())
    return f"{hardware.cpu_model()} | {flags or 'none'} | tensorflow {tensorflow_version()}"


def costs_dir() -> Path:
    """The folder measured tables are kept in: ``$AMP_REWRITE_COSTS_DIR``, else
    ``$XDG_CACHE_HOME/amp-rewrite``, else ``~/.cache/amp-rewrite``."""
    given = os.environ.get(DIR_VARIABLE)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "amp-rewrite"


def measured_path(key: str | None = None) -> Path:
    """Where the table measured on the machine of ``key`` (default this one's) is kept."""
    digest = hashlib.sha256((key or machine_key()).encode()).hexdigest()[:12]
    return costs_dir() / f"costs-{digest}.toml"


def choose(costs: str | os.PathLike | None = None) -> CostTable:
    """The table a conversion weighs with: ``costs`` (``--costs``: a file, :data:`SHIPPED`,
    or a CPU class of :data:`SHIPPED_FILES`, whose shipped table it names), else the one
    measured on this machine where :func:`measured_path` holds it, else the shipped one of this
    CPU's class. A measured table that says it is another machine's is refused,
    naming it: it was copied there, or this machine changed."""
    if costs is not None and str(costs) == SHIPPED:
        return shipped()
    if costs is not None and str(costs) in SHIPPED_FILES:   # another CPU class's rates
        return shipped(str(costs))
    if costs is not None:
        return read_table(costs, "file")
    mine = machine_key()
    path = measured_path(mine)
    if not path.is_file():
        return shipped()
    table = read_table(path, "measured")
    if table.key != mine:
        raise InputError(f"{path}: this cost table was measured for {table.key!r}, not this "
                         f"machine ({mine!r}): run amp-rewrite costs measure again, "
                         "or delete it")
    return table


# ----------------------------------------------------------------- writing
def format_table(rates: Mapping[str, float], unfused: Mapping[str, float],
                 measured: Mapping[str, object],
                 saved_by_op: Mapping[str, float] | None = None) -> str:
    """A table as :func:`read_table` reads it: ``measured`` what it was measured on (the keys
    of :data:`_MEASURED_KEYS`), the rates with their units, and what each kind of matrix op
    saves (``saved_by_op``, :data:`SAVED_KINDS`) where given."""
    lines = ["# amp-rewrite's cost model rates, measured by amp-rewrite costs measure",
             '# (docs/decisions.md "The cost model")', "", "[measured]"]
    lines += [f"{key} = {_toml(value)}" for key, value in measured.items()]
    lines += ["", "[rates]"]
    for name, (unit, what) in RATES.items():
        lines += [f"# {unit}: {what}", f"{name} = {_number(rates[name])}"]
    lines += ["", f"[rates.{UNFUSED}]",
              "# ps per element each activation loses unfused in bfloat16 (0 or less: not slower)"]
    lines += [f"{op} = {_number(unfused[op])}" for op in UNFUSED_OPS]
    if saved_by_op:
        lines += ["", f"[rates.{SAVED_BY_OP}]",
                  "# ps per FLOP each kind of matrix op saves in bfloat16 (its gradients, "
                  "batched and fused forms alike)"]
        lines += [f"{kind} = {_number(saved_by_op[kind])}" for kind in SAVED_KINDS
                  if kind in saved_by_op]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 10 else f"{value:.0f}"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
