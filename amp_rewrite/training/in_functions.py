"""Dynamic or static loss scaling inside a TF2 SavedModel's train-step functions.

A TF2 user saves a trainable model as a ``tf.Module`` (or a Keras model and optimizer held by
one) whose ``tf.function`` computes a ``GradientTape`` and applies the gradients. Its train step
is a library function, its variables are captured resource inputs bound to objects of the
SavedModel's object graph, and its state lives in ``variables/``. Loss scaling there means:

* the object graph gains ``root.amp_loss_scale`` with three variables (``scale``,
  ``skipped_steps``, ``good_steps``), which :func:`amp_rewrite.io.save.save` writes into the
  checkpoint with TensorFlow's own writer (the original tensors keep their bytes);
* each train function captures them as three more resource inputs (and so does every function
  or graph node that calls it, up the call graph);
* in its body each tape's seed is multiplied by the scale, each gradient is divided by it in
  float32 where it leaves the tape's scope, one ``IsFinite``/``All`` checks them all, and every
  variable write of the step becomes an ``If(all_finite)`` of the same name whose then-branch is
  the write: a skipped step writes nothing, so every variable, slot and counter keeps its bits
  (but a write the check itself waits on, such as a running input mean used before the tape,
  which cannot wait for it: the report names those in a warning);
* a step with several tapes (a GAN's generator and discriminator, two optimizers) is one step:
  one scale for every seed, one check over every gradient, every write gated, so an overflow in
  either part skips the whole step and the parts keep updating in lockstep (docs/training.md
  "Several tapes in one step" gives the reasons); a step that applies one tape's gradients
  before another tape's gradients are computed (they read what it wrote) cannot be checked
  whole, and is refused with the split into one function per tape that converts;
* every train function the SavedModel restores is scaled: those a signature reaches, and the
  ``tf.function`` methods saved beside the signatures (``loaded.train_step``), every trace of
  them (the object graph's concrete functions), their state handles bound to the same three
  variables; a method no signature reaches that loss scaling would refuse is left alone
  instead, float32 and unscaled, with a warning giving the refusal's reason and fix
  (:func:`unscalable_train_functions`), so the rest of the model still converts;
* the scale and counters are updated as in TF1 graphs (docs/training.md "Training graphs and loss
  scaling").

The body is edited as the FunctionDef TensorFlow wrote (``node:output:index`` references), in
place: every node keeps its name, so control edges, ``control_ret`` and the automatic control
dependencies TensorFlow recorded still hold. What cannot be found without doubt (no seed,
writes inside nested calls, writes a later tape's gradients wait on, a tape that differentiates
another's gradients, a model converted before) is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from tensorflow.core.framework import attr_value_pb2, function_pb2, types_pb2
from tensorflow.core.framework.tensor_shape_pb2 import TensorShapeProto
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import tensor_util

from ..check import lint
from ..check.input import check_input
from ..core.dtypes import CONVERTIBLE, FLOAT
from ..core.errors import InputError, LintError, UnsupportedGraphError
from ..core.ir import Node, TensorRef
from ..core.ops import CALL_OPS
from ..schema.functiondef import (
    FunctionGraph,
    called_functions,
    check_call_types,
    function_to_graph,
    graph_to_function,
    output_layout,
    reachable,
)
from ..schema.opdefs import (
    fill_defaults,
    graph_with_defaults,
    input_dtype,
    invalidate,
    is_variable_write,
    node_types,
    op_def,
    output_dtype,
    strip_graph_defaults,
)
from ..schema.snapshot import Before
from .config import ScaleConfig
from .detect import backprop_scope, training_functions
from .state import SCOPE

log = logging.getLogger(__name__)

I64, BOOL, INT32, RESOURCE = types_pb2.DT_INT64, types_pb2.DT_BOOL, types_pb2.DT_INT32, types_pb2.DT_RESOURCE
#: the variables the loaded object gains under ``root.amp_loss_scale``, with their dtypes
STATE = (("scale", FLOAT), ("skipped_steps", I64), ("good_steps", I64))
_OPS_USED = ("If", "IsFinite", "All", "Pack", "RealDiv", "LogicalNot", "LogicalAnd",
             "GreaterEqual", "SelectV2", "Maximum", "Reshape", "VarHandleOp", "AssignVariableOp",
             "ReadVariableOp", "Cast", "Mul", "AddV2", "NoOp", "Const", "StatefulPartitionedCall")


def _signatures(library) -> dict:
    return {f.signature.name: f.signature for f in library.function}


class _Body:
    """One library function as IR (:func:`~amp_rewrite.schema.functiondef.function_to_graph`), edited
    through :class:`~amp_rewrite.core.ir.Graph`'s primitives and written back by :meth:`finish`
    only once it passes the lint. Every node keeps its name, and so every control edge,
    ``control_ret`` and automatic control dependency TensorFlow recorded still holds."""

    def __init__(self, fdef: function_pb2.FunctionDef, signatures: dict):
        self.name = fdef.signature.name
        self.signatures = signatures
        self.fg: FunctionGraph = function_to_graph(fdef, signatures)
        self.graph = self.fg.graph
        check_input(self.graph)   # a body TensorFlow would not run is the input's fault
        self.before = Before(self.graph)
        self._rets = set(self.fg.rets)

    @property
    def fdef(self) -> function_pb2.FunctionDef:
        """The FunctionDef being edited: its signature, attrs and ``control_ret`` (the body
        itself is the IR's until :meth:`finish`)."""
        return self.fg.fdef

    def nodes(self) -> list[Node]:
        """The body's nodes in the FunctionDef's order, without the IR's argument and result
        nodes."""
        boundary = self.fg.boundary()
        return [n for n in self.graph.nodes() if n.name not in boundary]

    def dtype(self, ref: TensorRef) -> int | None:
        """The dtype of ``ref`` (None for an op TensorFlow does not register)."""
        return output_dtype(self.graph.node(ref.node), ref.port)

    def add(self, op: str, name: str, inputs=(), control=(), **attrs) -> TensorRef:
        """Add node ``name`` (exactly that name: a body that has one already was converted
        before); keyword arguments are attrs, a dtype or an ``AttrValue``."""
        if name in self.graph:
            raise UnsupportedGraphError(f"function {self.name!r} already has a node {name!r}: "
                                        "converted before?")
        node = self.graph.add_node(op, name, inputs, {
            key: value if isinstance(value, attr_value_pb2.AttrValue)
            else attr_value_pb2.AttrValue(type=value) for key, value in attrs.items()},
            control_inputs=control)
        filled = fill_defaults(node.proto)   # for the type model; the FunctionDef stays lean
        if filled:
            self.fg.defaults[name] = filled
        return TensorRef(name)

    def const(self, name: str, value, dtype: int) -> TensorRef:
        proto = tensor_util.make_tensor_proto(value, dtype=dtype)
        return self.add("Const", name, value=attr_value_pb2.AttrValue(tensor=proto), dtype=dtype)

    def add_resource_arg(self, name: str, var_dtype: int) -> TensorRef:
        """A new trailing resource input (a capture), with ``_input_shapes`` kept in step
        (the loader refuses a function whose shapes and inputs differ in number)."""
        if name in self.graph:
            raise UnsupportedGraphError(f"function {self.name!r} already has an input or node "
                                        f"{name!r}: converted before?")
        sig = self.fdef.signature
        index = len(sig.input_arg)
        arg = sig.input_arg.add(name=name, type=RESOURCE)
        arg.handle_data.add(dtype=var_dtype).shape.SetInParent()
        if "_input_shapes" in self.fdef.attr:
            self.fdef.attr["_input_shapes"].list.shape.add()       # a handle is a scalar
        self.fdef.arg_attr[index].attr["_user_specified_name"].s = b"resource"
        self.graph.add_node("Placeholder", name, attrs={
            "dtype": attr_value_pb2.AttrValue(type=RESOURCE)})
        self.fg.args.append(name)
        return TensorRef(name)

    def readers(self, ref: TensorRef) -> list[tuple[str, int]]:
        """``(node, input port)`` of every body node that reads ``ref`` (the function's
        results are not readers: they return what they get)."""
        return [(r, i) for r, i in self.graph.consumers(ref.node, ref.port) if r not in self._rets]

    def op(self, name: str) -> str:
        return self.graph.node(name).op

    def attr(self, name: str):
        return self.graph.node(name).attr

    def finish(self) -> function_pb2.FunctionDef:
        """The edited FunctionDef, once the body passes the lint every converted graph passes
        (an :class:`~amp_rewrite.core.errors.LintError` otherwise: our bug)."""
        problems = lint.lint_problems(self.graph, original=self.before)
        if problems:
            raise LintError([f"function {self.name!r}: {p}" for p in problems])
        return graph_to_function(self.fg, self.signatures)


def _in_tape(name: str) -> bool:
    return backprop_scope(name) is not None


def _types(dtypes) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=list(dtypes)))


