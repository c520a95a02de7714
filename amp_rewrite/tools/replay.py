"""Replaying a TF2 SavedModel signature function body by body, for ``verify --per-node``.

Each body is imported as a graph and pruned to a function that returns every tensor inside
(a tf.function's results wait on its writes, through the control edges TensorFlow adds, so
those run in the replay as in the signature's run); the call ops of a body (While, If, Case,
PartitionedCall) are replayed with the values they were given, so every float tensor of every
body the signature runs is recorded, named ``function/node:port`` as the conversion report
names nodes.

**State.** A signature whose functions write variables (a train step: optimizer updates,
scatters into an embedding table, batch-norm statistics, a loss scale) is run several times per
sample: by TensorFlow, then body by body. So that every run computes what one call of the
signature computes, each starts from the state the SavedModel saved (:class:`SavedState`: the
variables its function captures, read once when it is loaded, which is the checkpoint in
``variables/``, and assigned back before each run), and each body replayed starts from the
state its call saw: its caller's run reads the variables a call is handed just before the call
(in the caller's graph, ordered by TensorFlow's own control edges), and the replay of the
callee assigns those values, then puts back what it found (:func:`_state_at_call`), so a While
body's next iteration, or the next call replayed, sees the state the real run left.

Why put values back rather than redirect the writes to copies: a write is one of many ops
(``AssignVariableOp``, ``ResourceApply*``, ``ResourceScatter*``, the ``If`` loss scaling wraps a
write in, ops no list here names) inside bodies TensorFlow itself runs (the signature's own
call, a caller's run of a nested call), so redirecting would mean rewriting every body and
knowing every op that writes; restoring the variable covers them all, because what is put back
is the state, not the op. Nothing is written to disk: only the loaded model's variables in
memory change, and both models (each its own loaded SavedModel) start every sample from their
own saved weights, which a conversion keeps byte for byte. State that is no variable (a mutable
lookup table) cannot be put back: a function that writes one is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def
from tensorflow.python.ops.resource_variable_ops import get_eager_safe_handle_data

from ..core.dtypes import FLOATING, RESOURCE, VARIANT
from ..core.errors import InputError, ReplayError
from ..core.ops import (
    CALL_OPS,
    CASE_OPS,
    FUNCTIONAL_OPS,
    IF_OPS,
    TABLE_WRITES,
    WHILE_OPS,
)
from ..io.load import Model
from ..schema.functiondef import reachable
from ..schema.opdefs import is_variable_write
from ..training.state import SCOPE
from .analysis import SCALED_SUFFIX, UNSCALED_SUFFIX
from .traces import TensorInfo, Trace, downstream, tensor_name

#: a function the conversion specialized for one call site (``f_amp1``) is ``f`` to verify
_SPECIALIZED = re.compile(r"_amp\d+$")
#: a While that a replay steps through more often than this is refused (a cond that never ends)
_MAX_ITERATIONS = 100_000
#: the reads a body's graph gains before each call handed a variable (``_read_state_before_calls``)
_STATE_READS = "amp_replay_state"
#: in a train function the conversion scaled, the scale this run used (training/in_functions.py)
_SCALE_READ = f"{SCOPE}/scale/read:0"


def serving_meta_graph(model: Model, key: str):
    """The MetaGraph ``tf.saved_model.load`` reads: the only one, else the ``serve`` one."""
    graphs = list(model.meta_graphs)
    if len(graphs) > 1:
        graphs = [m for m in graphs if "serve" in m.meta_info_def.tags] or graphs
    for meta in graphs:
        if key in meta.signature_def:
            return meta
    raise InputError(f"{model.path}: no MetaGraph holds signature {key!r}")


def signature_call(model: Model, key: str):
    """The MetaGraph holding signature ``key``, the signature, and the node that calls its
    function: a TF2 signature's call of a library function, None for a TF1 signature (its
    tensors are the MetaGraph's own nodes)."""
    meta = serving_meta_graph(model, key)
    sig = meta.signature_def[key]
    nodes = {n.name: n for n in meta.graph_def.node}
    producers = {info.name.split(":")[0] for info in sig.outputs.values()}
    call = nodes.get(next(iter(producers))) if len(producers) == 1 else None
    return meta, sig, call if call is not None and call.op in CALL_OPS else None


