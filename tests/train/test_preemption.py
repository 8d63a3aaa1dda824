"""Preemption (SIGTERM, SIGUSR1) honoured within ``run.stop_deadline_s``, wherever the loop is when it comes.

One run of 2 gloo ranks is preempted four times, each time in another phase, and requeued with ``--auto-resume``
as Slurm would: in an evaluation (SIGTERM to both ranks, as Slurm signals every process), while an asynchronous
checkpoint is being written (rank 0 alone), in a data stall (rank 1 alone) and in a forward pass (SIGUSR1 to the
launcher of ``--nproc 2``, which passes it on). The ranks of the other three are two processes started with the
environment torchrun gives its ranks, so that each rank's own exit status is seen (torchrun's is its own, and it
ends the other ranks when one exits). After each stop: every rank exited with the requeue code by the normal way
(not the deadline's), the latest checkpoint is complete and is of the last step in ``metrics.jsonl``. Oracle: an
uninterrupted run of the same config: the per-step losses bit for bit, every step once; its evaluations, but for
those the stops abandoned. A model, a data transform and the checkpoint writer pause where a test says (they
write ``reached-RANK`` and wait for ``go``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.launcher.api import LaunchConfig

from steadytrain.runs.goodput import goodput
from steadytrain.train.job.stop import REQUEUE_EXIT_CODE
from tests.dist_utils import free_port
from tests.train_utils import EXE, evals, metrics, run_cli, sets, write_text_dataset

_HOOKS = '''
"""A bigram LM, a data transform and the checkpoint writer, pausing at call PAUSE_AT (counted in this process) of
PAUSE_POINT: "train" or "eval" (a forward pass), "data" (a micro-batch transformed), "save" (a checkpoint file
written, on the writing thread). There it writes PAUSE_DIR/reached-RANK (its pid) and waits for PAUSE_DIR/go; every
call of PAUSE_POINT is a line of PAUSE_DIR/calls-POINT."""
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_calls = {}


def pause(point):
    if os.environ.get("PAUSE_POINT") != point:
        return
    with open(Path(os.environ["PAUSE_DIR"]) / ("calls-" + point), "a") as f:
        f.write("1\\n")
    _calls[point] = _calls.get(point, 0) + 1
    if _calls[point] != int(os.environ["PAUSE_AT"]):
        return
    where = Path(os.environ["PAUSE_DIR"])
    (where / ("reached-" + os.environ.get("RANK", "0"))).write_text(str(os.getpid()))
    while not (where / "go").exists():
        time.sleep(0.01)


class Bigram(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)

    def forward(self, batch):
        pause("train" if self.training else "eval")
        tokens = batch["tokens"].long()
        logits = self.head(self.emb(tokens[:, :-1]))
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def factory(**kw):
    return Bigram(**kw)


def transform(mb):
    pause("data")
    return mb


if os.environ.get("PAUSE_POINT") == "save":
    from steadytrain.train.checkpoint import writer

    _write = writer.write_safetensors

    def _paused(*args, **kwargs):
        pause("save")
        return _write(*args, **kwargs)

    writer.write_safetensors = _paused
'''

ITEMS = [
    "model.name=preempt_hooks:factory",
    "data.transform=preempt_hooks:transform",
    "data.num_workers=0",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "batch.base_lr=0.01",
    "run.max_steps=12",
    "run.log_every=1",
    "run.trackers=[]",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=20",
    "checkpoint.async=true",
    "eval.holdout_shards=1",
    "eval.every_steps=2",
]
"""12 steps of 2 micro-batches per rank on 2 ranks (4 on one), an evaluation every 2 steps (5 passes per rank on 2
ranks), an asynchronous checkpoint every 3."""
STOPPED = "interrupted by"
USR1 = signal.SIGUSR1 if "signals_to_handle" in LaunchConfig.__dataclass_fields__ else signal.SIGTERM
"""What the launcher of ``--nproc`` is sent: SIGUSR1 where torchrun passes it on (``--signals-to-handle``)."""
PASSED = "run.stop_deadline_s=60 s passed"
"""The deadline's line (the attempts below must end the normal way, long before it)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """The hooks' package and the dataset."""
    tmp = tmp_path_factory.mktemp("preempt")
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "preempt_hooks.py").write_text(_HOOKS)
    return tmp / "pkg", write_text_dataset(tmp / "data", [40, 40, 40, 40])


def _items(data: Path, *more: str) -> list[str]:
    return sets(*ITEMS, f"data.path={data}", "run.stop_deadline_s=60", *more)


class Ranks:
    """Two ``steadytrain train --auto-resume`` processes with the environment torchrun gives ranks 0 and 1."""

    def __init__(self, pkg: Path, data: Path, run: Path, logs: Path, pause: dict[str, str]) -> None:
        port = str(free_port())
        self.logs = [logs / f"rank-{r}.txt" for r in (0, 1)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "STEADYTRAIN_LAUNCHER_PID")}
            env |= {
                "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pkg), "RANK": str(rank), "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **pause,
            }  # fmt: skip
            with open(log, "w") as out:
                cmd = [EXE, "train", "--run-dir", str(run), "--auto-resume", *_items(data)]
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))

    def text(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait(self, timeout: float = 120) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the ranks did not end:\n{self.text(0)[-3000:]}\n{self.text(1)[-3000:]}")

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _wait_until(what: str, ready, procs: list[subprocess.Popen], out, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if any(p.poll() is not None for p in procs) or time.monotonic() > end:
            for p in procs:
                p.kill()
            pytest.fail(f"{what}: not seen:\n{out()[-4000:]}")
        time.sleep(0.02)


def _stopped_at(run: Path) -> int:
    """The step a stop ended at: its checkpoint is the latest, complete, and of the last row of metrics.jsonl."""
    assert not list((run / "checkpoints").glob(".*.partial")), "a save left unfinished"
    done = sorted(p for p in (run / "checkpoints").iterdir() if (p / "state.json").is_file())
    last = metrics(run)[-1]["step"]
    assert done[-1].name == f"step-{last:08d}", (done, last)
    assert json.loads((done[-1] / "state.json").read_text())["step"] == last
    return last


def _preempt(ranks: Ranks, pause: Path, targets: list[int], *, reached: int = 2) -> None:
    """When ``reached`` ranks pause, SIGTERM to the ranks ``targets``; once their handlers said so, ``go``."""
    out = lambda: ranks.text(0) + ranks.text(1)  # noqa: E731
    _wait_until(
        f"{reached} rank(s) at the pause", lambda: len(list(pause.glob("reached-*"))) >= reached, ranks.procs, out
    )
    for rank in targets:
        ranks.procs[rank].send_signal(signal.SIGTERM)
    told = lambda: all("SIGTERM: stopping at the next optimizer step boundary" in ranks.text(r) for r in targets)  # noqa: E731
    _wait_until("the signal taken", told, ranks.procs, out)
    (pause / "go").touch()


def _segment(tmp: Path, name: str, pkg: Path, data: Path, run: Path, point: str, at: int, targets: list[int]):
    """One attempt of the run, preempted at call ``at`` of ``point``: both ranks exit with the requeue code."""
    where = tmp / name
    where.mkdir()
    ranks = Ranks(pkg, data, run, where, {"PAUSE_POINT": point, "PAUSE_AT": str(at), "PAUSE_DIR": str(where)})
    _preempt(ranks, where, targets, reached=1 if point == "save" else 2)
    codes = ranks.wait()
    texts = [ranks.text(0), ranks.text(1)]
    assert codes == [REQUEUE_EXIT_CODE] * 2, (name, codes, texts[0][-3000:], texts[1][-3000:])
    assert not any(PASSED in t for t in texts), name  # the normal way, within the deadline
    step = _stopped_at(run)
    assert f"{STOPPED} " in texts[0] and f"preempted, requeue me; checkpoint written at step {step}" in texts[0]
    return step, texts[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, setup) -> Path:
    """The same config on 2 ranks, uninterrupted."""
    pkg, data = setup
    tmp = tmp_path_factory.mktemp("straight")
    ranks = Ranks(pkg, data, tmp / "run", tmp, {})
    assert ranks.wait() == [0, 0], ranks.text(0)[-3000:]
    return tmp / "run"


def _abandoned(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"evaluation at step (\d+) abandoned: [^;]+; it is not part of", text)]


@pytest.mark.distributed
def test_preempted_in_every_phase_each_stop_is_complete_and_the_requeues_equal_one_run(tmp_path, setup, straight):
    pkg, data = setup
    run = tmp_path / "run"
    # in the evaluation after step 2 (its second pass on each rank): abandoned, the stop is at step 2
    step, text = _segment(tmp_path, "eval", pkg, data, run, "eval", 2, [0, 1])
    assert step == 2 and _abandoned(text) == [2], text[-3000:]
    abandoned = [2]
    # while rank 0's writing thread writes step 3's checkpoint (the loop trains on): rank 0 alone is signalled
    step, text = _segment(tmp_path, "save", pkg, data, run, "save", 1, [0])
    assert 3 <= step <= 6, step  # step 6's save waits for step 3's; a stop agreed after it is one at step 6
    assert (run / "checkpoints" / "step-00000003" / "state.json").is_file()
    abandoned += _abandoned(text)
    # in the data of the second micro-batch after the resume: rank 1 alone is signalled
    before = step
    step, text = _segment(tmp_path, "data", pkg, data, run, "data", 2, [1])
    assert before < step <= before + 2, (before, step)  # the step in progress, at most the next
    abandoned += _abandoned(text)
    # in the first forward after the resume, under --nproc 2: the launcher's SIGUSR1, passed on by torchrun
    before, (step, text) = step, _launcher_segment(tmp_path, pkg, data, run)
    assert before < step <= before + 2, (before, step)
    abandoned += _abandoned(text)
    # requeued once more: it finishes
    last = Ranks(pkg, data, run, tmp_path, {})
    assert last.wait() == [0, 0], last.text(0)[-3000:]
    assert [(r["step"], r["loss"]) for r in metrics(run)] == [(r["step"], r["loss"]) for r in metrics(straight)]
    kept = [(r["step"], r["val_loss"]) for r in evals(straight) if r["step"] not in abandoned]
    assert [(r["step"], r["val_loss"]) for r in evals(run)] == kept


def _launcher_segment(tmp: Path, pkg: Path, data: Path, run: Path) -> tuple[int, str]:
    """The attempt under ``steadytrain train --nproc 2``, preempted in its first forward: the launcher exits with the
    requeue code."""
    where = tmp / "launcher"
    where.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pkg)}
    env |= {"PAUSE_POINT": "train", "PAUSE_AT": "1", "PAUSE_DIR": str(where)}
    log = where / "out.txt"
    with open(log, "w") as out:
        cmd = [EXE, "train", "--nproc", "2", "--run-dir", str(run), "--auto-resume", *_items(data)]
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    _wait_until("both ranks at the pause", lambda: len(list(where.glob("reached-*"))) == 2, [proc], log.read_text)
    proc.send_signal(USR1)  # the launcher: torchrun passes it to its ranks
    told = lambda: log.read_text().count(f"{USR1.name}: stopping at the next optimizer step boundary") == 2  # noqa: E731
    _wait_until("both ranks told", told, [proc], log.read_text)
    (where / "go").touch()
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(log.read_text()[-4000:])
    text = log.read_text()
    assert code == REQUEUE_EXIT_CODE, text[-4000:]
    assert PASSED not in text and "Traceback" not in text, text[-4000:]
    return _stopped_at(run), text


def test_a_stall_longer_than_the_deadline_exits_with_the_requeue_code_and_the_checkpoint_intact(tmp_path, setup):
    pkg, data = setup
    run, pause = tmp_path / "run", tmp_path / "pause"
    pause.mkdir()
    # one rank: 4 micro-batches a step; the data of step 4's second micro-batch stalls and never comes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pkg)}
    env |= {"PAUSE_POINT": "data", "PAUSE_AT": "14", "PAUSE_DIR": str(pause)}
    items = sets(*ITEMS, f"data.path={data}", "run.stop_deadline_s=3")
    proc = subprocess.Popen(
        [EXE, "train", "--run-dir", str(run), *items],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_until("the stall", (pause / "reached-0").exists, [proc], lambda: "")
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the deadline did not end the process")
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    (line,) = [x for x in out.splitlines() if "run.stop_deadline_s=3 s passed" in x]
    assert "phase data after step 3" in line and "step-00000003" in line, line
    assert [p.name for p in (run / "checkpoints").iterdir() if (p / "state.json").is_file()] == ["step-00000003"]
    resumed = run_cli("train", "--run-dir", str(run), "--auto-resume", *items, PYTHONPATH=str(pkg))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, 13))
    # the time account: the stopped attempt wrote its last line before the deadline's exit; the stall (at least
    # the 3 s deadline) is its data wait, and nothing trained past the checkpoint at 3 is lost
    stopped, finished = goodput(run).to_dict()["attempts"]
    assert (stopped["how"], stopped["steps"][1], finished["how"], finished["resumed_at"]) == (
        "stopped",
        3,
        "finished",
        3,
    )
    assert stopped["badput"]["data_wait"] >= 3.0 and stopped["badput"]["lost_progress"] == 0.0, stopped


def test_a_signal_during_a_checkpoint_save_ends_the_run_with_that_checkpoint(tmp_path, setup):
    # one rank, in this process; the save of step 3 (written by the loop: not async) pauses in its first file
    pkg, data = setup
    run, pause = tmp_path / "run", tmp_path / "pause"
    pause.mkdir()

    def preempt() -> None:
        while not (pause / "reached-0").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread, inside the save
        time.sleep(0.2)
        (pause / "go").touch()

    signaller = threading.Thread(target=preempt, daemon=True)
    signaller.start()
    items = sets(*ITEMS, f"data.path={data}", "checkpoint.async=false", "run.stop_deadline_s=60")
    proc = run_cli(
        "train", "--run-dir", str(run), *items, PYTHONPATH=str(pkg), PAUSE_POINT="save", PAUSE_AT="1",
        PAUSE_DIR=str(pause),
    )  # fmt: skip
    signaller.join(timeout=10)
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr[-3000:]
    assert "interrupted by SIGTERM at step 3" in proc.stderr  # the step saved: not one more
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    (saved,) = (run / "checkpoints").iterdir()
    assert saved.name == "step-00000003" and (saved / "state.json").is_file()
    files = len(list(saved.glob("*.safetensors")))
    assert len((pause / "calls-save").read_text().splitlines()) == files  # saved once, not again at the stop
