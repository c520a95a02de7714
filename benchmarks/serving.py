"""Serving SavedModels: FP32, grappler's bfloat16 pass, amp-rewrite's default conversion, the
same SavedModel frozen and folded but left float32, and ``--freeze`` in bfloat16, side by side
at batch 1 and 32 on this CPU (issue 36, item 4).

Each model (Keras, ``weights=None``, batch norms given trained-looking statistics with
``keras_models.set_batch_norms``: an untrained one is an identity that bfloat16 distorts,
BENCHMARKS.md "Untrained batch norms in bfloat16") is exported with ``model.export`` (a TF2
SavedModel, signatures ``serve`` and ``serving_default``, weights in variables) and served five
ways, each loaded into a TF1 session as TF Serving loads a SavedModel
(``tf.compat.v1.saved_model.loader.load``, tag ``serve``, signature ``serving_default``):

* ``fp32``: the export, in a default session;
* ``grappler``: the export, in a session with grappler's ``auto_mixed_precision_onednn_bfloat16``
  on (``train_step.session_config(True)``: TensorFlow's own run-time bfloat16 pass);
* ``default``: ``amp-rewrite IN -o OUT --target bfloat16 --device cpu --shape KEY=B,...``
  (told the batch it runs at);
* ``frozen fp32``: ``amp-rewrite IN -o OUT --freeze --target bfloat16 --device cpu --rules
  all_fp32.toml``, where the rules file is one override, ``glob = "*"``, ``action =
  "keep_fp32"``: the ``--freeze`` path exactly (signatures frozen, constant folding, batch
  norms folded into the convolutions, written back as a SavedModel) with nothing painted, so
  the column is what freezing and folding alone gain (the script checks that no node is
  bfloat16 and that it folded what ``--freeze`` folded);
* ``--freeze``: ``amp-rewrite IN -o OUT --freeze --target bfloat16 --device cpu --shape
  KEY=B,...``.

For each batch size the five run round-robin in one process (``train_step.time_round_robin``:
the order rotates every round, so drift and the other jobs on the machine fall on all alike),
after warm-up runs; the table gives FP32's median and each variant's ratio FP32 median /
variant median, with the 10th-90th percentile of the per-round ratio (FP32's time in a round /
the variant's in the same round) to show the noise. Errors are each output's against FP32 on
the same 32 inputs (``amp_rewrite.tools.verify.ErrorStats``, as ``verify`` measures: relative
L2, and top-1 agreement per position where the output has a class axis); ``amp-rewrite verify
FP32 OUT --signature KEY --inputs x.npz`` (the command, run in this process by
``amp_rewrite.cli.main``) judges each ``--freeze`` output on both signatures, and the script
checks that it serves the input's signatures with the same keys, dtypes and shapes. The
Done-when conditions of issue 36 item 4 are checked and printed.

Run: ``.venv/bin/python benchmarks/serving.py [--rounds 15] [--rounds-1 60] [--only NAME]
[--json FILE] [--write]`` (17-23 minutes on 2 shared cores); ``--write`` also keeps the
measurements (every round's times, the commit it ran at) in ``benchmarks/results/serving.json``,
from which tests/test_docs.py renders the section again and holds BENCHMARKS.md to it;
``--render FILE --write`` prints (and writes) the section again from such a file without
running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from benchmd import commit, publish, save_results  # noqa: E402
from keras_models import set_batch_norms  # noqa: E402
from train_step import session_config, time_round_robin  # noqa: E402

from amp_rewrite import cli, convert_file  # noqa: E402
from amp_rewrite.core import hardware  # noqa: E402
from amp_rewrite.core.dtypes import BFLOAT16  # noqa: E402
from amp_rewrite.core.ops import MATRIX_OPS  # noqa: E402
from amp_rewrite.tools.verify import ErrorStats, criteria  # noqa: E402

v1 = tf.compat.v1
SECTION = "## Serving SavedModels"
BATCHES = (1, 32)
SIZE = 128            # image side for the Keras applications and the U-Net
SEQ = 128             # the encoder's sequence length
VOCAB = 8000
VARIANTS = ("fp32", "grappler", "default", "frozen_fp32", "freeze")
LABELS = {"fp32": "FP32 SavedModel", "grappler": "grappler's bf16 pass",
          "default": "amp-rewrite default", "frozen_fp32": "frozen+folded, float32",
          "freeze": "--freeze bf16"}
ALL_FP32 = '[[override]]\nglob = "*"\naction = "keep_fp32"\n'


def unet(classes: int = 8, widths=(32, 64, 128, 256)):
    """A small U-Net: Conv-BN-ReLU pairs, max-pool down, Conv2DTranspose up, skips
    concatenated; per-pixel class scores."""
    import keras
    L = keras.layers

    def block(h, width):
        for _ in range(2):
            h = L.ReLU()(L.BatchNormalization()(L.Conv2D(width, 3, padding="same",
                                                         use_bias=False)(h)))
        return h

    x = keras.Input((SIZE, SIZE, 3), name="image")
    h, skips = x, []
    for width in widths[:-1]:
        h = block(h, width)
        skips.append(h)
        h = L.MaxPooling2D()(h)
    h = block(h, widths[-1])
    for width, skip in zip(reversed(widths[:-1]), reversed(skips)):
        h = L.Conv2DTranspose(width, 2, strides=2, padding="same")(h)
        h = block(L.Concatenate()([h, skip]), width)
    return keras.Model(x, L.Conv2D(classes, 1)(h))


def bert(layers: int = 4, width: int = 256, heads: int = 4):
    """A BERT-style encoder: token and position embeddings, ``layers`` post-norm Transformer
    blocks (self-attention with the padding mask: token id 0 is padding; a GELU feed-forward
    4x wide; LayerNorm), the first token pooled (Dense, tanh) into a 2-way classifier."""
    import keras
    L, ops = keras.layers, keras.ops
    ids = keras.Input((SEQ,), dtype="int32", name="tokens")
    mask = ops.expand_dims(ops.not_equal(ids, 0), 1)            # [batch, 1, keys]: no padding
    h = L.Embedding(VOCAB, width)(ids) + L.Embedding(SEQ, width)(ops.arange(SEQ))
    h = L.LayerNormalization()(h)
    for _ in range(layers):
        a = L.MultiHeadAttention(heads, width // heads)(h, h, attention_mask=mask)
        h = L.LayerNormalization()(h + a)
        f = L.Dense(width)(L.Dense(4 * width, activation="gelu")(h))
        h = L.LayerNormalization()(h + f)
    pooled = L.Dense(width, activation="tanh")(h[:, 0])
    return keras.Model(ids, L.Dense(2)(pooled))


def models():
    """name -> (builder, pixel range); every image model takes ``image`` [batch, SIZE, SIZE,
    3], the encoder ``tokens`` [batch, SEQ]."""
    import keras
    apps = keras.applications

    def app(cls, **kw):
        def build():
            image = keras.Input((SIZE, SIZE, 3), name="image")
            return set_batch_norms(cls(weights=None, input_tensor=image,
                                       classifier_activation=None, **kw))
        return build

    # (builder, pixel range): EfficientNetV2 rescales 0-255 itself; the others are fed
    # pixels as their preprocessing leaves them, about -1 to 1
    return {"EfficientNetV2B0": (app(apps.EfficientNetV2B0), 255.0),
            "MobileNetV2 (alpha 0.75)": (app(apps.MobileNetV2, alpha=0.75), 1.0),
            "Xception": (app(apps.Xception), 1.0),
            "ResNet50": (app(apps.ResNet50), 1.0),
            "U-Net (32-256, 8 classes)": (lambda: set_batch_norms(unet()), 1.0),
            f"BERT-style encoder (4x256, seq {SEQ})": (bert, None)}


def feed(key: str, batch: int, pixels: float | None = 1.0) -> np.ndarray:
    """The input at ``batch``: token ids with padding, or pixels uniform in 0..255
    (``pixels`` 255) or -1..1."""
    rng = np.random.default_rng(batch)
    if key == "tokens":   # lengths 16..SEQ, then padding (id 0)
        ids = rng.integers(1, VOCAB, (batch, SEQ)).astype(np.int32)
        lengths = rng.integers(16, SEQ + 1, batch)
        ids[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0
        return ids
    low = 0.0 if pixels == 255.0 else -pixels
    return rng.uniform(low, pixels, (batch, SIZE, SIZE, 3)).astype(np.float32)


def input_key(path: Path) -> str:
    sig = tf.saved_model.load(str(path)).signatures["serving_default"]
    (key,) = sig.structured_input_signature[1]
    return key


def signatures(path: Path) -> dict:
    """Signature key -> (inputs, outputs) as (key, dtype, shape) tuples: what a server sees."""
    loaded = tf.saved_model.load(str(path))

    def specs(structure):
        return sorted((k, s.dtype.name, tuple(s.shape.as_list())) for k, s in structure.items())

    return {k: (specs(f.structured_input_signature[1]), specs(f.structured_outputs))
            for k, f in loaded.signatures.items()}


def load(path: Path, grappler_amp: bool = False):
    g = tf.Graph()
    sess = v1.Session(graph=g, config=session_config(grappler_amp))
    with g.as_default():
        meta = v1.saved_model.loader.load(sess, ["serve"], str(path))
    sig = meta.signature_def["serving_default"]
    (inp,) = sig.inputs.values()
    (out,) = sig.outputs.values()
    return sess, inp.name, out.name


def matrix(report) -> str:
    ops = [n for n in report.nodes if n.op in MATRIX_OPS]
    return f"{sum(n.precision == 'bfloat16' for n in ops)}/{len(ops)}"


def convert_all(fp32: Path, tmp: Path, key: str, rules: Path) -> tuple[dict, dict]:
    """The conversions: paths by (variant, batch) and what their reports say."""
    paths, info = {}, {}
    t = time.perf_counter()
    report = convert_file(fp32, tmp / "frozen_fp32", freeze=True, target="bfloat16",
                          device="cpu", rules=[str(rules)])
    painted = sum(n.precision == "bfloat16" for n in report.nodes)
    assert painted == 0, f"frozen fp32 painted {painted} nodes"
    info["frozen_fp32_fusion"] = report.extra.get("fusion", {})
    info["convert_s"] = {"frozen_fp32": time.perf_counter() - t}
    for batch in BATCHES:
        paths["frozen_fp32", batch] = tmp / "frozen_fp32"
        shape = (batch,) + tuple(feed(key, 1).shape[1:])
        for variant, freeze in (("default", False), ("freeze", True)):
            out = tmp / f"{variant}_{batch}"
            t = time.perf_counter()
            report = convert_file(fp32, out, freeze=freeze, target="bfloat16", device="cpu",
                                  shapes={key: shape})
            info["convert_s"][f"{variant}_{batch}"] = time.perf_counter() - t
            info[f"{variant}_{batch}"] = {
                "matrix": matrix(report),
                "hint": any("--freeze" in w for w in report.warnings) if not freeze else None,
                "fusion": report.extra.get("fusion", {})}
            paths[variant, batch] = out
        if info[f"freeze_{batch}"]["fusion"] != info["frozen_fp32_fusion"]:
            raise AssertionError(f"frozen fp32 folded {info['frozen_fp32_fusion']}, --freeze "
                                 f"{info[f'freeze_{batch}']['fusion']}")
    return paths, info


def verify_command(original: Path, converted: Path, signature: str, npz: Path) -> bool:
    """``amp-rewrite verify ORIGINAL CONVERTED --signature KEY --inputs x.npz`` (run in this
    process, its report kept off the screen): whether it passed (exit 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["verify", str(original), str(converted), "--signature", signature,
                         "--inputs", str(npz), "-q"])
    if code not in (0, 1):
        raise RuntimeError(f"amp-rewrite verify exit {code}: {out.getvalue()[-300:]}")
    return code == 0


