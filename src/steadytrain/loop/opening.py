"""Opening the run directory of a user's own loop: claimed new, or resumed, with the records every command reads.

Rank 0 does the file work; every decision that could differ by rank (the directory exists, it is not a run of
:class:`~steadytrain.loop.run.Run`, it is held by another process) is agreed over all ranks, so every rank raises the
same one-line error instead of some waiting forever in a later collective.

What a new run gets: ``config.yaml`` (the loop's own config mapping, recorded as given), ``plan.json`` (the batch
factors known so far: the micro-batch size joins at the first step), ``loop.json`` (what wrote the run and whether a
command can rebuild its model), and ``env.json`` (written by the trainer's own writer, a collective).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from steadytrain._io import load_json, present
from steadytrain._mapping import flatten
from steadytrain._version import __version__
from steadytrain._yamlio import dump_yaml, load_yaml, parse_yaml
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, claim_run_dir, lock_run, open_run_dir, record_owner
from steadytrain.rundir.origin import read_origin, write_origin
from steadytrain.rundir.schema import check_config
from steadytrain.train.checkpoint.catalog import check_latest, latest_checkpoint
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
    """The directory a Run writes: its paths, rank 0's lock, the checkpoint to resume from (None: fresh) and what
    the loop's config changed in a resumed run's (``{key: [saved, new]}``)."""

    run: RunDir
    lock: FileLock | None
    checkpoint: Path | None
    changes: dict[str, list[Any]]


def check_config_mapping(config: Any) -> dict[str, Any]:
    """The loop's ``config`` as ``config.yaml`` will hold it: a mapping of names to YAML data (numbers finite),
    whose keys named like a steadytrain section hold mappings (the readers of ``config.yaml`` take them so)."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise UserError(f"Run(config={type(config).__name__}): give a mapping (a dict of your run's settings) or None")
    data = dict(config)
    try:
        text = dump_yaml(data)
    except Exception as err:  # a value YAML cannot write (an object, a tensor, a set)
        raise UserError(
            f"Run(config=...): {type(err).__name__}: {err}; give plain values (numbers, strings, lists, dicts)"
        ) from None
    if parse_yaml(text, source="Run(config=...)", what="Run(config=...)") != data:
        raise UserError("Run(config=...): a value does not read back as written (give plain numbers, strings, lists)")
    for key, value in flatten(data).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"Run(config=...): {key}={value} is not a finite number: record it as a string")
    return check_config(data, "Run(config=...)")


def open_run(
    path: Path, info: DistInfo, *, config: dict[str, Any], resume: bool, origin: Origin, plan: dict[str, Any]
) -> Opened:
    """Claim ``path`` (``resume=False``), or open it to resume (``resume=True``: the latest complete checkpoint, or a
    fresh start when it has none); on rank 0 the lock is held until :meth:`Run.close`. A collective."""
    error, lock, ckpt, changes = None, None, None, {}
    if info.is_main:
        try:
            lock, ckpt, changes = _open_main(path, config=config, resume=resume, origin=origin, plan=plan)
        except UserError as err:
            error = str(err)
            if lock is not None:
                lock.release()
    agree(info, error, "to open the run directory")
    found = from_main(info, 1 if ckpt is not None else 0)  # only rank 0 listed the checkpoints
    name = from_main(info, int(ckpt.name.split("-")[-1]) if ckpt is not None else -1)
    run = RunDir(path)
    checkpoint = run.checkpoints / f"step-{name:08d}" if found else None
    return Opened(run, lock, checkpoint, changes)


def _open_main(
    path: Path, *, config: dict[str, Any], resume: bool, origin: Origin, plan: dict[str, Any]
) -> tuple[FileLock, Path | None, dict[str, list[Any]]]:
    """Rank 0's part of :func:`open_run`: the directory claimed or checked, locked, its records written."""
    if resume and path.exists():
        run = open_run_dir(path)
        if read_origin(run.path) is None:
            raise UserError(
                f"{path}: a run of `steadytrain train`, not of steadytrain.Run: resume it with "
                f"steadytrain train --resume {path}, or give Run another directory"
            )
        lock = lock_run(run, record=False)
        try:
            check_latest(run.checkpoints)
            ckpt = latest_checkpoint(run.checkpoints)
            saved = load_yaml(run.config, what="run config") or {}
            changes = _changes(saved if isinstance(saved, dict) else {}, config)
            record_owner(run)
            _write_records(run, config=config, origin=origin, plan=plan, fresh=ckpt is None)
        except BaseException:
            lock.release()
            raise
        return lock, ckpt, changes
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
    return lock, None, {}


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
