"""The hang watchdog on real ranks: a rank that stops is named with its phase and line, the job exits for torchrun
to restart it, and the restart (``--auto-resume``) finishes the run with every step once. A rank that is slow but
moves is no hang (:mod:`tests.planted`'s run).

The oracle is the planted hang: the test's model sleeps on rank 1 in the forward of step 5 (once: a marker file),
so the watchdog must name rank 1, ``forward``, and the model file's sleeping line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadytrain.runs.goodput import goodput
from tests.cli_utils import in_process, launched
from tests.train_utils import bigram_module, metrics, sets, write_text_dataset

_SLEEPY = bigram_module(
    doc="""A bigram LM; on rank 1 its forward number SLEEP_AT sleeps SLEEP_S (once per SLEEP_MARKER, when set), and its
    forward number CRASH_AT ends the process (exit 3).""",
    hook="""
    rank1 = os.environ.get("RANK") == "1"
    marker = os.environ.get("SLEEP_MARKER")
    if rank1 and marker and self.calls == int(os.environ["SLEEP_AT"]) and not Path(marker).exists():
        Path(marker).write_text("slept")
        time.sleep(float(os.environ["SLEEP_S"]))  # SLEEPING LINE
    if rank1 and os.environ.get("CRASH_AT") and self.calls == int(os.environ["CRASH_AT"]):
        os._exit(3)  # a faulty node, every attempt
    """,
)
_LINE = next(i for i, line in enumerate(_SLEEPY.splitlines(), start=1) if "SLEEPING LINE" in line)
"""The sleeping line's number in sleepy.py."""

ITEMS = [
    "model.name=sleepy:factory",
    "data.seq_len=32",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "run.max_steps=8",
    "run.log_every=1",
    "checkpoint.every_steps=2",
]
"""8 steps of 2 micro-batches per rank on 2 ranks (the forward of step 5 is rank 1's 9th call); checkpoints every 2."""


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hangs")
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "sleepy.py").write_text(_SLEEPY)
    return pkg, write_text_dataset(root / "data", [40, 40, 40, 40])


@pytest.mark.distributed
def test_a_rank_that_stops_is_named_and_the_restart_finishes_every_step_once(sleepy, tmp_path):
    pkg, data = sleepy
    run = tmp_path / "run"
    env = {"PYTHONPATH": str(pkg), "SLEEP_MARKER": str(tmp_path / "slept"), "SLEEP_AT": "9", "SLEEP_S": "300"}
    proc = launched(
        "train", "--nproc", "2", "--max-restarts", "1", "--run-dir", run,
        *sets(*ITEMS, f"data.path={data}", "distributed.watchdog_s=3"), timeout=240, **env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]

    hang = json.loads((run / "hangs" / "step-00000005" / "hang.json").read_text())
    assert hang["step"] == 5 and hang["stuck_ranks"] == [1] and hang["phase"] == "forward"
    assert hang["frame"].startswith(f"{pkg / 'sleepy.py'}:{_LINE} in forward"), hang["frame"]
    assert hang["ranks"]["0"]["phase"] in ("backward", "all_reduce")  # waiting for rank 1's gradients
    stacks = (run / "hangs" / "step-00000005" / "rank-00001.txt").read_text()
    assert f'sleepy.py", line {_LINE}, in forward' in stacks and "steadytrain-watchdog" in stacks

    (restart,) = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert restart["step"] == 4 and (restart["world_size_before"], restart["world_size_after"]) == (2, 2)
    assert "hang at step 5" in restart["reason"] and "rank(s) 1" in restart["reason"] and restart["lost_s"] > 3
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))  # every step once

    # the time account: the hung attempt ends at the watchdog's verdict, 3 s (watchdog_s) and at most a poll or two
    # after rank 1's last progress; nothing it trained is lost (it hung in step 5, after its checkpoint at 4)
    account = goodput(run).to_dict()
    hung, resumed = account["attempts"]
    assert (hung["how"], hung["steps"], resumed["how"], resumed["resumed_at"]) == ("hang", [0, 4], "finished", 4)
    assert 3.0 <= hung["badput"]["hang"] <= 3.0 + 3.0, hung
    assert hung["badput"]["lost_progress"] < 0.5 and resumed["badput"]["restart_gap"] > 0
    assert resumed["badput"]["checkpoint_restore"] > 0 and account["badput"]["hang"] == hung["badput"]["hang"]
    for a in (account, hung, resumed):
        assert a["productive_s"] + sum(a["badput"].values()) == pytest.approx(a["wall_s"], abs=5e-3)

    listed = in_process("hangs", str(run), "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert {k: row[k] for k in ("step", "stuck_ranks", "phase", "host", "frame")} == {
        k: hang[k] for k in ("step", "stuck_ranks", "phase", "host", "frame")
    }
    text = in_process("hangs", str(run)).stdout
    assert "step 5: rank(s) 1 stuck in forward" in text and "sleepy.py" in text


