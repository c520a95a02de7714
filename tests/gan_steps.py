"""A GAN train step as TensorFlow's DCGAN tutorial writes it, on the 8x8 digits: the model of
tests/test_two_tape_steps.py and benchmarks/gan_training.py.

:class:`GAN` is a ``tf.Module`` holding a Keras generator (Dense, batch norm, LeakyReLU,
Reshape, two Conv2DTranspose, tanh) and discriminator (two Conv2D, LeakyReLU, Dense), two Adam
optimizers and one ``train_step(images, noise)`` tf.function that opens a generator tape and a
discriminator tape, computes both losses from one forward pass and applies both gradients (the
tutorial's ``train_step``). Two loss weights, non-trainable variables at 1, multiply the losses
inside the tapes: a test raises one of them to make only that side's gradients overflow.
:func:`convert` saves one and converts it with ``--target float16`` (dynamic loss scaling);
:func:`compare` trains the FP32 SavedModel and the converted one from the same start on the same
batches and noise, the start and the batches given by a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from saved_trainers import all_variables as variables
from saved_trainers import scale_history
from sklearn.datasets import load_digits

from amp_rewrite import convert_file

NOISE = 16
BATCH = 64
START_SCALE = 2.0 ** 15     # the dynamic loss scale's default start
SIGNATURE = [tf.TensorSpec([None, 8, 8, 1], tf.float32), tf.TensorSpec([None, NOISE], tf.float32)]
_cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)


def generator() -> keras.Model:
    return keras.Sequential([
        keras.Input((NOISE,)),
        layers.Dense(4 * 4 * 32, use_bias=False), layers.BatchNormalization(), layers.LeakyReLU(),
        layers.Reshape((4, 4, 32)),
        layers.Conv2DTranspose(16, 3, strides=1, padding="same", use_bias=False),
        layers.BatchNormalization(), layers.LeakyReLU(),
        layers.Conv2DTranspose(1, 3, strides=2, padding="same", activation="tanh")])


def discriminator() -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, strides=2, padding="same"), layers.LeakyReLU(),
        layers.Conv2D(32, 3, strides=2, padding="same"), layers.LeakyReLU(),
        layers.Flatten(), layers.Dense(1)])


def generator_loss(fake):
    return _cross_entropy(tf.ones_like(fake), fake)


def discriminator_loss(real, fake):
    return _cross_entropy(tf.ones_like(real), real) + _cross_entropy(tf.zeros_like(fake), fake)


class GAN(tf.Module):
    """The tutorial's GAN: ``train_step`` (two tapes, two Adam optimizers) and ``generate``."""

    def __init__(self, seed: int = 0, learning_rate: float = 2e-3):
        super().__init__()
        keras.utils.set_random_seed(seed)
        self.generator, self.discriminator = generator(), discriminator()
        self.generator_optimizer = keras.optimizers.Adam(learning_rate, beta_1=0.5)
        self.discriminator_optimizer = keras.optimizers.Adam(learning_rate, beta_1=0.5)
        self.generator_optimizer.build(self.generator.trainable_variables)
        self.discriminator_optimizer.build(self.discriminator.trainable_variables)
        self.generator_loss_weight = tf.Variable(1.0, trainable=False)
        self.discriminator_loss_weight = tf.Variable(1.0, trainable=False)

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, images, noise):
        with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
            generated_images = self.generator(noise, training=True)
            real_output = self.discriminator(images, training=True)
            fake_output = self.discriminator(generated_images, training=True)
            gen_loss = generator_loss(fake_output)
            disc_loss = discriminator_loss(real_output, fake_output)
            weighted_gen = gen_loss * self.generator_loss_weight
            weighted_disc = disc_loss * self.discriminator_loss_weight
        gradients_of_generator = gen_tape.gradient(weighted_gen, self.generator.trainable_variables)
        gradients_of_discriminator = disc_tape.gradient(weighted_disc,
                                                        self.discriminator.trainable_variables)
        self.generator_optimizer.apply_gradients(
            zip(gradients_of_generator, self.generator.trainable_variables))
        self.discriminator_optimizer.apply_gradients(
            zip(gradients_of_discriminator, self.discriminator.trainable_variables))
        return {"gen_loss": gen_loss, "disc_loss": disc_loss}

    @tf.function(input_signature=[tf.TensorSpec([None, NOISE], tf.float32)])
    def generate(self, noise):
        return {"images": self.generator(noise, training=False)}


def save(module: GAN, path, train_signature: bool = True) -> None:
    """``generate`` as the serving signature; ``train_step`` as the ``train`` signature too, or
    only as the module's method (``train_signature=False``)."""
    signatures = {"serving_default": module.generate}
    if train_signature:
        signatures["train"] = module.train_step
    tf.saved_model.save(module, str(path), signatures=signatures)


