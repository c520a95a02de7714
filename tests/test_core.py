"""The core converter on small real graphs: converts, imports, runs, and matches FP32."""

import graphs
import pytest
import tensorflow as tf

from amp_rewrite import convert

TOL = {"float16": 5e-3, "bfloat16": 2e-2}
DEVICE = {"float16": "gpu", "bfloat16": "cpu"}
BUILDERS = [graphs.mlp, graphs.conv_bn, graphs.conv_bias_relu_pool, graphs.attention,
            graphs.while_v1, graphs.tensorarray_lstm, graphs.functional_while]


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
def test_converts_runs_and_matches(builder, target):
    gd, feeds, fetches = builder()
    ref = graphs.run(gd, feeds, fetches)
    new, report = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)
    out = graphs.run(new, feeds, fetches)
    for a, b in zip(out, ref):
        assert graphs.rel_l2(a, b) <= TOL[target]
    lowp = tf.dtypes.as_dtype({"float16": tf.float16, "bfloat16": tf.bfloat16}[target]).name
    bodies = [n for f in new.library.function for n in f.node_def]  # functional_while's MatMul
    matrix = [n for n in list(new.node) + bodies
              if n.op in ("MatMul", "Conv2D", "BatchMatMulV2", "Einsum")]
    assert matrix and all(tf.dtypes.as_dtype(n.attr["T"].type).name == lowp for n in matrix)
    s = report.summary()
    assert s["matrix_converted"] == s["matrix_total"]


def test_outputs_and_inputs_keep_float32():
    gd, feeds, fetches = graphs.mlp()
    new, _ = convert(gd)
    assert graphs.dtypes_of(new, name="x")["x"]["dtype"] == "float32"
    assert graphs.dtypes_of(new, name="probs")["probs"]["T"] == "float32"
    out = graphs.run(new, feeds, fetches)[0]
    assert out.shape == (8, 10)


def test_deterministic_and_idempotent():
    gd, _, _ = graphs.conv_bias_relu_pool()
    a, _ = convert(gd)
    b, _ = convert(gd)
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    again, report = convert(a)
    assert again.SerializeToString(deterministic=True) == a.SerializeToString(deterministic=True)
    assert report.summary()["casts_added"] == 0
