"""float16 emulation (``--emulate``): the float16 painting, computed in float32 on values
rounded to float16; its numbers track a real float16 run's, overflow included."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from tensorflow.core.framework import types_pb2

from amp_rewrite import cli, convert_file
from amp_rewrite.core.errors import InputError
from amp_rewrite.tools.verify import verify

from machine import onednn_float16

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"
v1 = tf.compat.v1


def _graph_def(path):
    gd = v1.GraphDef()
    gd.ParseFromString(Path(path).read_bytes())
    return gd


def _run(path, feeds, fetch):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(_graph_def(path), name="")
    with v1.Session(graph=g) as sess:
        return sess.run(fetch, feeds)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emulate")
    real = convert_file(EXAMPLE, folder / "f16.pb", target="float16")
    emulated = convert_file(EXAMPLE, folder / "emu.pb", target="float16", emulate=True)
    images = (load_digits().data[:256] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    np.savez(folder / "in.npz", images=images)
    return folder, real, emulated, images


def test_emulation_computes_in_float32_and_rounds_like_float16(converted):
    folder, real, emulated, images = converted
    assert emulated.to_dict()["emulation"]["ops"] >= 4
    # the same painting: every node the real conversion put in float16 is emulated
    assert emulated.summary()["matrix_converted"] == real.summary()["matrix_converted"] == 4
    gd = _graph_def(folder / "emu.pb")
    compute = [n for n in gd.node if n.op in ("Conv2D", "MatMul")]
    assert compute and all(n.attr["T"].type == types_pb2.DT_FLOAT for n in compute)
    for n in compute:    # each reads values rounded to float16: a Cast from half
        producer = {m.name: m for m in gd.node}[n.input[0].split(":")[0]]
        assert producer.op == "Cast" and producer.attr["SrcT"].type == types_pb2.DT_HALF
    feeds = {"images:0": images}
    fp32 = _run(EXAMPLE, feeds, "probabilities:0")
    half = _run(folder / "f16.pb", feeds, "probabilities:0")
    emu = _run(folder / "emu.pb", feeds, "probabilities:0")
    err = lambda a: np.linalg.norm(a - fp32) / np.linalg.norm(fp32)  # noqa: E731
    # float16's error, at least: a float32 run would be exact
    assert 1e-5 < err(emu) < 1e-2 and 1e-5 < err(half) < 1e-2
    # here 1.525e-4 and 1.524e-4; TensorFlow's float16 CPU kernels may accumulate differently
    # on other CPUs, so the bound leaves room
    assert abs(err(emu) - err(half)) < 0.5 * err(half)
    if not onednn_float16:   # Eigen's kernels: the emulation rounds as they do
        assert np.linalg.norm(emu - half) / np.linalg.norm(fp32) < err(half)


def test_emulation_overflows_where_float16_does(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 64], name="x")
        w = tf.constant(np.full((64, 64), 40.0, np.float32))
        h = tf.matmul(tf.matmul(x, w), w)        # about 64 * 40 * 64 * 40: past 65504
        tf.identity(tf.reduce_max(tf.nn.relu(h), axis=1), name="out")
    (tmp_path / "big.pb").write_bytes(g.as_graph_def().SerializeToString())
    convert_file(tmp_path / "big.pb", tmp_path / "f16.pb", target="float16")
    convert_file(tmp_path / "big.pb", tmp_path / "emu.pb", target="float16", emulate=True)
    feeds = {"x:0": np.ones((4, 64), np.float32)}
    assert np.all(np.isfinite(_run(tmp_path / "big.pb", feeds, "out:0")))
    assert np.all(np.isinf(_run(tmp_path / "f16.pb", feeds, "out:0")))
    assert np.all(np.isinf(_run(tmp_path / "emu.pb", feeds, "out:0")))


def test_verify_emulates_a_float16_file_and_refuses_what_it_cannot(converted, tmp_path, capsys):
    folder, _, _, _ = converted
    data = str(folder / "in.npz")
    real = verify(EXAMPLE, folder / "f16.pb", inputs=data)
    emu = verify(EXAMPLE, folder / "f16.pb", inputs=data, emulate=True)
    assert real.ok and emu.ok and emu.criteria.dtype == "float16"
    assert emu.outputs[0].rel_l2 == pytest.approx(real.outputs[0].rel_l2, rel=0.5)
    assert cli.main(["verify", str(EXAMPLE), str(folder / "f16.pb"), "--inputs", data,
                     "--emulate", "-q"]) == 0
    with pytest.raises(InputError, match="--target float16"):
        convert_file(EXAMPLE, tmp_path / "x.pb", target="bfloat16", emulate=True)
    with pytest.raises(InputError, match="--lowp-io"):
        convert_file(EXAMPLE, tmp_path / "x.pb", target="float16", emulate=True, lowp_io=True)
    capsys.readouterr()
    assert cli.main([str(EXAMPLE), "-o", str(tmp_path / "x.pb"), "--emulate", "--lowp-io"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "x.pb").exists()


@pytest.mark.parametrize("build", ["mlp", "conv_bn", "while_v1", "tensorarray_lstm"])
def test_emulated_graphs_run_and_track_float16(build, tmp_path):
    """v1 loops included (found in review: rounding after Merge/NextIteration made a cycle
    TensorFlow refuses; routing ops now pass their rounded values on)."""
    import graphs
    gd, feeds, fetches = getattr(graphs, build)()
    (tmp_path / "in.pb").write_bytes(gd.SerializeToString())
    convert_file(tmp_path / "in.pb", tmp_path / "f16.pb", target="float16")
    convert_file(tmp_path / "in.pb", tmp_path / "emu.pb", target="float16", emulate=True)
    ref = graphs.run(gd, feeds, fetches)[0]
    half = graphs.run(_graph_def(tmp_path / "f16.pb"), feeds, fetches)[0]
    emu = graphs.run(_graph_def(tmp_path / "emu.pb"), feeds, fetches)[0]
    assert np.all(np.isfinite(emu))
    assert graphs.rel_l2(emu, half) <= max(graphs.rel_l2(half, ref), 1e-6)


@pytest.mark.parametrize("build", ["example", "mlp", "conv_bn", "conv_bias_relu_pool"])
def test_emulation_matches_grapplers_cpu_emulation(build, tmp_path):
    """Side by side with grappler's own float16 emulation (its auto_mixed_precision_cpu pass,
    which runs on any CPU): the same numbers."""
    import graphs
    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    from amp_rewrite.transforms.constfold import grappler_alone
    if build == "example":
        gd = _graph_def(EXAMPLE)
        feeds = {"images:0": (load_digits().data[:256] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)}
        fetches = ["probabilities:0"]
    else:
        gd, feeds, fetches = getattr(graphs, build)()
    meta = meta_graph_pb2.MetaGraphDef(graph_def=gd)
    meta.collection_def["train_op"].node_list.value.extend(f.split(":")[0] for f in fetches)
    theirs = tf_optimizer.OptimizeGraph(grappler_alone("auto_mixed_precision_cpu"), meta)
    assert any(n.op == "Cast" and n.attr["DstT"].type == types_pb2.DT_HALF for n in theirs.node)
    (tmp_path / "in.pb").write_bytes(gd.SerializeToString())
    convert_file(tmp_path / "in.pb", tmp_path / "emu.pb", target="float16", emulate=True)
    ours = graphs.run(_graph_def(tmp_path / "emu.pb"), feeds, fetches)[0]
    ref = graphs.run(theirs, feeds, fetches)[0]
    assert graphs.rel_l2(ours, ref) <= 1e-6
