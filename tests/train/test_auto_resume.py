"""``steadytrain train --auto-resume``: resume when there is a checkpoint, start otherwise, never lose a file.

The oracle of a restart is the run it restarts: the same steps, each once, with the losses of the uninterrupted
run (one process: bit for bit), and a ``restarts.jsonl`` row whose numbers come from that run's own files.
"""

from __future__ import annotations

import json
import shutil

from tests.cli_utils import assert_user_error
from tests.train_utils import CHECKPOINTED, TINY, copy_run, metrics, run_cli, sets, train


def _items(tiny_data) -> list[str]:
    return [*TINY, f"data.path={tiny_data}", *CHECKPOINTED]


def test_a_missing_run_directory_starts_fresh_and_records_no_restart(tmp_path, tiny_data):
    run = tmp_path / "run"
    train(run, *_items(tiny_data), args=("--auto-resume",))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert not run.with_name("run.restart-1").exists()
    assert not (run / "restarts.jsonl").exists() and not (run / "resumes.jsonl").exists()


def test_a_run_killed_after_a_checkpoint_resumes_there_and_records_the_restart(tmp_path, tiny_run, tiny_data):
    done = tiny_run(*CHECKPOINTED)
    run = copy_run(done, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # as if killed during step 4's save
    ckpt_elapsed = json.loads((run / "checkpoints" / "step-00000002" / "state.json").read_text())["train"]["elapsed_s"]
    last_elapsed = metrics(run)[-1]["elapsed_s"]

    train(run, *_items(tiny_data), args=("--auto-resume",))

    assert [(r["step"], r["loss"]) for r in metrics(run)] == [(r["step"], r["loss"]) for r in metrics(done)]
    (resume,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert resume["step"] == 2 and resume["changes"] == {}  # the same command: nothing changed
    (restart,) = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert restart["step"] == 2
    assert (restart["world_size_before"], restart["world_size_after"]) == (1, 1)
    assert restart["lost_s"] >= last_elapsed - ckpt_elapsed > 0  # step 3 and 4 are trained again
    assert "started again" in restart["reason"]
    assert "restarted 1 time(s)" in (run / "summary.md").read_text()


def test_a_finished_run_continued_is_a_resume_not_a_restart(tmp_path, tiny_run, tiny_data):
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    train(run, *_items(tiny_data), "run.max_steps=6", args=("--auto-resume",))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    (resume,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert resume["changes"] == {"run.max_steps": [4, 6]}
    assert not (run / "restarts.jsonl").exists()


def test_a_run_killed_before_its_first_checkpoint_is_kept_aside_and_started_again(tmp_path, tiny_run, tiny_data):
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    for ckpt in (run / "checkpoints").iterdir():
        shutil.rmtree(ckpt)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    train(run, *_items(tiny_data), args=("--auto-resume",))
    aside = run.with_name("run.restart-1")
    assert sorted(p.relative_to(aside) for p in aside.rglob("*")) == before  # nothing lost
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    # a second such attempt takes the next free name
    for ckpt in (run / "checkpoints").iterdir():
        shutil.rmtree(ckpt)
    train(run, *_items(tiny_data), args=("--auto-resume",))
    assert run.with_name("run.restart-2").is_dir() and aside.is_dir()


def test_an_empty_directory_is_claimed(tmp_path, tiny_data):
    run = tmp_path / "run"
    run.mkdir()
    train(run, *_items(tiny_data), args=("--auto-resume",))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_a_foreign_directory_or_a_file_is_refused_and_left_alone(tmp_path, tiny_data):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("meow")
    proc = run_cli("train", "--auto-resume", "--run-dir", str(foreign), *sets(*_items(tiny_data)))
    assert_user_error(proc, "--auto-resume", "not a steadytrain run directory", "photos")  # a long path is shortened
    assert [p.name for p in foreign.iterdir()] == ["cat.jpg"] and not foreign.with_name("photos.restart-1").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    proc = run_cli("train", "--auto-resume", "--run-dir", str(a_file), *sets(*_items(tiny_data)))
    assert_user_error(proc, "--run-dir", "is a file")
    assert a_file.read_text() == "x"


def test_a_damaged_checkpoint_or_another_model_is_the_resumes_one_line_refusal(tmp_path, tiny_run, tiny_data):
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    proc = run_cli("train", "--auto-resume", "--run-dir", str(run), *sets(*_items(tiny_data), "model.dim=64"))
    assert_user_error(proc, "model.dim")
    (run / "checkpoints" / "step-00000004" / "state.json").write_text('{"step": "four"')
    proc = run_cli("train", "--auto-resume", "--run-dir", str(run), *sets(*_items(tiny_data)))
    assert_user_error(proc, "step-00000004")
    assert not (run / "restarts.jsonl").exists() and not (run / "resumes.jsonl").exists()


def test_flags_that_do_not_go_together_are_usage_errors(tmp_path, tiny_run):
    run = tiny_run(*CHECKPOINTED)
    proc = run_cli("train", "--resume", str(run), "--auto-resume")
    assert_user_error(proc, "--resume", "--auto-resume")
    proc = run_cli("train", "--run-dir", str(tmp_path / "r"), "--max-restarts", "2")
    assert_user_error(proc, "--max-restarts", "--nproc")
