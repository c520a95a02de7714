"""Infinities the float32 model has too are not blamed (issue 28, item 4).

A Transformer's causal mask adds -1e9 to the attention scores of future positions; float16
holds that as -inf, and the softmax turns both into the same zeros. ``verify --per-node`` must
not rank the masked scores first as "added inf", and ``tune`` must spend its first keep on a
tensor that changes the outputs. A genuine overflow (a float32 value within float16's range
that float16 holds as inf, or an inf of the other sign) is still blamed, and so is a value past
the range whose infinity a consumer turns into an error.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.convert_to_constants import (
    convert_variables_to_constants_v2,
)

from amp_rewrite import convert, convert_file
from amp_rewrite.io.load import Model
from amp_rewrite.rules.loader import load_rules
from amp_rewrite.tools.tuning import keep_rule, tune
from amp_rewrite.tools.verify import ErrorStats, format_result, verify

VOCAB, D_MODEL, SEQ = 50, 16, 8
F16_MAX = 65504.0


class TinyTransformer(tf.Module):
    """Embeddings plus positions, one causal self-attention layer and a ReLU feed-forward
    layer, logits over the vocabulary; a train step (SGD) and a serving function. ``gain``
    scales the feed-forward layer's first weights up and its second down by the same factor:
    the function is the same, but its hidden activations (about 1e5) are past float16's range
    and its second matmul turns their infinities into NaN: a real float16 fault."""

    def __init__(self, seed=0, gain=1.0):
        super().__init__()
        rng = np.random.default_rng(seed)

        def var(shape, scale, name):
            return tf.Variable((rng.standard_normal(shape) * scale).astype(np.float32), name=name)

        self.emb = var((VOCAB, D_MODEL), 0.5, "emb")
        self.pos = var((SEQ, D_MODEL), 0.1, "pos")
        self.wq, self.wk, self.wv, self.wo = (var((D_MODEL, D_MODEL), D_MODEL ** -0.5, n)
                                              for n in ("wq", "wk", "wv", "wo"))
        self.w1 = var((D_MODEL, 4 * D_MODEL), gain * D_MODEL ** -0.5, "w1")
        self.w2 = var((4 * D_MODEL, D_MODEL), (4 * D_MODEL) ** -0.5 / gain, "w2")
        self.wout = var((D_MODEL, VOCAB), D_MODEL ** -0.5, "wout")
        self.params = [self.emb, self.pos, self.wq, self.wk, self.wv, self.wo, self.w1,
                       self.w2, self.wout]
        self.opt = tf.keras.optimizers.SGD(0.1)
        self.opt.build(self.params)

    def logits(self, tokens):
        x = tf.gather(self.emb, tokens) + self.pos
        q, k, v = (tf.einsum("bsd,de->bse", x, w) for w in (self.wq, self.wk, self.wv))
        scores = tf.matmul(q, k, transpose_b=True) / np.float32(np.sqrt(D_MODEL))
        future = 1.0 - tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
        masked = tf.add(scores, future * -1e9, name="masked")
        att = tf.nn.softmax(masked, axis=-1, name="attention")
        h = x + tf.einsum("bsd,de->bse", tf.matmul(att, v), self.wo)
        hidden = tf.nn.relu(tf.einsum("bsd,df->bsf", h, self.w1, name="ffn_in"))
        h = h + tf.einsum("bsf,fd->bsd", hidden, self.w2, name="ffn_out")
        return tf.einsum("bsd,dv->bsv", h, self.wout, name="vocab")

    @tf.function(input_signature=[tf.TensorSpec([None, SEQ], tf.int32),
                                  tf.TensorSpec([None, SEQ], tf.int32)])
    def train_step(self, tokens, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                targets, self.logits(tokens)))
        self.opt.apply_gradients(zip(tape.gradient(loss, self.params), self.params))
        return {"loss": loss}

    @tf.function(input_signature=[tf.TensorSpec([None, SEQ], tf.int32)])
    def serve(self, tokens):
        return {"logits": self.logits(tokens)}


def _frozen(module) -> tf.compat.v1.GraphDef:
    return convert_variables_to_constants_v2(module.serve.get_concrete_function()).graph.as_graph_def()


def _tokens(seed, batch=4):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """The FP32 SavedModel (train step and serving signatures), its frozen serving graph, both
    converted to float16, and a sample of tokens."""
    folder = tmp_path_factory.mktemp("transformer")
    module = TinyTransformer()
    tf.saved_model.save(module, str(folder / "sm"), signatures={
        "serving_default": module.serve, "train_step": module.train_step})
    (folder / "frozen.pb").write_bytes(_frozen(module).SerializeToString())
    convert_file(folder / "sm", folder / "sm16", target="float16")
    convert_file(folder / "frozen.pb", folder / "frozen16.pb", target="float16")
    np.savez(folder / "tokens.npz", tokens=_tokens(1))
    rng = np.random.default_rng(2)
    np.savez(folder / "step.npz", tokens=_tokens(2),
             targets=rng.integers(0, VOCAB, (4, SEQ)).astype(np.int32))
    return folder


@pytest.mark.parametrize("orig, conv", [("frozen.pb", "frozen16.pb"), ("sm", "sm16")])
def test_per_node_does_not_blame_the_causal_mask(transformer, orig, conv):
    result = verify(transformer / orig, transformer / conv,
                    inputs=str(transformer / "tokens.npz"), nodes=True)
    assert result.ok, format_result(result)
    (mask,) = [n for n in result.nodes if n.tensor.split("/")[-1] == "masked:0"]
    # float16 really holds the future positions as -inf (batch 4 x 28 above the diagonal),
    # and the softmax after it gives the same zeros: they agree
    assert mask.dtype == "float16" and mask.beyond_range == 4 * 28 and mask.harmless
    assert math.isfinite(mask.rel_l2) and mask.rel_l2 < result.criteria.rel_l2
    assert result.nodes[0].tensor != mask.tensor
    assert not [n.tensor for n in result.nodes if not math.isfinite(n.added)]
    text = format_result(result, top=len(result.nodes))
    assert "added inf" not in text and "no consumer's result changes" in text


def test_the_converted_train_step_keeps_the_loss(transformer, tmp_path):
    """The train-step signature, loss-scaled in float16, computes the float32 loss from the
    same masked attention; the mask computed in float16 instead (``0 * -1e9`` is ``0 * -inf``,
    NaN) is caught: a NaN never agrees."""
    result = verify(transformer / "sm", transformer / "sm16", signature="train_step",
                    inputs=str(transformer / "step.npz"))
    (loss,) = result.outputs
    assert result.ok and loss.nonfinite == 0 and loss.rel_l2 < 1e-2, format_result(result)

    rules = tmp_path / "mask16.toml"
    rules.write_text('[[override]]\nglob = "__inference_train_step_*/mul"\naction = "force_lowp"\n')
    convert_file(transformer / "sm", tmp_path / "nan16", target="float16", rules=[str(rules)])
    broken = verify(transformer / "sm", tmp_path / "nan16", signature="train_step",
                    inputs=str(transformer / "step.npz"))
    assert not broken.ok and broken.outputs[0].nonfinite == 1


def test_masked_logits_output_fails_where_float16_gives_inf():
    """An output holding -1e9 (masked logits) that the float16 conversion gives as -inf is what
    the user receives: verify's outputs compare with no rounding allowance (issue 34: an output
    element non-finite where float32 is finite fails, whatever its sign). Inside a model
    (per-node, ``limit``) the same -inf is float16's rounding of a constant mask; +inf is not."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6], name="x")
        w = tf.constant(np.random.default_rng(0).normal(0, 0.3, (6, 6)).astype(np.float32))
        banned = tf.constant([0, 0, 1, 0, 1, 0], tf.float32)
        tf.add(tf.matmul(x, w, name="scores"), banned * -1e9, name="logits")
    graph_def = g.as_graph_def()
    converted, _ = convert(graph_def, target="float16", lowp_io=True)
    feed = {"x:0": np.random.default_rng(1).normal(size=(32, 6)).astype(np.float32)}
    want = _run(graph_def, feed, "logits:0")
    got = _run(converted, feed, "logits:0")
    assert got.dtype == np.float16 and np.isneginf(got[:, [2, 4]]).all()
    output = ErrorStats(1e-2, 1e-3, tie=1e-2)          # as verify compares an output
    output.update(want, got)
    assert output.lost == 64 and math.isinf(output.rel_l2) and output.top1 == 0.0
    inside = ErrorStats(1e-2, 1e-3, tie=1e-2, limit=F16_MAX)   # as --per-node compares
    inside.update(want, got)
    assert inside.beyond == 64 and inside.lost == 0 and inside.rel_l2 < 1e-2
    flipped = ErrorStats(1e-2, 1e-3, tie=1e-2, limit=F16_MAX)
    flipped.update(want, np.where(np.isinf(got), np.inf, got))
    assert flipped.beyond == 0 and flipped.nonfinite == 64 and math.isinf(flipped.rel_l2)
    assert flipped.top1 == 0.0


