"""Every output of a command is written with the others, or not at all.

A bad destination for any output (the model, ``--report``, ``--html``, ``--tensorboard``,
``--json``, tune's rules file) is refused before the work starts: exit 2, one line naming it,
no file written (the model included), the input unchanged. A good run writes every output.
Should a rename fail once everything is written, the renames before it are undone
(:class:`~amp_rewrite.io.files.OutputSet`).
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tune_graphs
from refusals import assert_refused, run_batch, run_cli, snapshot, without_root_powers

from amp_rewrite.core.errors import InputError
from amp_rewrite.io.files import OutputSet

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"
KERAS_EXPORT = Path(__file__).parent / "data" / "keras_export"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder holding the input, a file and a sub-folder that are in the way, as cwd."""
    shutil.copy(EXAMPLE, tmp_path / "in.pb")
    (tmp_path / "taken.json").write_text("{}\n")
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _refused(capsys, folder, argv, named):
    before = snapshot(folder)
    code, _, err = run_cli(capsys, argv)
    assert_refused(code, err, named, folder, before)


# ----------------------------------------------------------------- convert
CONVERT = ["in.pb", "-o", "out.pb"]
CONVERT_REFUSALS = {
    "report_exists": (["--report", "taken.json"], "taken.json"),
    "report_is_a_directory": (["--report", "adir", "--force"], "adir"),
    "report_folder_missing": (["--report", "nowhere/r.json"], "r.json"),
    "report_is_the_input": (["--report", "in.pb", "--force"], "in.pb"),
    "report_is_the_output": (["--report", "out.pb"], "out.pb"),
    "html_exists": (["--html", "taken.json"], "taken.json"),
    "html_is_a_directory": (["--html", "adir", "--force"], "adir"),
    "html_folder_missing": (["--html", "nowhere/r.html"], "r.html"),
    "html_is_the_input": (["--html", "in.pb", "--force"], "in.pb"),
    "html_is_the_report": (["--report", "r.json", "--html", "r.json"], "r.json"),
    "tensorboard_is_a_file": (["--tensorboard", "taken.json"], "taken.json"),
    "tensorboard_folder_missing": (["--tensorboard", "nowhere/tb"], "tb"),
    "tensorboard_is_the_output": (["--tensorboard", "out.pb"], "out.pb"),
    "tensorboard_inside_a_file": (["--tensorboard", "in.pb/tb"], "tb"),
}


@pytest.mark.parametrize("case", sorted(CONVERT_REFUSALS))
def test_convert_side_output_refusals_write_nothing(case, folder, capsys):
    """The old --tensorboard check came after the model was written: a bad folder left it."""
    extra, named = CONVERT_REFUSALS[case]
    _refused(capsys, folder, CONVERT + extra, named)


def test_convert_writes_the_model_report_page_and_event_file(folder, capsys):
    argv = CONVERT + ["--report", "r.json", "--html", "r.html", "--tensorboard", "tb", "-q"]
    assert run_cli(capsys, argv)[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        "adir", "in.pb", "out.pb", "r.html", "r.json", "taken.json", "tb"]
    (event,) = (folder / "tb").iterdir()
    written = tf.compat.v1.GraphDef()
    written.ParseFromString((folder / "out.pb").read_bytes())
    (graph,) = [tf.compat.v1.GraphDef.FromString(e.graph_def)
                for e in tf.compat.v1.train.summary_iterator(str(event)) if e.graph_def]
    assert {n.name: n.op for n in graph.node} == {n.name: n.op for n in written.node}
    report = json.loads((folder / "r.json").read_text())
    assert report["summary"]["matrix_converted"] == 4
    assert "<table" in (folder / "r.html").read_text()
    # again with --force: each file replaced, a second event file beside the first
    (folder / "r.json").write_text("old")
    assert run_cli(capsys, argv + ["--force"])[0] == 0
    assert json.loads((folder / "r.json").read_text()) == report
    assert len(list((folder / "tb").iterdir())) == 2
    assert not [p for p in folder.rglob(".*")]   # no temporary left anywhere


