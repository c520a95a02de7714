"""The graphs of TensorFlow's own AMP tests (tensorflow/python/grappler/auto_mixed_precision_test.py),
rebuilt with the public API, more graphs where grappler's choices are worth matching (pinned
devices, v1 batch norm, TensorLists, direct function calls, infer ops after allow ops), and
runners for grappler's pass: its oneDNN bfloat16 mode, and its CUDA float16 mode on a virtual
GPU (grappler's own cluster description of an Ampere GPU; no GPU is needed to paint)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import device_properties_pb2
from tensorflow.python.framework import function as v1_function
from tensorflow.python.framework.convert_to_constants import (
    convert_variables_to_constants_v2,
)
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import tf_optimizer

from amp_rewrite.transforms.constfold import grappler_alone

v1 = tf.compat.v1
LOWP = (tf.bfloat16.as_datatype_enum, tf.float16.as_datatype_enum)


def _weight(shape, seed=[0]):
    seed[0] += 1
    return tf.constant(np.random.default_rng(seed[0]).uniform(-0.5, 0.5, shape).astype(np.float32))


def _input(shape):
    return v1.placeholder(tf.float32, shape, name="input")


def _conv2d(x, w):
    return tf.nn.conv2d(x, w, strides=[1, 1, 1, 1], padding="SAME")


def _conv_bn(x):
    i = tf.reshape(x, [-1, 8, 8, 1] if x.shape[-1] == 1 else [-1, 8, 8, x.shape[-1]])
    f = _weight([3, 3, i.shape[-1], 6])
    y = _conv2d(i, f)
    y, _, _ = v1.nn.fused_batch_norm(y, scale=_weight([6]), offset=_weight([6]), is_training=True)
    return tf.identity(y)


def _conv_pool(x):
    x_image = tf.reshape(x, [-1, 8, 8, 1])
    h1 = tf.nn.relu(tf.nn.bias_add(_conv2d(x_image, _weight([3, 3, 1, 6])), tf.fill([6], 0.1)))
    p1 = tf.nn.max_pool2d(h1, 2, 2, "SAME")
    h2 = tf.nn.relu(tf.nn.bias_add(_conv2d(p1, _weight([3, 3, 6, 4])), tf.fill([4], 0.1)))
    return tf.nn.max_pool2d(h2, 2, 2, "SAME")


def _node(color, x, name):
    if color == "w":
        return tf.matmul(x, _weight(x.shape.as_list()), name=name)
    if color == "g":
        return tf.add(x, 0.1, name=name)
    if color == "c":
        return tf.nn.relu(x, name=name)
    if color == "b":
        return tf.pow(tf.pow(x, 2.0), 0.5, name=name)
    raise ValueError(color)


def conv_bn():
    g = tf.Graph()
    with g.as_default():
        x = _input([2, 8, 8, 1])
        out = _conv_bn(_conv_bn(x))
        tf.identity(out, name="output")
    return g.as_graph_def(), {"input:0": np.random.default_rng(0).normal(size=(2, 8, 8, 1))}


def conv_pool():
    g = tf.Graph()
    with g.as_default():
        x = _input([2, 8, 8, 1])
        tf.identity(_conv_pool(x), name="output")
    return g.as_graph_def(), {"input:0": np.random.default_rng(0).normal(size=(2, 8, 8, 1))}


def simple_loop(inp: str, body: str, out: str):
    """inp -> while[body] -> out, each letter a node: w allow, g infer, c clear, b deny."""
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            a = _input([8, 8])
            for i, c in enumerate(inp):
                a = _node(c, a, f"input_{i}")

            def body_fn(x):
                for i, c in enumerate(body):
                    x = _node(c, x, f"body_{i}")
                return x

            _, a = tf.while_loop(lambda i, j: i < 4, lambda i, j: (i + 1, body_fn(j)),
                                 (tf.constant(0), a))
            for i, c in enumerate(out):
                a = _node(c, a, f"output_{i}")
            tf.identity(a, name="output")
        finally:
            v1.enable_control_flow_v2()
    return g.as_graph_def(), {"input:0": np.random.default_rng(0).uniform(0, 1, (8, 8))}


def multi_paths():
    g = tf.Graph()
    with g.as_default():
        x = _input([2, 8, 8, 3])
        x1, x2, x3 = tf.split(x, num_or_size_splits=3, axis=3)
        y = tf.concat([_conv_pool(x1), _conv_pool(x2), _conv_pool(x3)], axis=3)
        y = tf.identity(y)
        grad = tf.gradients(y, [x])[0]
        tf.identity(y, name="output")
        tf.identity(grad, name="grad_output")
    return g.as_graph_def(), {"input:0": np.random.default_rng(0).normal(size=(2, 8, 8, 3))}


def grappler_bfloat16(graph_def, fetch_nodes):
    """Run only grappler's auto_mixed_precision (oneDNN bfloat16 mode) on ``graph_def``."""
    return _grappler(graph_def, fetch_nodes, "auto_mixed_precision_onednn_bfloat16", None)


