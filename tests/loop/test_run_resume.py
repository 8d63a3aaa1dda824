"""kill -9 in the middle of a Run, then the same script with ``resume=True``: every step once, and the losses and
final weights equal an uninterrupted run's bit for bit (the killed and the resumed run each in a process of its own,
as a user runs them; the uninterrupted one in this process). A kill before the first checkpoint, or during it, is
``tests/loop/test_run_hostile.py``'s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.loop import own_loop

ROOT = Path(__file__).resolve().parents[2]


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tests.loop.own_loop", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["own", "nanogpt"])
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, kind):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    own_loop.main([kind, str(whole), "14"])  # uninterrupted, in this process (one thread, as the scripts run)
    killed = _script(kind, str(cut), "14", "kill=10")
    assert killed.returncode == -9, killed.stderr  # SIGKILL after step 10; the last checkpoint is step 8's
    assert max(r["step"] for r in _rows(cut)) < 14
    # the complete checkpoints the kill left (an asynchronous save in flight is not one)
    complete = sorted(int(p.name[5:]) for p in (cut / "checkpoints").glob("step-*"))
    done = _script(kind, str(cut), "14", "resume")
    assert done.returncode == 0, done.stderr
    a, b = _rows(whole), _rows(cut)
    assert [r["step"] for r in b] == list(range(1, 15))  # every step once: the rows past step 8 were cut
    keys = ("loss", "lr", "grad_norm", "skipped", "clipped")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    wa, wb = torch.load(f"{whole}.pt"), torch.load(f"{cut}.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    resumes = [json.loads(line) for line in (cut / "resumes.jsonl").read_text().splitlines()]
    assert complete and [r["step"] for r in resumes] == [complete[-1]]
