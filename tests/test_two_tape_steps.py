"""Several tapes in one train step, as TensorFlow's DCGAN tutorial writes a GAN: one
``tf.function`` with a generator tape and a discriminator tape and two Adam optimizers
(tests/gan_steps.py), saved as a SavedModel signature and converted to float16.

The step is one step (docs/training.md "Several tapes in one step"): one loss scale for both
seeds, one finiteness check over both parts' gradients, every write gated, so an overflow on
either side skips the whole step; a train method loss scaling would refuse is left alone, with
the reason; the flags only graph files take are refused for a SavedModel or a Keras file.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from gan_steps import (
    GAN,
    NOISE,
    SIGNATURE,
    batches,
    compare,
    convert,
    discriminator_loss,
    generator_loss,
    load,
    save,
    variables,
)
from tensorflow.core.framework import types_pb2
from tensorflow.python.saved_model import loader_impl

from amp_rewrite import InputError, UnsupportedGraphError, cli, convert_file
from amp_rewrite.core.ops import MATRIX_OPS

STATE = "amp_loss_scale/"
WEIGHTS = ("generator_loss_weight", "discriminator_loss_weight")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tutorial's GAN (seed 0) saved with ``generate`` and ``train`` signatures, converted
    to float16 with dynamic loss scaling: (folder, report)."""
    folder = tmp_path_factory.mktemp("gan")
    return folder, convert(folder)


def library(path) -> dict:
    meta = loader_impl.parse_saved_model(str(path)).meta_graphs[0]
    return {f.signature.name: f for f in meta.graph_def.library.function}


def state(loaded) -> tuple:
    s = loaded.amp_loss_scale
    return float(s.scale.numpy()), int(s.skipped_steps.numpy()), int(s.good_steps.numpy())


def model_bits(loaded) -> dict:
    """Every variable's bytes but the loss-scale state's and the loss weights'."""
    return {k: v.numpy().tobytes() for k, v in variables(loaded).items()
            if not k.startswith(STATE) and k not in WEIGHTS}


def test_the_two_tape_step_is_scaled_as_one_step(converted):
    folder, report = converted
    scaling = report.to_dict()["loss_scaling"]
    (function,) = scaling["functions"]
    assert [s.split("/")[-1] for s in scaling["seeds"]] == ["ones", "ones_1"]
    gan = GAN(0)
    generator, discriminator = (len(m.trainable_variables) for m in (gan.generator, gan.discriminator))
    # the discriminator's weights get a term from the real and one from the fake images, each
    # unscaled where it leaves the tape (their sum, outside it, is then the true gradient)
    assert len(scaling["gradients"]) == generator + 2 * discriminator == 20
    # every write of the step: Adam's m, v and the weight for each of the 14 weights, both
    # iteration counters, the generator's two batch norms' moving mean and variance
    assert scaling["gated_writes"] == 3 * 14 + 2 + 4 and scaling["ungated_writes"] == []
    body = library(folder / "f16")[function]
    matrix = [n for n in body.node_def if n.op in MATRIX_OPS]
    assert sum(n.attr["T"].type == types_pb2.DT_HALF for n in matrix) >= 20, len(matrix)
    writes = [n for n in body.node_def if n.op.startswith(("Assign", "ResourceApply"))
              and not n.name.startswith(STATE)]
    assert not writes          # each became an If on the one check
    finite = [n for n in body.node_def if n.name == f"{STATE}all_finite"]
    assert len(finite) == 1


