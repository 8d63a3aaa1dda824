"""``steadytrain hangs``, the report's restarts and a restart's reason, on hand-written hang and restart records
(issue 47): wrong types, control characters, huge values, directories and empty or torn files.

Every run here is written by hand (no training): a ``config.yaml`` is all ``hangs`` needs, and
:func:`tests.runs.test_hardening_runs.fake_run` is a run the report reads. Oracles: the exit code and the one line
on stderr naming the file (and line) and the key; the lines of the output as a terminal shows them; the records
as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadytrain.errors import UserError
from steadytrain.rundir.hangs import read_restarts
from steadytrain.rundir.layout import RunDir
from steadytrain.train.job.restart import record_restart
from tests.cli_utils import assert_user_error, in_process
from tests.runs.test_hardening_runs import fake_run

HANG = {"step": 5, "stuck_ranks": [1], "phase": "forward", "host": "node-1", "frame": "model.py:9 in forward: x"}
RESTART = {
    "step": 4,
    "world_size_before": 2,
    "world_size_after": 2,
    "reason": "the run was started again",
    "lost_s": 3.5,
}


def run_with_hang(tmp_path: Path, record: object = HANG, step: int = 5, text: str | None = None) -> Path:
    """A directory ``hangs`` accepts (a ``config.yaml``) with one hang folder: ``record`` as its ``hang.json``
    (``text``: these bytes instead), a stack file beside it."""
    run = tmp_path / "run"
    where = run / "hangs" / f"step-{step:08d}"
    where.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: r}\n")
    (where / "hang.json").write_text(
        json.dumps(record | {"step": step} if step != 5 else record) if text is None else text
    )
    (where / "rank-00001.txt").write_text("Thread MainThread:\n")
    return run


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"step": True}, ["step=True"]),
        ({"step": -3}, ["step=-3"]),
        ({"step": "5"}, ["step='5'"]),
        ({"stuck_ranks": [{"rank": 1}]}, ["stuck_ranks[0]"]),
        ({"stuck_ranks": []}, ["stuck_ranks=[]"]),
        ({"stuck_ranks": "1"}, ["stuck_ranks="]),
        ({"stuck_ranks": [True]}, ["stuck_ranks[0]=True"]),
        ({"phase": 5}, ["phase=5"]),
        ({"phase": None}, ["phase=null"]),
        ({"host": ["a"]}, ["host="]),
        ({"frame": {"f": 1}}, ["frame="]),
        ({"ranks": "all"}, ["ranks="]),
    ],
)
def test_every_field_of_a_hang_record_is_checked_in_one_line(tmp_path, change, words):
    run = run_with_hang(tmp_path, HANG | change)
    for args in (["hangs", str(run)], ["hangs", str(run), "--json"]):
        proc = in_process(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "hang.json" in line and "damaged" in line and all(w in line for w in words), line


def test_directories_where_files_are_expected_are_one_line(tmp_path):
    run = run_with_hang(tmp_path)
    where = run / "hangs" / "step-00000005"
    (where / "hang.json").unlink()
    (where / "hang.json").mkdir()
    assert_user_error(in_process("hangs", str(run)), "hang.json", "is a directory")
    (where / "hang.json").rmdir()
    hangs = run / "hangs"
    for p in sorted(hangs.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    hangs.rmdir()
    hangs.write_text("not a folder")  # "no hang recorded" would be a guess
    assert_user_error(in_process("hangs", str(run)), "hangs", "not a directory")


def test_control_characters_in_any_field_never_forge_or_rewrite_a_line(tmp_path):
    forged = "forward\nstep 9: rank(s) 0 stuck in nothing"
    record = HANG | {"phase": forged, "host": "node\r\x1b[2Kclean", "frame": "f.py:1\nstep 8: x\x1b]0;title\x07"}
    proc = in_process("hangs", str(run_with_hang(tmp_path, record)))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("step 5: rank(s) 1 stuck in forward\\nstep 9"), lines
    assert not any(line.startswith(("step 9", "step 8")) for line in lines)
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout and "\x07" not in proc.stdout
    assert json.loads(in_process("hangs", str(tmp_path / "run"), "--json").stdout)[0]["phase"] == forged  # as written


def test_a_huge_frame_is_shortened_on_the_terminal_and_whole_in_json(tmp_path):
    frame = "model.py:9 in forward: " + "x" * 100_000
    run = run_with_hang(tmp_path, HANG | {"frame": frame})
    proc = in_process("hangs", str(run))
    assert proc.returncode == 0, proc.stderr
    at = next(line for line in proc.stdout.splitlines() if line.startswith("  at "))
    assert len(at) < 500 and at.startswith("  at model.py:9 in forward") and str(len(frame)) in at
    assert json.loads(in_process("hangs", str(run), "--json").stdout)[0]["frame"] == frame


def test_stacks_without_a_hang_record_are_pointed_at(tmp_path):
    run = run_with_hang(tmp_path, step=7)
    where = run / "hangs" / "step-00000007"
    (where / "hang.json").unlink()  # rank 0 died before writing it; rank 1 wrote its stacks
    proc = in_process("hangs", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "no hang recorded" not in proc.stdout
    assert proc.stdout.startswith("step 7: no hang.json") and f"{where} (rank-00001.txt)" in proc.stdout
    (found,) = json.loads(in_process("hangs", str(run), "--json").stdout)
    assert found["step"] == 7 and found["stuck_ranks"] is None and found["stacks"] == ["rank-00001.txt"]
    (where / "rank-00001.txt").unlink()  # a folder with neither is no hang
    assert "no hang recorded" in in_process("hangs", str(run)).stdout


def test_hangs_are_listed_by_step_and_each_record_is_in_its_own_step_folder(tmp_path):
    run = run_with_hang(tmp_path, step=100_000_000)  # nine digits: sorts before step-00000005 as text
    where = run / "hangs" / "step-00000005"
    where.mkdir()
    (where / "hang.json").write_text(json.dumps(HANG))
    proc = in_process("hangs", str(run))
    steps = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("step")]
    assert steps == ["step 5", "step 100000000"], proc.stdout
    (where / "hang.json").write_text(json.dumps(HANG | {"step": 6}))  # moved by hand, or damaged
    assert_user_error(in_process("hangs", str(run)), "step-00000005", "step=6")


# --- restarts.jsonl ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"lost_s": "lots"}, "lost_s='lots'"),
        ({"lost_s": -1.0}, "lost_s=-1.0"),
        ({"lost_s": True}, "lost_s=True"),
        ({"step": True}, "step=True"),
        ({"step": -1}, "step=-1"),
        ({"world_size_after": 0}, "world_size_after=0"),
        ({"world_size_before": "2"}, "world_size_before='2'"),
        ({"reason": {"why": 1}}, "reason="),
        ({"reason": None}, "reason=null"),
    ],
)
def test_every_field_of_a_restart_record_is_checked(tmp_path, change, key):
    path = tmp_path / "restarts.jsonl"
    path.write_text(json.dumps(RESTART) + "\n" + json.dumps(RESTART | change) + "\n")
    with pytest.raises(UserError, match="damaged") as err:
        read_restarts(path)
    assert f"{path}: line 2" in str(err.value) and key in str(err.value)


def test_restart_records_that_are_not_records(tmp_path):
    path = tmp_path / "restarts.jsonl"
    for text, words in [
        ("[]\n", "not a restart record"),
        (json.dumps({k: v for k, v in RESTART.items() if k != "lost_s"}) + "\n", "lost_s is missing"),
        ('{"step": 4, "lost_s": 1}\nnot json\n', ":2"),
    ]:
        path.write_text(text)
        with pytest.raises(UserError, match=words):
            read_restarts(path)
    path.write_text("")
    assert read_restarts(path) == []
    path.write_text(json.dumps(RESTART) + '\n{"step": 5, "wor')  # torn by a kill: the complete one stays
    assert read_restarts(path) == [RESTART]
    path.unlink()
    path.mkdir()
    with pytest.raises(UserError, match="is a directory"):
        read_restarts(path)


def test_report_of_a_damaged_restart_record_is_one_line(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "restarts.jsonl").write_text(json.dumps(RESTART | {"lost_s": "lots"}) + "\n")
    assert_user_error(in_process("report", str(run)), "restarts.jsonl: line 1", "lost_s='lots'")


# --- a restart's reason, from the run's hang records ---------------------------------------------------------


def restarting(tmp_path: Path, hang: dict = HANG, step: int = 5) -> RunDir:
    """A run of 2 ranks, 6 of 8 steps done, with a hang at ``step`` (``hang`` its record), about to restart."""
    run = fake_run(tmp_path / "run", plan={"world_size": 2, "total_steps": 8})
    where = run / "hangs" / f"step-{step:08d}"
    where.mkdir(parents=True)
    (where / "hang.json").write_text(json.dumps(hang | {"step": step}))
    return RunDir(run)


def test_a_restart_names_the_hang_on_one_line(tmp_path):
    run = restarting(tmp_path, HANG | {"phase": "forward\nstep 9: injected"})
    record = record_restart(run, step=4, elapsed_s=0.0, world_size=2)
    assert record["reason"].startswith("hang at step 5: rank(s) 1 stuck in forward") and "\n" not in record["reason"]
    assert read_restarts(run.restarts) == [record]


def test_a_hang_before_the_checkpoint_does_not_change_the_world_size_said(tmp_path):
    run = restarting(tmp_path, step=3)  # an older attempt's hang: not why this one ended
    record = record_restart(run, step=4, elapsed_s=0.0, world_size=2)
    assert record["reason"] == "the run was started again", record


def test_a_damaged_hang_record_does_not_stop_the_restart(tmp_path, caplog):
    run = restarting(tmp_path, HANG | {"stuck_ranks": 5})
    record = record_restart(run, step=4, elapsed_s=0.0, world_size=2)
    assert record["reason"] == "the run was started again"
    assert "stuck_ranks=5" in caplog.text


def test_a_torn_restart_line_is_not_glued_to_the_next(tmp_path):
    run = restarting(tmp_path, step=3)
    run.restarts.write_text(json.dumps(RESTART) + '\n{"step": 6, "wor')  # killed while appending
    record = record_restart(run, step=4, elapsed_s=0.0, world_size=2)
    assert read_restarts(run.restarts) == [RESTART, record]


def test_a_damaged_restart_record_is_said_before_another_is_appended(tmp_path):
    run = restarting(tmp_path, step=3)
    run.restarts.write_text(json.dumps(RESTART | {"lost_s": "lots"}) + "\n")
    with pytest.raises(UserError, match=r"restarts\.jsonl: line 1"):
        record_restart(run, step=4, elapsed_s=0.0, world_size=2)
    assert run.restarts.read_text() == json.dumps(RESTART | {"lost_s": "lots"}) + "\n"


def test_a_metrics_row_without_its_elapsed_time_is_no_crash(tmp_path):
    run = restarting(tmp_path, step=3)
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    rows[-1]["elapsed_s"] = None
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = record_restart(run, step=4, elapsed_s=0.0, world_size=2)
    assert record["lost_s"] >= rows[-2]["elapsed_s"]
