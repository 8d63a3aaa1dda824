"""examples/slurm/train.sbatch, run as Slurm runs it, on a machine without Slurm.

Slurm's commands are stand-ins first on PATH: ``scontrol show hostnames`` prints the node list it is given
(a comma-separated list), ``scontrol requeue`` is recorded, and ``srun`` records its argv and then execs its
command once, as its one task on one node would. The script gets the environment Slurm sets
(``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_RESTART_COUNT``...).

Oracles: the same config under ``steadytrain train --nproc 2`` (the per-step losses of ``metrics.jsonl``,
bit for bit: the same world size and accumulation), for a job that is killed before its first checkpoint,
requeued, stopped by the time-limit signal with a checkpoint, requeued again and resumed; and the command
lines srun received (the rendezvous on the first node, ``--nnodes`` from ``SLURM_NNODES``, ``--auto-resume`` of
the same run directory on every attempt), and what ``--auto-resume`` decides for each state a requeue finds.
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

from steadytrain.train.job.stop import REQUEUE_EXIT_CODE
from tests.dist_utils import free_port
from tests.train_utils import EXE, metrics, write_text_dataset

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
JOB_ID = "4242"

_SRUN = '''#!{python}
"""srun's stand-in: record the argv, two variables of the environment the step gets, and the step (its pid,
under the batch script's pid); then run the command as the one task on one node (exec: the same pid)."""
import json, os, sys
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["srun", *sys.argv[1:]]) + "\\n")
    step_env = [os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")]
    f.write(json.dumps(["srun-env", *step_env]) + "\\n")
with open(os.environ["FAKE_SLURM_LOG"] + ".steps", "a") as f:
    f.write(f"{{os.getppid()}} {{os.getpid()}}\\n")
args = sys.argv[1:]
while args and args[0].startswith("-"):  # srun's own options (the script gives them as --name=value)
    args.pop(0)
if os.environ.get("FAKE_SRUN_EXEC", "1") == "1":
    os.execvp(args[0], args)
'''

_SCANCEL = '''#!{python}
"""scancel's stand-in for `scancel --signal=SIG JOBID`: SIG to the job's steps (those srun started under the
same batch script), not to the batch script itself."""
import json, os, signal, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["scancel", *args]) + "\\n")
if len(args) != 2 or not args[0].startswith("--signal="):
    sys.exit(f"scancel stand-in: not a command it knows: {{args}}")
sig = getattr(signal, "SIG" + args[0].split("=", 1)[1])
for line in open(os.environ["FAKE_SLURM_LOG"] + ".steps").read().splitlines():
    batch, pid = map(int, line.split())
    if batch == os.getppid():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
'''

_SCONTROL = '''#!{python}
"""scontrol's stand-in: `show hostnames LIST` prints a comma-separated LIST one host a line; `requeue` is
recorded."""
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["scontrol", *args]) + "\\n")
if args[:2] == ["show", "hostnames"] and len(args) == 3:
    print("\\n".join(args[2].split(",")))
elif not (args[:1] == ["requeue"] and len(args) == 2):
    sys.exit(f"scontrol stand-in: not a command it knows: {{args}}")
'''

_GATED = '''
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class Bigram(torch.nn.Module):
    """A bigram LM whose training forward number GATE_AT (counted per rank) writes GATE_DIR/reached-RANK (its
    pid) and waits for GATE_DIR/go: a kill point the test chooses."""

    def __init__(self, dim=16, **_):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        gate = os.environ.get("GATE_DIR")
        if gate and self.calls == int(os.environ["GATE_AT"]):
            Path(gate, "reached-" + os.environ.get("RANK", "0")).write_text(str(os.getpid()))
            while not Path(gate, "go").exists():
                time.sleep(0.01)
        tokens = batch["tokens"].long()
        logits = self.head(self.emb(tokens[:, :-1]))
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def factory(**kw):
    return Bigram(**kw)
