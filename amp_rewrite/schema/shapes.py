"""Static tensor shapes, as far as the graph states them, for the cost model's element counts.

TensorFlow infers every shape when a graph is imported, but importing costs seconds on a graph
of 100k nodes (6 s measured), more than the whole conversion; this walks only the nodes it is
asked about and their producers, with the shape rules of the ops that carry most of a model's
activations: elementwise ops, convolutions, pooling, pads, matrix products, reshapes,
reductions, concatenations; where an op has no rule (or its rule cannot tell), the
``_output_shapes`` attr TensorFlow leaves on a SavedModel's function nodes. Anything else is
unknown (None), and so is everything computed from it.

A shape is a tuple of ints, -1 where the graph leaves a dimension open (the batch, mostly).
:meth:`Shapes.elements` counts per sample: an open first dimension counts as 1, any other open
dimension makes the count unknown.

A MatMul whose left operand's shape no rule knows (a loop's state, a tensor list's item, a
reshape to a size computed at run time) still has its weight's columns: its output is
(:data:`ROWS`, columns), as TensorFlow's own shape function makes it (?, columns). ROWS counts as
1 like an open batch, but it is not one: rows per sample are not known, so a count from it is
good only against another count of the same rows (:meth:`Shapes.guessed` tells which).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
from tensorflow.python.framework import tensor_util

from ..core.ir import Graph, Node, TensorRef

Shape = tuple[int, ...]
# the first dimension of a MatMul's output whose rows are not known, and of what is computed
# from it (an open batch is -1)
ROWS = -2

_UNSET = object()   # not worked out yet (None is a shape not known)
# ops whose output 0 has the shape of input 0
_SAME = frozenset({
    "Identity", "Snapshot", "StopGradient", "Cast", "CheckNumerics", "PreventGradient",
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "Erf", "Erfc", "Exp", "Expm1", "Log", "Log1p", "Neg", "Sqrt", "Rsqrt", "Square", "Abs",
    "Floor", "Ceil", "Round", "Rint", "Sign", "Reciprocal", "Inv", "Softmax", "LogSoftmax",
    "BiasAdd", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "ClipByValue",
    "Sin", "Cos", "IsNan", "IsFinite", "ZerosLike", "OnesLike", "LRN", "Mish", "Gelu",
    "LogicalNot",
    # a TF1 loop's frame boundaries pass their input on (a lowered While's, in a frozen graph)
    "Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
})
# ops whose every output port has a rule: a Switch's both branches are its input; a Split's and
# SplitV's pieces (which of their inputs is the value: _VALUE)
_PORTS = frozenset({"Switch", "RefSwitch", "Split", "SplitV", "IdentityN"})
_NEXT = frozenset({"NextIteration", "RefNextIteration"})
# the rules a frozen loop needs, where no ``_output_shapes`` are left: where a node states its
# shape (a SavedModel's function body), that comes first, as before these rules
_FRAME_RULES = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                          "RefNextIteration", "Merge", "RefMerge", "Fill", "TensorListGetItem",
                          "StridedSlice"}) | _PORTS
_VALUE = {"Switch": 0, "RefSwitch": 0, "Split": 1, "SplitV": 0}
# elementwise ops of two or more inputs, broadcast as numpy does
_BROADCAST = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
    "SquaredDifference", "Pow", "FloorDiv", "FloorMod", "Greater", "GreaterEqual", "Less",
    "LessEqual", "Equal", "NotEqual", "SelectV2", "AddN", "BiasAddV1", "LogicalAnd", "LogicalOr",
})
_REDUCE = frozenset({"Mean", "Sum", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin"})
# gradient convolutions: output 0 has the shape their sizes input holds (input_sizes of an input
# gradient, filter_sizes of a filter gradient), a Const or the Shape/ShapeN of a tensor
_SIZED = {"Conv2DBackpropInput": 0, "DepthwiseConv2dNativeBackpropInput": 0,
          "Conv2DBackpropFilter": 1, "DepthwiseConv2dNativeBackpropFilter": 1}


class Shapes:
    """Shapes of one graph's tensors, worked out on demand and remembered while the graph is
    not edited (an edit, :attr:`Graph.version`, makes it start over)."""

    def __init__(self, graph: Graph, given: Mapping[str, Shape] | None = None):
        """``given``: placeholder name -> the shape it is fed with (``convert --shape``),
        stated over what the graph says (which may leave the batch open)."""
        self.graph = graph
        self.given = dict(given or {})
        self._known: dict[TensorRef, Shape | None] = {}
        self._journal: list[TensorRef] | None = None   # what a walk round a loop worked out
        # each node's place in the graph's topological order, and the version it is of
        self._rank: dict[str, int] | None = None
        self._version = graph.version

    def elements(self, ref: TensorRef) -> int | None:
        """Elements of ``ref`` per sample (an open first dimension counts as 1), or None."""
        shape = self.shape(ref)
        if shape is None or any(d < 0 for d in shape[1:]):
            return None
        return math.prod(max(d, 1) if i == 0 else d for i, d in enumerate(shape)) if shape else 1

    def guessed(self, ref: TensorRef) -> bool:
        """Whether ``ref``'s first dimension is :data:`ROWS` (counted as 1, not a batch)."""
        shape = self.shape(ref)
        return bool(shape) and shape[0] == ROWS

    def shape(self, ref: TensorRef) -> Shape | None:
        """The static shape of ``ref``, or None where it is not known."""
        known = self._known.get(ref, _UNSET)
        if known is _UNSET or self._version != self.graph.version:
            self._work_out([ref])
            known = self._known[ref]
        return known

    def work_out(self, names: Iterable[str]) -> None:
        """Work out the shapes of output 0 of each node of ``names`` and of what they are
        computed from, in one walk and one order, where most will be asked for (the FLOPs of
        every matrix op): what asking :meth:`shape` of each would, for one walk instead of one
        per node."""
        self._work_out([TensorRef(name, 0) for name in names])

    def _work_out(self, refs: list[TensorRef]) -> None:
        if self._version != self.graph.version:   # edited: what was worked out may not hold
            self._known.clear()
            self._rank, self._version = None, self.graph.version
        missing = [ref for ref in refs if ref not in self._known]
        if not missing:
            return
        for top in self._producers_first(missing):
            if top in self._known:
                continue
            try:
                self._remember(top, _rule(self, top))
            except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError):
                self._remember(top, None)   # attrs or values a rule did not expect: unknown

    def _producers_first(self, refs: list[TensorRef]) -> list[TensorRef]:
        """``refs`` and the tensors they are computed from, producers first: the IR's walk up
        the data edges from their nodes, not past a node whose shape is known, in the graph's
        topological order (worked out once, not per walk: a loop's back edge does not order,
        so a Merge comes before its body, and its rule walks round the loop itself); of each,
        output 0 and, where each output has a rule (:data:`_PORTS`), the outputs the others
        read. Another output a rule asks for is worked out then. Without recursion: chains of
        thousands of nodes are common."""
        graph, known = self.graph, self._known
        # (nothing known yet, as when work_out starts: nothing to stop at)
        past = (lambda node: TensorRef(node.name, 0) not in known) if known else None
        reached = graph.ancestors([ref.node for ref in refs], control=False, past=past)
        if self._rank is None:
            self._rank = {name: i for i, name in enumerate(graph.topological_order())}
        todo = [name for name in reached if TensorRef(name, 0) not in known] if known \
            else list(reached)
        todo.sort(key=self._rank.__getitem__)
        order = []
        for name in todo:
            if graph.node(name).op not in _PORTS:
                order.append(TensorRef(name, 0))
                continue
            ports = {0} | {port for port, reader, _ in graph.out_edges(name) if reader in reached}
            order.extend(TensorRef(name, port) for port in sorted(ports))
        return order + refs

    def _remember(self, ref: TensorRef, shape: Shape | None) -> None:
        if self._journal is not None and ref not in self._known:
            self._journal.append(ref)
        self._known[ref] = shape

    def value(self, ref: TensorRef) -> np.ndarray | None:
        """The value of a Const input (through Identity), or None."""
        node = const_behind(self.graph, ref)
        return None if node is None else tensor_util.MakeNdarray(node.attr["value"].tensor)


