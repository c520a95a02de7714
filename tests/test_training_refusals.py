"""Every refusal of loss scaling is true of the graph it names (issue 44).

A train step that loss scaling cannot take is refused (exit 2, one line, nothing written), and
the line says why: which function, node, seed or write. Each refusal in ``amp_rewrite/training``
has a test here, or one elsewhere that :data:`REFUSALS` names, that builds a real graph where
the reason holds, and checks the refusal by its exit code or exception type and by the facts it
names, read off the graph the test built (not by the refusal's wording). The one that once
fired on a graph where it was false (a Mixture-of-Experts step, whose ``top_k`` gradient was
taken for a write) converts: :func:`test_a_routed_step_is_not_refused`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from refusals import assert_refused, run_cli, snapshot
from saved_trainers import RoutedGather
from tensorflow.python.framework import function as tf1_function
from tensorflow.python.saved_model import loader_impl
from training_graphs import build

from amp_rewrite import InputError, convert_file

v1 = tf.compat.v1
ROOT = Path(__file__).resolve().parent.parent
SIGNATURE = [tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int64)]
#: op names of variable writes, for the facts a test reads off a graph by itself
WRITES = ("Assign", "ResourceApply", "ApplyGradientDescent")

#: a fragment of each refusal's message in amp_rewrite/training -> the test that builds a graph
#: where it is true and checks it (``file::test``)
REFUSALS = {
    # the loss-scale options (training/config.py): the user's flags, no graph
    "unknown loss-scale option": "test_training_refusals.py::test_an_unknown_loss_scale_option",
    "must be a whole number of steps":
        "test_loss_scaling.py::test_bad_interval_and_factor_are_input_errors",
    "has no effect with": "test_newcomer.py::test_conflicting_loss_scale_options_are_refused",
    "applies to --loss-scale dynamic":
        "test_newcomer.py::test_conflicting_loss_scale_options_are_refused",
    "must be a finite number above": "test_loss_scaling.py::test_bad_loss_scale_is_an_input_error",
    "must fit in float32": "test_review_fixes.py::test_loss_scale_beyond_float32_is_refused",
    "must be 'dynamic', 'none' or a number":
        "test_loss_scaling.py::test_bad_loss_scale_is_an_input_error",
    # a graph's own train step (training/detect.py, training/state.py)
    "--loss names no node": "test_training_refusals.py::test_a_hint_naming_no_node",
    "--grad names no node": "test_training_refusals.py::test_a_hint_naming_no_node",
    "no backprop seed reads the shape of loss": "test_loss_scaling.py::test_user_seed_needs_a_hint",
    "but its backprop seed is missing": "test_loss_scaling.py::test_user_seed_needs_a_hint",
    "reads gradients that no backprop seed found":
        "test_loss_scaling.py::test_separate_train_steps_need_a_hint",
    "could not tell which tensors are the gradients":
        "test_training_refusals.py::test_updates_made_inside_the_backprop_scope",
    "reaches no variable write": "test_training_refusals.py::test_a_seed_that_reaches_no_write",
    "backprop seeds reach separate variable updates":
        "test_loss_scaling.py::test_separate_train_steps_need_a_hint",
    "the graph already has nodes named":
        "test_training_refusals.py::test_a_converted_graph_is_not_scaled_twice",
    # train steps in functions (training/in_functions.py, training/in_graph.py)
    "finds no backprop seed": "test_training_refusals.py::test_a_tape_seeded_with_output_gradients",
    "meets the one from seed":
        "test_two_tape_steps.py::test_a_tape_differentiating_another_tapes_gradients_is_refused",
    "from the gradients of seed":
        "test_training_refusals.py::test_a_custom_gradient_that_writes_and_reads_back",
    "before the gradients of another tape":
        "test_two_tape_steps.py::test_a_step_applying_one_tape_before_the_next_is_refused_and_its_split_converts",
    "has no object graph to hold loss-scale state":
        "test_training_refusals.py::test_a_tf1_saved_model_with_a_train_function",
    "state: converted before": "test_saved_training.py::test_static_scale_and_converting_twice",
    "sit in function": "test_training_refusals.py::test_writes_in_a_called_function",
    "directly (its op is the function's name)":
        "test_training_refusals.py::test_a_train_function_called_directly",
    "already has a node": "test_training_refusals.py::test_a_body_holding_our_names",
    "already has an input or node": "test_training_refusals.py::test_a_body_holding_our_names",
    "name nodes of the graph, but its train step is in function":
        "test_training_refusals.py::test_a_graph_whose_step_is_a_function_with_hints",
    "both the graph and function":
        "test_training_refusals.py::test_a_graph_and_its_function_both_training",
}


def _template(node: ast.expr) -> str:
    """A raise's message as written, each formatted value ``{}``."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _template(node.left) + _template(node.right)
    if isinstance(node, ast.IfExp):
        return _template(node.body) + " | " + _template(node.orelse)
    return "{}"


