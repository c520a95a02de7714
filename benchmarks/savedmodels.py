"""Keras models as SavedModels (weights in variables): FP32, amp-rewrite's bfloat16 and
grappler's own bfloat16 pass on this CPU, in one run.

Each model is exported with ``model.export`` (a TF2 SavedModel: its weights are variables
that reach the serving function as resource arguments), converted with
``convert_file(..., target="bfloat16", device="cpu", shapes={input: (batch, ...)})`` (told
the batch it runs at, as ``--shape``; and with ``min_matrix_intensity=0``,
painted whole as before the cost model weighed it), and the SavedModels are loaded into
TF1 sessions (``tf.compat.v1.saved_model.loader.load``): the FP32 one twice, once with
grappler's ``auto_mixed_precision_onednn_bfloat16`` pass on. Its serving signature is also
frozen as docs/savedmodels.md "Frozen graphs from a SavedModel" shows
(``convert_variables_to_constants_v2``), run as it is (frozen FP32) and converted with
``fold_constants=True`` (``--fold-constants``). After a warm-up run each, ``--rounds`` rounds
run the six round-robin, the order rotating per round; the table gives medians and FP32
SavedModel median / variant median, at batch ``--batch``, and whether the SavedModel's
conversion suggested freezing (its warning, which names ``--freeze`` for a SavedModel).

Run: ``.venv/bin/python benchmarks/savedmodels.py [--rounds 9] [--batch 8] [--write]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import provenance, publish  # noqa: E402
from keras_models import set_batch_norms  # noqa: E402
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2  # noqa: E402
from train_step import session, session_config, time_round_robin  # noqa: E402

from amp_rewrite import convert, convert_file  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402

v1 = tf.compat.v1
SECTION = "## Keras SavedModels"


def models():
    """name -> (builder, input kind)."""
    import keras
    L = keras.layers

    def text(rnn):
        ids = keras.Input((64,), dtype="int32")
        return keras.Model(ids, L.Dense(2)(rnn(128)(L.Embedding(5000, 128)(ids))))

    def mlp():
        x = keras.Input((64,))
        return keras.Model(x, L.Dense(10)(L.Dense(64, activation="relu")(
            L.Dense(64, activation="relu")(x))))

    def embedding():
        ids = keras.Input((64,), dtype="int32")
        h = L.GlobalAveragePooling1D()(L.Embedding(20000, 64)(ids))
        return keras.Model(ids, L.Dense(2)(L.Dense(64, activation="relu")(h)))

    return {"GRU text classifier (seq 64, 128 units)": (lambda: text(L.GRU), "tokens"),
            "LSTM text classifier (seq 64, 128 units)": (lambda: text(L.LSTM), "tokens"),
            "small MLP (64-64-64-10)": (mlp, "features"),
            "embedding model (20000x64, mean, 64, 2)": (embedding, "tokens"),
            "Xception (71x71, weights=None)": (lambda: keras.applications.Xception(
                weights=None, input_shape=(71, 71, 3), classifier_activation=None), "images71"),
            # weights=None leaves every batch norm an identity that folding removes; a trained
            # model's have offsets and scales (keras_models.set_batch_norms)
            "MobileNetV2 (96x96, weights=None, batch norms set)": (
                lambda: set_batch_norms(keras.applications.MobileNetV2(
                    weights=None, input_shape=(96, 96, 3), classifier_activation=None)),
                "images96")}


def _feed(kind: str, batch: int):
    rng = np.random.default_rng(0)
    if kind == "tokens":
        return rng.integers(0, 5000, (batch, 64)).astype(np.int32)
    if kind == "features":
        return rng.normal(size=(batch, 64)).astype(np.float32)
    size = int(kind.removeprefix("images"))
    return rng.uniform(0, 1, (batch, size, size, 3)).astype(np.float32)


def _load(path: Path, grappler_amp: bool):
    g = tf.Graph()
    sess = v1.Session(graph=g, config=session_config(grappler_amp))
    with g.as_default():
        meta = v1.saved_model.loader.load(sess, ["serve"], str(path))
    sig = meta.signature_def["serving_default"]
    inp = next(iter(sig.inputs.values())).name
    out = next(iter(sig.outputs.values())).name
    return sess, inp, out


def input_key(path: Path) -> str:
    """The serving signature's (one) input key: the name ``--shape`` takes."""
    sig = tf.saved_model.load(str(path)).signatures["serving_default"]
    return next(iter(sig.structured_input_signature[1]))