def const_behind(graph: Graph, ref: TensorRef) -> Node | None:
    """The Const ``ref`` reads, through Identity ops (a frozen graph's ``/read``), or None."""
    node = graph.node(graph.origin(ref.node, _IDENTITY))
    return node if node.op == "Const" else None


_IDENTITY = frozenset({"Identity"})


# elementwise ops grappler's constant folding computes where every input is a Const: what a
# frozen Keras batch norm does to its four vectors (scale = gamma * rsqrt(var + eps), offset =
# beta - mean * scale) on every run, folded before the remapper looks for fusions
_FOLDED = {"Identity": lambda a: a, "Snapshot": lambda a: a, "Neg": np.negative,
           "Rsqrt": lambda a: 1 / np.sqrt(a), "Sqrt": np.sqrt, "Reciprocal": np.reciprocal,
           "Inv": np.reciprocal, "Square": np.square, "Mul": np.multiply, "Add": np.add,
           "AddV2": np.add, "Sub": np.subtract, "RealDiv": np.divide, "Maximum": np.maximum,
           "Minimum": np.minimum,
           # Keras' batch norm with axis=3 (EfficientNetV2, ResNet50) reshapes its vectors to
           # [1, 1, 1, C] before the arithmetic; folding takes the reshape with them
           "Reshape": lambda a, shape: np.reshape(a, shape)}
