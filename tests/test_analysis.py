"""The runner's analysis of a model, on real graphs and without a TensorFlow session: the copy
a runner imports, endpoints, setup ops, training parts, v1 frames, what runs after a variable
write, what a trace compares and in which order, the variables two models share."""

import logging
import random
import zlib

import graphs
import pytest
import tensorflow as tf
import training_graphs
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from amp_rewrite.conversion.pipeline import convert_file
from amp_rewrite.core.errors import InputError
from amp_rewrite.core.ir import Graph
from amp_rewrite.schema.opdefs import is_variable_write
from amp_rewrite.io.load import Model, load
from amp_rewrite.tools.analysis import Analysis, own_variables
from amp_rewrite.tools.traces import TensorInfo, upstream
from amp_rewrite.training.detect import find_backprop
from amp_rewrite.training.in_graph import FETCH

v1 = tf.compat.v1


def _meta(tmp_path, name, meta):
    path = tmp_path / f"{name}.meta"
    path.write_bytes(meta.SerializeToString())
    return path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The MLP training MetaGraph (resource variables, SGD) and its float16 conversion."""
    folder = tmp_path_factory.mktemp("analysis")
    path = _meta(folder, "mlp", training_graphs.build("mlp", "sgd"))
    convert_file(path, folder / "mlp16.meta", target="float16")
    return load(path), load(folder / "mlp16.meta")


def test_a_training_graph_read_without_a_session(mlp):
    original, _ = mlp
    a = Analysis(original)
    assert a.signature is None and a.inputs == [("x", "x:0"), ("y", "y:0")]
    # the forward pass's outputs; the accuracy counts decisions, the loss does not
    assert a.outputs == ["loss:0", "accuracy:0"]
    assert [a.is_decision_share(t) for t in a.outputs] == [False, True]
    # the initializers (and the values they assign), the saver: only setting up
    assert {f"{v}/Assign" for v in ("w1", "b1", "w2", "b2", "global_step")} <= a.setup
    assert {"w1/Initializer/initial_value", "save/SaveV2", "save/restore_all"} <= a.setup
    assert not {"MatMul", "loss", "w1", "x"} & a.setup
    # the updates and what waits on them run after a write; the backward pass does not
    assert {"train", "train/update_w1/ResourceApplyGradientDescent"} <= a.after_writes
    assert not [n for n in a.after_writes if n.startswith("gradients/")]
    assert a.frames == set() and a.uncomparable() == {}
    # the gradients are the converter's, and a trace compares them
    backprop = find_backprop(Graph.from_graph_def(original.graph_def))
    assert a.gradients == [f"{g.node}:{g.port}" for g in backprop.gradients]
    assert set(a.gradients) <= set(a.comparable()) <= set(a.fetchable())
    assert not [t for t in a.comparable() if "/Initializer/" in t or t.startswith("save/")]
    assert list(a.variables) == ["w1", "b1", "w2", "b2", "global_step"]


def test_the_copy_a_runner_imports_never_waits_on_an_update(tmp_path):
    """The CNN's gradients are built under control_dependencies(UPDATE_OPS): in the graph as
    given they run after the moving mean's update, in the runnable copy they do not."""
    model = load(_meta(tmp_path, "cnn", training_graphs.build("cnn", "adam")))
    given = Graph.from_graph_def(model.graph_def)
    writes = [n.name for n in given.nodes() if is_variable_write(n.op)]
    assert [n for n in given.descendants(writes, control=True) if n.startswith("gradients/")]
    a = Analysis(model)
    runnable = Graph.from_graph_def(a.runnable)
    assert runnable.descendants(writes, control=True) == a.after_writes
    # a group keeps its control inputs (below), what waits on the group does not
    assert {runnable.node(n).op for n in a.after_writes if n.startswith("gradients/")} == {"NoOp"}
    # the groups keep the writes they run: the init op and the saver's restore_all
    for group in ("init", "save/restore_all", "train"):
        assert runnable.control_inputs(group) == given.control_inputs(group)
    # only control edges went, and only those out of what runs after a write
    for node in model.graph_def.node:
        kept = next(n for n in a.runnable.node if n.name == node.name)
        assert [i for i in node.input if i not in kept.input] == [
            i for i in node.input if i.startswith("^") and i[1:] in a.after_writes
            and node.op != "NoOp"]
    # so the gradients are worth comparing
    assert "gradients/MatMul_grad/MatMul_1:0" in a.comparable()