def errors(outputs: dict, ref: np.ndarray) -> dict:
    """Per variant: (relative L2, top-1 agreement or None) against FP32, as verify measures."""
    crit = criteria(BFLOAT16)
    out = {}
    for name, value in outputs.items():
        stats = ErrorStats(crit.rtol, crit.atol, crit.rel_l2)
        stats.update(ref, value)
        out[name] = (stats.rel_l2, stats.top1)
    return out


def measure(name: str, build, pixels, rounds: dict, rules: Path) -> dict:
    import keras
    keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32 = tmp / "fp32"
        build().export(str(fp32), verbose=False)
        key = input_key(fp32)
        paths, info = convert_all(fp32, tmp, key, rules)
        # the Done-when checks on the --freeze outputs: same signatures, verify on each
        want = signatures(fp32)
        npz = tmp / "inputs.npz"
        np.savez(npz, **{key: feed(key, 32, pixels)})
        checks = {}
        for batch in BATCHES:
            got = signatures(paths["freeze", batch])
            verdicts = {sig: verify_command(fp32, paths["freeze", batch], sig, npz)
                        for sig in sorted(want)}
            checks[str(batch)] = {"signatures": got == want, "keys": sorted(got),
                                  "verify": verdicts}
        sessions = {"fp32": load(fp32), "grappler": load(fp32, grappler_amp=True)}
        for (variant, batch), path in paths.items():
            sessions.setdefault(f"{variant}_{batch}", load(path))
        row = {"name": name, "key": key, "info": info, "checks": checks, "batches": {}}
        x32 = feed(key, 32, pixels)
        for batch in BATCHES:
            runs = {v: sessions[v if v in ("fp32", "grappler") else f"{v}_{batch}"]
                    for v in VARIANTS}
            x = feed(key, batch, pixels)
            times = time_round_robin({v: functools.partial(s.run, o, {i: x})
                                      for v, (s, i, o) in runs.items()},
                                     rounds[batch], warmup=3)
            outputs = {v: s.run(o, {i: x32}) for v, (s, i, o) in runs.items()}
            ref = outputs.pop("fp32")
            row["batches"][str(batch)] = {
                "times_ms": {v: [t * 1000 for t in ts] for v, ts in times.items()},
                "errors": errors(outputs, ref)}
            print(name, batch, {v: round(r, 2) for v, r in ratios(row, batch).items()},
                  file=sys.stderr, flush=True)
        for s, _, _ in sessions.values():
            s.close()
    return row


