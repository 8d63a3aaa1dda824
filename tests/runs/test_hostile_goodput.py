"""The time account (``timeline.jsonl``, ``steadytrain goodput``, ``report``'s goodput line and plot, ``compare``'s
side-by-side) used carelessly and with hostile input.

Each test is a finding: a traceback, an infinite or 300-digit number, a line merged into the wrong attempt, an
attempt's progress written off on a guess, a time that no cause names, a plot 135,000 pixels tall, a reader that
waits forever on a FIFO, a summary that drops the account because ``goodput.json`` could not be written. Timelines
are written by hand (or with ``tests/runs/test_goodput.py``'s fake clock): the oracle is the undamaged part of each
file, whose account is its sums written out next to it (one attempt started at 100, its first step at 105 after a
5 s startup, 5 s of steps to step 5 at 110, its end at 111: wall 11 s, productive 5 s, startup 5 s, other 1 s).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from steadytrain.rundir.timeline import CAUSES, read_timeline, seal
from steadytrain.runs.goodput import goodput
from tests.cli_utils import assert_user_error, in_process
from tests.runs.test_goodput import Clock, _first_attempt, _run, _second_attempt
from tests.runs.test_hardening_runs import fake_run


def S(**kw: Any) -> dict[str, Any]:
    """The start line: the process started at 100, its first step began at 105."""
    line = {"attempt": "a", "event": "start", "t": 105.0, "step": 0, "started_at": 100.0, "resumed_at": None}
    return line | {"world_size": 1, "compiled": False, "seconds": {"startup": 5.0}} | kw


def I(**kw: Any) -> dict[str, Any]:  # noqa: E743 (the interval line, beside S and E)
    """An interval line: 5 s of steps to step 5, at 110."""
    return {"attempt": "a", "event": "interval", "t": 110.0, "step": 5, "seconds": {"startup": 5.0, "train": 5.0}} | kw


def E(**kw: Any) -> dict[str, Any]:
    """The end line, 1 s later, no new step: that second is claimed by no cause (other)."""
    line = {"attempt": "a", "event": "end", "t": 111.0, "step": 5, "how": "finished"}
    return line | {"seconds": {"startup": 5.0, "train": 5.0}} | kw


def timeline(run: Path, *lines: dict[str, Any] | str) -> Path:
    """``run/timeline.jsonl`` holding ``lines`` (a str is written as it is: JSON that json.dumps cannot write)."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    (run / "timeline.jsonl").write_text(text)
    return run


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in --json output")

    return json.loads(text, parse_constant=refuse)


def _adds_up(account: dict[str, Any]) -> None:
    assert account["productive_s"] + sum(account["badput"].values()) == pytest.approx(account["wall_s"], abs=2e-3)


def _badput(**causes: float) -> dict[str, float]:
    return dict.fromkeys(CAUSES, 0.0) | causes


def _printable(text: str) -> None:
    for line in text.splitlines():
        assert all(c.isprintable() for c in line), repr(line)


def _notes(account: Any) -> str:
    return " | ".join(account.notes)


# --- damaged values: left out with a note, never an infinite, 300-digit or crashing number ---------------------

_BIG = "1" + "0" * 400
DAMAGED_END = {
    "t of 1e308": E(t=1e308),
    "t of 10**400": json.dumps(E(t=0)).replace('"t": 0', f'"t": {_BIG}'),
    "t of 1e400": json.dumps(E(t=0)).replace('"t": 0', '"t": 1e400'),
    "seconds of 1e308 twice": E(seconds={"startup": 5.0, "train": 5.0, "hang": 1e308, "other": 1e308}),
    "seconds of 10**400": json.dumps(E(seconds={"train": 0})).replace('"train": 0', f'"train": {_BIG}'),
    "seconds of NaN": json.dumps(E(seconds={"train": 0})).replace('"train": 0', '"train": NaN'),
    "seconds of true": E(seconds={"startup": 5.0, "train": True}),
    "seconds of a string": E(seconds={"startup": 5.0, "train": "5"}),
    "seconds negative": E(seconds={"startup": 5.0, "train": -5.0}),
    "seconds a list": E(seconds=[5.0]),
    "step of 10**400": json.dumps(E(step=0)).replace('"step": 0', f'"step": {_BIG}'),
    "step of 5.0": E(step=5.0),
    "step a string": E(step="5"),
    "attempt a list": E(attempt=["a"]),
    "event unknown": E(event="stop"),
    "how unknown (mathtext, ANSI)": E(how="$\\foo{$ \x1b[31m\nred"),
    "how a list": E(how=["finished"]),
    "not an object": "[1, 2]",
    "binary": "\x00\x01\x02",
}


