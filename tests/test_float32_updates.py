"""Everything from the unscaled gradients to the variable writes runs in float32 (docs/training.md
"Updates in float32"), whatever optimizer wrote it, in function bodies and in graphs.

A hand-written AdamW step (tests/hand_optimizers.py) converted to float16 used to diverge: its
moment math was painted float16 and fed an unscaled gradient cast back to float16, so
``(1 - b2) * g * g`` rounded to zero (issue 34). Here it trains on the digits like FP32, saved as
a signature and as a method; a TF1 graph with a hand-written momentum update and tiny gradients
trains too; the dtypes on every path from a gradient to a write are read from the saved protos
(not from the converter's report); the lint refuses a body edited to break the rule.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from hand_optimizers import HandAdamW, save, sixteen_bit, update_nodes
from saved_trainers import digits
from tensorflow.core.framework import attr_value_pb2, types_pb2
from tensorflow.python.saved_model import loader_impl
from training_graphs import Trainer, build

from amp_rewrite import convert_file
from amp_rewrite.check.lint import lint, lint_problems
from amp_rewrite.conversion.pipeline import Options, convert_model
from amp_rewrite.core.errors import LintError
from amp_rewrite.core.ir import TensorRef
from amp_rewrite.io.load import Model
from amp_rewrite.schema.functiondef import function_to_graph
from amp_rewrite.schema.snapshot import Before

HALF = types_pb2.DT_HALF
TRAIN = 1400


def _library(path):
    meta = loader_impl.parse_saved_model(str(path)).meta_graphs[0]
    return meta.graph_def.library


def _train_bodies(path, report) -> list:
    library = _library(path)
    names = set(report.to_dict()["loss_scaling"]["functions"])
    return [f for f in library.function if f.signature.name in names]


@pytest.fixture(scope="module", params=["signature", "method"])
def hand_adamw(request, tmp_path_factory):
    """HandAdamW(0) saved with its train step as a signature or only as a method, converted to
    float16 (dynamic loss scaling): (folder, report)."""
    folder = tmp_path_factory.mktemp(f"hand_adamw_{request.param}")
    save(HandAdamW(0), folder / "fp32", as_signature=request.param == "signature")
    return folder, convert_file(folder / "fp32", folder / "f16", target="float16")


def test_the_update_of_a_hand_written_adamw_is_float32_in_the_saved_body(hand_adamw):
    """Every node between the tape and the writes (moments, bias corrections, warmup, weight
    decay, the step) has float32 type attributes in the saved FunctionDef, the forward and
    backward MatMuls are float16, and no Cast on that way goes to 16 bits."""
    folder, report = hand_adamw
    bodies = _train_bodies(folder / "f16", report)
    assert bodies
    library = _library(folder / "f16")
    for body in bodies:
        region = update_nodes(body.node_def, library)
        ops = [n.op for n in region.values()]
        # per weight, on the data path from g: 0.1 * g, 0.001 * g and its * g (what follows
        # reads the moments back from their variables); the sums into m and v
        assert ops.count("Mul") >= 3 * len(HandAdamW(0).params), ops
        assert ops.count("AddV2") >= 2 * len(HandAdamW(0).params), ops
        painted = {name: sixteen_bit(n) for name, n in region.items() if sixteen_bit(n)}
        assert not painted, painted
        matmuls = [n for n in body.node_def if n.op == "MatMul"]
        assert len(matmuls) == 2 + 3 and all(n.attr["T"].type == HALF for n in matmuls)


def test_a_hand_written_adamw_trains_in_float16_like_fp32(hand_adamw, capsys):
    """200 steps on the digits, the FP32 SavedModel and the converted one on the same batches:
    no NaN loss, and the held-out accuracy within 3 points of FP32's (before the fix: NaN from
    step 18, 175 steps skipped, 0.51 against 1.00 in the issue's BERT-style model)."""
    folder, _ = hand_adamw
    x, y = digits()
    fp32, half = (tf.saved_model.load(str(folder / n)) for n in ("fp32", "f16"))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(200):
        idx = rng.choice(TRAIN, 64, replace=False)
        fp32.train_step(x[idx], y[idx])
        losses.append(float(half.train_step(x[idx], y[idx])["loss"]))

    def accuracy(model):
        logits = model.serve(tf.constant(x[TRAIN:]))["logits"].numpy()
        return float(np.mean(np.argmax(logits, 1) == y[TRAIN:]))
    theirs, ours = accuracy(fp32), accuracy(half)
    skipped = int(half.amp_loss_scale.skipped_steps.numpy())
    with capsys.disabled():
        print(f"\nhand AdamW: FP32 {theirs:.3f}, float16 {ours:.3f}, {skipped} steps skipped")
    assert all(math.isfinite(v) for v in losses)
    assert theirs > 0.85 and ours >= theirs - 0.03
    assert skipped <= 2
    assert float(half.amp_loss_scale.scale.numpy()) >= 2.0 ** 14


def test_bfloat16_keeps_the_update_float32_too(tmp_path):
    """bfloat16 needs no loss scaling, but a small step added to a weight rounds away in its
    8-bit mantissa just the same: the update stays float32 there too."""
    save(HandAdamW(0), tmp_path / "fp32", as_signature=True)
    report = convert_file(tmp_path / "fp32", tmp_path / "bf16", target="bfloat16",
                          min_matrix_intensity=0)
    assert "loss_scaling" not in report.to_dict()
    library = _library(tmp_path / "bf16")
    trained = [f for f in library.function if f.signature.name.startswith("__inference_train_step")]
    assert trained
    for body in trained:
        region = update_nodes(body.node_def, library)
        assert region and not {name for name, n in region.items() if sixteen_bit(n)}
        assert any(n.op == "MatMul" and n.attr["T"].type == types_pb2.DT_BFLOAT16
                   for n in body.node_def)
    codes = {n.code for n in report.nodes if n.name.split("/", 1)[-1] in
             update_nodes(trained[0].node_def, library)}
    assert "update" in codes


