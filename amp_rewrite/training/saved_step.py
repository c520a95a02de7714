"""Dynamic or static loss scaling inside a TF2 SavedModel's train-step functions.

A TF2 user saves a trainable model as a ``tf.Module`` (or a Keras model and optimizer held by
one) whose ``tf.function`` computes a ``GradientTape`` and applies the gradients. Its train step
is a library function, its variables are captured resource inputs bound to objects of the
SavedModel's object graph, and its state lives in ``variables/``. Loss scaling there means:

* the object graph gains ``root.amp_loss_scale`` with three variables (``scale``,
  ``skipped_steps``, ``good_steps``), which :func:`amp_rewrite.save.save` writes into the
  checkpoint with TensorFlow's own writer (the original tensors keep their bytes);
* each train function captures them as three more resource inputs (and so does every function
  or graph node that calls it, up the call graph);
* in its body the tape's seed is multiplied by the scale, each gradient is divided by it in
  float32 where it leaves the tape's scope, one ``IsFinite``/``All`` checks them all, and every
  variable write of the step becomes an ``If(all_finite)`` of the same name whose then-branch is
  the write: a skipped step writes nothing, so every variable, slot and counter keeps its bits
  (but a write the check itself waits on, such as a running input mean used before the tape,
  which cannot wait for it: the report names those in a warning);
* the scale and counters are updated as in TF1 graphs (README "Training graphs and loss
  scaling").

The body is edited as the FunctionDef TensorFlow wrote (``node:output:index`` references), in
place: every node keeps its name, so control edges, ``control_ret`` and the automatic control
dependencies TensorFlow recorded still hold. What cannot be found without doubt (no seed or
several, writes inside nested calls, a model converted before) is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from tensorflow.core.framework import attr_value_pb2, function_pb2, node_def_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import tensor_util

from ..dtypes import CONVERTIBLE, FLOAT
from ..errors import UnsupportedGraphError
from ..ir import Node
from ..library import called_functions, output_layout
from ..loss_scale import ScaleConfig
from ..ops import CALL_OPS, is_variable_write
from ..signatures import fill_defaults, input_dtype, node_types, op_def, output_dtype
from .detect import backprop_scope, training_functions
from .state import SCOPE

log = logging.getLogger(__name__)

I64, BOOL, INT32, RESOURCE = types_pb2.DT_INT64, types_pb2.DT_BOOL, types_pb2.DT_INT32, types_pb2.DT_RESOURCE
#: the variables the loaded object gains under ``root.amp_loss_scale``, with their dtypes
STATE = (("scale", FLOAT), ("skipped_steps", I64), ("good_steps", I64))
_OPS_USED = ("If", "IsFinite", "All", "Pack", "RealDiv", "LogicalNot", "LogicalAnd",
             "GreaterEqual", "SelectV2", "Maximum", "Reshape", "VarHandleOp", "AssignVariableOp",
             "ReadVariableOp", "Cast", "Mul", "AddV2", "NoOp", "Const", "StatefulPartitionedCall")


class _Body:
    """A FunctionDef edited in place; tensors are FunctionDef references ``node:arg:index``."""

    def __init__(self, fdef: function_pb2.FunctionDef):
        self.f = fdef
        self.args = {a.name: a.type for a in fdef.signature.input_arg}
        self.nodes = {n.name: n for n in fdef.node_def}
        self._readers: dict[str, list] | None = None

    def out(self, name: str, index: int = 0) -> str:
        if name in self.args:
            return name
        outputs = op_def(self.nodes[name].op).output_arg
        return f"{name}:{outputs[0].name}:{index}" if outputs else name

    def dtype(self, ref: str) -> int | None:
        """The dtype of ``ref`` (None for an op TensorFlow does not register)."""
        parts = ref.split(":")
        if len(parts) == 1:
            return self.args.get(ref)
        node = self.nodes[parts[0]]
        if op_def(node.op) is None:
            return None
        typed = _typed(node)
        return output_dtype(typed, output_layout(typed.proto, {}).index((parts[1], int(parts[2]))))

    def add(self, op: str, name: str, inputs=(), control=(), **attrs):
        if name in self.nodes or name in self.args:
            raise UnsupportedGraphError(f"function {self.f.signature.name!r} already has a node "
                                        f"{name!r}: converted before?")
        node = self.f.node_def.add(name=name, op=op)
        node.input.extend(inputs)
        node.input.extend("^" + c for c in control)
        for key, value in attrs.items():
            node.attr[key].CopyFrom(value if isinstance(value, attr_value_pb2.AttrValue)
                                    else attr_value_pb2.AttrValue(type=value))
        self.nodes[name] = node
        if self._readers is not None:
            for i, text in enumerate(node.input):
                self._readers.setdefault(text, []).append((node, i))
        return self.out(name)

    def const(self, name: str, value, dtype: int) -> str:
        proto = tensor_util.make_tensor_proto(value, dtype=dtype)
        return self.add("Const", name, value=attr_value_pb2.AttrValue(tensor=proto), dtype=dtype)

    def add_resource_arg(self, name: str, var_dtype: int) -> str:
        """A new trailing resource input (a capture), with ``_input_shapes`` kept in step
        (the loader refuses a function whose shapes and inputs differ in number)."""
        index = len(self.f.signature.input_arg)
        arg = self.f.signature.input_arg.add(name=name, type=RESOURCE)
        arg.handle_data.add(dtype=var_dtype).shape.SetInParent()
        if "_input_shapes" in self.f.attr:
            self.f.attr["_input_shapes"].list.shape.add()       # a handle is a scalar
        self.f.arg_attr[index].attr["_user_specified_name"].s = b"resource"
        self.args[name] = RESOURCE
        return name

    def readers(self, ref: str) -> list:
        """``(node, input index)`` of every data input that reads ``ref``."""
        if self._readers is None:
            self._readers = {}
            for node in self.f.node_def:
                for i, text in enumerate(node.input):
                    self._readers.setdefault(text, []).append((node, i))
        return list(self._readers.get(ref, ()))

    def rewire(self, node, index: int, ref: str) -> None:
        if self._readers is not None:
            old = self._readers.get(node.input[index], [])
            old[:] = [(n, i) for n, i in old if not (n is node and i == index)]
            self._readers.setdefault(ref, []).append((node, index))
        node.input[index] = ref

    def descendants(self, names) -> set[str]:
        """``names`` and the nodes that read them, through data edges."""
        readers: dict[str, list[str]] = {}
        for node in self.f.node_def:
            for text in node.input:
                if not text.startswith("^"):
                    readers.setdefault(text.split(":")[0], []).append(node.name)
        seen, stack = set(), list(names)
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(readers.get(name, ()))
        return seen

    def ancestors(self, names) -> set[str]:
        seen, stack = set(), list(names)
        while stack:
            name = stack.pop()
            if name in seen or name not in self.nodes:
                continue
            seen.add(name)
            stack.extend(s.lstrip("^").split(":")[0] for s in self.nodes[name].input)
        return seen


def _typed(node) -> Node:
    """A body node as the type model reads it: a copy holding the OpDef defaults that
    SavedModels strip (type attributes among them)."""
    filled = node_def_pb2.NodeDef()
    filled.CopyFrom(node)
    fill_defaults(filled)
    return Node(filled)


def _input_types(node) -> list[int]:
    typed = _typed(node)
    return [input_dtype(typed, port) for port in range(len(node_types(typed).inputs))]


def _types(dtypes) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=list(dtypes)))


def _in_tape(name: str) -> bool:
    return backprop_scope(name) is not None


# ----------------------------------------------------------------- one train function
@dataclass
class _Found:
    function: str
    seed: str
    gradients: list[str]
    gated: list[str]
    ungated: list[str] = field(default_factory=list)   # writes the check waits on


def _seed(body: _Body) -> str:
    """The tape's backprop seed: a float Const of ones outside the tape scope, read only by it
    (``tape.gradient(loss, ...)`` without ``output_gradients``)."""
    seeds = []
    for node in body.f.node_def:
        if node.op != "Const" or _in_tape(node.name):
            continue
        readers = body.readers(body.out(node.name))
        if readers and all(_in_tape(r.name) for r, _ in readers):
            value = tensor_util.MakeNdarray(node.attr["value"].tensor)
            if value.dtype.kind == "f" and value.size and np.all(value == 1):
                seeds.append(node.name)
    if len(seeds) != 1:
        raise UnsupportedGraphError(
            f"function {body.f.signature.name!r} trains, but amp-rewrite finds "
            f"{'no backprop seed' if not seeds else 'several backprop seeds: ' + ', '.join(seeds)} "
            "(a Const of ones read only by the gradient tape); convert with --loss-scale none, "
            "or --target bfloat16")
    return seeds[0]


def _gradients(body: _Body, seed: str) -> list[str]:
    """Float tensors made in the backward pass and read outside it, in body order. The
    backward pass is the tape's scope and what lies between its nodes on the seed's side: the
    tape sums a tensor's gradient contributions with an ``AddN`` outside the scope, whose result
    the scope reads again (taking that sum for a gradient would unscale part of the backward
    pass). Only what the seed computes counts: a forward ``While`` also reads the scope (its
    gradient's accumulators) and is read by it, but is no gradient."""
    scoped = {n.name for n in body.f.node_def if _in_tape(n.name)} | {seed}
    inside = scoped | (body.descendants([seed]) & body.ancestors(scoped))
    found: list[str] = []
    for node in body.f.node_def:
        if node.name in inside:
            continue
        for ref in node.input:
            if (not ref.startswith("^") and ref.split(":")[0] in inside and ref not in found
                    and body.dtype(ref) in CONVERTIBLE):
                found.append(ref)
    return found


def _widen_pass_through(body: _Body, reader, index: int, value: str) -> bool:
    """A low-precision gradient read by an Identity/IdentityN (Keras' all-reduce point) whose
    output only feeds casts to float32: that slot becomes float32 and reads ``value``, so the
    unscaled gradient never rounds through 16 bits again (small ones would flush to zero)."""
    if reader.op not in ("Identity", "IdentityN"):
        return False
    slot = 0 if reader.op == "Identity" else index
    casts = body.readers(f"{reader.name}:output:{slot}")
    if not casts or any(r.op != "Cast" or r.attr["DstT"].type != FLOAT for r, _ in casts):
        return False
    body.rewire(reader, index, value)
    if reader.op == "Identity":
        reader.attr["T"].type = FLOAT
    else:
        reader.attr["T"].list.type[index] = FLOAT
    reader.attr.pop("_output_shapes", None)
    for cast, _ in casts:
        cast.attr["SrcT"].type = FLOAT
    return True


def _unscale_and_check(body: _Body, gradients: list[str], scale: str) -> tuple[str, list[str]]:
    """Divide each gradient by ``scale`` in float32 where it leaves the tape; returns the one
    flag that all of them are finite, and the float32 tensors unscaled (one per gradient: a
    16-bit gradient and painting's float32 cast of it are the same gradient)."""
    unscaled: dict[str, str] = {}
    flags = []
    for k, grad in enumerate(gradients):
        readers = [(r, i) for r, i in body.readers(grad) if not _in_tape(r.name)]
        dtype = body.dtype(grad)
        node = grad.split(":")[0]
        if dtype == FLOAT:
            wide = grad
        else:   # painting's float32 cast of it, where there is one: one value per gradient
            casts = [r for r, _ in body.readers(grad) if r.op == "Cast" and r.attr["DstT"].type == FLOAT]
            wide = (body.out(casts[0].name) if casts else
                    body.add("Cast", f"{node}/amp_float_{k}", [grad], SrcT=dtype, DstT=FLOAT))
        if wide not in unscaled:
            base = wide.split(":")[0]
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
                body.rewire(reader, index, value)
            elif reader.name != wide.split(":")[0] and not _widen_pass_through(body, reader, index, value):
                back = f"{node}/amp_unscaled_{k}"     # a 16-bit reader gets it rounded back
                ref = body.out(back) if back in body.nodes else body.add(
                    "Cast", back, [value], SrcT=FLOAT, DstT=dtype)
                body.rewire(reader, index, ref)
    packed = body.add("Pack", f"{SCOPE}/finite_flags", flags, T=BOOL)
    body.nodes[f"{SCOPE}/finite_flags"].attr["N"].i = len(flags)
    finite = body.add("All", f"{SCOPE}/all_finite", [packed, body.const(f"{SCOPE}/axis", 0, INT32)],
                      Tidx=INT32)
    return finite, list(unscaled)


def _gate_writes(body: _Body, library, finite: str, branches: dict) -> tuple[list[str], list[str]]:
    """Every variable write of the step becomes an ``If`` of the same name whose then-branch is
    the write and whose else-branch does nothing; returns those and the writes the check itself
    waits on (gating them would make a cycle), which run on every step."""
    before_check = body.ancestors([finite.split(":")[0]])
    gated, ungated = [], []
    for node in list(body.f.node_def):
        if is_variable_write(node.op) and node.name in before_check:
            ungated.append(f"{node.name} ({node.op})")
        if not is_variable_write(node.op) or node.name in before_check:
            continue
        tin = _input_types(node)
        key = (node.op, tuple(sorted((k, v.SerializeToString(deterministic=True))
                                     for k, v in node.attr.items() if not k.startswith("_"))))
        if key not in branches:
            branches[key] = _branch_pair(library, node, tin, len(branches))
        then_name, else_name = branches[key]
        data = [x for x in node.input if not x.startswith("^")]
        control = [x for x in node.input if x.startswith("^")]
        op, name = node.op, node.name
        node.Clear()
        node.name, node.op = name, "If"
        node.input.extend([finite] + data + control)
        node.attr["Tcond"].type = BOOL
        node.attr["Tin"].CopyFrom(_types(tin))
        node.attr["Tout"].CopyFrom(_types([]))
        node.attr["then_branch"].func.name = then_name
        node.attr["else_branch"].func.name = else_name
        node.attr["output_shapes"].list.SetInParent()
        node.attr["_lower_using_switch_merge"].b = True   # as tf.cond sets: lowered at run time
        gated.append(f"{name} ({op})")
    body._readers = None
    return gated, ungated


def _branch_pair(library, node, tin: list[int], number: int) -> tuple[str, str]:
    """Two new library functions: ``then`` runs ``node``'s write on its inputs, ``else`` nothing."""
    taken = {f.signature.name for f in library.function}
    base = f"{SCOPE}_gate_{number}_{node.op}"
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
            write = f.node_def.add(name="write", op=node.op)
            write.input.extend(f"a{i}" for i in range(len(tin)))
            for key, value in node.attr.items():
                if not key.startswith("_"):
                    write.attr[key].CopyFrom(value)
            f.control_ret["write"] = "write"
            f.signature.control_output.append("write")
        names.append(f.signature.name)
    return names[0], names[1]


def _next_state(body: _Body, config: ScaleConfig, finite: str, handles: list[str],
                reads: list[str]) -> list[str]:
    """Assignments of the next scale and counters (TF1 graphs' rule, README "Modes")."""
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
    return [u.split(":")[0] for u in updates]


def _scale_function(body: _Body, library, config: ScaleConfig, branches: dict) -> _Found:
    """Loss scaling in one train function's body; its three new inputs come last."""
    seed = _seed(body)
    gradients = _gradients(body, seed)
    handles = [body.add_resource_arg(f"{SCOPE}_{name}_resource", dtype) for name, dtype in STATE]
    reads = [body.add("ReadVariableOp", f"{SCOPE}/{name}/read", [handle], dtype=dtype)
             for (name, dtype), handle in zip(STATE, handles)]
    scale = reads[0]
    seed_ref = body.out(seed)
    seed_dtype = body.dtype(seed_ref)
    factor = scale if seed_dtype == FLOAT else body.add("Cast", f"{seed}/amp_scale_cast", [scale],
                                                        SrcT=FLOAT, DstT=seed_dtype)
    seed_readers = body.readers(seed_ref)
    scaled = body.add("Mul", f"{seed}/amp_scaled", [seed_ref, factor], T=seed_dtype)
    for reader, index in seed_readers:
        body.rewire(reader, index, scaled)
    finite, gradients = _unscale_and_check(body, gradients, scale)
    gated, ungated = _gate_writes(body, library, finite, branches)
    updates = _next_state(body, config, finite, handles, reads)
    # the step runs them, and its results wait on them, as TF2's automatic control
    # dependencies make every result wait on every stateful op
    group = body.add("NoOp", f"{SCOPE}/update", control=updates).split(":")[0]
    for name in updates:
        body.f.control_ret[name] = name
        body.f.signature.control_output.append(name)
    for ret in body.f.ret.values():
        producer = body.nodes.get(ret.split(":")[0])
        if producer is not None:
            producer.input.append("^" + group)
    return _Found(body.f.signature.name, seed, gradients, gated, ungated)


# ----------------------------------------------------------------- the model around them
def add_saved_model_loss_scaling(meta: meta_graph_pb2.MetaGraphDef, config: ScaleConfig,
                                 report) -> dict[str, np.ndarray] | None:
    """Loss scaling in every train function ``meta`` restores (in place); returns the variables
    to add to the checkpoint under ``root.amp_loss_scale`` (local name -> starting value), or
    None when nothing trains.

    Raises :class:`UnsupportedGraphError` for a graph whose own nodes train (a TF1 SavedModel),
    a train step whose writes sit in functions it calls, and a model converted before.
    """
    library = meta.graph_def.library
    og = meta.object_graph_def
    train = training_functions(library)
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


def scale_train_functions(meta: meta_graph_pb2.MetaGraphDef, train: list[str],
                          config: ScaleConfig, report, ids: list[int] = ()) -> None:
    """Loss scaling inside the library functions ``train`` of ``meta`` (in place): each gets
    the three state handles as new inputs, and so does every caller up to the graph, whose
    call nodes read the ``VarHandleOp`` nodes ``amp_loss_scale/<name>`` (added where missing).
    ``ids`` are the state's object-graph nodes (a SavedModel's), bound to each new capture."""
    library = meta.graph_def.library
    by_name = {f.signature.name: f for f in library.function}
    _refuse_writes_in_callees(by_name, train)
    branches: dict = {}
    found = []
    for name in train:
        found.append(_scale_function(_Body(by_name[name]), library, config, branches))
        if ids and name in meta.object_graph_def.concrete_functions:
            meta.object_graph_def.concrete_functions[name].bound_inputs.extend(ids)
    for name in train:
        _forward_handles(meta, name, list(ids))
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
    """The report's ``loss_scaling`` section for train functions (README "Report schema");
    ``saved``: the state is the loaded SavedModel's, else the graph's variables."""
    return {
        "mode": config.mode, "start": config.start,
        **({"interval": config.interval, "factor": config.factor} if config.mode == "dynamic" else {}),
        "functions": [f.function for f in found], "seeds": [f"{f.function}/{f.seed}" for f in found],
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


def _forward_handles(meta: meta_graph_pb2.MetaGraphDef, callee: str, ids: list[int]) -> None:
    """Every caller of ``callee`` passes the new handles: a caller function captures them too
    (new trailing inputs, bound to the same objects) and forwards them; a call in the graph
    itself reads new ``VarHandleOp`` nodes. Repeated up the call graph."""
    library = meta.graph_def.library
    og = meta.object_graph_def
    pending, done = [callee], set()
    while pending:
        target = pending.pop()
        if target in done:
            continue
        done.add(target)
        for f in library.function:
            calls = [n for n in f.node_def if n.op in CALL_OPS and n.attr["f"].func.name == target]
            if not calls:
                continue
            body = _Body(f)
            args = [a.name for a in f.signature.input_arg if a.name.startswith(f"{SCOPE}_")]
            for call in calls:
                call.op = "StatefulPartitionedCall"
                _append_call_inputs(call, args or [f"{SCOPE}_{name}_resource" for name, _ in STATE])
            if args:
                # it has the handles already (a train function, or a caller of another one
                # whose callers were given them then): its callers pass them already
                continue
            for name, dtype in STATE:
                body.add_resource_arg(f"{SCOPE}_{name}_resource", dtype)
            if ids and f.signature.name in og.concrete_functions:
                og.concrete_functions[f.signature.name].bound_inputs.extend(ids)
            pending.append(f.signature.name)
        graph_calls = [n for n in meta.graph_def.node
                       if n.op in CALL_OPS and n.attr["f"].func.name == target]
        for call in graph_calls:
            _append_call_inputs(call, _graph_handles(meta.graph_def))


def _append_call_inputs(call, refs) -> None:
    data = [x for x in call.input if not x.startswith("^")]
    control = [x for x in call.input if x.startswith("^")]
    del call.input[:]
    call.input.extend(data + list(refs) + control)
    call.attr["Tin"].list.type.extend([RESOURCE] * len(refs))


def _graph_handles(graph_def) -> list[str]:
    names = []
    have = {n.name for n in graph_def.node}
    for name, dtype in STATE:
        full = f"{SCOPE}/{name}"
        if full not in have:
            node = graph_def.node.add(name=full, op="VarHandleOp")
            node.attr["dtype"].type = dtype
            node.attr["shape"].shape.SetInParent()
            node.attr["shared_name"].s = full.encode()
        names.append(full)
    return names


def _add_ops(meta: meta_graph_pb2.MetaGraphDef) -> None:
    """The ops added, in the MetaGraph's list of the ops it uses (loaders check against it)."""
    ops = meta.meta_info_def.stripped_op_list
    have = {op.name for op in ops.op}
    for name in _OPS_USED:
        if name not in have:
            ops.op.add().CopyFrom(op_def(name))
