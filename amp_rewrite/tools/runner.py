"""Running a model: the one place where verify, kernels and bench execute graphs.

A :class:`Runner` wraps a GraphDef or MetaGraphDef (imported into a v1 Session) or a
SavedModel signature (loaded with ``tf.saved_model.load``) behind the same small interface:
``inputs`` (name, dtype, shape), ``outputs`` (names), ``callable()`` and ``trace()`` (the
tensors inside, for ``verify --per-node``). Inputs are named as the user sees them: signature
keys for MetaGraphs and SavedModels, placeholder names for GraphDefs; a placeholder nothing
reads (the ``unused_control_flow_input`` placeholders ``convert_variables_to_constants_v2``
leaves) is no input: it needs no data. Random inputs follow each input's dtype and shape;
unknown dimensions come from ``shapes`` (``--shape name=2,8,8,1``) or default to 1 with a
warning.

A runner never writes a variable. A graph runner imports a private copy of the graph in which
the control edges leaving a variable write (and everything that runs after one) are dropped, so
a tensor that only *waits* on an update (the gradients of a graph built under
``control_dependencies(UPDATE_OPS)``) computes as if the update had not run, and a tensor that
*reads* a written value is never fetched (:meth:`GraphRunner.fetchable`). Stateful random ops
without a seed get one derived from their name in that copy, so an original and its conversion
draw the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..core.dtypes import BOOL, FLOATING, VARIANT
from ..core.errors import InputError
from ..core.ir import Graph as IRGraph
from ..core.ops import (
    CALL_OPS,
    ENTER_OPS,
    EXIT_OPS,
    MERGE_OPS,
    NOT_OUTPUTS,
    SAVER_OPS,
    SWITCH_OPS,
    VARIABLE_CREATORS,
    is_variable_write,
)
from ..io.load import SAVED_MODEL_FILES, Model, load
from ..training.detect import backprop_scope, find_backprop
from ..training.in_graph import FETCH
from ..training.state import SCOPE
from ..transforms.emulate import emulate_float16
from .replay import SignatureReplay, serving_meta_graph
from .traces import TensorInfo, Trace, run_errors, tensor_name

log = logging.getLogger(__name__)

#: what loss scaling names the nodes it adds (amp_rewrite/training/scaling.py): the seed times
#: the scale, and a gradient divided by it in float32 (README "Training graphs and loss scaling")
SCALED_SUFFIX = "/amp_scaled"
UNSCALED_SUFFIX = "/amp_unscaled"


@dataclass(frozen=True)
class InputSpec:
    """One model input: the user-facing ``name``, the tensor fed, its dtype and static shape."""

    name: str
    tensor: str
    dtype: int                        # types_pb2 enum
    shape: tuple[int | None, ...] | None  # None: unknown rank


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["x=2,8,8,1"]`` -> ``{"x": (2, 8, 8, 1)}``; a malformed item is an InputError."""
    shapes = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip() != "")
        except ValueError:
            raise InputError(f"--shape {item!r}: expected NAME=D1,D2,... (e.g. images=8,8,8,1)") from None
        if any(d < 0 for d in shapes[name]):
            raise InputError(f"--shape {item!r}: dimensions must be non-negative")
    return shapes