def variable_dtype(handle) -> int | None:
    """The dtype (an enum) of the variable an eager resource handle points to, as the handle
    says (its handle data); None for a handle that says none (a lookup table, another
    resource)."""
    if handle.dtype != tf.resource:
        return None
    data = get_eager_safe_handle_data(handle)
    if data is None or not data.is_set or len(data.shape_and_type) != 1:
        return None
    return data.shape_and_type[0].dtype or None


class SavedState:
    """The variables a signature's function captures, with the values they held when this
    object was made (right after ``tf.saved_model.load``: the SavedModel's checkpoint);
    :meth:`restore` assigns them back, so a run that writes variables leaves nothing the next
    run would start from."""

    def __init__(self, captured: Sequence):
        self.handles, self.values = [], []
        for handle in captured:
            dtype = variable_dtype(handle)
            if dtype is not None:
                self.handles.append(handle)
                self.values.append(tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype))

    def restore(self) -> None:
        _assign(self.handles, self.values)


def saved_state(fn) -> SavedState | None:
    """For a loaded signature function ``fn`` whose functions write variables, their state as
    loaded (:class:`SavedState`), taken now; None when nothing it runs writes one (a serving
    signature: nothing to put back, no run pays for it)."""
    graph_def = fn.graph.as_graph_def()
    defs = {f.signature.name: f for f in graph_def.library.function}
    bodies = [graph_def.node] + [defs[name].node_def
                                 for name in reachable(graph_def.node, graph_def.library)]
    if not any(is_variable_write(nd.op) for nodes in bodies for nd in nodes):
        return None
    return SavedState(fn.captured_inputs)


def _assign(handles: Sequence, values: Sequence) -> None:
    for handle, value in zip(handles, values):
        tf.raw_ops.AssignVariableOp(resource=handle, value=value)


@contextlib.contextmanager
def _state_at_call(inputs: Sequence, state: Sequence[tuple[int, object]]):
    """Inside, the variables a call was handed (``inputs[i]`` for each ``(i, value)`` of
    ``state``) hold what they held when the call ran; after, what they held before."""
    handles = [inputs[i] for i, _ in state]
    values = [value for _, value in state]
    found = [tf.raw_ops.ReadVariableOp(resource=h, dtype=v.dtype) for h, v in zip(handles, values)]
    _assign(handles, values)
    try:
        yield
    finally:
        _assign(handles, found)


class SignatureReplay:
    """Replays a TF2 signature function body by body (see :meth:`SavedModelRunner.trace`),
    each run from ``state`` (:class:`SavedState`, None: the signature writes no variable)."""

    def __init__(self, runner, meta, sig, call, state: SavedState | None = None):
        self.path = runner.path
        self.functions = FunctionReplay(meta.graph_def.library, runner.path,
                                        writes=state is not None)
        self.top = call.attr["f"].func.name
        data = [i for i in call.input if not i.startswith("^")]
        captured = list(runner.fn.captured_inputs)
        by_tensor = {info.name: key for key, info in sig.inputs.items()}
        user = [by_tensor.get(tensor_name(i)) for i in data[:len(data) - len(captured)]]
        fdef = self.functions.defs.get(self.top)
        if fdef is None or None in user or len(fdef.signature.input_arg) != len(data):
            # TensorFlow runs the signature: a call we cannot read is our replay's failure
            raise ReplayError(f"{self.path}: signature {runner.key!r}: cannot match its call of "
                              f"{self.top!r} to the signature's inputs, so our replay cannot "
                              "run it")
        self.user_keys, self.captured, self.state = user, captured, state
        self.functions.refuse_table_writes(self.top)
        self.last_outputs: list[np.ndarray] = []
        #: tensors the replay recorded but that cannot be compared, with the reason's code
        self.uncomparable: dict[str, str] = {}
        self._output_keys = sorted(sig.outputs)
        self._output_ports = [int(sig.outputs[k].name.split(":")[1]) for k in self._output_keys]

    def run(self, feeds) -> Trace:
        """The signature's function run body by body on ``feeds``, from the saved state; in
        a train step the conversion loss-scaled, the tensors holding scaled values are divided
        by the scale (:func:`unscale`). TensorFlow's errors pass through (the caller ran the
        signature itself on them: see :func:`~amp_rewrite.tools.traces.replay_errors`)."""
        if self.state is not None:
            self.state.restore()
        args = [tf.constant(feeds[k]) for k in self.user_keys] + self.captured
        trace = Trace({}, {})
        results = self.functions.run(self.top, args, trace)
        self.last_outputs = [results[p].numpy() for p in self._output_ports]
        self.uncomparable.update(unscale(trace))
        return trace


