"""Replaying a TF2 SavedModel signature function body by body, for ``verify --per-node``.

Each body is imported as a graph and pruned to a function that returns every tensor inside; the
call ops of a body (While, If, Case, PartitionedCall) are replayed with the values they were
given, so every float tensor of every body the signature runs is recorded, named
``function/node:port`` as the conversion report names nodes.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
from tensorflow.core.framework import graph_pb2

from ..core.dtypes import FLOATING, VARIANT
from ..core.errors import InputError, ReplayError
from ..core.ops import CALL_OPS, CASE_OPS, FUNCTIONAL_OPS, IF_OPS, WHILE_OPS, is_variable_write
from ..io.load import Model
from ..schema.functiondef import reachable
from .traces import TensorInfo, Trace, tensor_name

#: a function the conversion specialized for one call site (``f_amp1``) is ``f`` to verify
_SPECIALIZED = re.compile(r"_amp\d+$")
#: a While that a replay steps through more often than this is refused (a cond that never ends)
_MAX_ITERATIONS = 100_000


def serving_meta_graph(model: Model, key: str):
    """The MetaGraph ``tf.saved_model.load`` reads: the only one, else the ``serve`` one."""
    graphs = list(model.meta_graphs)
    if len(graphs) > 1:
        graphs = [m for m in graphs if "serve" in m.meta_info_def.tags] or graphs
    for meta in graphs:
        if key in meta.signature_def:
            return meta
    raise InputError(f"{model.path}: no MetaGraph holds signature {key!r}")


class SignatureReplay:
    """Replays a TF2 signature function body by body (see :meth:`SavedModelRunner.trace`)."""

    def __init__(self, runner, meta, sig, call):
        self.path = runner.path
        self.functions = FunctionReplay(meta.graph_def.library, runner.path)
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
        self.user_keys, self.captured = user, captured
        self.functions.refuse_writes(self.top)
        self.last_outputs: list[np.ndarray] = []
        self._output_keys = sorted(sig.outputs)
        self._output_ports = [int(sig.outputs[k].name.split(":")[1]) for k in self._output_keys]

    def run(self, feeds) -> Trace:
        """The signature's function run body by body on ``feeds``; TensorFlow's errors pass
        through (the caller ran the signature itself on them: see
        :func:`~amp_rewrite.tools.traces.replay_errors`)."""
        import tensorflow as tf
        args = [tf.constant(feeds[k]) for k in self.user_keys] + self.captured
        trace = Trace({}, {})
        results = self.functions.run(self.top, args, trace)
        self.last_outputs = [results[p].numpy() for p in self._output_ports]
        return trace


class FunctionReplay:
    """Runs the functions of a library one body at a time, eagerly: each body is imported as a
    graph (``function_def_to_graph_def``) and pruned to a function that returns every tensor of
    the body; the call ops inside are then replayed with the values they were given, a While
    iteration by iteration, an If or Case along the branch taken. The functions are registered
    under a prefix of this replay's own, so an original and its conversion (same function
    names, different bodies) live side by side."""

    _instances = itertools.count()

    def __init__(self, library, path):
        self.path = path
        self.defs = {f.signature.name: f for f in library.function}
        self.given = library   # its own names: what the signature calls
        self.prefix = f"amp_replay{next(self._instances)}_"
        self.library = graph_pb2.GraphDef().library
        for fdef in library.function:
            self.library.function.add().CopyFrom(self._renamed(fdef))
        self._compiled: dict[str, Body] = {}

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

    def refuse_writes(self, top: str) -> None:
        """A body replayed on its own runs its ops a second time: refuse variable writes in
        ``top`` and every function it calls."""
        for name in reachable((), self.given, [top]):
            writes = [nd.name for nd in self.defs[name].node_def if is_variable_write(nd.op)]
            if writes:
                raise InputError(f"{self.path}: function {name!r} writes variables ({writes[0]}): "
                                 "replaying it for --per-node would change them")

    def _body(self, name: str) -> "Body":
        if name not in self._compiled:
            self._compiled[name] = Body(name, self.defs[name], self._renamed(self.defs[name]),
                                         self.library)
        return self._compiled[name]

    def run(self, name: str, args: list, trace: Trace) -> list:
        """Run function ``name`` on ``args`` (eager tensors), recording its tensors into
        ``trace`` and replaying its calls; returns its results."""
        body = self._body(name)
        key = _SPECIALIZED.sub("", name)
        results, recorded, call_inputs = body.run(args)
        for tensor, value in recorded:
            self._record(trace, f"{key}/{tensor.name}", tensor.op.type, tensor.dtype.name, value,
                         {f"{key}/{t.name}" for t in tensor.op.inputs})
        for tensor in body.variants:
            self._record(trace, f"{key}/{tensor.name}", tensor.op.type, "variant", None,
                         {f"{key}/{t.name}" for t in tensor.op.inputs})
        for op, inputs in call_inputs:
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
            self._link(trace, outputs, self._rets(callee))
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
                self._link(trace, outputs, self._rets(branch))
        elif op.type in WHILE_OPS:
            cond, body = self._name(op.get_attr("cond").name), self._name(op.get_attr("body").name)
            values, sources = list(inputs), passed
            for _ in range(_MAX_ITERATIONS):
                (go,) = self._enter(cond, values, sources, trace)[:1]
                if not bool(go.numpy()):
                    break
                values = self._enter(body, values, sources, trace)
                sources = self._rets(body)
            else:
                raise InputError(f"{self.path}: a While over {body!r} ran {_MAX_ITERATIONS} "
                                 "iterations while replaying it for --per-node")
            self._link(trace, outputs, self._rets(body))
            self._link(trace, outputs, [[s] for s in passed])

    def _name(self, renamed: str) -> str:
        return renamed[len(self.prefix):] if renamed.startswith(self.prefix) else renamed

    def _enter(self, callee: str, values: list, sources: list, trace: Trace) -> list:
        """Run ``callee``; its float arguments are recorded, computed from ``sources``."""
        body = self._body(callee)
        key = _SPECIALIZED.sub("", callee)
        for arg, value, source in zip(body.args, values, sources):
            given = set(source) if isinstance(source, list) else {source}
            if arg.dtype.as_datatype_enum in FLOATING:
                self._record(trace, f"{key}/{arg.name}", "_Arg", arg.dtype.name, value, given)
            elif arg.dtype.as_datatype_enum == VARIANT:
                self._record(trace, f"{key}/{arg.name}", "_Arg", "variant", None, given)
        return self.run(callee, values, trace)

    def _rets(self, name: str) -> list[list[str]]:
        key = _SPECIALIZED.sub("", name)
        return [[f"{key}/{t.name}"] for t in self._body(name).rets]

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
    results, every float tensor inside, and the inputs of each call op inside."""

    def __init__(self, name: str, fdef, renamed, library):
        import tensorflow as tf
        from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def
        scratch = tf.Graph()
        with scratch.as_default():
            # converting checks that the functions the body's attrs name exist: register them
            holder = tf.compat.v1.GraphDef()
            holder.library.CopyFrom(library)
            tf.graph_util.import_graph_def(holder, name="")
            graph_def, flat = function_def_to_graph_def(renamed)
        graph_def.library.CopyFrom(library)
        drop_foreign_colocation(graph_def)

        def _import():
            tf.graph_util.import_graph_def(graph_def, name="")

        wrapped = tf.compat.v1.wrap_function(_import, [])
        g = wrapped.graph
        self.args = [g.get_tensor_by_name(f"{a.name}:0") for a in fdef.signature.input_arg]
        rets = [fdef.ret[o.name] for o in fdef.signature.output_arg]
        self.rets = [g.get_tensor_by_name(flat.get(r, f"{r}:0")) for r in rets]
        args = {t.name for t in self.args}
        ops = g.get_operations()
        self.recorded = [t for op in ops if op.type != "Placeholder" for t in op.outputs
                         if t.dtype.as_datatype_enum in FLOATING]
        self.variants = [t for op in ops if op.type != "Placeholder" for t in op.outputs
                         if t.dtype.as_datatype_enum == VARIANT]
        # sorted by name: the original and the conversion replay their calls in the same order
        self.calls = sorted((op for op in ops if op.type in FUNCTIONAL_OPS), key=lambda op: op.name)
        fetches: list = []
        index: dict[str, int] = {}
        for t in self.rets + self.recorded + [t for op in self.calls for t in op.inputs]:
            if t.name not in args and t.name not in index:
                index[t.name] = len(fetches)
                fetches.append(t)
        self._index = index
        self._arg_position = {t.name: i for i, t in enumerate(self.args)}
        self._fn = wrapped.prune(feeds=self.args, fetches=fetches) if fetches else None
        self.name = name

    def run(self, args: list):
        """Results, (tensor, value) of every float tensor, (call op, input values) per call."""
        values = list(self._fn(*args)) if self._fn is not None else []

        def value(t):
            if t.name in self._arg_position:
                return args[self._arg_position[t.name]]
            return values[self._index[t.name]]
        results = [value(t) for t in self.rets]
        recorded = [(t, value(t)) for t in self.recorded]
        calls = [(op, [value(t) for t in op.inputs]) for op in self.calls]
        return results, recorded, calls
