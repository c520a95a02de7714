"""Rule files, presets, overrides, grappler's variables, and validation errors."""

from pathlib import Path

import graphs
import pytest
import tensorflow as tf

from amp_rewrite import convert
from amp_rewrite.core.errors import RuleError
from amp_rewrite.rules.loader import builtin_rules_dir, load_rules

pytestmark = pytest.mark.fast  # conversions only: no TensorFlow session

ROOT = Path(__file__).resolve().parent.parent
# the example rule files as the package ships them (rules/examples in a checkout)
EXAMPLES = builtin_rules_dir() / "examples"
sys_path = ROOT / "examples"


def _example_graph():
    import sys
    sys.path.insert(0, str(sys_path))
    import make_example
    return make_example.build()


def _precisions(graph_def):
    """node name -> 'lowp' / 'float32' by its first float-ish type attr."""
    out = {}
    for n in graph_def.node:
        types = [v.type for k, v in sorted(n.attr.items()) if v.WhichOneof("value") == "type"
                 and k in ("T", "dtype", "DstT")]
        if types:
            out[n.name] = "lowp" if types[0] in (tf.float16.as_datatype_enum,
                                                 tf.bfloat16.as_datatype_enum) else "float32"
    return out


def _write(tmp_path, text, name="r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_files_all_load():
    names = sorted(p.name for p in EXAMPLES.glob("*.toml"))
    assert names == ["conservative.toml", "keep_head_fp32.toml", "no_einsum.toml",
                     "tensor_cores_only.toml"]
    for path in EXAMPLES.glob("*.toml"):
        load_rules("float16", [path], env={})


def test_tensor_cores_only_changes_only_allow_ops():
    gd = _example_graph()
    base = _precisions(convert(gd, rules=load_rules("float16", env={}))[0])
    new, report = convert(gd, rules=load_rules("float16", [EXAMPLES / "tensor_cores_only.toml"], env={}))
    got = _precisions(new)
    assert {"Conv2D", "MatMul", "FusedBatchNormV3", "Relu", "BiasAdd", "MaxPool", "Reshape"} <= {
        n.op for n in gd.node}   # each branch below has nodes to check
    for n in gd.node:
        if n.op in ("Conv2D", "MatMul"):
            assert got[n.name] == "lowp"
        elif n.op in ("FusedBatchNormV3", "Relu", "BiasAdd", "MaxPool", "Reshape"):
            assert got[n.name] == "float32", n.name
            if n.op == "Relu":
                assert base[n.name] == "lowp"  # the default would have painted it


def test_treat_infer_as_deny_and_list_edits():
    gd = _example_graph()
    rules = load_rules("float16", [EXAMPLES / "conservative.toml"], env={})
    assert "Softmax" in rules.effective("deny") and "BiasAdd" in rules.effective("deny")
    assert not rules.effective("infer")
    got = _precisions(convert(gd, rules=rules)[0])
    assert got["block1/bn"] == "float32" and got["block2/bias"] == "float32"
    assert got["block1/conv"] == "lowp" and got["block2/conv"] == "lowp"


def test_no_einsum_moves_exactly_einsum():
    gd, feeds, fetches = graphs.attention()
    rules = load_rules("float16", [EXAMPLES / "no_einsum.toml"], env={})
    assert "Einsum" not in rules.effective("allow") and "Square" in rules.effective("infer")
    new, report = convert(gd, rules=rules)
    ops = {n.name: n.op for n in gd.node}
    base = _precisions(convert(gd)[0])
    got = _precisions(new)
    assert {"Einsum", "BatchMatMulV2"} <= set(ops.values())
    for name, op in ops.items():
        if op == "Einsum":
            assert base[name] == "lowp" and got[name] == "float32"
        elif op == "BatchMatMulV2":
            assert got[name] == "lowp"


def test_node_overrides_glob_then_regex_later_wins():
    gd = _example_graph()
    new, report = convert(gd, rules=load_rules("float16", [EXAMPLES / "keep_head_fp32.toml"], env={}))
    got = _precisions(new)
    assert got["head/fc1"] == "float32" and got["head/fc2"] == "float32"
    assert report.node("head/fc1").code == "user_keep"
    assert got["head/logits"] == "lowp" and report.node("head/logits").code == "user_force"
    assert got["block2/conv"] == "lowp"


def test_force_lowp_refused_without_kernel(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
        det = tf.linalg.det(tf.matmul(x, x), name="det")
        tf.identity(det * 2.0, name="out")
    path = _write(tmp_path, '[[override]]\nglob = "det"\naction = "force_lowp"\n')
    new, report = convert(g.as_graph_def(), rules=load_rules("float16", [path], env={}))
    assert _precisions(new)["det"] == "float32"
    assert report.node("det").code == "no_kernel"
    assert any("force_lowp refused" in w and "det" in w for w in report.warnings)


def test_override_matching_nothing_warns(tmp_path):
    gd, _, _ = graphs.mlp()
    path = _write(tmp_path, '[[override]]\nglob = "nothing/*"\naction = "keep_fp32"\n')
    _, report = convert(gd, rules=load_rules("float16", [path], env={}))
    assert any("matches no node" in w for w in report.warnings)


def test_files_stack_in_order(tmp_path):
    first = _write(tmp_path, '[allow]\nremove = ["MatMul"]\n', "a.toml")
    second = _write(tmp_path, '[allow]\nadd = ["MatMul"]\n', "b.toml")
    assert "MatMul" in load_rules("float16", [first, second], env={}).effective("allow")
    assert "MatMul" not in load_rules("float16", [second, first], env={}).effective("allow")
    # extends restarts from the named set
    third = _write(tmp_path, 'extends = "float16"\n', "c.toml")
    assert "MatMul" in load_rules("float16", [first, third], env={}).effective("allow")


def test_grappler_environment_variables_are_honoured():
    gd, _, _ = graphs.mlp()
    env = {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE": "MatMul",
           "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD": "Relu"}
    rules = load_rules("float16", env=env)
    assert "MatMul" not in rules.effective("allow")
    assert "Relu" in rules.effective("deny") and "Relu" not in rules.effective("clear")
    new, report = convert(gd, rules=rules)
    assert all(p == "float32" for p in _precisions(new).values())
    assert sorted(report.env) == sorted(f"{k}={v}" for k, v in env.items())
    level = load_rules("float16", env={"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL": "TENSOR_CORES_ONLY"})
    assert level.level == "tensor_cores_only" and not level.effective("clear")
    old_name = load_rules("float16", env={"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_GRAYLIST_ADD": "Square"})
    assert "Square" in old_name.effective("infer")


@pytest.mark.parametrize("text, needle, line", [
    ('[allow]\nadd = [\n  "Conv2D",\n  "Matmul",\n]\n', "did you mean 'MatMul'", 4),
    ('[allow]\nadd = ["MatMull"]\n', "did you mean 'MatMul'", 2),
    ('[allow]\nadd = ["Softmax"]\n[deny]\nadd = ["Softmax"]\n', "in both", 4),
    ('[allow]\nadd = "MatMul"\n', "list of op names", 2),
    ('[painting]\ninfer_follows_allow = 3\n', "infer_follows_allow", 2),
    ('level = "fast"\n', "unknown level", 1),
    ('\n\ncolour = "red"\n', "unknown key 'colour'", 3),
    ('[[override]]\nglob = "a"\naction = "explode"\n', "action = 'explode': override action must be", 3),
    ('[allow\n', "not valid TOML", 1),
    ('# typo\nextends = "float61"\n', "neither a built-in rule set (float16, bfloat16)", 2),
])
def test_bad_rule_files_name_file_and_line(tmp_path, text, needle, line):
    path = _write(tmp_path, text)
    with pytest.raises(RuleError) as err:
        load_rules("float16", [path], env={})
    message = str(err.value)
    assert needle in message
    assert message.startswith(f"{path}:{line}:") or (needle == "not valid TOML" and str(path) in message)


def test_bad_env_variable_is_an_error():
    with pytest.raises(RuleError, match="did you mean 'MatMul'"):
        load_rules("float16", env={"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD": "Matmul"})


def test_rule_file_for_other_target_is_refused(tmp_path):
    path = _write(tmp_path, 'extends = "bfloat16"\n')
    with pytest.raises(RuleError, match="bfloat16"):
        load_rules("float16", [path], env={})


def test_default_lists_are_valid_and_disjoint():
    for target in ("float16", "bfloat16"):
        rules = load_rules(target, env={})
        seen = {}
        for name, ops in rules.lists.items():
            for op in ops:
                assert op not in seen, f"{op} in {seen.get(op)} and {name}"
                seen[op] = name
    assert load_rules("bfloat16", env={}).infer_follows_allow
    # float16 follows the installed TensorFlow's grappler: on from TensorFlow 2.21
    from amp_rewrite.rules.loader import TF_VERSION, grappler_default
    on = tuple(int(p) for p in TF_VERSION.split(".")[:2]) >= (2, 21)
    assert load_rules("float16", env={}).infer_follows_allow is on
    assert grappler_default("infer_follows_allow", "float16") is on
