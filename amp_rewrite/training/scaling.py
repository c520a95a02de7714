"""Loss scaling inside the graph: seed x scale, gradient / scale, one finiteness check, skipped steps.

On a step whose gradients are not all finite, no update op runs at all: each update reads its
gradient through a ``Switch`` on the finiteness predicate, whose taken output is dead on such
a step, and TensorFlow's executor does not run a node with a dead input (data or control)
and marks everything after it dead. So variables, optimizer slots (momentum, Adam m/v),
Adam's beta powers (they wait on the updates) and the global step (it waits on them too)
keep their exact bits. Writes that hang off the train op without waiting on an update get a
control input from the same dead-on-skip gate. The scale and counters are updated by a
group the train op waits on, which runs on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorflow.core.framework import attr_value_pb2

from ..core.dtypes import BOOL, FLOAT, INT64
from ..core.ir import Graph, TensorRef
from ..schema.opdefs import is_variable_write, output_dtype
from . import nodes as nd
from .config import ScaleConfig
from .detect import Backprop, backprop_scope
from .state import SCOPE, StateVar, add_variable, assign, refuse_scaled


@dataclass
class Added:
    """What :func:`insert_loss_scaling` added, for the report."""

    variables: list[StateVar]
    gated_writes: list[str]  # other writes of the train op, gated by a control edge
    train_ops: list[str]     # the sinks that now also run the scale update


def insert_loss_scaling(graph: Graph, backprop: Backprop, config: ScaleConfig) -> Added:
    """Rewrite ``graph`` in place so its train op trains with loss scaling (see module doc)."""
    refuse_scaled(graph)
    scale = add_variable(graph, f"{SCOPE}/scale", config.start, FLOAT)
    skipped = add_variable(graph, f"{SCOPE}/skipped_steps", 0, INT64)
    variables = [scale, skipped]
    good = None
    if config.mode == "dynamic":
        good = add_variable(graph, f"{SCOPE}/good_steps", 0, INT64)
        variables.append(good)

    for seed in backprop.seeds:
        _scale_seed(graph, TensorRef(seed), scale.read)
    unscaled = [_unscale(graph, g, scale.read) for g in backprop.gradients]
    finite = _all_finite(graph, unscaled)

    train_ops = _sinks(graph, backprop.updates)
    switches = _gate_updates(graph, backprop.updates, unscaled, finite)
    gated_writes = _gate_other_writes(graph, backprop.updates, train_ops, finite)
    _keep_results_alive(graph, switches, finite)
    updates = _state_updates(graph, config, finite, scale, skipped, good)
    group = nd.noop(graph, f"{SCOPE}/update", control=updates)
    for name in train_ops:
        graph.add_control_edge(group, name)
    return Added(variables, gated_writes, train_ops)


def _scale_seed(graph: Graph, seed: TensorRef, scale: TensorRef) -> None:
    dtype = output_dtype(graph.node(seed.node), seed.port)
    factor = nd.cast(graph, f"{seed.node}/amp_scale_cast", scale, FLOAT, dtype)
    scaled = nd.binary(graph, "Mul", f"{seed.node}/amp_scaled", seed, factor, dtype)
    graph.replace_uses(seed, scaled, exclude=[scaled.node])


def _unscale(graph: Graph, grad: TensorRef, scale: TensorRef) -> TensorRef:
    """``grad / scale`` in float32, read by every reader of ``grad`` outside the backprop scope.

    Painting kept the update float32 (:mod:`amp_rewrite.paint.updates`): a gradient read by
    it leaves the scope through painting's float32 cast (named inside the scope), so its
    readers read the float32 quotient itself. Only a gradient that leaves the scope in 16 bits
    is cast back, for its 16-bit readers, which are off the way to any write (a summary of
    it); one on that way would be our bug, which the lint of the graph reports."""
    readers = [(c, p) for c, p in graph.consumers(grad.node, grad.port) if backprop_scope(c) is None]
    dtype = output_dtype(graph.node(grad.node), grad.port)
    wide = nd.cast(graph, f"{grad.node}/amp_float32", grad, dtype, FLOAT)
    value = nd.binary(graph, "RealDiv", f"{grad.node}/amp_unscaled", wide, scale, FLOAT)
    back = nd.cast(graph, f"{grad.node}/amp_unscaled_cast", value, FLOAT, dtype)
    for consumer, port in readers:
        graph.set_input(consumer, port, back)
    return value


def _all_finite(graph: Graph, values: list[TensorRef]) -> TensorRef:
    flags = []
    for value in values:
        finite = nd.op(graph, "IsFinite", f"{value.node}/amp_is_finite", [value], T=FLOAT)
        flags.append(nd.reduce_all(graph, f"{value.node}/amp_all_finite", finite))
    packed = nd.pack(graph, f"{SCOPE}/finite_flags", flags, BOOL)
    return nd.reduce_all(graph, f"{SCOPE}/all_finite", packed)


def _sinks(graph: Graph, updates: list[str]) -> list[str]:
    """The train ops: NoOps and writes reached from the updates that nothing waits on.

    A dangling read (Adam's beta-power ReadVariableOps) is not a train op: no one fetches it.
    """
    after = graph.descendants(updates, control=True)
    ends = [n for n in graph.names() if n in after and not graph.consumers(n)
            and not graph.control_consumers(n)]
    return [n for n in ends if graph.node(n).op == "NoOp" or is_variable_write(graph.node(n).op)] or ends


def _gate_updates(graph: Graph, updates: list[str], unscaled: list[TensorRef],
                  finite: TensorRef) -> list[str]:
    """Route each update's gradient-derived inputs through ``Switch(x, finite):1``; returns
    the Switch nodes."""
    derived = graph.descendants([u.node for u in unscaled])
    switches: dict[TensorRef, TensorRef] = {}
    for update in updates:
        for port, ref in enumerate(graph.inputs(update)):
            if ref.node not in derived:
                continue
            if ref not in switches:
                dtype = output_dtype(graph.node(ref.node), ref.port)
                switch = nd.op(graph, "Switch", f"{ref.node}/amp_skip_if_not_finite", [ref, finite], T=dtype)
                switches[ref] = TensorRef(switch.node, 1)
            graph.set_input(update, port, switches[ref])
    return [ref.node for ref in switches.values()]


def _keep_results_alive(graph: Graph, switches: list[str], finite: TensorRef) -> None:
    """Let what the step computes after its updates, without leading to a write, run on a
    skipped step too.

    A skipped step leaves everything after a gated update dead. That is right for writes
    (the global step waits on the updates) but not for a result the user fetches: a loss
    taken ``with tf.control_dependencies([train_op])``, or the per-replica loss a
    MirroredStrategy step returns, would have no value ("Retval does not have value"). Such
    a node (no write after it, no data input that is dead) waits instead on a join, a Merge
    of "the updates ran" and "the step was skipped", which is alive either way.
    """
    dead = graph.descendants(switches, control=True) - set(switches)
    writes = [n for n in dead if is_variable_write(graph.node(n).op)]
    before_writes = graph.ancestors(writes) if writes else set()
    alive: list[str] = []
    revived: set[str] = set()
    for name in graph.topological_order():
        if name not in dead or name in before_writes:
            continue
        if all(ref.node not in dead or ref.node in revived for ref in graph.inputs(name)):
            revived.add(name)
            alive.append(name)
    gate = None
    for name in alive:
        waits = [c for c in graph.control_inputs(name) if c in dead and c not in revived]
        if not waits:
            continue
        if gate is None:
            gate = nd.op(graph, "Switch", f"{SCOPE}/results_gate", [finite, finite], T=BOOL).node
        ran = nd.op(graph, "Identity", f"{name}/amp_updates_ran", [TensorRef(gate, 1)],
                    control=waits, T=BOOL)
        skipped = nd.op(graph, "Identity", f"{name}/amp_step_skipped", [TensorRef(gate, 0)],
                        T=BOOL)
        join = nd.add(graph, "Merge", f"{name}/amp_after_updates", [ran, skipped],
                      {"T": nd.type_attr(BOOL), "N": attr_value_pb2.AttrValue(i=2)})
        for src in waits:
            graph.remove_control_edge(src, name)
        graph.add_control_edge(join.node, name)


def _gate_other_writes(graph: Graph, updates: list[str], train_ops: list[str],
                       finite: TensorRef) -> list[str]:
    """Gate the train op's writes that neither read a gradient nor wait on an update."""
    candidates = graph.ancestors(train_ops) - graph.descendants(updates, control=True) \
        - graph.ancestors([finite.node])
    writes = [n for n in graph.names() if n in candidates and is_variable_write(graph.node(n).op)]
    if writes:
        switch = nd.op(graph, "Switch", f"{SCOPE}/gate", [finite, finite], T=BOOL)
        gate = nd.op(graph, "Identity", f"{SCOPE}/gate/taken", [TensorRef(switch.node, 1)], T=BOOL)
        for name in writes:
            graph.add_control_edge(gate.node, name)
    return writes


def _state_updates(graph: Graph, config: ScaleConfig, finite: TensorRef, scale: StateVar,
                   skipped: StateVar, good: StateVar | None) -> list[str]:
    """The assigns of the step: skipped += !finite; dynamic: grow or shrink the scale."""
    s = f"{SCOPE}/next"
    overflow = nd.op(graph, "LogicalNot", f"{s}/overflow", [finite])
    one = nd.cast(graph, f"{s}/overflow_count", overflow, BOOL, INT64)
    ops = [assign(graph, skipped, nd.binary(graph, "AddV2", f"{s}/skipped_steps", skipped.read, one, INT64),
                  f"{SCOPE}/skipped_steps/update")]
    if good is None:
        return ops
    factor = nd.const(graph, f"{s}/factor", config.factor, FLOAT)
    grown = nd.binary(graph, "Mul", f"{s}/grown", scale.read, factor, FLOAT)
    shrunk = nd.binary(graph, "Maximum", f"{s}/shrunk",
                       nd.binary(graph, "RealDiv", f"{s}/divided", scale.read, factor, FLOAT),
                       nd.const(graph, f"{s}/floor", 1.0, FLOAT), FLOAT)
    count = nd.binary(graph, "AddV2", f"{s}/count", good.read, nd.const(graph, f"{s}/one", 1, INT64),
                      INT64)
    due = nd.binary(graph, "GreaterEqual", f"{s}/due", count,
                    nd.const(graph, f"{s}/interval", config.interval, INT64), INT64)
    grow = nd.op(graph, "LogicalAnd", f"{s}/grow", [finite, due])
    grow_ok = nd.op(graph, "LogicalAnd", f"{s}/grow_ok",
                    [grow, nd.op(graph, "IsFinite", f"{s}/grown_is_finite", [grown], T=FLOAT)])
    kept = nd.select(graph, f"{s}/kept_or_grown", grow_ok, grown, scale.read, FLOAT)
    new_scale = nd.select(graph, f"{s}/scale", finite, kept, shrunk, FLOAT)
    zero = nd.const(graph, f"{s}/zero", 0, INT64)
    counting = nd.op(graph, "LogicalAnd", f"{s}/counting",
                     [finite, nd.op(graph, "LogicalNot", f"{s}/not_grow", [grow])])
    new_good = nd.select(graph, f"{s}/good_steps", counting, count, zero, INT64)
    ops.append(assign(graph, scale, new_scale, f"{SCOPE}/scale/update"))
    ops.append(assign(graph, good, new_good, f"{SCOPE}/good_steps/update"))
    return ops
