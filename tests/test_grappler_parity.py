"""Our painting against grappler's own pass, on the graphs of TensorFlow's AMP tests and on
graphs where grappler's choices are worth matching (pinned devices, v1 batch norm, TensorLists,
direct function calls, infer ops after allow ops).

Two modes: grappler's oneDNN bfloat16 mode, which needs TensorFlow's oneDNN ops on (conftest.py
turns them on where the CPU's default leaves them off; the tests skip where they stay off), and
its CUDA float16 mode on a virtual GPU (tests/grappler_graphs.py). The sets of low-precision
nodes must agree; every difference must be one README.md lists ("Where we differ from
grappler"), identified here by the decision code our report gives the node.
"""

import grappler_graphs as gg
import pytest
from machine import needs_onednn

from amp_rewrite import convert

# decision code of ours -> why grappler differs (docs/decisions.md "Where we differ from grappler")
EXPLAINED = {
    # grappler paints nodes nothing reads unless they are fetched; we keep every graph output
    # float32 so a converted file keeps its interface (here: unused weight gradients)
    "interface": "graph outputs keep their dtypes",
}

CASES = {
    "conv_bn": gg.conv_bn,
    "conv_pool": gg.conv_pool,
    "multi_paths": gg.multi_paths,
    "conv_bn_v1": gg.conv_bn_v1,
    "direct_call": gg.direct_call,
    "infer_chain": gg.infer_chain,
}
# the loop cases of grappler's test: letters are allow (w), infer (g), clear (c), deny (b)
for spec in [("w", "c", "w"), ("c", "c", "w"), ("w", "g", "w"), ("w", "gbg", "cb"),
             ("b", "gwc", "c"), ("b", "cwcg", "c"), ("c", "cwcg", "c"), ("c", "cwgcg", "c"),
             ("w", "gbg", "w"), ("w", "ggg", "w")]:
    CASES["loop_" + "_".join(spec)] = lambda s=spec: gg.simple_loop(*s)
for case in "ABCDEGI":
    CASES["tensorlist_" + case] = lambda c=case: gg.tensorlist(c)
# grappler's own list tests (auto_mixed_precision_test.cc), the list through a tf.function call,
# and the EmptyTensorList accumulators of a frozen TF2 while loop's gradient
CASES.update({
    "tensorlist_push_pop": gg.tensorlist_push_pop,
    "tensorlist_batch_concat": gg.tensorlist_batch_concat,
    "tensorlist_through_function": gg.tensorlist_through_function,
    "tensorlist_through_call": lambda: gg.tensorlist_through_function("partitioned"),
    "tensorlist_loop_gradient": gg.tensorlist_loop_gradient,
})
# a node pinned to the device the conversion is not for: each mode's "other" device
PINNED = {"bfloat16": "/device:GPU:0", "float16": "/device:CPU:0"}
MODES = {"bfloat16": ("cpu", gg.grappler_bfloat16), "float16": ("gpu", gg.grappler_float16)}


def _compare(graph_def, target):
    device, grappler = MODES[target]
    fetches = [n.name for n in graph_def.node if n.name in ("output", "output2", "grad_output")]
    # Consts: we store them in the target dtype, grappler casts them at run time (README)
    names = {n.name for n in graph_def.node if n.op != "Const"}
    theirs = gg.lowp_nodes(grappler(graph_def, fetches), names)
    # grappler has no cost model; its pass alone folds no constant (bfloat16 on a CPU folds
    # by default: the painting is compared on the same graph)
    converted, report = convert(graph_def, target=target, device=device, keep=fetches,
                                min_matrix_intensity=0, fold_constants=False)
    ours = gg.lowp_nodes(converted, names)
    assert theirs, "grappler painted nothing: the comparison would be empty"
    for name in sorted(theirs ^ ours):
        code = report.node(name).code
        assert code in EXPLAINED, f"{name}: grappler {'paints' if name in theirs else 'keeps'} it, we say {code}"
    return converted, report


@pytest.mark.parametrize("target", [pytest.param("bfloat16", marks=needs_onednn), "float16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_low_precision_nodes_as_grappler(case, target):
    graph_def, _ = CASES[case]()
    _compare(graph_def, target)


@pytest.mark.parametrize("target", [pytest.param("bfloat16", marks=needs_onednn), "float16"])
def test_a_node_pinned_to_another_device_is_left_as_it_is(target):
    graph_def, _ = gg.pinned(PINNED[target])
    converted, report = _compare(graph_def, target)
    assert report.node("pinned").code == "other_device"
    assert report.node("mm0").precision == report.node("mm2").precision == target


def test_v1_batch_norm_runs_as_v2_in_low_precision_with_float32_statistics():
    converted, _ = _compare(gg.conv_bn_v1()[0], "float16")
    bn = {n.op: n for n in converted.node if n.op.startswith("FusedBatchNorm")}
    assert set(bn) == {"FusedBatchNormV2", "FusedBatchNormGradV2"}
    assert all(n.attr["T"].type == gg.LOWP[1] and n.attr["U"].type == 1 for n in bn.values())


def test_loop_sections_as_grappler_test_expects():
    """grappler's test_propagation_through_simple_loop: 'W','G','W' paints the whole loop."""
    graph_def, feeds = gg.simple_loop("w", "g", "w")
    converted, report = convert(graph_def, target="bfloat16", device="cpu", min_matrix_intensity=0, keep=["output"])
    for name in ("input_0", "while/body_0", "output_0"):
        assert report.node(name).precision == "bfloat16"
    merges = [n for n in report.nodes if n.op in ("Merge", "NextIteration") and n.attrs.get("T") != "int32"]
    assert merges and all(n.precision == "bfloat16" for n in merges)