def test_every_refusal_in_training_has_a_test():
    """Each ``raise UnsupportedGraphError`` / ``InputError`` in amp_rewrite/training matches one
    entry of :data:`REFUSALS`, each entry one raise, and the test it names exists."""
    raised = []
    for path in sorted((ROOT / "amp_rewrite" / "training").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", "") in ("UnsupportedGraphError", "InputError"):
                raised.append((path.name, node.lineno, _template(node.exc.args[0])))
    assert len(raised) >= 28
    for where, line, text in raised:
        keys = [k for k in REFUSALS if k in text]
        assert len(keys) == 1, f"training/{where}:{line} {text!r} matches {keys} in REFUSALS"
    for key in REFUSALS:
        assert sum(key in text for _, _, text in raised) == 1, key
    for test in set(REFUSALS.values()):
        file, name = test.split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, test


# ----------------------------------------------------------------- helpers
def _which(text: str) -> str:
    """The refusal ``text`` is: its one key in :data:`REFUSALS`."""
    (key,) = [k for k in REFUSALS if k in text]
    return key


def _quoted(text: str) -> list[str]:
    """The names a message quotes (``'name'``)."""
    return re.findall(r"'([^']+)'", text)


def _refused_cli(capsys, tmp_path: Path, refusal: str, src: Path, *flags) -> str:
    """Convert ``src`` with the CLI, which must refuse it with ``refusal`` (a key of
    :data:`REFUSALS`): exit 2, one line naming it, nothing written, the folder as it was.
    Returns the line."""
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / f"out{src.suffix}", "--target", "float16",
                                    "--device", "cpu", *flags])
    assert_refused(code, err, str(src), tmp_path, before)
    assert _which(err) == refusal, err
    return err.strip()


def _library(path: Path) -> dict:
    meta = loader_impl.parse_saved_model(str(path)).meta_graphs[0]
    return {f.signature.name: f for f in meta.graph_def.library.function}


def _trains(body) -> bool:
    """A function body that computes gradients (a gradient_tape/ node) and writes a variable."""
    return (any(n.name.startswith("gradient_tape/") for n in body.node_def)
            and any(n.op.startswith(WRITES) for n in body.node_def))


def _ones_seeds(body) -> list[str]:
    """Consts of ones read only by gradient_tape/ nodes: a tape's seed."""
    readers: dict[str, list[str]] = {}
    for n in body.node_def:
        for i in n.input:
            readers.setdefault(i.lstrip("^").split(":")[0], []).append(n.name)
    return [n.name for n in body.node_def if n.op == "Const" and readers.get(n.name)
            and not n.name.startswith("gradient_tape/")
            and all(r.startswith("gradient_tape/") for r in readers[n.name])
            and n.attr["dtype"].type == tf.float32.as_datatype_enum
            and np.all(tf.make_ndarray(n.attr["value"].tensor) == 1)]


def _downstream(nodes, roots) -> set[str]:
    """``roots`` and the nodes (NodeDefs of a graph or a function body) that read them, along
    data edges."""
    readers: dict[str, list[str]] = {}
    for n in nodes:
        for i in n.input:
            if not i.startswith("^"):
                readers.setdefault(i.split(":")[0], []).append(n.name)
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(readers.get(name, ()))
    return seen


def _save_meta(meta, path: Path) -> Path:
    path.write_bytes(meta.SerializeToString())
    return path


# ----------------------------------------------------------------- the options
def test_an_unknown_loss_scale_option(tmp_path):
    with pytest.raises(InputError) as refused:
        convert_file(_save_meta(build("mlp", "sgd"), tmp_path / "train.meta"), tmp_path / "out.meta",
                     device="cpu", loss_scale_options={"begin": 128})
    assert _which(str(refused.value)) == "unknown loss-scale option"
    assert _quoted(str(refused.value)) == ["begin"]
    assert not (tmp_path / "out.meta").exists()