'''

_CONFIG = """\
model:
  name: gated:factory
data:
  path: {data}
  seq_len: 32
  num_workers: 0
batch:
  micro_batch_size: 4
  global_batch_size: 16
  base_batch_size: 16
  base_lr: 0.01
run:
  max_steps: 8
  log_every: 1
checkpoint:
  every_steps: 100
"""
"""8 steps of 2 micro-batches per rank on 2 ranks; no checkpoint but the one a stop writes (and the last)."""


class Slurm:
    """The stand-ins on PATH, their log, and the environment Slurm gives a batch script."""

    def __init__(self, root: Path) -> None:
        self.bin, self.log = root / "slurm-bin", root / "slurm.log"
        self.bin.mkdir()
        for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL), ("scancel", _SCANCEL)):
            (self.bin / name).write_text(text.format(python=sys.executable))
            (self.bin / name).chmod(0o755)
        self.cwd = root  # sbatch runs the script in the directory it was submitted from

    def env(self, restarts: int, **extra: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GATE_"))}
        env.pop("RANK", None)
        env.update(
            PATH=os.pathsep.join([str(self.bin), str(Path(sys.executable).parent), env.get("PATH", "")]),
            FAKE_SLURM_LOG=str(self.log),
            OMP_NUM_THREADS="1",
            SLURM_JOB_ID=JOB_ID,
            SLURM_JOB_NAME="tiny run",
            SLURM_JOB_NODELIST="localhost",
            SLURM_NNODES="1",
            SLURM_RESTART_COUNT=str(restarts),
            GPUS_PER_NODE="2",
        )
        return {k: v for k, v in (env | extra).items() if v is not None}  # None: unset

    def start(self, *args: str, restarts: int = 0, out: Path | None = None, **extra: str) -> subprocess.Popen:
        with open(out or self.cwd / f"out-{restarts}.txt", "w") as log:  # the child writes it
            return subprocess.Popen(
                ["bash", str(SCRIPT), *args],
                cwd=self.cwd,
                env=self.env(restarts, **extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def run(self, *args: str, restarts: int = 0, **extra: str | None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            cwd=self.cwd,
            env=self.env(restarts, **extra),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def calls(self, cmd: str) -> list[list[str]]:
        if not self.log.exists():
            return []
        rows = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r[1:] for r in rows if r[0] == cmd]

    def steps(self) -> list[int]:
        """The pids of the steps srun started (torchrun's, after the exec)."""
        return [int(line.split()[1]) for line in Path(f"{self.log}.steps").read_text().splitlines()]

    def launched(self) -> list[str]:
        """The argv srun got last (its own options included)."""
        runs = self.calls("srun")
        assert runs, "srun was not called"
        return runs[-1]


@pytest.fixture
def slurm(tmp_path) -> Slurm:
    return Slurm(tmp_path)


def _dry(**extra: str | None) -> dict[str, str | None]:
    return {"FAKE_SRUN_EXEC": "0", **extra}


def _torchrun_argv(nnodes: int, endpoint: str) -> list[str]:
    return [
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=1",
        "torchrun",
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        f"--rdzv-id={JOB_ID}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "-m",
        "steadytrain",
        "train",
    ]


def test_two_nodes_rendezvous_on_the_first_and_every_argument_arrives_verbatim(slurm, tmp_path):
    config = tmp_path / "my configs" / "tiny $(touch pwned).yaml"
    extra = ["--set", "run.seed=3", "--set", "data.path=a b;`touch pwned`\n'\""]
    proc = slurm.run(str(config), *extra, **_dry(SLURM_JOB_NODELIST="gpu-07,gpu-08", SLURM_NNODES="2"))
    assert proc.returncode == 0, proc.stderr
    port = 29500 + int(JOB_ID) % 10000  # the default: one port per job, so two jobs on a node do not clash
    run_dir = "runs/tiny run-4242"  # RUNS_DIR/JOBNAME-JOBID
    assert slurm.launched() == [
        *_torchrun_argv(2, f"gpu-07:{port}"), str(config), "--run-dir", run_dir, "--auto-resume", *extra
    ]  # fmt: skip
    assert slurm.calls("scontrol") == [["show", "hostnames", "gpu-07,gpu-08"]]
    assert not list(tmp_path.rglob("pwned"))


def test_cluster_variables_replace_the_defaults(slurm, tmp_path):
    runs = tmp_path / "scratch space" / "runs"
    proc = slurm.run(
        "c.yaml",
        **_dry(
            RDZV_PORT="31000",
            RDZV_HOST="gpu-07-ib0",
            RUNS_DIR=str(runs),
            TORCHRUN="/opt/env/bin/torchrun",
            STOP_TIMEOUT_S="600",
            SLURM_CPUS_PER_TASK="16",
            OMP_NUM_THREADS=None,
        ),
    )
    assert proc.returncode == 0, proc.stderr
    argv = slurm.launched()
    assert argv[:4] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=16", "/opt/env/bin/torchrun"]
    assert "--rdzv-endpoint=gpu-07-ib0:31000" in argv
    assert argv[-3:] == ["--run-dir", f"{runs}/tiny run-4242", "--auto-resume"]
    assert slurm.calls("scontrol") == []  # a host given: no lookup
    assert slurm.calls("srun-env") == [["8", "600"]]  # 16 CPUs for 2 ranks; torchrun's wait for a stop


def test_defaults_of_the_step_environment(slurm):
    proc = slurm.run("c.yaml", **_dry(OMP_NUM_THREADS=None, SLURM_CPUS_PER_TASK="1"))
    assert proc.returncode == 0, proc.stderr
    assert slurm.calls("srun-env") == [["1", "240"]]  # never 0 threads


def _fake_checkpoint(run: Path, name: str) -> None:
    """``checkpoints/NAME``: an earlier version's file (``.pt``), or a directory still without its state.json."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    path = run / "checkpoints" / name
    if name.endswith(".pt"):
        path.write_bytes(b"x")
    else:
        path.mkdir()


@pytest.mark.parametrize(
    ("restarts", "checkpoint", "resumes"),
    [
        (0, None, False),  # the first start
        (1, None, False),  # killed before the run directory was made
        (1, "empty", False),  # killed before the first checkpoint
        (2, "step-00000004", False),  # killed while the first checkpoint was being written (no state.json)
        (1, "step-00000004.pt", True),  # a checkpoint of an earlier version
        (0, "step-00000004.pt", True),  # a new job given an earlier job's run (RUN_DIR)
        (0, "empty", False),  # ... without a checkpoint: kept aside as well
    ],
)
def test_a_requeue_resumes_a_run_with_a_checkpoint_and_starts_again_without_one(slurm, restarts, checkpoint, resumes):
    run = slurm.cwd / "runs" / "tiny run-4242"
    if checkpoint == "empty":
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.yaml").write_text("run: {}\n")
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
    elif checkpoint is not None:
        _fake_checkpoint(run, checkpoint)
    proc = slurm.run("c.yaml", "--set", "run.seed=3", restarts=restarts, **_dry())
    assert proc.returncode == 0, proc.stderr
    tail = ["c.yaml", "--run-dir", "runs/tiny run-4242", "--auto-resume", "--set", "run.seed=3"]
    assert slurm.launched()[len(_torchrun_argv(1, "")) :] == tail  # every attempt runs the same command
    # what that command then does with the directory it finds (every rank gets rank 0's decision)
    assert _auto_resume(run) == (run if resumes else None)
    aside = run.with_name("tiny run-4242.restart-1")
    if checkpoint and not resumes:  # what the attempt wrote is kept beside it; the name is free again
        assert not run.exists() and (aside / "checkpoints").is_dir()
    else:
        assert not aside.exists() and run.is_dir() == (checkpoint is not None)


def _auto_resume(run: Path) -> Path | None:
    import torch

    from steadytrain.train.job.restart import auto_resume
    from steadytrain.train.setup.distributed import DistInfo

    return auto_resume(DistInfo(0, 1, 0, torch.device("cpu"), None), run)


def test_a_second_requeue_without_a_checkpoint_keeps_both_attempts(slurm):
    run = slurm.cwd / "runs" / "tiny run-4242"
    for restarts in (1, 2):
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.yaml").write_text("run: {}\n")
        proc = slurm.run("c.yaml", restarts=restarts, **_dry())
        assert proc.returncode == 0, proc.stderr
        assert _auto_resume(run) is None
    assert sorted(p.name for p in run.parent.iterdir()) == ["tiny run-4242.restart-1", "tiny run-4242.restart-2"]


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        ((), {}, "usage"),
        (("--set", "run.seed=1"), {}, "the config comes first"),
        (("c.yaml",), {"GPUS_PER_NODE": "two"}, "GPUS_PER_NODE=two"),
        (("c.yaml",), {"RDZV_PORT": "70000"}, "RDZV_PORT=70000"),
        (("c.yaml",), {"SLURM_JOB_ID": ""}, "sbatch"),
    ],
)
def test_bad_input_says_the_fix_and_launches_nothing(slurm, args, env, words):
    proc = slurm.run(*args, **_dry(**env))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert slurm.calls("srun") == []
    assert not (slurm.cwd / "runs").exists()


_TORCHRUN = '''#!{python}
"""torchrun's stand-in, for the script's handling of signals: on SIGTERM (or at once, with STANDIN_ALONE) it takes
0.5 s (a checkpoint) and exits STANDIN_EXIT; it writes its parent's pid when it starts and when it exits (the script
must still be waiting)."""
import os, signal, sys, time
from pathlib import Path
out = Path(os.environ["STANDIN_DIR"])
def stop(signum, frame):
    time.sleep(0.5)
    (out / "stopped").write_text(str(os.getppid()))
    sys.exit(int(os.environ["STANDIN_EXIT"]))