#: the ops :func:`folded_value` computes (the cost model's frozen estimate walks the same ops)
FOLDED_OPS = frozenset(_FOLDED)
#: how many of them a value is looked for through, up from where it is read: a frozen Keras
#: batch norm's offset is four deep; the bound keeps a look-up from walking a residual stream
#: of Adds (each of which may be asked about)
FOLDED_DEPTH = 12
# the largest value worked out: batch-norm vectors are one value per channel
_FOLDED_MAX = 1 << 16


def folded_value(graph: Graph, ref: TensorRef) -> np.ndarray | None:
    """The value of ``ref`` where it is a Const or computed from Consts alone by the elementwise
    ops constant folding evaluates (:data:`_FOLDED`, through up to :data:`FOLDED_DEPTH` of
    them), each reading output 0 of what it reads, with no control input on the way and at
    most 65536 values each; None otherwise (a variable, a placeholder, another op, a malformed
    Const). What it is computed from is the IR's walk up through those ops, evaluated in the
    IR's topological order of what the walk reached."""
    if ref.port:
        return None

    def folds(node: Node) -> bool:
        return node.op in _FOLDED and not graph.control_inputs(node.name)

    reached = graph.ancestors([ref.node], control=False, past=folds, depth=FOLDED_DEPTH)
    values: dict[str, np.ndarray | None] = {}
    for name in graph.topological_order(among=reached):
        node = graph.node(name)
        if node.op == "Const":
            values[name] = _const_value(node)
            continue
        inputs = graph.inputs(name)
        args = [values.get(r.node) if not r.port else None for r in inputs]
        values[name] = (_fold(node.op, args) if folds(node) and args
                        and all(a is not None for a in args) else None)
    return values[ref.node]


def _const_value(node: Node) -> np.ndarray | None:
    """A Const's value, where it holds at most :data:`_FOLDED_MAX` values and reads."""
    tensor = node.attr["value"].tensor
    if math.prod(d.size for d in tensor.tensor_shape.dim) > _FOLDED_MAX:
        return None
    try:
        return tensor_util.MakeNdarray(tensor)
    except (TypeError, ValueError):
        return None


def _fold(op: str, args: list[np.ndarray]) -> np.ndarray | None:
    """What constant folding computes for ``op`` of ``args``, or None (it fails, or it is more
    than :data:`_FOLDED_MAX` values)."""
    try:
        with np.errstate(all="ignore"):
            out = np.asarray(_FOLDED[op](*args))
    except (TypeError, ValueError):
        return None
    return out if out.size <= _FOLDED_MAX else None


def _measured(graph: Graph, ref: TensorRef) -> TensorRef | None:
    """The tensor whose shape ``ref`` is, where ``ref`` is a Shape op's output or a ShapeN's
    (TensorFlow's convolution gradients read their sizes so), else None."""
    node = graph.node(ref.node)
    inputs = graph.inputs(ref.node)
    if node.op == "Shape" and ref.port == 0 and inputs:
        return inputs[0]
    if node.op == "ShapeN" and ref.port < len(inputs):
        return inputs[ref.port]
    return None


def _const_shape(shapes: Shapes, ref: TensorRef) -> Shape | None:
    """The shape of ``ref``, read off the value where it is a Const's not worked out yet (no
    walk for a weight)."""
    if ref not in shapes._known:
        node = shapes.graph.node(ref.node)
        if node.op == "Const":
            return tuple(d.size for d in node.attr["value"].tensor.tensor_shape.dim)
    return shapes.shape(ref)


def _rule(shapes: Shapes, ref: TensorRef) -> Shape | None:
    """The static shape of ``ref`` by its op's handler (:data:`_HANDLERS`); None where the op
    has none, or its handler cannot tell."""
    node = shapes.graph.node(ref.node)
    if node.op in ("Placeholder", "PlaceholderWithDefault", "Const"):
        return _SOURCES[node.op](shapes, ref, node)
    if node.op in _FRAME_RULES:   # what TensorFlow stated stands (a SavedModel's bodies)
        stated = _stated(node, ref.port)
        if stated is not None:
            return stated
    if node.op in _PORTS:
        return _port(shapes, ref, node)
    if ref.port != 0:   # FusedBatchNorm's statistics, Unique's indices ...: not activations
        return None
    handler = _HANDLERS.get(node.op)
    found = handler(shapes, shapes.graph.inputs(ref.node), node) if handler else None
    return found if found is not None else _stated(node)


def _stated(node, port: int = 0) -> Shape | None:
    """The shape of output ``port`` as the node's ``_output_shapes`` attr states it (TensorFlow
    writes them into a SavedModel's function bodies: a loop body's TensorListGetItem, say), or
    None."""
    if "_output_shapes" not in node.attr:
        return None
    listed = node.attr["_output_shapes"].list.shape
    if len(listed) <= port or listed[port].unknown_rank:
        return None
    return tuple(d.size for d in listed[port].dim)