# ----------------------------------------------------------------- a graph's own step
@pytest.mark.parametrize("flag", ["--loss", "--grad"])
def test_a_hint_naming_no_node(flag, tmp_path, capsys):
    meta = build("mlp", "sgd")
    line = _refused_cli(capsys, tmp_path, f"{flag} names no node",
                        _save_meta(meta, tmp_path / "train.meta"), flag, "lost")
    assert "lost" in _quoted(line) and "lost" not in {n.name for n in meta.graph_def.node}


def _inference_graph():
    """The digits MLP's forward pass alone, as a frozen serving graph: nothing trains."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        w = tf.constant(np.random.default_rng(0).normal(0, 0.1, (64, 10)).astype(np.float32))
        tf.nn.softmax(tf.matmul(x, w), name="probabilities")
    return g.as_graph_def()


def test_a_seed_that_reaches_no_write(tmp_path, capsys):
    """A seed named for a graph that writes no variable: nothing to loss-scale."""
    graph_def = _inference_graph()
    src = tmp_path / "serve.pb"
    src.write_bytes(graph_def.SerializeToString())
    _refused_cli(capsys, tmp_path, "reaches no variable write", src, "--grad", "x")
    by_name = {n.name: n for n in graph_def.node}
    assert not [n for n in _downstream(graph_def.node, ["x"]) if by_name[n].op.startswith(WRITES)]


def _digits_inputs():
    """In the graph being built: the digits' features ``x`` and labels ``y`` as placeholders,
    and a resource variable ``w`` of softmax-regression weights."""
    x = v1.placeholder(tf.float32, [None, 64], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    w = v1.get_variable("w", initializer=np.random.default_rng(0).normal(
        0, 0.1, (64, 10)).astype(np.float32), use_resource=True)
    return x, y, w


def _update_in_backprop_scope():
    """The digits regression whose optimizer update is made under ``gradients/``, the scope
    tf.gradients names its backward pass by: the gradients never leave it."""
    g = tf.Graph()
    with g.as_default():
        x, y, w = _digits_inputs()
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(x, w)), name="loss")
        grads = tf.gradients(loss, [w])
        with tf.name_scope("gradients/"):
            v1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, [w]), name="train")
        v1.global_variables_initializer()
        return v1.train.Saver().export_meta_graph()


def test_updates_made_inside_the_backprop_scope(tmp_path, capsys):
    meta = _update_in_backprop_scope()
    line = _refused_cli(capsys, tmp_path, "could not tell which tensors are the gradients",
                        _save_meta(meta, tmp_path / "train.meta"))
    seeds = [n.name for n in meta.graph_def.node if n.op == "Fill" and n.name.startswith("gradients/")]
    assert seeds and all(s in line for s in seeds)
    updates = [n.name for n in meta.graph_def.node if n.op == "ResourceApplyGradientDescent"]
    assert updates and all(u.startswith("gradients/") for u in updates)


def test_a_converted_graph_is_not_scaled_twice(tmp_path, capsys):
    src = _save_meta(build("mlp", "sgd"), tmp_path / "train.meta")
    code, _, _ = run_cli(capsys, [src, "-o", tmp_path / "once.meta", "--device", "cpu"])
    assert code == 0
    once = tmp_path / "once.meta"
    line = _refused_cli(capsys, tmp_path, "the graph already has nodes named", once)
    converted = tf.compat.v1.MetaGraphDef.FromString(once.read_bytes())
    assert "amp_loss_scale/" in line
    assert any(n.name.startswith("amp_loss_scale/") for n in converted.graph_def.node)


# ----------------------------------------------------------------- train steps in functions
class _Step(tf.Module):
    """Softmax regression of the digits, SGD written with ``assign_sub``: the smallest train
    step. Each subclass changes one thing."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).normal(0, 0.1, (64, 10)).astype(np.float32))

    def loss(self, x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, self.w)))

    def gradient(self, tape, loss, x):
        return tape.gradient(loss, self.w)

    def apply(self, g):
        self.w.assign_sub(0.1 * g)

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.loss(x, y)
        self.apply(self.gradient(tape, loss, x))
        return {"loss": loss}


class _OutputGradients(_Step):
    """The tape seeded with the batch's share of a 64-example batch: no Const of ones."""

    def gradient(self, tape, loss, x):
        return tape.gradient(loss, self.w, output_gradients=tf.cast(tf.shape(x)[0], tf.float32) / 64.0)