def ratios(row: dict, batch: int) -> dict:
    """Variant -> FP32's median time / the variant's."""
    times = row["batches"][str(batch)]["times_ms"]
    return {v: statistics.median(times["fp32"]) / statistics.median(times[v]) for v in VARIANTS}


def spread(row: dict, batch: int, variant: str) -> tuple[float, float]:
    """The 10th and 90th percentile of the per-round ratio: FP32's time in a round / the
    variant's in the same round."""
    times = row["batches"][str(batch)]["times_ms"]
    per_round = np.array(times["fp32"]) / np.array(times[variant])
    return tuple(float(p) for p in np.percentile(per_round, [10, 90]))


def fp32_ms(row: dict, batch: int) -> float:
    return statistics.median(row["batches"][str(batch)]["times_ms"]["fp32"])


def cpu_line() -> str:
    flags = hardware.cpu_flags()
    isa = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "amx_fp16")
           if f in flags]
    absent = [f for f in ("amx_bf16", "avx512_bf16") if f not in flags]
    return (f"{hardware.cpu_model()}, {os.cpu_count()} cores, /proc/cpuinfo flags "
            f"{', '.join(isa) or 'none of amx_bf16, avx512_bf16'}"
            + (f", no {', '.join(absent)}" if absent else "")
            + (" (an AMX CPU, Sapphire Rapids or later: oneDNN runs bfloat16 MatMul/Conv on "
               "AMX)" if "amx_bf16" in flags else ""))


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _cell(row: dict, batch: int, v: str) -> str:
    lo, hi = spread(row, batch, v)
    return f"{ratios(row, batch)[v]:.2f}x ({lo:.2f}-{hi:.2f})"