def _run(graph_def, feed, fetch):
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        return sess.run(fetch, feed)


def test_only_float16s_own_rounding_of_a_value_past_its_range_agrees():
    """Element by element: the inf of the same sign for a value past 65504 agrees; an inf
    for a value within the range, of the other sign, or a NaN is an error; and without a
    16-bit limit (float32 defaults) no infinity agrees."""
    ref = np.array([-1e9, 7e4, 1.0], np.float32)

    def stats(out, limit=F16_MAX):
        s = ErrorStats(0.0, 0.0, limit=limit)
        s.update(ref, np.array(out, np.float32))
        return s

    agree = stats([-np.inf, np.inf, 1.0])
    assert (agree.beyond, agree.nonfinite, agree.rel_l2, agree.share) == (2, 0, 0.0, 0.0)
    for out in ([np.inf, np.inf, 1.0],          # -1e9 as +inf: the other sign
                [-np.inf, -np.inf, 1.0],        # 7e4 as -inf
                [-np.inf, np.nan, 1.0]):        # a NaN is never a rounding
        s = stats(out)
        assert s.beyond == 1 and s.nonfinite == 1 and math.isinf(s.rel_l2)
    within = ErrorStats(0.0, 0.0, limit=F16_MAX)
    within.update(np.array([6e4, F16_MAX], np.float32), np.array([np.inf, np.inf], np.float32))
    assert within.beyond == 0 and within.nonfinite == 2
    float32 = stats([-np.inf, np.inf, 1.0], limit=math.inf)
    assert float32.beyond == 0 and float32.nonfinite == 2