class _WritesInCallee(_Step):
    """The weights written by a tf.function the step calls; a step counter in the step."""

    def __init__(self):
        super().__init__()
        self.steps = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def apply(self, g):
        self.steps.assign_add(1)
        self.w.assign_sub(0.1 * g)

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.loss(x, y)
        self.steps.assign_add(1)
        self.apply(tape.gradient(loss, self.w))
        return {"loss": loss}


class _ScopedLikeOurs(_Step):
    """A loss named under the scope loss scaling adds its nodes in."""

    def loss(self, x, y):
        with tf.name_scope("amp_loss_scale/scale/"):
            return tf.identity(super().loss(x, y), name="read")


class _NamedLikeOurs(_Step):
    """A loss named as loss scaling names the scale's handle."""

    def loss(self, x, y):
        return tf.identity(super().loss(x, y), name="amp_loss_scale_scale_resource")


class _WritesInsideBackprop(_Step):
    """One tape, whose custom gradient (between the logits and the loss) records the largest
    gradient in a variable and reads it back: a write inside the backward pass that the rest of
    the backward pass waits on."""

    def __init__(self):
        super().__init__()
        self.largest = tf.Variable(0.0)

    def loss(self, x, y):
        @tf.custom_gradient
        def recorded(logits):
            def grad(dy):
                self.largest.assign(tf.reduce_max(tf.abs(dy)))
                return dy * (self.largest / self.largest)
            return tf.identity(logits), grad
        logits = recorded(tf.matmul(x, self.w))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def _save_step(module, path: Path) -> Path:
    tf.saved_model.save(module, str(path), signatures={"train": module.train_step})
    return path


def test_a_tape_seeded_with_output_gradients(tmp_path, capsys):
    src = _save_step(_OutputGradients(), tmp_path / "fp32")
    (name,) = _quoted(_refused_cli(capsys, tmp_path, "finds no backprop seed", src))
    body = _library(src)[name]
    assert _trains(body) and not _ones_seeds(body)


def test_writes_in_a_called_function(tmp_path, capsys):
    src = _save_step(_WritesInCallee(), tmp_path / "fp32")
    train, callee = _quoted(_refused_cli(capsys, tmp_path, "sit in function", src))
    library = _library(src)
    assert _trains(library[train])
    assert any(n.attr["f"].func.name == callee for n in library[train].node_def if "f" in n.attr)
    assert any(n.op == "AssignSubVariableOp" for n in library[callee].node_def)


@pytest.mark.parametrize("module,refusal", [(_ScopedLikeOurs, "already has a node"),
                                            (_NamedLikeOurs, "already has an input or node")])
def test_a_body_holding_our_names(module, refusal, tmp_path, capsys):
    """A body that already has a node of a name loss scaling would add."""
    src = _save_step(module(), tmp_path / "fp32")
    function, node = _quoted(_refused_cli(capsys, tmp_path, refusal, src))
    body = _library(src)[function]
    assert _trains(body) and node in {n.name for n in body.node_def}
    assert node.startswith("amp_loss_scale")


def test_a_custom_gradient_that_writes_and_reads_back(tmp_path, capsys):
    """One tape: the refusal names its one seed and the write inside its backward pass, not a
    second tape (it once named one)."""
    src = _save_step(_WritesInsideBackprop(), tmp_path / "fp32")
    function, write, seed = _quoted(_refused_cli(capsys, tmp_path, "from the gradients of seed", src))
    body = _library(src)[function]
    assert _ones_seeds(body) == [seed]
    by_name = {n.name: n for n in body.node_def}
    assert by_name[write].op == "AssignVariableOp"
    assert write in _downstream(body.node_def, [seed])


def test_a_routed_step_is_not_refused(tmp_path, capsys):
    """A Mixture-of-Experts step: its backward pass holds top_k's ScatterNd, which writes
    nothing; one tape, converted and scaled."""
    module = RoutedGather(0)
    src = _save_step(module, tmp_path / "fp32")
    code, _, err = run_cli(capsys, [src, "-o", tmp_path / "f16", "--target", "float16"])
    assert code == 0, err
    (train,) = [f for name, f in _library(src).items() if name.startswith("__inference_train_step")]
    assert any(n.op == "ScatterNd" and n.name.startswith("gradient_tape/") for n in train.node_def)
    assert len(_ones_seeds(train)) == 1
    assert hasattr(tf.saved_model.load(str(tmp_path / "f16")), "amp_loss_scale")