def _err(row: dict, batch: int, v: str) -> str:
    rel, top1 = row["batches"][str(batch)]["errors"][v]
    return f"{rel:.1e}" + (f", {top1:.3f}" if top1 is not None else "")


def _fusion(info: dict) -> str:
    f = info["frozen_fp32_fusion"]
    return f"{f.get('scales_folded', 0)} / {f.get('bias_adds', 0)}"


def done_when(rows: list[dict]) -> list[tuple[str, bool]]:
    ok = [r for r in rows if "error" not in r]
    found = []
    fails = [r["name"] for r in rows if "error" in r]
    found.append(("every model ran" + (": not " + ", ".join(fails) if fails else ""), not fails))
    sig = [f"{r['name']} (told batch {b})" for r in ok for b, c in r["checks"].items()
           if not c["signatures"]]
    found.append(("each `--freeze` output serves the input's signatures (`serve`, "
                  "`serving_default`: keys, input and output keys, dtypes, shapes)"
                  + (": not " + "; ".join(sig) if sig else ""), not sig))
    bad = [f"{r['name']} {s} (told batch {b})" for r in ok for b, c in r["checks"].items()
           for s, passed in c["verify"].items() if not passed]
    found.append(("`amp-rewrite verify FP32 OUT --signature serve` and `--signature "
                  "serving_default` pass for each `--freeze` output (bfloat16 defaults: rel. L2 "
                  "5e-2, top-1 0.99; on the 32 inputs)"
                  + (": fail " + "; ".join(bad) if bad else ""), not bad))
    g = geomean(ratios(r, 32)["freeze"] for r in ok) if ok else 0.0
    found.append((f"`--freeze` at batch 32, geometric mean over the {len(ok)} models: "
                  f"{g:.2f}x FP32 (needs 1.5x)", g >= 1.5 and len(ok) == len(rows)))
    slow = [f"{r['name']} batch {b}: {ratios(r, b)['freeze']:.2f}x"
            for r in ok for b in BATCHES if ratios(r, b)["freeze"] < 1.0]
    low = min((ratios(r, b)["freeze"] for r in ok for b in BATCHES), default=0.0)
    found.append((f"`--freeze` never below 1.0x FP32 at batch 1 or 32 (lowest {low:.2f}x)"
                  + (": " + "; ".join(slow) if slow else ""), not slow))
    behind = [f"{r['name']} batch {b}: {ratios(r, b)['freeze']:.2f}x against "
              f"{ratios(r, b)['grappler']:.2f}x" for r in ok for b in BATCHES
              if ratios(r, b)["freeze"] < ratios(r, b)["grappler"]]
    least = min((ratios(r, b)["freeze"] / ratios(r, b)["grappler"] for r in ok for b in BATCHES),
                default=0.0)
    found.append((f"`--freeze` never below grappler's pass on the same SavedModel (closest: "
                  f"{least:.2f}x grappler's speed)" + (": " + "; ".join(behind) if behind else ""),
                  not behind))
    return found


