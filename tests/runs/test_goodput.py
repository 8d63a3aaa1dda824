"""The time account by arithmetic: an attempt's clock driven through phases of known lengths on a fake clock, and the
run's account read back from ``timeline.jsonl``. Every expected number is the sum of the planted durations, written
out next to the scenario; the identity ``productive + causes == wall`` is checked on each."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from steadytrain.rundir.timeline import CAUSES
from steadytrain.runs.goodput import goodput
from steadytrain.train.observe.timeline import AttemptClock
from steadytrain.train.observe.watchdog import Beat
from tests.cli_utils import in_process


class Clock:
    """Wall time ``now``; ``perf_counter`` runs 1000 s behind it (another origin, the same rate)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
        self.now = now
        monkeypatch.setattr(time, "time", lambda: self.now)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now - 1000.0)

    def at(self, t: float) -> Clock:
        self.now = t
        return self


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("run: {}\n")
    return run


def _steps(clock: Clock, beat: Beat, ac: AttemptClock, steps: list[tuple[float, float, bool]]) -> None:
    """Each step: ``data`` seconds, then ``forward`` seconds, refused or not; the step ends there."""
    for data, compute, skipped in steps:
        beat.enter("data")
        clock.at(clock.now + data)
        beat.enter("forward")
        clock.at(clock.now + compute)
        beat.enter("all_reduce")
        ac.step(skipped)


def _first_attempt(run: Path, clock: Clock) -> None:
    """Started at 100, beat at 103, first step at 105: startup 6 (5, then the first batch's 1 s in "start").
    Steps: 2.0 (compiled), 0.5 + 1.0, a refused 0.1 + 1.0, evaluation 2.0, 0.1 + 1.0, a checkpoint 0.5, a straggler
    wait of 0.3, then 0.1 + 1.0 twice, the last line at step 6 and no end (killed) at 116.4."""
    clock.at(103)
    beat = Beat()
    clock.at(105)
    ac = AttemptClock(run, beat, compiled=True, started_at=100.0)
    ac.begin(0, None, 2)
    clock.at(106)
    beat.enter("forward")
    clock.at(108)
    beat.enter("all_reduce")
    ac.step(False)  # the compiled first step: 2.0
    _steps(clock, beat, ac, [(0.5, 1.0, False), (0.1, 1.0, True)])
    beat.enter("eval")
    clock.at(clock.now + 2.0)
    _steps(clock, beat, ac, [(0.1, 1.0, False)])
    beat.enter("checkpoint")
    clock.at(clock.now + 0.5)
    ac.saved(4)
    ac.waited(0.3)
    _steps(clock, beat, ac, [(0.1, 1.0, False)])
    ac.interval(5)
    _steps(clock, beat, ac, [(0.1, 1.0, False)])
    ac.interval(6)


def _second_attempt(run: Path, clock: Clock) -> None:
    """Started at 120 (a gap of 3.6 s), resumed at step 4: restore 2 s, startup 2.5 s, one step of 1 s, 0.5 s
    waiting for the next batch, then its end at 126."""
    clock.at(121)
    beat = Beat()
    beat.enter("restore")
    clock.at(123)
    beat.enter("start")
    clock.at(124)
    ac = AttemptClock(run, beat, started_at=120.0)
    ac.begin(4, 4, 2)
    clock.at(124.5)
    beat.enter("forward")
    clock.at(125.5)
    beat.enter("data")
    ac.step(False)
    clock.at(126)
    ac.end("finished", 5)


def _adds_up(account: dict) -> None:
    assert account["productive_s"] + sum(account["badput"].values()) == pytest.approx(account["wall_s"], abs=2e-3)


def test_two_attempts_by_arithmetic(tmp_path, monkeypatch):
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 0.0)
    _first_attempt(run, clock)
    _second_attempt(run, clock)
    got = goodput(run).to_dict()
    first, second = got["attempts"]
    # attempt 1: compile = 2.0 - median(1, 1, 1, 1); productive = steps 1-4 (2 + 1 + 1, less the compile) = 3.0;
    # lost: steps 5 and 6 (1 + 1, less the 0.3 s straggler wait counted on its own), trained past checkpoint 4
    assert first["productive_s"] == pytest.approx(3.0)
    expected = {"startup": 6.0, "compile": 1.0, "data_wait": 0.8, "checkpoint_save": 0.5, "checkpoint_restore": 0.0,
                "evaluation": 2.0, "lost_progress": 1.7, "skipped_steps": 1.1, "restart_gap": 0.0, "hang": 0.0,
                "straggler": 0.3, "other": 0.0}  # fmt: skip
    assert first["badput"] == pytest.approx(expected)
    assert (first["wall_s"], first["how"], first["steps"]) == (pytest.approx(16.4), "killed", [0, 6])
    assert first["resumed_at"] is None
    assert second["badput"] == pytest.approx(
        dict.fromkeys(CAUSES, 0.0) | {"startup": 2.5, "checkpoint_restore": 2.0, "restart_gap": 3.6, "data_wait": 0.5}
    )
    assert (second["productive_s"], second["how"], second["resumed_at"]) == (pytest.approx(1.0), "finished", 4)
    assert second["wall_s"] == pytest.approx(3.6 + 6.0)  # the gap before it, then 120 to 126
    assert got["wall_s"] == pytest.approx(26.0) and got["productive_s"] == pytest.approx(4.0)
    assert got["goodput"] == pytest.approx(4.0 / 26.0, abs=1e-4)
    for account in (got, first, second):
        _adds_up(account)
    assert got["notes"] == []