# ----------------------------------------------------------------- TF1 graphs calling a train function
def _graph_calling_a_train_function(own_step: bool = False) -> tf.Graph:
    """A TF1 graph whose train step is a tf.function it calls (a GradientTape, SGD on a resource
    variable); with ``own_step``, a second model trained by the graph's own nodes too."""
    g = tf.Graph()
    with g.as_default():
        x, y, w = _digits_inputs()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    y, tf.matmul(x, w)))
            w.assign_sub(0.1 * tape.gradient(loss, w))
            return loss

        tf.identity(step(x, y), name="loss")
        if own_step:
            u = v1.get_variable("u", initializer=np.zeros((64, 10), np.float32), use_resource=True)
            other = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(x, u)), name="other_loss")
            v1.train.GradientDescentOptimizer(0.1).minimize(other, name="train_other")
        v1.global_variables_initializer()
    return g


def _export(g: tf.Graph):
    with g.as_default():
        return v1.train.Saver().export_meta_graph()


def _calls(graph_def, function: str) -> bool:
    return any(n.attr["f"].func.name == function for n in graph_def.node if "f" in n.attr)


def test_a_graph_whose_step_is_a_function_with_hints(tmp_path, capsys):
    """--grad names a node of the graph; the seed loss scaling scales is in the function."""
    meta = _export(_graph_calling_a_train_function())
    (function,) = _quoted(_refused_cli(
        capsys, tmp_path, "name nodes of the graph, but its train step is in function",
        _save_meta(meta, tmp_path / "train.meta"), "--grad", "x"))
    library = {f.signature.name: f for f in meta.graph_def.library.function}
    assert _calls(meta.graph_def, function) and _trains(library[function])
    assert not any(n.name.startswith("gradients/") for n in meta.graph_def.node)


def test_a_graph_and_its_function_both_training(tmp_path, capsys):
    meta = _export(_graph_calling_a_train_function(own_step=True))
    (function,) = _quoted(_refused_cli(capsys, tmp_path, "both the graph and function",
                                       _save_meta(meta, tmp_path / "train.meta")))
    library = {f.signature.name: f for f in meta.graph_def.library.function}
    assert _calls(meta.graph_def, function) and _trains(library[function])
    own = [n for n in meta.graph_def.node if n.op == "ResourceApplyGradientDescent"]
    assert own and all(n.name.startswith("train_other/") for n in own)


def test_a_tf1_saved_model_with_a_train_function(tmp_path, capsys):
    """A TF1 SavedModel (no object graph) whose signature runs a train function."""
    g = _graph_calling_a_train_function()
    src = tmp_path / "tf1"
    with g.as_default(), v1.Session(graph=g) as sess:
        sess.run(v1.global_variables_initializer())
        builder = v1.saved_model.Builder(str(src))
        signature = v1.saved_model.predict_signature_def(
            {"x": g.get_tensor_by_name("x:0"), "y": g.get_tensor_by_name("y:0")},
            {"loss": g.get_tensor_by_name("loss:0")})
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={"train": signature})
        builder.save()
    (function,) = _quoted(_refused_cli(
        capsys, tmp_path, "has no object graph to hold loss-scale state", src))
    meta = loader_impl.parse_saved_model(str(src)).meta_graphs[0]
    assert not meta.object_graph_def.nodes
    assert _trains({f.signature.name: f for f in meta.graph_def.library.function}[function])


def test_a_train_function_called_directly(tmp_path, capsys):
    """A TF1 ``Defun`` train step: the graph calls it by its name as an op."""
    g = tf.Graph()
    with g.as_default():
        x, y, w = _digits_inputs()

        @tf1_function.Defun(tf.resource, tf.float32, tf.int64)
        def step(handle, x, y):
            value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
            with tf.GradientTape() as tape:
                tape.watch(value)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=y, logits=tf.matmul(x, value)))
            grad = tape.gradient(loss, value, output_gradients=tf.constant(1.0, name="ones"))
            tf.raw_ops.AssignSubVariableOp(resource=handle, value=0.1 * grad)
            return loss

        tf.identity(step(w.handle, x, y), name="loss")
        v1.global_variables_initializer()
    meta = _export(g)
    node, function = _quoted(_refused_cli(capsys, tmp_path, "directly (its op is the function's name)",
                                         _save_meta(meta, tmp_path / "train.meta")))
    assert {n.name: n.op for n in meta.graph_def.node}[node] == function
    assert _trains({f.signature.name: f for f in meta.graph_def.library.function}[function])
