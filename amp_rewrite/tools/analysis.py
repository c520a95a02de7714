"""What running a model needs to know about its graph, found on the IR, without a session.

:class:`Analysis` reads a loaded :class:`~amp_rewrite.io.load.Model`'s graph into the IR once
(with its OpDefs' defaults, so every tensor has its dtype) and answers, each part computed once:

* :attr:`~Analysis.runnable`, the GraphDef a runner imports: devices cleared (a graph saved on a
  GPU machine names devices this one lacks), unseeded random ops seeded from their names (an
  original and its conversion draw the same numbers), and the control edges out of a variable
  write and out of everything after one dropped, so a tensor that only *waits* on an update
  computes as if the update had not run. Kept: the edges into a NoOp (a group such as an init
  op or the saver's ``restore_all`` runs its writes that way) and those inside v1 loops and
  conds (their frames are built of control edges). The model reads each output of a tf.data
  iterator through a placeholder of its own (:attr:`~Analysis.iterator_inputs`), so a run
  never draws from the iterator. The IR is edited the same way: every answer below is about
  the graph the session runs.
* the endpoints: a signature's inputs and outputs, else the placeholders something reads, the
  outputs of tf.data iterators (:attr:`~Analysis.iterator_inputs`) and the float outputs of
  the forward pass;
* what a fetch from outside cannot reach (:attr:`~Analysis.hidden`): v1 loop frames and cond
  branches, and everything after a variable write (fetching it would train);
* the ops that only set variables up (:attr:`~Analysis.setup`): initializers, the saver, and
  whatever feeds those alone; the initializers a run needs once, after the variables
  (:attr:`~Analysis.initializers`: initializable iterators');
* the training parts: the gradients the converter finds, the tensors a loss-scaled graph holds
  scaled, the unscaled gradient of each scaled one;
* the tensors a trace compares, in the order TensorFlow imports the graph (the IR's
  topological order: both take the ready node listed first), and those it cannot, with why;
* the variables, and which of them a converted model shares with its original.
"""

from __future__ import annotations

import functools
import logging
import zlib
from typing import Sequence

from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2, variable_pb2

from ..core.dtypes import BOOL, FLOATING, INVALID, VARIANT, base_dtype
from ..core.errors import InputError
from ..core.ir import Graph, Node, TensorRef
from ..core.ops import (
    ENTER_OPS,
    EXIT_OPS,
    ITERATOR_GET_NEXT_OPS,
    ITERATOR_INIT_OPS,
    MERGE_OPS,
    NOT_OUTPUTS,
    SAVER_OPS,
    SWITCH_OPS,
    VARIABLE_CREATORS,
)
from ..io.load import Model
from ..schema.opdefs import (
    graph_with_defaults,
    is_variable_write,
    node_types,
    port_dtype,
    set_call_signature,
)
from ..training.detect import backprop_scope, find_backprop
from ..training.in_graph import FETCH
from ..training.state import SCOPE
from .traces import TensorInfo

log = logging.getLogger(__name__)

#: what loss scaling names the nodes it adds (amp_rewrite/training/scaling.py): the seed times
#: the scale, and a gradient divided by it in float32 (docs/training.md "Training graphs and loss scaling")
SCALED_SUFFIX = "/amp_scaled"
UNSCALED_SUFFIX = "/amp_unscaled"
#: the reference flag of a dtype enum (DT_FLOAT_REF == DT_FLOAT + 100 in types.proto)
_REF = 100


