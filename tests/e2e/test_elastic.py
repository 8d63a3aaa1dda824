"""Elastic world size under torchrun's own agents: a node lost mid-run, a node that joins, no example lost.

Two torchrun agents on 127.0.0.1 (``--nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d``), each running
``steadytrain train CFG --run-dir RUN --auto-resume``, as docs/training.md says. The oracle is an uninterrupted run
of the same config in one process: the interrupted run must hold every step once, see the same examples
(``exposure.json``) and reach the same losses (float tolerance: the world size changes the order of the sums).
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

from tests.dist_utils import free_port
from tests.train_utils import bigram_module, metrics, train, write_text_dataset

pytestmark = pytest.mark.distributed

_MODEL = bigram_module(
    doc="""A bigram LM. On rank 1, forward number GATE_AT writes GATE_DIR/reached (its pid) and waits there for ever
    (a node about to be lost); with SLOW_S every forward of a rank alone sleeps that long (a run long enough for a node
    to join; once it has, the job runs at full speed).""",
    hook="""
    gate = os.environ.get("GATE_DIR")
    if gate and os.environ.get("RANK") == "1" and self.calls == int(os.environ["GATE_AT"]):
        Path(gate, "reached").write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)
    if os.environ.get("SLOW_S") and os.environ.get("WORLD_SIZE") == "1":
        time.sleep(float(os.environ["SLOW_S"]))
    """,
)

_CONFIG = """\
model:
  name: gated:factory
data:
  path: {data}
  seq_len: 32
batch:
  micro_batch_size: 4
  global_batch_size: 16
  base_batch_size: 16
run:
  max_steps: 8
  log_every: 1
checkpoint:
  every_steps: 2
"""
"""8 steps of a global batch of 16: accumulation 2 on 2 ranks, 4 on 1; a checkpoint every 2 steps."""


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("elastic")
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "gated.py").write_text(_MODEL)
    data = write_text_dataset(root / "data", [40, 40, 40, 40])
    config = root / "run.yaml"
    config.write_text(_CONFIG.format(data=json.dumps(str(data))))
    ref = root / "ref"
    train(ref, args=(str(config),), PYTHONPATH=str(pkg))  # the uninterrupted run, one process
    return {"pkg": pkg, "config": config, "ref": ref}


_RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
"""The c10d rendezvous' own settings, shortened for one machine: a round closes 1 s after its last join (30 s by
default), and a node whose agent sent no heartbeat for 3 s (15 s by default: 5 s apart, 3 missed) is dead, so the
survivor's next round does not wait 15 s for the killed node to expire."""


def _agent(job: dict, run: Path, port: int, out: Path, **env: str) -> subprocess.Popen:
    """One torchrun agent of the elastic job (the exact line of docs/training.md, on this machine)."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test", "--max-restarts=3",
        f"--rdzv-conf={_RDZV_CONF}", "-m", "steadytrain", "train", str(job["config"]), "--run-dir", str(run),
        "--auto-resume",
    ]  # fmt: skip
    full = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    full |= {"PYTHONPATH": str(job["pkg"]), **env}
    return subprocess.Popen(argv, stdout=out.open("w"), stderr=subprocess.STDOUT, env=full, start_new_session=True)


def _wait(what: str, ready, procs: list[subprocess.Popen], outs: list[Path], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            _kill(procs)
            logs = "\n".join(o.read_text()[-2000:] for o in outs)
            pytest.fail(f"{what}: not seen:\n{logs}")
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def _finish(proc: subprocess.Popen, out: Path, others: list[subprocess.Popen], timeout: float = 180) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill([proc, *others])
        pytest.fail(f"the job did not end:\n{out.read_text()[-3000:]}")


def _same_run(run: Path, ref: Path) -> None:
    """Every step once, the same examples, the same losses as the uninterrupted run."""
    got, want = metrics(run), metrics(ref)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert json.loads((run / "exposure.json").read_text()) == json.loads((ref / "exposure.json").read_text())
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-6), (g["step"], g["loss"], w["loss"])


def test_a_node_killed_mid_run_the_survivor_finishes_alone_with_every_step_once(job, tmp_path):
    run, port, gate = tmp_path / "run", free_port(), tmp_path / "gate"
    gate.mkdir()
    outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    gated = {"GATE_DIR": str(gate), "GATE_AT": "11"}  # rank 1's first forward of step 6: checkpoint 4 is written
    a = _agent(job, run, port, outs[0], **gated)  # it hosts the rendezvous (started first)
    time.sleep(1)
    b = _agent(job, run, port, outs[1], **gated)
    _wait("rank 1 at its kill point", lambda: (gate / "reached").exists(), [a, b], outs)
    rank1 = int((gate / "reached").read_text())
    os.killpg(b.pid, signal.SIGKILL)  # the agent and everything it started: a node lost
    with contextlib.suppress(ProcessLookupError):
        os.kill(rank1, signal.SIGKILL)
    b.wait(timeout=30)
    assert _finish(a, outs[0], [b]) == 0, outs[0].read_text()[-3000:]

    _same_run(run, job["ref"])
    (restart,) = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    # the latest complete checkpoint: step 4's, or step 2's when the asynchronous save of step 4 was still
    # being written at the kill (a busy machine); either way every step after it is trained again
    assert restart["step"] in (2, 4) and (restart["world_size_before"], restart["world_size_after"]) == (2, 1)
    assert "lost" in restart["reason"] and restart["lost_s"] > 0
    (resume,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert resume["world_size"] == 1 and resume["changes"] == {}
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["accumulation_steps"], plan["global_batch_size"]) == (1, 4, 16)
    assert "restarted 1 time(s)" in (run / "summary.md").read_text()


def test_a_node_that_joins_grows_the_job_back_to_two(job, tmp_path):
    run, port = tmp_path / "run", free_port()
    outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    slow = {"SLOW_S": "0.3"}  # 1.2 s a step on one rank: time for the second agent to join
    a = _agent(job, run, port, outs[0], **slow)
    _wait("the first checkpoint", lambda: (run / "checkpoints" / "step-00000002").is_dir(), [a], outs[:1])
    b = _agent(job, run, port, outs[1], **slow)
    assert _finish(a, outs[0], [b]) == 0, outs[0].read_text()[-3000:]
    assert _finish(b, outs[1], [a]) == 0, outs[1].read_text()[-3000:]

    _same_run(run, job["ref"])
    (restart,) = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert (restart["world_size_before"], restart["world_size_after"]) == (1, 2)
    assert "joined" in restart["reason"] and 2 <= restart["step"] < 8
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["accumulation_steps"]) == (2, 2)
