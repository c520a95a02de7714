"""Painting rules that need their own small graphs: TensorList clusters, ref variables."""

import graphs
import numpy as np
import tensorflow as tf

from amp_rewrite import convert

v1 = tf.compat.v1
HALF = tf.float16.as_datatype_enum
FLOAT = tf.float32.as_datatype_enum


def _tensorlist_graph(reader_feeds_matmul: bool):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [3, 4, 4], name="x")
        w = tf.constant(np.eye(4, dtype=np.float32))
        src = tf.matmul(tf.reshape(x, [12, 4]), w, name="producer")
        handle = tf.raw_ops.TensorListFromTensor(tensor=tf.reshape(src, [3, 4, 4]),
                                                 element_shape=tf.constant([4, 4]), name="list")
        item = tf.raw_ops.TensorListGetItem(input_handle=handle, index=1, element_shape=[4, 4],
                                            element_dtype=tf.float32, name="item")
        if reader_feeds_matmul:
            out = tf.matmul(item, w, name="reader")
        else:
            out = tf.reduce_sum(tf.exp(item), name="reader")
        tf.identity(out, name="out")
    feeds = {"x:0": np.random.default_rng(0).normal(size=(3, 4, 4)).astype(np.float32)}
    return g.as_graph_def(), feeds


def test_tensorlist_writer_and_reader_share_the_element_dtype():
    gd, feeds = _tensorlist_graph(reader_feeds_matmul=True)
    new, report = convert(gd)
    nodes = {n.name: n for n in new.node}
    assert nodes["list"].attr["element_dtype"].type == HALF
    assert nodes["item"].attr["element_dtype"].type == HALF
    np.testing.assert_allclose(graphs.run(new, feeds, ["out:0"])[0],
                               graphs.run(gd, feeds, ["out:0"])[0], rtol=1e-2, atol=1e-2)


def test_tensorlist_follows_its_member_that_must_stay_float32():
    gd, feeds = _tensorlist_graph(reader_feeds_matmul=False)
    new, report = convert(gd, keep=["item"])   # the reader is pinned to float32
    nodes = {n.name: n for n in new.node}
    assert nodes["item"].attr["element_dtype"].type == FLOAT
    assert nodes["list"].attr["element_dtype"].type == FLOAT   # so the writer follows it
    assert report.node("list").code == "tensorlist_float32"
    assert nodes["producer"].attr["T"].type == HALF
    np.testing.assert_allclose(graphs.run(new, feeds, ["out:0"])[0],
                               graphs.run(gd, feeds, ["out:0"])[0], rtol=1e-2)


def test_ref_variable_reads_are_not_painted():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 4], name="x")
        var = tf.Variable(np.ones((4, 4), np.float32), name="var")  # resource in TF2 graphs
        ref = v1.Variable(np.ones((4, 4), np.float32), name="refvar", use_resource=False)
        read = tf.identity(ref, name="ref_read")
        tf.identity(tf.matmul(tf.matmul(x, var), read), name="out")
        init = v1.global_variables_initializer()
    new, report = convert(g.as_graph_def())
    nodes = {n.name: n for n in new.node}
    direct_reads = [n for n in new.node if list(n.input) == ["refvar"] and n.op == "Identity"]
    assert nodes["refvar"].attr["dtype"].type == FLOAT
    assert direct_reads and all(n.attr["T"].type == FLOAT for n in direct_reads)
    assert nodes["ref_read"].attr["T"].type == HALF   # past the ref read, painting goes on
    assert report.node("refvar").code == "variable"
    g2 = tf.Graph()
    with g2.as_default():
        tf.graph_util.import_graph_def(new, name="")
    with v1.Session(graph=g2) as sess:
        sess.run(init.name)
        out = sess.run("out:0", {"x:0": np.ones((2, 4), np.float32)})
    np.testing.assert_allclose(out, np.full((2, 4), 16.0))