def unscale(trace: Trace) -> dict[str, str]:
    """Divide, in place, every tensor of a loss-scaled train step that holds ``scale x`` its
    true value by the scale, so it compares with the original's; returns the tensors left
    out, each with its reason code (verify's ``UNCOMPARED``).

    The scaled tensors are those the scaled seed (``<seed>/amp_scaled``) reaches, across the
    bodies it flows into (a nested function's backward pass), before a gradient is unscaled
    (``<gradient>/amp_unscaled``): the backward pass is linear in its seed, so each holds its
    true value times the scale, which the train function read (``amp_loss_scale/scale/read``).
    A power-of-two scale divides exactly. Left out:

    * ``skipped_step``: in a run whose unscaled gradients were not all finite, the step
      skipped its update on purpose (docs/training.md "Skipped steps"; at too high a scale,
      dynamic loss scaling lowers it and retries), so what is computed from the scaled seed
      differs from the original's by design: the backward pass (overflowed where the scale
      made it), the gradients, the optimizer's arithmetic, the weights and slots read back
      after their skipped update (a read's sources name what its write was given:
      :meth:`Body.sources`). All of it is left out, for the step; the forward pass stays
      compared, so an overflow there, which makes the step skip too, is still ranked;
    * ``loss_scaled``: a scaled tensor whose scale is not known for every run (not recorded,
      or several: a loop of steps whose scale changed, two train functions reaching it).
    """
    starts = [n for n in trace.info if n.endswith(f"{SCALED_SUFFIX}:0")]
    if not starts:
        return {}
    consumers: dict[str, list[str]] = {}
    for name, info in trace.info.items():
        for source in info.sources:
            consumers.setdefault(source, []).append(name)
    unscaled = f"{UNSCALED_SUFFIX}:0"
    left_out: dict[str, str] = {}
    scales: dict[str, set] = {}
    for start in starts:
        computed = {start} | downstream(start, lambda t: consumers.get(t, ()), lambda t: True)
        if any(not np.isfinite(v).all() for t in computed if t.endswith(unscaled)
               for v in trace.values.get(t, ())):
            left_out.update((t, "skipped_step") for t in computed if t in trace.values)
            continue
        read = trace.values.get(f"{start.split('/', 1)[0]}/{_SCALE_READ}", [])
        scale = {float(v) for v in read} or {None}
        reached = downstream(start, lambda t: consumers.get(t, ()),
                             lambda t: not t.endswith(unscaled))
        for name in {start} | {t for t in reached if not t.endswith(unscaled)}:
            scales.setdefault(name, set()).update(scale)
    for name, found in scales.items():
        if name not in trace.values or name in left_out:
            continue                      # a variant holds no values
        if len(found) != 1 or None in found:
            left_out[name] = "loss_scaled"
            continue
        (scale,) = found
        trace.values[name] = [np.asarray(v, np.float64) / scale for v in trace.values[name]]
    return left_out