# ----------------------------------------------------------------- one handler per op kind
# Each takes the Shapes being worked out, the node's data inputs and the node, and returns the
# shape of the node's output 0 (None: not known).
def _placeholder(shapes: Shapes, ref: TensorRef, node) -> Shape | None:
    if node.name in shapes.given:
        return tuple(shapes.given[node.name])
    shape = node.attr["shape"].shape if "shape" in node.attr else None
    if shape is None or shape.unknown_rank:
        return None
    return tuple(d.size for d in shape.dim)


def _const(shapes: Shapes, ref: TensorRef, node) -> Shape | None:
    return _const_shape(shapes, ref)


def _same(shapes: Shapes, inputs, node) -> Shape | None:
    return _const_shape(shapes, inputs[0])


def _broadcasting(shapes: Shapes, inputs, node) -> Shape | None:
    return _broadcast([_const_shape(shapes, r) for r in inputs])


def _convolution(shapes: Shapes, inputs, node) -> Shape | None:
    return _conv(shapes.shape(inputs[0]), _const_shape(shapes, inputs[1]), node)


def _pool(shapes: Shapes, inputs, node) -> Shape | None:
    return _window(shapes.shape(inputs[0]), list(node.attr["ksize"].list.i), node, None)


def _pad(shapes: Shapes, inputs, node) -> Shape | None:
    x, pads = shapes.shape(inputs[0]), shapes.value(inputs[1])
    if x is None or pads is None:
        return None
    return tuple(d if d < 0 else d + int(p[0]) + int(p[1]) for d, p in zip(x, pads))


def _port(shapes: Shapes, ref: TensorRef, node) -> Shape | None:
    """Output ``ref.port`` of a Switch (its input's shape), a Split or a SplitV (its value's,
    cut along the axis; None where a cut size or the axis is not a Const), an IdentityN (its
    input of that port: Keras' swish passes its value and its input on through one, for its
    custom gradient)."""
    inputs = shapes.graph.inputs(ref.node)
    if node.op == "IdentityN":
        return _const_shape(shapes, inputs[ref.port]) if ref.port < len(inputs) else None
    x = _const_shape(shapes, inputs[_VALUE[node.op]])
    if x is None or node.op in ("Switch", "RefSwitch"):
        return x
    axis = shapes.value(inputs[0 if node.op == "Split" else 2])
    if axis is None or not x:
        return None
    axis = int(axis) % len(x)
    if node.op == "Split":
        n = node.attr["num_split"].i
        size = x[axis] // n if x[axis] >= 0 and n and x[axis] % n == 0 else None
    else:
        sizes = shapes.value(inputs[1])
        size = None if sizes is None or ref.port >= len(sizes) else int(sizes[ref.port])
        if size is not None and size < 0:
            size = None   # the -1 piece: the rest of the axis
    if size is None:
        return None
    return x[:axis] + (size,) + x[axis + 1:]


def _list_item(shapes: Shapes, inputs, node) -> Shape | None:
    """A TensorListGetItem's element_shape input (a Const; an open first dimension there is
    :data:`ROWS`, the run-time size of what was stacked)."""
    dims = shapes.value(inputs[2]) if len(inputs) > 2 else None
    if dims is None or dims.ndim != 1 or any(d < 0 for d in dims[1:]):
        return None
    return tuple(ROWS if i == 0 and d < 0 else int(d) for i, d in enumerate(dims))


def _fill(shapes: Shapes, inputs, node) -> Shape | None:
    """A Fill's shape input (:func:`_sizes`): zeros as many as a run-time size are a recurrent
    layer's first state; or the shape of a tensor it is computed from (``ones_like``)."""
    if shapes.graph.node(inputs[0].node).op == "Shape":
        dims = _shape_value(shapes, inputs[0])
        return None if dims is None else tuple(int(d) for d in dims)
    return _sizes(shapes, inputs[0])


def _sizes(shapes: Shapes, ref: TensorRef, depth: int = 4) -> Shape | None:
    """The values of ``ref``, a size vector: a Const, a Pack of scalars, or a ConcatV2 of such
    pieces and of ExpandDims (TF1's ``RNNCell.zero_state``: [batch] + [units]); a scalar that is
    not a Const is :data:`ROWS`. A piece of a size vector is 1-D, so an ExpandDims' is one
    scalar."""
    dims = shapes.value(ref)
    if dims is not None:
        return tuple(int(d) for d in np.atleast_1d(dims))
    node = shapes.graph.node(ref.node)
    parts = shapes.graph.inputs(node.name)
    if ref.port or not depth or node.op not in ("Pack", "ExpandDims", "ConcatV2"):
        return None
    if node.op == "ConcatV2":
        found = [_sizes(shapes, r, depth - 1) for r in parts[:-1]]
        return None if None in found else sum(found, ())
    found = [shapes.value(r) for r in parts[:1 if node.op == "ExpandDims" else None]]
    if any(v is not None and v.ndim for v in found):
        return None
    return tuple(ROWS if v is None else int(v) for v in found)


