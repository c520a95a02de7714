"""A TF2 train step converts wherever the user saved it: as a signature, or only as a
``tf.function`` method of the module (``loaded.train_step``), the way TensorFlow's SavedModel
guide restores every method (docs/training.md "TF2 train steps in SavedModels").

Six steps, each saved both ways and converted to float16: the example's single-tape step with
Keras' Adam, a hand-written AdamW (tests/hand_optimizers.py), the DCGAN tutorial's two-tape
step (tests/gan_steps.py) and three Mixture-of-Experts blocks routing with ``top_k``
(tests/saved_trainers.py). ``loaded.train_step(...)`` then runs its matrix ops in float16,
counts its finite steps on the one ``amp_loss_scale`` state, and skips a step whose gradients
overflow without changing a bit of any variable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gan_steps
import numpy as np
import pytest
import tensorflow as tf
from hand_optimizers import HandAdamW
from hand_optimizers import save as save_hand
from saved_trainers import ROUTED, all_variables, digits
from tensorflow.core.framework import types_pb2
from tensorflow.python.saved_model import loader_impl

from amp_rewrite import convert_file
from amp_rewrite.core.ops import MATRIX_OPS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_step_savedmodel import Classifier  # noqa: E402

STATE = "amp_loss_scale/"
GAN_WEIGHTS = ("generator_loss_weight", "discriminator_loss_weight")


def _save_classifier(module, path, as_signature):
    signatures = {"serving_default": module.serve}
    if as_signature:
        signatures["train"] = module.train_step
    tf.saved_model.save(module, str(path), signatures=signatures)


#: name -> (build, save(module, path, as_signature), a batch(step), an overflowing batch)
MODELS = {
    "keras_adam": (lambda: Classifier(0, "adam"), _save_classifier),
    "hand_adamw": (lambda: HandAdamW(0), save_hand),
    "gan": (lambda: gan_steps.GAN(0),
            lambda m, path, sig: gan_steps.save(m, path, train_signature=sig)),
    # Mixture-of-Experts blocks routing with top_k, whose gradient (ScatterNd) writes nothing
    **{name: (lambda cls=cls: cls(0), save_hand) for name, cls in ROUTED.items()},
}


def _batches(model: str, steps: int):
    if model == "gan":
        yield from gan_steps.batches(steps, seed=0)
        return
    x, y = digits()
    rng = np.random.default_rng(0)
    for _ in range(steps):
        idx = rng.choice(1400, 64, replace=False)
        yield x[idx], y[idx]


def _overflowing(model: str):
    """A batch finite in float32 whose float16 forward pass (and so every gradient) overflows."""
    a, b = next(_batches(model, 1))
    return (a * np.float32(1e30), b)


def _bits(loaded) -> dict:
    """Every variable of the original model, by object path (not the loss-scale state)."""
    return {k: v.numpy().tobytes() for k, v in all_variables(loaded).items()
            if not k.startswith(STATE) and k not in GAN_WEIGHTS}


def _state(loaded) -> tuple:
    s = loaded.amp_loss_scale
    return float(s.scale.numpy()), int(s.skipped_steps.numpy()), int(s.good_steps.numpy())


@pytest.mark.parametrize("saved_as", ["method", "signature"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_train_step_trains_in_float16_with_loss_scaling_however_it_was_saved(
        model, saved_as, tmp_path):
    build, save = MODELS[model]
    save(build(), tmp_path / "fp32", saved_as == "signature")
    report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    assert not [w for w in report.warnings if "left as it is" in w], report.warnings

    # every trace of the train step the SavedModel restores is scaled and runs in float16
    meta = loader_impl.parse_saved_model(str(tmp_path / "f16")).meta_graphs[0]
    restored = set(meta.object_graph_def.concrete_functions)
    steps = [f for f in meta.graph_def.library.function
             if f.signature.name.startswith("__inference_train_step") and f.signature.name in restored]
    scaled = set(report.to_dict()["loss_scaling"]["functions"])
    assert steps and {f.signature.name for f in steps} <= scaled
    for f in steps:
        assert any(n.op in MATRIX_OPS and n.attr["T"].type == types_pb2.DT_HALF for n in f.node_def)
        # its three state handles are bound to the loaded object's amp_loss_scale variables
        bound = meta.object_graph_def.concrete_functions[f.signature.name].bound_inputs
        assert len(bound) >= 3

    loaded = tf.saved_model.load(str(tmp_path / "f16"))
    start = _bits(loaded)
    for a, b in _batches(model, 3):
        out = loaded.train_step(a, b)
        assert all(np.isfinite(v.numpy()).all() for v in tf.nest.flatten(out))
    assert _state(loaded) == (2.0 ** 15, 0, 3)
    trained = _bits(loaded)
    assert trained != start

    # an overflowing step: skipped whole, no variable of the model changes a bit
    loaded.train_step(*_overflowing(model))
    assert _bits(loaded) == trained
    assert _state(loaded) == (2.0 ** 14, 1, 0)