# ----------------------------------------------------------------- one train function
@dataclass
class _Found:
    function: str
    seeds: list[str]
    gradients: list[str]
    gated: list[str]
    ungated: list[str] = field(default_factory=list)   # writes the check waits on


def _seeds(body: _Body) -> list[str]:
    """The tapes' backprop seeds, in body order: each a float Const of ones outside the tape
    scope, read only by it (``tape.gradient(loss, ...)`` without ``output_gradients``; one per
    ``tape.gradient`` call, so a GAN step has two), directly or through painting's Cast of it
    (a seed read by a 16-bit and a float32 gradient op)."""
    seeds = []
    for node in body.nodes():
        if node.op != "Const" or _in_tape(node.name):
            continue
        readers = body.readers(TensorRef(node.name))
        if readers and all(_in_tape(r) or _cast_for_tape(body, r) for r, _ in readers):
            value = tensor_util.MakeNdarray(node.attr["value"].tensor)
            if value.dtype.kind == "f" and value.size and np.all(value == 1):
                seeds.append(node.name)
    if not seeds:
        raise UnsupportedGraphError(
            f"function {body.name!r} trains, but amp-rewrite finds no backprop seed (a Const of "
            "ones read only by the gradient tape; tape.gradient(..., output_gradients=...) has "
            "none); convert with --loss-scale none, or --target bfloat16")
    return seeds