def test_a_rollback_loses_the_steps_since_its_checkpoint_once(tmp_path, monkeypatch):
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 50.0)
    beat = Beat()
    ac = AttemptClock(run, beat, started_at=50.0)
    ac.begin(0, None, 1)  # startup 0
    _steps(clock, beat, ac, [(0.0, 1.0, False)] * 2)
    beat.enter("checkpoint")
    ac.saved(2)  # no time in the save
    _steps(clock, beat, ac, [(0.0, 1.5, False)] * 2)  # steps 3, 4: 3.0 s
    beat.enter("data")
    clock.at(clock.now + 0.25)  # the refused step 5 (a spike), then its rollback's restore of 0.75 s
    beat.enter("restore")
    clock.at(clock.now + 0.75)
    beat.enter("all_reduce")
    ac.rolled_back(2)
    _steps(clock, beat, ac, [(0.0, 2.0, False)])  # step 3 again: 2.0 s
    beat.enter("data")
    clock.at(clock.now + 0.5)  # refused again
    ac.rolled_back(2)  # step 3's second try lost too, the first two counted once
    ac.end("finished", 2)
    (a,) = goodput(run).to_dict()["attempts"]
    assert a["badput"]["lost_progress"] == pytest.approx(3.0 + 2.0)
    assert a["badput"]["skipped_steps"] == pytest.approx(0.25 + 0.5)
    assert a["badput"]["checkpoint_restore"] == pytest.approx(0.75)
    assert a["productive_s"] == pytest.approx(2.0)  # steps 1 and 2
    _adds_up(a)


def _begun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Clock, Beat, AttemptClock]:
    """An attempt of 2 ranks started at 10 s, its first step beginning at once (no startup)."""
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 10.0)
    beat = Beat()
    ac = AttemptClock(run, beat, started_at=10.0)
    ac.begin(0, None, 2)
    return run, clock, beat, ac


def test_a_hang_is_its_own_cause_and_the_unfinished_step_is_other(tmp_path, monkeypatch):
    run, clock, beat, ac = _begun(tmp_path, monkeypatch)
    _steps(clock, beat, ac, [(0.0, 1.0, False)])
    beat.enter("forward")
    clock.at(clock.now + 1.0)  # step 2's forward, then waiting in its all-reduce for 3 s of no progress
    beat.enter("all_reduce")
    clock.at(clock.now + 3.0)
    ac.end("hang", 1, hang_s=3.0)
    (a,) = goodput(run).to_dict()["attempts"]
    assert (a["how"], a["productive_s"], a["badput"]["hang"]) == ("hang", pytest.approx(1.0), pytest.approx(3.0))
    assert a["badput"]["other"] == pytest.approx(1.0)  # the unfinished step's forward
    _adds_up(a)


def test_a_hang_during_a_save_is_not_counted_twice(tmp_path, monkeypatch):
    run, clock, beat, ac = _begun(tmp_path, monkeypatch)
    beat.enter("checkpoint")
    clock.at(clock.now + 5.0)  # 2 s saving, then 3 s of no progress
    ac.end("hang", 0, hang_s=3.0)
    (a,) = goodput(run).to_dict()["attempts"]
    assert a["badput"]["hang"] == pytest.approx(3.0) and a["badput"]["checkpoint_save"] == pytest.approx(2.0)
    _adds_up(a)


def _lines(run: Path) -> list[str]:
    return (run / "timeline.jsonl").read_text().splitlines()


def test_damaged_lines_are_named_and_left_out_and_a_new_attempt_is_not_swallowed(tmp_path, monkeypatch):
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 0.0)
    _first_attempt(run, clock)
    path = run / "timeline.jsonl"
    lines = _lines(run)
    lines[2] = lines[2].replace('"seconds": {', '"seconds": {"hang": -5, ')  # a negative duration
    lines[3] = '{"attempt": "x", "event": "interval", "t": "soon", "step": 1, "seconds": {}}'
    lines.insert(4, '{"attempt": "x", "event": "interval", "t": NaN, "step": 1, "seconds": {}}')
    lines.insert(5, "\x00\x01 binary")
    path.write_text("\n".join(lines) + '\n{"attempt": "killed mid-write", "ev')  # torn, no newline
    _second_attempt(run, clock)  # its first line starts on a line of its own
    got = goodput(run)
    assert [a["how"] for a in got.attempts] == ["killed", "finished"]
    assert got.attempts[1]["resumed_at"] == 4
    notes = " | ".join(got.notes)
    for n in (3, 4, 5, 6, len(lines) + 1):
        assert f"timeline.jsonl line {n}:" in notes
    assert "cut short or not JSON" in notes and "non-negative numbers" in notes and "not a number" in notes