def _frozen(path: Path):
    """The SavedModel's serving signature frozen to Consts (docs/savedmodels.md), its input
    and output tensor names."""
    loaded = tf.saved_model.load(str(path))
    frozen = convert_variables_to_constants_v2(loaded.signatures["serving_default"])
    return frozen.graph.as_graph_def(), frozen.inputs[0].name, frozen.outputs[0].name


def measure(name: str, build, kind: str, rounds: int, batch: int) -> dict:
    import keras
    keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        fp32, ours, painted = Path(tmp) / "fp32", Path(tmp) / "bf16", Path(tmp) / "painted"
        build().export(str(fp32), verbose=False)
        value = _feed(kind, batch)
        # told the batch it runs at, as a user would (--shape); BENCHMARKS.md "Batch size and
        # weight casts" has the default's decisions across batches
        report = convert_file(fp32, ours, target="bfloat16", device="cpu",
                              shapes={input_key(fp32): value.shape})
        convert_file(fp32, painted, target="bfloat16", device="cpu", min_matrix_intensity=0)
        frozen_gd, f_in, f_out = _frozen(fp32)
        folded_gd, folded_report = convert(frozen_gd, target="bfloat16", device="cpu",
                                           fold_constants=True)
        runs = {"fp32": _load(fp32, False), "ours": _load(ours, False),
                "painted": _load(painted, False), "grappler": _load(fp32, True),
                "frozen": (session(frozen_gd, False), f_in, f_out),
                "folded": (session(folded_gd, False), f_in, f_out),
                "frozen_grappler": (session(frozen_gd, True), f_in, f_out)}
        outputs = {k: np.asarray(s.run(o, {i: value}), np.float64) for k, (s, i, o) in runs.items()}
        times = time_round_robin({k: functools.partial(s.run, o, {i: value})
                                  for k, (s, i, o) in runs.items()}, rounds, warmup=1)
        for s, _, _ in runs.values():
            s.close()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    ref = outputs["fp32"]
    err = {k: float(np.linalg.norm(outputs[k] - ref) / max(np.linalg.norm(ref), 1e-30))
           for k in ("ours", "painted", "grappler", "folded", "frozen_grappler")}
    return {"name": name, "matrix": _matrix(report), "folded_matrix": _matrix(folded_report),
            **{f"{k}_ms": v for k, v in med.items()},
            **{f"{k}_err": v for k, v in err.items()},
            # the freezing hint: its summary is set only where it fires (it named
            # --fold-constants before --freeze existed; matching its words missed it)
            "hint": bool(report.extra.get("freezing", {}).get("summary"))}


def _matrix(report) -> str:
    matrix = [n for n in report.nodes if n.op in MATRIX_OPS]
    return f"{sum(n.precision == 'bfloat16' for n in matrix)}/{len(matrix)}"


