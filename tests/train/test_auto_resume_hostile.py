"""``steadytrain train --auto-resume`` on what a requeue, a retry or a careless user hands it (issue 47): a folder of
the user's own, a run that had already finished, the current directory, damaged restart records.

The oracle is the directory as it was: every file's bytes before and after (a refusal or a finished run changes
none), and the one line on stderr.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.cli_utils import assert_user_error
from tests.train_utils import CHECKPOINTED, TINY, copy_run, metrics, run_cli, sets


def _items(tiny_data) -> list[str]:
    return [*TINY, f"data.path={tiny_data}", *CHECKPOINTED]


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` (and beside it: a ``NAME.restart-N``), with a file's bytes."""
    found = {str(p.relative_to(path.parent)): p.read_bytes() if p.is_file() else None for p in path.rglob("*")}
    return found | {p.name: None for p in path.parent.glob(f"{path.name}.restart-*")}


def test_a_folder_of_the_users_own_is_refused_and_left_where_it_is(tmp_path, tiny_data):
    mine = tmp_path / "experiment"
    mine.mkdir()
    (mine / "config.yaml").write_text("model: {dim: 32}\n")
    (mine / "train.py").write_text("print('my own training script')\n")
    before = snapshot(mine)
    proc = run_cli("train", "--auto-resume", "--run-dir", str(mine), *sets(*_items(tiny_data)))
    assert_user_error(proc, "--auto-resume", "experiment", "not a steadytrain run directory", "plan.json")
    assert snapshot(mine) == before


def test_a_run_that_had_already_finished_is_success_and_changes_nothing(tmp_path, tiny_run, tiny_data):
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    before = snapshot(run)
    proc = run_cli("train", "--auto-resume", "--run-dir", str(run), *sets(*_items(tiny_data)))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "already finished" in proc.stderr and "step 4 of 4" in proc.stderr
    assert sum("already finished" in line for line in proc.stderr.splitlines()) == 1
    assert snapshot(run) == before  # no restart, no resume recorded, no log cut, no lock owner written
    # an explicit --resume of it is still the user's mistake
    proc = run_cli("train", "--resume", str(run), *sets("run.max_steps=4"))
    assert_user_error(proc, "nothing to do", "run.max_steps")
    assert snapshot(run) == before


def test_the_current_directory_as_the_run_directory(tmp_path, tiny_run, tiny_data, monkeypatch):
    folder = tmp_path / "work"  # a user's folder with a config in it
    folder.mkdir()
    (folder / "config.yaml").write_text("model: {dim: 32}\n")
    monkeypatch.chdir(folder)
    proc = run_cli("train", "--auto-resume", "--run-dir", ".", *sets(*_items(tiny_data)))
    assert_user_error(proc, "--auto-resume", "not a steadytrain run directory")
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml"]

    killed = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "killed")  # killed before its first checkpoint
    for ckpt in (killed / "checkpoints").iterdir():
        shutil.rmtree(ckpt)
    before = snapshot(killed)
    monkeypatch.chdir(killed)
    proc = run_cli("train", "--auto-resume", "--run-dir", ".", *sets(*_items(tiny_data)))
    assert_user_error(proc, "--auto-resume", "current directory", f"--run-dir {killed.name}")
    assert snapshot(killed) == before  # not moved from under the shell that stands in it

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    proc = run_cli("train", "--auto-resume", "--run-dir", ".", *sets(*_items(tiny_data)))
    assert_user_error(proc, "--auto-resume", "current directory")
    assert empty.is_dir()

    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")  # interrupted after its checkpoint at step 2
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    monkeypatch.chdir(run)
    proc = run_cli("train", "--auto-resume", "--run-dir", ".", *sets(*_items(tiny_data)))
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    (restart,) = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert restart["step"] == 2


def test_a_damaged_restart_record_refuses_the_resume_before_it_changes_anything(tmp_path, tiny_run, tiny_data):
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    (run / "restarts.jsonl").write_text('{"step": 2, "world_size_before": 1, "world_size_after": 1, "reason": "x", '
                                        '"lost_s": "lots"}\n')  # fmt: skip
    before = snapshot(run)
    proc = run_cli("train", "--auto-resume", "--run-dir", str(run), *sets(*_items(tiny_data)))
    assert_user_error(proc, "restarts.jsonl: line 1", "lost_s='lots'")
    assert snapshot(run) == before


def test_a_change_the_resume_cannot_honour_names_the_flag_the_user_gave(tmp_path, tiny_run, tiny_data):
    """A requeue that forgot a --set: the refusal says --auto-resume (what was typed, not --resume), names the
    --set that keeps the run's value, and changes nothing."""
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    before = snapshot(run)
    items = [i for i in _items(tiny_data) if not i.startswith("data.path=")]
    proc = run_cli("train", "--auto-resume", "--run-dir", str(run), *sets(*items, "run.max_steps=8"))
    assert_user_error(proc, f"--auto-resume {run}: data.path cannot change", f"--set data.path={str(tiny_data)!r}")
    assert snapshot(run) == before