def concrete_shape(spec: InputSpec, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape to feed for ``spec``: the user's ``--shape``, else the static shape with an
    unknown leading dimension set to the batch of the shapes given (else 1) and other unknown
    dimensions set to 1 (logged, so the user knows to pass ``--shape``)."""
    for key in (spec.name, spec.tensor, spec.tensor.split(":")[0]):
        if key in shapes:
            given = shapes[key]
            if spec.shape is not None and (len(given) != len(spec.shape) or any(
                    s is not None and s != g for s, g in zip(spec.shape, given))):
                raise InputError(f"--shape {key}={','.join(map(str, given))} does not fit the "
                                 f"input's shape {_shape_text(spec.shape)}")
            return given
    if spec.shape is None:
        raise InputError(f"input {spec.name!r} has unknown rank: pass --shape {spec.name}=D1,D2,...")
    batch = next((dims[0] for dims in shapes.values() if dims), 1)
    shape = tuple((batch if i == 0 else 1) if d is None else d for i, d in enumerate(spec.shape))
    if shape != spec.shape:
        log.warning("input %s has shape %s: fed as %s (pass --shape %s=...)", spec.name,
                    _shape_text(spec.shape), _shape_text(shape), spec.name)
    return shape


def _shape_text(shape) -> str:
    if shape is None:
        return "<unknown rank>"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def random_inputs(specs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]] | None = None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds, one per input: normal floats, small non-negative ints, random bools."""
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        shape = concrete_shape(spec, shapes or {})
        np_dtype = tf.dtypes.as_dtype(spec.dtype).as_numpy_dtype
        if spec.dtype in FLOATING:
            value = rng.standard_normal(shape).astype(np_dtype)
        elif spec.dtype == BOOL:
            value = rng.random(shape) < 0.5
        elif tf.dtypes.as_dtype(spec.dtype).is_integer:
            # small values: integer inputs are usually indices or lengths
            value = rng.integers(0, 4, shape).astype(np_dtype)
        else:
            raise InputError(f"input {spec.name!r} has dtype {tf.dtypes.as_dtype(spec.dtype).name}: "
                             "cannot make random data for it; pass --inputs data.npz")
        feeds[spec.name] = value
    return feeds


def load_inputs(path: str | os.PathLike, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """Feeds from an ``.npz`` file whose keys are input names (or tensor names)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read as .npz: {exc}") from None
    feeds = {}
    for spec in specs:
        for key in (spec.name, spec.tensor, spec.tensor.split(":")[0]):
            if key in data.files:
                feeds[spec.name] = data[key]
                break
        else:
            raise InputError(f"{path}: no array for input {spec.name!r} (keys: {', '.join(data.files)})")
    return feeds


@functools.lru_cache(maxsize=1)
def init_devices() -> None:
    """Let TensorFlow enumerate its devices once, before the first Session or SavedModel load.

    On a machine without a GPU driver this is where TensorFlow's C++ layer logs a CUDA error
    line that no environment variable silences; it means nothing for a CPU run, so it is kept
    off stderr unless amp-rewrite logs at DEBUG level (``-v``).
    """
    import tensorflow as tf
    if log.isEnabledFor(logging.DEBUG):
        tf.config.list_physical_devices()
        return
    try:
        saved = os.dup(2)
    except OSError:
        tf.config.list_physical_devices()
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        tf.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class Runner:
    """A model ready to run. Subclasses: :class:`GraphRunner`, :class:`SavedModelRunner`."""

    inputs: list[InputSpec]
    outputs: list[str]
    #: the outputs (by this runner's names) that are gradients, not results of the forward pass
    gradients: frozenset[str] = frozenset()

    def callable(self) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
        """A function from feeds (by input name) to the outputs, in ``self.outputs`` order."""
        raise NotImplementedError

    def trace(self, feeds: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> Trace:
        """One run recording the float tensors inside the model (``names`` of them, where the
        runner needs to be told which: see :meth:`comparable`)."""
        raise NotImplementedError

    def comparable(self) -> list[str] | None:
        """The tensors :meth:`trace` can record, or None when a trace finds them itself."""
        return None

    def uncomparable(self) -> dict[str, str]:
        """The float tensors of the model's computation that :meth:`trace` cannot record, each
        with why (see :meth:`GraphRunner.uncomparable`); empty where a trace finds its own."""
        return {}

    def decision_shares(self) -> frozenset[str]:
        """The outputs that are shares of yes/no decisions (an accuracy: the mean of a cast
        ``Equal(ArgMax(...), labels)``), which move by whole decisions, not by rounding; empty
        where the runner cannot see the graph."""
        return frozenset()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GraphRunner(Runner):
    """A GraphDef or MetaGraphDef imported into its own graph and Session.

    Variables (MetaGraphs) are restored from ``checkpoint`` when one is given, else run through
    their initializers (``initialize=False`` leaves that to :func:`share_weights`);
    :meth:`variable_values` / :meth:`load_variables` copy them between two runners so an
    original and its conversion compute with the same weights.
    """

    def __init__(self, model: Model, signature: str | None = None, outputs: Sequence[str] = (),
                 checkpoint: str | None = None, *, initialize: bool = True):
        import tensorflow as tf
        v1 = tf.compat.v1
        init_devices()
        self.model = model
        self.path = model.path
        self.graph = tf.Graph()
        graph_def = _private_copy(model.graph_def)
        self._saver = None
        with self.graph.as_default():
            if model.meta_graph is not None:
                meta = type(model.meta_graph)()
                meta.CopyFrom(model.meta_graph)
                meta.graph_def.CopyFrom(graph_def)
                self._saver = v1.train.import_meta_graph(meta, clear_devices=True)
            else:
                tf.graph_util.import_graph_def(graph_def, name="")
        self.has_signature = bool(model.meta_graph is not None and model.meta_graph.signature_def)
        self.inputs, default_outputs = self._endpoints(signature)
        if not (outputs or default_outputs):
            raise InputError(f"{self.path}: no graph outputs found; name them with --output")
        self.outputs = default_outputs
        self.set_outputs(outputs or default_outputs)
        self.session = v1.Session(graph=self.graph)
        if initialize:
            self.initialize(checkpoint)
        elif checkpoint:
            raise ValueError("a checkpoint is restored by initialize()")

    # -- structure -----------------------------------------------------------------------------
    @functools.cached_property
    def _ops(self):
        return self.graph.get_operations()

    @functools.cached_property
    def _read(self) -> set[str]:
        """Names of the ops something reads (along a data or a control edge)."""
        return {t.op.name for op in self._ops for t in op.inputs} | {
            c.name for op in self._ops for c in op.control_inputs}

    @functools.cached_property
    def _after_writes(self) -> set[str]:
        """Ops that run only after a variable write (the writes included)."""
        return _reach(self._ops, {op.name for op in self._ops if is_variable_write(op.type)},
                      control=True)

    @functools.cached_property
    def _hidden(self) -> set[str]:
        ops = self._ops
        # a loop's Switch leads to its Exit, a cond's to its Merge
        return (_reach(ops, {op.name for op in ops if op.type in ENTER_OPS}, EXIT_OPS)
                | _reach(ops, {op.name for op in ops if op.type in SWITCH_OPS}, MERGE_OPS | EXIT_OPS)
                | self._after_writes)

    # -- endpoints ---------------------------------------------------------------------------
    def _endpoints(self, signature: str | None):
        sigs = self.model.meta_graph.signature_def if self.model.meta_graph is not None else {}
        if sigs:
            key = signature or ("serving_default" if "serving_default" in sigs else sorted(sigs)[0])
            if key not in sigs:
                raise InputError(f"{self.path}: no signature {key!r} "
                                 f"(has: {', '.join(sorted(sigs))})")
            sig = sigs[key]
            inputs = [self._spec(k, info.name) for k, info in sorted(sig.inputs.items())]
            return inputs, [info.name for _, info in sorted(sig.outputs.items())]
        if signature:
            raise InputError(f"{self.path}: has no signatures; drop --signature")
        placeholders = [op for op in self._ops if op.type == "Placeholder"]
        # a placeholder nothing reads needs no value (convert_variables_to_constants_v2 leaves
        # dozens of them, of variant and unknown-rank types no random data could fill)
        unread = [op.name for op in placeholders if op.name not in self._read]
        if unread:
            log.info("%d placeholders nothing reads are not inputs: %s", len(unread),
                     ", ".join(unread[:5]) + (" ..." if len(unread) > 5 else ""))
        inputs = [self._spec(op.name, op.outputs[0].name) for op in placeholders
                  if op.name in self._read]
        return inputs, self._forward_outputs()

    def _forward_outputs(self) -> list[str]:
        """The float outputs of the forward pass: tensors of ops that no op outside a backprop
        scope reads, themselves outside one and outside the loss-scale state, that a fetch can
        reach without a variable write and that do not only set variables up."""
        def forward(op) -> bool:
            return backprop_scope(op.name) is None and not op.name.startswith(f"{SCOPE}/")
        read = {t.op.name for op in self._ops if forward(op) for t in op.inputs} | {
            c.name for op in self._ops if forward(op) for c in op.control_inputs}
        setup = self.setup_ops()
        return [t.name for op in self._ops
                if forward(op) and op.name not in read and op.type not in NOT_OUTPUTS
                and op.name not in self._hidden and op.name not in setup
                for t in op.outputs if t.dtype.as_datatype_enum in FLOATING]

    def set_outputs(self, names: Sequence[str]) -> None:
        """Compare ``names``: each must exist and be computed before any variable write."""
        names = [tensor_name(n) for n in names]
        for name in names:
            op = self.tensor(name).op
            if op.name in self._after_writes:
                raise InputError(f"{self.path}: {name} is computed after a variable write "
                                 f"({op.type}): fetching it would change the variables; compare "
                                 "a tensor computed before the updates")
        self.outputs = names

    def decision_shares(self) -> frozenset[str]:
        return frozenset(name for name in self.outputs if _is_decision_share(self.tensor(name)))

    def _spec(self, name: str, tensor_name: str) -> InputSpec:
        t = self.tensor(tensor_name)
        shape = None if t.shape.rank is None else tuple(t.shape.as_list())
        return InputSpec(name, t.name, t.dtype.as_datatype_enum, shape)

    def tensor(self, name: str):
        try:
            return self.graph.get_tensor_by_name(tensor_name(name))
        except (KeyError, ValueError):
            raise InputError(f"{self.path}: no tensor named {name!r}") from None

    # -- training graphs -------------------------------------------------------------------------
    def unscaled_gradients(self) -> dict[str, str]:
        """Gradient tensor -> the tensor holding its unscaled value, in a loss-scaled graph: each
        ``<gradient>/amp_unscaled`` node divides a gradient by the scale, in float32. The
        gradient it reads may be a cast the conversion added (``<tensor>/amp_float``,
        ``<tensor>/amp_float32``): the key is the tensor cast, which the original graph holds
        under the same name. Empty for a graph without loss scaling."""
        found = {}
        for op in self._ops:
            if not op.name.endswith(UNSCALED_SUFFIX) or op.type != "RealDiv":
                continue
            source = op.inputs[0]
            while source.op.type == "Cast" and source.op.name.rsplit("/", 1)[-1].startswith("amp_"):
                source = source.op.inputs[0]
            found[source.name] = op.outputs[0].name
        return found

    def gradient_tensors(self) -> list[str]:
        """The gradients a training graph feeds its updates, as the converter finds them
        (README "Training graphs and loss scaling"); empty for a graph that does not train or
        whose backward pass cannot be told without hints."""
        try:
            backprop = find_backprop(IRGraph.from_graph_def(self.model.graph_def))
        except InputError as exc:
            log.info("%s: gradients not compared: %s", self.path, exc)
            return []
        return [] if backprop is None else [f"{g.node}:{g.port}" for g in backprop.gradients]

    @functools.cached_property
    def _loss_scaled(self) -> tuple[set[str], str | None]:
        """Tensors of a loss-scaled graph that hold ``scale x`` their true value (everything
        the scaled seed reaches before a gradient is unscaled), and the scale's tensor."""
        starts = {op.name for op in self._ops if op.name.endswith(SCALED_SUFFIX)}
        if not starts:
            return set(), None
        stops = {op.name for op in self._ops if op.name.endswith(UNSCALED_SUFFIX)}
        reached = _reach(self._ops, starts, stop_names=stops)
        names = {t.name for op in self._ops if op.name in reached for t in op.outputs}
        scale = FETCH["scale"]
        try:
            self.graph.get_tensor_by_name(scale)
        except KeyError:
            return names, None
        return names, scale

    # -- variables ---------------------------------------------------------------------------
    def _variables(self):
        found = {}
        for key in ("variables", "local_variables"):
            for var in self.graph.get_collection(key):
                found.setdefault(var.op.name, var)
        return list(found.values())

    def initialize(self, checkpoint: str | None = None, skip: Mapping | set = ()) -> None:
        """Restore the variables from ``checkpoint``, else run the initializers of those not
        in ``skip`` (local variables, which checkpoints do not hold, always)."""
        import tensorflow as tf
        variables = self._variables()
        if checkpoint:
            if self._saver is None:
                raise InputError(f"{self.path}: --checkpoint needs a MetaGraph with a saver")
            try:
                with self.graph.as_default():
                    self._saver.restore(self.session, checkpoint)
            except (tf.errors.OpError, ValueError) as exc:
                raise InputError(f"{checkpoint}: cannot restore: {str(exc).splitlines()[0]}") from None
            local = {v.op.name for v in self.graph.get_collection("local_variables")}
            variables = [v for v in variables if v.op.name in local]
        variables = [v for v in variables if v.op.name not in skip]
        if variables:
            with self.graph.as_default():
                init = tf.compat.v1.variables_initializer(variables)
            with run_errors(self.path):
                self.session.run(init)

    def variable_values(self) -> dict[str, np.ndarray]:
        variables = self._variables()
        with run_errors(self.path):
            return dict(zip((v.op.name for v in variables), self.session.run(variables)))

    def load_variables(self, values: Mapping[str, np.ndarray]) -> int:
        """Set the variables that ``values`` names; returns how many were set."""
        count = 0
        with self.graph.as_default(), run_errors(self.path):
            for var in self._variables():
                if var.op.name in values:
                    # feeding the initial value works for ref and resource variables alike
                    self.session.run(var.initializer, {var.initial_value: values[var.op.name]})
                    count += 1
        return count

    def setup_ops(self) -> set[str]:
        """Ops that only set variables up: the initializers (a random initializer draws afresh
        on every run, so its tensors mean nothing to compare), the saver's save and restore
        ops, and every op whose results feed those alone."""
        return self._setup

    @functools.cached_property
    def _setup(self) -> set[str]:
        ops = self._ops
        sinks = {v.initializer.name for v in self._variables() if v.initializer is not None}
        # a GraphDef keeps no variables collection: TF1's initializer is "<variable>/Assign"
        sinks |= {op.name for op in ops if is_variable_write(op.type) and op.inputs
                  and op.inputs[0].op.type in VARIABLE_CREATORS
                  and op.name == op.inputs[0].op.name + "/Assign"}
        sinks |= _reach(ops, {op.name for op in ops if op.type in SAVER_OPS}, control=True)
        readers: dict[str, set[str]] = {}
        for op in ops:
            for producer in {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}:
                readers.setdefault(producer, set()).add(op.name)
        pending = {name: len(r) for name, r in readers.items()}
        setup, stack = set(sinks), list(sinks)
        while stack:
            op = self.graph.get_operation_by_name(stack.pop())
            for producer in {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}:
                if producer in setup:
                    continue
                pending[producer] -= 1
                if pending[producer] == 0:
                    setup.add(producer)
                    stack.append(producer)
        return setup

    # -- running -----------------------------------------------------------------------------
    def callable(self, fetches: Sequence[str] | None = None):
        names = [spec.tensor for spec in self.inputs]
        fn = self.session.make_callable(list(fetches or self.outputs), names)
        keys = [spec.name for spec in self.inputs]

        def call(feeds):
            with run_errors(self.path):
                return [np.asarray(o) for o in fn(*[feeds[k] for k in keys])]
        return call

    def fetch(self, feeds: Mapping[str, np.ndarray], fetches: Sequence[str]) -> list[np.ndarray]:
        """Run once, fetching any tensors of the graph (not only the outputs); TensorFlow's
        own error (``tf.errors.OpError``) passes through, for callers that try again."""
        feed_dict = {spec.tensor: feeds[spec.name] for spec in self.inputs}
        return [np.asarray(o) for o in self.session.run(list(fetches), feed_dict)]

    def fetchable(self) -> list[str]:
        """Tensors that can be fetched from outside without side effects: not inside a loop
        frame or a cond branch, and not after a variable write (fetching it would train)."""
        return [t.name for op in self._ops if op.name not in self._hidden for t in op.outputs]

    def comparable(self) -> list[str]:
        """The float tensors worth comparing: fetchable, not setting variables up, not the
        loss-scale state (``amp_loss_scale/``), in topological order."""
        order = self._order
        names = [t.name for op in self._computing() if op.name not in self._hidden
                 for t in op.outputs if t.dtype.as_datatype_enum in FLOATING]
        return sorted(names, key=lambda n: order.get(n.rsplit(":", 1)[0], 0))

    def uncomparable(self) -> dict[str, str]:
        """The float tensors :meth:`comparable` leaves out among those that compute the model
        (not setting variables up, not the loss-scale state), each with why: ``"after_write"``
        (fetching it would run a variable write) or ``"control_flow"`` (inside a v1 loop
        frame or cond branch, which a fetch from outside cannot reach)."""
        return {t.name: "after_write" if op.name in self._after_writes else "control_flow"
                for op in self._computing() if op.name in self._hidden
                for t in op.outputs if t.dtype.as_datatype_enum in FLOATING}

    def _computing(self) -> list:
        """The ops that compute the model: not setting variables up, not the loss-scale state."""
        setup = self.setup_ops()
        return [op for op in self._ops
                if op.name not in setup and not op.name.startswith(f"{SCOPE}/")]

    def trace(self, feeds, names=None) -> Trace:
        """``names`` (default :meth:`comparable`) fetched in one run (if TensorFlow refuses one
        of them, each on its own, leaving out those that fail). In a loss-scaled graph the
        tensors that hold scaled values are divided by the scale, so they compare with the
        original's."""
        import tensorflow as tf
        names = list(self.comparable() if names is None else names)
        scaled, scale = self._loss_scaled
        wanted = names + ([scale] if scale and scaled.intersection(names) else [])
        try:
            fetched = dict(zip(wanted, self.fetch(feeds, wanted)))
        except tf.errors.OpError:
            log.info("fetching all tensors at once failed; fetching one at a time")
            fetched = {}
            for name in wanted:
                try:
                    fetched[name] = self.fetch(feeds, [name])[0]
                except tf.errors.OpError:
                    pass
        values, info = {}, {}
        for name in names:
            if name not in fetched:
                continue
            value = fetched[name]
            if name in scaled:
                if scale not in fetched:
                    continue
                value = value.astype(np.float64) / np.float64(fetched[scale])
            t = self.graph.get_tensor_by_name(name)
            values[name] = [value]
            info[name] = TensorInfo(t.op.type, t.dtype.name, {i.name for i in t.op.inputs},
                                    self._order.get(t.op.name, 0))
        info.update(self._variants)
        return Trace(values, info)

    @functools.cached_property
    def _variants(self) -> dict[str, TensorInfo]:
        return {t.name: TensorInfo(op.type, "variant", {i.name for i in op.inputs})
                for op in self._ops for t in op.outputs if t.dtype.as_datatype_enum == VARIANT}

    @functools.cached_property
    def _order(self) -> dict[str, int]:
        """Op name -> position in a topological order (loop back edges are skipped, not followed)."""
        preds = {op.name: [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
                 for op in self._ops}
        order: dict[str, int] = {}
        for root in preds:
            if root in order:
                continue
            stack, visiting = [(root, iter(preds[root]))], {root}
            while stack:
                name, pending = stack[-1]
                nxt = next((p for p in pending if p not in order and p not in visiting), None)
                if nxt is None:
                    stack.pop()
                    visiting.discard(name)
                    order[name] = len(order)
                else:
                    visiting.add(nxt)
                    stack.append((nxt, iter(preds[nxt])))
        return order

    def close(self) -> None:
        self.session.close()


def _is_decision_share(tensor) -> bool:
    """Whether every float path into ``tensor`` runs ``Mean``/``Identity`` ops back to a cast
    of a bool, through at least one ``Mean``: a value in [0, 1] that counts decisions."""
    import tensorflow as tf
    stack, means = [tensor], 0
    while stack:
        t = stack.pop()
        op = t.op
        if op.type == "Cast" and t.dtype.is_floating and op.inputs[0].dtype == tf.bool:
            continue
        if op.type not in ("Mean", "Identity") or not t.dtype.is_floating:
            return False
        means += op.type == "Mean"
        stack.append(op.inputs[0])    # Mean's other input holds the axes
    return means > 0


class SavedModelRunner(Runner):
    """One signature of a SavedModel, called eagerly through ``tf.saved_model.load``."""

    def __init__(self, path: Path, signature: str | None = None):
        import tensorflow as tf
        init_devices()
        try:
            loaded = tf.saved_model.load(str(path))
        except (OSError, ValueError, tf.errors.OpError) as exc:
            raise InputError(f"{path}: cannot load the SavedModel: {str(exc).splitlines()[0]}") from None
        sigs = loaded.signatures
        if not sigs:
            raise InputError(f"{path}: the SavedModel has no signatures to run")
        key = signature or ("serving_default" if "serving_default" in sigs else sorted(sigs)[0])
        if key not in sigs:
            raise InputError(f"{path}: no signature {key!r} (has: {', '.join(sorted(sigs))})")
        self.path, self.key, self._loaded, self.fn = path, key, loaded, sigs[key]
        specs = self.fn.structured_input_signature[1]
        self.inputs = [InputSpec(k, k, s.dtype.as_datatype_enum,
                                 None if s.shape.rank is None else tuple(s.shape.as_list()))
                       for k, s in sorted(specs.items())]
        self.outputs = sorted(self.fn.structured_outputs)
        self._tracer: SignatureReplay | GraphRunner | None = None

    def callable(self):
        import tensorflow as tf

        def call(feeds):
            with run_errors(self.path):
                result = self.fn(**{k: tf.constant(feeds[k]) for k in (s.name for s in self.inputs)})
                return [result[k].numpy() for k in self.outputs]
        return call

    def trace(self, feeds, names=None) -> Trace:
        """Every float tensor of the signature's computation. A TF2 signature calls a library
        function: its body, and the bodies of the functions it calls (While and If bodies,
        PartitionedCalls), are run one at a time with the values their callers pass, and their
        tensors are named ``function/node:port`` as the conversion report names nodes. A TF1
        signature reads the MetaGraph's own nodes: they are fetched as in a graph file."""
        if self._tracer is None:
            self._tracer = self._make_tracer()
        if isinstance(self._tracer, GraphRunner):
            return self._tracer.trace(feeds)
        trace = self._tracer.run(feeds)
        self._check_replay(feeds, trace)
        return trace

    def uncomparable(self) -> dict[str, str]:
        """A TF1 signature's tensors are fetched as in a graph file: what that leaves out
        (known once :meth:`trace` has run); a TF2 signature's replay records every tensor."""
        return self._tracer.uncomparable() if isinstance(self._tracer, GraphRunner) else {}

    def _make_tracer(self):
        model = load(self.path)
        meta = serving_meta_graph(model, self.key)
        sig = meta.signature_def[self.key]
        nodes = {n.name: n for n in meta.graph_def.node}
        producers = {info.name.split(":")[0] for info in sig.outputs.values()}
        call = nodes.get(next(iter(producers))) if len(producers) == 1 else None
        if call is None or call.op not in CALL_OPS:
            # a TF1 SavedModel: the signature's tensors are nodes of the MetaGraph
            prefix = Path(self.path) / "variables" / "variables"
            saved = meta.HasField("saver_def") and prefix.with_suffix(".index").exists()
            return GraphRunner(Model(self.path, "metagraph", False, (meta,)), self.key,
                               checkpoint=str(prefix) if saved else None)
        return SignatureReplay(self, meta, sig, call)

    def _check_replay(self, feeds, trace: Trace) -> None:
        # a body run on its own must give what the whole signature gives, or the tensors
        # recorded are not the ones the signature computes (a random or stateful op inside)
        expected = self.callable()(feeds)
        for name, want, got in zip(self.outputs, expected, self._tracer.last_outputs):
            numeric = want.dtype.kind in "biuf" or want.dtype.name == "bfloat16"
            if want.shape != got.shape or (
                    not np.allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                    rtol=1e-4, atol=1e-6, equal_nan=True)
                    if numeric else not np.array_equal(got, want)):
                raise InputError(
                    f"{self.path}: running signature {self.key!r} function by function does not "
                    f"reproduce its output {name!r} (a random or stateful op in its functions?): "
                    "--per-node cannot compare its function bodies")

    def close(self) -> None:
        if isinstance(self._tracer, GraphRunner):
            self._tracer.close()


def open_model(model: str | os.PathLike | Model, *, signature: str | None = None,
               outputs: Sequence[str] = (), checkpoint: str | None = None,
               initialize: bool = True, emulate: bool = False) -> Runner:
    """A :class:`Runner` for a GraphDef / MetaGraphDef file, a SavedModel directory, or a
    loaded :class:`~amp_rewrite.io.load.Model` (a SavedModel runs from its directory)
    (``initialize=False``: a graph's variables are left for :func:`share_weights`;
    ``emulate``: a float16 graph runs as its float32 emulation, :mod:`amp_rewrite.transforms.emulate`)."""
    loaded = model if isinstance(model, Model) else None
    path = Path(model) if loaded is None else loaded.path if loaded.kind == "savedmodel" else None
    if path is not None and (path.is_dir() or path.name in SAVED_MODEL_FILES):
        folder = path if path.is_dir() else path.parent
        if outputs or checkpoint or emulate:
            raise InputError(f"{folder}: --output, --checkpoint and --emulate apply to graph "
                             "files, not SavedModels")
        return SavedModelRunner(folder, signature)
    model = loaded or load(path)
    if emulate:
        graphs = []
        for meta in model.meta_graphs:
            new = type(meta)()
            new.CopyFrom(meta)
            new.graph_def.CopyFrom(emulate_float16(meta.graph_def)[0])
            graphs.append(new)
        model = dataclasses.replace(model, meta_graphs=tuple(graphs))
    return GraphRunner(model, signature, outputs, checkpoint, initialize=initialize)


@contextlib.contextmanager
def open_pair(original, converted, *, signature: str | None = None, outputs: Sequence[str] = (),
              checkpoint: str | None = None, emulate: bool = False):
    """An original and its conversion, ready to compare: the same inputs and number of outputs,
    and the same weights (a checkpoint is restored into the original, or its initializers run,
    once; its variable values are then copied into the converted graph, whose own extra state,
    such as a loss scale, is initialized): :func:`open_model`, then :func:`open_converted`.
    """
    with open_model(original, signature=signature, outputs=outputs, checkpoint=checkpoint) as a:
        with open_converted(a, converted, signature=signature, outputs=outputs,
                            emulate=emulate) as b:
            yield a, b


def open_converted(original: Runner, converted, *, signature: str | None = None,
                   outputs: Sequence[str] = (), emulate: bool = False) -> Runner:
    """``converted`` (a path or a loaded :class:`~amp_rewrite.io.load.Model`) opened to compare
    with ``original``, already open with its weights: the same inputs and number of outputs,
    and ``original``'s variable values (see :func:`open_pair`).

    Without ``outputs`` (the user's choice, as ``original`` was opened with), a graph file
    without signatures compares the original's forward outputs (see
    :meth:`GraphRunner._forward_outputs`) and, for a training graph, its gradients: in a
    loss-scaled conversion the original's gradient against the converted graph's unscaled one
    (``<gradient node>/amp_unscaled:0``). An output named with ``outputs`` that the conversion
    scales is compared unscaled too. ``emulate`` runs the converted graph as its float32
    emulation.
    """
    chosen = bool(outputs)
    if not outputs and isinstance(original, GraphRunner) and not original.has_signature:
        # the converted graph keeps node names; its own "nodes nothing reads" would also
        # list what the conversion added (loss-scale state and such)
        outputs = original.outputs
    b = open_model(converted, signature=signature, outputs=outputs, initialize=False,
                   emulate=emulate)
    try:
        if isinstance(b, GraphRunner):
            _pair_gradients(original, b, chosen)
        check_same_interface(original, b)
        share_weights(original, b)
    except BaseException:
        b.close()
        raise
    return b


def _pair_gradients(a: Runner, b: GraphRunner, chosen: bool) -> None:
    """Point the converted graph's outputs at unscaled gradients; add the gradients of a
    training graph to the default outputs."""
    unscaled = b.unscaled_gradients()
    if not isinstance(a, GraphRunner):
        return
    grads = list(unscaled) if unscaled else a.gradient_tensors()
    if not (a.has_signature or chosen):
        fetchable_a, fetchable_b = set(a.fetchable()), set(b.fetchable())
        added = [g for g in grads if g in fetchable_a and unscaled.get(g, g) in fetchable_b
                 and g not in a.outputs]
        a.set_outputs(a.outputs + added)
        b.outputs = list(a.outputs)
    a.gradients = frozenset(set(grads) & set(a.outputs))
    mapped = [unscaled.get(name, name) for name in b.outputs]
    if mapped != b.outputs:
        log.info("comparing %d gradients unscaled (<gradient>%s:0)",
                 sum(m != n for m, n in zip(mapped, b.outputs)), UNSCALED_SUFFIX)
    b.set_outputs(mapped)
    b.gradients = frozenset(unscaled.get(g, g) for g in a.gradients)


def share_weights(original: Runner, converted: Runner) -> None:
    """Give ``converted`` the variable values of ``original`` (variables keep their names and
    dtypes through conversion), so random initializers cannot make the two differ; variables
    only the converted graph has (its loss-scale state) are initialized, each once."""
    if not isinstance(converted, GraphRunner):
        return
    values = original.variable_values() if isinstance(original, GraphRunner) else {}
    if values:
        n = converted.load_variables(values)
        log.info("copied %d of %d variables into the converted graph", n, len(values))
    own = [v.op.name for v in converted._variables()
           if v.op.name not in values and not v.op.name.startswith(f"{SCOPE}/")]
    if own:
        log.warning("%d variables of the converted graph are not in the original (%s): they run "
                    "their own initializers, so the two may compute with different weights",
                    len(own), ", ".join(own[:3]) + (" ..." if len(own) > 3 else ""))
    converted.initialize(skip=values)


def check_same_interface(a: Runner, b: Runner) -> None:
    """Both models must take the same inputs and give the same number of outputs."""
    names_a, names_b = [s.name for s in a.inputs], [s.name for s in b.inputs]
    if names_a != names_b:
        raise InputError(f"the two models take different inputs: {names_a} and {names_b}")
    if len(a.outputs) != len(b.outputs):
        raise InputError(f"the two models give different outputs: {a.outputs} and {b.outputs}")


def _private_copy(graph_def):
    """The graph as a runner imports it: devices cleared (a graph saved on a GPU machine names
    devices this one lacks; placement is TF's job here), seeds given to unseeded random ops,
    and the control edges that make a fetch run a variable write dropped (module docstring)."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in out.node:
        node.device = ""
        seeds = node.attr.get("seed"), node.attr.get("seed2")
        if None not in seeds and not node.op.startswith("Stateless") and \
                seeds[0].i == 0 and seeds[1].i == 0:
            # seed 0 and seed2 0 mean "draw a new seed": two graphs would differ
            node.attr["seed2"].i = zlib.crc32(node.name.encode()) % (2**31 - 1) + 1
    _drop_write_edges(out)
    return out


def _drop_write_edges(graph_def) -> None:
    """Drop the control edges out of every variable write and every node after one, but those
    into a NoOp (a group such as the saver's ``restore_all`` or an init op runs its writes that
    way) and those inside v1 loops and conds (their frames are built of control edges)."""
    ops = {n.name: n.op for n in graph_def.node}
    readers: dict[str, list[tuple[str, bool]]] = {}
    for n in graph_def.node:
        for text in n.input:
            readers.setdefault(text.lstrip("^").split(":")[0], []).append((n.name, text[:1] == "^"))

    def reach(starts, ends=frozenset(), control=True):
        seen, stack = set(), list(starts)
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(reader for reader, is_control in readers.get(name, ())
                         if ops.get(reader) not in ends and (control or not is_control))
        return seen
    after = reach([n.name for n in graph_def.node if is_variable_write(n.op)])
    if not after:
        return
    frames = (reach([n.name for n in graph_def.node if n.op in ENTER_OPS], EXIT_OPS, control=False)
              | reach([n.name for n in graph_def.node if n.op in SWITCH_OPS], MERGE_OPS | EXIT_OPS,
                      control=False))
    for n in graph_def.node:
        if n.op == "NoOp" or n.name in frames:
            continue
        kept = [i for i in n.input if not (i.startswith("^") and i[1:] in after and i[1:] not in frames)]
        if len(kept) != len(n.input):
            del n.input[:]
            n.input.extend(kept)


def _reach(ops, starts: set[str], ends=frozenset(), control: bool = False,
           stop_names=frozenset()) -> set[str]:
    """Names of the ops reachable forward from the ops named ``starts`` without passing an op
    whose type is in ``ends`` or whose name is in ``stop_names`` (along control edges too if
    ``control``)."""
    consumers: dict[str, list] = {}
    for op in ops:
        for producer in [t.op for t in op.inputs] + (list(op.control_inputs) if control else []):
            consumers.setdefault(producer.name, []).append(op)
    seen: set[str] = set()
    stack = [op for op in ops if op.name in starts]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(c for c in consumers.get(op.name, ())
                     if c.type not in ends and c.name not in stop_names)
    return seen

