"""float16 training of TF2 train-step SavedModels: dynamic loss scaling added offline.

A tf.Module holding weights and a Keras optimizer, with a ``train_step`` tf.function (a
GradientTape and ``apply_gradients``) and a serving signature, saved by ``tf.saved_model.save``,
converted with ``--target float16`` (dynamic loss scaling by default), loaded back with
``tf.saved_model.load`` and trained on the digits data set.
"""

import hashlib
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from tensorflow.core.framework import types_pb2
from tensorflow.python.saved_model import loader_impl
from tensorflow.python.training import py_checkpoint_reader

from amp_rewrite import UnsupportedGraphError, cli, convert_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from saved_trainers import all_variables  # noqa: E402
from train_step_savedmodel import Classifier  # noqa: E402


def Trainer(optimizer: str = "adam", seed: int = 0):
    """The example's classifier (examples/train_step_savedmodel.py): weights, a Keras
    optimizer, ``train_step`` and ``serve``."""
    return Classifier(seed, optimizer)


def save_trainer(module, path) -> None:
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve,
                                                       "train": module.train_step})


def digits():
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def bits(variables: dict) -> dict:
    return {k: v.numpy().tobytes() for k, v in variables.items()}


def state(loaded) -> tuple:
    s = loaded.amp_loss_scale
    return float(s.scale.numpy()), int(s.skipped_steps.numpy()), int(s.good_steps.numpy())


@pytest.fixture(scope="module", params=["adam", "sgd"])
def converted(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"saved_training_{request.param}")
    save_trainer(Trainer(request.param), folder / "fp32")
    report = convert_file(folder / "fp32", folder / "f16", target="float16")
    return folder, report


def test_trains_in_float16_with_master_weights_and_scale_state(converted):
    folder, report = converted
    scaling = report.to_dict()["loss_scaling"]
    assert scaling["mode"] == "dynamic" and scaling["start"] == 2.0 ** 15
    assert len(scaling["functions"]) == 1 and len(scaling["gradients"]) == 4
    assert scaling["gated_writes"] >= 5    # 4 weights + the slots + the iteration counter
    meta = loader_impl.parse_saved_model(str(folder / "f16")).meta_graphs[0]
    (train,) = [f for f in meta.graph_def.library.function if f.signature.name in scaling["functions"]]
    matmuls = [n for n in train.node_def if n.op == "MatMul"]
    # 2 forward, 3 backward (no gradient for x)
    assert len(matmuls) == 5 and all(n.attr["T"].type == types_pb2.DT_HALF for n in matmuls)
    assert not [n for n in train.node_def if n.op.startswith("Assign") and "amp_loss_scale" not in n.name]

    x, y = digits()
    loaded, reference = tf.saved_model.load(str(folder / "f16")), tf.saved_model.load(str(folder / "fp32"))
    assert all(v.dtype == tf.float32 for v in (loaded.w1, loaded.b1, loaded.w2, loaded.b2))
    assert state(loaded) == (2.0 ** 15, 0, 0)
    rng = np.random.default_rng(0)
    losses, ref = [], []
    for _ in range(40):
        idx = rng.choice(1400, 64, replace=False)
        losses.append(float(loaded.train_step(x[idx], y[idx])))
        ref.append(float(reference.train_step(x[idx], y[idx])))
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    assert abs(np.mean(losses[-10:]) - np.mean(ref[-10:])) < 0.05 + 0.1 * np.mean(ref[-10:])
    scale, skipped, good = state(loaded)
    assert (scale, good) == (2.0 ** 15 / 2 ** skipped, 40 - skipped) or skipped == 0 and good == 40
    # the signature runs the same gated step
    before = state(loaded)[2]
    loaded.signatures["train"](x=tf.constant(x[:64]), y=tf.constant(y[:64]))
    assert state(loaded)[2] == before + 1