@pytest.mark.parametrize("damaged", list(DAMAGED_END.values()), ids=list(DAMAGED_END))
def test_a_damaged_last_line_is_left_out_and_named(tmp_path, damaged):
    # the end line damaged: the account is the attempt's first two lines' (wall 110 - 100, the attempt "killed")
    run = timeline(_run(tmp_path), S(), I(), damaged)
    got = goodput(run)
    assert "timeline.jsonl line 3:" in _notes(got)
    (a,) = got.to_dict()["attempts"]
    assert (a["wall_s"], a["productive_s"], a["how"], a["steps"]) == (10.0, 5.0, "killed", [0, 5])
    assert a["badput"] == _badput(startup=5.0)
    out = in_process("goodput", str(run), "--json")
    assert out.returncode == 0, out.stderr
    assert _strict(out.stdout)["wall_s"] == 10.0
    text = in_process("goodput", str(run))
    assert text.returncode == 0 and "timeline.jsonl line 3:" in text.stdout
    assert all(len(line) < 200 for line in text.stdout.splitlines())
    _printable(text.stdout)


DAMAGED_START = {
    "started after its own t": S(started_at=200.0),
    "started_at of -1e308": S(started_at=-1e308),
    "started_at of 1e308": S(started_at=1e308),
    "resumed_at of 10**400": json.dumps(S(resumed_at=0)).replace('"resumed_at": 0', f'"resumed_at": {_BIG}'),
    "world_size a mapping": S(world_size={"ranks": [1] * 10}),
}


@pytest.mark.parametrize("damaged", list(DAMAGED_START.values()), ids=list(DAMAGED_START))
def test_a_damaged_start_line_is_left_out_and_the_start_taken_from_the_next(tmp_path, damaged):
    # without its start line, the attempt began at its first line's t less the seconds it accounts: 110 - 10 = 100
    run = timeline(_run(tmp_path), damaged, I(), E())
    got = goodput(run)
    assert "timeline.jsonl line 1:" in _notes(got) and "its start line is missing" in _notes(got)
    (a,) = got.to_dict()["attempts"]
    assert (a["wall_s"], a["productive_s"], a["how"], a["resumed_at"]) == (11.0, 5.0, "finished", None)
    assert a["badput"] == _badput(startup=5.0, other=1.0)
    assert _strict(in_process("goodput", str(run), "--json").stdout)["wall_s"] == 11.0


# --- lines out of order within one attempt ----------------------------------------------------------------------


def test_an_end_line_before_its_start_line_ends_the_attempt(tmp_path):
    # the start line after the end line is left out: the attempt is its end line (111, less its 10 s: from 101)
    got = goodput(timeline(_run(tmp_path), E(), S()))
    assert "timeline.jsonl line 2:" in _notes(got) and "after its attempt's end line" in _notes(got)
    (a,) = got.to_dict()["attempts"]
    assert (a["wall_s"], a["productive_s"], a["how"], a["steps"]) == (10.0, 5.0, "finished", [5, 5])


def test_a_line_after_the_end_line_is_left_out(tmp_path):
    got = goodput(timeline(_run(tmp_path), S(), I(), E(), I(t=112.0, step=6, seconds={"startup": 5.0, "train": 6.0})))
    assert "timeline.jsonl line 4:" in _notes(got) and "after its attempt's end line" in _notes(got)
    (a,) = got.to_dict()["attempts"]
    assert (a["wall_s"], a["productive_s"], a["how"], a["steps"]) == (11.0, 5.0, "finished", [0, 5])


