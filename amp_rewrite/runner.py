"""Running a model: the one place where verify, kernels and bench execute graphs.

A :class:`Runner` wraps a GraphDef or MetaGraphDef (imported into a v1 Session) or a
SavedModel signature (loaded with ``tf.saved_model.load``) behind the same small interface:
``inputs`` (name, dtype, shape), ``outputs`` (names), ``run(feeds)`` and ``callable()``.
Inputs are named as the user sees them: signature keys for MetaGraphs and SavedModels,
placeholder names for GraphDefs. Random inputs follow each input's dtype and shape; unknown
dimensions come from ``shapes`` (``--shape name=2,8,8,1``) or default to 1 with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from .dtypes import BOOL, FLOATING
from .errors import InputError
from .load import SAVED_MODEL_FILES, load
from .ops import ENTER_OPS, EXIT_OPS, MERGE_OPS, NOT_OUTPUTS, SWITCH_OPS, is_variable_write

log = logging.getLogger(__name__)


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

    def callable(self) -> Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]:
        """A function from feeds (by input name) to the outputs, in ``self.outputs`` order."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GraphRunner(Runner):
    """A GraphDef or MetaGraphDef imported into its own graph and Session.

    Variables (MetaGraphs) are restored from ``checkpoint`` when one is given, else run through
    their initializers; :meth:`variable_values` / :meth:`load_variables` copy them between two
    runners so an original and its conversion compute with the same weights.
    """

    def __init__(self, model, signature: str | None = None, outputs: Sequence[str] = (),
                 checkpoint: str | None = None):
        import tensorflow as tf
        v1 = tf.compat.v1
        init_devices()
        self.model = model
        self.graph = tf.Graph()
        saver = None
        with self.graph.as_default():
            if model.meta_graph is not None:
                meta = type(model.meta_graph)()
                meta.CopyFrom(model.meta_graph)
                meta.graph_def.CopyFrom(model.graph_def)
                saver = v1.train.import_meta_graph(meta, clear_devices=True)
            else:
                tf.graph_util.import_graph_def(_without_devices(model.graph_def), name="")
        self.has_signature = bool(model.meta_graph is not None and model.meta_graph.signature_def)
        self.inputs, default_outputs = self._endpoints(signature)
        self.outputs = [_tensor_name(o) for o in outputs] or default_outputs
        for name in self.outputs:
            self.tensor(name)  # a bad --output name fails here, with the name
        self.session = v1.Session(graph=self.graph)
        self._init_variables(saver, checkpoint)

    # -- endpoints ---------------------------------------------------------------------------
    def _endpoints(self, signature: str | None):
        import tensorflow as tf
        sigs = self.model.meta_graph.signature_def if self.model.meta_graph is not None else {}
        if sigs:
            key = signature or ("serving_default" if "serving_default" in sigs else sorted(sigs)[0])
            if key not in sigs:
                raise InputError(f"{self.model.path}: no signature {key!r} "
                                 f"(has: {', '.join(sorted(sigs))})")
            sig = sigs[key]
            inputs = [self._spec(k, info.name) for k, info in sorted(sig.inputs.items())]
            return inputs, [info.name for _, info in sorted(sig.outputs.items())]
        if signature:
            raise InputError(f"{self.model.path}: has no signatures; drop --signature")
        ops = self.graph.get_operations()
        inputs = [self._spec(op.name, op.outputs[0].name) for op in ops if op.type == "Placeholder"]
        read = {t.op.name for op in ops for t in op.inputs} | {
            c.name for op in ops for c in op.control_inputs}
        outs = [t.name for op in ops if op.name not in read and op.type not in NOT_OUTPUTS
                for t in op.outputs if t.dtype.as_datatype_enum in FLOATING]
        if not outs:
            raise InputError(f"{self.model.path}: no graph outputs found; name them with --output")
        return inputs, outs

    def _spec(self, name: str, tensor_name: str) -> InputSpec:
        t = self.tensor(tensor_name)
        shape = None if t.shape.rank is None else tuple(t.shape.as_list())
        return InputSpec(name, t.name, t.dtype.as_datatype_enum, shape)

    def tensor(self, name: str):
        try:
            return self.graph.get_tensor_by_name(_tensor_name(name))
        except (KeyError, ValueError):
            raise InputError(f"{self.model.path}: no tensor named {name!r}") from None

    # -- variables ---------------------------------------------------------------------------
    def _variables(self):
        return self.graph.get_collection("variables")

    def _init_variables(self, saver, checkpoint: str | None) -> None:
        import tensorflow as tf
        if checkpoint:
            if saver is None:
                raise InputError(f"{self.model.path}: --checkpoint needs a MetaGraph with a saver")
            try:
                with self.graph.as_default():
                    saver.restore(self.session, checkpoint)
            except (tf.errors.OpError, ValueError) as exc:
                raise InputError(f"{checkpoint}: cannot restore: {str(exc).splitlines()[0]}") from None
        elif self._variables():
            with self.graph.as_default():
                init = tf.compat.v1.variables_initializer(self._variables())
            self.session.run(init)

    def variable_values(self) -> dict[str, np.ndarray]:
        variables = self._variables()
        return dict(zip((v.op.name for v in variables), self.session.run(variables)))

    def load_variables(self, values: Mapping[str, np.ndarray]) -> int:
        """Set the variables that ``values`` names; returns how many were set."""
        count = 0
        with self.graph.as_default():
            for var in self._variables():
                if var.op.name in values:
                    # feeding the initial value works for ref and resource variables alike
                    self.session.run(var.initializer, {var.initial_value: values[var.op.name]})
                    count += 1
        return count

    # -- running -----------------------------------------------------------------------------
    def callable(self, fetches: Sequence[str] | None = None):
        names = [spec.tensor for spec in self.inputs]
        fn = self.session.make_callable(list(fetches or self.outputs), names)
        keys = [spec.name for spec in self.inputs]

        def call(feeds):
            with run_errors(self.model.path):
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
        ops = self.graph.get_operations()
        writes = {op.type for op in ops if is_variable_write(op.type)}
        hidden = (_reach(ops, ENTER_OPS, EXIT_OPS) | _reach(ops, SWITCH_OPS, MERGE_OPS)
                  | _reach(ops, writes, set(), control=True))
        return [t.name for op in ops if op.name not in hidden for t in op.outputs]

    def close(self) -> None:
        self.session.close()


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
        self.path, self._loaded, self.fn = path, loaded, sigs[key]
        specs = self.fn.structured_input_signature[1]
        self.inputs = [InputSpec(k, k, s.dtype.as_datatype_enum,
                                 None if s.shape.rank is None else tuple(s.shape.as_list()))
                       for k, s in sorted(specs.items())]
        self.outputs = sorted(self.fn.structured_outputs)

    def callable(self):
        import tensorflow as tf

        def call(feeds):
            with run_errors(self.path):
                result = self.fn(**{k: tf.constant(feeds[k]) for k in (s.name for s in self.inputs)})
                return [result[k].numpy() for k in self.outputs]
        return call


