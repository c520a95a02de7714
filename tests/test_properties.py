"""Property tests: random real graphs convert soundly; mutated real files fail only with our errors.

Hypothesis runs derandomized (a fixed sequence of examples, no example database), so CI sees
the same graphs every run.
"""

import functools
from pathlib import Path

import graphs
import numpy as np
import random_graphs
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from amp_rewrite import convert
from amp_rewrite.check import lint
from amp_rewrite.conversion.pipeline import Options, convert_model
from amp_rewrite.core.errors import InputError
from amp_rewrite.core.ir import Graph
from amp_rewrite.io import load
from amp_rewrite.rules.loader import load_rules

LOWP = {"float16": tf.float16.as_datatype_enum, "bfloat16": tf.bfloat16.as_datatype_enum}
DEVICE = {"float16": "gpu", "bfloat16": "cpu"}
# relative L2 error against FP32: about 20 units of roundoff (float16 u = 2**-11, bfloat16
# u = 2**-8) for chains of up to ten layers; 400 random graphs peaked at 2.5e-3 and 2.3e-2
TOL = {"float16": 1e-2, "bfloat16": 6e-2}
# the random graphs' ops that each target's rules deny (bfloat16 paints Mean, as grappler does)
DENY = {t: {"Exp", "Sum", "Mean"} & load_rules(t).effective("deny") for t in ("float16", "bfloat16")}
MATRIX = {"MatMul", "Conv2D"}

FIXED = dict(derandomize=True, database=None, deadline=None,
             suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=200, **FIXED)
@given(layers=st.lists(st.sampled_from(sorted(random_graphs.LAYERS)), min_size=1, max_size=10),
       batch=st.sampled_from([1, 2, 4]), width=st.sampled_from([8, 12, 16]),
       seed=st.integers(0, 2**16), target=st.sampled_from(["float16", "bfloat16"]))
def test_random_graphs_convert_lint_run_and_match(layers, batch, width, seed, target):
    event(f"{len(layers)} layers")
    gd, feeds, fetches = random_graphs.build(layers, batch, width, seed)
    ref = graphs.run(gd, feeds, fetches)[0]
    new, report = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)

    assert lint.lint_problems(Graph.from_graph_def(new)) == []
    nodes = list(new.node)
    assert all(n.attr["T"].type == LOWP[target] for n in nodes if n.op in MATRIX)
    assert all(n.attr["T"].type == tf.float32.as_datatype_enum for n in nodes if n.op in DENY[target])
    assert {n.name: n for n in nodes}["x"].attr["dtype"].type == tf.float32.as_datatype_enum
    summary = report.summary()
    assert summary["matrix_converted"] == summary["matrix_total"] == sum(
        n.op in MATRIX for n in gd.node)

    out = graphs.run(new, feeds, fetches)[0]
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    assert graphs.rel_l2(out, ref) <= TOL[target]


# ----------------------------------------------------------------- mutated real files
@functools.lru_cache(maxsize=1)
def _sources() -> list[tuple[str, bytes]]:
    """Real model files as bytes: binary GraphDefs, a text GraphDef and a MetaGraphDef."""
    out = []
    for builder in (graphs.mlp, graphs.conv_bn, graphs.while_v1, graphs.tensorarray_lstm,
                    graphs.functional_while):
        out.append(("model.pb", builder()[0].SerializeToString()))
    out.append(("model.pbtxt", str(graphs.conv_bias_relu_pool()[0]).encode()))
    meta = tf.compat.v1.MetaGraphDef(graph_def=graphs.attention()[0])
    out.append(("model.meta", meta.SerializeToString()))
    return out


def test_the_sources_of_the_mutations_convert_as_they_are():
    """The two tests below pass on a refusal: each source converts unmutated, or they would
    pass on a converter that refused every file."""
    for name, data in _sources():
        for target in ("float16", "bfloat16"):
            model, report = convert_model(load.parse(data, Path(name)), Options(
                target=target, device=DEVICE[target], min_matrix_intensity=0))
            assert lint.lint_problems(Graph.from_graph_def(model.graph_def)) == []
            assert report.summary()["matrix_converted"] > 0, (name, target)


