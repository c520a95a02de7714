"""Formats: binary/text GraphDef and MetaGraphDef, detected from content, round-tripped."""

import graphs
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import meta_graph_pb2

from amp_rewrite import convert_file
from amp_rewrite.io.load import load

v1 = tf.compat.v1


def _write_text(path, proto):
    path.write_text(text_format.MessageToString(proto))


def test_pbtxt_in_pbtxt_out(tmp_path):
    gd, feeds, fetches = graphs.mlp()
    src = tmp_path / "mlp.pbtxt"
    _write_text(src, gd)
    convert_file(src, tmp_path / "out.pbtxt")
    out = load(tmp_path / "out.pbtxt")
    assert out.kind == "graphdef" and out.text
    assert graphs.rel_l2(graphs.run(out.graph_def, feeds, fetches)[0],
                         graphs.run(gd, feeds, fetches)[0]) < 5e-3


def test_format_comes_from_content_not_extension(tmp_path):
    gd, feeds, fetches = graphs.mlp()
    text_named_pb = tmp_path / "really_text.pb"
    _write_text(text_named_pb, gd)
    binary_named_txt = tmp_path / "really_binary.pbtxt"
    binary_named_txt.write_bytes(gd.SerializeToString())
    assert load(text_named_pb).text and load(text_named_pb).kind == "graphdef"
    assert not load(binary_named_txt).text
    # the output's extension picks the encoding: .pb is binary even for a text input
    convert_file(text_named_pb, tmp_path / "out.pb")
    assert not load(tmp_path / "out.pb").text
    # an unknown extension keeps the input's encoding
    convert_file(text_named_pb, tmp_path / "out.graph")
    assert load(tmp_path / "out.graph").text


def test_untouched_parts_survive(tmp_path):
    gd, _, _ = graphs.mlp()
    gd.node[0].device = "/device:CPU:0"
    gd.node[0].attr["_keep_me"].s = b"yes"
    gd.versions.producer = 1234
    src = tmp_path / "in.pb"
    src.write_bytes(gd.SerializeToString())
    convert_file(src, tmp_path / "out.pb")
    out = load(tmp_path / "out.pb").graph_def
    node = next(n for n in out.node if n.name == gd.node[0].name)
    assert node.device == "/device:CPU:0" and node.attr["_keep_me"].s == b"yes"
    assert out.versions.producer == 1234


def _training_meta(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        w = v1.get_variable("w", initializer=np.full((16, 8), 0.1, np.float32), use_resource=True)
        logits = tf.matmul(x, w, name="logits")
        loss = tf.reduce_mean(tf.square(logits), name="loss")
        train = v1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
        v1.add_to_collection("my_collection", logits)
        v1.train.Saver()
        sig = v1.saved_model.signature_def_utils.predict_signature_def({"x": x}, {"logits": logits})
        meta = v1.train.export_meta_graph(graph=g)
        meta.signature_def["serving"].CopyFrom(sig)
    path = tmp_path / "train.meta"
    path.write_bytes(meta.SerializeToString())
    return path, meta


def test_metagraph_keeps_collections_saver_and_signatures(tmp_path):
    src, meta = _training_meta(tmp_path)
    convert_file(src, tmp_path / "out.meta")
    out = meta_graph_pb2.MetaGraphDef()
    out.ParseFromString((tmp_path / "out.meta").read_bytes())
    assert set(out.collection_def) == set(meta.collection_def)
    assert out.saver_def == meta.saver_def
    assert out.signature_def["serving"] == meta.signature_def["serving"]
    nodes = {n.name: n for n in out.graph_def.node}
    # the signature's output keeps float32 although it is a MatMul (the interface is FP32)
    assert nodes["logits"].attr["T"].type == tf.float32.as_datatype_enum
    # and the converted MetaGraph imports, initializes and trains
    g = tf.Graph()
    with g.as_default():
        saver = v1.train.import_meta_graph(str(tmp_path / "out.meta"))
        assert saver is not None
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            x = np.ones((4, 16), np.float32)
            before = sess.run("loss:0", {"x:0": x})
            for _ in range(3):
                sess.run("train", {"x:0": x})
            assert sess.run("loss:0", {"x:0": x}) < before


@pytest.mark.parametrize("suffix", [".pbtxt", ".meta"])
def test_text_metagraph_and_wrapping(tmp_path, suffix):
    src, meta = _training_meta(tmp_path)
    text_src = tmp_path / "train.pbtxt"
    _write_text(text_src, meta)
    model = load(text_src)
    assert model.kind == "metagraph" and model.text
    convert_file(text_src, tmp_path / f"out{suffix}")
    assert load(tmp_path / f"out{suffix}").kind == "metagraph"