class FunctionReplay:
    """Runs the functions of a library one body at a time, eagerly: each body is imported as a
    graph (``function_def_to_graph_def``) and pruned to a function that returns every tensor of
    the body; the call ops inside are then replayed with the values they were given, a While
    iteration by iteration, an If or Case along the branch taken, each from the state of the
    variables it was handed when it ran (:func:`_state_at_call`; ``writes``: the functions
    write variables, else no state is read or put back, which nothing could change). The
    functions are registered under a prefix of this replay's own, so an original and its
    conversion (same function names, different bodies) live side by side."""

    _instances = itertools.count()

    def __init__(self, library, path, writes: bool = False):
        self.path, self.writes = path, writes
        self.defs = {f.signature.name: f for f in library.function}
        self.given = library   # its own names: what the signature calls
        self.prefix = f"amp_replay{next(self._instances)}_"
        self.library = graph_pb2.GraphDef().library
        for fdef in library.function:
            self.library.function.add().CopyFrom(self._renamed(fdef))
        self._compiled: dict[tuple, Body] = {}

    def _renamed(self, fdef):
        out = type(fdef)()
        out.CopyFrom(fdef)
        out.signature.name = self.prefix + fdef.signature.name
        for nd in out.node_def:
            if nd.op in self.defs:
                nd.op = self.prefix + nd.op
            for value in nd.attr.values():
                if value.HasField("func") and value.func.name in self.defs:
                    value.func.name = self.prefix + value.func.name
                elif value.HasField("list"):
                    for func in value.list.func:
                        if func.name in self.defs:
                            func.name = self.prefix + func.name
        return out

    def refuse_table_writes(self, top: str) -> None:
        """A body replayed on its own runs its ops a second time; the variables it writes are
        put back (module docstring), a mutable lookup table's entries cannot be: refuse a
        table write in ``top`` and every function it calls."""
        for name in reachable((), self.given, [top]):
            writes = [nd.name for nd in self.defs[name].node_def if nd.op in TABLE_WRITES]
            if writes:
                raise InputError(f"{self.path}: function {name!r} writes a lookup table "
                                 f"({writes[0]}): replaying it for --per-node would change "
                                 "the table, which (unlike variables) cannot be put back")

    def _body(self, name: str, args: Sequence) -> "Body":
        # the variables among the arguments, by position: their dtypes (which the handles
        # carry, the function does not) let the body read them before its calls
        variables = None if not self.writes else {
            i: dtype for i, dtype in enumerate(map(variable_dtype, args)) if dtype is not None}
        key = (name, tuple(sorted((variables or {}).items())))
        if key not in self._compiled:
            self._compiled[key] = Body(name, self.defs[name], self._renamed(self.defs[name]),
                                       self.library, variables)
        return self._compiled[key]

    def run(self, name: str, args: list, trace: Trace) -> list:
        """Run function ``name`` on ``args`` (eager tensors), recording its tensors into
        ``trace`` and replaying its calls; returns its results."""
        body = self._body(name, args)
        key = _SPECIALIZED.sub("", name)
        results, recorded, calls = body.run(args)
        for tensor, value in recorded:
            self._record(trace, f"{key}/{tensor.name}", tensor.op.type, tensor.dtype.name, value,
                         {f"{key}/{t}" for t in body.sources(tensor)})
        for tensor in body.variants:
            self._record(trace, f"{key}/{tensor.name}", tensor.op.type, "variant", None,
                         {f"{key}/{t}" for t in body.sources(tensor)})
        for op, inputs, state in calls:
            with _state_at_call(inputs, state):
                self._replay(key, op, inputs, trace)
        return results

    def _record(self, trace: Trace, name: str, op: str, dtype: str, value, sources: set[str]):
        if value is not None:
            trace.values.setdefault(name, []).append(value.numpy())
        info = trace.info.get(name)
        if info is None:
            trace.info[name] = TensorInfo(op, dtype, set(sources), len(trace.info))
        else:
            info.sources |= sources

    def _replay(self, caller: str, op, inputs: list, trace: Trace) -> None:
        passed = [f"{caller}/{t.name}" for t in op.inputs]
        outputs = [f"{caller}/{t.name}" for t in op.outputs]
        if op.type in CALL_OPS:
            callee = self._name(op.get_attr("f").name)
            self._enter(callee, inputs, passed, trace)
            self._link(trace, outputs, self._rets(callee, inputs))
        elif op.type in IF_OPS or op.type in CASE_OPS:
            if op.type in IF_OPS:
                branches = [op.get_attr("then_branch").name, op.get_attr("else_branch").name]
                value = inputs[0].numpy()
                taken = 0 if (bool(value) if value.ndim == 0 else value.size > 0) else 1
            else:
                branches = [f.name for f in op.get_attr("branches")]
                index = int(inputs[0].numpy())
                taken = index if 0 <= index < len(branches) else len(branches) - 1
            branches = [self._name(b) for b in branches]
            self._enter(branches[taken], inputs[1:], passed[1:], trace)
            for branch in branches:
                self._link(trace, outputs, self._rets(branch, inputs[1:]))
        elif op.type in WHILE_OPS:
            cond, body = self._name(op.get_attr("cond").name), self._name(op.get_attr("body").name)
            values, sources = list(inputs), passed
            for _ in range(_MAX_ITERATIONS):
                (go,) = self._enter(cond, values, sources, trace)[:1]
                if not bool(go.numpy()):
                    break
                given, values = values, self._enter(body, values, sources, trace)
                sources = self._rets(body, given)
            else:
                raise InputError(f"{self.path}: a While over {body!r} ran {_MAX_ITERATIONS} "
                                 "iterations while replaying it for --per-node")
            self._link(trace, outputs, self._rets(body, values))
            self._link(trace, outputs, [[s] for s in passed])

    def _name(self, renamed: str) -> str:
        return renamed[len(self.prefix):] if renamed.startswith(self.prefix) else renamed

    def _enter(self, callee: str, values: list, sources: list, trace: Trace) -> list:
        """Run ``callee``; its float arguments are recorded, computed from ``sources``."""
        body = self._body(callee, values)
        key = _SPECIALIZED.sub("", callee)
        for arg, value, source in zip(body.args, values, sources):
            given = set(source) if isinstance(source, list) else {source}
            if arg.dtype.as_datatype_enum in FLOATING:
                self._record(trace, f"{key}/{arg.name}", "_Arg", arg.dtype.name, value, given)
            elif arg.dtype.as_datatype_enum == VARIANT:
                self._record(trace, f"{key}/{arg.name}", "_Arg", "variant", None, given)
        return self.run(callee, values, trace)

    def _rets(self, name: str, args: Sequence) -> list[list[str]]:
        """The tensors function ``name`` returns, called with ``args``."""
        key = _SPECIALIZED.sub("", name)
        return [[f"{key}/{t.name}"] for t in self._body(name, args).rets]

    @staticmethod
    def _link(trace: Trace, outputs: list[str], sources: list[list[str]]) -> None:
        """A call's outputs are computed from what its callee returned."""
        for name, found in zip(outputs, sources):
            if name in trace.info:
                trace.info[name].sources |= set(found)


