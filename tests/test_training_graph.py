"""A tf.compat.v1 training graph (tf.gradients + GradientDescent) converts, runs and trains."""

import graphs
import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import convert

DEVICE = {"float16": "gpu", "bfloat16": "cpu"}


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_training_graph_trains_like_fp32(target):
    gd, feeds, fetches = graphs.training_mlp()
    ref = graphs.train_losses(gd, feeds, fetches, 20)
    converted, report = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)
    got = graphs.train_losses(converted, feeds, fetches, 20)
    assert np.all(np.isfinite(got))
    assert got[-1] < 0.7 * got[0]                      # it learns
    np.testing.assert_allclose(got, ref, rtol=5e-2)    # and follows the FP32 run
    lowp = {"float16": tf.float16, "bfloat16": tf.bfloat16}[target].as_datatype_enum
    by_name = {n.name: n for n in converted.node}
    # forward and gradient MatMuls run in low precision ...
    matmuls = [n for n in converted.node if n.op == "MatMul"]
    assert len(matmuls) >= 5 and all(n.attr["T"].type == lowp for n in matmuls)
    # ... while the weights, their reads and their updates stay float32 (master weights)
    updates = [n for n in converted.node if n.op == "ResourceApplyGradientDescent"]
    assert len(updates) == len([n for n in converted.node if n.op == "VarHandleOp"]) >= 2
    for n in converted.node:
        if n.op in ("VarHandleOp", "ReadVariableOp", "ResourceApplyGradientDescent"):
            key = "dtype" if "dtype" in n.attr else "T"
            assert n.attr[key].type == tf.float32.as_datatype_enum, n.name
    # the gradient reaching each update is float32: a cast from the low-precision MatMul
    for n in updates:
        src = by_name[n.input[2].split(":")[0]]
        assert src.op == "Cast" and src.attr["DstT"].type == tf.float32.as_datatype_enum