def test_a_time_that_goes_back_within_an_attempt_is_left_out(tmp_path):
    # one monotonic clock per attempt: the line at 108 after the one at 200 is damaged; the account ends at 200
    run = timeline(_run(tmp_path), S(), I(t=200.0), I(t=108.0, step=6, seconds={"startup": 5.0, "train": 6.0}))
    got = goodput(run)
    assert "timeline.jsonl line 3:" in _notes(got) and "goes back" in _notes(got)
    (a,) = got.to_dict()["attempts"]
    assert (a["wall_s"], a["productive_s"], a["steps"]) == (100.0, 5.0, [0, 5])
    assert a["badput"] == _badput(startup=5.0, other=90.0)


# --- two attempts under one name ----------------------------------------------------------------------------------

NAME = 'x"\n\x1b[2J'


def test_two_attempts_under_one_name_are_not_merged(tmp_path):
    # a second start line under the first's name: which attempt wrote each later line cannot be told, so they are
    # all left out; the account is the first start line's (startup 5 s)
    lines = [S(attempt=NAME), S(attempt=NAME, t=106.0, started_at=100.5, seconds={"startup": 5.5}),
             I(attempt=NAME), I(attempt=NAME, t=111.0, step=3, seconds={"startup": 5.5, "train": 3.0})]  # fmt: skip
    run = timeline(_run(tmp_path), *lines)
    got = goodput(run)
    for n in (2, 3, 4):
        assert f"timeline.jsonl line {n}:" in _notes(got)
    (a,) = got.to_dict()["attempts"]
    assert (a["wall_s"], a["productive_s"], a["badput"]) == (5.0, 0.0, _badput(startup=5.0))
    text = in_process("goodput", str(run))
    assert text.returncode == 0 and "started twice" in text.stdout
    _printable(text.stdout)


def test_a_timeline_appended_to_itself_counts_each_attempt_once(tmp_path, monkeypatch):
    # `cat timeline.jsonl >> timeline.jsonl`: test_goodput's two attempts (wall 26 s, productive 4 s), then a copy
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 0.0)
    _first_attempt(run, clock)
    _second_attempt(run, clock)
    path = run / "timeline.jsonl"
    once = path.read_text()
    path.write_text(once * 2)
    got = goodput(run)
    assert (got.wall_s, got.productive_s) == (pytest.approx(26.0), pytest.approx(4.0))
    assert len(got.attempts) == 2
    n = len(once.splitlines())
    for copied in range(n + 1, 2 * n + 1):
        assert f"timeline.jsonl line {copied}:" in _notes(got)


# --- what a restart loses, when the resume step is missing or impossible ------------------------------------------


def test_an_attempt_without_its_start_line_does_not_write_off_the_one_before(tmp_path):
    # attempt a: step 4 at 109 (4 s trained), step 6 at 111 (6 s), killed; attempt b: only its end line, at step 5
    # (it resumed from step 4 or 5: its start line is lost). Taking its resume step as its first line's (5): of a's
    # 6 s, the 2 s past step 4 are lost, not all 6 (as if b had started from scratch)
    a = [S(), I(t=109.0, step=4, seconds={"startup": 5.0, "train": 4.0}),
         I(t=111.0, step=6, seconds={"startup": 5.0, "train": 6.0})]  # fmt: skip
    b = E(attempt="b", t=130.0, step=5, seconds={"startup": 3.0, "train": 1.0})
    got = goodput(timeline(_run(tmp_path), *a, b))
    first, second = got.to_dict()["attempts"]
    assert (first["productive_s"], first["badput"]["lost_progress"]) == (4.0, 2.0)
    assert "attempt 2" in _notes(got) and "resume step" in _notes(got)
    # b began at 130 - 4 = 126: 15 s after a's last line
    assert (second["wall_s"], second["badput"]["restart_gap"]) == (19.0, 15.0)
    _adds_up(got.to_dict())