def images() -> np.ndarray:
    """The 1797 digits as 8x8x1 images in [-1, 1], the generator's tanh range."""
    return (load_digits().images[..., None] / 8.0 - 1.0).astype(np.float32)


def batches(steps: int, seed: int):
    """``steps`` (images, noise) pairs, the same for every model trained with ``seed``."""
    data = images()
    rng = np.random.default_rng(seed + 100)
    for _ in range(steps):
        yield (data[rng.choice(len(data), BATCH, replace=False)],
               rng.normal(size=(BATCH, NOISE)).astype(np.float32))


def train(model, steps: int, seed: int, watch=None) -> np.ndarray:
    """Train ``model`` (a loaded SavedModel or a :class:`GAN`); the losses, one row
    ``(gen_loss, disc_loss)`` per step."""
    losses = []
    for step, (x, z) in enumerate(batches(steps, seed)):
        out = model.train_step(x, z)
        losses.append((float(out["gen_loss"]), float(out["disc_loss"])))
        if watch is not None:
            watch(step)
    return np.array(losses)


def start_from(loaded, seed: int, folder: Path) -> None:
    """Put ``loaded`` (the FP32 or the converted SavedModel of a :class:`GAN`) back to where
    ``GAN(seed)`` starts, through a checkpoint of it in ``folder`` (written once): its weights,
    zeroed optimizer slots and counters; and the loss scale to its starting state. One
    SavedModel pair then trains from as many starting points as wanted without saving and
    converting each (a checkpoint of the Python object restores into the converted SavedModel
    by object path: docs/training.md)."""
    prefix = folder / f"start_{seed}"
    if not Path(f"{prefix}.index").exists():
        tf.train.Checkpoint(GAN(seed)).write(str(prefix))
    status = tf.train.Checkpoint(loaded).read(str(prefix))
    if not hasattr(loaded, "amp_loss_scale"):
        status.assert_existing_objects_matched()
    else:   # the loss-scale state is the only part the checkpoint does not hold
        state = loaded.amp_loss_scale
        state.scale.assign(START_SCALE)
        state.skipped_steps.assign(0)
        state.good_steps.assign(0)


@dataclass
class Run:
    """One seed: the FP32 and the float16 SavedModel trained on the same batches."""

    seed: int
    fp32: np.ndarray        # (steps, 2): gen_loss, disc_loss per step
    float16: np.ndarray
    scale_history: list = field(default_factory=list)   # (step, new scale), first (0, start)
    skipped: int = 0
    good_steps: int = 0     # the loss scale's count of finite steps since its last change

    def final(self, which: str, last: int) -> np.ndarray:
        """The mean (gen_loss, disc_loss) over the ``last`` steps."""
        return getattr(self, which)[-last:].mean(axis=0)


def convert(folder: Path, **options) -> tuple:
    """Save ``GAN(0)`` in ``folder/fp32``, convert it to ``folder/f16`` (``options`` are
    ``convert_file``'s; float16 with dynamic loss scaling by default); the report."""
    save(GAN(0), folder / "fp32")
    return convert_file(folder / "fp32", folder / "f16", force=True,
                        **{"target": "float16", **options})


def load(folder: Path) -> tuple:
    """The FP32 and the converted SavedModel of ``folder`` (:func:`convert`), loaded."""
    return tuple(tf.saved_model.load(str(folder / name)) for name in ("fp32", "f16"))


def compare(folder: Path, seed: int, steps: int, models: tuple | None = None) -> Run:
    """Train the FP32 and the converted SavedModel of ``folder`` (:func:`convert`; ``models``:
    both loaded, :func:`load`), both from ``GAN(seed)``'s start (checked: the same bytes),
    ``steps`` steps on the same batches."""
    fp32, converted = models or load(folder)
    for model in (fp32, converted):
        start_from(model, seed, folder)
    theirs = {k: v.numpy().tobytes() for k, v in variables(fp32).items()}
    ours = {k: v.numpy().tobytes() for k, v in variables(converted).items()
            if not k.startswith("amp_loss_scale/")}
    if ours != theirs:
        raise AssertionError(f"the two SavedModels start apart: "
                             f"{sorted(k for k in theirs if ours.get(k) != theirs[k])[:3]}")
    state = converted.amp_loss_scale
    history, watch = scale_history(state)
    fp32_losses = train(fp32, steps, seed)
    half = train(converted, steps, seed, watch)
    return Run(seed, fp32_losses, half, history, int(state.skipped_steps.numpy()),
               int(state.good_steps.numpy()))
