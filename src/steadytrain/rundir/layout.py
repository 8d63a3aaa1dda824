"""The run directory: what a run leaves behind, and the rule that one is never overwritten.

``runs/<name>/`` holds ``config.yaml`` (resolved), ``plan.json`` (the batch plan's numbers),
``env.json`` (rank 0's manifest; ``env.ranks.json`` when ranks differ), ``data.json`` (the data's
fingerprint and provenance), ``metrics.jsonl`` (one line
per optimizer step), ``nonfinite.jsonl`` (one line per rank per refused step), ``exposure.json``
(examples seen per shard), ``checkpoints/``, ``plots/`` and ``summary.md``; ``resumes.jsonl`` and
``restarts.jsonl`` (one line per resume, per automatic restart), ``hangs/`` (what the hang watchdog found) and
``layers.jsonl`` (one line per layer per monitored step: gradient, weight and update norms).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from steadytrain._io import brief, ensure_dir, read_text, utc_now, write_text_atomic
from steadytrain._yamlio import dump_yaml
from steadytrain.errors import UserError

__all__ = [
    "RunDir",
    "claim_run_dir",
    "exists_error",
    "held_error",
    "lock_run",
    "open_run_dir",
    "record_owner",
    "running_by",
]


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    config = property(lambda self: self.path / "config.yaml")
    plan = property(lambda self: self.path / "plan.json")
    env = property(lambda self: self.path / "env.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    nonfinite = property(lambda self: self.path / "nonfinite.jsonl")
    spikes = property(lambda self: self.path / "spikes.jsonl")
    layers = property(lambda self: self.path / "layers.jsonl")
    exposure = property(lambda self: self.path / "exposure.json")
    data = property(lambda self: self.path / "data.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    summary = property(lambda self: self.path / "summary.md")
    resumes = property(lambda self: self.path / "resumes.jsonl")
    restarts = property(lambda self: self.path / "restarts.jsonl")
    hangs = property(lambda self: self.path / "hangs")
    lock = property(lambda self: self.path / ".lock")

    def write_json(self, path: Path, data: Any) -> None:
        write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")

    def write_config(self, config: dict[str, Any]) -> None:
        write_text_atomic(self.config, dump_yaml(config))


def exists_error(path: Path) -> UserError:
    """The error for a run directory that exists already (never overwritten)."""
    return UserError(
        f"run directory {path} exists: resume it with --resume {path}, or choose another run.name or --run-dir"
    )


def claim_run_dir(path: Path) -> RunDir:
    """Create a new run directory; an existing one is never overwritten (one ``mkdir`` decides, also
    between two processes started at once)."""
    ensure_dir(path.parent, f"run directory {brief(str(path))}: its parent")
    try:
        path.mkdir()
    except FileExistsError:
        raise held_error(path) or exists_error(path) from None
    except NotADirectoryError:
        raise UserError(f"run directory {path}: a parent is a file, not a directory") from None
    except OSError as err:  # a name too long, a read-only or full disk
        raise UserError(f"run directory {brief(str(path))}: cannot be created ({err.strerror or err})") from None
    run = RunDir(path)
    try:
        run.checkpoints.mkdir()
    except OSError as err:  # another process's --auto-resume removed it as empty, between the two mkdirs
        raise UserError(
            f"run directory {brief(str(path))}: changed by another process as it was created "
            f"({err.strerror or err}): run the command again"
        ) from None
    return run


def open_run_dir(path: Path) -> RunDir:
    """An existing run directory (for resume, report, compare); a UserError if it is not one."""
    run = RunDir(Path(path))
    if not run.path.is_dir():
        raise UserError(f"{path}: no such run directory")
    if not run.config.is_file():
        raise UserError(f"{path}: not a steadytrain run directory (no config.yaml)")
    return run


def _owner(run: RunDir) -> str:
    try:
        return read_text(run.path / ".lock.owner", what="lock owner", max_bytes=4096).strip() or "another process"
    except UserError:
        return "another process"


def _busy(run: RunDir) -> UserError:
    return UserError(
        f"{run.path}: the run is being written by {_owner(run)}: wait for it to finish (or stop it) "
        "before resuming it again"
    )


def running_by(path: Path) -> str | None:
    """Who holds the run at ``path`` now (its lock): ``pid N on HOST since T``; None when no process does. Creates
    nothing (a directory without a ``.lock`` is held by no one)."""
    run = RunDir(Path(path))
    if not run.lock.is_file():
        return None
    lock = FileLock(run.lock, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return _owner(run)
    except OSError:  # unreadable: the caller's own error says what it found
        return None
    lock.release()
    return None


def held_error(path: Path) -> UserError | None:
    """The refusal a second writer gets when another process holds the run at ``path`` (its lock), else None."""
    return None if running_by(path) is None else _busy(RunDir(Path(path)))


def lock_run(run: RunDir, *, record: bool = True) -> FileLock:
    """Hold ``run`` for this process: a second writer (two resumes at once) gets one clear error.

    The lock is an ``flock`` on ``RUN/.lock``, which the kernel releases when its process dies, so a
    kill -9 never leaves a stale lock behind; ``RUN/.lock.owner`` says who holds it (``record=False``: not
    yet; a resume records it with :func:`record_owner` once its checks pass, so a refused resume changes
    no byte of the run). Release it with ``.release()`` when the run is done.
    """
    lock = FileLock(run.lock, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise _busy(run) from None
    except OSError as err:
        raise UserError(f"{run.path}: cannot lock the run directory ({err.strerror or err})") from None
    if record:
        record_owner(run)
    return lock


def record_owner(run: RunDir) -> None:
    """``RUN/.lock.owner``: this process, for the message a second writer gets."""
    owner = f"pid {os.getpid()} on {socket.gethostname()} since {utc_now()}"
    write_text_atomic(run.path / ".lock.owner", owner + "\n")