def test_a_resume_past_every_step_of_the_attempt_before_is_noted(tmp_path):
    b = [S(attempt="b", t=120.0, started_at=115.0, step=1000, resumed_at=1000),
         E(attempt="b", t=125.0, step=1001, seconds={"startup": 5.0, "train": 5.0})]  # fmt: skip
    got = goodput(timeline(_run(tmp_path), S(), I(), E(), *b))
    assert "step 1000" in _notes(got) and "step 5" in _notes(got)
    assert got.badput["lost_progress"] == 0.0 and got.productive_s == 10.0


# --- causes this version does not know, a line no writer makes, a file of damage ----------------------------------


def test_causes_the_reader_does_not_know_are_named_not_silently_other(tmp_path):
    # 3 s under a cause no version writes: counted as other (10 - 5 - 2), and said so, on one line
    run = timeline(_run(tmp_path), S(), I(seconds={"startup": 5.0, "train": 2.0, "bogus\n\x1b[2J": 3.0}))
    got = goodput(run)
    assert got.badput["other"] == 3.0 and "bogus\\n" in _notes(got)
    text = in_process("goodput", str(run))
    assert "bogus\\n" in text.stdout
    _printable(text.stdout)


def test_a_line_longer_than_any_the_writer_makes_is_left_out_unparsed(tmp_path):
    # 10**6 causes in one line (about 17 MB): not a line an attempt writes; the rest of the file still counts
    causes = b", ".join(b'"k%d": 0' % i for i in range(10**6))
    huge = json.dumps(I(t=110.5, seconds={})).encode().replace(b'"seconds": {}', b'"seconds": {' + causes + b"}")
    run = _run(tmp_path)
    (run / "timeline.jsonl").write_bytes(b"\n".join([json.dumps(S()).encode(), huge, json.dumps(E()).encode(), b""]))
    got = goodput(run)
    assert "timeline.jsonl line 2:" in _notes(got) and got.wall_s == 11.0


def test_a_file_of_damaged_lines_is_counted_not_listed_line_by_line(tmp_path):
    # 30,000 damaged lines between the three good ones: every one is counted in the notes, in a few notes
    damaged = 30_000
    run = _run(tmp_path)
    good = [json.dumps(x) for x in (S(), I(), E())]
    (run / "timeline.jsonl").write_text("\n".join([good[0], *(["junk"] * damaged), *good[1:]]) + "\n")
    got = goodput(run)
    assert got.wall_s == 11.0 and len(got.notes) < 50
    named = len(re.findall(r"timeline\.jsonl line \d+:", _notes(got)))
    counted = sum(int(n) for n in re.findall(r"(\d+) more lines? left out", _notes(got)))
    assert named + counted == damaged
    assert len(in_process("goodput", str(run)).stdout.splitlines()) < 80


# --- the file itself ------------------------------------------------------------------------------------------------


def test_seal_does_not_wait_for_a_writer_of_a_fifo(tmp_path):
    path = tmp_path / "timeline.jsonl"
    os.mkfifo(path)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            seal(path)
        except BaseException as err:  # what seal raised, checked below
            raised.append(err)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # open() is waiting for a writer: be one, so the thread ends
        os.close(os.open(path, os.O_WRONLY))
        thread.join(10)
        pytest.fail("seal waited for a writer of the FIFO")
    (err,) = raised
    assert isinstance(err, OSError) and "not a regular file" in str(err)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()


def _unreadable(path: Path) -> None:
    timeline(path.parent, S(), E())
    path.chmod(0)


@pytest.mark.parametrize(
    ("make", "words"),
    [(_fifo, "FIFO"), (_dev_zero, "character device"), (_directory, "is a directory"), (_unreadable, "not readable")],
    ids=["fifo", "/dev/zero", "directory", "unreadable"],
)
def test_a_timeline_that_is_not_a_readable_file_is_one_line(tmp_path, make, words):
    if make is _unreadable and os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    run = _run(tmp_path)
    make(run / "timeline.jsonl")
    assert_user_error(in_process("goodput", str(run)), "timeline.jsonl", words)
    assert_user_error(in_process("goodput", str(run), "--json"), "timeline.jsonl", words)