_COLOCATION = b"loc:@"


def drop_foreign_colocation(graph_def) -> None:
    """Drop the ``_class`` colocation entries that name no node of ``graph_def``.

    A function body keeps the colocation its ops had in the graph it was traced in: an
    ``embedding_lookup`` (ResourceGather) is colocated with ``loc:@embedding_lookup/19``, the
    variable's handle there, which the body receives as the argument ``embedding_lookup_19``.
    TensorFlow's function runtime ignores such entries; importing the body as a graph
    (``import_graph_def``) refuses every one whose node is missing. A replay runs on one
    device, so dropping them changes nothing it computes; entries naming a node of the body
    stay."""
    names = {nd.name.encode() for nd in graph_def.node}
    for nd in graph_def.node:
        if "_class" not in nd.attr or not nd.attr["_class"].list.s:
            continue
        entries = list(nd.attr["_class"].list.s)
        kept = [e for e in entries if not e.startswith(_COLOCATION) or e[len(_COLOCATION):] in names]
        if len(kept) == len(entries):
            continue
        if kept:
            del nd.attr["_class"].list.s[:]
            nd.attr["_class"].list.s.extend(kept)
        else:
            del nd.attr["_class"]


class Body:
    """One function body made runnable: a pruned function of its arguments that returns its
    results, every float tensor inside, the inputs of each call op inside and the state of
    the variables each call was handed. ``variables``: the arguments that are variables, by
    position, with their dtypes; None for a signature that writes no variable: then no state
    is read, nor are reads linked to the writes before them (:meth:`sources`)."""

    def __init__(self, name: str, fdef, renamed, library,
                 variables: Mapping[int, int] | None = None):
        scratch = tf.Graph()
        with scratch.as_default():
            # converting checks that the functions the body's attrs name exist: register them
            holder = tf.compat.v1.GraphDef()
            holder.library.CopyFrom(library)
            tf.graph_util.import_graph_def(holder, name="")
            graph_def, flat = function_def_to_graph_def(renamed)
        graph_def.library.CopyFrom(library)
        drop_foreign_colocation(graph_def)
        arg_names = [a.name for a in fdef.signature.input_arg]
        reads = {} if variables is None else _read_state_before_calls(
            graph_def, {arg_names[i]: dtype for i, dtype in variables.items()})

        def _import():
            tf.graph_util.import_graph_def(graph_def, name="")

        wrapped = tf.compat.v1.wrap_function(_import, [])
        g = wrapped.graph
        self.args = [g.get_tensor_by_name(f"{a}:0") for a in arg_names]
        rets = [fdef.ret[o.name] for o in fdef.signature.output_arg]
        self.rets = [g.get_tensor_by_name(flat.get(r, f"{r}:0")) for r in rets]
        args = {t.name for t in self.args}
        ops = [op for op in g.get_operations() if not op.name.startswith(f"{_STATE_READS}/")]
        self.recorded = [t for op in ops if op.type != "Placeholder" for t in op.outputs
                         if t.dtype.as_datatype_enum in FLOATING]
        self.variants = [t for op in ops if op.type != "Placeholder" for t in op.outputs
                         if t.dtype.as_datatype_enum == VARIANT]
        # sorted by name: the original and the conversion replay their calls in the same order
        self.calls = sorted((op for op in ops if op.type in FUNCTIONAL_OPS), key=lambda op: op.name)
        self._state = {op.name: [(port, g.get_tensor_by_name(f"{read}:0"))
                                 for port, read in reads.get(op.name, ())] for op in self.calls}
        self._written = {} if variables is None else _written_before_reads(ops)
        fetches: list = []
        index: dict[str, int] = {}
        for t in (self.rets + self.recorded + [t for op in self.calls for t in op.inputs]
                  + [t for state in self._state.values() for _, t in state]):
            if t.name not in args and t.name not in index:
                index[t.name] = len(fetches)
                fetches.append(t)
        self._index = index
        self._arg_position = {t.name: i for i, t in enumerate(self.args)}
        self._roots = {t.name: self._arg_position[root.name] for op in ops for t in op.outputs
                       if (root := _resource_root(t)) is not t and root.name in self._arg_position}
        self._fn = wrapped.prune(feeds=self.args, fetches=fetches) if fetches else None
        self.name = name

    def sources(self, tensor) -> list[str]:
        """What ``tensor`` is computed from: its op's inputs and, for a read of a variable
        that the body wrote before it (a weight or an optimizer slot read back after its
        update), the values that write was given."""
        return [t.name for t in tensor.op.inputs] + self._written.get(tensor.op.name, [])

    def run(self, args: list):
        """Results, (tensor, value) of every float tensor, and per call (call op, input values,
        [(input index, value of the variable it hands over when the call ran)])."""
        values = list(self._fn(*args)) if self._fn is not None else []

        def value(t):
            if t.name in self._arg_position:
                return args[self._arg_position[t.name]]
            if t.name in self._roots:    # the argument's own handle, which knows its dtype
                return args[self._roots[t.name]]
            return values[self._index[t.name]]
        results = [value(t) for t in self.rets]
        recorded = [(t, value(t)) for t in self.recorded]
        calls = [(op, [value(t) for t in op.inputs],
                  [(port, value(t)) for port, t in self._state[op.name]]) for op in self.calls]
        return results, recorded, calls