def _cast_for_tape(body: _Body, name: str) -> bool:
    """Whether ``name`` is a Cast read only by the tape (painting's, between a seed and a
    gradient op of the other dtype)."""
    readers = body.readers(TensorRef(name))
    return body.op(name) == "Cast" and bool(readers) and all(_in_tape(r) for r, _ in readers)


def _gradients(body: _Body, seeds: list[str]) -> list[TensorRef]:
    """Float tensors the seeds compute in the backward passes and read outside them, in body
    order. The backward pass is the tapes' scope and what lies between its nodes on the seeds'
    side: a tape sums a tensor's gradient contributions with an ``AddN`` outside the scope, whose
    result the scope reads again (taking that sum for a gradient would unscale part of the
    backward pass). Only what the seeds compute counts: a forward ``While`` also reads the scope
    (its gradient's accumulators) and is read by it, and a tape whose seed is not a Const of
    ones (``ones_like`` of a critic's batch of scores, in a gradient penalty) computes under the
    same scope, unscaled: neither is a gradient to unscale.

    Raises :class:`UnsupportedGraphError` when one tape differentiates what another's gradients
    compute (a gradient penalty whose inner tape's seed is a Const of ones too, higher-order
    gradients): scaling both seeds would leave that tape's gradients scaled twice."""
    graph = body.graph
    scoped = {n.name for n in body.nodes() if _in_tape(n.name)} | set(seeds)
    computed = graph.descendants(seeds)
    inside = scoped | (computed & graph.ancestors(scoped))
    _refuse_tapes_through_gradients(body, seeds, inside)
    found: list[TensorRef] = []
    for node in body.nodes():
        if node.name in inside:
            continue
        for ref in graph.inputs(node.name):
            if ref.node in inside and ref.node in computed and ref not in found \
                    and body.dtype(ref) in CONVERTIBLE:
                found.append(ref)
    return found


def _refuse_tapes_through_gradients(body: _Body, seeds: list[str], inside: set[str]) -> None:
    """Two seeds' backward passes meet in a node of the backward pass only when one tape
    differentiates what the other's gradients compute: refused."""
    seen: dict[str, str] = {}
    for seed in seeds:
        for name in body.graph.descendants([seed]) & inside:
            if name in seen and name != seed:
                raise UnsupportedGraphError(
                    f"function {body.name!r} trains, and the backward pass from seed {seed!r} "
                    f"meets the one from seed {seen[name]!r} at {name!r}: one tape "
                    "differentiates what another tape's gradients compute (a gradient "
                    "penalty, higher-order gradients), which one loss scale would scale twice; "
                    "convert with --loss-scale none, or --target bfloat16")
            seen.setdefault(name, seed)


def _unscale_and_check(body: _Body, gradients: list[TensorRef],
                       scale: TensorRef) -> tuple[TensorRef, list[TensorRef]]:
    """Divide each gradient by ``scale`` in float32 where it leaves the tape; returns the one
    flag that all of them are finite, and the float32 tensors unscaled (one per gradient: a
    16-bit gradient and painting's float32 cast of it are the same gradient).

    Painting kept the update float32 (:mod:`amp_rewrite.paint.updates`), so the update reads a
    gradient through painting's float32 cast of it, made inside the tape's scope: that cast is
    the gradient found, and its readers read the unscaled value. A gradient that leaves the
    tape in 16 bits has only 16-bit readers, off the way to any write (a gradient norm the step
    returns): they read the unscaled value rounded back. One on the way to a write would be our
    bug, and the lint of the body (:meth:`_Body.finish`) reports it."""
    unscaled: dict[TensorRef, TensorRef] = {}
    flags = []
    for k, grad in enumerate(gradients):
        readers = [(r, i) for r, i in body.readers(grad) if not _in_tape(r)]
        dtype = body.dtype(grad)
        if dtype == FLOAT:
            wide = grad
        else:   # painting's float32 cast of it, where there is one: one value per gradient
            casts = [r for r, _ in body.readers(grad)
                     if body.op(r) == "Cast" and body.attr(r)["DstT"].type == FLOAT]
            wide = (TensorRef(casts[0]) if casts else
                    body.add("Cast", f"{grad.node}/amp_float_{k}", [grad], SrcT=dtype, DstT=FLOAT))
        if wide not in unscaled:
            base = wide.node
            value = body.add("RealDiv", f"{base}/amp_unscaled", [wide, scale], T=FLOAT)
            unscaled[wide] = value
            finite = body.add("IsFinite", f"{base}/amp_is_finite", [value], T=FLOAT)
            flat = body.add("Reshape", f"{base}/amp_flat",
                            [finite, body.const(f"{base}/amp_minus_one", [-1], INT32)], T=BOOL)
            flags.append(body.add("All", f"{base}/amp_all_finite",
                                  [flat, body.const(f"{base}/amp_axis", 0, INT32)], Tidx=INT32))
        value = unscaled[wide]
        for reader, index in readers:
            if dtype == FLOAT:
                body.graph.set_input(reader, index, value)
            elif reader != wide.node:   # a 16-bit reader, off the update: rounded back
                back = f"{grad.node}/amp_unscaled_{k}"
                ref = TensorRef(back) if back in body.graph else body.add(
                    "Cast", back, [value], SrcT=FLOAT, DstT=dtype)
                body.graph.set_input(reader, index, ref)
    packed = body.add("Pack", f"{SCOPE}/finite_flags", flags, T=BOOL,
                      N=attr_value_pb2.AttrValue(i=len(flags)))
    finite = body.add("All", f"{SCOPE}/all_finite",
                      [packed, body.const(f"{SCOPE}/axis", 0, INT32)], Tidx=INT32)
    return finite, list(unscaled)