def test_a_wall_clock_that_goes_back_between_attempts_is_noted_not_negative(tmp_path, monkeypatch):
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 0.0)
    _first_attempt(run, clock)
    lines = _lines(run)
    clock.now = 0.0
    second = tmp_path / "second"
    second.mkdir()
    (second / "config.yaml").write_text("")
    _second_attempt(second, clock)
    shifted = [json.loads(x) for x in _lines(second)]
    for line in shifted:  # the second attempt's clock set 20 s back: it "starts" before the first one ended
        line["t"] -= 20
        line["started_at"] = line.get("started_at", 0) - 20 if "started_at" in line else None
        if line["started_at"] is None:
            del line["started_at"]
    (run / "timeline.jsonl").write_text("\n".join(lines + [json.dumps(x) for x in shifted]) + "\n")
    got = goodput(run)
    assert got.badput["restart_gap"] == 0.0 and "the wall clock went back" in got.notes[0]
    assert got.wall_s == pytest.approx(16.4 + 6.0)
    _adds_up(got.to_dict())


def _two_attempts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run of the two attempts above, written on the fake clock (the real clock back afterwards)."""
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 0.0)
    _first_attempt(run, clock)
    _second_attempt(run, clock)
    monkeypatch.undo()
    return run


def test_the_command_prints_the_account_and_refuses_what_it_cannot_read(tmp_path, monkeypatch):
    run = _two_attempts(tmp_path, monkeypatch)
    out = in_process("goodput", str(run))
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("goodput 15.4%: 4.0 s of 26.0 s") and "over 2 attempts" in first
    assert "most lost to startup (8.5 s)" in first
    table = {line.split()[0]: line.split()[-1] for line in out.stdout.splitlines()[2:15]}
    assert table["lost_progress"] == f"{1.7 / 26:.1%}" and table["restart_gap"] == f"{3.6 / 26:.1%}"
    assert json.loads(in_process("goodput", str(run), "--json").stdout)["badput"]["restart_gap"] == 3.6

    missing = _run(tmp_path / "old")
    proc = in_process("goodput", str(missing))
    assert proc.returncode == 2 and "no timeline.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    (missing / "timeline.jsonl").write_text("garbage\n")
    proc = in_process("goodput", str(missing))
    assert proc.returncode == 2 and "no line could be read" in proc.stderr and "line 1" in proc.stderr
    (missing / "timeline.jsonl").unlink()
    (missing / "timeline.jsonl").mkdir()
    proc = in_process("goodput", str(missing))
    assert proc.returncode == 2 and "is a directory" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = in_process("goodput", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no such run directory" in proc.stderr


class _Tracker:
    name, hint, keeps_first = "fake", "", True

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, rows: list[dict]) -> None:
        self.rows += rows

    def finish(self, artifacts, status) -> None:
        self.status = status


def test_the_trackers_get_the_account_at_the_last_step(tmp_path, monkeypatch):
    from steadytrain.rundir.layout import RunDir
    from steadytrain.runs.goodput import write_goodput
    from steadytrain.train.observe.trackers import Trackers, end_run

    run = _two_attempts(tmp_path, monkeypatch)
    fake = _Tracker()
    end_run(Trackers(None, [fake]), RunDir(run), (None, "FINISHED"), lambda path, stopped: write_goodput(path))
    (row,) = fake.rows
    account = json.loads((run / "goodput.json").read_text())
    assert row["step"] == 5 and row["goodput/goodput"] == account["goodput"] and fake.status == "FINISHED"
    assert row["goodput/restart_gap_s"] == pytest.approx(3.6) and row["goodput/wall_s"] == pytest.approx(26.0)
    assert {k for k in row if k.endswith("_s")} == {f"goodput/{c}_s" for c in CAUSES} | {
        "goodput/wall_s", "goodput/productive_s"}  # fmt: skip

    (run / "goodput.json").write_text("[1, 2]")  # damaged: the trackers go on without it
    fake = _Tracker()
    end_run(Trackers(None, [fake]), RunDir(run), (None, "FINISHED"), None)
    assert fake.rows == [] and fake.status == "FINISHED"


def test_a_timeline_that_is_a_fifo_is_never_waited_on_and_the_attempt_goes_on(tmp_path, caplog):
    import os

    run = _run(tmp_path)
    os.mkfifo(run / "timeline.jsonl")  # nothing reads it: an append would wait forever
    beat = Beat()
    ac = AttemptClock(run, beat, started_at=time.time())
    ac.begin(0, None, 1)
    beat.enter("forward")
    ac.step(False)
    ac.interval(1)
    ac.saved(1)
    ac.end("finished", 1)
    assert "this attempt's time is not accounted" in caplog.text
    assert (run / "timeline.jsonl").is_fifo()