@pytest.mark.parametrize("side", ["generator", "discriminator", "discriminator forward"])
def test_an_overflow_on_either_side_skips_the_whole_step(converted, side, tmp_path):
    """Only one side's gradients overflow (its loss weight at 1e30, which the other tape never
    sees; or a batch of images times 1e30, which only the discriminator reads): no variable of
    either side, no optimizer slot or counter, no batch-norm statistic changes a bit; the scale
    halves and the skipped step is counted once, in state a checkpoint of the model keeps."""
    folder, _ = converted
    loaded = tf.saved_model.load(str(folder / "f16"))
    data = list(batches(3, seed=0))
    loaded.train_step(*data[0])
    before, (scale, skipped, good) = model_bits(loaded), state(loaded)
    assert (skipped, good) == (0, 1) and len(before) == 50
    images, noise = data[1]
    if side == "discriminator forward":
        images = images * np.float32(1e30)
    else:
        getattr(loaded, f"{side}_loss_weight").assign(1e30)
    out = loaded.train_step(images, noise)
    other = "gen_loss" if side.startswith("discriminator") else "disc_loss"
    assert np.isfinite(float(out[other]))       # the other side's loss was fine
    assert model_bits(loaded) == before
    assert state(loaded) == (scale / 2, skipped + 1, 0)
    # the state is the model's: a checkpoint of it restores the skipped step's count
    path = tf.train.Checkpoint(loaded).write(str(tmp_path / "ckpt"))
    fresh = tf.saved_model.load(str(folder / "f16"))
    tf.train.Checkpoint(fresh).read(path).assert_consumed()
    assert state(fresh) == state(loaded) and model_bits(fresh) == before
    for name in WEIGHTS:
        getattr(loaded, name).assign(1.0)
    loaded.train_step(*data[2])
    after = model_bits(loaded)
    changed = {k for k in before if after[k] != before[k]}
    assert {k.split("/")[0] for k in changed} == {"generator", "discriminator",
                                                 "generator_optimizer", "discriminator_optimizer"}
    assert state(loaded) == (scale / 2, skipped + 1, 1)


def test_a_normal_step_updates_both_sides_with_their_true_gradients(converted):
    """One step from the same start on the same batch: every weight, slot and statistic of
    both sides moves, and each optimizer's slots (Adam's m and v, made of the unscaled
    gradients) agree with FP32's to float16's precision: both seeds were scaled and both
    parts' gradients unscaled by the same factor."""
    folder, _ = converted
    fp32, half = load(folder)
    start = model_bits(fp32)
    assert model_bits(half) == start
    batch = next(batches(1, seed=0))
    fp32.train_step(*batch)
    half.train_step(*batch)
    theirs, ours = model_bits(fp32), model_bits(half)
    moved = {k for k in start if k.startswith(("generator/", "discriminator/"))}
    assert len(moved) == 12 + 6 and all(theirs[k] != start[k] and ours[k] != start[k] for k in moved)
    fp32_vars, half_vars = variables(fp32), variables(half)
    for optimizer in ("generator_optimizer", "discriminator_optimizer"):
        slots = sorted(k for k in theirs if k.startswith(optimizer) and fp32_vars[k].shape.rank)
        a = np.concatenate([fp32_vars[k].numpy().ravel() for k in slots])
        b = np.concatenate([half_vars[k].numpy().ravel() for k in slots])
        assert np.linalg.norm(a) > 0 and np.linalg.norm(b - a) / np.linalg.norm(a) < 0.02, optimizer
    assert state(half) == (2.0 ** 15, 0, 1)


@pytest.mark.parametrize("flags", [["--grad", "ones", "--grad", "ones_1"], ["--loss", "add"],
                                   ["--fold-constants"], ["--lowp-io"]])
def test_flags_only_graph_files_take_are_refused_for_a_savedmodel(converted, tmp_path, capsys,
                                                                   flags):
    folder, _ = converted
    out = tmp_path / "out"
    assert cli.main([str(folder / "fp32"), "-o", str(out)] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flags[0]} applies to graph files" in err, err
    assert not out.exists()


def test_flags_only_graph_files_take_are_refused_for_a_keras_file_and_from_python(tmp_path, capsys):
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.save(tmp_path / "m.keras")
    assert cli.main([str(tmp_path / "m.keras"), "-o", str(tmp_path / "out"), "--grad", "x"]) == 2
    assert "--grad applies to graph files" in capsys.readouterr().err
    with pytest.raises(InputError, match="lowp_io=True applies to graph files"):
        convert_file(tmp_path / "m.keras", tmp_path / "out", lowp_io=True)
    assert not (tmp_path / "out").exists()