def _write_attrs(body: _Body, name: str) -> dict:
    """The attrs a write node has in the FunctionDef (without the defaults the IR filled in
    for the type model, nor internal ``_`` attrs): what its gated copy keeps."""
    filled = set(body.fg.defaults.get(name, ()))
    return {k: v for k, v in body.attr(name).items() if not k.startswith("_") and k not in filled}


def _gate_writes(body: _Body, library, finite: TensorRef, seeds: list[str],
                 gradients: list[TensorRef], branches: dict) -> tuple[list[str], list[str]]:
    """Every variable write of the step becomes an ``If`` of the same name whose then-branch is
    the write and whose else-branch does nothing; returns those and the writes the check itself
    waits on (gating them would make a cycle), which run on every step. A write the check waits
    on that reads gradients would write a non-finite step's gradients: refused
    (:func:`_refuse_write_before_check`)."""
    graph = body.graph
    before_check = graph.ancestors([finite.node])
    from_gradients = graph.descendants(seeds)
    gated, ungated = [], []
    for node in body.nodes():
        if not is_variable_write(node.op):
            continue
        if node.name in before_check and node.name in from_gradients:
            _refuse_write_before_check(body, node, seeds, gradients)
        if node.name in before_check:
            ungated.append(f"{node.name} ({node.op})")
            continue
        types = node_types(node)
        tin = [input_dtype(node, port) for port in range(len(types.inputs))]
        attrs = _write_attrs(body, node.name)
        key = (node.op, tuple(sorted((k, v.SerializeToString(deterministic=True))
                                     for k, v in attrs.items())))
        if key not in branches:
            branches[key] = _branch_pair(library, node.op, attrs, tin, len(branches))
        then_name, else_name = branches[key]
        gated.append(f"{node.name} ({node.op})")
        _become_if(body, node, finite, tin, then_name, else_name)
    return gated, ungated


def _refuse_write_before_check(body: _Body, node: Node, seeds: list[str],
                               gradients: list[TensorRef]) -> None:
    """Refuse write ``node``, which reads gradients and which the finiteness check waits on,
    saying which gradients wait on it. Those of another seed: the step applies one tape's
    gradients before the next tape's are computed (an alternating GAN), and its split into one
    tf.function per tape converts. Only those of its own seeds: the write sits inside the
    backward pass (a custom gradient that writes a variable and reads it back), and no split
    helps."""
    graph = body.graph
    after = graph.descendants([node.name], control=True)
    computed = {s: graph.descendants([s]) for s in seeds}
    own = [s for s in seeds if node.name in computed[s]]
    later = [s for s in seeds if s not in own
             and any(g.node in after and g.node in computed[s] for g in gradients)]
    if later:
        raise UnsupportedGraphError(
            f"function {body.name!r} applies gradients ({node.name!r}, {node.op}) before "
            f"the gradients of another tape (seed {later[0]!r}) are computed, which wait on "
            "that write: one finiteness check over the step cannot skip it. Split the step into "
            "one tf.function per tape, called from the step: each is then scaled and checked on "
            "its own (docs/training.md \"Several tapes in one step\")")
    raise UnsupportedGraphError(
        f"function {body.name!r} writes a variable ({node.name!r}, {node.op}) from the "
        f"gradients of seed {own[0]!r}, and gradients of the same seed wait on that write "
        "(such as a custom gradient that writes a variable and reads it back): the step's one "
        "finiteness check comes after it, so an overflowing step cannot skip it; convert with "
        "--loss-scale none, or --target bfloat16")


def _become_if(body: _Body, node: Node, finite: TensorRef, tin: list[int], then_name: str,
               else_name: str) -> None:
    """Turn write ``node`` into ``If(finite, *its inputs)`` calling the two branches; its name
    and control inputs stay."""
    graph = body.graph
    data = graph.inputs(node.name)
    for port, ref in enumerate([finite] + data[:-1]):
        graph.set_input(node.name, port, ref)
    graph.append_input(node.name, data[-1])
    proto = node.proto
    for fld, _ in proto.ListFields():   # the write's device and debug info go with it
        if fld.name not in ("name", "input", "attr"):
            proto.ClearField(fld.name)
    for key in list(node.attr):   # key by key: node.attr is the map the IR holds
        del node.attr[key]
    node.set_op("If")
    body.fg.defaults.pop(node.name, None)
    node.attr["Tcond"].type = BOOL
    node.attr["Tin"].CopyFrom(_types(tin))
    node.attr["Tout"].CopyFrom(_types([]))
    node.attr["then_branch"].func.name = then_name
    node.attr["else_branch"].func.name = else_name
    node.attr["output_shapes"].list.SetInParent()
    node.attr["_lower_using_switch_merge"].b = True   # as tf.cond sets: lowered at run time
    invalidate(node)