class Analysis:
    """One model's graph as a runner needs it (module docstring); ``signature`` picks the
    signature whose endpoints it takes (default ``serving_default``, else the first by name)."""

    def __init__(self, model: Model, signature: str | None = None):
        self.model, self.path = model, model.path
        self.graph = _typed_graph(model.graph_def)
        writes = [n.name for n in self.graph.nodes() if is_variable_write(n.op)]
        #: v1 loop frames and cond branches: data edges only, which dropping control edges keeps
        self.frames = (_inside(self.graph, ENTER_OPS, EXIT_OPS)
                       | _inside(self.graph, SWITCH_OPS, MERGE_OPS | EXIT_OPS))
        dropped = _write_edges(self.graph, writes, self.frames)
        for dst, sources in dropped.items():
            for src in sources:
                self.graph.remove_control_edge(src, dst)
        #: each output of a tf.data iterator the model reads (``IteratorGetNext:0`` ...), in
        #: graph order -> the placeholder's tensor the model reads it through in the runnable
        #: graph: inputs a run feeds, named by the iterator's tensor, from the user's arrays or
        #: else from the iterator itself (:func:`amp_rewrite.tools.runner.fill_iterator_inputs`).
        #: Empty for a model with signatures, whose inputs are the signature's
        meta = model.meta_graph
        self.iterator_inputs = {} if meta is not None and meta.signature_def else \
            _detach_iterators(self.graph, self.frames)
        self.runnable = _runnable(model.graph_def, dropped, self.graph, self.iterator_inputs)
        #: ops that run only after a variable write (the writes included), in the runnable graph
        self.after_writes = self.graph.descendants(writes, control=True)
        self.hidden = self.frames | self.after_writes
        self.signature, self.inputs, self.outputs = self._endpoints(signature)

    # -- the graph's tensors ---------------------------------------------------------------
    @functools.cached_property
    def names(self) -> list[str]:
        """Node names in the order TensorFlow imports the runnable graph."""
        return self.graph.topological_order()

    @functools.cached_property
    def order(self) -> dict[str, int]:
        """Node name -> its place in :attr:`names`."""
        return {name: i for i, name in enumerate(self.names)}

    def tensors(self, name: str) -> list[tuple[str, int]]:
        """``(tensor name, dtype)`` of each output of node ``name``; a reference (a ref
        variable's value) has its dtype plus 100, as TensorFlow's enums do."""
        dtypes = _dtypes(self.graph.node(name))
        return [(f"{name}:{port}", dtype) for port, dtype in enumerate(dtypes)]

    def _floats(self, name: str) -> list[str]:
        return [t for t, dtype in self.tensors(name) if dtype in FLOATING]

    # -- endpoints ---------------------------------------------------------------------------
    def _endpoints(self, signature: str | None):
        """The signature chosen (None for a graph without), its inputs as (name, tensor), and
        its outputs. Without a signature the inputs, everything a run feeds (and so every name
        an ``.npz`` or ``--shape`` may give), are the placeholders the model reads, then the
        iterator outputs (:attr:`iterator_inputs`, named by the iterator's tensor, fed through
        their placeholders), then the placeholders only initializers read (a dataset built
        from a placeholder): each group in graph order, so the first input is one a batch
        goes through."""
        sigs = self.model.meta_graph.signature_def if self.model.meta_graph is not None else {}
        if sigs:
            key = signature or ("serving_default" if "serving_default" in sigs else sorted(sigs)[0])
            if key not in sigs:
                raise InputError(f"{self.path}: no signature {key!r} "
                                 f"(has: {', '.join(sorted(sigs))})")
            sig = sigs[key]
            return (key, [(k, info.name) for k, info in sorted(sig.inputs.items())],
                    [info.name for _, info in sorted(sig.outputs.items())])
        if signature:
            raise InputError(f"{self.path}: has no signatures; drop --signature")
        fed = {TensorRef.parse(t).node for t in self.iterator_inputs.values()}
        placeholders = [n for n in self.names
                        if self.graph.node(n).op == "Placeholder" and n not in fed]
        # a placeholder nothing reads needs no value (convert_variables_to_constants_v2 leaves
        # dozens of them, of variant and unknown-rank types no random data could fill)
        unread = [n for n in placeholders if not self.graph.is_read(n)]
        if unread:
            log.info("%d placeholders nothing reads are not inputs: %s", len(unread),
                     ", ".join(unread[:5]) + (" ..." if len(unread) > 5 else ""))
        read = [n for n in placeholders if self.graph.is_read(n)]
        return (None, [(n, f"{n}:0") for n in read if n not in self.setup]
                + list(self.iterator_inputs.items())
                + [(n, f"{n}:0") for n in read if n in self.setup], self._forward_outputs())

    def _forward_outputs(self) -> list[str]:
        """The float outputs of the forward pass: tensors of ops that no op outside a backprop
        scope reads, themselves outside one and outside the loss-scale state, that a fetch can
        reach without a variable write and that do not only set variables up."""
        def forward(name: str) -> bool:
            return backprop_scope(name) is None and not name.startswith(f"{SCOPE}/")

        def read(name: str) -> bool:
            return any(forward(c) for c, _ in self.graph.consumers(name)) or any(
                forward(c) for c in self.graph.control_consumers(name))
        return [t for name in self.names
                if forward(name) and self.graph.node(name).op not in NOT_OUTPUTS
                and name not in self.hidden and name not in self.setup and not read(name)
                for t in self._floats(name)]

    # -- what a run can fetch and compare ------------------------------------------------------
    def fetchable(self) -> list[str]:
        """Tensors a fetch from outside reaches without side effects: not inside a loop frame
        or a cond branch, and not after a variable write (fetching it would train)."""
        return [t for name in self.names if name not in self.hidden for t, _ in self.tensors(name)]

    def comparable(self) -> list[str]:
        """The float tensors worth comparing: fetchable, not setting variables up, not the
        loss-scale state (``amp_loss_scale/``), in execution order."""
        return [t for name in self._computing() if name not in self.hidden
                for t in self._floats(name)]

    def uncomparable(self) -> dict[str, str]:
        """The float tensors :meth:`comparable` leaves out among those that compute the model,
        each with why: ``"after_write"`` (fetching it would run a variable write) or
        ``"control_flow"`` (inside a v1 loop frame or cond branch)."""
        return {t: "after_write" if name in self.after_writes else "control_flow"
                for name in self._computing() if name in self.hidden for t in self._floats(name)}

    def _computing(self) -> list[str]:
        """The ops that compute the model: not setting variables up, not the loss-scale state."""
        return [n for n in self.names if n not in self.setup and not n.startswith(f"{SCOPE}/")]

    @functools.cached_property
    def variants(self) -> dict[str, TensorInfo]:
        """Every variant tensor (a TensorList), so a trace can follow an error through one."""
        return {t: TensorInfo(self.graph.node(name).op, "variant",
                              {_tensor(ref) for ref in self.graph.inputs(name)})
                for name in self.names for t, dtype in self.tensors(name) if dtype == VARIANT}

    def is_decision_share(self, tensor: str) -> bool:
        """Whether every float path into ``tensor`` runs ``Mean``/``Identity`` ops back to a
        cast of a bool, through at least one ``Mean``: a value in [0, 1] that counts decisions
        (an accuracy), which moves by whole decisions, not by rounding."""
        ref, means = TensorRef.parse(tensor), 0
        while True:
            node = self.graph.node(ref.node)
            floating = base_dtype(self._dtype(ref)) in FLOATING
            if node.op == "Cast" and floating and \
                    self._dtype(self.graph.input(ref.node, 0)) == BOOL:
                return means > 0
            if node.op not in ("Mean", "Identity") or not floating:
                return False
            means += node.op == "Mean"
            ref = self.graph.input(ref.node, 0)    # Mean's other input holds the axes

    def _dtype(self, ref: TensorRef) -> int:
        found = _dtypes(self.graph.node(ref.node))
        return found[ref.port] if ref.port < len(found) else INVALID

    # -- setting up ------------------------------------------------------------------------------
    @functools.cached_property
    def variables(self) -> dict[str, str]:
        """Variable op name -> its initializer op ('' if none), as the MetaGraph's
        ``variables`` then ``local_variables`` collections list them (a GraphDef has none)."""
        meta, found = self.model.meta_graph, {}
        for key in ("variables", "local_variables"):
            if meta is None or key not in meta.collection_def:
                continue
            for raw in meta.collection_def[key].bytes_list.value:
                var = variable_pb2.VariableDef.FromString(raw)
                found.setdefault(var.variable_name.rsplit(":", 1)[0], var.initializer_name)
        return found

    @functools.cached_property
    def initializers(self) -> list[str]:
        """The ops that start initializable iterators (``MakeIterator``, what an iterator's
        ``initializer`` runs), found by their op, in graph order, none that a fetch cannot
        reach: a run needs them once, after the variables and the lookup tables (which the
        runner fills as it sets the variables up; a dataset may look one up), before the
        first batch."""
        return [n for n in self.names
                if self.graph.node(n).op in ITERATOR_INIT_OPS and n not in self.hidden]

    def init_ops(self, named: Sequence[str] = ()) -> list[str]:
        """:attr:`initializers`, then the ops ``named`` (``--init-op``), each once. A name
        that is no op of the graph, or an op that runs a variable write (it would change the
        weights both models share, which come from the checkpoint or the initializers), is an
        InputError."""
        g = self.graph
        for name in named:
            if name not in g:
                raise InputError(f"{self.path}: --init-op {name}: the graph has no op of that "
                                 "name (an op name, such as the iterator's initializer "
                                 "'MakeIterator' or a group op)")
            writes = sorted(n for n in g.ancestors([name]) if is_variable_write(g.node(n).op))
            if writes:
                raise InputError(f"{self.path}: --init-op {name} runs variable writes "
                                 f"({', '.join(writes[:3])}{' ...' if len(writes) > 3 else ''}): "
                                 "the variables come from --checkpoint or their initializers; "
                                 "name the table or iterator initializer itself")
        return list(dict.fromkeys([*self.initializers, *named]))

    @functools.cached_property
    def setup(self) -> set[str]:
        """Ops that only set variables up: the initializers (a random initializer draws afresh
        on every run, so its tensors mean nothing to compare; :attr:`initializers`, whose
        datasets are data, not the model), the iterators' get-next ops (only the runner reads
        them: a fetch would draw a batch), the saver's save and restore ops, and every op
        whose results feed those alone."""
        g = self.graph
        sinks = {init for init in self.variables.values() if init} | set(self.initializers)
        sinks |= {n.name for n in g.nodes()
                  if n.op in ITERATOR_GET_NEXT_OPS and n.name not in self.hidden}
        # a GraphDef keeps no variables collection: TF1's initializer is "<variable>/Assign"
        for node in g.nodes():
            inputs = g.inputs(node.name) if is_variable_write(node.op) else ()
            if inputs and g.node(inputs[0].node).op in VARIABLE_CREATORS \
                    and node.name == inputs[0].node + "/Assign":
                sinks.add(node.name)
        sinks |= g.descendants([n.name for n in g.nodes() if n.op in SAVER_OPS], control=True)
        return g.only_feeding(sinks)

    # -- training graphs -------------------------------------------------------------------------
    @functools.cached_property
    def unscaled_gradients(self) -> dict[str, str]:
        """Gradient tensor -> the tensor holding its unscaled value, in a loss-scaled graph: each
        ``<gradient>/amp_unscaled`` node divides a gradient by the scale, in float32. The
        gradient it reads may be a cast the conversion added (``<tensor>/amp_float``,
        ``<tensor>/amp_float32``): the key is the tensor cast, which the original graph holds
        under the same name. Empty for a graph without loss scaling."""
        g, found = self.graph, {}
        for name in self.names:
            if not name.endswith(UNSCALED_SUFFIX) or g.node(name).op != "RealDiv":
                continue
            source = g.input(name, 0)
            while g.node(source.node).op == "Cast" and \
                    source.node.rsplit("/", 1)[-1].startswith("amp_"):
                source = g.input(source.node, 0)
            found[_tensor(source)] = f"{name}:0"
        return found

    @functools.cached_property
    def gradients(self) -> list[str]:
        """The gradients a training graph feeds its updates, as the converter finds them
        (docs/training.md "Training graphs and loss scaling"), in the graph as given; empty for a graph
        that does not train or whose backward pass cannot be told without hints."""
        try:
            backprop = find_backprop(Graph.from_graph_def(self.model.graph_def))
        except InputError as exc:
            log.info("%s: gradients not compared: %s", self.path, exc)
            return []
        return [] if backprop is None else [f"{g.node}:{g.port}" for g in backprop.gradients]

    @functools.cached_property
    def loss_scaled(self) -> tuple[set[str], str | None]:
        """Tensors of a loss-scaled graph that hold ``scale x`` their true value (everything
        the scaled seed reaches before a gradient is unscaled), and the scale's tensor."""
        starts = [n for n in self.names if n.endswith(SCALED_SUFFIX)]
        if not starts:
            return set(), None
        stops = {n for n in self.names if n.endswith(UNSCALED_SUFFIX)}
        reached = self.graph.descendants(starts, stop=stops) - stops
        scaled = {t for name in reached for t, _ in self.tensors(name)}
        scale = TensorRef.parse(FETCH["scale"])
        held = scale.node in self.graph and self._dtype(scale) != INVALID
        return scaled, FETCH["scale"] if held else None