def _resource_root(tensor):
    """The resource tensor ``tensor`` passes on unchanged (through Identity), else itself."""
    while tensor.dtype.as_datatype_enum == RESOURCE and tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    return tensor


def _read_state_before_calls(graph_def, variables: Mapping[str, int]) -> dict[str, list]:
    """Add to a body's ``graph_def`` a read of each variable a call op is handed (an argument
    named in ``variables``, with its dtype, or a ``VarHandleOp``), run after what the call
    waits on and before the call: the state its callee saw. Returns call -> [(input index,
    read node)]. The call waits on its reads, so no write after the call can come first."""
    nodes = {nd.name: nd for nd in graph_def.node}
    taken = set(nodes)
    reads: dict[str, list] = {}
    for nd in list(graph_def.node):
        if nd.op not in FUNCTIONAL_OPS:
            continue
        data = [i for i in nd.input if not i.startswith("^")]
        control = [i for i in nd.input if i.startswith("^")]
        for port, ref in enumerate(data):
            dtype = _variable_of(ref, nodes, variables)
            if dtype is None:
                continue
            name = f"{_STATE_READS}/{nd.name}/{port}"
            while name in taken:
                name += "_"
            taken.add(name)
            read = graph_def.node.add(name=name, op="ReadVariableOp")
            read.input.extend([ref] + control)
            read.attr["dtype"].type = dtype
            nd.input.append(f"^{name}")
            reads.setdefault(nd.name, []).append((port, name))
    return reads