def test_a_run_that_is_a_file_is_one_line(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a run\n")
    assert_user_error(in_process("goodput", str(path)), str(path))


# --- report and compare ---------------------------------------------------------------------------------------------


def test_report_keeps_the_account_when_goodput_json_cannot_be_written(tmp_path):
    run = timeline(fake_run(tmp_path / "run"), S(), I(), E())
    (run / "goodput.json").mkdir()
    proc = in_process("report", str(run))
    assert "Traceback" not in proc.stderr and "goodput.json" in proc.stderr
    summary = (run / "summary.md").read_text()
    first = next(line for line in summary.splitlines() if line.startswith("- "))
    assert f"goodput {5 / 11:.1%}" in first and "goodput.json" in first
    assert (run / "plots" / "goodput.png").is_file() and (run / "goodput.json").is_dir()


def test_the_summary_says_the_account_left_lines_out_and_a_hostile_how_does_not_break_the_plot(tmp_path):
    # line 2 is not JSON, line 4's how is mathtext matplotlib cannot parse: both left out, the account ends at 110
    run = timeline(fake_run(tmp_path / "run"), S(), "junk", I(), E(how="$\\foo{$"))
    proc = in_process("report", str(run))
    assert proc.returncode == 0 and "not drawn" not in proc.stdout, proc.stdout
    assert (run / "plots" / "goodput.png").is_file()
    first = next(line for line in (run / "summary.md").read_text().splitlines() if line.startswith("- "))
    assert f"goodput {5 / 10:.1%}" in first and "2 notes" in first and "line 2" in first


def _png_height(path: Path) -> int:
    data = path.read_bytes()
    assert data[12:16] == b"IHDR"
    return struct.unpack(">I", data[20:24])[0]


def test_the_plot_of_a_crash_loop_stays_a_picture(tmp_path):
    # 200 attempts of 11 s, 9 s apart, each resumed from step 5: one bar each would be a PNG 9,000 pixels tall
    from steadytrain.runs.goodplot import goodput_plot
    from steadytrain.runs.plots import DPI

    lines = []
    for i in range(200):
        at, resumed = 20.0 * i, {"step": 5, "resumed_at": 5} if i else {}
        lines += [S(attempt=f"a{i}", t=105.0 + at, started_at=100.0 + at, **resumed), E(attempt=f"a{i}", t=111.0 + at)]
    account = goodput(timeline(_run(tmp_path), *lines))
    assert len(account.attempts) == 200 and account.productive_s == 1000.0
    drawn = goodput_plot(account, "run", tmp_path / "goodput.png")
    assert drawn is not None and _png_height(drawn) < (1.6 + 0.45 * 40) * DPI


def test_compare_with_a_damaged_timeline_stays_finite_and_says_so(tmp_path):
    a = timeline(fake_run(tmp_path / "a"), S(), I(), E())
    b = timeline(fake_run(tmp_path / "b"), S(), I(), E(seconds={"train": 1e308, "hang": 1e308}))
    proc = in_process("compare", str(a), str(b), "--json")
    assert proc.returncode == 0, proc.stderr
    side = _strict(proc.stdout)["goodput"]
    assert side["wall_s"] == [11.0, 10.0] and side["hang"] == [0.0, 0.0]
    text = in_process("compare", str(a), str(b))
    assert "10.0 s" in text.stdout and all(len(line) < 200 for line in text.stdout.splitlines())
    assert "timeline.jsonl" in text.stderr and "steadytrain goodput" in text.stderr


def test_the_reader_leaves_nothing_unnamed_on_the_fake_clock(tmp_path, monkeypatch):
    # an undamaged timeline, torn by a kill and resumed: no note besides the torn line (the rules above leave a real
    # attempt's lines alone)
    run = _run(tmp_path)
    clock = Clock(monkeypatch, 0.0)
    _first_attempt(run, clock)
    with open(run / "timeline.jsonl", "a") as f:
        f.write('{"attempt": "killed mid-write", "ev')
    _second_attempt(run, clock)
    attempts, notes = read_timeline(run / "timeline.jsonl")
    assert len(attempts) == 2 and len(notes) == 1 and "cut short" in notes[0]
    assert stat.S_ISREG(os.stat(run / "timeline.jsonl").st_mode)