def own_variables(original: Analysis | None, converted: Analysis) -> list[str]:
    """The variables of ``converted`` that ``original`` lacks (variables keep their names and
    dtypes through conversion, so the others take the original's values), but the loss-scale
    state: these run their own initializers. ``original`` None: a model whose variables
    cannot be read (a SavedModel's)."""
    theirs = original.variables if original is not None else {}
    return [v for v in converted.variables if v not in theirs and not v.startswith(f"{SCOPE}/")]


def _typed_graph(graph_def) -> Graph:
    """The IR of ``graph_def``, defaults filled and direct calls of library functions typed by
    their signatures, so every output has a dtype."""
    graph, _ = graph_with_defaults(graph_def)
    calls = {f.signature.name: f.signature for f in graph_def.library.function}
    for node in graph.nodes():
        if node.op in calls:
            set_call_signature(node, calls[node.op])
    return graph


def _dtypes(node: Node) -> list[int]:
    """The dtype of each output of ``node``, a reference's with the flag TensorFlow gives it."""
    types = node_types(node)
    if types is None:
        return []
    return [port_dtype(node, p) + (_REF if p.is_ref else 0) for p in types.outputs]


def _tensor(ref: TensorRef) -> str:
    return f"{ref.node}:{ref.port}"


def _inside(graph: Graph, starts: frozenset, ends: frozenset) -> set[str]:
    """The nodes data flows through from a node of op ``starts`` before an op of ``ends``
    (those not included): a loop's Enter leads to its Exit, a cond's Switch to its Merge."""
    stops = {n.name for n in graph.nodes() if n.op in ends}
    return graph.descendants([n.name for n in graph.nodes() if n.op in starts], stop=stops) - stops