def test_unseeded_random_ops_are_seeded_by_name_in_the_copy():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4], name="x")
        noise = tf.random.normal([4], name="noise")
        fixed = tf.random.uniform([4], seed=3, name="fixed")
        tf.add(x + noise, fixed, name="out")
    a = Analysis(Model.of_graph_def(g.as_graph_def()))
    nodes = {n.name: n for n in a.runnable.node}
    assert nodes["noise/RandomStandardNormal"].attr["seed2"].i == \
        zlib.crc32(b"noise/RandomStandardNormal") % (2**31 - 1) + 1
    assert nodes["fixed/RandomUniform"].attr["seed2"].i == \
        next(n for n in g.as_graph_def().node if n.name == "fixed/RandomUniform").attr["seed2"].i
    assert a.outputs == ["out:0"] and a.inputs == [("x", "x:0")]


def test_a_loss_scaled_conversion_pairs_each_gradient_with_its_unscaled_value(mlp):
    original, converted = mlp
    a, b = Analysis(original), Analysis(converted)
    # each gradient of the original, under its own name, against the scale-free value
    assert set(b.unscaled_gradients) == set(a.gradients)
    assert all(u.endswith("/amp_unscaled:0") for u in b.unscaled_gradients.values())
    scaled, scale = b.loss_scaled
    assert scale == FETCH["scale"]
    assert set(b.unscaled_gradients) <= scaled
    assert not scaled & set(b.unscaled_gradients.values()) and "loss:0" not in scaled
    assert a.loss_scaled == (set(), None) and a.unscaled_gradients == {}
    # the loss-scale state is the conversion's own: never compared, never taken from the original
    assert not [t for t in b.comparable() + list(b.uncomparable())
                if t.startswith("amp_loss_scale/")]
    assert own_variables(a, b) == []
    assert own_variables(None, b) == list(a.variables)


def test_v1_loop_frames_are_hidden_and_the_order_is_tensorflows():
    graph_def, _, _ = graphs.while_v1()
    # shuffled: the order is the one TensorFlow imports in, not the file's
    nodes = list(graph_def.node)
    random.Random(0).shuffle(nodes)
    del graph_def.node[:]
    graph_def.node.extend(nodes)
    a = Analysis(Model.of_graph_def(graph_def))
    # the loop's nodes data flows through from an Enter (its Consts hang on control edges)
    assert a.frames == {n.name for n in graph_def.node if n.name.startswith("loop/")
                        and n.op not in ("Exit", "Const")}
    assert set(a.uncomparable().values()) == {"control_flow"}
    assert sorted(a.comparable()) == ["loop/Exit_1:0", "out:0", "w:0", "x:0"]
    imported = tf.Graph()
    with imported.as_default():
        tf.graph_util.import_graph_def(a.runnable, name="")
    assert a.names == [op.name for op in imported.get_operations()] != [n.name for n in nodes]
    assert a.comparable() == [t for n in a.names for t in ("x:0", "w:0", "loop/Exit_1:0", "out:0")
                              if t.startswith(n + ":")]


def test_the_bundled_example():
    a = Analysis(load("examples/cnn_fp32.pb"))
    assert a.inputs == [("images", "images:0")] and a.outputs == ["probabilities:0"]
    assert a.setup == a.hidden == set() and a.variables == {}
    assert not a.is_decision_share("probabilities:0")
    imported = tf.Graph()
    with imported.as_default():
        tf.graph_util.import_graph_def(a.runnable, name="")
    ops = imported.get_operations()
    assert a.fetchable() == [t.name for op in ops for t in op.outputs]
    assert a.comparable() == [t.name for op in ops for t in op.outputs if t.dtype.is_floating]


