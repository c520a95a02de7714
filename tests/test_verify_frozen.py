"""verify, bench and kernels on the commonest TF2 frozen graph: a Keras RNN in a tf.function,
frozen with convert_variables_to_constants_v2, which leaves ``unused_control_flow_input*``
placeholders that nothing reads (of variant and unknown-rank types)."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

from amp_rewrite import cli, convert_file
from amp_rewrite.tools.runner import open_model
from amp_rewrite.tools.verify import verify


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frozen")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8))
    h = keras.layers.LSTM(32, return_sequences=True)(inp)
    h = keras.layers.GRU(32)(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    fn = tf.function(lambda x: model(x)).get_concrete_function(
        tf.TensorSpec([None, 8, 8], tf.float32, name="x"))
    graph_def = convert_variables_to_constants_v2(fn).graph.as_graph_def()
    tf.io.write_graph(graph_def, str(folder), "rnn.pb", as_text=False)
    convert_file(folder / "rnn.pb", folder / "rnn16.pb", target="float16")
    digits = (load_digits().images[:64] / 16.0).astype(np.float32)   # 8 rows of 8 pixels each
    np.savez(folder / "digits.npz", x=digits)
    return folder, graph_def


def test_unread_placeholders_are_no_inputs(frozen):
    folder, graph_def = frozen
    unused = [n.name for n in graph_def.node if n.op == "Placeholder" and n.name != "x"]
    assert len(unused) > 10 and all(n.startswith("unused_control_flow_input") for n in unused)
    for path in (folder / "rnn.pb", folder / "rnn16.pb"):
        with open_model(path) as runner:
            assert [(s.name, s.shape) for s in runner.inputs] == [("x", (None, 8, 8))]


def test_verify_bench_and_kernels_run_on_it(frozen, tmp_path):
    folder, _ = frozen
    orig, conv = folder / "rnn.pb", folder / "rnn16.pb"
    result = verify(orig, conv, inputs=str(folder / "digits.npz"), nodes=True)
    assert result.ok and result.criteria.dtype == "float16"
    (out,) = result.outputs
    assert out.name == "Identity:0" and 0 < out.rel_l2 < 1e-2 and (out.rows, out.top1) == (64, 1.0)
    matrix = [n for n in result.nodes if n.op == "MatMul" and n.dtype == "float16"]
    assert matrix and result.nodes_compared > 10
    # random data: only x needs a shape
    assert cli.main(["verify", str(orig), str(conv), "--shape", "x=16,8,8", "-q"]) == 0
    assert cli.main(["bench", str(orig), str(conv), "--shape", "x=16,8,8", "--runs", "2",
                     "--warmup", "1", "--json", str(tmp_path / "bench.json"), "-q"]) == 0
    timings = json.loads((tmp_path / "bench.json").read_text())
    assert timings["batch"] == 16 and timings["speedup"] > 0
    assert cli.main(["kernels", str(conv), "--device", "cpu", "--shape", "x=16,8,8",
                     "--json", str(tmp_path / "kernels.json"), "-q"]) == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    # the Dense layer's 10 classes keep its float16 MatMul off Tensor Cores
    assert [m["not_multiple_of_8"] for m in report["misaligned"] if m["op"] == "MatMul"] == [{"N": 10}]
