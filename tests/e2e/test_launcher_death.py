"""Ranks die with their launcher; a kill after the last step keeps the run's report.

The process is the point here, so these tests start real processes: ``steadytrain train --nproc 2`` (torchrun
starts each rank in a session of its own, so a kill of the launcher's process group does not reach them), and
small launchers of their own for :mod:`steadytrain.train.setup.launcher`. Every process a test starts, and every
descendant it saw, is killed when the test ends, whatever its outcome.

Oracles: ``/proc`` (which processes still exist), the run directory's files, and a ``--resume`` that continues
from the latest complete checkpoint to a metrics log with every step exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train_utils import EXE, metrics, sets, write_text_dataset

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")

_MODEL = '''
"""A bigram LM whose ranks write their pid (PID_DIR/rank-RANK) when built and sleep SLOW seconds per forward.
KILL_POINT=parting: the ranks stop where they part at the end (steadytrain.train.setup.distributed.quiesce) and wait
there; KILL_POINT=report: the report waits for PID_DIR/go; KILL_POINT=forward: every forward waits, forever.
Kill points the test chooses."""
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_DIR = os.environ.get("PID_DIR")


def _mark(name):
    Path(_DIR, name).write_text(str(os.getpid()))


if os.environ.get("KILL_POINT") == "parting":
    from steadytrain.train.setup import distributed

    def _parting(*args, **kwargs):
        _mark("parting-" + os.environ.get("RANK", "0"))
        while True:
            time.sleep(0.05)

    distributed.quiesce = _parting

if os.environ.get("KILL_POINT") == "report":
    import importlib

    _report = importlib.import_module("steadytrain.runs.report")

    _draw = _report.report

    def _gated(run, **kwargs):
        _mark("report")
        while not Path(_DIR, "go").exists():
            time.sleep(0.02)
        return _draw(run, **kwargs)

    _report.report = _gated


class Bigram(torch.nn.Module):
    def __init__(self, dim=16, **_):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)
        if _DIR:
            _mark("rank-" + os.environ.get("RANK", "0"))

    def forward(self, batch):
        if os.environ.get("KILL_POINT") == "forward":
            _mark("forward-" + os.environ.get("RANK", "0"))
            while True:
                time.sleep(0.05)
        if os.environ.get("SLOW"):
            time.sleep(float(os.environ["SLOW"]))
        tokens = batch["tokens"].long()
        logits = self.head(self.emb(tokens[:, :-1]))
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def factory(**kw):
    return Bigram(**kw)
'''

_SETTINGS = [
    "model.name=pidlm:factory",
    "data.seq_len=32",
    "data.num_workers=1",  # a worker process too: it must not outlive its rank either
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "batch.base_lr=0.01",
    "run.log_every=1",
    "checkpoint.every_steps=2",
]


def _stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time)`` of a live process; None when gone (a zombie is gone: it runs nothing)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in "ZX" else (int(fields[1]), fields[0], int(fields[19]))


def _descendants(root: int) -> dict[int, int]:
    """Every live process under ``root``: pid -> start time (so a reused pid is never taken for it)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if (st := _stat(child)) is not None:
                out[child] = st[2]
                todo.append(child)
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in procs.items() if (st := _stat(pid)) is not None and st[2] == start}


class Processes:
    """What a test started and saw; all of it killed at the end (a failed test leaves no orphan behind)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.groups: list[int] = []

    def see(self, pid: int) -> None:
        if (st := _stat(pid)) is not None:
            self.seen[pid] = st[2]

    def kill_all(self) -> None:
        for pgid in self.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for pid in _alive(self.seen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def procs():
    p = Processes()
    yield p
    p.kill_all()


def _wait(what: str, ready, timeout: float, log: Path | None = None, proc: subprocess.Popen | None = None) -> None:
    """Until ``ready()``; a failure after ``timeout`` seconds, or as soon as ``proc`` (which should get there) exits."""
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end or (proc is not None and proc.poll() is not None):
            why = f"not within {timeout} s" if proc is None or proc.poll() is None else f"exit {proc.poll()}"
            pytest.fail(f"{what}: {why}" + (f"\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(0.05)


@pytest.fixture
def setup(tmp_path):
    pkg, pids = tmp_path / "pkg", tmp_path / "pids"
    pkg.mkdir()
    pids.mkdir()
    (pkg / "pidlm.py").write_text(_MODEL)
    data = write_text_dataset(tmp_path / "data", [40, 40, 40, 40])
    return pkg, pids, data


def _path(pkg: Path) -> str:
    """``PYTHONPATH`` with the user model's directory first."""
    return os.pathsep.join(p for p in (str(pkg), os.environ.get("PYTHONPATH")) if p)