def run(rounds: int = 9, batch: int = 8, only=()) -> str:
    measured = provenance()   # the load average as it starts
    rows = []
    for name, (build, kind) in models().items():
        if only and not any(o in name for o in only):
            continue
        try:
            rows.append(measure(name, build, kind, rounds, batch))
        except Exception as exc:  # noqa: BLE001 - a model that fails is a row saying so
            rows.append({"name": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
        print(rows[-1], file=sys.stderr, flush=True)
    lines = [SECTION, "",
             "`benchmarks/savedmodels.py`: Keras models exported as TF2 SavedModels (weights "
             f"in variables), batch {batch}; FP32, amp-rewrite's bfloat16 conversion (`--device "
             f"cpu`, default options told the batch with `--shape NAME={batch},...`, and painted whole with `--min-matrix-intensity 0` as before "
             "the cost model weighed variables), grappler's "
             "`auto_mixed_precision_onednn_bfloat16` on the FP32 SavedModel, and the serving "
             "signature frozen (docs/savedmodels.md \"Frozen graphs from a SavedModel\") as it is, "
             "converted with `--fold-constants`, and painted by grappler's pass; "
             f"round-robin in one process, {rounds} rounds "
             f"after a warm-up run, medians ({hardware.describe()}); one run. {measured} Ratios "
             "are FP32 SavedModel time / variant time. \"bf16 gain frozen / as SavedModel\": "
             "what bfloat16 gains on the frozen graph (frozen FP32 / frozen with "
             "--fold-constants) over what it gains on the SavedModel (FP32 / amp-rewrite), the "
             "part of freezing's gain that comes with the conversion; freezing alone also "
             "speeds some models up in float32 (the frozen FP32 column: no function calls or "
             "variable reads), which the suggestion does not claim. \"freeze suggested\": the "
             "SavedModel's conversion warned that converting with --freeze would gain "
             "(docs/savedmodels.md \"When freezing gains\").",
             "",
             "| model | MatMul/Conv in bf16: ours / frozen, folded | FP32 ms | amp-rewrite ms "
             "(ratio) | painted whole (`--min-matrix-intensity 0`) ms (ratio) | grappler ms "
             "(ratio) | frozen FP32 ms (ratio) | frozen with --fold-constants ms (ratio) | "
             "frozen, grappler ms (ratio) | "
             "ours / grappler speed | bf16 gain frozen / as SavedModel | freeze suggested | "
             "rel. L2 error ours / painted / grappler / frozen, folded |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(r, k):
        return f"{r[k + '_ms']:.2f} ({r['fp32_ms'] / r[k + '_ms']:.2f}x)"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['matrix']} / {r['folded_matrix']} | {r['fp32_ms']:.2f} | "
            f"{cell(r, 'ours')} | {cell(r, 'painted')} | {cell(r, 'grappler')} | "
            f"{cell(r, 'frozen')} | {cell(r, 'folded')} | {cell(r, 'frozen_grappler')} | "
            f"{r['grappler_ms'] / r['ours_ms']:.2f}x | "
            f"{r['frozen_ms'] / r['folded_ms'] / (r['fp32_ms'] / r['ours_ms']):.2f}x | "
            f"{'yes' if r['hint'] else 'no'} | "
            f"{r['ours_err']:.1e} / {r['painted_err']:.1e} / {r['grappler_err']:.1e} / "
            f"{r['folded_err']:.1e} |")
    # what the models the suggestion fired for gained frozen, from this run's figures
    hinted = "; ".join(
        f"{r['name'].split(' (')[0]}'s frozen, folded conversion ran "
        f"{r['ours_ms'] / r['folded_ms']:.1f}x as fast as its SavedModel's, and bfloat16 gained "
        f"{r['frozen_ms'] / r['folded_ms'] / (r['fp32_ms'] / r['ours_ms']):.2f}x more frozen"
        for r in rows if r.get("hint")) or "none here"
    lines += ["", "A model with 0 matrix ops in bfloat16 was kept float32 whole by the cost model "
              "(docs/decisions.md \"Small matrix ops stay float32\": its variable weights, cast "
              "on every run, cost more than its matrix ops save at this batch); its SavedModel "
              "computes what the FP32 one does, so its ratio is 1 within the noise of this shared "
              f"machine. The suggestion fires where freezing lets the conversion gain: {hinted} "
              "(the weights' casts gone, the batch norms folded into the convolutions and their "
              "activations fused). The GRU and LSTM frozen conversions keep their loops' matrix "
              "ops float32 (weighed per row of a step: the gates' Sigmoid and Tanh lose more than "
              "the MatMuls save, docs/decisions.md) where grappler's painting of the frozen graph "
              "ran slower than frozen float32; the small MLP's and the embedding model's keep every matrix op "
              "float32, frozen as well, so what freezing gains them (a fraction of a millisecond "
              "a run) is no conversion's: the suggestion stays quiet for all four."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--only", action="append", default=[], help="model names to run")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    return publish(run(args.rounds, args.batch, args.only), args.write)


if __name__ == "__main__":
    sys.exit(main())