def test_a_signature_chooses_the_endpoints(mlp, tmp_path):
    original, _ = mlp
    meta = meta_graph_pb2.MetaGraphDef()
    meta.CopyFrom(original.meta_graph)
    for key, output in (("serving_default", "loss:0"), ("accuracy", "accuracy:0")):
        sig = meta.signature_def[key]
        sig.inputs["images"].name, sig.inputs["labels"].name = "x:0", "y:0"
        sig.outputs["out"].name = output
    model = load(_meta(tmp_path, "signed", meta))
    a = Analysis(model)
    assert (a.signature, a.inputs, a.outputs) == (
        "serving_default", [("images", "x:0"), ("labels", "y:0")], ["loss:0"])
    assert Analysis(model, "accuracy").outputs == ["accuracy:0"]
    with pytest.raises(InputError, match=r"no signature 'nope' \(has: accuracy, serving_default\)"):
        Analysis(model, "nope")
    with pytest.raises(InputError, match="has no signatures; drop --signature"):
        Analysis(original, "serving_default")


def test_a_placeholder_nothing_reads_is_no_input(caplog):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2], name="x")
        v1.placeholder(tf.float32, None, name="unused_control_flow_input")
        tf.identity(x * 2.0, name="out")
    with caplog.at_level(logging.INFO, logger="amp_rewrite"):
        a = Analysis(Model.of_graph_def(g.as_graph_def()))
    assert a.inputs == [("x", "x:0")] and a.outputs == ["out:0"]
    assert "1 placeholders nothing reads are not inputs: unused_control_flow_input" in caplog.text


def test_a_graph_def_sets_its_variables_up_without_collections():
    graph_def, _, _ = graphs.training_mlp()
    a = Analysis(Model.of_graph_def(graph_def))
    assert a.variables == {}
    assert {"w1/Assign", "w2/Assign", "w1/Initializer/initial_value"} <= a.setup
    assert a.outputs == ["loss:0"]


def test_upstream_finds_the_nearest_wanted_sources_through_variants():
    """verify's and tune's walk over what a trace says a tensor is computed from."""
    info = {
        "out": TensorInfo("Add", "float", {"a", "list"}),
        "a": TensorInfo("Relu", "float", {"b"}),
        "b": TensorInfo("MatMul", "float", {"x"}),
        "list": TensorInfo("TensorListSetItem", "variant", {"pushed", "list", "out"}),
        "pushed": TensorInfo("Mul", "float", set()),
    }
    compared = {"b", "pushed", "out"}

    def sources(name):
        return info[name].sources

    def through(name):
        return info[name].dtype == "variant"
    # a, not compared, ends the way to b; pushed is reached through the list; out is no source
    # of its own, though the list loops back to it
    assert upstream("out", sources, compared.__contains__, through) == {"pushed"}
    # through every tensor (tune's walk over compared tensors), b is the nearest behind a
    assert upstream("out", sources, compared.__contains__) == {"b", "pushed"}
    assert upstream("b", sources, lambda n: True) == {"x"}


def test_a_ref_variable_is_no_float_tensor_to_compare(tmp_path):
    """A ref variable's value (and an update's, which returns it) is a float32_ref to
    TensorFlow: fetchable, never compared; the read of it is compared."""
    a = Analysis(load(_meta(tmp_path, "ref", training_graphs.build("mlp", "sgd", resource=False))))
    assert a.tensors("w1") == [("w1:0", types_pb2.DT_FLOAT_REF)]
    assert "w1/read:0" in a.comparable() and "w1:0" in a.fetchable()
    assert not {"w1:0", "train/update_w1/ApplyGradientDescent:0"} & (
        set(a.comparable()) | set(a.uncomparable()))
