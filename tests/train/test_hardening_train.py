"""`steadytrain train` under careless and hostile use: no lost or duplicated step, no silent override.

Crashes land where the test chooses: a user model pauses at a chosen forward call (it writes a
`reached` file with its pid and waits for a `go` file), and the test kills or signals it there.
Oracles: a straight run of the same config (bit-identical losses), the schedule's closed form.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steadytrain.schedule import lr_multiplier
from tests.cli_utils import assert_user_error
from tests.train_utils import EXE, TINY, copy_run, evals, run_cli, sets, write_text_dataset

K = 4  # micro-batches per optimizer step with TINY on one rank (global 16 / micro 4)
BATCH = [x for x in TINY if not x.startswith("model.")]

_MODEL = '''
import os, time
from pathlib import Path
import torch
import torch.nn.functional as F


class Paused(torch.nn.Module):
    """A bigram LM that pauses at forward call $PAUSE_AT (1-based) until `$PAUSE_DIR/go` exists."""

    def __init__(self, dim=16, nan=False):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)
        self.calls, self.nan = 0, nan
        self.pause_at, self.dir = int(os.environ.get("PAUSE_AT", "0")), Path(os.environ.get("PAUSE_DIR", "."))

    def forward(self, batch):
        self.calls += 1
        if self.calls == self.pause_at:
            rank = os.environ.get("RANK", "0")
            (self.dir / f"reached-{rank}").write_text(str(os.getpid()))
            while not (self.dir / "go").exists():
                time.sleep(0.01)
        tokens = batch["tokens"].long()
        loss = F.cross_entropy(self.head(self.emb(tokens[:, :-1])).transpose(1, 2), tokens[:, 1:], reduction="none")
        return loss.mean(1) * float("nan") if self.nan else loss.mean(1)


def factory(**kw):
    return Paused(**kw)
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("hard") / "data", [40, 40, 40, 40])


@pytest.fixture
def model_dir(tmp_path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "pausemodel.py").write_text(_MODEL)
    return tmp_path / "pkg"


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, data) -> Path:
    """A finished 4-step run of the pausing model (no pause) on ``data``, trained once for the module: the resume
    tests below work on a copy (``copy_run``) with their own ``model_dir``, which holds the same model."""
    tmp = tmp_path_factory.mktemp("four-steps")
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "pausemodel.py").write_text(_MODEL)
    run = tmp / "run"
    proc = run_cli("train", "--run-dir", str(run), *_args(data, "run.max_steps=4"), PYTHONPATH=str(tmp / "pkg"))
    assert proc.returncode == 0, proc.stderr
    return run


def _args(data: Path, *items: str) -> list[str]:
    return sets(*BATCH, f"data.path={data}", "model.name=pausemodel:factory", "checkpoint.keep_last=10", *items)


def _start(
    model_dir: Path, run_dir: Path, data: Path, *items: str, pause: dict, resume: bool = False
) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(model_dir), **pause}
    head = ["train", "--resume", str(run_dir)] if resume else ["train", "--run-dir", str(run_dir)]
    cmd = [EXE, *head, *(sets(*items) if resume else _args(data, *items))]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    time.sleep(0.05)
    return int(path.read_text())


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "val_loss" not in r]  # the training rows


def _straight(tmp_path: Path, model_dir: Path, data: Path, steps: int, *items: str) -> list[dict]:
    run = tmp_path / "straight"
    proc = run_cli(
        "train", "--run-dir", str(run), *_args(data, f"run.max_steps={steps}", *items), PYTHONPATH=str(model_dir)
    )
    assert proc.returncode == 0, proc.stderr
    return _rows(run)


def _pause(tmp_path: Path, step: int, world: int = 1) -> dict:
    """The environment that pauses the model at the first forward call of optimizer ``step``."""
    return {"PAUSE_AT": str((step - 1) * K // world + 1), "PAUSE_DIR": str(tmp_path)}


def test_a_kill_after_a_checkpoint_loses_no_metrics_row(tmp_path, model_dir, data):
    # checkpoint every 3 steps, rows written every 4: checkpoint 6 is newer than the rows on disk
    # unless they are flushed first. Killed during step 7, resumed: steps 1..12, once each.
    items = ["run.max_steps=12", "checkpoint.every_steps=3", "run.log_every=4"]
    run = tmp_path / "run"
    proc = _start(model_dir, run, data, *items, pause=_pause(tmp_path, 7))
    _wait_for(tmp_path / "reached-0", proc)
    proc.kill()
    proc.wait()
    resumed = run_cli("train", "--resume", str(run), PYTHONPATH=str(model_dir))
    assert resumed.returncode == 0, resumed.stderr
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    straight = _straight(tmp_path, model_dir, data, 12, *items)
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]


def test_two_resumes_of_one_run_at_once_the_second_is_refused_and_a_killed_holder_does_not_block(
    tmp_path, model_dir, data
):
    run = tmp_path / "run"
    first = run_cli("train", "--run-dir", str(run), *_args(data, "run.max_steps=2"), PYTHONPATH=str(model_dir))
    assert first.returncode == 0, first.stderr
    holder = _start(model_dir, run, data, "run.max_steps=4", pause=_pause(tmp_path, 1), resume=True)
    _wait_for(tmp_path / "reached-0", holder)
    second = run_cli("train", "--resume", str(run), *sets("run.max_steps=4"), PYTHONPATH=str(model_dir))
    assert_user_error(second, "being written by", f"pid {holder.pid}")
    holder.kill()  # kill -9: the kernel drops its lock
    holder.wait()
    third = run_cli("train", "--resume", str(run), *sets("run.max_steps=4"), PYTHONPATH=str(model_dir))
    assert third.returncode == 0, third.stderr
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]


def _interrupted_at(step: int, tmp_path: Path, model_dir: Path, run: Path, data: Path, *items: str) -> str:
    """Ctrl-C during optimizer ``step`` of a new run: exit 130; its stderr."""
    proc = _start(model_dir, run, data, *items, pause=_pause(tmp_path, step))
    _wait_for(tmp_path / "reached-0", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    (tmp_path / "go").touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    return err


def test_ctrl_c_writes_a_checkpoint_at_the_step_boundary_and_resume_continues_exactly(tmp_path, model_dir, data):
    run = tmp_path / "run"
    err = _interrupted_at(5, tmp_path, model_dir, run, data, "run.max_steps=8", "checkpoint.every_steps=100")
    assert "Traceback" not in err
    assert f"--resume {run}" in err and "step 5" in err
    assert (run / "checkpoints" / "step-00000005" / "state.json").is_file()
    assert "interrupted by SIGINT at step 5" in (run / "summary.md").read_text()
    resumed = run_cli("train", "--resume", str(run), PYTHONPATH=str(model_dir))
    assert resumed.returncode == 0, resumed.stderr
    straight = _straight(tmp_path, model_dir, data, 8, "checkpoint.every_steps=100")
    assert [(r["step"], r["loss"]) for r in _rows(run)] == [(r["step"], r["loss"]) for r in straight]


def test_ctrl_c_on_an_evaluation_step_still_evaluates_it(tmp_path, model_dir, data):
    # Ctrl-C during step 5, which evaluates: the evaluation of step 5 runs before the stop is honoured
    # (a resume starts at step 6 and would never owe it), so the resumed run's evaluations are a straight run's.
    items = ["run.max_steps=8", "checkpoint.every_steps=100", "eval.holdout_shards=1", "eval.every_steps=5"]
    run = tmp_path / "run"
    _interrupted_at(5, tmp_path, model_dir, run, data, *items)
    assert [r["step"] for r in evals(run)] == [5]
    resumed = run_cli("train", "--resume", str(run), PYTHONPATH=str(model_dir))
    assert resumed.returncode == 0, resumed.stderr
    straight = tmp_path / "straight"
    done = run_cli("train", "--run-dir", str(straight), *_args(data, *items), PYTHONPATH=str(model_dir))
    assert done.returncode == 0, done.stderr
    assert [(r["step"], r["val_loss"]) for r in evals(run)] == [(r["step"], r["val_loss"]) for r in evals(straight)]
    assert [r["step"] for r in evals(straight)] == [5, 8]


def test_a_second_ctrl_c_aborts_at_once_without_a_checkpoint(tmp_path, model_dir, data):
    run = tmp_path / "run"
    proc = _start(model_dir, run, data, "run.max_steps=8", "checkpoint.every_steps=100", pause=_pause(tmp_path, 3))
    _wait_for(tmp_path / "reached-0", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)  # beyond the window in which a forwarded copy of the first signal is ignored
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "aborted" in err
    assert list((run / "checkpoints").iterdir()) == []


@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_both_after_the_same_step_with_a_checkpoint(tmp_path, model_dir, data):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(model_dir), **_pause(tmp_path, 3, world=2)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "steadytrain"]
    cmd += ["train", "--run-dir", str(run), *_args(data, "run.max_steps=8", "checkpoint.every_steps=100")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = _wait_for(tmp_path / "reached-1", proc)
    _wait_for(tmp_path / "reached-0", proc)
    os.kill(pid, signal.SIGTERM)  # rank 1 alone
    time.sleep(0.3)
    (tmp_path / "go").touch()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1, (saved, err[-2000:])
    stopped_at = int(saved[0].split("-")[1].split(".")[0])
    assert stopped_at in (3, 4)  # the boundary after the signal: every rank agreed on it
    assert [r["step"] for r in _rows(run)] == list(range(1, stopped_at + 1))


def test_a_torn_last_metrics_line_does_not_stop_a_resume(tmp_path, model_dir, four_steps):
    run = copy_run(four_steps, tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.1')  # what a kill in the middle of a write leaves
    resumed = run_cli("train", "--resume", str(run), *sets("run.max_steps=6"), PYTHONPATH=str(model_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4, 5, 6]


def test_resume_applies_a_new_lr_and_max_steps_from_the_resume_step_and_records_them(tmp_path, model_dir, four_steps):
    run = copy_run(four_steps, tmp_path / "run")
    proc = run_cli(
        "train", "--resume", str(run), *sets("batch.base_lr=0.5", "run.max_steps=8"), PYTHONPATH=str(model_dir)
    )
    assert proc.returncode == 0, proc.stderr
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    plan = json.loads((run / "plan.json").read_text())
    assert plan["total_steps"] == 8 and plan["lr"] == 0.5  # global 16 = base batch 16: unscaled
    for r in rows[4:]:  # the LR of step s is set after step s-1: peak x multiplier(s - 1)
        want = 0.5 * lr_multiplier(
            r["step"] - 1, warmup_steps=plan["warmup_steps"], total_steps=8, decay="cosine", min_lr_ratio=0.1
        )
        assert math.isclose(r["lr"], want, rel_tol=1e-12), (r, want)
    (record,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["changes"]["batch.base_lr"] == [0.01, 0.5]
    assert "base_lr: 0.5" in (run / "config.yaml").read_text()
    summary = (run / "summary.md").read_text()
    assert "8 of 8 planned" in summary
    assert "resumed after step 4 on 1 rank(s): batch.base\\_lr 0.01 → 0.5" in summary
    with open(run / "resumes.jsonl", "a") as f:
        f.write('{"step": "four", "world_size": 1, "changes": {}}\n')
    assert_user_error(run_cli("report", str(run)), "resumes.jsonl: line 2", "step='four'")


@pytest.mark.parametrize(
    ("item", "word"),
    [
        ("model.dim=32", "model.dim"),
        ("batch.global_batch_size=32", "global batch"),
        ("run.seed=7", "run.seed"),
        ("optim.name=sgd", "optim.name"),
        ("data.shuffle_window=2", "data.shuffle_window"),
        ("run.max_steps=2", "nothing to do"),
    ],
)
def test_resume_refuses_what_it_cannot_honour_and_changes_nothing(tmp_path, model_dir, four_steps, item, word):
    run = copy_run(four_steps, tmp_path / "run")  # at step 4: run.max_steps=2 leaves nothing to do
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.startswith(".")}
    proc = run_cli("train", "--resume", str(run), *sets(item), PYTHONPATH=str(model_dir))
    assert_user_error(proc, word)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert after == before


def test_a_run_that_never_applied_an_update_fails(tmp_path, model_dir, data):
    run = tmp_path / "run"
    proc = run_cli(
        "train",
        "--run-dir",
        str(run),
        *_args(data, "run.max_steps=3", "model.nan=true", "nonfinite.max_consecutive_skips=100"),
        PYTHONPATH=str(model_dir),
    )
    assert proc.returncode == 1, proc.stderr
    assert "no update was applied" in proc.stderr
    assert "no update was applied" in (run / "summary.md").read_text()


def test_bad_model_arguments_and_modules_are_one_line(tmp_path, model_dir, data):
    (model_dir / "raising.py").write_text("raise RuntimeError('broken\\nsecond line')\n")
    cases = [
        (["model.dim=-8"], "model.dim=-8"),
        (["model.heads=0"], "model.heads=0"),
        (["model.name=raising:factory"], "raising:factory"),
        (["model.name=pausemodel:factory", "model.dim=-3"], "pausemodel:factory"),
    ]
    for items, word in cases:
        base = TINY if items[0].startswith("model.d") or items[0].startswith("model.h") else BATCH
        proc = run_cli(
            "train",
            "--run-dir",
            str(tmp_path / "r"),
            *sets(*base, f"data.path={data}", *items),
            PYTHONPATH=str(model_dir),
        )
        assert_user_error(proc, word)
        assert not (tmp_path / "r").exists()


def test_paths_that_cannot_hold_a_run_or_a_cache_are_one_line(tmp_path, data):
    afile = tmp_path / "afile"
    afile.write_text("x")
    short = [*sets(*TINY, f"data.path={data}", "run.max_steps=1")]
    assert_user_error(run_cli("train", "--run-dir", str(afile / "run"), *short), "a parent is a file")
    assert_user_error(run_cli("train", "--run-dir", str(tmp_path / ("x" * 300)), *short), "cannot be created")
    proc = run_cli("train", "--run-dir", str(tmp_path / "r"), *sets("run.max_steps=1"), STEADYTRAIN_CACHE=str(afile))
    assert_user_error(proc, "STEADYTRAIN_CACHE", "not a directory")
    assert afile.read_text() == "x"


def test_nproc_with_a_bad_config_says_so_once_before_starting_ranks(tmp_path):
    for item, word in (("batch.bogus=1", "batch.bogus"), ("model.dim=-1", "model.dim=-1")):
        proc = run_cli("train", "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets(item), timeout=120)
        assert_user_error(proc, word)
        assert "torch.distributed" not in proc.stderr


def test_a_run_directory_with_a_newline_and_markup_stays_inert_in_logs_and_summary(tmp_path, data):
    run = tmp_path / "ok\n## INJECTED <img src=x onerror=alert(1)>"
    proc = run_cli("train", "--run-dir", str(run), *sets(*TINY, f"data.path={data}", "run.max_steps=2"))
    assert proc.returncode == 0, proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("## INJECTED")]
    summary = (run / "summary.md").read_text()
    assert [line for line in summary.splitlines() if line.startswith("#")] == [summary.splitlines()[0]]
    assert "<img" not in summary


def test_checkpoint_load_errors_name_the_parameter_and_the_way_back(tmp_path):
    import torch

    from steadytrain.errors import UserError
    from steadytrain.train.checkpoint.catalog import load_checkpoint, restore
    from steadytrain.train.checkpoint.writer import CheckpointWriter
    from steadytrain.train.setup.distributed import DistInfo

    def stepped(n_in: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = torch.nn.Linear(n_in, 2)
        o = torch.optim.AdamW(m.parameters())
        m(torch.ones(1, n_in)).sum().backward()
        o.step()
        return m, o

    saved_model, saved_opt = stepped(4)
    ckpt = tmp_path / "checkpoints"
    writer = CheckpointWriter(ckpt, DistInfo(0, 1, 0, torch.device("cpu"), None), use_async=False, keep_last=5)
    writer.save(2, saved_model, saved_opt, {"step": 2}, frozenset())
    model, opt = stepped(3)
    with pytest.raises(UserError, match=r"does not fit.*other shape: model/weight") as err:
        restore(ckpt / "step-00000002", model, opt, no_dist=True)
    assert "Traceback" not in str(err.value)
    (ckpt / "step-00000004.pt").write_text("not a checkpoint")  # the single-file format of earlier versions
    with pytest.raises(UserError, match=re.escape("move it away to resume from step-00000002")) as err:
        load_checkpoint(ckpt / "step-00000004.pt")
    assert "weights_only" not in str(err.value)
    damaged = ckpt / "step-00000006"
    shutil.copytree(ckpt / "step-00000002", damaged)
    for f in damaged.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match=re.escape("move it away to resume from step-00000004.pt")):
        load_checkpoint(damaged)


@pytest.mark.distributed
def test_ctrl_c_on_nproc_stops_every_rank_with_a_checkpoint_and_no_traceback(tmp_path, model_dir, data):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(model_dir), **_pause(tmp_path, 2, world=2)}
    cmd = [EXE, "train", "--nproc", "2", "--run-dir", str(run)]
    cmd += _args(data, "run.max_steps=8", "checkpoint.every_steps=100")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "reached-0", proc)
    _wait_for(tmp_path / "reached-1", proc)
    proc.send_signal(signal.SIGINT)  # the launcher, as a terminal's Ctrl-C: torchrun passes it on
    time.sleep(0.3)
    (tmp_path / "go").touch()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.count(f"resume with: steadytrain train --resume {run}") == 1
    (saved,) = [p.name for p in (run / "checkpoints").iterdir()]
    assert saved in ("step-00000002", "step-00000003")  # the agreement is read one boundary later
    assert [r["step"] for r in _rows(run)] == list(range(1, int(saved[5:13]) + 1))


def test_a_relative_data_path_is_stored_absolute_so_the_run_resumes_from_anywhere(tmp_path, data, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    shutil.copytree(data, work / "data")
    monkeypatch.chdir(work)
    first = run_cli("train", "--run-dir", "run", *sets(*TINY, "data.path=data", "run.max_steps=2"))
    assert first.returncode == 0, first.stderr
    run = work / "run"
    assert json.loads((run / "plan.json").read_text())["data"] == str((work / "data").resolve())
    assert f"path: {(work / 'data').resolve()}" in (run / "config.yaml").read_text()
    monkeypatch.chdir(elsewhere)
    resumed = run_cli("train", "--resume", str(run), *sets("run.max_steps=3"))
    assert resumed.returncode == 0, resumed.stderr
    (record,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["changes"] == {"run.max_steps": [2, 3]}  # the data path did not "change"
