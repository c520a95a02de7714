"""A Transformer train-step SavedModel as Keras users write one (tests/saved_trainers.py
``Transformer``: Embedding, causal + padding-masked MultiHeadAttention, LayerNormalization, GELU
feed-forward, Adam), converted to bfloat16 and to float16, trains in TensorFlow as the FP32
SavedModel does."""

import numpy as np
import pytest
import saved_trainers as st
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.saved_model import loader_impl

from amp_rewrite import convert_file
from amp_rewrite.core.ops import MATRIX_OPS

SIZE = {"layers": 2, "width": 64, "heads": 4, "seq": 16, "vocab": 64}
STEPS = 8
LOWP = {"bfloat16": types_pb2.DT_BFLOAT16, "float16": types_pb2.DT_HALF}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformer")
    st.save_transformer(st.Transformer(0, lr=3e-3, **SIZE), folder / "fp32")
    batches = st.token_batches(8, SIZE["seq"], SIZE["vocab"], STEPS)
    return folder, batches, _train(folder / "fp32", batches)


def _train(path, batches) -> list[float]:
    step = tf.saved_model.load(str(path)).signatures["train"]
    return [float(step(tokens=tf.constant(b))["loss"]) for b in batches]


def _lowp_matrix_ops(path, dtype) -> dict[str, int]:
    """Matrix ops of the train step's function bodies in ``dtype``, by op."""
    meta = loader_impl.parse_saved_model(str(path)).meta_graphs[0]
    counts: dict[str, int] = {}
    for f in meta.graph_def.library.function:
        for n in f.node_def:
            if n.op in MATRIX_OPS and n.attr["T"].type == dtype:
                counts[n.op] = counts.get(n.op, 0) + 1
    return counts


@pytest.mark.parametrize("target", ["bfloat16", "float16"])
def test_the_converted_transformer_trains_like_fp32(saved, target):
    folder, batches, reference = saved
    out = folder / target
    # every island painted whatever the cost model weighs (the numbers are what is tested here)
    report = convert_file(folder / "fp32", out, target=target, device="cpu" if target == "bfloat16"
                          else "gpu", min_matrix_intensity=0, force=True)
    lowp = _lowp_matrix_ops(out, LOWP[target])
    # attention's Einsums and the Dense/EinsumDense products, forward and backward
    assert lowp.get("Einsum", 0) >= 8 and lowp.get("MatMul", 0) >= 10, lowp
    # float16 trains under dynamic loss scaling; bfloat16 needs none
    assert ("loss_scaling" in report.to_dict()) == (target == "float16")
    if target == "float16":
        assert report.to_dict()["loss_scaling"]["mode"] == "dynamic"
    losses = _train(out, batches)
    assert all(np.isfinite(losses)), losses
    assert reference[-1] < 0.9 * reference[0]   # the FP32 run learns ...
    # ... and the 16-bit one follows its curve step by step
    assert np.max(np.abs(np.array(losses) - reference) / np.array(reference)) <= 0.01, (losses, reference)