signal.signal(signal.SIGTERM, stop)
(out / "started").write_text(str(os.getppid()))
if os.environ.get("STANDIN_ALONE"):
    stop(None, None)
while True:
    time.sleep(0.05)
'''


@pytest.mark.parametrize(
    ("sent", "standin_exit", "requeued"),
    [
        ("usr1", 1, True),  # the time limit is near: stop with a checkpoint, then requeue (torchrun exits 1)
        ("usr1", 0, False),  # the run ended by itself meanwhile: nothing to requeue
        ("term", 143, False),  # Slurm ends the job (scancel, preemption, time limit): wait for the checkpoint
        ("term", REQUEUE_EXIT_CODE, False),  # ... and Slurm's own --requeue decides, not the run's code
        (None, REQUEUE_EXIT_CODE, True),  # the run asks for it by itself ("preempted, requeue me"; a hang)
        (None, 1, False),  # a failure: no requeue
    ],
)
def test_signals_stop_the_ranks_and_the_script_waits_for_them(slurm, tmp_path, sent, standin_exit, requeued):
    standin = tmp_path / "torchrun-standin"
    standin.write_text(_TORCHRUN.format(python=sys.executable))
    standin.chmod(0o755)
    out = tmp_path / "out.txt"
    alone = {} if sent else {"STANDIN_ALONE": "1"}
    job = slurm.start(
        "c.yaml", out=out, TORCHRUN=str(standin), STANDIN_DIR=str(tmp_path), STANDIN_EXIT=str(standin_exit), **alone
    )
    started = tmp_path / "started"
    _wait_for("the stand-in started", started.exists, job, out)
    if sent == "usr1":
        os.kill(job.pid, signal.SIGUSR1)  # --signal=B:USR1@300: to the batch script only
    elif sent == "term":  # SIGTERM to the batch script and to every step
        os.kill(job.pid, signal.SIGTERM)
        for pid in slurm.steps():
            os.kill(pid, signal.SIGTERM)
    assert _finish(job, out, timeout=30) == standin_exit, out.read_text()
    assert (tmp_path / "stopped").read_text() == started.read_text() == str(job.pid)  # the script outlived it
    scancel = [["--signal=TERM", JOB_ID]] if sent == "usr1" else []
    assert slurm.calls("scancel") == scancel
    assert (["requeue", JOB_ID] in slurm.calls("scontrol")) == requeued
    assert ("requeueing job 4242" in out.read_text()) == requeued


def _wait_for(what: str, ready, proc: subprocess.Popen, out: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            pytest.fail(f"{what}: not seen (exit {proc.poll()}):\n{out.read_text()[-3000:]}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end:\n{out.read_text()[-3000:]}")


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run)]


@pytest.mark.distributed
def test_killed_requeued_stopped_requeued_again_equals_one_nproc_run(slurm, tmp_path):
    pkg, data = tmp_path / "pkg", write_text_dataset(tmp_path / "data", [40, 40, 40, 40])
    pkg.mkdir()
    (pkg / "gated.py").write_text(_GATED)
    config = tmp_path / "my configs" / "tiny run.yaml"
    config.parent.mkdir()
    config.write_text(_CONFIG.format(data=json.dumps(str(data))))
    extra = ["--set", "run.seed=3"]
    env = {"PYTHONPATH": str(pkg), "RDZV_PORT": str(free_port())}

    ref = tmp_path / "ref"
    proc = subprocess.run(
        [EXE, "train", str(config), "--nproc", "2", "--run-dir", str(ref), *extra],
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(pkg)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    straight = _losses(ref)
    assert [s for s, _ in straight] == list(range(1, 9))

    run = slurm.cwd / "runs" / "tiny run-4242"
    # attempt 0: the node fails in the first forward (SIGKILL, everything): no checkpoint yet
    gate, out = tmp_path / "gate-0", tmp_path / "out-0.txt"
    gate.mkdir()
    job = slurm.start(str(config), *extra, out=out, GATE_DIR=str(gate), GATE_AT="1", **env)
    reached = [gate / "reached-0", gate / "reached-1"]
    _wait_for("both ranks in their first forward", lambda: all(p.exists() for p in reached), job, out)
    os.killpg(job.pid, signal.SIGKILL)  # the script, srun/torchrun
    for p in reached:  # and the ranks (torchrun starts each in its own session; they die with it, or here)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(p.read_text()), signal.SIGKILL)
    job.wait(timeout=30)
    assert (run / "config.yaml").is_file() and not list((run / "checkpoints").iterdir())

    # attempt 1 (requeued): nothing to resume, so it starts again; the time-limit signal stops it mid-run
    gate, out = tmp_path / "gate-1", tmp_path / "out-1.txt"
    gate.mkdir()
    job = slurm.start(str(config), *extra, restarts=1, out=out, GATE_DIR=str(gate), GATE_AT="5", **env)
    reached = [gate / "reached-0", gate / "reached-1"]
    _wait_for("both ranks at the kill point", lambda: all(p.exists() for p in reached), job, out)
    os.kill(job.pid, signal.SIGUSR1)  # what --signal=B:USR1@300 sends to the batch script
    _wait_for(
        "both ranks told to stop",
        lambda: out.read_text().count("SIGTERM: stopping at the next optimizer step boundary") == 2,
        job,
        out,
    )
    (gate / "go").touch()
    assert _finish(job, out) != 0
    assert slurm.calls("scancel") == [["--signal=TERM", JOB_ID]]  # the steps told to stop, then the job requeued
    assert slurm.calls("scontrol")[-1] == ["requeue", JOB_ID]
    assert slurm.launched()[-6:] == [str(config), "--run-dir", "runs/tiny run-4242", "--auto-resume", *extra]
    assert run.with_name("tiny run-4242.restart-1").is_dir()  # attempt 0's files, kept aside
    stopped_at = [int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir()]
    assert len(stopped_at) == 1 and 3 <= stopped_at[0] < 8, stopped_at  # the stop wrote it, past the kill point

    # attempt 2 (requeued again): resumes the same run directory and finishes it
    out = tmp_path / "out-2.txt"
    job = slurm.start(str(config), *extra, restarts=2, out=out, **env)
    assert _finish(job, out) == 0, out.read_text()[-3000:]
    launched = slurm.launched()
    assert launched[:-6] == _torchrun_argv(1, f"localhost:{env['RDZV_PORT']}")
    assert launched[-6:] == [str(config), "--run-dir", "runs/tiny run-4242", "--auto-resume", *extra]
    assert len(slurm.calls("scontrol")) == 3 + 1  # a lookup per attempt and the one requeue
    resumes = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumes] == stopped_at
    assert _losses(run) == straight  # the same world size and accumulation: bit for bit