def _mutate(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for kind, where, value in edits:
        at = int(where * len(buf)) if buf else 0
        if kind == "set" and buf:
            buf[min(at, len(buf) - 1)] = value
        elif kind == "delete":
            del buf[at:at + 1 + value % 8]
        else:
            buf[at:at] = bytes([value]) * (1 + value % 4)
    return bytes(buf)


EDITS = st.lists(st.tuples(st.sampled_from(["set", "delete", "insert"]),
                           st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                 min_size=1, max_size=6)


@settings(max_examples=600, **FIXED)
@given(source=st.integers(0, 6), edits=EDITS, target=st.sampled_from(["float16", "bfloat16"]))
def test_mutated_files_fail_only_with_input_errors(source, edits, target):
    name, data = _sources()[source]
    mutated = _mutate(data, edits)
    try:
        model, _ = convert_model(load.parse(mutated, Path(name)),
                                 Options(target=target, device=DEVICE[target], min_matrix_intensity=0))
    except InputError as exc:
        event("refused")
        # an InputError, not a LintError: a broken input is the user's problem, said in one line
        assert "\n" not in str(exc)
    else:
        event("converted")
        assert lint.lint_problems(Graph.from_graph_def(model.graph_def)) == []


# ----------------------------------------------------------------- structurally broken graphs
def _edit_node(gd, idx, kind, value):
    """One structural edit of node ``idx``: the kinds of damage a hand-edited or foreign
    generator's graph shows (wrong dtypes, counts, wiring, ops; missing attrs; odd devices)."""
    nodes = gd.node
    node = nodes[idx % len(nodes)]
    other = nodes[value % len(nodes)].name
    keys = sorted(node.attr)
    if kind == "attr_type" and keys:
        av = node.attr[keys[value % len(keys)]]
        dtypes = [0, 1, 2, 3, 7, 10, 14, 19, 101, 119]
        if av.WhichOneof("value") == "type":
            av.type = dtypes[value % len(dtypes)]
        elif av.WhichOneof("value") == "list":
            av.list.type.append(dtypes[value % len(dtypes)])
    elif kind == "attr_int" and keys:
        av = node.attr[keys[value % len(keys)]]
        if av.WhichOneof("value") == "i":
            av.i = [-1, 0, 1, 3, 1000, 2**40][value % 6]
    elif kind == "drop_attr" and keys:
        del node.attr[keys[value % len(keys)]]
    elif kind == "rewire" and node.input:
        node.input[value % len(node.input)] = [other, other + ":1", other + ":9", "^" + other][value % 4]
    elif kind == "drop_input" and node.input:
        del node.input[value % len(node.input)]
    elif kind == "add_input":
        node.input.append(other)
    elif kind == "op":
        node.op = ["MatMul", "AddV2", "Identity", "Exp", "Merge", "NextIteration", "Cast",
                   "ConcatV2", "Relu", "Enter", "NoSuchOp"][value % 11]
    elif kind == "device":
        node.device = ["/device:CPU:0", "/device:GPU:0", "/job:w/device:TPU:0", "garbage::"][value % 4]


NODE_EDITS = st.lists(st.tuples(st.integers(0, 10**6),
                                st.sampled_from(["attr_type", "attr_int", "drop_attr", "rewire",
                                                 "drop_input", "add_input", "op", "device"]),
                                st.integers(0, 10**6)),
                      min_size=1, max_size=3)


@settings(max_examples=500, **FIXED)
@given(source=st.integers(0, 4), edits=NODE_EDITS, target=st.sampled_from(["float16", "bfloat16"]))
def test_structurally_broken_graphs_fail_only_with_input_errors(source, edits, target):
    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString(_sources()[source][1])
    for idx, kind, value in edits:
        _edit_node(gd, idx, kind, value)
    try:
        new, _ = convert(gd, target=target, device=DEVICE[target], min_matrix_intensity=0)
    except InputError as exc:
        event("refused")
        assert "\n" not in str(exc)
    else:
        event("converted")
        assert lint.lint_problems(Graph.from_graph_def(new)) == []