def _branch_pair(library, op: str, attrs: dict, tin: list[int], number: int) -> tuple[str, str]:
    """Two new library functions: ``then`` runs write ``op`` (with ``attrs``) on its inputs,
    ``else`` nothing."""
    taken = {f.signature.name for f in library.function}
    base = f"{SCOPE}_gate_{number}_{op}"
    while f"{base}_then" in taken:
        base += "_"
    names = []
    for suffix in ("then", "else"):
        f = library.function.add()
        f.signature.name = f"{base}_{suffix}"
        f.signature.is_stateful = suffix == "then"
        for i, dtype in enumerate(tin):
            f.signature.input_arg.add(name=f"a{i}", type=dtype)
        if suffix == "then":
            write = f.node_def.add(name="write", op=op)
            write.input.extend(f"a{i}" for i in range(len(tin)))
            for key, value in attrs.items():
                write.attr[key].CopyFrom(value)
            f.control_ret["write"] = "write"
            f.signature.control_output.append("write")
        names.append(f.signature.name)
    return names[0], names[1]


def _next_state(body: _Body, config: ScaleConfig, finite: TensorRef, handles: list[TensorRef],
                reads: list[TensorRef]) -> list[str]:
    """Assignments of the next scale and counters (TF1 graphs' rule, docs/training.md "Modes")."""
    scale_r, skipped_r, good_r = handles
    scale, skipped, good = reads
    n = f"{SCOPE}/next"
    overflow = body.add("Cast", f"{n}/overflow_count", [body.add("LogicalNot", f"{n}/overflow", [finite])],
                        SrcT=BOOL, DstT=I64)
    updates = [body.add("AssignVariableOp", f"{SCOPE}/skipped_steps/update",
                        [skipped_r, body.add("AddV2", f"{n}/skipped_steps", [skipped, overflow], T=I64)],
                        dtype=I64)]
    if config.mode == "dynamic":
        factor = body.const(f"{n}/factor", config.factor, FLOAT)
        grown = body.add("Mul", f"{n}/grown", [scale, factor], T=FLOAT)
        shrunk = body.add("Maximum", f"{n}/shrunk", [body.add("RealDiv", f"{n}/divided", [scale, factor],
                                                              T=FLOAT), body.const(f"{n}/floor", 1.0, FLOAT)],
                          T=FLOAT)
        count = body.add("AddV2", f"{n}/count", [good, body.const(f"{n}/one", 1, I64)], T=I64)
        grow = body.add("LogicalAnd", f"{n}/grow", [finite, body.add(
            "GreaterEqual", f"{n}/due", [count, body.const(f"{n}/interval", config.interval, I64)], T=I64)])
        grow_ok = body.add("LogicalAnd", f"{n}/grow_ok",
                           [grow, body.add("IsFinite", f"{n}/grown_is_finite", [grown], T=FLOAT)])
        kept = body.add("SelectV2", f"{n}/kept_or_grown", [grow_ok, grown, scale], T=FLOAT)
        new_scale = body.add("SelectV2", f"{n}/scale", [finite, kept, shrunk], T=FLOAT)
        counting = body.add("LogicalAnd", f"{n}/counting",
                            [finite, body.add("LogicalNot", f"{n}/not_grow", [grow])])
        new_good = body.add("SelectV2", f"{n}/good_steps",
                            [counting, count, body.const(f"{n}/zero", 0, I64)], T=I64)
        updates.append(body.add("AssignVariableOp", f"{SCOPE}/scale/update", [scale_r, new_scale], dtype=FLOAT))
        updates.append(body.add("AssignVariableOp", f"{SCOPE}/good_steps/update", [good_r, new_good], dtype=I64))
    return [u.node for u in updates]


def _scale_function(body: _Body, library, config: ScaleConfig, branches: dict) -> _Found:
    """Loss scaling in one train function's body; its three new inputs come last."""
    seeds = _seeds(body)
    gradients = _gradients(body, seeds)
    handles = [body.add_resource_arg(f"{SCOPE}_{name}_resource", dtype) for name, dtype in STATE]
    reads = [body.add("ReadVariableOp", f"{SCOPE}/{name}/read", [handle], dtype=dtype)
             for (name, dtype), handle in zip(STATE, handles)]
    scale = reads[0]
    for seed in seeds:   # one scale for every tape: one step, one check (module docstring)
        _scale_seed(body, seed, scale)
    finite, unscaled = _unscale_and_check(body, gradients, scale)
    gated, ungated = _gate_writes(body, library, finite, seeds, gradients, branches)
    updates = _next_state(body, config, finite, handles, reads)
    # the step runs them, and its results wait on them, as TF2's automatic control
    # dependencies make every result wait on every stateful op
    group = body.add("NoOp", f"{SCOPE}/update", control=updates).node
    for name in updates:
        body.fdef.control_ret[name] = name
        body.fdef.signature.control_output.append(name)
    for ret in body.fg.rets:
        producer = body.graph.input(ret, 0).node
        if producer not in body.fg.args:
            body.graph.add_control_edge(group, producer)
    return _Found(body.name, seeds, [_function_ref(body, g) for g in unscaled], gated, ungated)