def _merge(shapes: Shapes, inputs, node) -> Shape | None:
    """A TF1 loop's Merge: the shape its value enters the loop with (the input that is not a
    NextIteration's), where the loop keeps it (:func:`_kept_round_the_loop`; a loop may let it
    grow: ``shape_invariants``, which a GraphDef does not keep). An open first dimension is
    :data:`ROWS` inside the loop: a run-time size. A lowered cond's Merge: its branches'
    shape."""
    entering, back = _back_edges(shapes.graph, inputs)
    found = {_const_shape(shapes, r) for r in entering}
    if len(found) != 1 or None in found:
        return None
    x = found.pop()
    if not back:   # a lowered cond's Merge, joining two branches
        return x
    x = (ROWS,) + x[1:] if x and x[0] < 0 else x
    return x if _kept_round_the_loop(shapes, node, back, x) else None


def _back_edges(graph: Graph, inputs) -> tuple[list[TensorRef], list[TensorRef]]:
    """A Merge's inputs: those entering it, and those a NextIteration brings back (a loop's)."""
    back = [r for r in inputs if graph.node(r.node).op in _NEXT]
    return [r for r in inputs if r not in back], back


def _kept_round_the_loop(shapes: Shapes, merge, back, x: Shape) -> bool:
    """Whether what a loop's Merge gets back from its NextIteration has the shape ``x`` it
    entered with, worked out with the Merge taken as ``x``: a loop may let a value grow
    (``shape_invariants``, which a GraphDef does not keep). A back edge whose shape no rule
    knows is taken as kept, TensorFlow's default. Where it is not, whatever the walk worked out
    from ``x`` is forgotten."""
    ref = TensorRef(merge.name, 0)
    outer, shapes._journal = shapes._journal, []
    shapes._remember(ref, x)   # for the walk round the loop, which comes back to it
    came = [shapes.shape(r) for r in back]
    walked, shapes._journal = shapes._journal, outer
    if all(b is None or b == x for b in came):
        if outer is not None:
            outer.extend(walked)
        return True
    for key in walked:
        del shapes._known[key]
    return False


def _strided_slice(shapes: Shapes, inputs, node) -> Shape | None:
    """A StridedSlice with Const begin, end and strides and no ellipsis or new axis (a
    recurrent cell's gates cut from one product); an open dimension only where it is taken
    whole."""
    x = shapes.shape(inputs[0])
    begin, end, strides = (shapes.value(r) for r in inputs[1:4])
    attr = node.attr
    if (x is None or begin is None or end is None or strides is None
            or attr["ellipsis_mask"].i or attr["new_axis_mask"].i or begin.ndim != 1
            or not len(begin) == len(end) == len(strides) <= len(x)):
        return None
    out = []
    for axis, size in enumerate(x):
        if axis >= len(begin):
            out.append(size)
            continue
        b, e, step = int(begin[axis]), int(end[axis]), int(strides[axis])
        bit = 1 << axis
        whole = attr["begin_mask"].i & bit and attr["end_mask"].i & bit and step == 1
        if attr["shrink_axis_mask"].i & bit:
            if size < 0:
                return None   # one sample or row of an open dimension: not a count per sample
            continue
        if whole:
            out.append(size)
            continue
        if size < 0 or step == 0:
            return None
        b = None if attr["begin_mask"].i & bit else b
        e = None if attr["end_mask"].i & bit else e
        out.append(len(range(size)[slice(b, e, step)]))
    return tuple(out)


def _matmul(shapes: Shapes, inputs, node) -> Shape | None:
    a, b = shapes.shape(inputs[0]), _const_shape(shapes, inputs[1])
    if b is None or len(b) != 2:
        return None
    if a is None:   # its columns are the weight's; its rows not known (TensorFlow: (?, cols))
        stated = _stated(node)   # unless TensorFlow stated them (a SavedModel's function body)
        if stated is not None:
            return stated
        a = (ROWS, ROWS)
    rows = a[1] if node.attr["transpose_a"].b else a[0]
    cols = b[0] if node.attr["transpose_b"].b else b[1]
    return (rows, cols)


def _batch_matmul(shapes: Shapes, inputs, node) -> Shape | None:
    a, b = _const_shape(shapes, inputs[0]), _const_shape(shapes, inputs[1])
    if a is None or b is None:
        return None
    batch = _broadcast([a[:-2], b[:-2]])
    if batch is None:
        return None
    rows = a[-1] if node.attr["adj_x"].b else a[-2]
    cols = b[-2] if node.attr["adj_y"].b else b[-1]
    return batch + (rows, cols)


def _sized(shapes: Shapes, inputs, node) -> Shape | None:
    ref = inputs[_SIZED[node.op]]
    measured = _measured(shapes.graph, ref)
    if measured is not None:
        return _const_shape(shapes, measured)
    sizes = shapes.value(ref)
    return None if sizes is None or sizes.ndim != 1 else tuple(int(d) for d in sizes)