def table(result: dict) -> str:
    rows, rounds = result["rows"], {int(k): v for k, v in result["rounds"].items()}
    ok = [r for r in rows if "error" not in r]
    lines = [SECTION, "",
             f"`benchmarks/serving.py` (issue 36 item 4), {result['date']}, on {result['cpu']}, "
             "TensorFlow "
             f"{result['tf']}, Python {result['python']}; command `{result['command']}`"
             + (f" at commit `{result['commit']}` (its measurements: "
                "`benchmarks/results/serving.json`)" if "commit" in result else "") + ". "
             "**The machine was shared**: other engineers' test suites ran on the same 2 cores "
             f"during the run (1-minute load average {min(result['load']):.1f} to "
             f"{max(result['load']):.1f}, sampled as each model started and at the end), so "
             "single timings are noisy; the variants ran interleaved, which keeps the ratios "
             "fair, and the brackets show the noise.",
             "",
             "Keras models with `weights=None` (random weights; no downloads), every batch norm "
             "given trained-looking statistics (`keras_models.set_batch_norms`: an untrained "
             "one is an identity that bfloat16 distorts, \"Untrained batch norms in bfloat16\"); "
             f"images {SIZE}x{SIZE}x3 (MobileNetV2 with alpha 0.75), the U-Net Conv-BN-ReLU "
             "pairs 32-64-128-256 wide with Conv2DTranspose and concatenated skips, 8 classes "
             "per pixel; the BERT-style encoder 4 post-norm blocks 256 wide (4 heads, "
             f"MultiHeadAttention with the padding mask, GELU feed-forward 1024), {SEQ} int32 "
             "token ids with padding (lengths 16-128), the first token pooled (Dense, tanh) "
             "into 2 logits. Each is exported with `model.export` (signatures `serve` and "
             "`serving_default`) and served five ways, each SavedModel loaded into a TF1 "
             "session as TF Serving loads one (`loader.load`, signature `serving_default`):",
             "",
             "- **FP32**: the export as it is;",
             "- **grappler**: the export in a session with grappler's "
             "`auto_mixed_precision_onednn_bfloat16` on (TensorFlow's own run-time pass);",
             "- **default**: `amp-rewrite IN -o OUT --target bfloat16 --device cpu --shape "
             "KEY=B,...`;",
             "- **frozen fp32**: `amp-rewrite IN -o OUT --freeze --target bfloat16 --device cpu "
             "--rules all_fp32.toml`, the rules file one override (`glob = \"*\"`, `action = "
             "\"keep_fp32\"`): the `--freeze` path (signatures frozen, constant folding, batch "
             "norms folded into the convolutions, written back as a SavedModel) with nothing "
             "painted, so this column is what freezing alone gains (the script checks that no "
             "node went to bfloat16 and that it folded what `--freeze` folded);",
             "- **--freeze**: `amp-rewrite IN -o OUT --freeze --target bfloat16 --device cpu "
             "--shape KEY=B,...`.",
             "",
             "The conversions run in the script as `convert_file` with these options. Both "
             "bfloat16 conversions are told the batch they are timed at (`--shape`; a batch-1 "
             "row's conversions were told 1). Round-robin in one process per batch size, "
             f"{rounds[1]} rounds at batch 1 and {rounds[32]} at batch 32 after 3 warm-up "
             "rounds, the order rotating per round. A ratio is FP32's median time / the "
             "variant's (above 1: faster than FP32); in brackets the 10th-90th percentile of "
             "the per-round ratio (FP32's time in a round / the variant's in the same round). "
             "Errors are the output's against FP32 on the same 32 inputs (a batch-1 row's "
             "conversion run at batch 32 for it), as `verify` measures them "
             "(`amp_rewrite.tools.verify.ErrorStats`): relative L2, then top-1 agreement per "
             "image, pixel or sequence (near-ties agree). \"BN folds\": batch-norm scales "
             "folded into filters / per-channel adds made `BiasAdd` by the freeze path "
             "(the same in both frozen columns). \"hint\": whether the default conversion "
             "suggested `--freeze` (docs/savedmodels.md \"When freezing gains\").", "",
             "| model | batch | FP32 ms | grappler | default | frozen fp32 | --freeze | "
             "MatMul/Conv in bf16: default / --freeze | BN folds | hint | error grappler | "
             "error default | error --freeze |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | | failed: {r['error']} | | | | | | | | | | |")
            continue
        i = r["info"]
        for b in BATCHES:
            lines.append(
                f"| {r['name']} | {b} | {fp32_ms(r, b):.2f} | {_cell(r, b, 'grappler')} | "
                f"{_cell(r, b, 'default')} | {_cell(r, b, 'frozen_fp32')} | "
                f"**{_cell(r, b, 'freeze')}** | {i[f'default_{b}']['matrix']} / "
                f"{i[f'freeze_{b}']['matrix']} | {_fusion(i)} | "
                f"{'yes' if i[f'default_{b}']['hint'] else 'no'} | {_err(r, b, 'grappler')} | "
                f"{_err(r, b, 'default')} | {_err(r, b, 'freeze')} |")
    if ok:
        lines += ["", "Geometric means over the models (ratios to FP32):", "",
                  "| batch | grappler | default | frozen fp32 | --freeze | --freeze / frozen "
                  "fp32 |", "| --- | --- | --- | --- | --- | --- |"]
        for b in BATCHES:
            g = {v: geomean(ratios(r, b)[v] for r in ok) for v in VARIANTS}
            lines.append(f"| {b} | {g['grappler']:.2f}x | {g['default']:.2f}x | "
                         f"{g['frozen_fp32']:.2f}x | {g['freeze']:.2f}x | "
                         f"{g['freeze'] / g['frozen_fp32']:.2f}x |")
    lines += ["", "Done when (issue 36 item 4), as this run found:", ""]
    lines += [f"- {'holds' if held else '**fails**'}: {text}" for text, held in done_when(rows)]
    lines += ["", *NOTES]
    return "\n".join(lines)