def test_a_skipped_step_changes_no_bit(converted):
    """A forward overflow (inputs times 1e30) and a backward-only one (scale 2^120): every
    variable, slot and the iteration counter keep their exact bytes; the scale halves."""
    folder, _ = converted
    x, y = digits()
    loaded = tf.saved_model.load(str(folder / "f16"))
    for _ in range(3):
        loaded.train_step(x[:64], y[:64])
    model = {k: v for k, v in all_variables(loaded).items() if not k.startswith("amp_loss_scale")}
    assert len(model) >= 9      # weights, slots, iteration, learning rate
    before, (scale, skipped, good) = bits(model), state(loaded)
    assert (skipped, good) == (0, 3)
    loss = float(loaded.train_step(x[:64] * 1e30, y[:64]))
    assert not np.isfinite(loss)
    assert bits(model) == before
    assert state(loaded) == (scale / 2, skipped + 1, 0)
    loaded.amp_loss_scale.scale.assign(2.0 ** 120)
    loss = float(loaded.train_step(x[:64], y[:64]))
    assert np.isfinite(loss)          # the forward pass is fine, the scaled backprop is not
    assert bits(model) == before
    assert state(loaded) == (2.0 ** 119, skipped + 2, 0)
    loaded.amp_loss_scale.scale.assign(2.0 ** 10)
    loaded.train_step(x[:64], y[:64])
    assert bits(model) != before and state(loaded) == (2.0 ** 10, skipped + 2, 1)


def test_state_is_checkpointed_with_the_model(converted, tmp_path):
    folder, _ = converted
    x, y = digits()
    loaded = tf.saved_model.load(str(folder / "f16"))
    loaded.train_step(x[:64] * 1e30, y[:64])
    loaded.train_step(x[:64], y[:64])
    saved_state, saved_w1 = state(loaded), loaded.w1.numpy()
    path = tf.train.Checkpoint(loaded).write(str(tmp_path / "ckpt"))
    keys = dict(tf.train.list_variables(path))
    assert "amp_loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE" in keys
    loaded.train_step(x[:64] * 1e30, y[:64])
    assert state(loaded) != saved_state
    tf.train.Checkpoint(loaded).read(path).assert_consumed()
    assert state(loaded) == saved_state
    fresh = tf.saved_model.load(str(folder / "f16"))
    tf.train.Checkpoint(fresh).read(path).assert_consumed()
    assert state(fresh) == saved_state and np.array_equal(fresh.w1.numpy(), saved_w1)