@contextlib.contextmanager
def run_errors(path):
    """A run that TensorFlow refuses (shapes that do not fit, a failed assertion ...) is the
    input's problem: one line naming the model and TensorFlow's reason."""
    import tensorflow as tf
    try:
        yield
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        raise InputError(f"{path}: TensorFlow could not run the model: {_reason(exc)} "
                         "(check --shape / --inputs)") from None


_NOISE = ("Graph execution error", "Detected at node", "Node:", "Original stack trace", "File ",
          "[[", "(most recent call last)")


def _reason(exc: Exception) -> str:
    """The line of a TensorFlow error that says what went wrong, not where."""
    text = getattr(exc, "message", None) or str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(_NOISE) and "defined at" not in line:
            return line
    return type(exc).__name__


def open_model(path: str | os.PathLike, *, signature: str | None = None, outputs: Sequence[str] = (),
               checkpoint: str | None = None) -> Runner:
    """A :class:`Runner` for a GraphDef / MetaGraphDef file or a SavedModel directory."""
    path = Path(path)
    if path.is_dir() or path.name in SAVED_MODEL_FILES:
        folder = path if path.is_dir() else path.parent
        if outputs or checkpoint:
            raise InputError(f"{folder}: --output and --checkpoint apply to graph files, not SavedModels")
        return SavedModelRunner(folder, signature)
    return GraphRunner(load(path), signature, outputs, checkpoint)


@contextlib.contextmanager
def open_pair(original, converted, *, signature: str | None = None, outputs: Sequence[str] = (),
              checkpoint: str | None = None):
    """An original and its conversion, ready to compare: the same inputs and number of outputs,
    and the same weights (a checkpoint is restored into the original, whose variable values
    are then copied into the converted graph, which may hold extra state such as a loss scale)."""
    with open_model(original, signature=signature, outputs=outputs, checkpoint=checkpoint) as a:
        if not outputs and isinstance(a, GraphRunner) and not a.has_signature:
            # the converted graph keeps node names; its own "nodes nothing reads" would also
            # list what the conversion added (loss-scale state and such)
            outputs = a.outputs
        with open_model(converted, signature=signature, outputs=outputs) as b:
            check_same_interface(a, b)
            share_weights(a, b)
            yield a, b


def share_weights(original: Runner, converted: Runner) -> None:
    """Give ``converted`` the variable values of ``original`` (variables keep their names and
    dtypes through conversion), so random initializers cannot make the two differ."""
    if isinstance(original, GraphRunner) and isinstance(converted, GraphRunner):
        values = original.variable_values()
        if values:
            n = converted.load_variables(values)
            log.info("copied %d of %d variables into the converted graph", n, len(values))


def check_same_interface(a: Runner, b: Runner) -> None:
    """Both models must take the same inputs and give the same number of outputs."""
    names_a, names_b = [s.name for s in a.inputs], [s.name for s in b.inputs]
    if names_a != names_b:
        raise InputError(f"the two models take different inputs: {names_a} and {names_b}")
    if len(a.outputs) != len(b.outputs):
        raise InputError(f"the two models give different outputs: {a.outputs} and {b.outputs}")


def _tensor_name(name: str) -> str:
    return name if ":" in name else f"{name}:0"


def _without_devices(graph_def):
    # a graph saved on a GPU machine names devices this one lacks; placement is TF's job here
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in out.node:
        node.device = ""
    return out


def _reach(ops, starts: set[str], ends: set[str], control: bool = False) -> set[str]:
    """Names of the ops reachable forward from an op whose type is in ``starts`` without
    passing an op whose type is in ``ends`` (along control edges too if ``control``)."""
    consumers: dict[str, list] = {}
    for op in ops:
        for producer in [t.op for t in op.inputs] + (list(op.control_inputs) if control else []):
            consumers.setdefault(producer.name, []).append(op)
    seen: set[str] = set()
    stack = [op for op in ops if op.type in starts]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(c for c in consumers.get(op.name, ()) if c.type not in ends)
    return seen
