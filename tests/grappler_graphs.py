"""The graphs of TensorFlow's own AMP tests (tensorflow/python/grappler/auto_mixed_precision_test.py),
rebuilt with the public API, and a runner for grappler's pass in its oneDNN bfloat16 mode."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.grappler import tf_optimizer

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
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        for name in fetch_nodes:
            g.add_to_collection("train_op", g.get_operation_by_name(name))
        meta = v1.train.export_meta_graph(graph=g)
    config = config_pb2.ConfigProto()
    rw = config.graph_options.rewrite_options
    rw.auto_mixed_precision_onednn_bfloat16 = rewriter_config_pb2.RewriterConfig.ON
    rw.min_graph_nodes = -1
    rw.disable_model_pruning = True  # keep Identity nodes so both sides name the same nodes
    off = rewriter_config_pb2.RewriterConfig.OFF
    for opt in ("constant_folding", "layout_optimizer", "arithmetic_optimization", "remapping",
                "dependency_optimization", "loop_optimization", "function_optimization",
                "shape_optimization", "memory_optimization", "debug_stripper",
                "pin_to_host_optimization", "implementation_selector",
                "common_subgraph_elimination"):
        setattr(rw, opt, off)
    return tf_optimizer.OptimizeGraph(config, meta)


def lowp_nodes(graph_def, names) -> set[str]:
    """Of ``names``, the nodes that hold a low-precision type attribute in ``graph_def``."""
    out = set()
    for n in graph_def.node:
        if n.name in names and any(v.WhichOneof("value") == "type" and v.type in LOWP
                                   for v in n.attr.values()):
            out.add(n.name)
    return out