def _einsum(shapes: Shapes, inputs, node) -> Shape | None:
    parsed = parse_einsum(node.attr["equation"].s.decode())
    if parsed is None:
        return None
    operands, output = parsed
    found = [_const_shape(shapes, r) for r in inputs]
    if len(found) != len(operands) or any(f is None for f in found):
        return None
    sizes = einsum_sizes(operands, found)
    if sizes is None:
        return None
    out = []
    for label in output:
        if label == ".":
            out.extend(sizes["."])
        else:
            out.append(sizes[label])
    return tuple(out)


def parse_einsum(equation: str) -> tuple[list[str], str] | None:
    """An Einsum equation's operand labels and output labels, an ellipsis as one ``.``; None
    where a label repeats within one operand (a diagonal), the output is implicit (TensorFlow's
    ``tf.einsum`` writes it out) or the equation is not one this reads."""
    equation = equation.replace(" ", "").replace("...", ".")
    lhs, arrow, output = equation.partition("->")
    operands = lhs.split(",")
    if not arrow or not all(o.replace(".", "").isalpha() or o in ("", ".") for o in operands):
        return None
    labels = [c for o in operands for c in o if c != "."]
    if not output.replace(".", "").isalpha() and output not in ("", "."):
        return None
    if any(len(set(o)) != len(o) for o in operands + [output]):
        return None
    if any(c not in labels for c in output if c != "."):
        return None
    return operands, output


def einsum_sizes(operands: list[str], found: list[Shape]) -> dict | None:
    """Each label's size from the operands' shapes (a known size over an open one, a size over
    a broadcast 1), and under ``.`` the ellipsis' dimensions broadcast together; None where the
    shapes do not fit the labels."""
    sizes: dict = {}
    ellipses = []
    for labels, shape in zip(operands, found):
        named = labels.replace(".", "")
        if len(shape) < len(named) or ("." not in labels and len(shape) != len(named)):
            return None
        before = labels.index(".") if "." in labels else len(labels)
        after = len(labels) - before - 1 if "." in labels else 0
        ellipses.append(tuple(shape[before:len(shape) - after]) if "." in labels else ())
        dims = list(shape[:before]) + (list(shape[len(shape) - after:]) if after else [])
        for label, dim in zip(named, dims):
            seen = sizes.get(label)
            if seen is None or seen == 1 or (seen < 0 and dim > 1):
                sizes[label] = dim
            elif dim not in (seen, 1, -1) and seen > 0:
                return None
    broadcast = _broadcast(ellipses)
    if broadcast is None:
        return None
    sizes["."] = broadcast
    return sizes


def _gather(shapes: Shapes, inputs, node) -> Shape | None:
    """A GatherV2 (an embedding's lookup): the params' shape with the axis taken by the
    indices' (no batch dimensions); a ResourceGather, axis 0 of its variable's shape."""
    if node.attr["batch_dims"].i if "batch_dims" in node.attr else 0:
        return None
    if node.op == "ResourceGather":
        params, axis = _stated_variable(shapes, inputs[0]), 0
    else:
        params, axis = shapes.shape(inputs[0]), shapes.value(inputs[2])
    indices = shapes.shape(inputs[1])
    if params is None or indices is None or axis is None:
        return None
    axis = int(axis) % len(params)
    return params[:axis] + indices + params[axis + 1:]


def _stated_variable(shapes: Shapes, ref: TensorRef) -> Shape | None:
    """The shape of the variable a resource handle ``ref`` is (a VarHandleOp's ``shape``)."""
    node = shapes.graph.node(ref.node)
    if node.op != "VarHandleOp" or node.attr["shape"].shape.unknown_rank:
        return None
    return tuple(d.size for d in node.attr["shape"].shape.dim)


def _reshaped(shapes: Shapes, inputs, node) -> Shape | None:
    target = shapes.value(inputs[1])
    if target is None:
        target = _shape_value(shapes, inputs[1])
    return _reshape(shapes.shape(inputs[0]), target)


# ops of the small integer arithmetic a model computes a reshape's target with from a tensor's
# shape (Keras' Reshape layer: the batch of ``tf.shape(x)`` packed with the dimensions it
# states), worked out from the shapes known: an open dimension stays -1, as a reshape's target
# takes it
_SHAPE_ARITHMETIC = frozenset({"Shape", "StridedSlice", "Pack", "ConcatV2", "Cast", "Identity",
                               "GatherV2", "Prod", "Mul"})


def _shape_value(shapes: Shapes, ref: TensorRef) -> np.ndarray | None:
    """The value of ``ref`` where it is that arithmetic (:data:`_SHAPE_ARITHMETIC`) on Consts
    and on the shapes of tensors, or None; its producers worked out first, without recursion."""
    graph, found = shapes.graph, {}
    stack = [(ref, False)]
    while stack:
        top, ready = stack.pop()
        if top in found:
            continue
        const = shapes.value(top)
        node = graph.node(top.node)
        if const is not None or node.op not in _SHAPE_ARITHMETIC or top.port != 0:
            found[top] = const
            continue
        inputs = graph.inputs(top.node)
        operands = (inputs if node.op in ("Pack", "Mul") else inputs[:-1]
                    if node.op == "ConcatV2" else inputs[:1])
        if node.op == "Shape":
            shape = shapes.shape(inputs[0])
            found[top] = None if shape is None else np.array(shape, np.int64)
            continue
        if not ready:
            stack.append((top, True))
            stack.extend((r, False) for r in operands if r not in found)
            continue
        values = [found.get(r) for r in operands]
        found[top] = None if any(v is None for v in values) else _arithmetic(
            shapes, node, inputs, values)
    return found[ref]