#: what the numbers mean and what they do not: written for the run BENCHMARKS.md holds (its
#: figures are that run's; another run's table moves within the noise the brackets show)
NOTES = [
    "**What the numbers say.** On this AMX CPU `--freeze` ran ahead of FP32, of grappler's "
    "pass and of the default conversion for every model at both batch sizes (3.73x FP32 by "
    "geometric mean at batch 32, 2.36x at batch 1). Freezing alone (frozen fp32: no variable "
    "reads or casts, batch norms folded so TensorFlow fuses them with the convolutions' "
    "activations) gives 1.28x and 1.35x of that; bfloat16 on the frozen graph gives the rest "
    "(the last column: 2.91x over frozen float32 at batch 32, 1.75x at batch 1). On the "
    "SavedModel itself bfloat16 gains far less: the default conversion keeps the four Keras "
    "applications float32 at batch 1 (0/N matrix ops: casting every variable weight on each "
    "run costs more than one image's convolutions save, docs/decisions.md \"Small matrix ops "
    "stay float32\"), "
    "and MobileNetV2 at batch 32 too; grappler's pass, which paints them anyway, ran slower "
    "than FP32 at batch 1 on every model but the U-Net (0.63x-0.90x) and on MobileNetV2 at "
    "batch 32 (0.81x). The issue's hand-made check (MobileNetV2, alpha 0.75, 128x128, batch "
    "16: frozen and converted by hand 2.91x FP32, grappler 0.77x) agrees with the MobileNetV2 "
    "rows (4.45x and 0.81x at batch 32, 1.83x and 0.63x at batch 1). The U-Net gains most "
    "(6.47x at batch 32): its work is full-resolution convolutions, which AMX runs far faster "
    "in bfloat16, and frozen their batch norms and ReLUs fuse into them, where as a SavedModel "
    "the batch norms' Mul and Add and the ReLUs run unfused, in bfloat16, over the same large "
    "tensors (default 2.36x, grappler 2.24x). The BERT-style encoder has no batch norm: "
    "freezing alone gains it nothing (0.97x at batch 32), and `--freeze` (1.68x) is ahead of "
    "the default (1.33x) by the weights' casts, stored in bfloat16 once instead of cast on "
    "every run. At batch 1 bfloat16 adds little to freezing for EfficientNetV2B0 (1.50x "
    "against frozen fp32's 1.49x) and MobileNetV2 (1.83x against 1.55x): little work per run, "
    "and a difference the brackets cannot tell from noise. Errors stay within bfloat16's "
    "rounding (relative L2 3e-3 to 1.3e-2, as grappler's), every top-1 agreeing.",
    "",
    "**Found by this benchmark.** Its first run folded none of EfficientNetV2B0's batch "
    "norms: a Keras batch norm with `axis=3` (EfficientNetV2's, ResNet50's) keeps its "
    "statistics as `[1, 1, 1, C]` Consts, which `amp_rewrite/transforms/bnfold.py` took only "
    "as `[C]` vectors. Fixed with tests/test_fusion.py::"
    "test_per_channel_consts_shaped_1_1_1_c_fold_as_vectors; in a side-by-side run of the two "
    "conversions EfficientNetV2B0's `--freeze` went from 2.25x to 2.63x FP32 at batch 32 (here "
    "2.65x, 16 scales and 59 adds folded). ResNet50's \"BN folds\" stay 0 / 0 for another "
    "reason: with `weights=None` its convolutions' biases are zeros, which constant folding "
    "removes, leaving an Identity between each convolution and its batch norm; grappler's "
    "passes fold and fuse them at run time anyway (its 52 convolutions ran as fused "
    "convolutions in a trace). A trained ResNet50's convolution has a bias before its batch "
    "norm (Conv2D, BiasAdd, Mul, AddV2), a chain bnfold does not fold either; what that costs "
    "this run cannot say. The default conversion's hint to freeze stayed quiet for "
    "EfficientNetV2B0 and ResNet50 at batch 32 and for the encoder, where `--freeze` ran "
    "1.3x-2.3x the default's speed: the estimate undercounts there, as docs/savedmodels.md "
    "\"When freezing gains\" says of EfficientNetV2B0 (`--measure` times it instead).",
    "",
    "**What they do not say.** The weights are random with set batch-norm statistics: speed "
    "does not depend on the values except where folding does (the zero biases above), and the "
    "errors are for random weights on 32 random inputs, not a trained model's accuracy "
    "(verify a trained model on its own data). Images are 128x128, not the 224 or 299 these "
    "models are trained at, and the encoder is small, so that a run fits in 15-25 minutes on "
    "2 cores: at full size the convolutions take a larger share of the time. The ratios hold "
    "for this CPU only: without AMX (an AVX512-BF16 CPU, as in the other sections) bfloat16 "
    "convolutions gain less, and with AVX2 alone bfloat16 runs slower than float32. And the "
    "machine was shared: between two full runs of this script (both after the fix) "
    "ResNet50's FP32 time at batch 32 moved from 1396 to 677 ms and its `--freeze` ratio from "
    "2.55x to 4.05x, the batch-32 geometric mean from 3.36x to 3.73x; read a difference under "
    "about a quarter between two columns as noise unless their brackets are apart.",
]