@pytest.mark.distributed
def test_a_slow_rank_that_moves_is_no_hang(planted):
    run = planted.runs["moving"]  # rank 1 sleeps 0.4 s in each forward: 0.8 s a step, inside the watchdog's 3 s
    for proc in planted.results["moving"]:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "hangs").exists()
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))
    assert not (run / "restarts.jsonl").exists()


def test_hangs_on_a_run_without_hangs_and_on_bad_records(tmp_path, tiny_run):
    from tests.train_utils import CHECKPOINTED, copy_run

    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    proc = in_process("hangs", str(run))
    assert proc.returncode == 0 and "no hang recorded" in proc.stdout
    assert json.loads(in_process("hangs", str(run), "--json").stdout) == []
    bad = run / "hangs" / "step-00000003"
    bad.mkdir(parents=True)
    (bad / "hang.json").write_text('{"step": 3}')
    proc = in_process("hangs", str(run))
    assert proc.returncode == 2 and "not a hang record" in proc.stderr and "Traceback" not in proc.stderr
    proc = in_process("hangs", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no such run directory" in proc.stderr


def _configs_worker(rank: int, world_size: int, out: Path) -> None:
    import torch

    from steadytrain._mapping import flatten
    from steadytrain.errors import UserError
    from steadytrain.train.setup.distributed import DistInfo, same_everywhere
    from tests.dist_utils import save

    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo")
    same = {"batch": {"base_lr": 0.01, "micro_batch_size": 4}, "run": {"seed": 0}}
    same_everywhere(info, flatten(same))  # equal everywhere: nothing said
    other = {"batch": {"base_lr": 0.01 * (rank + 1), "micro_batch_size": 4}, "run": {"seed": 0}}
    try:
        same_everywhere(info, flatten(other))
        error = None
    except UserError as err:
        error = str(err)
    save(out, rank, error)


@pytest.mark.distributed
def test_two_agents_with_different_configs_are_refused_on_every_rank(tmp_path):
    from tests.dist_utils import load_all, spawn

    spawn(_configs_worker, 2, tmp_path)
    errors = load_all(tmp_path, 2)
    assert all(e is not None and "\n" not in e for e in errors)
    assert "rank 1 runs another config than rank 0" in errors[0] and "batch.base_lr=0.02" in errors[0]
    assert "rank 0 runs another config than rank 1" in errors[1] and "batch.base_lr=0.01" in errors[1]


@pytest.mark.distributed
def test_a_restart_storm_stops_after_max_restarts_and_keeps_every_attempt(sleepy, tmp_path):
    pkg, data = sleepy
    run = tmp_path / "run"
    proc = launched(
        "train", "--nproc", "2", "--max-restarts", "1", "--run-dir", run, *sets(*ITEMS, f"data.path={data}"),
        timeout=240, PYTHONPATH=str(pkg), CRASH_AT="1",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]  # the failing rank's own exit code
    last = proc.stderr.strip().splitlines()[-1]
    assert "failed again after 1 restart(s) (--max-restarts 1)" in last, proc.stderr[-3000:]
    # each attempt died before its first checkpoint: the first one's files are kept aside, never overwritten
    assert (run.with_name("run.restart-1") / "config.yaml").is_file() and (run / "config.yaml").is_file()
    assert not run.with_name("run.restart-2").exists()