def _scale_seed(body: _Body, seed: str, scale: TensorRef) -> None:
    """Every reader of ``seed`` reads it times ``scale`` (cast to the seed's dtype)."""
    seed_ref = TensorRef(seed)
    seed_dtype = body.dtype(seed_ref)
    factor = scale if seed_dtype == FLOAT else body.add("Cast", f"{seed}/amp_scale_cast", [scale],
                                                        SrcT=FLOAT, DstT=seed_dtype)
    seed_readers = body.readers(seed_ref)
    scaled = body.add("Mul", f"{seed}/amp_scaled", [seed_ref, factor], T=seed_dtype)
    for reader, index in seed_readers:
        body.graph.set_input(reader, index, scaled)


def _function_ref(body: _Body, ref: TensorRef) -> str:
    """``ref`` as the FunctionDef names it (``node:output_arg:index``), as the report shows it."""
    if ref.node in body.fg.args:
        return ref.node
    arg, index = output_layout(body.graph.node(ref.node).proto, body.signatures)[ref.port]
    return f"{ref.node}:{arg}:{index}"


# ----------------------------------------------------------------- the model around them
def unscalable_train_functions(meta: meta_graph_pb2.MetaGraphDef,
                               config: ScaleConfig) -> dict[str, str]:
    """The train functions of ``meta`` that no signature reaches (a ``tf.function`` method
    saved beside the signatures, a trace kept with its method) and that loss scaling would
    refuse, each with the refusal (its reason and its fix): found by scaling a copy of each
    body, before anything is painted. They are left alone, neither painted nor scaled, so a
    method that cannot be converted keeps the rest of the model convertible; a signature that
    reaches such a function is refused instead, when its turn comes."""
    library = meta.graph_def.library
    reached = set(reachable(meta.graph_def.node, library))
    restored = reachable((), library, meta.object_graph_def.concrete_functions)
    by_name = {f.signature.name: f for f in library.function}
    signatures = _signatures(library)
    out = {}
    for name in training_functions(library, restored):
        if name in reached:
            continue
        try:
            _refuse_writes_in_callees(by_name, [name])
            _refuse_direct_calls(meta.graph_def, name)
            trial = function_pb2.FunctionDef()
            trial.CopyFrom(by_name[name])
            _scale_function(_Body(trial, signatures), function_pb2.FunctionDefLibrary(),
                            config, {})
        except InputError as exc:   # the user's: a refusal, or a body we cannot take
            out[name] = str(exc)
    return out


def add_saved_model_loss_scaling(meta: meta_graph_pb2.MetaGraphDef, config: ScaleConfig,
                                 report, leave: dict[str, str] | None = None
                                 ) -> dict[str, np.ndarray] | None:
    """Loss scaling in every train function ``meta`` restores (in place): those a signature
    reaches and the object graph's concrete functions (a method's traces), but those of
    ``leave`` (:func:`unscalable_train_functions`: name -> why), which are named in a warning.
    Returns the variables to add to the checkpoint under ``root.amp_loss_scale`` (local name ->
    starting value), or None when nothing trains.

    Raises :class:`UnsupportedGraphError` for a graph whose own nodes train (a TF1 SavedModel),
    a train step whose writes sit in functions it calls, one that applies a tape's gradients
    before another tape's are computed, and a model converted before.
    """
    library = meta.graph_def.library
    og = meta.object_graph_def
    leave = leave or {}
    _warn_left_alone(leave, report)
    restored = reachable(meta.graph_def.node, library, og.concrete_functions)
    train = [name for name in training_functions(library, restored) if name not in leave]
    if not train:
        return None
    if not og.nodes:
        raise UnsupportedGraphError(f"function {train[0]!r} trains, but the SavedModel has no "
                                    "object graph to hold loss-scale state (a TF1 SavedModel): "
                                    "convert its MetaGraph (.meta) instead")
    if any(c.local_name == SCOPE for c in og.nodes[0].children):
        raise UnsupportedGraphError(f"the SavedModel already has {SCOPE!r} state: converted "
                                    "before (it would be scaled twice)")
    ids = _add_objects(og)
    scale_train_functions(meta, train, config, report, ids)
    log.info("a checkpoint written before conversion restores into the converted model with "
             "tf.train.Checkpoint(loaded).read(path); %s then starts fresh (scale %g)",
             SCOPE, config.start)
    return {"scale": np.float32(config.start), "skipped_steps": np.int64(0),
            "good_steps": np.int64(0)}


