"""The rule loader on its own: what each key does, and a RuleError (never another exception)
for every wrong TOML type at every key."""

import itertools

import pytest

from amp_rewrite.core.errors import RuleError
from amp_rewrite.rules.loader import load_rules

pytestmark = pytest.mark.fast

# one value of every TOML type, as TOML text
VALUES = {
    "string": '"Relu"', "integer": "1", "float": "1.5", "boolean": "true",
    "datetime": "1979-05-27T07:32:00Z", "date": "1979-05-27", "time": "07:32:00",
    "strings": '["Relu"]', "integers": "[1, 2]", "empty array": "[]",
    "tables": "[{ glob = \"x\", action = \"keep_fp32\" }]", "table": "{ a = 1 }",
    "empty table": "{}",
}
# where a key sits: (table header or "", key, other lines the table needs)
KEYS = [("", key, "") for key in ("target", "extends", "level", "painting", "override",
                                  "allow", "infer", "clear", "deny")]
KEYS += [(f"[{lst}]", key, "") for lst in ("allow", "infer", "clear", "deny")
         for key in ("ops", "add", "remove")]
KEYS += [("[painting]", "infer_follows_allow", "")]
KEYS += [("[[override]]", "glob", 'action = "keep_fp32"'),
         ("[[override]]", "regex", 'action = "keep_fp32"'),
         ("[[override]]", "action", 'glob = "x"')]


def _load(tmp_path, text: str, name: str = "r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return load_rules("float16", [path], env={})


def test_every_toml_type_at_every_key_is_accepted_or_a_rule_error(tmp_path):
    outcomes = {"loaded": 0, "refused": 0}
    for (table, key, extra), (kind, value) in itertools.product(KEYS, VALUES.items()):
        text = "\n".join(line for line in (table, f"{key} = {value}", extra) if line) + "\n"
        try:
            _load(tmp_path, text)
        except RuleError as exc:
            outcomes["refused"] += 1
            assert str(exc).startswith(str(tmp_path / "r.toml")), (kind, key, str(exc))
        except Exception as exc:  # noqa: BLE001 - the property under test
            pytest.fail(f"{table} {key} = {value} ({kind}): {type(exc).__name__}: {exc}")
        else:
            outcomes["loaded"] += 1
    # both happen: the right types load (a string op list, a boolean setting ...)
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0


def test_a_list_of_strings_for_override_names_file_and_line(tmp_path):
    with pytest.raises(RuleError, match=r"r\.toml:2: .*\[\[override\]\]"):
        _load(tmp_path, 'extends = "float16"\noverride = ["head/*"]\n')


def test_add_moves_an_op_and_remove_drops_it(tmp_path):
    base = load_rules("float16", env={})
    assert "Relu" in base.lists["clear"] and "Exp" in base.lists["deny"]
    rules = _load(tmp_path, '[allow]\nadd = ["Relu"]\n[deny]\nremove = ["Exp"]\n')
    assert "Relu" in rules.lists["allow"] and "Relu" not in rules.lists["clear"]
    assert rules.category("Exp") is None and rules.sources[-1].endswith("r.toml")


def test_ops_replaces_a_list_and_level_and_painting_apply(tmp_path):
    rules = _load(tmp_path, 'level = "treat_infer_as_deny"\n[allow]\nops = ["MatMul"]\n'
                            '[painting]\ninfer_follows_allow = true\n')
    assert rules.lists["allow"] == {"MatMul"} and rules.infer_follows_allow
    assert rules.effective("infer") == frozenset() and "Add" in rules.effective("deny")


def test_overrides_later_wins_and_glob_and_regex_match_names(tmp_path):
    rules = _load(tmp_path, '[[override]]\nglob = "head/*"\naction = "keep_fp32"\n'
                            '[[override]]\nregex = "^head/fc2$"\naction = "force_lowp"\n')
    assert rules.node_rule("head/fc1").action == "keep_fp32"
    assert rules.node_rule("head/fc2").action == "force_lowp"
    assert rules.node_rule("body/fc") is None
    assert rules.node_rules[1].source.endswith("r.toml:4")


@pytest.mark.parametrize("text, match", [
    ('[allow]\nadd = ["Relux"]\n', r":2: .*no op 'Relux'; did you mean 'Relu'"),
    ('[allow]\nadd = ["Relu"]\n[deny]\nadd = ["Relu"]\n', r"in both \[allow\] and \[deny\]"),
    ('target = "bfloat16"\n', r":1: this rule file is for target 'bfloat16'"),
    ('extends = "bfloat16"\n', r"extends 'bfloat16', but the conversion targets 'float16'"),
    ('extends = "nope.toml"\n', r"neither a built-in rule set"),
    ('colour = "red"\n', r"unknown key 'colour'"),
    ('level = "fast"\n', r"unknown level 'fast'"),
    ('[[override]]\nregex = "("\naction = "keep_fp32"\n', r"bad regex"),
    ('[[override]]\nglob = "x"\nregex = "y"\naction = "keep_fp32"\n', r"exactly one of glob or regex"),
    ('[[override]]\nglob = "x"\naction = "paint"\n', r"action must be one of"),
    ("not = [toml\n", r"not valid TOML"),
])
def test_bad_files_are_rule_errors_naming_the_file(tmp_path, text, match):
    with pytest.raises(RuleError, match=match):
        _load(tmp_path, text)


def test_extends_cycle_unreadable_and_non_utf8_files(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(RuleError, match="makes a cycle"):
        load_rules("float16", [tmp_path / "a.toml"], env={})
    with pytest.raises(RuleError, match="cannot read"):
        load_rules("float16", [tmp_path / "missing.toml"], env={})
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RuleError, match="not UTF-8"):
        load_rules("float16", [tmp_path / "bin.toml"], env={})


def test_grappler_variables_apply_last():
    env = {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD": "Relu",
           "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_REMOVE": "Exp",
           "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL": "TENSOR_CORES_ONLY"}
    rules = load_rules("float16", env=env)
    assert "Relu" in rules.lists["allow"] and "Exp" not in rules.lists["deny"]
    assert rules.level == "tensor_cores_only" and len(rules.env) == 3
    with pytest.raises(RuleError, match="no op 'Relux'"):
        load_rules("float16", env={"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD": "Relux"})
    with pytest.raises(RuleError, match="not a variable grappler knows"):
        load_rules("float16", env={"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_PINKLIST_ADD": "Relu"})