def _start(procs: Processes, log: Path, *args: str, **env: str) -> subprocess.Popen:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [EXE, "train", *args],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    procs.groups.append(proc.pid)
    procs.see(proc.pid)
    return proc


def _rows(run: Path) -> list[dict]:
    """The training rows written so far (none while the file is missing or its last line is being written)."""
    try:
        return metrics(run)
    except (OSError, ValueError):
        return []


def _snapshot(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def _kill_launcher(procs: Processes, launcher: subprocess.Popen, pids: Path) -> dict[int, int]:
    """SIGKILL to the launcher's process group; the processes under it (both ranks among them), as they were."""
    under = _descendants(launcher.pid)
    ranks = {int((pids / f"rank-{r}").read_text()) for r in (0, 1)}
    assert ranks <= set(under), (ranks, under)
    procs.seen.update(under)
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    return under


@pytest.mark.distributed
def test_ranks_die_with_their_launcher_and_the_run_resumes_from_its_last_checkpoint(cli, setup, tmp_path, procs):
    pkg, pids, data = setup
    run, log = tmp_path / "run", tmp_path / "out.txt"
    items = [*_SETTINGS, f"data.path={data}", "run.max_steps=400"]  # far more steps than the test waits for
    launcher = _start(
        procs, log, "--nproc", "2", "--run-dir", str(run), *sets(*items),
        PYTHONPATH=_path(pkg), PID_DIR=str(pids), SLOW="0.05",
    )  # fmt: skip
    ckpts = run / "checkpoints"
    _wait("a metrics row and a checkpoint", lambda: _rows(run) and list(ckpts.glob("step-*")), 120, log, launcher)
    under = _kill_launcher(procs, launcher, pids)
    assert len(under) >= 4, under  # two ranks, each with its data worker
    _wait(f"the end of every process the launcher had started {under}", lambda: not _alive(under), 30, log)
    before = _snapshot(run)
    time.sleep(1.0)
    assert _snapshot(run) == before  # nothing writes the run directory any more
    assert "Traceback" not in log.read_text()

    latest = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*"))
    assert latest < 400
    sys.path.insert(0, str(pkg))  # the cli fixture restores sys.path and forgets the module
    r = cli("train", "--resume", str(run), "--set", f"run.max_steps={latest + 2}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(run)] == list(range(1, latest + 3))  # every step once
    resumes = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["step"] == latest


@pytest.mark.distributed
def test_a_kill_while_the_ranks_part_leaves_the_report_and_no_traceback(setup, tmp_path, procs):
    pkg, pids, data = setup
    run, log = tmp_path / "run", tmp_path / "out.txt"
    items = [*_SETTINGS, f"data.path={data}", "run.max_steps=4"]
    launcher = _start(
        procs, log, "--nproc", "2", "--run-dir", str(run), *sets(*items),
        PYTHONPATH=_path(pkg), PID_DIR=str(pids), KILL_POINT="parting",
    )  # fmt: skip
    parting = [pids / "parting-0", pids / "parting-1"]
    _wait("both ranks parting", lambda: all(p.exists() for p in parting), 120, log, launcher)
    under = _kill_launcher(procs, launcher, pids)
    _wait(f"the end of every process the launcher had started {under}", lambda: not _alive(under), 30, log)
    assert "Traceback" not in log.read_text()
    plots = sorted(p.name for p in (run / "plots").iterdir())
    assert plots == [f"{name}.png" for name in ("goodput", "grad_norm", "layers", "loss", "lr", "throughput")]
    summary = (run / "summary.md").read_text()
    assert "![loss](plots/loss.png)" in summary and "**Environment.**" in summary  # the report's, not the short one
    assert [row["step"] for row in metrics(run)] == [1, 2, 3, 4]


@pytest.mark.distributed
def test_eval_ranks_under_a_bare_torchrun_die_with_it(cli, setup, tmp_path, procs):
    """The sibling command (``eval`` under torchrun, no ``--nproc``): torchrun's own environment arms the ranks."""
    pkg, pids, data = setup
    run, log = tmp_path / "run", tmp_path / "out.txt"
    sys.path.insert(0, str(pkg))  # the cli fixture restores sys.path and forgets the module
    r = cli("train", "--run-dir", str(run), *sets(*_SETTINGS, f"data.path={data}", "run.max_steps=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [*cmd, "-m", "steadytrain", "eval", str(run)],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _path(pkg), "PID_DIR": str(pids),
                 "KILL_POINT": "forward"},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    procs.groups.append(launcher.pid)
    _wait("both ranks evaluating", lambda: all((pids / f"forward-{r}").exists() for r in (0, 1)), 120, log, launcher)
    under = _kill_launcher(procs, launcher, pids)
    _wait(f"the end of every process the launcher had started {under}", lambda: not _alive(under), 30, log)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_report_is_written_waits_for_it(setup, tmp_path, procs, sig):
    pkg, pids, data = setup
    run, log = tmp_path / "run", tmp_path / "out.txt"
    items = [*(s for s in _SETTINGS if not s.startswith("data.num_workers")), f"data.path={data}", "run.max_steps=2"]
    proc = _start(
        procs, log, "--run-dir", str(run), *sets(*items), PYTHONPATH=_path(pkg), PID_DIR=str(pids), KILL_POINT="report"
    )
    _wait("the report", (pids / "report").exists, 120, log, proc)
    os.kill(proc.pid, sig)
    noted = f"{sig.name}: the job is already ending"
    _wait("the signal noted", lambda: noted in log.read_text(), 30, log, proc)
    (pids / "go").touch()
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert noted in out and "Traceback" not in out
    names = sorted(p.stem for p in (run / "plots").glob("*.png"))
    assert names == ["goodput", "grad_norm", "layers", "loss", "lr", "throughput"]  # every plot of the report
    assert "![loss](plots/loss.png)" in (run / "summary.md").read_text()


_RANK = """
import os, signal, sys, time
from pathlib import Path
from steadytrain.train.setup import launcher

out, mode = Path(sys.argv[1]), sys.argv[2]
(out / "rank").write_text(str(os.getpid()))
if mode == "watch":  # no prctl here: the launcher's pid is watched from a thread
    launcher._set_pdeathsig = lambda sig: False
if mode == "late":  # the launcher dies before the rank asks for its death signal
    while os.getppid() == int(os.environ[launcher.LAUNCHER_PID]):
        time.sleep(0.01)
launcher.die_with_launcher()
(out / "armed").write_text(str(launcher.launcher_pid()))
if mode == "report":
    import torch
    from steadytrain.train.setup.distributed import DistInfo
    from steadytrain.train.job.stop import StopRequest

    with StopRequest(DistInfo(0, 1, 0, torch.device("cpu"), None)) as stop:
        stop.settle()
        with stop.holding():
            (out / "holding").touch()
            while not (out / "go").exists():
                if launcher.launcher_gone() and not (out / "saw-gone").exists():
                    (out / "saw-gone").touch()
                time.sleep(0.01)
            (out / "report-written").touch()
        (out / "after").touch()  # never: the rank dies with its launcher once the report is written
while True:
    time.sleep(0.05)
"""

_LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "RANK": "0", "STEADYTRAIN_LAUNCHER_PID": str(os.getpid())}
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env, start_new_session=True)
end = time.monotonic() + 600
while time.monotonic() < end and not (sys.argv[3] == "late" and os.path.exists(os.path.join(sys.argv[2], "exit"))):
    time.sleep(0.01)
"""


def _launch(procs: Processes, out: Path, mode: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, str(out), mode], env=env)
    procs.see(proc.pid)
    _wait("the rank", (out / "rank").exists, 60)
    rank = int((out / "rank").read_text())
    procs.see(rank)
    return proc, rank


@pytest.mark.parametrize("mode", ["prctl", "watch"])
def test_a_rank_dies_when_its_launcher_is_killed(tmp_path, procs, mode):
    launcher, rank = _launch(procs, tmp_path, mode)
    _wait("the rank armed", (tmp_path / "armed").exists, 60)
    assert int((tmp_path / "armed").read_text()) == launcher.pid
    ranks = _alive({rank: procs.seen[rank]})
    assert ranks  # alive while its launcher is
    launcher.kill()
    launcher.wait()
    _wait("the rank's end", lambda: not _alive(ranks), 30)


def test_a_rank_whose_launcher_died_before_it_looked_exits_at_once(tmp_path, procs):
    launcher, rank = _launch(procs, tmp_path, "late")
    ranks = {rank: procs.seen[rank]}
    (tmp_path / "exit").touch()  # the launcher exits; the rank arms only once it has
    launcher.wait(timeout=60)
    _wait("the rank's end", lambda: not _alive(ranks), 30)
    assert not (tmp_path / "armed").exists()


def test_rank_0_outlives_its_launcher_until_the_report_is_written(tmp_path, procs):
    launcher, rank = _launch(procs, tmp_path, "report")
    _wait("the report under way", (tmp_path / "holding").exists, 60)
    ranks = {rank: procs.seen[rank]}
    launcher.kill()
    launcher.wait()
    _wait("the rank seeing its launcher gone", (tmp_path / "saw-gone").exists, 30)
    assert _alive(ranks)  # its death signal, SIGTERM while the report is written, did not end it
    (tmp_path / "go").touch()
    _wait("the rank's end", lambda: not _alive(ranks), 30)
    assert (tmp_path / "report-written").exists() and not (tmp_path / "after").exists()