def _warn_left_alone(leave: dict[str, str], report) -> None:
    """One warning per train function left alone: float32, unscaled, and why."""
    for name, why in leave.items():
        text = (f"train function {name!r}, which no signature reaches, left as it is (float32, "
                f"without loss scaling): {why}")
        report.warnings.append(text)
        log.warning(text)


def scale_train_functions(meta: meta_graph_pb2.MetaGraphDef, train: list[str],
                          config: ScaleConfig, report, ids: list[int] = ()) -> None:
    """Loss scaling inside the library functions ``train`` of ``meta`` (in place): each gets
    the three state handles as new inputs, and so does every caller up to the graph, whose
    call nodes read the ``VarHandleOp`` nodes ``amp_loss_scale/<name>`` (added where missing).
    ``ids`` are the state's object-graph nodes (a SavedModel's), bound to each new capture.

    Every body is edited as IR and linted before it is written back, the gates' new branch
    functions are linted too, and every call site must then agree with its callee's signature:
    a :class:`~amp_rewrite.core.errors.LintError` otherwise (our bug), which ends the conversion
    before anything is written."""
    library = meta.graph_def.library
    by_name = {f.signature.name: f for f in library.function}
    _refuse_writes_in_callees(by_name, train)
    branches: dict = {}
    found = []
    signatures = _signatures(library)
    for name in train:
        body = _Body(by_name[name], signatures)
        found.append(_scale_function(body, library, config, branches))
        by_name[name].CopyFrom(body.finish())
        if ids and name in meta.object_graph_def.concrete_functions:
            meta.object_graph_def.concrete_functions[name].bound_inputs.extend(ids)
    branch_names = {name for pair in branches.values() for name in pair}
    for f in library.function:
        if f.signature.name in branch_names:
            _lint_new_function(f, signatures)
    _forward_handles(meta, train, list(ids))
    problems = check_call_types(meta.graph_def)
    if problems:
        raise LintError(problems)
    _add_ops(meta)
    report.extra["loss_scaling"] = _record(config, found, saved=bool(ids))
    ungated = [f"{f.function}/{w}" for f in found for w in f.ungated]
    if ungated:
        text = (f"{len(ungated)} variable write(s) run before the finiteness check, which waits "
                f"on them, so an overflowing step does not skip them: {', '.join(ungated[:3])}"
                + (" ..." if len(ungated) > 3 else ""))
        report.warnings.append(text)
        log.warning(text)
    log.info("loss scaling: %s", report.extra["loss_scaling"]["summary"])


def _lint_new_function(fdef: function_pb2.FunctionDef, signatures: dict) -> None:
    """The lint of a function amp-rewrite wrote from scratch (a gate's branch)."""
    problems = lint.lint_problems(function_to_graph(fdef, signatures).graph)
    if problems:
        raise LintError([f"function {fdef.signature.name!r}: {p}" for p in problems])


def _refuse_writes_in_callees(by_name: dict, train: list[str]) -> None:
    """Writes are gated in the train step's own body only: refuse one whose callees write."""
    names = set(by_name)
    for name in train:
        writers = [c for node in by_name[name].node_def for c in called_functions(node, names)
                   if any(is_variable_write(n.op) for n in by_name[c].node_def)]
        if writers:
            raise UnsupportedGraphError(
                f"function {name!r} trains, and some of its variable writes sit in function "
                f"{writers[0]!r} it calls; amp-rewrite gates only writes in the train step's "
                "own body: convert with --loss-scale none, or --target bfloat16")


def _record(config: ScaleConfig, found: list[_Found], saved: bool) -> dict:
    """The report's ``loss_scaling`` section for train functions (docs/report.md "Report schema");
    ``saved``: the state is the loaded SavedModel's, else the graph's variables."""
    return {
        "mode": config.mode, "start": config.start,
        **({"interval": config.interval, "factor": config.factor} if config.mode == "dynamic" else {}),
        "functions": [f.function for f in found], "seeds": [f"{f.function}/{s}" for f in found for s in f.seeds],
        "gradients": [f"{f.function}/{g}" for f in found for g in f.gradients],
        "gated_writes": sum(len(f.gated) for f in found),
        "ungated_writes": [f"{f.function}/{w}" for f in found for w in f.ungated],
        "variables": [f"{SCOPE}.{name}" if saved else f"{SCOPE}/{name}" for name, _ in STATE],
        "summary": _summary(config, found, saved)}


def _summary(config: ScaleConfig, found: list[_Found], saved: bool) -> str:
    how = (f"dynamic (start {config.start:g}, x{config.factor:g} after {config.interval} finite "
           f"steps)" if config.mode == "dynamic" else f"static {config.start:g}")
    return (f"{how}; {len(found)} train function(s); "
            f"{sum(len(f.gradients) for f in found)} gradients, "
            f"{sum(len(f.gated) for f in found)} writes gated; "
            + (f"state in loaded.{SCOPE}" if saved else f"scale in {SCOPE}/scale/Read/ReadVariableOp:0"))


