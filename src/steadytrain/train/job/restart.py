"""``--auto-resume``: the command a torchrun restart, a Slurm requeue and a person retrying all run.

It resumes the run directory from its latest complete checkpoint when there is one (with every check and record
of ``--resume``), and otherwise starts the run there: a directory an earlier attempt left without a checkpoint
(killed before its first save) is kept beside it as ``RUN.restart-N``, never overwritten or deleted; a directory
that is not a steadytrain run (no ``plan.json`` or ``metrics.jsonl``, and more than a new run's bare
``checkpoints/``: a folder of the user's own) is refused and left where it is, as is one that holds the current
directory (it cannot be moved aside from under it), and one another process holds (its lock: a run being written
is never moved from under it). Rank 0 decides, every rank gets its decision (one broadcast).
A run that had already finished is resumed, and the resume's checks end it: nothing to train (exit 0).

Every automatic resume appends ``{"step", "world_size_before", "world_size_after", "reason", "lost_s"}`` to
``RUN/restarts.jsonl``: ``lost_s`` is the training time since the checkpoint resumed from (redone now) plus the
time from the previous attempt's last metrics row to this restart; ``reason`` names a hang the watchdog recorded
after that checkpoint, else the change of world size, else the restart.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

from steadytrain._io import append_jsonl, brief, load_json, present, rewrite_jsonl
from steadytrain._text import one_line, short
from steadytrain.errors import UserError
from steadytrain.rundir.hangs import HANG_FILE, ranks_text, read_hang, read_restarts
from steadytrain.rundir.layout import RunDir, exists_error, held_error, lock_run
from steadytrain.rundir.schema import read_metrics
from steadytrain.train.checkpoint.catalog import latest_checkpoint
from steadytrain.train.setup.distributed import DistInfo, agree, from_main

__all__ = ["auto_resume", "record_restart"]

log = logging.getLogger("steadytrain.train")

RUN_FILES = ("plan.json", "metrics.jsonl")
"""Files only a steadytrain run holds: a directory with one of them (or a fresh run's bare ``checkpoints/``) is one."""
_FRESH = {"checkpoints", ".lock", ".lock.owner", "config.yaml"}
"""What a run directory holds between its claim and its ``plan.json``: a run killed then is still a run."""
_SAVE = re.compile(r"\.?step-\d+(\.pt|\.partial)?")
"""A checkpoint's name in ``checkpoints/``, complete or not (``.step-N.partial``: a save under way)."""


def auto_resume(info: DistInfo, run_dir: Path) -> Path | None:
    """The run to resume (``run_dir``, made absolute), or None to start it fresh (every rank the same answer)."""
    error, resume = None, 0
    path = Path(os.path.abspath(run_dir))  # "." and ".." have no name to keep a run aside under
    if info.is_main:
        try:
            resume = int(_decide(path))
        except UserError as err:
            error = str(err)
    agree(info, error, "with --auto-resume")
    return path if from_main(info, resume) else None


def _decide(path: Path) -> bool:
    if not path.exists() and not path.is_symlink():
        return False
    if not path.is_dir():
        raise UserError(f"--auto-resume {brief(str(path))}: not a directory; give a run directory with --run-dir")
    if latest_checkpoint(path / "checkpoints") is not None:
        if not (path / "config.yaml").is_file():
            raise UserError(f"--auto-resume {brief(str(path))}: not a steadytrain run directory (no config.yaml)")
        return True
    names = {p.name for p in path.iterdir()}
    if names and not _is_run(path, names):
        raise UserError(
            f"--auto-resume {brief(str(path))}: not a steadytrain run directory (no {' or '.join(RUN_FILES)}, and "
            "more than a new run's checkpoints/), so it is left as it is: give another --run-dir"
        )
    _not_in_use(path)
    if not names:
        try:
            path.rmdir()  # an empty directory: nothing to keep; the run claims it anew
        except OSError:  # another process claimed it meanwhile
            raise held_error(path) or exists_error(path) from None
        return False
    lock = lock_run(RunDir(path), record=False)  # a run another process is writing is never moved from under it
    try:
        aside = _aside(path)
        path.rename(aside)
    finally:
        lock.release()
    log.warning("--auto-resume: %s has no checkpoint to resume; kept it as %s and starting again", path, aside.name)
    return False


def _is_run(path: Path, names: set[str]) -> bool:
    """Whether ``path`` (holding ``names``) is a run: a run file, or only what a run holds right after its claim."""
    if any((path / name).is_file() for name in RUN_FILES):
        return True
    ckpts = path / "checkpoints"
    if not names <= _FRESH or not ckpts.is_dir() or ckpts.is_symlink():
        return False
    return all(_SAVE.fullmatch(p.name) for p in ckpts.iterdir())  # nothing, or a first save killed under way


def _not_in_use(path: Path) -> None:
    """A run without a checkpoint starts anew where it is: refuse when that directory holds the working directory."""
    try:
        here, there = Path.cwd().resolve(), path.resolve()
    except OSError:  # the working directory was deleted: it is in no run directory
        return
    if here == there or there in here.parents:
        raise UserError(
            f"--auto-resume {brief(str(path))}: the run has no checkpoint, so it starts anew in a directory of its "
            "own (this one moved aside, or created again), but this one holds the current directory: run the "
            f"command from outside it (cd {shlex.quote(str(path.parent))}; --run-dir {shlex.quote(path.name)})"
        )


def _aside(path: Path) -> Path:
    n = 1
    while (aside := path.with_name(f"{path.name}.restart-{n}")).exists() or aside.is_symlink():
        n += 1
    return aside


def record_restart(run: RunDir, *, step: int, elapsed_s: float, world_size: int) -> dict[str, Any] | None:
    """Rank 0, before the resume cuts the logs: append this restart to ``restarts.jsonl`` (see the module). A run
    that had reached its planned last step was not interrupted: continuing it is a resume, not a restart (None)."""
    plan = load_json(run.plan, what="batch plan") if present(run.plan) else {}
    plan = plan if isinstance(plan, dict) else {}
    if isinstance(plan.get("total_steps"), int) and step >= plan["total_steps"]:
        return None
    before = plan.get("world_size") if isinstance(plan.get("world_size"), int) else None
    rows = read_metrics(run.metrics)[0]  # checked: an elapsed_s is a number or null
    last = max((r["elapsed_s"] for r in rows if r.get("elapsed_s") is not None), default=elapsed_s)
    idle = time.time() - run.metrics.stat().st_mtime if run.metrics.exists() else 0.0
    record = {
        "step": step,
        "world_size_before": before,
        "world_size_after": world_size,
        "reason": _reason(run, step, before, world_size),
        "lost_s": round(max(0.0, float(last) - elapsed_s) + max(0.0, idle), 3),
    }
    read_restarts(run.restarts)  # a damaged line is said (file and line), never buried under a new one
    rewrite_jsonl(run.restarts, lambda _: True, what="restart record")  # a torn last line would swallow this one
    append_jsonl(run.restarts, record)
    log.info("restart at step %d: %s (lost %.1f s)", step, one_line(record["reason"]), record["lost_s"])
    return record


def _reason(run: RunDir, step: int, before: int | None, after: int) -> str:
    hangs = sorted(run.hangs.glob(f"step-*/{HANG_FILE}")) if run.hangs.is_dir() else []
    for path in reversed(hangs):
        try:
            hang = read_hang(path)
        except UserError as err:  # the restart goes on: the hang's stacks are still there to read
            log.warning("--auto-resume: %s", one_line(err))
            continue
        if hang["step"] > step and path.stat().st_mtime >= _last_restart(run):  # a hang of the attempt that ended
            ranks = ranks_text(hang["stuck_ranks"])
            return f"hang at step {hang['step']}: rank(s) {ranks} stuck in {short(hang['phase'])}"
    if before is not None and after < before:
        return f"world size {before} -> {after}: rank(s) lost"
    if before is not None and after > before:
        return f"world size {before} -> {after}: rank(s) joined"
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"restart {count} of the ranks" if count and count != "0" else "the run was started again"


def _last_restart(run: RunDir) -> float:
    return run.restarts.stat().st_mtime if run.restarts.exists() else 0.0
