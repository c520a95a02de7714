"""Cast placement: shared casts, device placement, retargeted casts, no chains, Consts in place."""

import graphs
import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import convert

v1 = tf.compat.v1
HALF = tf.float16.as_datatype_enum
FLOAT = tf.float32.as_datatype_enum


def _casts(graph_def):
    return [n for n in graph_def.node if n.op == "Cast"]


def _consumers(graph_def, name):
    return [n for n in graph_def.node if any(i.split(":")[0] == name for i in n.input)]


def test_one_cast_per_tensor_and_dtype_shared_by_consumers():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.constant(np.eye(8, dtype=np.float32))
        with tf.device("/device:GPU:0"):
            a = tf.matmul(x, w, name="a")
            b = tf.matmul(x, w, name="b")
            total = tf.add(a, b, name="total")
        tf.identity(total, name="out")
    new, report = convert(g.as_graph_def())
    x_casts = [c for c in _casts(new) if c.input[0] == "x"]
    assert len(x_casts) == 1 and x_casts[0].attr["DstT"].type == HALF
    assert {n.name for n in _consumers(new, x_casts[0].name)} == {"a", "b"}
    # the weight is stored in float16 instead of being cast at run time
    assert report.summary()["consts_converted"] == 1
    # a cast sits on its source's device: the one back to float32 after the GPU ops
    out_cast = [c for c in _casts(new) if c.attr["DstT"].type == FLOAT]
    assert out_cast and all(c.device == "/device:GPU:0" for c in out_cast)


def test_existing_cast_is_retargeted_not_stacked():
    g = tf.Graph()
    with g.as_default():
        ids = v1.placeholder(tf.int32, [4, 8], name="ids")
        x = tf.cast(ids, tf.float32, name="to_float")
        tf.identity(tf.matmul(x, tf.ones([8, 8])), name="out")
    new, report = convert(g.as_graph_def())
    to_float = next(n for n in new.node if n.name == "to_float")
    assert to_float.attr["DstT"].type == HALF
    assert [n.name for n in _consumers(new, "to_float")] and len(_casts(new)) == 2  # + output cast
    assert report.node("to_float").code == "cast_retargeted"
    ids_feed = {"ids:0": np.arange(32, dtype=np.int32).reshape(4, 8) % 5}
    np.testing.assert_allclose(graphs.run(new, ids_feed, ["out:0"])[0],
                               graphs.run(g.as_graph_def(), ids_feed, ["out:0"])[0], rtol=1e-3)


def test_no_half_float_half_chain():
    g = tf.Graph()
    with g.as_default():
        h = v1.placeholder(tf.float16, [4, 8], name="h")
        x = tf.cast(h, tf.float32, name="widen")
        tf.identity(tf.matmul(x, tf.ones([8, 8])), name="out")
    new, report = convert(g.as_graph_def())
    matmul = next(n for n in new.node if n.op == "MatMul")
    assert matmul.input[0] == "h"  # reads the half tensor directly
    assert "widen" not in {n.name for n in new.node}
    assert report.casts_removed == ["widen"]
    widen_chain = [c for c in _casts(new) if c.attr["SrcT"].type == HALF and
                   any(d.op == "Cast" and d.attr["DstT"].type == HALF for d in _consumers(new, c.name))]
    assert not widen_chain


def test_const_beyond_float16_range_stays_float32_with_a_warning():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 2], name="x")
        big = tf.constant([[1e5, 0.0], [0.0, 1.0]], name="big")
        tf.identity(tf.matmul(x, big), name="out")
    new, report = convert(g.as_graph_def())
    big_node = next(n for n in new.node if n.name == "big")
    assert big_node.attr["dtype"].type == FLOAT
    assert report.node("big").code == "const_overflow"
    assert any("big" in w and "65504" in w for w in report.warnings)
    # bfloat16 has float32's range: the same Const converts there
    new_bf, report_bf = convert(g.as_graph_def(), target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert report_bf.node("big").code == "const_converted"


def test_const_shared_by_float32_and_lowp_consumers_is_cast_once():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 2], name="x")
        c = tf.constant([[1.0, 2.0], [3.0, 4.0]], name="c")
        tf.identity(tf.matmul(x, c), name="lowp_use")
        tf.identity(tf.exp(c), name="fp32_use")
    new, report = convert(g.as_graph_def())
    assert next(n for n in new.node if n.name == "c").attr["dtype"].type == FLOAT
    c_casts = [n for n in _casts(new) if n.input[0] == "c"]
    assert len(c_casts) == 1 and c_casts[0].attr["DstT"].type == HALF


@pytest.mark.parametrize("shape", [(), (1,), (2,), (3, 4), (0,), (2, 0)])
@pytest.mark.parametrize("target", [tf.float16, tf.bfloat16])
def test_a_const_is_stored_as_tensorflow_stores_the_cast_values(shape, target):
    """Whatever way a Const's values are held (one value listed, packed bytes, none), the
    converted Const is the TensorProto TensorFlow writes for those values cast to the target,
    and holds exactly what TensorFlow's Cast computes (NaN, inf and rounding included)."""
    from tensorflow.core.framework import node_def_pb2
    from tensorflow.python.framework import tensor_util

    from amp_rewrite.core.ir import Node
    from amp_rewrite.schema import consts

    rng = np.random.default_rng(len(shape))
    values = (rng.standard_normal(shape) * 1e3).astype(np.float32)
    values.flat[:3] = [np.nan, np.inf, 70000.0][:values.size]
    proto = node_def_pb2.NodeDef(name="c", op="Const")
    proto.attr["dtype"].type = FLOAT
    proto.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(values))
    node = Node(proto)
    consts.convert(node, target.as_datatype_enum)
    cast = tf.cast(values, target).numpy()
    assert node.attr["value"].tensor == tensor_util.make_tensor_proto(cast, dtype=target, shape=shape)
    assert node.attr["dtype"].type == target.as_datatype_enum
    stored = tensor_util.MakeNdarray(node.attr["value"].tensor)
    assert stored.dtype == cast.dtype and stored.tobytes() == cast.tobytes()