def _add_objects(og) -> list[int]:
    """``root.amp_loss_scale``, a user object with three scalar variables; their node ids."""
    parent_id = len(og.nodes)
    parent = og.nodes.add()
    parent.user_object.identifier = "_generic_user_object"
    parent.user_object.version.producer = 1
    parent.user_object.version.min_consumer = 1
    ids = []
    for name, dtype in STATE:
        ids.append(len(og.nodes))
        var = og.nodes.add().variable
        var.dtype = dtype
        var.shape.SetInParent()
        var.trainable = False
        var.synchronization = 1   # VariableSynchronization.ON_WRITE
        var.aggregation = 3       # VariableAggregation.ONLY_FIRST_REPLICA
        var.name = f"{SCOPE}/{name}"
        parent.children.add(node_id=ids[-1], local_name=name)
    og.nodes[0].children.add(node_id=parent_id, local_name=SCOPE)
    return ids


def _forward_handles(meta: meta_graph_pb2.MetaGraphDef, train: list[str], ids: list[int]) -> None:
    """Every caller of a function in ``train`` passes the new handles: a caller function
    captures them too (new trailing inputs, bound to the same objects) and forwards them; a call
    in the graph itself reads new ``VarHandleOp`` nodes. Repeated up the call graph."""
    library = meta.graph_def.library
    og = meta.object_graph_def
    pending, done = list(reversed(train)), set()
    while pending:
        target = pending.pop()
        if target in done:
            continue
        done.add(target)
        _refuse_direct_calls(meta.graph_def, target)
        for f in library.function:
            if not any(_calls(n, target) for n in f.node_def):
                continue
            body = _Body(f, _signatures(library))
            args = [a for a in body.fg.args if a.startswith(f"{SCOPE}_")]
            # a function with the handles already (a train function, or a caller of another
            # one whose callers were given them then) has its callers passing them too
            new = not args
            if new:
                args = [body.add_resource_arg(f"{SCOPE}_{name}_resource", dtype).node
                        for name, dtype in STATE]
            for node in body.nodes():
                if _calls(node, target):
                    _append_call_inputs(body.graph, node, [TensorRef(a) for a in args])
            f.CopyFrom(body.finish())
            if new:
                if ids and f.signature.name in og.concrete_functions:
                    og.concrete_functions[f.signature.name].bound_inputs.extend(ids)
                pending.append(f.signature.name)
    _graph_calls_pass_handles(meta.graph_def, done)


def _calls(node, target: str) -> bool:
    """Whether ``node`` (a NodeDef or an IR node) calls ``target`` through a call op."""
    return node.op in CALL_OPS and node.attr["f"].func.name == target


def _refuse_direct_calls(graph_def, target: str) -> None:
    """A node whose op is ``target`` itself calls it with exactly its signature's inputs,
    which cannot grow; TensorFlow's own SavedModels call through call ops."""
    bodies = [("the graph", graph_def.node)] + [(f"function {f.signature.name!r}", f.node_def)
                                                for f in graph_def.library.function]
    for where, nodes in bodies:
        for node in nodes:
            if node.op == target:
                raise UnsupportedGraphError(
                    f"node {node.name!r} in {where} calls train function {target!r} directly "
                    "(its op is the function's name), which cannot pass the loss-scale state; "
                    "convert with --loss-scale none, or --target bfloat16")


def _graph_calls_pass_handles(graph_def, targets: set[str]) -> None:
    """Calls of ``targets`` in the graph's own nodes read the state's ``VarHandleOp`` nodes
    (added where missing), edited as IR and linted before the graph is written back."""
    if not any(_calls(n, t) for n in graph_def.node for t in targets):
        return
    graph, added = graph_with_defaults(graph_def)
    handles = []
    for name, dtype in STATE:
        full = f"{SCOPE}/{name}"
        if full not in graph:
            graph.add_node("VarHandleOp", full, attrs={
                "dtype": attr_value_pb2.AttrValue(type=dtype),
                "shape": attr_value_pb2.AttrValue(shape=TensorShapeProto()),
                "shared_name": attr_value_pb2.AttrValue(s=full.encode())})
            added[full] = fill_defaults(graph.node(full).proto)
        handles.append(TensorRef(full))
    calls = [n for n in graph.nodes() if any(_calls(n, t) for t in targets)]
    for node in calls:
        _append_call_inputs(graph, node, handles)
    lint.lint(graph, only={n.name for n in calls} | {h.node for h in handles})
    out = graph.to_graph_def()
    strip_graph_defaults(out, added)
    del graph_def.node[:]
    graph_def.node.extend(out.node)


def _append_call_inputs(graph, node: Node, refs: list[TensorRef]) -> None:
    """``node``, a call, passes ``refs`` as its last inputs (resource handles)."""
    for ref in refs:
        graph.append_input(node.name, ref)
    node.set_op("StatefulPartitionedCall")
    node.attr["Tin"].list.type.extend([RESOURCE] * len(refs))
    invalidate(node)


def _add_ops(meta: meta_graph_pb2.MetaGraphDef) -> None:
    """The ops added, in the MetaGraph's list of the ops it uses (loaders check against it)."""
    ops = meta.meta_info_def.stripped_op_list
    have = {op.name for op in ops.op}
    for name in _OPS_USED:
        if name not in have:
            ops.op.add().CopyFrom(op_def(name))