def _faults_graph():
    """Three branches whose float16 versions hold infinities:
    ``near`` = a + b is 65504 in float32 (within the range), but a and b round up in float16
    and their sum is inf (a genuine overflow); ``big`` = c * 1e3 is 1e6, past the range, and
    ``small`` = big * 1e-4 turns its inf into an error (100 in float32); ``masked`` = d - 1e9
    is past the range too, but the softmax after it gives the same zeros."""
    g = tf.Graph()
    with g.as_default():
        a, b, c, d = (tf.compat.v1.placeholder(tf.float32, [None, 4], name=n) for n in "abcd")
        near = tf.add(a, b, name="near")
        small = tf.multiply(tf.multiply(c, 1e3, name="big"), 1e-4, name="small")
        mask = tf.constant([0.0, 0.0, 1.0, 1.0]) * -1e9
        soft = tf.nn.softmax(tf.add(d, mask, name="masked"), name="soft")
        tf.identity(near * 1e-3 + small + soft, name="out")
    return g.as_graph_def()


def test_genuine_overflows_are_still_blamed(tmp_path):
    orig, conv, rules = tmp_path / "m.pb", tmp_path / "m16.pb", tmp_path / "force.toml"
    orig.write_bytes(_faults_graph().SerializeToString())
    rules.write_text("".join(f'[[override]]\nglob = "{n}"\naction = "force_lowp"\n\n'
                             for n in ("near", "big", "small", "masked", "soft")))
    convert_file(orig, conv, target="float16", rules=[str(rules)])
    rows = np.ones((2, 4), np.float32)
    np.savez(tmp_path / "in.npz", a=rows * 60017, b=rows * 5487, c=rows * 1e3, d=rows)
    result = verify(orig, conv, inputs=str(tmp_path / "in.npz"), nodes=True)
    assert not result.ok and math.isinf(result.outputs[0].rel_l2)
    by_name = {n.tensor: n for n in result.nodes}
    assert all(by_name[t].dtype == "float16" for t in ("near:0", "big:0", "small:0", "masked:0"))
    # the two overflows come first, each where it starts; what they feed adds nothing
    assert {n.tensor for n in result.nodes[:2]} == {"near:0", "big:0"}
    assert [n.tensor for n in result.nodes if math.isinf(n.added)] == [
        n.tensor for n in result.nodes[:2]]
    near, big, masked = by_name["near:0"], by_name["big:0"], by_name["masked:0"]
    assert near.beyond_range == 0                       # 65504 is within: no rounding to inf
    assert big.beyond_range == 8 and not big.harmless   # past the range, but small differs
    assert masked.beyond_range == 4 and masked.harmless and masked.rel_l2 == 0.0
    assert by_name["soft:0"].added < 1e-2
    text = format_result(result)
    assert "a consumer's result differs" in text


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    """The transformer whose feed-forward layer overflows float16, frozen, and two samples."""
    graph_def = _frozen(TinyTransformer(gain=4e4))
    feeds = [{"tokens": _tokens(s)} for s in (1, 2)]
    return graph_def, feeds