def test_original_variables_keep_their_bytes(converted):
    folder, _ = converted
    old = py_checkpoint_reader.NewCheckpointReader(str(folder / "fp32" / "variables" / "variables"))
    new = py_checkpoint_reader.NewCheckpointReader(str(folder / "f16" / "variables" / "variables"))
    keys = [k for k in old.get_variable_to_dtype_map() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    assert all(old.get_tensor(k).tobytes() == new.get_tensor(k).tobytes() for k in keys)
    assert set(new.get_variable_to_dtype_map()) - set(old.get_variable_to_dtype_map()) == {
        f"amp_loss_scale/{n}/.ATTRIBUTES/VARIABLE_VALUE" for n in ("scale", "skipped_steps", "good_steps")}
    # TensorFlow's writer put the original tensors first: the original data file is shard 0
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(folder / "fp32" / "variables" / "variables.data-00000-of-00001") == \
        digest(folder / "f16" / "variables" / "variables.data-00000-of-00002")


def test_a_checkpoint_of_the_fp32_model_resumes_in_the_converted_one(tmp_path):
    """No var_list to filter: the object-based checkpoint restores every original variable;
    the loss-scale state, absent from it, starts fresh."""
    module = Trainer("adam", seed=1)
    save_trainer(module, tmp_path / "fp32")
    convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    x, y = digits()
    for _ in range(5):
        module.train_step(x[:64], y[:64])
    path = tf.train.Checkpoint(module).write(str(tmp_path / "ckpt"))
    loaded = tf.saved_model.load(str(tmp_path / "f16"))
    tf.train.Checkpoint(loaded).read(path)
    saved = tf.train.load_checkpoint(path)
    keys = {k.removesuffix("/.ATTRIBUTES/VARIABLE_VALUE") for k in saved.get_variable_to_shape_map()}
    ours = all_variables(loaded)
    assert len(ours) == len(keys - {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter"}) + 3
    assert all(np.array_equal(v.numpy(), saved.get_tensor(k + "/.ATTRIBUTES/VARIABLE_VALUE"))
               for k, v in ours.items() if k in keys)
    assert int(loaded.opt._iterations.numpy()) == 5
    assert state(loaded) == (2.0 ** 15, 0, 0)
    loaded.train_step(x[:64], y[:64])
    assert int(loaded.opt._iterations.numpy()) == 6


def test_static_scale_and_converting_twice(tmp_path, caplog):
    save_trainer(Trainer("sgd"), tmp_path / "fp32")
    report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16", loss_scale="1024")
    assert report.to_dict()["loss_scaling"]["mode"] == "static"
    loaded = tf.saved_model.load(str(tmp_path / "f16"))
    x, y = digits()
    loaded.train_step(x[:64] * 1e30, y[:64])
    loaded.train_step(x[:64], y[:64])
    assert state(loaded) == (1024.0, 1, 0)
    with pytest.raises(UnsupportedGraphError, match="converted before"):
        convert_file(tmp_path / "f16", tmp_path / "again", target="float16")
    with caplog.at_level(logging.ERROR):
        assert cli.main([str(tmp_path / "f16"), "-o", str(tmp_path / "again"), "-q"]) == 2
    assert not (tmp_path / "again").exists()


def test_the_example_builds_converts_and_trains(tmp_path):
    import re
    import subprocess
    example = Path(__file__).resolve().parent.parent / "examples" / "train_step_savedmodel.py"
    proc = subprocess.run([sys.executable, str(example), "--steps", "100", "--folder", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "loss_scaling: dynamic" in out and "variables: w1:0 float32, w2:0 float32" in out
    ours, fp32 = map(float, re.search(r"test accuracy, float16 after conversion: ([\d.]+); FP32: ([\d.]+)",
                                      out).groups())
    assert ours > 0.8 and abs(ours - fp32) <= 0.02
    assert (tmp_path / "f16" / "saved_model.pb").is_file()


@pytest.mark.parametrize("name", ["CNN", "LSTM"])
def test_scaling_alone_trains_bit_for_bit_like_the_original(name, tmp_path):
    """Every op kept float32 (a keep_fp32 override of every node), loss scaling still added:
    scaling by a power of two is exact, so the converted step must train exactly as the
    original. The CNN's tape sums gradient contributions with an AddN outside its scope (batch
    norm, conv), the LSTM's backward pass is a While loop beside the forward one."""
    import saved_trainers as st
    module = st.MODELS[name](0)
    save_trainer(module, tmp_path / "fp32")
    keep_all = tmp_path / "keep_all.toml"
    keep_all.write_text('[[override]]\nglob = "*"\naction = "keep_fp32"\n')
    report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16", rules=[str(keep_all)])
    assert report.to_dict()["loss_scaling"]["mode"] == "dynamic"
    a, b = tf.saved_model.load(str(tmp_path / "fp32")), tf.saved_model.load(str(tmp_path / "f16"))
    x, y = digits()
    for step in range(5):
        assert float(a.train_step(x[64 * step:64 * step + 64], y[64 * step:64 * step + 64])) == \
            float(b.train_step(x[64 * step:64 * step + 64], y[64 * step:64 * step + 64]))
    ours = {k: v for k, v in all_variables(b).items() if not k.startswith("amp_loss_scale")}
    assert bits(ours) == bits(all_variables(a))
    assert state(b) == (2.0 ** 15, 0, 5)


def test_a_skipped_step_leaves_batch_norm_statistics_alone(tmp_path):
    """The moving averages are written by the step's forward pass: on a skipped step they
    keep their bits too, whether the forward pass overflowed or only the scaled gradients."""
    import saved_trainers as st
    save_trainer(st.CNN(0), tmp_path / "fp32")
    convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    loaded = tf.saved_model.load(str(tmp_path / "f16"))
    x, y = digits()
    loaded.train_step(x[:64], y[:64])
    before = bits({"mean": loaded.moving_mean, "var": loaded.moving_var})
    loaded.train_step(x[:64] * 1e30, y[:64])
    loaded.amp_loss_scale.scale.assign(2.0 ** 120)
    assert np.isfinite(float(loaded.train_step(x[:64], y[:64])))
    assert bits({"mean": loaded.moving_mean, "var": loaded.moving_var}) == before
    assert state(loaded)[1] == 2


def test_float16_training_reaches_the_fp32_accuracy(capsys):
    """The digits MLP, CNN (batch norm) and LSTM, 300 Adam steps after conversion against the
    FP32 SavedModel trained on the same batches, 3 seeds each: the mean test accuracy within 1
    point. Prints the means, the spreads, each run's loss-scale history and how many of the 397
    held-out digits the two trained models classify differently.

    That float16 ran: the train step's matrix ops are float16 and its trained weights differ
    from FP32's (with everything float32, loss scaling by a power of two is exact and the
    weights would match bit for bit, test_scaling_alone_trains_bit_for_bit_like_the_original).
    That the loss scale ran: its count of finite steps since its last change is every step
    since then. The accuracies often come out equal: float16 moves the logits by a few hundredths,
    which flips the class of at most a digit or two."""
    import saved_trainers as st
    lines = []
    for name in st.MODELS:
        runs = [st.compare(name, seed) for seed in range(3)]
        fp32 = np.array([r.fp32 for r in runs])
        half = np.array([r.float16 for r in runs])
        lines.append(f"{name}: FP32 {100 * fp32.mean():.2f}% (spread {100 * np.ptp(fp32):.2f}), "
                     f"float16 {100 * half.mean():.2f}% (spread {100 * np.ptp(half):.2f}); "
                     + "; ".join(f"seed {r.seed}: scale {r.scale_history}, skipped {r.skipped}, "
                                 f"{r.disagreements} digits classified differently, weights "
                                 f"{r.weight_difference:.2g} apart" for r in runs))
        for r in runs:
            assert r.float16_matrix_ops >= 3, lines[-1]   # forward and weight gradients
            assert r.weight_difference > 0, lines[-1]
            assert r.good_steps == r.steps - r.scale_history[-1][0] > 0, lines[-1]
        assert abs(half.mean() - fp32.mean()) <= 0.01, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


class TwoSteps(tf.Module):
    """A train step that calls two training tf.functions (each a tape and an optimizer)."""

    SIGNATURE = [tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int64)]

    def __init__(self):
        super().__init__()
        import keras
        r = np.random.default_rng(0)
        self.a = tf.Variable(r.normal(0, 0.15, (64, 32)).astype(np.float32))
        self.b = tf.Variable(r.normal(0, 0.15, (32, 10)).astype(np.float32))
        self.opt_a, self.opt_b = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
        self.opt_a.build([self.a])
        self.opt_b.build([self.b])

    def loss(self, x, y):
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, self.a)), self.b)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    def _train(self, optimizer, variable, x, y):
        with tf.GradientTape() as tape:
            loss = self.loss(x, y)
        optimizer.apply_gradients([(tape.gradient(loss, variable), variable)])
        return loss

    @tf.function
    def step_a(self, x, y):
        return self._train(self.opt_a, self.a, x, y)

    @tf.function
    def step_b(self, x, y):
        return self._train(self.opt_b, self.b, x, y)

    @tf.function(input_signature=SIGNATURE)
    def train_step(self, x, y):
        self.step_a(x, y)
        return self.step_b(x, y)


def test_a_step_calling_two_train_functions_passes_the_state_once(tmp_path):
    """Each train function gets the handles; their shared caller captures them once and the
    signature wrapper above it passes three inputs, not six (found in review: the signature
    failed with 'input_devices must have the same length as the number of arguments')."""
    module = TwoSteps()
    tf.saved_model.save(module, str(tmp_path / "fp32"), signatures={"train": module.train_step})
    report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    # both traces of each (the one called and the one saved with the method)
    assert len(report.to_dict()["loss_scaling"]["functions"]) == 4
    loaded = tf.saved_model.load(str(tmp_path / "f16"))
    x, y = digits()
    first = float(loaded.signatures["train"](x=tf.constant(x[:64]), y=tf.constant(y[:64]))["output_0"])
    for _ in range(10):
        last = float(loaded.train_step(x[:64], y[:64]))
    # each train function checks its own gradients and counts its own good steps
    assert last < first and state(loaded) == (2.0 ** 15, 0, 11 * 2)


class Normalizing(tf.Module):
    """A running input mean updated, then used, before the tape: a write the gradients (and so
    the finiteness check) depend on."""

    def __init__(self):
        super().__init__()
        self.model = Classifier()
        self.mean = tf.Variable(tf.zeros([64]))
        self.n = tf.Variable(0.0)

    @tf.function(input_signature=TwoSteps.SIGNATURE)
    def train_step(self, x, y):
        self.n.assign_add(1.0)
        self.mean.assign_add((tf.reduce_mean(x, 0) - self.mean) / self.n)
        with tf.GradientTape() as tape:
            logits = self.model.logits(x - self.mean)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        params = self.model.params
        self.model.opt.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss


def test_writes_the_check_waits_on_are_named_in_a_warning(tmp_path):
    """They cannot be gated (the check depends on them): the report says so, by name (found in
    review: they ran on skipped steps silently)."""
    module = Normalizing()
    tf.saved_model.save(module, str(tmp_path / "fp32"), signatures={"train": module.train_step})
    report = convert_file(tmp_path / "fp32", tmp_path / "f16", target="float16")
    ungated = report.to_dict()["loss_scaling"]["ungated_writes"]
    assert len(ungated) == 2 and all("AssignAddVariableOp" in w for w in ungated)
    assert any("before the finiteness check" in w for w in report.warnings)
