"""How much matrix work an op does per element of data it moves, from the shapes of its weights.

A MatMul with a weight of shape (p, q) does 2·p·q FLOPs for every row it reads (p elements)
and writes (q elements); a convolution with a kh×kw×cin×cout filter does 2·kh·kw·cin·cout
FLOPs per output pixel, for about cin elements read and cout written. Their ratio, FLOPs per
element moved (:func:`matrix_intensity`), does not depend on the batch, so it is known before
running. Where it is small the op is memory-bound: the casts around it and its low-precision
neighbours cost more than the 16-bit matrix unit saves (measured on an AVX512-BF16 CPU, an
isolated bfloat16 MatMul between casts breaks even near 50; see BENCHMARKS.md "Small matrix
ops").

A weight is a Const, a variable read (in a function body, of the resource argument the
variable reaches it as: ``schema.functiondef.variable_argument_shapes``), or what an op's output updates (a weight gradient
feeds the variable's update); other shapes are not inferred (None: unknown).

:func:`runtime_estimate` weighs a whole island on a CPU with a bfloat16 matrix unit: time its
matrix ops save (per FLOP) against time its activations lose where TensorFlow runs them in
bfloat16 with Eigen loops slower than its float32 ones (per element), unless the oneDNN remapper
fuses them into the convolution or MatMul before them; and the casts of the weights its matrix
ops read from variables, once a run. The rates are a
:class:`~amp_rewrite.rules.cost_table.CostTable`: the shipped one (``rules/costs.toml``,
measured on an AVX512-BF16 CPU), or one measured on this CPU (``amp-rewrite costs measure``),
or ``--costs FILE`` (docs/decisions.md "The cost model").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..core.dtypes import FLOATING, RESOURCE
from ..core.ir import Graph, Node, TensorRef
from ..core.ops import ENTER_OPS, MATRIX_OPS, STORED_VARIABLE, VARIABLE_OPS
from ..rules.cost_table import CostTable, shipped
from ..schema.consts import is_all_ones
from ..schema.opdefs import is_variable_write
from ..schema.shapes import (FOLDED_DEPTH, FOLDED_OPS, Shapes, const_behind, convolution_output,
                             einsum_sizes, folded_value, parse_einsum)

_IDENTITIES = frozenset({"Identity"})
# ops a weight passes through unchanged on its way to a matrix op (or its gradient to an update)
_PASS_THROUGH = frozenset({"Identity", "Cast", "ReadVariableOp", "Snapshot", "StopGradient",
                           "AddN", "CollectiveReduce", "CollectiveReduceV2", "NcclAllReduce",
                           "HorovodAllreduce"}) | ENTER_OPS
_FILTER = {"Conv2D": 1, "Conv2DBackpropInput": 1, "Conv2DBackpropFilter": 1, "Conv3D": 1,
           "Conv3DBackpropInputV2": 1, "Conv3DBackpropFilterV2": 1, "DepthwiseConv2dNative": 1,
           "DepthwiseConv2dNativeBackpropInput": 1, "DepthwiseConv2dNativeBackpropFilter": 1}
# ops whose filter input is the filter's shape (a Const of ints), not the filter
_FILTER_SIZES = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                           "DepthwiseConv2dNativeBackpropFilter"})


def matrix_intensity(graph: Graph, node: Node) -> float | None:
    """FLOPs per element of activations read and written, or None when not known."""
    if node.op == "MatMul":
        shape = _weight_shape(graph, node)
        if shape is None or len(shape) != 2:
            return None
        p, q = shape
        return 2.0 * p * q / (p + q) if p + q else None
    if node.op in _FILTER:
        shape = _filter_shape(graph, node)
        if shape is None or len(shape) < 4:
            return None
        window, cin, cout = math.prod(shape[:-2]), shape[-2], shape[-1]
        if node.op.startswith("Depthwise"):   # cout is a channel multiplier
            return 2.0 * window * cout / (1 + cout)
        return 2.0 * window * cin * cout / (cin + cout) if cin + cout else None
    if node.op == "Einsum":
        return _einsum_intensity(graph, node)
    return None


def _einsum_intensity(graph: Graph, node: Node) -> float | None:
    """An Einsum reading a stored weight (a Keras EinsumDense kernel): as a MatMul's, p the
    product of the weight's dimensions it sums over and q of those it keeps. None where no
    operand is a stored weight with a shape that fits its labels (attention's two activations;
    a weight gradient, whose split of the weight into p and q the equation does not tell)."""
    parsed = parse_einsum(node.attr["equation"].s.decode())
    if parsed is None:
        return None
    operands, output = parsed
    for labels, ref in zip(operands, graph.inputs(node.name)):
        shape = _stored_shape(graph, ref.node)
        if shape is None or "." in labels or len(shape) != len(labels):
            continue
        p = math.prod(d for c, d in zip(labels, shape) if c not in output)
        q = math.prod(d for c, d in zip(labels, shape) if c in output)
        return 2.0 * p * q / (p + q) if p + q else None
    return None


def _weight_shape(graph: Graph, node: Node) -> list[int] | None:
    for ref in graph.inputs(node.name):
        shape = _stored_shape(graph, ref.node)
        if shape is not None:
            return shape
    return _updated_shape(graph, node.name)   # a weight gradient: the shape of what it updates


def _filter_shape(graph: Graph, node: Node) -> list[int] | None:
    ref = graph.inputs(node.name)[_FILTER[node.op]]
    if node.op in _FILTER_SIZES:
        src = graph.node(ref.node)
        if src.op == "Const" and src.attr["value"].tensor.int_val:
            return list(src.attr["value"].tensor.int_val)
        return _updated_shape(graph, node.name)
    return _stored_shape(graph, ref.node)


def _stored_shape(graph: Graph, name: str) -> list[int] | None:
    """The static shape of a stored value (Const, variable) reaching ``name`` unchanged."""
    node = _stored_source(graph, name)
    if node is None:
        return None
    if node.op == "Const":
        dims = [d.size for d in node.attr["value"].tensor.tensor_shape.dim]
        return dims if all(d >= 0 for d in dims) else None
    if node.op == "Placeholder" and STORED_VARIABLE not in node.attr:   # a function's variable
        shapes = node.attr["_handle_shapes"].list.shape
        dims = [d.size for d in shapes[0].dim] if len(shapes) == 1 else []
    else:
        dims = [d.size for d in node.attr["shape"].shape.dim] if "shape" in node.attr else []
    return dims if dims and all(d >= 0 for d in dims) else None


def _updated_shape(graph: Graph, name: str) -> list[int] | None:
    """The shape of the variable a value updates (through pass-through ops), if it does: of
    the first variable write, by name, that ``name`` or a pass-through op after it feeds as
    the value (not the handle)."""
    def carries(node: Node) -> bool:   # the value itself, or a pass-through op after it
        return node.name == name or node.op in _PASS_THROUGH

    for src in sorted(graph.descendants([name], past=carries)):   # sorted: the first write
        if not carries(graph.node(src)):
            continue
        for reader, port in graph.consumers(src):
            if port > 0 and is_variable_write(graph.node(reader).op):
                shape = _stored_shape(graph, graph.inputs(reader)[0].node)
                if shape is not None:
                    return shape
    return None


# The rates (ps a FLOP saved, ps an element an unfused activation loses, a weight's cast ...)
# are a CostTable (rules/costs.toml, or one measured on this CPU). A weight read from a variable
# is cast to bfloat16 on every run (a Const is stored in bfloat16 by painting, once), whatever
# the batch, while the matrix ops save per sample: where the graph leaves the batch open, the
# estimate takes the batch ``convert --shape`` gives, else DEFAULT_BATCH samples a run. One, the
# batch where casts weigh most: a model served one sample at a time must not run slower than
# float32 (BENCHMARKS.md "Batch size and weight casts": Xception painted whole ran at 0.41x FP32
# at batch 1 and 1.03x at 8; the estimate turned between the same batches for every model
# there), and where a larger batch would gain, the summary says from which batch on.
DEFAULT_BATCH = 1
# what TensorFlow's remapper (grappler remapper.cc) fuses on a CPU into each contraction + bias:
# Tanh and Sigmoid only after a MatMul, LeakyRelu not after a depthwise convolution
_FUSES = {"Conv2D": frozenset({"Relu", "Relu6", "Elu", "LeakyRelu"}),
          "DepthwiseConv2dNative": frozenset({"Relu", "Relu6", "Elu"}),
          "MatMul": frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid"})}
# activations that folding batch norms into convolutions (--fold-constants) can make fusable
FOLDING_FUSES = _FUSES["Conv2D"] | _FUSES["DepthwiseConv2dNative"]


@dataclass
class Estimate:
    """An island's time in bfloat16 against float32, in microseconds a run of the shapes the
    graph states, or a sample where it leaves the batch open."""

    flops: float = 0.0                    # matrix FLOPs per sample
    saved_us: float = 0.0                 # what the matrix ops save
    lost_us: float = 0.0                  # what the unfused slow ops lose
    slow: dict[str, int] = field(default_factory=dict)   # op -> how many unfused
    cast_us: float = 0.0                  # casting variable weights, per sample
    weights: int = 0                      # elements of variable weights cast a run
    batch: int = DEFAULT_BATCH            # samples a run an open batch was taken as
    open_cast_us: float = 0.0             # of cast_us, what an open batch shares, a run
    per_row: bool = False                 # counted per row of matrix ops whose rows are unknown
    # the first dimensions the counts state (the graph's, or --shape's through the calls that
    # pass it on): counted per run of that batch; empty where the batch is open (per sample)
    rows: tuple[int, ...] = ()
    told: bool = False                    # batch was given (--shape), not DEFAULT_BATCH
    rates: str = ""                       # where the rates come from (CostTable.cite)

    @property
    def samples(self) -> int:
        """The samples a run the counts stand for: the batch they state (the smallest first
        dimension: a flattened sequence's rows are more), 1 where it is open."""
        return min(self.rows) if self.rows else 1

    @property
    def pays_from(self) -> int | None:
        """The least batch at which this island would gain, where only the casts an open batch
        shares keep it from gaining now; None where no batch would make it gain."""
        shared = self.open_cast_us / self.batch
        rest = self.saved_us - self.lost_us - (self.cast_us - shared)
        if not self.open_cast_us or rest <= 0:
            return None
        return max(self.batch + 1, math.ceil(self.open_cast_us / rest))

    @property
    def slower(self) -> bool:
        return self.lost_us + self.cast_us > self.saved_us

    def _from(self) -> str:
        pays = self.pays_from
        return (f": from a batch of {pays} on it would gain, --shape tells the batch"
                if pays else "")

    def unit(self) -> str:
        """What the times count: a run of the batch the shapes state, else a sample."""
        return "a run" if self.rows else "a sample"

    def weighed_at(self) -> str:
        """The batch the estimate stands for, as a reason says it."""
        if self.rows:
            return f"a batch of {self.samples}"
        return f"a batch of {self.batch}" if self.told else f"an open batch as {self.batch}"

    def describe(self, tname: str) -> str:
        """The reason an island stays float32, from "whose" on."""
        if self.saved_us < 0 and not self.slow and not self.weights:
            return (f"whose {self.flops / 1e6:.2f} MFLOPs of matrix work run slower in {tname} "
                    f"than in float32 on this CPU: they would lose about "
                    f"{microseconds(-self.saved_us)} µs {self.unit()} ({self.weighed_at()}; "
                    f"{self.rates}; --min-matrix-intensity 0 paints it anyway)")
        if self.cast_us >= self.lost_us:
            return (f"whose variable weights ({self.weights} elements) cast to {tname} on every "
                    f"run would cost about {self.cast_us:.2f} µs {self.unit()} on a CPU, with "
                    f"{self.lost_us:.2f} µs its unfused activations lose, more than the "
                    f"{self.saved_us:.2f} µs its {self.flops / 1e6:.2f} MFLOPs of matrix work "
                    f"save ({self.weighed_at()}{self._from()}; BENCHMARKS.md "
                    "\"Batch size and weight casts\"; "
                    "--min-matrix-intensity 0 paints it anyway)")
        ops = ", ".join(f"{n} {op}" for op, n in sorted(self.slow.items()))
        if self.per_row:
            return (f"whose unfused {tname} activations ({ops}) would lose about "
                    f"{self.lost_us * 1e3:.0f} ns per row of its matrix ops on a CPU, more "
                    f"than the {self.saved_us * 1e3:.0f} ns their "
                    f"{self.flops / 1e6:.2f} MFLOPs a row save (their rows are not known from "
                    f"the graph, a loop's state say; both grow with them; {self.rates}; "
                    "--min-matrix-intensity 0 paints it anyway)")
        return (f"whose unfused {tname} activations ({ops}) would lose about "
                f"{microseconds(self.lost_us)} µs {self.unit()} on a CPU, more than the "
                f"{microseconds(self.saved_us)} µs its {self.flops / 1e6:.0f} MFLOPs of matrix work save "
                f"(shapes as the graph states them, {self.weighed_at()}; {self.rates}; "
                "--min-matrix-intensity 0 paints it anyway)")


def microseconds(value: float) -> str:
    """Microseconds as a reason says them: whole ones, two decimals under ten."""
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def slow_unfused(graph: Graph, node: Node, island: set[str] | None = None,
                 costs: CostTable | None = None) -> bool:
    """Whether ``node`` is an op whose bfloat16 CPU kernel is slower than its float32 one (by
    ``costs``, default the shipped table) and that TensorFlow's remapper will not fuse into the
    contraction before it (or, a Sigmoid, into a Swish). ``island``: the names painted with it;
    a contraction outside it is float32, and the cast between them stops the fusion."""
    if not (costs or shipped()).slower(node.op):
        return False
    inputs = graph.inputs(node.name)
    if not inputs:
        return False
    if node.op == "Sigmoid" and _swish(graph, node, inputs[0]):
        return False
    if graph.node(inputs[0].node).op in _BATCH_NORMS:
        return not _fused_batch_norm(graph, node, inputs[0], island)
    contraction = _biased_contraction(graph, node, inputs[0], island)
    return contraction is None or node.op not in _FUSES[contraction.op]


def _swish(graph: Graph, node: Node, x: TensorRef) -> bool:
    """x * sigmoid(x), the Mul the Sigmoid's only reader: the remapper makes it one _MklSwish.
    Keras' ``swish`` / ``silu`` computes sigmoid(beta * x) with beta a Const 1, which grappler
    simplifies away first (a Keras 3 EfficientNet's swishes run as oneDNN's eltwise_swish), or
    constant folding makes an Identity of x, which grappler removes before the remapper looks
    (a frozen Keras 3 EfficientNetV2's swishes)."""
    if not graph.read_once(node.name):
        return False
    reader, port = graph.consumers(node.name)[0]
    if graph.node(reader).op != "Mul" or port >= 2:
        return False
    other = graph.inputs(reader)[1 - port]
    return (_past_identities(graph, other) == _past_identities(graph, x)
            or other == _times_one(graph, x))


def _past_identities(graph: Graph, ref: TensorRef) -> TensorRef:
    """The tensor ``ref`` passes on through Identity ops (``ref`` itself if it is none's)."""
    seen: set[str] = set()
    while graph.node(ref.node).op in _IDENTITIES and ref.node not in seen and graph.inputs(ref.node):
        seen.add(ref.node)
        ref = graph.inputs(ref.node)[0]
    return ref


def _times_one(graph: Graph, ref: TensorRef) -> TensorRef | None:
    """``y`` where ``ref`` is ``y * 1`` (a Mul by a Const of ones, either side), else None."""
    node = graph.node(ref.node)
    inputs = graph.inputs(node.name)
    if node.op != "Mul" or ref.port or len(inputs) != 2:
        return None
    for i, operand in enumerate(inputs):
        const = const_behind(graph, operand)
        if const is not None and is_all_ones(const):
            return inputs[1 - i]
    return None


def _biased_contraction(graph: Graph, act: Node, ref: TensorRef,
                        island: set[str] | None) -> Node | None:
    """The contraction the remapper would fuse ``act`` into, or None. ``ref`` must be a bias
    added to a Conv2D's, depthwise convolution's or MatMul's output: a BiasAdd whose bias is not
    all zeros (grappler's constant folding removes an add of zeros), or an add of a non-zero
    vector with one value per output channel after an NHWC contraction; between them may sit a
    Mul by a vector that constant folding multiplies into an NHWC Conv2D's Const filter. A bias
    or a scale may be a Const or computed from Consts alone (a frozen Keras batch norm's,
    :func:`~amp_rewrite.schema.shapes.folded_value`): constant folding computes it before the
    remapper runs. Each step is the only reader of the one before, none has
    control edges, and all are in ``island`` where one is given."""
    if ref.port or _controlled(graph, act.name):
        return None
    bias = graph.node(ref.node)
    if bias.op not in ("BiasAdd", "Add", "AddV2") or not _sole_step(graph, bias.name, island):
        return None
    inputs = graph.inputs(bias.name)
    if len(inputs) != 2:
        return None
    if bias.op == "BiasAdd":
        src, vec = inputs[0], _float_values(graph, inputs[1])
        if vec is not None and not vec.any():
            return None
    else:
        consts = [(i, v) for i, r in enumerate(inputs) if (v := _float_values(graph, r)) is not None]
        if len(consts) != 1:
            return None
        src, vec = inputs[1 - consts[0][0]], consts[0][1]
        dims = list(vec.shape)
        if not dims or any(d != 1 for d in dims[:-1]) or not vec.any():
            return None
    up = graph.node(src.node)
    if up.op == "Mul" and _sole_step(graph, up.name, island):
        muls = graph.inputs(up.name)
        scaled = [i for i, r in enumerate(muls) if _float_values(graph, r) is not None]
        conv = graph.node(muls[1 - scaled[0]].node) if len(scaled) == 1 else None
        if (conv is not None and conv.op == "Conv2D" and _nhwc(conv)
                and _float_const(graph, graph.inputs(conv.name)[1]) is not None):
            up = conv
    if up.op not in _FUSES or not _sole_step(graph, up.name, island) or src.port:
        return None
    if bias.op != "BiasAdd":   # an add counts as a bias with one value per channel, NHWC
        channels = _out_channels(graph, up)
        if not _nhwc(up) or channels is None or dims[-1] != channels:
            return None
    return up


_BATCH_NORMS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
# what follows an inference FusedBatchNorm into one kernel (measured against grappler in
# tests/test_costs.py): Conv2D + FusedBatchNorm + these make one _FusedConv2D; after a
# depthwise convolution only a Relu joins the batch norm (a _FusedBatchNormEx)
_FUSES_AFTER_BN = {"Conv2D": frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh"}),
                   "DepthwiseConv2dNative": frozenset({"Relu"})}


def _fused_batch_norm(graph: Graph, act: Node, ref: TensorRef, island: set[str] | None,
                      known=None) -> bool:
    """Whether ``act`` fuses with the inference batch norm ``ref`` (``is_training`` false, its
    four vectors Consts or computed from them, NHWC) and the contraction before it
    (:data:`_FUSES_AFTER_BN`); each step the only reader of the one before, with no control
    edges, and in ``island`` where one is given. ``known(graph, ref)`` tells whether a vector
    is one constant folding computes (default: its values are, :func:`_float_values`; the
    frozen estimate counts variables too, :func:`_stored_value`)."""
    known = known or (lambda g, r: _float_values(g, r) is not None)
    bn = graph.node(ref.node)
    training = bn.attr["is_training"].b if "is_training" in bn.attr else True   # OpDef default
    if (ref.port or _controlled(graph, act.name) or training
            or not _sole_step(graph, bn.name, island) or not _nhwc(bn)):
        return False
    inputs = graph.inputs(bn.name)
    if len(inputs) != 5 or inputs[0].port or not all(known(graph, r) for r in inputs[1:]):
        return False
    up = graph.node(inputs[0].node)
    return (act.op in _FUSES_AFTER_BN.get(up.op, ()) and _nhwc(up)
            and _sole_step(graph, up.name, island))


def _controlled(graph: Graph, name: str) -> bool:
    return bool(graph.control_inputs(name) or graph.control_consumers(name))


def _sole_step(graph: Graph, name: str, island: set[str] | None) -> bool:
    """One data reader, no control edges, and painted with the rest where that is known."""
    return (graph.read_once(name) and not graph.control_inputs(name)
            and (island is None or name in island))


def _nhwc(node: Node) -> bool:
    return "data_format" not in node.attr or node.attr["data_format"].s in (b"NHWC", b"")


def _out_channels(graph: Graph, node: Node) -> int | None:
    if node.op == "MatMul":
        shape = _stored_shape(graph, graph.inputs(node.name)[1].node)
        if shape is None or len(shape) != 2:
            return None
        return shape[0] if node.attr["transpose_b"].b else shape[1]
    shape = _filter_shape(graph, node)
    if shape is None or len(shape) != 4:
        return None
    return shape[2] * shape[3] if node.op.startswith("Depthwise") else shape[3]


def _float_values(graph: Graph, ref: TensorRef) -> np.ndarray | None:
    """The float values ``ref`` holds where constant folding knows them before the remapper
    runs (a Const, or computed from Consts alone), or None."""
    values = folded_value(graph, ref)
    return values if values is not None and values.dtype.kind == "f" else None


def _float_const(graph: Graph, ref: TensorRef) -> Node | None:
    """The float Const ``ref`` reads (through Identity), or None; its values are not read."""
    node = const_behind(graph, ref)
    return node if node is not None and node.attr["value"].tensor.dtype in FLOATING else None


def runtime_estimate(graph: Graph, shapes: Shapes, names, batch: int | None = None,
                     costs: CostTable | None = None) -> Estimate | None:
    """Time the nodes ``names`` (an island) save and lose in bfloat16 on a CPU, or
    None where a matrix op's FLOPs or a slow op's elements are not known from the graph (a
    gradient's convolution, an Einsum: their FLOPs are not worked out). Lost: what unfused slow
    activations lose, and casting the weights matrix ops read from variables, once a run.
    An island with neither loses nothing (an empty estimate), and no shape is worked out for
    it. ``batch``: the samples a run where the graph leaves the batch open (None:
    :data:`DEFAULT_BATCH`); ``costs``: the rates (None: the shipped table)."""
    costs = costs or shipped()
    est = Estimate(batch=batch or DEFAULT_BATCH, told=batch is not None, rates=costs.cite())
    members = set(names)
    island = sorted(members)
    slow = [name for name in island if slow_unfused(graph, graph.node(name), members, costs)]
    # one cast per variable read, however many matrix ops share it (an unrolled loop's steps)
    weights = {name: _variable_weight(graph, graph.node(name)) for name in island
               if graph.node(name).op in MATRIX_OPS}
    casts: dict[str, tuple[float, bool]] = {}   # variable -> µs a sample, open batch
    est.weights = sum({src: n for src, n in weights.values() if n}.values())
    # a matrix op this CPU runs slower in bfloat16 (a depthwise convolution on AMX, a MatMul
    # without a bfloat16 unit) is weighed even in an island with nothing else to lose
    losing = any(costs.saved(graph.node(name).op) <= 0 for name in weights)
    if not slow and not est.weights and not losing:
        return est
    # each count per row of a MatMul whose rows are not known (shapes.ROWS) or as the shapes
    # state it; ROWS weighs against ROWS, or against the one number of rows the island's other
    # counts state (a loop's step: its stated input, its state of run-time zeros), never
    # against an open batch nor a weight's cast once a run
    lost = {True: 0.0, False: 0.0}
    flops = {True: 0.0, False: 0.0}
    saved = {True: 0.0, False: 0.0}   # ps, each op's FLOPs at its kind's rate
    rows: set[int] = set()   # first dimensions of the counts that are not ROWS
    for name in slow:
        op = graph.node(name).op
        ref = TensorRef(name, 0)
        count = shapes.elements(ref)
        if count is None:
            return None
        lost[_rows(shapes, ref, rows)] += count * costs.unfused_ps_per_element[op] * 1e-6
        est.slow[op] = est.slow.get(op, 0) + 1
    for name in island:
        node = graph.node(name)
        if node.op in MATRIX_OPS:
            if node.op not in _FLOPS_PER_OUTPUT:
                return None
            per = _FLOPS_PER_OUTPUT[node.op](graph, shapes, node)
            ref = TensorRef(name, 0)
            count = shapes.elements(ref)
            if per is None or count is None:
                return None
            per_rows = _rows(shapes, ref, rows)
            flops[per_rows] += per * count
            saved[per_rows] += per * count * costs.saved(node.op)
            src, elements = weights[name]
            if elements:   # cast once a run: per sample, a share of the run's batch
                out = shapes.shape(ref)
                # a stated batch is in the element counts already: all per run
                shared = out is None or not out or out[0] < 0
                us = elements * costs.cast_ps_per_element * 1e-6 / (est.batch if shared else 1)
                if us > casts.get(src, (0.0, False))[0]:
                    casts[src] = (us, shared)
    est.rows = tuple(sorted(rows)) if rows and min(rows) > 0 else ()
    stated = 1   # what a ROWS count stands for: one row, or the island's stated rows
    if lost[True] or flops[True]:
        if casts or len(rows) > 1 or any(r < 0 for r in rows):
            return None
        stated = rows.pop() if rows else 1
        est.per_row = stated == 1 and not (lost[False] or flops[False])
    est.lost_us = lost[False] + stated * lost[True]
    est.flops = flops[False] + stated * flops[True]
    est.cast_us = sum(us for us, _ in casts.values())
    est.open_cast_us = sum(us * est.batch for us, shared in casts.values() if shared)
    est.saved_us = (saved[False] + stated * saved[True]) * 1e-6
    return est


def _rows(shapes: Shapes, ref: TensorRef, rows: set[int]) -> bool:
    """Whether ``ref``'s count is per ROWS; if not, its first dimension joins ``rows``."""
    if shapes.guessed(ref):
        return True
    shape = shapes.shape(ref)
    if shape:
        rows.add(shape[0])
    return False


def _variable_weight(graph: Graph, node: Node) -> tuple[str, int]:
    """The variable ``node`` reads as its weight (through pass-through ops; a SavedModel's
    function argument holding one included) and its elements; ("", 0) where its weight is a
    Const or is not known."""
    refs = ([graph.inputs(node.name)[_FILTER[node.op]]] if node.op in _FILTER
            else graph.inputs(node.name) if node.op in ("MatMul", "Einsum") else [])
    for ref in refs:
        src = _stored_source(graph, ref.node)
        if _cast_a_run(src):
            shape = _stored_shape(graph, src.name)
            if shape is not None:
                return src.name, math.prod(shape)
    return "", 0


def _stored_source(graph: Graph, name: str) -> Node | None:
    """The Const or variable whose value reaches ``name`` unchanged (through pass-through ops,
    :meth:`~amp_rewrite.core.ir.Graph.origin`), or None. A variable --freeze keeps is its
    stand-in (:data:`~amp_rewrite.core.ops.STORED_VARIABLE`)."""
    node = graph.node(graph.origin(name, _PASS_THROUGH))
    if node.op in ("Const", "VarHandleOp", "VariableV2", "Variable") or (
            node.op == "Placeholder" and ("_handle_shapes" in node.attr
                                          or STORED_VARIABLE in node.attr)):
        return node
    return None


def _cast_a_run(src: Node | None) -> bool:
    """Whether the stored value ``src`` is cast on every run a 16-bit op reads it: a variable,
    but not a Const nor a variable --freeze keeps, which are stored in the dtype painted."""
    return src is not None and src.op != "Const" and STORED_VARIABLE not in src.attr


def _conv_flops(graph: Graph, shapes: Shapes, node: Node) -> float | None:
    f = _filter_shape(graph, node)
    if f is None or len(f) != 4:
        return None
    return 2.0 * f[0] * f[1] * (f[2] if node.op == "Conv2D" else 1)


def _matmul_flops(graph: Graph, shapes: Shapes, node: Node) -> float | None:
    a = shapes.shape(graph.inputs(node.name)[0])
    if a is None and node.op == "MatMul":   # rows not known (shapes.ROWS): the weight's rows
        b = shapes.shape(graph.inputs(node.name)[1])
        if b is None or len(b) != 2:
            return None
        inner = b[1] if node.attr["transpose_b"].b else b[0]
        return 2.0 * inner if inner > 0 else None
    if a is None or len(a) < 2:
        return None
    if node.op == "MatMul":
        inner = a[0] if node.attr["transpose_a"].b else a[1]
    else:
        inner = a[-2] if node.attr["adj_x"].b else a[-1]
    return 2.0 * inner if inner > 0 else None


def _input_grad_flops(graph: Graph, shapes: Shapes, node: Node) -> float | None:
    """A convolution's input gradient does the forward convolution's FLOPs (2·kh·kw·cin·cout
    for each pixel of the gradient it reads, 2·kh·kw·multiplier per channel for a depthwise
    one), spread over the input's pixels: per element of its output, 2·kh·kw·cout (the
    multiplier) times the gradient's pixels over the input's (1 at stride 1, "SAME"). The
    gradient's pixels are the forward convolution's, worked out from the output's shape (the
    forward input's) and the op's strides, padding and dilations."""
    f = _filter_shape(graph, node)
    out = shapes.shape(TensorRef(node.name, 0))
    grad = convolution_output(out, f, node)   # the forward convolution's output, from its attrs
    if f is None or len(f) != 4 or grad is None or out is None:
        return None
    _, axes = _spatial_axes(node)
    pixels = [(grad[a], out[a]) for a in axes]
    if any(g <= 0 or o <= 0 for g, o in pixels):
        return None
    return 2.0 * f[0] * f[1] * f[3] * math.prod(g for g, _ in pixels) / math.prod(
        o for _, o in pixels)


def _filter_grad_flops(graph: Graph, shapes: Shapes, node: Node) -> float | None:
    """A convolution's filter gradient sums, for each filter element, one product a pixel of the
    gradient it reads: 2·N·Hout·Wout FLOPs per element of its output (the filter), N an open
    batch counted as 1 (per sample, as :meth:`Shapes.elements` counts); Hout and Wout the
    forward convolution's, from its input's shape (input 0) and the op's attrs."""
    f = shapes.shape(TensorRef(node.name, 0)) or _filter_shape(graph, node)   # its output
    grad = convolution_output(shapes.shape(graph.inputs(node.name)[0]), f, node)
    if grad is None:
        return None
    _, axes = _spatial_axes(node)
    if any(grad[a] <= 0 for a in axes):
        return None
    return 2.0 * max(grad[0], 1) * grad[axes[0]] * grad[axes[1]]


def _spatial_axes(node: Node) -> tuple[int, list[int]]:
    return (1, [2, 3]) if not _nhwc(node) else (3, [1, 2])


def _einsum_flops(graph: Graph, shapes: Shapes, node: Node) -> float | None:
    """2 × the product of the labels an Einsum sums over (in an operand, not in the output),
    per element of its output; None where one of their sizes is open or the equation sums
    over an ellipsis or takes a diagonal (:func:`~amp_rewrite.schema.shapes.parse_einsum`)."""
    parsed = parse_einsum(node.attr["equation"].s.decode())
    if parsed is None:
        return None
    operands, output = parsed
    found = [shapes.shape(r) for r in graph.inputs(node.name)]
    if len(found) != len(operands) or any(f is None for f in found):
        return None
    if "." not in output and any("." in o for o in operands):
        return None   # an ellipsis summed over: how many dimensions it holds is per operand
    sizes = einsum_sizes(operands, found)
    if sizes is None:
        return None
    summed = {c for o in operands for c in o if c != "." and c not in output}
    if any(sizes[c] < 0 for c in summed):
        return None
    return 2.0 * math.prod(sizes[c] for c in summed)


_FLOPS_PER_OUTPUT = {"Conv2D": _conv_flops, "DepthwiseConv2dNative": _conv_flops,
                     "MatMul": _matmul_flops, "BatchMatMul": _matmul_flops,
                     "BatchMatMulV2": _matmul_flops, "BatchMatMulV3": _matmul_flops,
                     "Conv2DBackpropInput": _input_grad_flops,
                     "DepthwiseConv2dNativeBackpropInput": _input_grad_flops,
                     "Conv2DBackpropFilter": _filter_grad_flops,
                     "DepthwiseConv2dNativeBackpropFilter": _filter_grad_flops,
                     "Einsum": _einsum_flops}



def matrix_flops(graph: Graph, shapes: Shapes, node: Node) -> int | None:
    """The FLOPs one matrix op does a run of the shapes the graph states, an open batch counted
    as one sample (as :meth:`Shapes.elements` counts), as :func:`runtime_estimate` counts them;
    None where a shape it needs is not known, where its rows are not (:data:`~amp_rewrite.schema.shapes.ROWS`: a count per
    row is no count per run), or for an op this does not count (a fused op, an RNN cell)."""
    count = _FLOPS_PER_OUTPUT.get(node.op)
    if count is None:
        return None
    ref = TensorRef(node.name, 0)
    per, elements = count(graph, shapes, node), shapes.elements(ref)
    if per is None or elements is None or shapes.guessed(ref):
        return None
    return round(per * elements)


def graph_estimate(flops: dict[str, int | None], lowp: set[str],
                   weighed: list[tuple[set[str], Estimate | None]],
                   costs: CostTable | None = None,
                   ops: Mapping[str, str] | None = None) -> dict:
    """The cost model's estimate for a whole graph in bfloat16 on a CPU, from the FLOPs of its
    matrix ops (``flops``, name -> :func:`matrix_flops`), the names that ended in bfloat16
    (``lowp``) and the islands :func:`runtime_estimate` weighed (names, estimate): ``fp32_us``,
    the matrix work at float32's rate (``costs.fp32_ps_per_flop``; None: the shipped table);
    ``saved_us``, what the bfloat16 matrix ops save (each at its kind's rate,
    ``costs.saved``; ``ops``: name -> op, else ``saved_ps_per_flop``); ``lost_us``,
    what their islands lose
    to unfused activations and weight casts; ``unknown``, the bfloat16 matrix ops left out of
    both, whose FLOPs or island estimate is not known (or that no weighed island held: painted
    by an override after the weighing). Times in µs a run, a sample where the batch is open."""
    costs = costs or shipped()
    saved = lost = 0.0
    unknown, weighed_ops = 0, set()
    for names, est in weighed:
        painted = [n for n in names if n in flops and n in lowp]
        weighed_ops.update(painted)
        if not painted:
            continue
        if est is None or est.per_row or any(flops[n] is None for n in painted):
            unknown += len(painted)
            continue
        saved += sum(flops[n] * costs.saved((ops or {}).get(n, "")) for n in painted) * 1e-6
        lost += est.lost_us + est.cast_us
    unknown += sum(1 for n in flops if n in lowp and n not in weighed_ops)
    fp32 = sum(f for f in flops.values() if f) * costs.fp32_ps_per_flop * 1e-6
    return {"fp32_us": round(fp32, 3), "saved_us": round(saved, 3), "lost_us": round(lost, 3),
            "unknown": unknown}

# --- what freezing would gain (docs/savedmodels.md "When freezing gains") ---------------------
# A graph whose weights are variables (a SavedModel) pays two things a frozen graph converted
# with --fold-constants does not: the weights' casts on every run, and activations left unfused
# because the batch norms before them read variables, which neither grappler's constant folding
# nor bnfold folds into the convolution.


# Two rates of the CostTable are for this: what a batch norm's Mul or AddV2 takes per element
# in float32, which folding it into the convolution saves (folded_ps_per_element), and what
# matrix work takes per FLOP in float32, the scale freezing's gain is weighed on
# (fp32_ps_per_flop).


@dataclass
class FreezeGain:
    """What freezing the variables to Consts and converting with --fold-constants would change
    in the islands :func:`runtime_estimate` weighed, summed; times in µs a sample (an open batch
    as the batch it was taken as for the casts, as 1 for the rest, as :class:`Estimate` counts
    them; an island whose shapes state its batch, per sample of it)."""

    islands: int = 0         # islands weighed that read variables
    matrix_ops: int = 0      # matrix ops kept float32 as is that would run in 16 bits frozen
    fp32_us: float = 0.0     # their matrix work in float32 (CostTable.fp32_ps_per_flop)
    saved_us: float = 0.0    # what the 16-bit islands save as is (kept ones: nothing)
    frozen_us: float = 0.0   # what they would save frozen: 16 bits, folded batch norms

    @property
    def gain_us(self) -> float:
        return self.frozen_us - self.saved_us

    def add(self, est: Estimate, frozen: Estimate, folded_us: float, matrix_ops: int,
            costs: CostTable | None = None) -> None:
        """Count one island: ``est`` as it is, ``frozen`` and ``folded_us`` (its batch norms'
        elementwise ops folded away) from :func:`frozen_estimate`; an island whose shapes state
        its batch is counted per sample of it. ``costs``: the rates (None: the shipped table)."""
        per = est.samples
        self.islands += 1
        self.fp32_us += est.flops * (costs or shipped()).fp32_ps_per_flop * 1e-6 / per
        if not est.slower:
            self.saved_us += (est.saved_us - est.lost_us - est.cast_us) / per
        self.frozen_us += (folded_us + (0.0 if frozen.slower
                                        else frozen.saved_us - frozen.lost_us)) / per
        if est.slower and not frozen.slower:
            self.matrix_ops += matrix_ops

    def to_dict(self) -> dict:
        return {"islands": self.islands, "matrix_ops": self.matrix_ops,
                "fp32_us": round(self.fp32_us, 3), "saved_us": round(self.saved_us, 3),
                "frozen_us": round(self.frozen_us, 3), "gain_us": round(self.gain_us, 3)}


def reads_variables(graph: Graph) -> bool:
    """Whether ``graph`` holds a variable or, a function body, receives one (a resource
    argument): what freezing would turn into Consts. (Whether it trains, and freezing makes no
    sense, is the conversion's to tell: ``training.detect``.)"""
    return any(node.op in VARIABLE_OPS or (node.op == "Placeholder"
                                           and node.attr["dtype"].type == RESOURCE)
               for node in graph.nodes())


def frozen_estimate(graph: Graph, shapes: Shapes, names, est: Estimate,
                    costs: CostTable | None = None) -> tuple[Estimate, float] | None:
    """``est``, the island ``names``' :func:`runtime_estimate`, as if every variable were a
    Const and the graph converted with --fold-constants: no weight is cast, and an activation
    whose batch norm or bias reads variables fuses where it would with Consts
    (:func:`_fuses_frozen`); with it, the µs the batch norms' Mul and AddV2 take that folding
    removes (``costs.folded_ps_per_element``; None: the shipped table). None where an element
    count is not known. The values a variable holds are not read: its batch norms are taken as
    trained (an untrained one, offset 0, folds away, leaving no bias to fuse)."""
    costs = costs or shipped()
    members = set(names)
    out, folded = Estimate(flops=est.flops, saved_us=est.saved_us), 0.0
    for name in sorted(members):
        node = graph.node(name)
        fold = _folds_frozen(graph, node, members)
        if fold or (slow_unfused(graph, node, members, costs)
                    and not _fuses_frozen(graph, node, members)):
            count = shapes.elements(TensorRef(name, 0))
            if count is None:
                return None
            if fold:
                folded += count * costs.folded_ps_per_element * 1e-6
            else:
                out.lost_us += count * costs.unfused_ps_per_element[node.op] * 1e-6
                out.slow[node.op] = out.slow.get(node.op, 0) + 1
    return out, folded


def _folds_frozen(graph: Graph, node: Node, island: set[str]) -> bool:
    """Whether ``node`` is a batch norm's Mul or AddV2 that bnfold would fold into the
    convolution before it once variables are Consts, and that reads a variable now (a Const
    one folds without freezing)."""
    if node.op not in ("Mul", "Add", "AddV2") or not _sole_step(graph, node.name, island):
        return False
    x = _stored_operand(graph, node, (node.op,))
    if x is None or not any(_reads_variable(graph, r) for r in graph.inputs(node.name)):
        return False
    if node.op != "Mul":   # an offset: the scale before it folds too
        x = _past_scale(graph, x, island)
        if x is None:
            return False
    up = graph.node(x.node)
    return (up.op in ("Conv2D", "DepthwiseConv2dNative") and not x.port and _nhwc(up)
            and _sole_step(graph, up.name, island)
            and _stored_value(graph, graph.inputs(up.name)[1]))


# how many ops up from a batch norm's Mul or AddV2 a variable makes it one that folds only
# once frozen: a Keras batch norm's vectors are three or four ops from their variables, the
# convolution's filter two; further up are other layers'
VARIABLE_HOPS = 12


def _reads_variable(graph: Graph, ref: TensorRef) -> bool:
    """Whether a variable's value (:func:`_stored_source`) reaches ``ref`` within
    :data:`VARIABLE_HOPS` ops, not walking past a stored value."""
    sources: dict[str, Node | None] = {}

    def source(node: Node) -> Node | None:
        if node.name not in sources:
            sources[node.name] = _stored_source(graph, node.name)
        return sources[node.name]

    reached = graph.ancestors([ref.node], control=False, depth=VARIABLE_HOPS,
                              past=lambda node: source(node) is None)
    return any(_cast_a_run(src) for src in (source(graph.node(name)) for name in reached))


def _fuses_frozen(graph: Graph, act: Node, island: set[str]) -> bool:
    """Whether ``act`` fuses with the contraction before it once variables are Consts and
    --fold-constants ran: through an inference batch norm whose vectors are stored values
    (:data:`_FUSES_AFTER_BN`), or through a bias (BiasAdd, or an add bnfold makes one) with a
    batch norm's scale (a Mul bnfold multiplies into the filter) between them, on an NHWC
    convolution whose filter is stored (:data:`_FUSES`). Each step the only reader of the one
    before, no control edges, all in ``island``."""
    inputs = graph.inputs(act.name)
    if not inputs or inputs[0].port or _controlled(graph, act.name):
        return False
    src = graph.node(inputs[0].node)
    if not _sole_step(graph, src.name, island):
        return False
    if src.op in _BATCH_NORMS:
        return _fused_batch_norm(graph, act, inputs[0], island, known=_stored_value)
    x = _stored_operand(graph, src, ("BiasAdd", "Add", "AddV2"))
    if x is not None:
        x = _past_scale(graph, x, island)
    if x is None:
        return False
    up = graph.node(x.node)
    if up.op not in ("Conv2D", "DepthwiseConv2dNative") or x.port or not _nhwc(up):
        return False
    return (act.op in _FUSES[up.op] and _sole_step(graph, up.name, island)
            and _stored_value(graph, graph.inputs(up.name)[1]))


def _past_scale(graph: Graph, x: TensorRef, island: set[str]) -> TensorRef | None:
    """``x`` or, where it is a batch norm's scale (a Mul by a stored vector, the only reader of
    what it scales, in ``island``), what it scales; None where it is a Mul bnfold would not
    fold (no stored vector, or two)."""
    up = graph.node(x.node)
    if up.op != "Mul" or not _sole_step(graph, up.name, island):
        return x
    return _stored_operand(graph, up, ("Mul",))


def _stored_operand(graph: Graph, node: Node, ops: tuple[str, ...]) -> TensorRef | None:
    """The other input of ``node`` (one of ``ops``, two inputs) where exactly one is a stored
    value (a BiasAdd's bias must be its second); None otherwise."""
    inputs = graph.inputs(node.name)
    if node.op not in ops or len(inputs) != 2:
        return None
    stored = [_stored_value(graph, r) for r in inputs]
    if node.op == "BiasAdd":
        return inputs[0] if stored[1] and not stored[0] else None
    return inputs[1 - stored.index(True)] if stored.count(True) == 1 else None


def _stored_value(graph: Graph, ref: TensorRef) -> bool:
    """Whether ``ref`` is a Const or a variable's value (through pass-through ops), or computed
    from such alone by the elementwise ops constant folding evaluates once they are Consts
    (each without control inputs, reading output 0 of what it reads; through up to
    :data:`~amp_rewrite.schema.shapes.FOLDED_DEPTH` of them, as
    :func:`~amp_rewrite.schema.shapes.folded_value`)."""
    stored: dict[str, bool] = {}

    def source(node: Node) -> bool:
        if node.name not in stored:
            stored[node.name] = _stored_source(graph, node.name) is not None
        return stored[node.name]

    def folds(node: Node) -> bool:
        return (not source(node) and node.op in FOLDED_OPS
                and not graph.control_inputs(node.name))

    if ref.port:
        return False
    reached = graph.ancestors([ref.node], control=False, past=folds, depth=FOLDED_DEPTH)
    for name in reached:   # every one must fold: the order does not matter
        node = graph.node(name)
        if source(node):
            continue
        inputs = graph.inputs(name)
        if not folds(node) or not inputs or any(r.port or r.node not in reached for r in inputs):
            return False   # not folded, or past the bound (what it reads was not reached)
    return True
