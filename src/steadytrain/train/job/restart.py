"""``--auto-resume``: the command a torchrun restart, a Slurm requeue and a person retrying all run.

It resumes the run directory from its latest complete checkpoint when there is one (with every check and record
of ``--resume``), and otherwise starts the run there: a directory an earlier attempt left without a checkpoint
(killed before its first save) is kept beside it as ``RUN.restart-N``, never overwritten or deleted; a directory
that is not a steadytrain run is refused. Rank 0 decides, every rank gets its decision (one broadcast).

Every automatic resume appends ``{"step", "world_size_before", "world_size_after", "reason", "lost_s"}`` to
``RUN/restarts.jsonl``: ``lost_s`` is the training time since the checkpoint resumed from (redone now) plus the
time from the previous attempt's last metrics row to this restart; ``reason`` names a hang the watchdog recorded
after that checkpoint, else the change of world size, else the restart.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from steadytrain._io import append_jsonl, brief, load_json, read_jsonl
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir
from steadytrain.train.checkpoint.catalog import latest_checkpoint
from steadytrain.train.setup.distributed import DistInfo, agree, from_main

__all__ = ["auto_resume", "record_restart"]

log = logging.getLogger("steadytrain.train")

_STARTED = {"checkpoints", ".lock", ".lock.owner", "plan.json", "data.json", "config.yaml", "env.json"}
"""What a run directory holds before its first step: an attempt killed then left nothing worth resuming."""


def auto_resume(info: DistInfo, run_dir: Path) -> Path | None:
    """The run to resume (``run_dir``), or None to start it fresh (every rank the same answer)."""
    error, resume = None, 0
    if info.is_main:
        try:
            resume = int(_decide(Path(run_dir)))
        except UserError as err:
            error = str(err)
    agree(info, error, "with --auto-resume")
    return Path(run_dir) if from_main(info, resume) else None


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
    if not names:
        path.rmdir()  # an empty directory: nothing to keep; the run claims it anew
        return False
    if not (path / "config.yaml").is_file() and not names <= _STARTED:
        raise UserError(
            f"--auto-resume {brief(str(path))}: not a steadytrain run directory (no config.yaml): "
            "give another --run-dir"
        )
    aside = _aside(path)
    path.rename(aside)
    log.warning("--auto-resume: %s has no checkpoint to resume; kept it as %s and starting again", path, aside.name)
    return False


def _aside(path: Path) -> Path:
    n = 1
    while (aside := path.with_name(f"{path.name}.restart-{n}")).exists() or aside.is_symlink():
        n += 1
    return aside


def record_restart(run: RunDir, *, step: int, elapsed_s: float, world_size: int) -> dict[str, Any] | None:
    """Rank 0, before the resume cuts the logs: append this restart to ``restarts.jsonl`` (see the module). A run
    that had reached its planned last step was not interrupted: continuing it is a resume, not a restart (None)."""
    plan = load_json(run.plan, what="batch plan") if run.plan.exists() else {}
    if isinstance(plan.get("total_steps"), int) and step >= plan["total_steps"]:
        return None
    before = plan.get("world_size") if isinstance(plan.get("world_size"), int) else None
    rows = [r for _, r in read_jsonl(run.metrics, what="metrics.jsonl")] if run.metrics.exists() else []
    last = max((r.get("elapsed_s", 0.0) for r in rows if isinstance(r, dict) and "step" in r), default=elapsed_s)
    idle = time.time() - run.metrics.stat().st_mtime if run.metrics.exists() else 0.0
    record = {
        "step": step,
        "world_size_before": before,
        "world_size_after": world_size,
        "reason": _reason(run, step, before, world_size),
        "lost_s": round(max(0.0, float(last) - elapsed_s) + max(0.0, idle), 3),
    }
    append_jsonl(run.restarts, record)
    log.info("restart at step %d: %s (lost %.1f s)", step, record["reason"], record["lost_s"])
    return record


def _reason(run: RunDir, step: int, before: int | None, after: int) -> str:
    hangs = sorted(run.hangs.glob("step-*/hang.json")) if run.hangs.is_dir() else []
    for path in reversed(hangs):
        try:
            hang = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        after = isinstance(hang, dict) and isinstance(hang.get("step"), int) and hang["step"] > step
        if after and path.stat().st_mtime >= _last_restart(run):  # a hang of the attempt that ended
            ranks = ", ".join(str(r) for r in hang.get("stuck_ranks", []))
            return f"hang at step {hang['step']}: rank(s) {ranks} stuck in {hang.get('phase')}"
    if before is not None and after < before:
        return f"world size {before} -> {after}: rank(s) lost"
    if before is not None and after > before:
        return f"world size {before} -> {after}: rank(s) joined"
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"restart {count} of the ranks" if count and count != "0" else "the run was started again"


def _last_restart(run: RunDir) -> float:
    return run.restarts.stat().st_mtime if run.restarts.exists() else 0.0