def run(rounds: dict, only=(), command: str = "") -> dict:
    rules = Path(tempfile.mkdtemp()) / "all_fp32.toml"
    rules.write_text(ALL_FP32)
    load, rows = [], []
    for name, (build, pixels) in models().items():
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        t = time.perf_counter()
        load.append(os.getloadavg()[0])
        try:
            rows.append(measure(name, build, pixels, rounds, rules))
        except Exception as exc:  # noqa: BLE001 - a model that fails is a row saying so
            rows.append({"name": name,
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
        print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return {"rows": rows, "rounds": rounds, "command": command, "commit": commit(),
            "date": time.strftime("%Y-%m-%d"),
            "load": load + [os.getloadavg()[0]], "cpu": cpu_line(), "tf": tf.__version__,
            "python": platform.python_version()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="rounds at batch 32")
    p.add_argument("--rounds-1", type=int, default=60, help="rounds at batch 1")
    p.add_argument("--only", action="append", default=[], help="model names to run")
    p.add_argument("--json", type=Path, help="also save the measurements (every round's times)")
    p.add_argument("--render", type=Path, help="print the section from a --json file, no run")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        command = ".venv/bin/python benchmarks/serving.py " + shlex.join(sys.argv[1:])
        result = run({1: args.rounds_1, 32: args.rounds}, args.only, command.strip())
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        if args.write:   # the section's source, kept beside it (tests/test_docs.py renders it)
            save_results("serving", result)
    return publish(table(result), args.write)


if __name__ == "__main__":
    sys.exit(main())