class AlternatingGAN(tf.Module):
    """A small GAN stepped in the order of keras.io's DCGAN: the discriminator's tape and
    update, then the generator's tape, whose forward pass reads the updated discriminator.
    Plain variables (a dense generator, a dense discriminator), so it saves in a second."""

    def __init__(self):
        super().__init__()
        r = np.random.default_rng(0)
        self.g = tf.Variable(r.normal(0, 0.3, (NOISE, 64)).astype(np.float32))
        self.d = tf.Variable(r.normal(0, 0.1, (64, 1)).astype(np.float32))
        self.g_opt, self.d_opt = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)
        self.g_opt.build([self.g])
        self.d_opt.build([self.d])

    def generated(self, noise):
        return tf.tanh(tf.matmul(noise, self.g))

    def discriminated(self, images):
        return tf.matmul(tf.reshape(images, [-1, 64]), self.d)

    def discriminator_step(self, images, noise):
        with tf.GradientTape() as tape:
            loss = discriminator_loss(self.discriminated(images),
                                      self.discriminated(self.generated(noise)))
        self.d_opt.apply_gradients([(tape.gradient(loss, self.d), self.d)])
        return loss

    def generator_step(self, noise):
        with tf.GradientTape() as tape:
            loss = generator_loss(self.discriminated(self.generated(noise)))
        self.g_opt.apply_gradients([(tape.gradient(loss, self.g), self.g)])
        return loss

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, images, noise):
        disc_loss = self.discriminator_step(images, noise)
        return {"gen_loss": self.generator_step(noise), "disc_loss": disc_loss}

    @tf.function(input_signature=SIGNATURE[1:])
    def generate(self, noise):
        return {"images": self.generated(noise)}


class SplitGAN(AlternatingGAN):
    """The same, each tape in a tf.function of its own: what the refusal advises."""

    discriminator_step = tf.function(AlternatingGAN.discriminator_step)
    generator_step = tf.function(AlternatingGAN.generator_step)


def test_a_step_applying_one_tape_before_the_next_is_refused_and_its_split_converts(tmp_path):
    """The discriminator's update runs before the generator's gradients exist, which read it:
    one check over the step cannot skip it, so the step is refused, naming the split into one
    function per tape; that split converts, each function checking its own gradients."""
    save(AlternatingGAN(), tmp_path / "alternating")
    with pytest.raises(UnsupportedGraphError, match="Split the step into one tf.function per tape"):
        convert_file(tmp_path / "alternating", tmp_path / "refused", target="float16")
    assert not (tmp_path / "refused").exists()
    save(SplitGAN(), tmp_path / "split")
    report = convert_file(tmp_path / "split", tmp_path / "f16", target="float16")
    # both traces of each step (the one train_step calls, the one saved with the method)
    assert len(report.to_dict()["loss_scaling"]["functions"]) == 4
    loaded = tf.saved_model.load(str(tmp_path / "f16"))
    before = model_bits(loaded)
    out = loaded.signatures["train"](**dict(zip(("images", "noise"), next(batches(1, 0)))))
    assert np.isfinite(float(out["gen_loss"])) and model_bits(loaded) != before
    assert state(loaded) == (2.0 ** 15, 0, 2)   # one good step counted by each function


class PenaltyGAN(AlternatingGAN):
    """A WGAN-GP critic step: the penalty on the gradient of the critic's scores with respect to
    the images comes from an inner tape inside the critic's tape. With a batch of scores the
    inner tape's seed is ``ones_like`` of them, no Const: only the critic's tape is scaled, and
    the penalty's gradient is a forward value, not to unscale; with ``scalar`` scores both
    seeds are Consts of ones and the critic's tape differentiates what the inner one computes."""

    scalar = False

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, images, noise):
        real = tf.reshape(images, [-1, 64])
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(real)
                scores = self.discriminated(real)
                if self.scalar:
                    scores = tf.reduce_sum(scores)
            penalty = tf.reduce_mean(tf.square(inner.gradient(scores, real)))
            if self.scalar:   # the seed then feeds a float16 and a float32 gradient op: a Cast
                loss = scores + 10.0 * penalty
            else:
                loss = (tf.reduce_mean(self.discriminated(self.generated(noise)))
                        - tf.reduce_mean(scores) + 10.0 * penalty)
        self.d_opt.apply_gradients([(tape.gradient(loss, self.d), self.d)])
        return {"disc_loss": loss, "penalty": penalty}


class ScalarPenaltyGAN(PenaltyGAN):
    scalar = True


@pytest.mark.parametrize("model", ["GAN", "PenaltyGAN"])
def test_scaling_alone_trains_bit_for_bit_like_the_original(model, tmp_path):
    """Every op kept float32 (a keep_fp32 override of every node), loss scaling still added:
    scaling by a power of two is exact, so the converted step trains exactly as the original:
    both of the GAN's seeds are scaled and all its gradients unscaled by the same factor, and
    the gradient penalty's inner gradient, which no scaled seed computes, is left as it is
    (it was divided by the scale once: found with this test)."""
    save(GAN(0) if model == "GAN" else PenaltyGAN(), tmp_path / "fp32")
    keep_all = tmp_path / "keep_all.toml"
    keep_all.write_text('[[override]]\nglob = "*"\naction = "keep_fp32"\n')
    report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16", rules=[str(keep_all)])
    assert len(report.to_dict()["loss_scaling"]["seeds"]) == (2 if model == "GAN" else 1)
    original, ours = (tf.saved_model.load(str(tmp_path / n)) for n in ("fp32", "f16"))
    for x, z in batches(3, seed=0):
        theirs, mine = original.train_step(x, z), ours.train_step(x, z)
        assert {k: v.numpy() for k, v in theirs.items()} == {k: v.numpy() for k, v in mine.items()}
    assert model_bits(ours) == model_bits(original)
    assert state(ours) == (2.0 ** 15, 0, 3)


