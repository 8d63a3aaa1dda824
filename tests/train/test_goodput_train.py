"""Where a real run's time went: costs planted with known durations, each found in its own cause.

One single-process run of a bigram model (each training forward takes 50 ms), with a data transform that stalls
twice, an evaluation forward that sleeps, and a checkpoint callback that sleeps (each records what it slept, with its
process id: the oracle), is killed with SIGKILL in step 7, three steps after its checkpoint at 4; after a planted
pause, ``--auto-resume`` finishes it. The rows the killed attempt wrote past its checkpoint (a copy of
``metrics.jsonl`` taken before the resume cuts them) say what its lost steps took.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.cli_utils import in_process, launched
from tests.train_utils import bigram_module, metrics, sets, user_package, write_text_dataset

EVAL_S, STALL_S, SAVE_S, PAUSE_S, TRAIN_S = 0.15, 0.4, 0.3, 1.5, 0.05
KILL_AT, SAVED_AT, STEPS = 7, 4, 10

_PLANT = (
    '''
import os, signal, time
from pathlib import Path

_calls = 0


def note(kind, seconds):
    with open(os.environ["PLANT_LOG"], "a") as f:
        f.write(f"{os.getpid()} {kind} {seconds}\\n")


def stall(mb):
    """Micro-batches 3 and 5 of each process wait STALL_S (its data, as a slow file system would)."""
    global _calls
    _calls += 1
    if _calls in (3, 5):
        time.sleep(STALL_S)
        note("data", STALL_S)
    return mb


class Hooks:
    def on_checkpoint(self, run, step):
        time.sleep(SAVE_S)
        note("checkpoint", SAVE_S)

    def on_step_end(self, run):
        marker = Path(os.environ["PLANT_LOG"] + ".killed")
        if run.step == KILL_AT and not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)


def hooks():
    return Hooks()
'''.replace("STALL_S", str(STALL_S))
    .replace("SAVE_S", str(SAVE_S))
    .replace("KILL_AT", str(KILL_AT))
)

ITEMS = (
    "model.name=sleepy:factory", "data.seq_len=32", "data.num_workers=0", "data.transform=plant:stall",
    "batch.micro_batch_size=4", "batch.global_batch_size=8", "batch.base_batch_size=8", f"run.max_steps={STEPS}",
    "run.log_every=1", f"checkpoint.every_steps={SAVED_AT}", "eval.holdout_shards=1", f"eval.every_steps={SAVED_AT}",
    "run.callbacks=[plant:hooks]",
)  # fmt: skip


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput")
    sleepy = bigram_module(hook=f"""
    if self.training:
        time.sleep({TRAIN_S})  # the work of a step
    else:
        time.sleep({EVAL_S})
        with open(os.environ["PLANT_LOG"], "a") as f:
            f.write(f"{{os.getpid()}} eval {EVAL_S}\\n")
    """)  # fmt: skip
    pkg = user_package(root, sleepy=sleepy, plant=_PLANT)
    data = write_text_dataset(root / "data", [40, 40, 40, 40])
    run, log = root / "run", root / "plant.log"
    env = {"PYTHONPATH": str(pkg), "PLANT_LOG": str(log)}
    args = ("train", "--run-dir", run, "--auto-resume", *sets(*ITEMS, f"data.path={data}"))
    first = launched(*args, timeout=240, **env)
    killed_rows = metrics(run)
    time.sleep(PAUSE_S)  # the planted gap between the attempts
    second = launched(*args, timeout=240, **env)
    return run, first, second, killed_rows, log


def _slept(log: Path) -> dict[int, dict[str, float]]:
    """Seconds slept by process (in order of the attempts) and kind."""
    out: dict[int, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        pid, kind, seconds = line.split()
        out.setdefault(int(pid), {}).setdefault(kind, 0.0)
        out[int(pid)][kind] += float(seconds)
    return out


def _adds_up(account: dict) -> None:
    assert account["productive_s"] + sum(account["badput"].values()) == pytest.approx(account["wall_s"], abs=5e-3)


def test_planted_costs_land_in_their_causes_across_a_kill_and_a_restart(killed_and_resumed):
    run, first, second, killed_rows, log = killed_and_resumed
    assert first.returncode == -9, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))  # every step once

    account = json.loads(in_process("goodput", str(run), "--json").stdout)
    assert account == json.loads((run / "goodput.json").read_text())  # written at the end of the last attempt
    one, two = account["attempts"]
    assert (one["how"], two["how"], two["resumed_at"]) == ("killed", "finished", SAVED_AT)
    slept = list(_slept(log).values())
    assert len(slept) == 2
    for attempt, planted in zip((one, two), slept, strict=True):
        bad = attempt["badput"]
        assert planted["data"] <= bad["data_wait"] <= planted["data"] + 0.5, (planted, bad)
        assert planted["eval"] <= bad["evaluation"] <= planted["eval"] + 1.0, (planted, bad)
        assert planted["checkpoint"] <= bad["checkpoint_save"] <= planted["checkpoint"] + 1.5, (planted, bad)
        assert bad["startup"] > 0 and bad["hang"] == bad["straggler"] == bad["compile"] == 0.0
        _adds_up(attempt)
    assert slept[0]["checkpoint"] == SAVE_S and slept[1]["checkpoint"] == 2 * SAVE_S  # at 4; at 8 and the end

    # the killed attempt's steps 5 and 6 are lost (their rows say how long they took; step 7's row was never
    # written: its time is in the gap before the restart)
    lost = [r for r in killed_rows if r["step"] > SAVED_AT]
    assert [r["step"] for r in lost] == [5, 6]
    assert one["badput"]["lost_progress"] == pytest.approx(sum(r["step_s"] for r in lost), rel=0.15, abs=0.05)
    assert PAUSE_S <= two["badput"]["restart_gap"] <= PAUSE_S + 15.0
    assert two["badput"]["checkpoint_restore"] > 0 and one["badput"]["checkpoint_restore"] == 0.0
    _adds_up(account)
    assert account["badput"]["restart_gap"] == two["badput"]["restart_gap"]

    summary = (run / "summary.md").read_text().splitlines()
    assert summary[2].startswith(f"- **goodput {account['goodput']:.1%}") and "over 2 attempts" in summary[2]
    assert (run / "plots" / "goodput.png").is_file()


def test_a_run_from_before_timelines_reports_without_a_goodput_line(killed_and_resumed, tmp_path):
    run = Path(shutil.copytree(killed_and_resumed[0], tmp_path / "old"))
    (run / "timeline.jsonl").unlink()
    (run / "goodput.json").unlink()
    proc = in_process("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "goodput" not in (run / "summary.md").read_text() and not (run / "goodput.json").exists()
    proc = in_process("goodput", str(run))
    assert proc.returncode == 2 and "no timeline.jsonl" in proc.stderr

    # compare: the two accounts side by side, the older run's side empty
    both = json.loads(in_process("compare", str(killed_and_resumed[0]), str(run), "--json").stdout)["goodput"]
    account = json.loads((killed_and_resumed[0] / "goodput.json").read_text())
    assert both["goodput"] == [account["goodput"], None]
    assert both["restart_gap"] == [account["badput"]["restart_gap"], None]
    text = in_process("compare", str(killed_and_resumed[0]), str(run)).stdout
    assert "time account (A vs B):" in text and f"{account['goodput']:.1%}" in text and "n/a" in text