def grappler_float16(graph_def, fetch_nodes):
    """Run only grappler's auto_mixed_precision in its CUDA float16 mode, on a virtual cluster
    with one Ampere GPU (compute capability 8.0), so unplaced nodes count as on the GPU."""
    cpu = device_properties_pb2.DeviceProperties(type="CPU", frequency=2000, num_cores=2)
    gpu = device_properties_pb2.DeviceProperties(type="GPU", vendor="NVIDIA")
    gpu.environment["architecture"] = "8.0"
    gpu.environment["cuda"] = "12050"
    gpu.environment["cudnn"] = "9000"
    cluster = gcluster.Cluster(devices=[
        device_properties_pb2.NamedDevice(name="/job:localhost/replica:0/task:0/device:CPU:0",
                                          properties=cpu),
        device_properties_pb2.NamedDevice(name="/job:localhost/replica:0/task:0/device:GPU:0",
                                          properties=gpu)])
    return _grappler(graph_def, fetch_nodes, "auto_mixed_precision", cluster)


def _grappler(graph_def, fetch_nodes, switch: str, cluster):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        for name in fetch_nodes:
            g.add_to_collection("train_op", g.get_operation_by_name(name))
        meta = v1.train.export_meta_graph(graph=g)
    config = grappler_alone(switch)
    return tf_optimizer.OptimizeGraph(config, meta, cluster=cluster)


# ----------------------------------------------------------------- more graphs
def _weights4():
    return tf.constant(np.random.default_rng(9).uniform(-0.5, 0.5, (4, 4)).astype(np.float32))