def _arithmetic(shapes: Shapes, node, inputs, values) -> np.ndarray | None:
    if node.op in ("Cast", "Identity"):
        return values[0]
    if node.op == "Mul":   # an open dimension (-1) times anything stays open
        a, b = (np.asarray(v) for v in values)
        return np.where((a < 0) | (b < 0), -1, a * b)
    if node.op == "GatherV2":   # a tensordot's free or contracted dimensions of a shape
        index, axis = shapes.value(inputs[1]), shapes.value(inputs[2])
        x = np.asarray(values[0])
        return (x[np.asarray(index)] if index is not None and axis is not None
                and int(axis) == 0 and x.ndim == 1 else None)
    if node.op == "Prod":   # the product of them; open if one is
        axes, x = shapes.value(inputs[1]), np.asarray(values[0])
        if axes is None or x.ndim != 1 or list(np.atleast_1d(axes)) not in ([0], [-1]):
            return None
        value = np.array(-1 if (x < 0).any() else int(np.prod(x)), np.int64)
        return value.reshape(1) if "keep_dims" in node.attr and node.attr["keep_dims"].b else value
    if node.op == "Pack":
        return np.stack([np.asarray(v) for v in values]) if node.attr["axis"].i == 0 else None
    if node.op == "ConcatV2":
        axis = shapes.value(inputs[-1])
        return (np.concatenate([np.atleast_1d(v) for v in values])
                if axis is not None and int(axis) == 0 else None)
    # StridedSlice of a vector: x[begin:end:stride], or x[begin] (shrink_axis_mask)
    x = np.asarray(values[0])
    begin, end, strides = (shapes.value(r) for r in inputs[1:4])
    if x.ndim != 1 or begin is None or end is None or strides is None or \
            len(np.atleast_1d(begin)) != 1 or any(node.attr[m].i for m in (
                "ellipsis_mask", "new_axis_mask") if m in node.attr):
        return None
    b, e, st = (int(np.atleast_1d(v)[0]) for v in (begin, end, strides))
    mask = {m: node.attr[m].i & 1 if m in node.attr else 0
            for m in ("begin_mask", "end_mask", "shrink_axis_mask")}
    if mask["shrink_axis_mask"]:
        return x[b] if -len(x) <= b < len(x) else None
    return x[None if mask["begin_mask"] else b:None if mask["end_mask"] else e:st]


def _reduction(shapes: Shapes, inputs, node) -> Shape | None:
    x, axes = shapes.shape(inputs[0]), shapes.value(inputs[1])
    if x is None or axes is None:
        return None
    axes = {int(a) % len(x) for a in np.atleast_1d(axes)}
    keep = node.attr["keep_dims"].b if "keep_dims" in node.attr else False
    if node.op in ("ArgMax", "ArgMin"):
        keep = False
    return tuple(1 if i in axes else d for i, d in enumerate(x) if keep or i not in axes)


def _concat(shapes: Shapes, inputs, node) -> Shape | None:
    parts = [_const_shape(shapes, r) for r in inputs[:-1]]
    axis = shapes.value(inputs[-1])
    if axis is None or any(p is None for p in parts):
        return None
    axis = int(axis) % len(parts[0])
    if any(len(p) != len(parts[0]) for p in parts):
        return None
    out = []
    for i, dims in enumerate(zip(*parts)):
        if i == axis:
            out.append(_open(dims) if any(d < 0 for d in dims) else sum(dims))
            continue
        known = {d for d in dims if d >= 0}   # the parts agree, or the concat fails
        out.append(known.pop() if len(known) == 1 else _open(dims) if not known else -1)
    return tuple(out)


def _transpose(shapes: Shapes, inputs, node) -> Shape | None:
    x, perm = shapes.shape(inputs[0]), shapes.value(inputs[1])
    if x is None or perm is None:
        return None
    return tuple(x[int(p)] for p in perm)


def _expand_dims(shapes: Shapes, inputs, node) -> Shape | None:
    x, dim = shapes.shape(inputs[0]), shapes.value(inputs[1])
    if x is None or dim is None:
        return None
    at = int(dim) % (len(x) + 1)
    return x[:at] + (1,) + x[at:]


def _squeeze(shapes: Shapes, inputs, node) -> Shape | None:
    x = shapes.shape(inputs[0])
    if x is None:
        return None
    dims = {d % len(x) for d in node.attr["squeeze_dims"].list.i}
    if not dims and any(d < 0 for d in x):
        return None   # which open dimensions are 1 is not known
    return tuple(d for i, d in enumerate(x) if (i not in dims if dims else d != 1))