def _convert_meta(meta):
    model = Model(Path("train.meta"), "metagraph", False, (meta,))
    converted, report = convert_model(model, Options(target="float16", device="cpu"))
    return converted.meta_graph, report


def test_a_tf1_hand_written_momentum_update_trains_on_tiny_gradients():
    """A TF1 graph whose momentum is written by hand (velocity = 0.9 velocity + g, w -= lr *
    velocity), its loss times 1e-7 and its learning rate times 1e7: FP32 trains as usual, the
    float16 gradients are about 1e-9, fine while scaled, zero if the unscaled gradient were
    rounded back to float16 for the update. The update's nodes stay float32 in the GraphDef."""
    meta = build("mlp", "momentum", backprop="hand_momentum", loss_factor=1e-7, lr_factor=1e7)
    out, report = _convert_meta(meta)
    assert report.extra["loss_scaling"]["mode"] == "dynamic"
    region = update_nodes(out.graph_def.node, scope="gradients/")
    # 0.9 * velocity + g into the velocity (the step reads the velocity back)
    assert sum(n.op == "AddV2" for n in region.values()) >= 4
    assert not {name for name, n in region.items() if sixteen_bit(n)}
    assert any(n.op == "MatMul" and n.attr["T"].type == HALF for n in out.graph_def.node)
    fp32, half = Trainer(meta), Trainer(out)
    fp32.train(200)
    losses = half.train(200)
    assert all(math.isfinite(v) for v in losses)
    assert fp32.accuracy() > 0.9 and half.accuracy() >= fp32.accuracy() - 0.02


def _to_half(graph, name: str) -> None:
    """Make float32 node ``name`` compute in float16, with casts around it so that every edge
    still carries what its consumer expects: what a painting that forgot the update makes."""
    node = graph.node(name)
    for port, ref in enumerate(graph.inputs(name)):
        cast = graph.add_node("Cast", f"{name}/to_half_{port}", [ref], {
            "SrcT": attr_value_pb2.AttrValue(type=types_pb2.DT_FLOAT),
            "DstT": attr_value_pb2.AttrValue(type=HALF)})
        graph.set_input(name, port, TensorRef(cast.name))
    readers = graph.consumers(name, 0)
    back = graph.add_node("Cast", f"{name}/to_float", [TensorRef(name)], {
        "SrcT": attr_value_pb2.AttrValue(type=HALF),
        "DstT": attr_value_pb2.AttrValue(type=types_pb2.DT_FLOAT)})
    for reader, port in readers:
        graph.set_input(reader, port, TensorRef(back.name))
    node.attr["T"].type = HALF


def test_the_lint_fails_a_body_whose_unscaled_gradient_reaches_a_write_through_float16(hand_adamw):
    """A converted train body passes the lint; the same body with one Mul of the moment math
    (``0.1 * g``, reading an unscaled gradient) moved to float16, casts around it so that every
    edge still type-checks, fails it, naming the edge: our bug, exit 70, never written."""
    folder, report = hand_adamw
    library = _library(folder / "f16")
    signatures = {f.signature.name: f.signature for f in library.function}
    body = _train_bodies(folder / "f16", report)[0]
    fg = function_to_graph(body, signatures)
    graph = fg.graph
    before = Before(graph)
    assert lint_problems(graph, original=before) == []
    region = update_nodes(body.node_def, library)
    # a Mul of the update that reads a tensor of the backward pass: an unscaled gradient
    target = next(name for name, n in region.items() if n.op == "Mul" and any(
        "gradient_tape/" in ref.node for ref in graph.inputs(name)))
    _to_half(graph, target)
    problems = lint_problems(graph, original=before)
    assert problems and all("between the gradients and a variable write" in p for p in problems)
    assert any(f"-> {target!r}" in p or f"{target}/to_float" in p for p in problems), problems
    with pytest.raises(LintError):
        lint(graph, original=before)
    assert LintError.exit_code == 70


def test_a_force_lowp_override_cannot_move_the_update(tmp_path):
    """The user's force_lowp on every node paints the forward pass, but the update stays
    float32 (code update) and a warning says why the override was refused there."""
    rules = tmp_path / "force.toml"
    rules.write_text('[[override]]\nglob = "*"\naction = "force_lowp"\n')
    meta = build("mlp", "momentum", backprop="hand_momentum")
    model = Model(Path("train.meta"), "metagraph", False, (meta,))
    out, report = convert_model(model, Options(target="float16", device="cpu", rules=[str(rules)]))
    region = update_nodes(out.meta_graph.graph_def.node, scope="gradients/")
    assert region and not {name for name, n in region.items() if sixteen_bit(n)}
    codes = {n.name: n.code for n in report.nodes}
    kept = {codes[name] for name in region if name in codes and codes[name] != "variable"}
    assert "update" in kept and kept <= {"update", "not_float32", "deny_list", "not_listed"}
    assert any("force_lowp refused" in w and "update reads the gradients in float32" in w
               for w in report.warnings)
