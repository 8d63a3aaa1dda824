"""The second hostile pass of issue 47 (Hardening IV): two processes on one run, kill -9 then ``--auto-resume``,
hostile hang records, hostile meshes.

Findings, each a test that failed before its fix:

- ``--auto-resume`` on a run another process was writing (no checkpoint yet) moved it aside as ``RUN.restart-1`` and
  started a second run in its place: the first went on writing into the new one (its ``metrics.jsonl`` then held
  steps 1-4 twice and the first process died on it). ``restart._decide`` now holds the run's lock to move it, so
  the second is refused in one line; a second ``train`` on a held run says who holds it
  (``rundir.layout.held_error``), not "exists: resume it with --resume";
- a ``hang.json`` naming 20,000 stuck ranks was a 129 KB line of ``steadytrain hangs`` and a 129 KB restart
  reason (``rundir.hangs.ranks_text``: the first 16 and how many more);
- ``check-parallel CFG`` never read CFG's own ``distributed.mesh``: a list, a number or a nested value there
  trained both layouts; now it is the one line ``train`` gives for it (``runs.parallel.check_parallel``).

Real processes only where two of them on one run are the point (a holder paused in its first step by a user model,
:mod:`tests.train.test_hardening_train`'s); the rest in process, on hand-written records.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from steadytrain.train.job.restart import record_restart
from tests.cli_utils import EXE, assert_user_error, in_process
from tests.runs.test_hostile_hangs import HANG, restarting, run_with_hang
from tests.train.test_hardening_train import _MODEL, _args, _pause, _rows, _start, _wait_for
from tests.train_utils import run_cli, user_package, write_text_dataset

STEPS = ("run.max_steps=6", "checkpoint.every_steps=2", "run.log_every=1")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("hostile-w") / "data", [40] * 4)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return user_package(tmp_path, pausemodel=_MODEL)  # test_hardening_train's model that pauses at a chosen step


def _auto(run: Path, data: Path, model_dir: Path, *items: str) -> subprocess.CompletedProcess:
    return run_cli("train", "--auto-resume", "--run-dir", str(run), *_args(data, *items), PYTHONPATH=str(model_dir))


# --- two processes on one run --------------------------------------------------------------------------------


def test_an_auto_resume_never_moves_a_run_another_process_is_writing(tmp_path, model_dir, data):
    run = tmp_path / "run"
    holder = _start(model_dir, run, data, *STEPS, pause=_pause(tmp_path, 1))  # step 1: no checkpoint yet
    _wait_for(tmp_path / "reached-0", holder)
    assert_user_error(_auto(run, data, model_dir, *STEPS), str(run), "being written by", f"pid {holder.pid}")
    again = run_cli("train", "--run-dir", str(run), *_args(data, *STEPS), PYTHONPATH=str(model_dir))
    assert_user_error(again, "being written by", f"pid {holder.pid}")  # not "exists: resume it with --resume"
    (tmp_path / "go").touch()
    _, err = holder.communicate(timeout=120)
    assert holder.returncode == 0, err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run.")] == []  # nothing moved aside
    assert [r["step"] for r in _rows(run)] == list(range(1, 7))


def test_two_auto_resumes_started_together_one_trains_and_the_other_is_refused(tmp_path, model_dir, data):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(model_dir)}
    cmd = [EXE, "train", "--auto-resume", "--run-dir", str(run), *_args(data, *STEPS)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    done = [subprocess.CompletedProcess(cmd, p.wait(timeout=180), *p.communicate()) for p in procs]
    assert sorted(p.returncode for p in done) == [0, 2], [p.stderr[-2000:] for p in done]
    assert_user_error(next(p for p in done if p.returncode == 2), str(run))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run.")] == []
    assert [r["step"] for r in _rows(run)] == list(range(1, 7))


# --- hang records ----------------------------------------------------------------------------------------------


def test_twenty_thousand_stuck_ranks_are_a_short_line_and_a_short_restart_reason(tmp_path):
    ranks = list(range(20_000))
    proc = in_process("hangs", str(run_with_hang(tmp_path, HANG | {"stuck_ranks": ranks})))
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("step 5: rank(s) 0, 1, 2,") and "and 19984 more stuck in forward" in first, first[:300]
    assert len(first) < 300
    assert json.loads(in_process("hangs", str(tmp_path / "run"), "--json").stdout)[0]["stuck_ranks"] == ranks
    record = record_restart(
        restarting(tmp_path / "r", HANG | {"stuck_ranks": ranks}), step=4, elapsed_s=0, world_size=2
    )
    assert record["reason"].startswith("hang at step 5: rank(s) 0, 1,") and len(record["reason"]) < 300


# --- check-parallel's config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "words"),
    [("[2, 1]", "is not a mesh"), ("4", "is not a mesh"), ("{shard: {a: 1}}", "distributed.mesh.shard"),
     ("{shard: 2, foo: 1}", "distributed.mesh.foo")],
)  # fmt: skip
def test_check_parallel_checks_the_configs_own_mesh_before_training(tmp_path, mesh, words):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"distributed: {{mesh: {mesh}}}\n")
    out = tmp_path / "out"
    proc = in_process("check-parallel", str(cfg), "--mesh", "shard=2", "--out", str(out))
    assert_user_error(proc, "c.yaml", words)
    assert not out.exists()


def test_report_of_a_run_still_training_says_running_not_stopped_early(tmp_path, tiny_run):
    """A run cut short (its metrics say 2 of 4 steps) is "stopped early" unless a process holds it: then "running",
    naming who holds it (the lock another process would be refused by)."""
    from filelock import FileLock

    from tests.train_utils import copy_run

    run = copy_run(tiny_run(), tmp_path / "run")
    rows = (run / "metrics.jsonl").read_text().splitlines()
    kept = [r for r in rows if json.loads(r)["step"] <= 2]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    assert in_process("report", str(run)).returncode == 0
    assert "stopped early: 2 of " in (run / "summary.md").read_text()
    (run / ".lock.owner").write_text("pid 4242 on node-7\nsince now\x1b[2J\n")
    with FileLock(run / ".lock", timeout=0):  # held as a training process holds it
        assert in_process("report", str(run)).returncode == 0
    summary = (run / "summary.md").read_text()
    assert "running: 2 of " in summary and "pid 4242 on node-7" in summary and "stopped early" not in summary
    assert "\x1b" not in summary
