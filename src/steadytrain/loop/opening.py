"""Opening the run directory of a user's own loop: claimed new, or resumed, with the records every command reads.

Rank 0 does the file work; every decision that could differ by rank (the directory exists, it is not a run of
:class:`~steadytrain.loop.run.Run`, it is held by another process) is agreed over all ranks, so every rank raises the
same one-line error instead of some waiting forever in a later collective.

What a new run gets: ``config.yaml`` (the loop's own config mapping, recorded as given), ``plan.json`` (the batch
factors known so far: the micro-batch size joins at the first step), ``loop.json`` (what wrote the run and whether a
command can rebuild its model), and ``env.json`` (written by the trainer's own writer, a collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from steadytrain._io import load_json, present
from steadytrain._mapping import flatten
from steadytrain._version import __version__
from steadytrain._yamlio import load_yaml
from steadytrain.errors import UserError
from steadytrain.loop.checks import check_config_mapping
from steadytrain.rundir.layout import RunDir, claim_run_dir, lock_run, open_run_dir, record_owner
from steadytrain.rundir.origin import read_origin, write_origin
from steadytrain.train.checkpoint.catalog import check_latest, latest_checkpoint
from steadytrain.train.job.files import truncate_logs
from steadytrain.train.setup.distributed import DistInfo, agree, from_main

__all__ = ["Opened", "Origin", "check_config_mapping", "open_run"]


@dataclass(frozen=True)
class Origin:
    """What ``loop.json`` records: how a command could rebuild the run's model and data (None: it cannot)."""

    model_factory: str | None
    dataset: str | None
    shard_size: int


@dataclass
class Opened:
    """The directory a Run writes: its paths, rank 0's lock, the checkpoint to resume from (None: fresh), what
    the loop's config changed in a resumed run's (``{key: [saved, new]}``), and (rank 0 of a resume) the writing of
    its records, called once the checkpoint is restored: a resume refused before then changes no byte of the run."""

    run: RunDir
    lock: FileLock | None
    checkpoint: Path | None
    changes: dict[str, list[Any]]
    records: Callable[[], None] | None = None


def open_run(
    path: Path, info: DistInfo, *, config: dict[str, Any], resume: bool, origin: Origin, plan: dict[str, Any]
) -> Opened:
    """Claim ``path`` (``resume=False``), or open it to resume (``resume=True``: the latest complete checkpoint, or a
    fresh start when it has none); on rank 0 the lock is held until :meth:`Run.close`. A collective."""
    error, lock, ckpt, changes, records = None, None, None, {}, None
    if info.is_main:
        try:
            lock, ckpt, changes, records = _open_main(path, config=config, resume=resume, origin=origin, plan=plan)
        except UserError as err:
            error = str(err)
            if lock is not None:
                lock.release()
    agree(info, error, "to open the run directory")
    found = from_main(info, 1 if ckpt is not None else 0)  # only rank 0 listed the checkpoints
    name = from_main(info, int(ckpt.name.split("-")[-1]) if ckpt is not None else -1)
    run = RunDir(path)
    checkpoint = run.checkpoints / f"step-{name:08d}" if found else None
    return Opened(run, lock, checkpoint, changes, records)


def _open_main(
    path: Path, *, config: dict[str, Any], resume: bool, origin: Origin, plan: dict[str, Any]
) -> tuple[FileLock, Path | None, dict[str, list[Any]], Callable[[], None] | None]:
    """Rank 0's part of :func:`open_run`: the directory claimed, or checked and locked (a resume's records to write
    once its checkpoint is restored)."""
    if resume and path.exists():
        run = open_run_dir(path)
        saved_origin = _saved_origin(run)
        lock = lock_run(run, record=False)
        try:
            check_latest(run.checkpoints)
            ckpt = latest_checkpoint(run.checkpoints)
            saved = load_yaml(run.config, what="run config") or {}
            changes = _changes(saved if isinstance(saved, dict) else {}, config)
            kept = _resumed_origin(run, origin, saved_origin)
        except BaseException:
            lock.release()
            raise

        def records() -> None:
            record_owner(run)
            if ckpt is None:  # a fresh start: the rows of the steps it trains again go
                _start_over(run)
            _write_records(run, config=config, origin=kept, plan=plan, fresh=ckpt is None)

        return lock, ckpt, changes, records
    try:
        run = claim_run_dir(path)
    except UserError as err:
        if "exists" in str(err) and "being written" not in str(err):
            raise UserError(
                f"run directory {path} exists: open it with Run(..., resume=True) to continue it, or give another "
                "directory (a run is never overwritten)"
            ) from None
        raise
    lock = lock_run(run)
    _write_records(run, config=config, origin=origin, plan=plan, fresh=True)
    return lock, None, {}, None


def _saved_origin(run: RunDir) -> dict[str, Any]:
    """The ``loop.json`` of the run a Run resumes; a directory without one is refused (nothing written)."""
    saved = read_origin(run.path)
    if saved is not None:
        return saved
    if any(p.exists() for p in (run.checkpoints, run.metrics, run.env)):
        raise UserError(
            f"{run.path}: a run of `steadytrain train`, not of steadytrain.Run: resume it with "
            f"steadytrain train --resume {run.path}, or give Run another directory"
        )
    raise UserError(
        f"{run.path}: not a run directory of steadytrain.Run (no loop.json): give Run a new directory or one it wrote"
    )


def _resumed_origin(run: RunDir, origin: Origin, saved: dict[str, Any]) -> Origin:
    """What the resumed run's ``loop.json`` records: the saved model factory and dataset unless given anew; the
    shard size must be the saved one (the run's shard ids, in ``exposure.json`` and the ledgers, are counted in it)."""
    if origin.shard_size != saved["shard_size"]:
        raise UserError(
            f"Run(shard_size={origin.shard_size}): {run.path} counts its examples in shards of {saved['shard_size']} "
            f"(loop.json): give shard_size={saved['shard_size']} to resume it"
        )
    factory, dataset = origin.model_factory or saved["model_factory"], origin.dataset or saved["dataset"]
    return Origin(factory, dataset, origin.shard_size)


def _start_over(run: RunDir) -> None:
    """A resume without a complete checkpoint trains from step 1 again: the rows and counts of the steps trained
    before are cut (each step's row appears once), as a resume from a checkpoint cuts those past it."""
    truncate_logs(run, 0, rollbacks=0)
    for name in (run.exposure, run.path / "nonfinite_report.json"):
        name.unlink(missing_ok=True)


def _write_records(run: RunDir, *, config: dict[str, Any], origin: Origin, plan: dict[str, Any], fresh: bool) -> None:
    """``config.yaml``, ``plan.json`` (a fresh start, or a resume that changes it) and ``loop.json``."""
    run.write_config(config)
    saved = load_json(run.plan, what="batch plan") if present(run.plan) and not fresh else {}
    run.write_json(run.plan, {**plan, **{k: v for k, v in (saved or {}).items() if k not in plan}})
    write_origin(
        run.path, model_factory=origin.model_factory, dataset=origin.dataset, shard_size=origin.shard_size,
        version=__version__,
    )  # fmt: skip


def _changes(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """What the loop's config changes in the saved one, by flat key."""
    a, b = flatten(saved), flatten(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