def _write_edges(graph: Graph, writes: list[str], frames: set[str]) -> dict[str, list[str]]:
    """Consumer -> the control inputs to drop: those out of a variable write or a node after
    one, but into a NoOp or inside a v1 frame (module docstring)."""
    after = graph.descendants(writes, control=True)
    dropped = {}
    for name in after - frames:
        for dst in graph.control_consumers(name):
            if dst not in frames and graph.node(dst).op != "NoOp":
                dropped.setdefault(dst, []).append(name)
    return dropped


def _detach_iterators(graph: Graph, frames: set[str]) -> dict[str, str]:
    """Each output of a tf.data iterator's get-next op (outside loop frames) that something
    reads, read instead through a new placeholder of its dtype and shape,
    ``<op>/amp_feed_<port>``, listed after the op (and the op's control edges leave from the
    first of them); returns iterator tensor -> placeholder tensor, in graph order. Feeding the
    get-next op's own tensors would not do: grappler may leave a control edge from the op (a
    shape it folds into a constant waits on the op whose output it was the shape of), and a
    fed tensor's op still runs for its control edges, so every run would draw a batch; a fed
    placeholder's control edges move to the feed."""
    found = {}
    get_next = [n for n in graph.nodes() if n.op in ITERATOR_GET_NEXT_OPS and n.name not in frames]
    for node in get_next:
        types, shapes = node.attr["output_types"].list.type, node.attr["output_shapes"].list.shape
        first = None
        for port, dtype in enumerate(types):
            if not graph.consumers(node.name, port):
                continue
            shape = shapes[port] if port < len(shapes) else \
                tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
            feed = graph.add_node("Placeholder", f"{node.name}/amp_feed_{port}", after=node.name,
                                  attrs={"dtype": attr_value_pb2.AttrValue(type=dtype),
                                         "shape": attr_value_pb2.AttrValue(shape=shape)})
            graph.replace_uses(TensorRef(node.name, port), TensorRef(feed.name, 0))
            found[f"{node.name}:{port}"] = f"{feed.name}:0"
            first = first or feed.name
        for dst in graph.control_consumers(node.name) if first else ():
            graph.remove_control_edge(node.name, dst)
            graph.add_control_edge(first, dst)
    return found


