"""Our painting against grappler's own pass, on the graphs of TensorFlow's AMP tests.

Grappler runs in its oneDNN bfloat16 mode, which needs TensorFlow's oneDNN ops on (conftest.py
turns them on where the CPU's default leaves them off; the tests skip where they stay off).
The sets of low-precision nodes must agree; every difference must be one README.md lists
("Where we differ from grappler"), identified here by the decision code our report gives the
node.
"""

import pytest

import grappler_graphs as gg
from machine import needs_onednn
from amp_rewrite import convert

# decision code of ours -> why grappler differs (README "Where we differ from grappler")
EXPLAINED = {
    # grappler paints nodes nothing reads unless they are fetched; we keep every graph output
    # float32 so a converted file keeps its interface (here: unused weight gradients)
    "interface": "graph outputs keep their dtypes",
}

CASES = {
    "conv_bn": gg.conv_bn,
    "conv_pool": gg.conv_pool,
    "multi_paths": gg.multi_paths,
}
# the loop cases of grappler's test: letters are allow (w), infer (g), clear (c), deny (b)
for spec in [("w", "c", "w"), ("c", "c", "w"), ("w", "g", "w"), ("w", "gbg", "cb"),
             ("b", "gwc", "c"), ("b", "cwcg", "c"), ("c", "cwcg", "c"), ("c", "cwgcg", "c"),
             ("w", "gbg", "w"), ("w", "ggg", "w")]:
    CASES["loop_" + "_".join(spec)] = lambda s=spec: gg.simple_loop(*s)


@needs_onednn
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_low_precision_nodes_as_grappler(case):
    graph_def, _ = CASES[case]()
    fetches = [n.name for n in graph_def.node if n.name in ("output", "grad_output")]
    # Consts: we store them in bfloat16, grappler casts them at run time (README)
    names = {n.name for n in graph_def.node if n.op != "Const"}
    theirs = gg.lowp_nodes(gg.grappler_bfloat16(graph_def, fetches), names)
    converted, report = convert(graph_def, target="bfloat16", device="cpu", keep=fetches)
    ours = gg.lowp_nodes(converted, names)
    assert theirs, "grappler painted nothing: the comparison would be empty"
    for name in sorted(theirs ^ ours):
        code = report.node(name).code
        assert code in EXPLAINED, f"{name}: grappler {'paints' if name in theirs else 'keeps'} it, we say {code}"


def test_loop_sections_as_grappler_test_expects():
    """grappler's test_propagation_through_simple_loop: 'W','G','W' paints the whole loop."""
    graph_def, feeds = gg.simple_loop("w", "g", "w")
    converted, report = convert(graph_def, target="bfloat16", device="cpu", keep=["output"])
    for name in ("input_0", "while/body_0", "output_0"):
        assert report.node(name).precision == "bfloat16"
    merges = [n for n in report.nodes if n.op in ("Merge", "NextIteration") and n.attrs.get("T") != "int32"]
    assert merges and all(n.precision == "bfloat16" for n in merges)
