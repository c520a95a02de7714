"""verify --per-node on SavedModels: the tensors inside the signature's function bodies (the
LSTM's While body included, one value per iteration), named function/node as the conversion
report names nodes, ranked so that a float16 overflow planted in a body comes first."""

import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

from amp_rewrite import cli, convert_file
from amp_rewrite.tools.runner import open_model
from amp_rewrite.tools.verify import verify


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An LSTM over the 8 rows of a digit, then ``log1p((1000 h)^2)`` (a Lambda layer named
    energy: its Square passes float16's 65504) and a Dense head; exported with model.export,
    converted to float16 as it is and with the Square forced to float16."""
    folder = tmp_path_factory.mktemp("exported")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8), name="digits")
    h = keras.layers.LSTM(16)(inp)
    h = keras.layers.Lambda(lambda t: tf.math.log1p(tf.square(1000.0 * t)), name="energy")(h)
    keras.Model(inp, keras.layers.Dense(10)(h)).export(str(folder / "fp32"), verbose=False)
    np.savez(folder / "digits.npz", digits=(load_digits().images[:32] / 16.0).astype(np.float32))
    (folder / "force.toml").write_text('[[override]]\nglob = "*energy*/Square"\naction = "force_lowp"\n')
    good = convert_file(folder / "fp32", folder / "f16", target="float16")
    forced = convert_file(folder / "fp32", folder / "f16_forced", target="float16",
                          rules=[str(folder / "force.toml")])
    return folder, good.to_dict(), forced.to_dict()


def test_per_node_reads_function_bodies_named_as_the_report(exported):
    folder, report, _ = exported
    result = verify(folder / "fp32", folder / "f16", inputs=str(folder / "digits.npz"), nodes=True)
    assert result.ok and result.nodes_compared > 30
    names = {n["name"] for n in report["nodes"]}
    # every compared tensor but a function's arguments is an output of a node the report lists
    args = [n for n in result.nodes if n.op == "_Arg"]
    assert args and all(n.tensor.rsplit(":", 1)[0] in names for n in result.nodes if n.op != "_Arg")
    functions = {n.tensor.split("/", 1)[0] for n in result.nodes}
    body = next(f for f in functions if re.search(r"while_body", f))
    assert set(report["functions"]) >= functions
    in_body = {n.op: n for n in result.nodes if n.tensor.startswith(body + "/")}
    assert in_body["MatMul"].dtype == "float16" and 0 < in_body["MatMul"].rel_l2 < 1e-2
    ranked = [n.added for n in result.nodes]
    assert ranked == sorted(ranked, reverse=True)


def test_while_body_tensors_hold_one_value_per_iteration(exported):
    folder, _, _ = exported
    feed = {"digits": np.load(folder / "digits.npz")["digits"]}
    with open_model(folder / "f16") as runner:
        trace = runner.trace(feed)
        signature = runner.callable()(feed)[0]
    body = {name: values for name, values in trace.values.items() if "while_body" in name.split("/")[0]}
    matmuls = [values for name, values in body.items() if trace.info[name].op == "MatMul"]
    assert matmuls and all(len(v) == 8 for v in matmuls)            # 8 rows, 8 iterations
    assert all(v.shape == (32, 64) and v.dtype == np.float16 for v in matmuls[0])
    # the body-by-body replay reproduces what the signature computes
    dense = [v for name, v in trace.values.items()
             if trace.info[name].op == "BiasAdd" and v[0].shape == (32, 10)]
    assert len(dense) == 1 and np.allclose(dense[0][0].astype(np.float32), signature, atol=1e-3)


def test_planted_float16_overflow_in_a_function_body_comes_first(exported):
    folder, _, forced = exported
    result = verify(folder / "fp32", folder / "f16_forced", inputs=str(folder / "digits.npz"),
                    nodes=True)
    (out,) = result.outputs
    assert not result.ok and out.failed == ["finite", "rel_l2", "top1"] and math.isinf(out.rel_l2)
    first = result.nodes[0]
    square = next(n["name"] for n in forced["nodes"] if re.search(r"/energy[^/]*/Square$", n["name"]))
    assert (first.tensor, first.op, first.dtype) == (square + ":0", "Square", "float16")
    assert math.isinf(first.added)
    assert [n.tensor for n in result.nodes if math.isinf(n.added)] == [first.tensor]
    assert cli.main(["verify", str(folder / "fp32"), str(folder / "f16_forced"), "--inputs",
                     str(folder / "digits.npz"), "--per-node", "-q"]) == 1


def test_per_node_replays_a_callee_that_writes_a_variable_from_the_state_it_saw(tmp_path):
    """Replaying a body runs it a second time: a variable write in a nested tf.function runs
    again, on the value the variable held when the call ran (the read after the write sees
    1, not 2), and every call of the signature starts from the value saved."""
    class Counter(tf.Module):
        def __init__(self):
            self.count = tf.Variable(0.0)

        @tf.function
        def bump(self, x):
            self.count.assign_add(1.0)
            return x * self.count

        @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
        def serve(self, x):
            return {"y": self.bump(x) + self.count}

    module = Counter()
    tf.saved_model.save(module, str(tmp_path / "counter"), signatures={"serving_default": module.serve})
    feed = {"x": np.ones(2, np.float32)}
    with open_model(tmp_path / "counter") as runner:
        call = runner.callable()
        assert np.array_equal(call(feed)[0], [2.0, 2.0])
        trace = runner.trace(feed)        # which checks that the replay gives [2, 2] too
        assert np.array_equal(call(feed)[0], [2.0, 2.0])
    (product,) = [name for name, info in trace.info.items()
                  if info.op == "Mul" and name.startswith("__inference_bump")]
    assert np.array_equal(trace.values[product][0], [1.0, 1.0])