def test_a_tape_differentiating_another_tapes_gradients_is_refused(tmp_path):
    """Both seeds Consts of ones, the critic's tape differentiating the inner tape's gradient:
    one scale would scale that tape's gradients twice. Refused, nothing written. (Painting
    puts a Cast between the critic's seed and one of its readers: the seed is found through
    it, else only the inner seed was scaled and the penalty came out divided by the scale.)"""
    save(ScalarPenaltyGAN(), tmp_path / "fp32")
    with pytest.raises(UnsupportedGraphError, match="one tape differentiates what another tape's"):
        convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    assert not (tmp_path / "f16").exists()


def test_a_train_method_loss_scaling_would_refuse_is_left_alone_with_the_reason(tmp_path, caplog):
    """The step above, which a signature would have refused, saved only as the module's
    method (the serving signature is ``generate``): no refusal, its body keeps its bytes, it
    trains exactly as the original, and a warning names it with the refusal's reason and fix;
    ``generate`` is converted. (A method that can be scaled is scaled:
    tests/test_saved_methods.py.)"""
    save(AlternatingGAN(), tmp_path / "fp32", train_signature=False)
    with caplog.at_level(logging.WARNING, logger="amp_rewrite"):
        report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    before, after = library(tmp_path / "fp32"), library(tmp_path / "f16")
    (train,) = [name for name in before if name.startswith("__inference_train_step")]
    assert after[train].SerializeToString(deterministic=True) == \
        before[train].SerializeToString(deterministic=True)
    assert "loss_scaling" not in report.to_dict()
    (warning,) = [w for w in report.warnings if train in w]
    assert "left as it is (float32, without loss scaling)" in warning
    assert "Split the step into one tf.function per tape" in warning
    assert train in caplog.text
    (generate,) = [n for n in after if n.startswith("__inference_generate")]
    assert any(n.op == "MatMul" and n.attr["T"].type == types_pb2.DT_HALF
               for n in after[generate].node_def)
    original, ours = (tf.saved_model.load(str(tmp_path / n)) for n in ("fp32", "f16"))
    assert not hasattr(ours, "amp_loss_scale")
    for x, z in batches(2, seed=0):
        assert original.train_step(x, z)["gen_loss"].numpy() == ours.train_step(x, z)["gen_loss"].numpy()
    assert model_bits(ours) == model_bits(original)


def test_float16_gan_training_tracks_fp32(converted, capsys):
    """The tutorial's GAN, 60 steps from 3 starting points (seeds), the FP32 SavedModel and the
    converted one on the same batches and noise: the float16 runs' mean generator and
    discriminator losses (each run's mean over its last 20 steps) lie within the FP32 runs'
    spread of their mean. benchmarks/gan_training.py runs the long version (BENCHMARKS.md
    "float16 GAN training").

    That float16 ran: the step's matrix ops are float16 (test_the_two_tape_step_is_scaled_as_one_step)
    and the losses differ from FP32's; that the scale ran: its count of finite steps since its
    last change is every step since then."""
    folder, _ = converted
    models = load(folder)
    runs = [compare(folder, seed, 60, models) for seed in range(3)]
    fp32 = np.array([r.final("fp32", 20) for r in runs])
    half = np.array([r.final("float16", 20) for r in runs])
    spread = np.ptp(fp32, axis=0)
    line = (f"GAN: FP32 gen/disc {fp32.mean(0).round(4)} (spread {spread.round(4)}), float16 "
            f"{half.mean(0).round(4)}; scale histories {[r.scale_history for r in runs]}")
    for r in runs:
        assert not np.array_equal(r.fp32, r.float16) and np.all(np.isfinite(r.float16)), line
        assert r.good_steps == 60 - r.scale_history[-1][0] > 0, line
    assert np.all(np.abs(half.mean(0) - fp32.mean(0)) <= spread), line
    with capsys.disabled():
        print("\n" + line)
