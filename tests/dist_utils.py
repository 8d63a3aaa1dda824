"""Spawn real ``torch.distributed`` ranks on gloo (CPU) inside pytest.

Workers are module-level functions ``fn(rank, world_size, out_dir, *args)``; each rank writes what
it measured with :func:`save` and the test reads it back with :func:`load_all`.

:func:`cli_on_ranks` runs several ``steadytrain`` commands on the same spawned ranks, one after another, each rank
calling ``main(argv)`` with the environment torchrun gives a rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...):
what ``steadytrain train --nproc 2`` runs in each rank, with one start-up (imports) per rank for all the commands
instead of a torchrun launch per command.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from steadytrain.train.setup.distributed import quiesce


def _entry(rank: int, fn, world_size: int, tmp: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, Path(tmp), *args)
        # No rank tears down its connections while a peer still finishes the last collective.
        dist.barrier()
        quiesce(world_size)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, tmp_path: Path, *args) -> None:
    """Run ``fn`` on ``world_size`` gloo ranks; an exception on any rank fails the test."""
    mp.spawn(_entry, args=(fn, world_size, str(tmp_path), args), nprocs=world_size, join=True)


def _entry_all(rank: int, world_size: int, tmp: Path, jobs: dict[str, tuple]) -> None:
    for name, (fn, *args) in jobs.items():
        (tmp / name).mkdir(exist_ok=True)
        fn(rank, world_size, tmp / name, *args)
        dist.barrier()  # each job starts on every rank together, as its own spawn would


def spawn_all(tmp_path: Path, jobs: dict[str, tuple], world_size: int = 2) -> dict[str, Path]:
    """Several workers on the same ``world_size`` gloo ranks, one after another: ``jobs`` maps a name to
    ``(fn, *args)``; each runs as ``fn(rank, world_size, tmp_path / name, *args)``. One start-up (imports, process
    group) for all of them instead of one spawn each; returns each job's output folder for :func:`load_all`."""
    spawn(_entry_all, world_size, tmp_path, jobs)
    return {name: tmp_path / name for name in jobs}


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, outside the kernel's ephemeral range.

    A port the kernel hands out (``bind`` to port 0) goes back to the pool for every outgoing connection: the gloo
    pairs of the ranks a parallel test worker runs take ports from it all the time, so a rendezvous port picked that
    way may be taken by the time its command starts (EADDRINUSE). Below the range only explicit binds land; a random
    one checked free collides with another worker's pick only if both choose the same one of ~12,000 ports at once.
    """
    low, _ = _ephemeral_range()
    start = 20000 if low > 21000 else 1024
    span = max(low - start, 1000)
    rng = random.Random()  # not the tests' seeded generators: two workers must not draw the same ports
    for _ in range(200):
        port = start + rng.randrange(span)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every draw taken: the kernel's pick, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_entry(
    rank: int, world_size: int, tmp: str, commands: list[list[str]], ports: list[int], env: dict, forked: bool = False
) -> None:
    from tests.cli_utils import in_process

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if forked:  # a fork of the test process: start from what a new process holds, not what the tests left
        import numpy as np
        import torch._dynamo as dynamo

        dynamo.reset()  # nothing compiled yet
        torch.seed()  # each rank's own unseeded streams
        random.seed()
        np.random.seed()
    for i, (argv, port) in enumerate(zip(commands, ports, strict=True)):
        if callable(argv):  # a step between two commands (e.g. a checkpoint removed): rank 0 takes it, all wait
            marker = Path(tmp) / f"cli-{i}.done"
            if rank == 0:
                argv()
                marker.touch()
            while not marker.exists():
                time.sleep(0.01)
            continue
        rank_env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"cli-{i}", **env,
        }  # fmt: skip
        done = in_process(*argv, **rank_env)
        out = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        (Path(tmp) / f"cli-{i}-rank{rank}.json").write_text(json.dumps(out))


def cli_on_ranks(
    tmp_path: Path, commands: list[list[str]], world_size: int = 2, *, start_method: str = "spawn", **env: str
) -> list[list[subprocess.CompletedProcess]]:
    """Run each of ``commands`` (``steadytrain`` argv lists) on the same ``world_size`` spawned ranks, in order;
    ``result[i][rank]`` is command ``i``'s exit code, stdout and stderr on that rank (None for a step). ``env`` is
    set for every command (as ``torchrun`` passes its environment on). A command may be a picklable callable
    (``functools.partial`` of a module-level function): a step between commands that rank 0 takes while the others
    wait, such as removing a run's last checkpoint before a resume.

    ``start_method="fork"``: each rank is a fork of this process (as :mod:`tests.loop.forked` runs a loop), which
    has imported torch and steadytrain already: a new interpreter's imports (seconds per rank, 4 ranks sharing 2
    cores) are saved where the fresh interpreter is not what the test is about. The rank starts with Dynamo's
    caches empty and random streams of its own, as a new process does; what the ranks run is the same."""
    out = tmp_path / "cli-ranks"
    out.mkdir(parents=True, exist_ok=True)
    commands = [argv if callable(argv) else [str(a) for a in argv] for argv in commands]
    ports = [free_port() for _ in commands]
    forked = start_method == "fork"
    if forked:
        gc.freeze()  # a fork's collector leaves what this process holds alone: no pauses over it, no copies of it
    try:
        args = (world_size, str(out), commands, ports, env, forked)
        mp.start_processes(_cli_entry, args=args, nprocs=world_size, join=True, start_method=start_method)
    finally:
        if forked:
            gc.unfreeze()
    results = []
    for i, argv in enumerate(commands):
        if callable(argv):
            results.append(None)
            continue
        ranks = [json.loads((out / f"cli-{i}-rank{r}.json").read_text()) for r in range(world_size)]
        results.append([subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"]) for r in ranks])
    return results


def save(out_dir: Path, rank: int, obj) -> None:
    torch.save(obj, out_dir / f"rank{rank}.pt")


def load_all(out_dir: Path, world_size: int) -> list:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _train_entry(rank: int, world_size: int, tmp: str, runs: list[tuple[str, str]], ports: list[int]) -> None:
    import traceback

    from steadytrain.train.job.loop import train
    from steadytrain.train.setup.config import load_config
    from tests.cli_utils import isolated

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    for i, ((config, run_dir), port) in enumerate(zip(runs, ports, strict=True)):
        rank_env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"train-{i}",
        }  # fmt: skip
        error = None
        with isolated(rank_env):
            try:
                train(load_config(config), run_dir=Path(run_dir))
            except Exception:
                error = traceback.format_exc()
        (Path(tmp) / f"train-{i}-rank{rank}.json").write_text(json.dumps({"error": error}))


def train_on_ranks(tmp_path: Path, runs: list[tuple[Path, Path]], world_size: int = 2) -> list[list[str | None]]:
    """Train each ``(config, run_dir)`` of ``runs`` on the same ``world_size`` spawned ranks, in order, each rank
    calling :func:`steadytrain.train.job.loop.train` with the environment torchrun gives a rank: the job that
    ``steadytrain train CONFIG --run-dir RUN_DIR`` runs on each rank, without the command's report at its end
    (plots and the full ``summary.md``, which rank 0 draws while the other ranks wait), for tests that read the
    run's own records. ``result[i][rank]``: None, or the traceback run ``i`` raised on that rank."""
    out = tmp_path / "train-ranks"
    out.mkdir(parents=True, exist_ok=True)
    runs = [(str(config), str(run_dir)) for config, run_dir in runs]
    ports = [free_port() for _ in runs]
    mp.spawn(_train_entry, args=(world_size, str(out), runs, ports), nprocs=world_size, join=True)
    return [
        [json.loads((out / f"train-{i}-rank{r}.json").read_text())["error"] for r in range(world_size)]
        for i in range(len(runs))
    ]