def _runnable(graph_def, dropped: dict[str, list[str]], graph: Graph, feeds: dict[str, str]):
    """A copy of ``graph_def`` as a runner imports it (module docstring): ``graph``'s
    placeholders for the iterator tensors ``feeds`` maps listed after their get-next op, and
    read instead of it."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    if feeds:
        _read_through(out, graph, feeds)
    for node in out.node:
        node.device = ""
        seeds = node.attr.get("seed"), node.attr.get("seed2")
        if None not in seeds and not node.op.startswith("Stateless") and \
                seeds[0].i == 0 and seeds[1].i == 0:
            # seed 0 and seed2 0 mean "draw a new seed": two graphs would differ
            node.attr["seed2"].i = zlib.crc32(node.name.encode()) % (2**31 - 1) + 1
        if node.name in dropped:
            gone = {f"^{src}" for src in dropped[node.name]}
            kept = [i for i in node.input if i not in gone]
            del node.input[:]
            node.input.extend(kept)
    return out


def _read_through(graph_def, graph: Graph, feeds: dict[str, str]) -> None:
    """Point, in place, every input of ``graph_def`` that reads a tensor of ``feeds`` at its
    placeholder (a control input from a get-next op at its first), and list each placeholder
    (``graph``'s node) after its get-next op, as :func:`_detach_iterators` did to ``graph``."""
    renamed: dict[str, str] = {}
    after: dict[str, list[str]] = {}
    for tensor, feed in feeds.items():
        ref, placeholder = TensorRef.parse(tensor), TensorRef.parse(feed).node
        renamed[tensor] = feed
        if ref.port == 0:
            renamed[ref.node] = feed   # "op" is "op:0"
        renamed.setdefault(f"^{ref.node}", f"^{placeholder}")
        after.setdefault(ref.node, []).append(placeholder)
    nodes = []
    for node in graph_def.node:
        inputs = [renamed.get(i, i) for i in node.input]
        if inputs != list(node.input):
            del node.input[:]
            node.input.extend(inputs)
        nodes.append(node)
        nodes.extend(graph.node(name).proto for name in after.get(node.name, ()))
    copies = [type(n)() for n in nodes]
    for copy, node in zip(copies, nodes):
        copy.CopyFrom(node)
    del graph_def.node[:]
    graph_def.node.extend(copies)