def test_a_saved_model_output_refused_while_saving_leaves_nothing(tmp_path, capsys):
    """A folder of something else is never replaced by a SavedModel, even with --force: found
    once the model is converted, before the report and event file are written or renamed."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me\n")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [KERAS_EXPORT, "-o", tmp_path / "notes", "--force",
                                    "--report", tmp_path / "r.json",
                                    "--tensorboard", tmp_path / "tb"])
    assert_refused(code, err, "notes", tmp_path, before)


# ----------------------------------------------------------------- verify, bench, kernels
OTHER_REFUSALS = {
    "verify_html_exists": (["verify", "in.pb", "in.pb", "--html", "taken.json"], "taken.json"),
    "verify_html_is_a_directory": (["verify", "in.pb", "in.pb", "--html", "adir", "--force"], "adir"),
    "verify_html_folder_missing": (["verify", "in.pb", "in.pb", "--html", "no/v.html"], "v.html"),
    "verify_html_is_the_converted_model": (["verify", EXAMPLE, "in.pb", "--html", "in.pb",
                                            "--force"], "in.pb"),
    "verify_html_is_the_report_read": (["verify", "in.pb", "in.pb", "--report", "taken.json",
                                        "--html", "taken.json", "--force"], "taken.json"),
    "bench_json_exists": (["bench", "in.pb", "in.pb", "--json", "taken.json"], "taken.json"),
    "bench_html_is_the_json": (["bench", "in.pb", "in.pb", "--json", "b.json", "--html", "b.json"],
                               "b.json"),
    "bench_html_folder_missing": (["bench", "in.pb", "in.pb", "--json", "b.json",
                                   "--html", "no/b.html"], "b.html"),
    "kernels_json_exists": (["kernels", "in.pb", "--json", "taken.json"], "taken.json"),
    "kernels_json_is_the_model": (["kernels", "in.pb", "--json", "in.pb", "--force"], "in.pb"),
}


@pytest.mark.parametrize("case", sorted(OTHER_REFUSALS))
def test_verify_bench_kernels_outputs_are_checked_first(case, folder, capsys):
    argv, named = OTHER_REFUSALS[case]
    _refused(capsys, folder, argv, named)


def test_bench_writes_both_files_and_force_replaces_them(folder, capsys):
    argv = ["bench", "in.pb", "in.pb", "--shape", "images=2,8,8,1", "--runs", "2", "--warmup",
            "1", "--json", "taken.json", "--html", "b.html", "-q"]
    assert run_cli(capsys, argv)[0] == 2   # taken.json exists
    assert not (folder / "b.html").exists()
    assert run_cli(capsys, argv + ["--force"])[0] == 0
    assert json.loads((folder / "taken.json").read_text())["runs"] == 2
    assert "Bench" in (folder / "b.html").read_text()


# ----------------------------------------------------------------- tune
@pytest.fixture
def tune_folder(folder):
    (folder / "sum.pb").write_bytes(tune_graphs.large_sum().SerializeToString())
    np.savez(folder / "s.npz", **tune_graphs.inputs(64, scale=10.0))
    return folder


TUNE = ["tune", "sum.pb", "--inputs", "s.npz", "-o", "t.pb"]
TUNE_REFUSALS = {
    "output_exists": (["-o", "taken.json"], "taken.json"),
    "rules_exists": (["--rules-out", "taken.json"], "taken.json"),
    "rules_folder_missing": (["--rules-out", "no/r.toml"], "r.toml"),
    "rules_is_the_output": (["--rules-out", "t.pb"], "t.pb"),
    "rules_is_a_sample": (["--rules-out", "s.npz", "--force"], "s.npz"),
    "report_exists": (["--report", "taken.json"], "taken.json"),
    "report_is_the_rules": (["--rules-out", "r.toml", "--report", "r.toml"], "r.toml"),
    "report_is_a_directory": (["--report", "adir", "--force"], "adir"),
}


@pytest.mark.parametrize("case", sorted(TUNE_REFUSALS))
def test_tune_outputs_are_checked_first(case, tune_folder, capsys):
    extra, named = TUNE_REFUSALS[case]
    _refused(capsys, tune_folder, TUNE + extra, named)


def test_tune_writes_model_rules_and_report_together(tune_folder, capsys):
    code, _, err = run_cli(capsys, TUNE + ["--report", "t.json", "-q"])
    assert code == 0, err
    assert {"t.pb", "t.pb.tune.toml", "t.json"} <= {p.name for p in tune_folder.iterdir()}
    rules = (tune_folder / "t.pb.tune.toml").read_text()
    report = {n["name"]: n for n in json.loads((tune_folder / "t.json").read_text())["nodes"]}
    written = tf.compat.v1.GraphDef.FromString((tune_folder / "t.pb").read_bytes())
    for node in ("pool", "head"):   # what the search keeps float32 (test_tune)
        assert f'glob = "{node}"' in rules and report[node]["precision"] == "float32"
        (nd,) = [n for n in written.node if n.name == node]
        assert nd.attr["T"].type == tf.float32.as_datatype_enum


# ----------------------------------------------------------------- permissions
def test_unwritable_side_output_folders_are_refused_before_any_work(folder):
    prefix = without_root_powers()
    if prefix is None:
        pytest.skip("running as root without setpriv: permission bits cannot be enforced")
    locked = folder / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        before = snapshot(folder)
        commands = [[EXAMPLE, "-o", folder / "out.pb", "--report", locked / "r.json"],
                    [EXAMPLE, "-o", folder / "out.pb", "--html", locked / "r.html"],
                    [EXAMPLE, "-o", folder / "out.pb", "--tensorboard", locked / "tb"],
                    [EXAMPLE, "-o", folder / "out.pb", "--tensorboard", locked],
                    ["verify", EXAMPLE, EXAMPLE, "--html", locked / "v.html"],
                    ["kernels", EXAMPLE, "--json", locked / "k.json"]]
        results = run_batch(commands, prefix)
        for (code, err), named in zip(results, ["r.json", "r.html", "tb", "locked", "v.html",
                                                "k.json"]):
            assert_refused(code, err, named, folder, before)
    finally:
        os.chmod(locked, 0o755)


# ----------------------------------------------------------------- the set itself
def test_a_failed_rename_undoes_the_renames_before_it(tmp_path):
    """The second target appears between the checks and the renames: the first output is taken
    back out, and the file it replaced is back as it was."""
    first, second, third = tmp_path / "model.pb", tmp_path / "report.json", tmp_path / "new.html"
    first.write_bytes(b"the old model")
    with pytest.raises(InputError, match="report.json"):
        with OutputSet() as outputs:
            outputs.add_file(first, b"the new model", force=True)
            outputs.add_file(second, b"{}")
            outputs.add_file(third, b"<html>")
            second.write_bytes(b"someone else's")
            outputs.commit()
    assert first.read_bytes() == b"the old model"
    assert second.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pb", "report.json"]


def test_a_folder_is_never_replaced_by_a_file_and_new_folders_are_taken_back(tmp_path):
    (tmp_path / "tb").mkdir()
    with pytest.raises(InputError, match="folder"):
        with OutputSet() as outputs:
            outputs.add_file(tmp_path / "a.json", b"{}")
            staged = outputs.temporary_folder(tmp_path / "tb" / "events")
            (staged / "events.out").write_bytes(b"x")
            outputs.add(staged / "events.out", tmp_path / "tb" / "events.out")
            outputs.add_file(tmp_path / "r.json", b"{}", force=True)
            (tmp_path / "r.json").mkdir()   # appears before the commit
            outputs.commit()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "r.json", "tb"]


def test_leaving_without_a_commit_removes_the_temporaries(tmp_path):
    with pytest.raises(RuntimeError):
        with OutputSet() as outputs:
            outputs.add_file(tmp_path / "a.json", b"{}")
            outputs.temporary_folder(tmp_path / "saved_model")
            raise RuntimeError("the next output could not be made")
    assert list(tmp_path.iterdir()) == []
