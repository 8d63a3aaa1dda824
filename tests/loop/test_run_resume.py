"""kill -9 in the middle of a Run, then the same script with ``resume=True``: every step once, and the losses and
final weights equal an uninterrupted run's bit for bit (the killed run in a process of its own, a fork of this one;
the resumed and the uninterrupted runs in this process). A kill before the first checkpoint, or during it, is
``tests/loop/test_run_hostile.py``'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.loop import forked, own_loop

ROOT = Path(__file__).resolve().parents[2]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["own", "nanogpt"])
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, kind):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    own_loop.main([kind, str(whole), "14"])  # uninterrupted, in this process (one thread, as the scripts run)
    assert forked.exit_code(own_loop.main, [kind, str(cut), "14", "kill=10"]) == -9  # SIGKILL after step 10
    assert max(r["step"] for r in _rows(cut)) < 14
    # the complete checkpoints the kill left (an asynchronous save in flight is not one)
    complete = sorted(int(p.name[5:]) for p in (cut / "checkpoints").glob("step-*"))
    own_loop.main([kind, str(cut), "14", "resume"])  # the same script again, resumed
    a, b = _rows(whole), _rows(cut)
    assert [r["step"] for r in b] == list(range(1, 15))  # every step once: the rows past step 8 were cut
    keys = ("loss", "lr", "grad_norm", "skipped", "clipped")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    wa, wb = torch.load(f"{whole}.pt"), torch.load(f"{cut}.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    resumes = [json.loads(line) for line in (cut / "resumes.jsonl").read_text().splitlines()]
    assert complete and [r["step"] for r in resumes] == [complete[-1]]