_SOURCES = {"Placeholder": _placeholder, "PlaceholderWithDefault": _placeholder, "Const": _const}
_HANDLERS = {
    **dict.fromkeys(_SAME, _same), **dict.fromkeys(_BROADCAST, _broadcasting),
    "Conv2D": _convolution, "DepthwiseConv2dNative": _convolution,
    "MaxPool": _pool, "AvgPool": _pool,
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad,
    "MatMul": _matmul,
    **dict.fromkeys(("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"), _batch_matmul),
    "Reshape": _reshaped,
    **dict.fromkeys(_REDUCE, _reduction),
    "ConcatV2": _concat, "Transpose": _transpose, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "Einsum": _einsum, "StridedSlice": _strided_slice,
    "Fill": _fill, "Merge": _merge, "RefMerge": _merge, "TensorListGetItem": _list_item,
    **dict.fromkeys(_SIZED, _sized),
    "GatherV2": _gather, "ResourceGather": _gather,
}


def _broadcast(parts: list[Shape | None]) -> Shape | None:
    if any(p is None for p in parts):
        return None
    rank = max((len(p) for p in parts), default=0)
    out = []
    for i in range(rank):
        dims = {p[len(p) - rank + i] for p in parts if len(p) - rank + i >= 0} - {1}
        if not dims:
            out.append(1)
        elif len(dims) == 1:
            out.append(dims.pop())
        else:
            known = dims - {-1, ROWS}
            if len(known) > 1:
                return None   # does not broadcast: not a shape this walk can know
            out.append(known.pop() if known else _open(dims))
    return tuple(out)


def _open(dims) -> int:
    """The open dimension that ``dims`` make: :data:`ROWS` where one of them is (a guess stays
    a guess), else -1."""
    return ROWS if ROWS in dims else -1


def _spatial(node) -> tuple[int, list[int]]:
    """The channel axis and the spatial axes of a 4-D NHWC or NCHW tensor."""
    fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
    return (1, [2, 3]) if fmt.startswith("NC") else (3, [1, 2])


def _window(x: Shape | None, window: list[int], node, channels: int | None) -> Shape | None:
    """The output shape of a windowed op (convolution, pooling) over 4-D ``x``; ``window`` in
    the layout's order (NHWC/NCHW) for pools, spatial sizes for convolutions."""
    if x is None or len(x) != 4:
        return None
    attr = node.attr
    c_axis, axes = _spatial(node)
    strides = list(attr["strides"].list.i)
    dilations = list(attr["dilations"].list.i) if "dilations" in attr else [1, 1, 1, 1]
    padding = attr["padding"].s.decode()
    explicit = list(attr["explicit_paddings"].list.i) if padding == "EXPLICIT" else []
    out = list(x)
    for k, axis in enumerate(axes):
        size = x[axis]
        win = window[k] if channels is not None else window[axis]
        eff = (win - 1) * (dilations[axis] if dilations else 1) + 1
        if size < 0:
            out[axis] = -1
        elif padding == "SAME":
            out[axis] = -(-size // strides[axis])
        elif padding == "VALID":
            out[axis] = (size - eff) // strides[axis] + 1
        elif explicit:
            before, after = explicit[2 * axis], explicit[2 * axis + 1]
            out[axis] = (size + before + after - eff) // strides[axis] + 1
        else:
            return None
    if channels is not None:
        out[c_axis] = channels
    return tuple(out)


def _conv(x: Shape | None, f: Shape | None, node) -> Shape | None:
    if f is None or len(f) != 4:
        return None
    channels = f[2] * f[3] if node.op.startswith("Depthwise") else f[3]
    return _window(x, list(f[:2]), node, channels)


def convolution_output(x: Shape | None, f, node) -> Shape | None:
    """The output shape of the 2-D convolution (or depthwise one) ``node`` or its gradients'
    forward convolution (same attrs) over ``x`` with a filter of shape ``f``; None where not
    known."""
    return _conv(x, tuple(f) if f is not None else None, node)


def _reshape(x: Shape | None, target: np.ndarray | None) -> Shape | None:
    if target is None:
        return None
    dims = [int(d) for d in np.atleast_1d(target)]
    if dims.count(-1) == 0:
        return tuple(dims)
    if x is None or dims.count(-1) > 1:
        return None
    rest = math.prod(d for d in dims if d != -1)
    if all(d >= 0 for d in x):
        return tuple(math.prod(x) // rest if d == -1 else d for d in dims) if rest else None
    # an open batch that stays first and open, each sample keeping its elements
    if (x[0] < 0 and all(d >= 0 for d in x[1:]) and dims[0] == -1
            and math.prod(dims[1:]) == math.prod(x[1:])):
        return (x[0], *dims[1:])
    return None
