"""A train step that routes each token to its experts (a Mixture-of-Experts block: top-2 gating
with ``tf.math.top_k``) trains in float16 with loss scaling like FP32 (issue 44).

``top_k``'s gradient is a ``ScatterNd``, a stateless op. Counted as a variable write by its name,
it made a one-tape step read as one that "applies gradients before the gradients of another
tape are computed", and the step was refused. Which ops write a variable is now read off their
OpDefs (:func:`amp_rewrite.schema.opdefs.is_variable_write`); here that answer is held to the
whole op registry, and three MoE blocks (tests/saved_trainers.py: experts gathered by index,
dispatched with ``unsorted_segment_sum``, dense einsum dispatch) train on the digits, saved as a
signature and as a method. That each runs its matrix ops in float16 and skips an overflowing
step without changing a bit is tests/test_saved_methods.py's, which trains them too.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from saved_trainers import ROUTED, compare

from amp_rewrite import convert_file
from amp_rewrite.schema.opdefs import all_op_names, is_variable_write

#: the families TensorFlow names its variable writes by: the test's oracle, written out
_WRITE_PREFIXES = ("Assign", "Apply", "SparseApply", "ResourceApply", "ResourceSparseApply",
                   "ResourceScatter")
_REF_SCATTERS = ({f"Scatter{k}" for k in ("Add", "Sub", "Mul", "Div", "Min", "Max", "Update")}
                 | {f"ScatterNd{k}" for k in ("Add", "Sub", "Min", "Max", "Update")})


def _named_like_a_write(op: str) -> bool:
    return (op.startswith(_WRITE_PREFIXES) or op in _REF_SCATTERS
            or op in ("StridedSliceAssign", "ResourceStridedSliceAssign"))


@pytest.mark.parametrize("op", [
    "Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "ApplyGradientDescent", "ApplyAdam", "SparseApplyMomentum",
    "ResourceApplyGradientDescent", "ResourceApplyAdam", "ResourceApplyKerasMomentum",
    "ResourceSparseApplyAdagrad", "ResourceSparseApplyMomentum", "ScatterUpdate", "ScatterAdd",
    "ScatterNdUpdate", "ScatterNdAdd", "ResourceScatterAdd", "ResourceScatterUpdate",
    "ResourceScatterNdUpdate", "StridedSliceAssign", "ResourceStridedSliceAssign"])
def test_ops_that_write_a_variable(op):
    assert is_variable_write(op)


@pytest.mark.parametrize("op", [
    # stateless: they compute a new tensor, whatever their names say
    "ScatterNd", "ScatterNdNonAliasingAdd", "TensorScatterUpdate", "TensorScatterAdd",
    "TensorScatterSub", "TensorScatterMax", "TensorScatterMin",
    # reads, creators and ref plumbing
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarHandleOp", "VariableV2",
    "VarIsInitializedOp", "IsVariableInitialized", "RefIdentity", "RefSwitch", "RefEnter",
    "DestroyResourceOp",
    # state that is no variable: tables, summaries, TensorArrays, stacks, queues, random states
    "LookupTableInsertV2", "InitializeTableV2", "WriteScalarSummary", "TensorArrayWriteV3",
    "StackPushV2", "QueueEnqueueV2", "RngReadAndSkip", "StatefulUniform",
    # no OpDef: a custom op, a direct call of a library function
    "MatMul", "MyCustomApplyAdam", "__inference_train_step_89"])
def test_ops_that_write_no_variable(op):
    assert not is_variable_write(op)


def test_the_writes_are_read_off_the_opdefs_of_the_whole_registry():
    """Every op TensorFlow registers, held to the families its variable writes are named by:
    the OpDef's answer agrees with them everywhere (a new op of this TensorFlow shows up
    here). The name prefixes used before counted exactly two stateless ops besides."""
    ops = all_op_names()
    writes = {op for op in ops if is_variable_write(op)}
    assert writes == {op for op in ops if _named_like_a_write(op)}
    assert len(writes) >= 88
    by_prefix = {op for op in ops if op.startswith(_WRITE_PREFIXES + ("Scatter",))
                 or op in ("StridedSliceAssign", "ResourceStridedSliceAssign")}
    assert by_prefix - writes == {"ScatterNd", "ScatterNdNonAliasingAdd"}
    assert writes - by_prefix == set()


@pytest.mark.parametrize("saved_as", ["signature", "method"])
@pytest.mark.parametrize("model", sorted(ROUTED))
def test_a_routed_step_trains_in_float16_like_fp32(model, saved_as, tmp_path, capsys):
    """300 Adam steps of the FP32 SavedModel and of its float16 conversion on the same digits
    batches: the held-out accuracy within 3 points of FP32's, the train step's matrix ops in
    float16 (the weights end up elsewhere than FP32's: float16 ran), every step since the
    scale's last change counted as finite (the loss scale ran)."""
    run = compare(model, 0, folder=tmp_path, as_signature=saved_as == "signature")
    line = (f"{model} as a {saved_as}: FP32 {run.fp32:.3f}, float16 {run.float16:.3f}, "
            f"{run.float16_matrix_ops} float16 matrix ops, scale {run.scale_history}, "
            f"{run.skipped} skipped")
    with capsys.disabled():
        print("\n" + line)
    assert run.float16_matrix_ops >= 3, line
    assert run.weight_difference > 0, line
    assert run.good_steps == run.steps - run.scale_history[-1][0] > 0, line
    assert run.fp32 > 0.85 and run.float16 >= run.fp32 - 0.03, line


class ScatterServing(tf.Module):
    """A serving function that builds its output with ``tf.scatter_nd`` (stateless)."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).normal(0, 0.1, (8, 4)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def serve(self, x):
        y = tf.matmul(x, self.w)
        rows = tf.shape(y)[0]
        placed = tf.scatter_nd([[1], [3], [0], [2]], tf.transpose(y), tf.stack([6, rows]))
        return {"y": tf.transpose(placed)}


def test_a_serving_signature_with_scatter_nd_freezes(tmp_path):
    """``--freeze`` refuses a signature that writes a variable (its weights change as it runs);
    a ``ScatterNd`` writes none, and the signature freezes and serves what it served."""
    module = ScatterServing()
    tf.saved_model.save(module, str(tmp_path / "fp32"), signatures={"serving_default": module.serve})
    convert_file(tmp_path / "fp32", tmp_path / "frozen", target="float16", freeze=True)
    x = np.random.default_rng(1).normal(0, 1, (5, 8)).astype(np.float32)
    theirs = module.serve(tf.constant(x))["y"].numpy()
    ours = tf.saved_model.load(str(tmp_path / "frozen")).signatures["serving_default"](
        tf.constant(x))["y"].numpy()
    assert ours.shape == (5, 6) and np.allclose(ours, theirs, atol=2e-2)
    assert np.all(ours[:, 4:] == 0)