def _output(graph_def, feed):
    return _run(graph_def, {"tokens:0": feed["tokens"]}, "Identity:0")


def _converted_output(graph_def, keep, feed):
    rules = load_rules("float16", [])
    rules.node_rules.extend(keep_rule(name) for name in keep)
    converted, _ = convert(graph_def, rules=rules)
    return _output(converted, feed)


def test_tune_first_keeps_a_node_that_changes_the_outputs(loud):
    graph_def, feeds = loud
    painted = _converted_output(graph_def, [], feeds[0])
    assert not np.isfinite(painted).all()               # the float16 fault is real
    # the mask kept float32 leaves the fault as it is: the softmax reads -inf either way
    assert (np.isfinite(_converted_output(graph_def, ["masked"], feeds[0]))
            == np.isfinite(painted)).all()

    result = tune(Model.of_graph_def(graph_def), feeds=feeds, target="float16")
    assert result.ok and math.isinf(result.before) and result.after <= 1e-2
    # the feed-forward activations are past the range on the samples: the range margin keeps
    # them before the search (tuning.py, step 1), the mask's infinities it finds harmless
    first = result.trial_log[1]
    assert first["why"] == "range margin" and first["keep"]
    assert "masked" not in {k for t in result.trial_log for k in t["keep"]}
    # what tune kept first changes the outputs: it is among the nodes it ends with, and
    # with the others alone the outputs are not finite
    kept = [k.node for k in result.kept]
    assert set(first["keep"]) <= set(kept)
    assert np.isfinite(_converted_output(graph_def, kept, feeds[0])).all()
    others = [k for k in kept if k not in first["keep"]]
    assert not np.isfinite(_converted_output(graph_def, others, feeds[0])).all()