def pinned(device: str):
    """x -> MatMul pinned to ``device`` -> Relu -> MatMul -> out: grappler processes only
    nodes on its target device, and paints around the pinned one."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 4], name="input")
        h = tf.matmul(x, _weights4(), name="mm0")
        with tf.device(device):
            h = tf.matmul(h, _weights4(), name="pinned")
        h = tf.nn.relu(h, name="relu")
        h = tf.matmul(h, _weights4(), name="mm2")
        tf.identity(h, name="output")
    return g.as_graph_def(), {"input:0": np.ones((4, 4))}


def conv_bn_v1():
    """conv -> FusedBatchNorm (v1, training) -> relu -> conv, and its gradients (FusedBatchNormGrad v1)."""
    g = tf.Graph()
    with g.as_default():
        x = _input([2, 8, 8, 4])
        y = _conv2d(x, _weight([3, 3, 4, 8]))
        bn = tf.raw_ops.FusedBatchNorm(x=y, scale=_weight([8]), offset=_weight([8]),
                                       mean=tf.constant([], tf.float32),
                                       variance=tf.constant([], tf.float32), is_training=True,
                                       name="bn")[0]
        z = _conv2d(tf.nn.relu(bn, name="relu"), _weight([3, 3, 8, 8]))
        out = tf.identity(z, name="output")
        tf.identity(tf.gradients(out, [x])[0], name="grad_output")
    return g.as_graph_def(), {}


def _list_base():
    x = v1.placeholder(tf.float32, [4, 4], name="input")
    return x, _weights4(), tf.constant([4], tf.int32), tf.constant(0)


def tensorlist(case: str):
    """TensorList graphs (names as in grappler's behaviour notes): A a MatMul into a list read
    back into a MatMul; B a MatMul into a list stacked to the output; C a graph input into a list
    read by a MatMul; D handles through Identity, Reshape, ExpandDims, ConcatLists,
    PushBackBatch and Unpack; E a list whose handle is a graph input; G a deny op (Exp) into a
    list; I Reserve/SetItem/Length/Resize/Stack."""
    R = tf.raw_ops
    g = tf.Graph()
    with g.as_default():
        x, w, es, i0 = _list_base()
        f32 = tf.float32
        if case in "ABDI":
            m1 = tf.matmul(x, w, name="m1")
        if case == "A":
            h = R.TensorListFromTensor(tensor=m1, element_shape=es, name="fromtensor")
            it = R.TensorListGetItem(input_handle=h, index=i0, element_shape=es, element_dtype=f32)
            out = tf.matmul(tf.reshape(it, [1, 4]), w, name="m2")
        elif case == "B":
            h = R.TensorListFromTensor(tensor=m1, element_shape=es, name="fromtensor")
            out = R.TensorListStack(input_handle=h, element_shape=es, element_dtype=f32, name="stack")
        elif case == "C":
            h = R.TensorListFromTensor(tensor=x, element_shape=es, name="fromtensor")
            st = R.TensorListStack(input_handle=h, element_shape=es, element_dtype=f32, name="stack")
            out = tf.matmul(st, w, name="m2")
        elif case == "D":
            h1 = tf.identity(R.TensorListFromTensor(tensor=m1, element_shape=es, name="ft1"), name="hid")
            h2 = R.TensorListFromTensor(tensor=x, element_shape=es, name="ft2")
            cat = R.TensorListConcatLists(input_a=tf.reshape(h1, [1]), input_b=tf.expand_dims(h2, 0),
                                          element_dtype=f32, name="concatlists")
            pb = R.TensorListPushBackBatch(input_handles=cat, tensor=tf.reshape(x, [1, 4, 4]),
                                           name="pushbackbatch")
            st = R.TensorListStack(input_handle=tf.unstack(pb, num=1)[0], element_shape=es,
                                   element_dtype=f32, name="stack")
            out = tf.matmul(tf.reshape(st, [-1, 4]), w, name="m2")
        elif case == "E":
            hp = v1.placeholder(tf.variant, [], name="handle_input")
            h = R.TensorListSetItem(input_handle=hp, index=i0, item=tf.matmul(x, w, name="m1"))
            it = R.TensorListGetItem(input_handle=h, index=i0, element_shape=es, element_dtype=f32)
            out = tf.matmul(tf.reshape(it, [1, 4]), w, name="m2")
        elif case == "G":
            h = R.TensorListFromTensor(tensor=tf.exp(x, name="exp"), element_shape=es, name="ft")
            st = R.TensorListStack(input_handle=h, element_shape=es, element_dtype=f32, name="stack")
            tf.identity(tf.matmul(tf.add(st, x, name="add"), w, name="m2"), name="output2")
            it = R.TensorListGetItem(input_handle=h, index=i0, element_shape=es, element_dtype=f32)
            out = tf.matmul(tf.reshape(it, [1, 4]), w, name="m3")
        elif case == "I":
            r = R.TensorListReserve(element_shape=es, num_elements=4, element_dtype=f32, name="reserve")
            h = R.TensorListSetItem(input_handle=r, index=i0, item=tf.reshape(m1, [-1])[:4],
                                    name="setitem")
            h2 = R.TensorListResize(input_handle=h, size=R.TensorListLength(input_handle=h), name="resize")
            out = R.TensorListStack(input_handle=h2, element_shape=es, element_dtype=f32, name="stack")
        tf.identity(out, name="output")
    return g.as_graph_def(), {}


# grappler's own TensorList tests (auto_mixed_precision_test.cc: TensorListPushPop,
# TensorListPushBackBatchAndConcatLists, TensorListThroughFunction), with its node names; a
# placeholder "input" stands for its Const so the graphs run on fed data
_SIDE = 16


def _list_input():
    x = v1.placeholder(tf.float32, [_SIDE, _SIDE], name="input")
    values = np.random.default_rng(3).uniform(0, 0.25, (_SIDE, _SIDE)).astype(np.float32)
    return x, tf.constant([_SIDE, _SIDE], name="shape"), {"input:0": values}


def _empty_list(name, shape):
    return tf.raw_ops.EmptyTensorList(element_shape=shape, max_num_elements=8,
                                      element_dtype=tf.float32, name=name)


def _pop(handle, shape, name):
    return tf.raw_ops.TensorListPopBack(input_handle=handle, element_shape=shape,
                                        element_dtype=tf.float32, name=name)


def tensorlist_push_pop():
    """Lists made by EmptyTensorList, written by PushBack, read by PopBack: tl1 carries MatMuls'
    results (grappler paints it whole, creator included); tl2 carries only the input (float32)."""
    R = tf.raw_ops
    g = tf.Graph()
    with g.as_default():
        x, shape, feeds = _list_input()
        tl1 = _empty_list("tl1", shape)
        tl1w1 = R.TensorListPushBack(input_handle=tl1, tensor=x, name="tl1w1")
        allow1 = tf.matmul(x, x, name="allow1")
        tl1w2 = R.TensorListPushBack(input_handle=tl1w1, tensor=allow1, name="tl1w2")
        infer1 = tf.tanh(_pop(tl1w2, shape, "tl1r1")[1], name="infer1")
        allow2 = tf.matmul(infer1, infer1, name="allow2")
        tl1w3 = R.TensorListPushBack(input_handle=tl1, tensor=allow2, name="tl1w3")
        tf.identity(_pop(tl1w3, shape, "tl1r2")[1], name="output")
        tl2 = _empty_list("tl2", shape)
        tl2w1 = R.TensorListPushBack(input_handle=tl2, tensor=x, name="tl2w1")
        tf.identity(_pop(tl2w1, shape, "tl2r1")[1], name="output2")
    return g.as_graph_def(), feeds


def tensorlist_batch_concat():
    """Two EmptyTensorLists stacked, written at once by PushBackBatch, split, reshaped and joined
    by ConcatLists, then popped: one list to grappler (both creators painted)."""
    R = tf.raw_ops
    g = tf.Graph()
    with g.as_default():
        x, shape, feeds = _list_input()
        tl1, tl2 = _empty_list("tl1", shape), _empty_list("tl2", shape)
        allow1 = tf.matmul(x, x, name="allow1")
        tl12 = tf.stack([tl1, tl2], name="tl1_tl2")
        tl12w1 = R.TensorListPushBackBatch(input_handles=tl12,
                                           tensor=tf.stack([allow1, allow1], name="allow1_allow1"),
                                           name="tl12w1")
        halves = tf.split(tl12w1, 2, axis=0, name="tl12w1_outputs")
        tl3 = R.TensorListConcatLists(input_a=tf.reshape(halves[0], [], name="tl12w1_output0"),
                                      input_b=tf.reshape(halves[1], [], name="tl12w1_output1"),
                                      element_dtype=tf.float32, name="tl3")
        infer1 = tf.tanh(_pop(tl3, shape, "tl3r1")[1], name="infer1")
        tf.identity(tf.matmul(infer1, infer1, name="allow2"), name="output")
    return g.as_graph_def(), feeds


def tensorlist_through_function(call: str = "direct"):
    """tl1's handle passes through a function that pushes and pops inside (a direct call, as in
    grappler's test, or a ``PartitionedCall`` of a ``tf.function``): grappler keeps that list
    float32 and paints tl2, a list of its own."""
    R = tf.raw_ops
    g = tf.Graph()
    with g.as_default():
        def body(handle, x):
            h = R.TensorListPushBack(input_handle=handle, tensor=x, name="tl1w1_handle")
            h, y = _pop(h, tf.constant([_SIDE, _SIDE]), "tl1r1")
            return tf.identity(h, name="ohandle"), tf.identity(y, name="y")

        if call == "direct":
            func1 = v1_function.Defun(tf.variant, tf.float32, func_name="Func1")(body)
        else:
            func1 = tf.function(body, input_signature=[tf.TensorSpec([], tf.variant),
                                                       tf.TensorSpec([_SIDE, _SIDE], tf.float32)])
        x, shape, feeds = _list_input()
        infer1 = tf.tanh(tf.matmul(x, x, name="allow1"), name="infer1")
        tl1w1 = R.TensorListPushBack(input_handle=_empty_list("tl1", shape), tensor=infer1,
                                     name="tl1w1")
        named = {"name": "Func1"} if call == "direct" else {}
        handle = func1(tl1w1, infer1, **named)[0]
        tl1r1 = _pop(handle, shape, "tl1r1")[1]
        tl2w1 = R.TensorListPushBack(input_handle=_empty_list("tl2", shape), tensor=infer1,
                                     name="tl2w1")
        tl2r1 = _pop(tl2w1, shape, "tl2r1")[1]
        tf.identity(tf.matmul(tl1r1, tl2r1, name="allow2"), name="output")
    return g.as_graph_def(), feeds


def tensorlist_loop_gradient(lower: bool = True):
    """A TF2 while loop and its gradient, frozen: the forward loop pushes each step's Tanh into
    an EmptyTensorList accumulator, the gradient loop pops them. ``lower`` gives the v1 control
    flow a frozen graph has by default (one list, in one graph, as grappler sees it at run
    time); else the functional While, whose bodies are library functions."""
    r = np.random.default_rng(5)
    w = r.uniform(-0.3, 0.3, (_SIDE, _SIDE)).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([8, _SIDE], tf.float32, name="input")])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            _, h = tf.while_loop(lambda i, h: i < 3,
                                 lambda i, h: (i + 1, tf.tanh(tf.matmul(h, tf.constant(w)))),
                                 (tf.constant(0), x))
            loss = tf.reduce_sum(h * h)
        return loss, tape.gradient(loss, x)

    frozen = convert_variables_to_constants_v2(step.get_concrete_function(),
                                               lower_control_flow=lower)
    gd = frozen.graph.as_graph_def()
    # the frozen function's results (Identity nodes nothing reads), under the names the
    # parity test fetches
    names = {frozen.outputs[0].op.name: "output", frozen.outputs[1].op.name: "grad_output"}
    for node in gd.node:
        node.name = names.get(node.name, node.name)
    feeds = {"input:0": r.uniform(-1, 1, (8, _SIDE)).astype(np.float32)}
    return gd, feeds


def direct_call():
    """MatMul -> a Defun call (the node's op is the function's name) -> MatMul."""
    g = tf.Graph()
    with g.as_default():
        @v1_function.Defun(tf.float32)
        def half_relu(h):
            return tf.nn.relu(h) * 0.5

        x = v1.placeholder(tf.float32, [4, 4], name="input")
        y = half_relu(tf.matmul(x, _weights4(), name="m1"))
        tf.identity(tf.matmul(y, _weights4(), name="m2"), name="output")
    return g.as_graph_def(), {}


def infer_chain():
    """MatMul -> BiasAdd -> Sigmoid -> AddV2 -> output: infer ops right after an allow op."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 4], name="input")
        h = tf.nn.bias_add(tf.matmul(x, _weights4(), name="m1"), tf.ones([4]), name="bias")
        h = tf.add(tf.sigmoid(h, name="sigmoid"), x, name="add")
        tf.identity(h, name="output")
    return g.as_graph_def(), {}


def lowp_nodes(graph_def, names) -> set[str]:
    """Of ``names``, the nodes that hold a low-precision type attribute in ``graph_def``."""
    out = set()
    for n in graph_def.node:
        if n.name in names and any(v.WhichOneof("value") == "type" and v.type in LOWP
                                   for v in n.attr.values()):
            out.add(n.name)
    return out