def _variable_of(ref: str, nodes: Mapping, variables: Mapping[str, int]) -> int | None:
    """The dtype of the variable input ``ref`` (``node:port``) hands over, None for another
    value (a lookup table's handle, a float)."""
    nd = nodes.get(ref.split(":")[0])
    while nd is not None and nd.op == "Identity" and nd.attr["T"].type == RESOURCE:
        nd = nodes.get(nd.input[0].split(":")[0])
    if nd is None:
        return None
    if nd.op == "Placeholder":
        return variables.get(nd.name)
    return nd.attr["dtype"].type if nd.op == "VarHandleOp" else None


def _written_before_reads(ops) -> dict[str, list[str]]:
    """Op -> the values written, before it, to a variable it reads: TensorFlow orders the ops
    on one resource with control edges (a read waits on the write before it), so a control
    input that writes (a variable write, or a call or ``If`` that may: loss scaling wraps each
    write in one) and shares a resource with an op holding float outputs wrote what that op
    reads; its other inputs are what was written (for a gated write: the update and the check
    deciding it)."""
    written: dict[str, list[str]] = {}
    for op in ops:
        if not any(t.dtype.as_datatype_enum in FLOATING for t in op.outputs):
            continue
        mine = {_resource_root(t).name for t in op.inputs if t.dtype.as_datatype_enum == RESOURCE}
        for writer in op.control_inputs if mine else ():
            if not (is_variable_write(writer.type) or writer.type in FUNCTIONAL_OPS):
                continue
            resources = {_resource_root(t).name for t in writer.inputs
                         if t.dtype.as_datatype_enum == RESOURCE}
            if mine & resources:
                written.setdefault(op.name, []).extend(
                    t.name for t in writer.inputs if t.dtype.as_datatype_enum != RESOURCE)
    return written
