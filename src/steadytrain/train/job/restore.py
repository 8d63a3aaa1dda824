"""Going back to a checkpoint inside a running job: the one restore path (:func:`restore_checkpoint`, used by a
resume and by a spike's rollback), the rollback itself, and the random streams of a restore.

``rollback`` (``spike.policy: rollback``) is the loop's recovery from a loss spike at step ``S``:
every rank restores the newest checkpoint ``C <= S - spike.skip_batches`` (kept by retention for this:
:func:`keep_for_rollback`), the run's logs go back to ``C`` (rank 0), a metrics row records
``{"step": S, "rollback_to": C, "skipped_batches": [...]}``, and training continues from ``C`` passing
over the global batches of the ``skip_batches`` steps that ended at the spike. The spike window, the
rollbacks so far and the skipped batches are carried over the restore (the checkpoint's are older).
``spike.max_rollbacks`` rollbacks done, the next spike stops the run (it ends like any failed run).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from steadytrain._io import append_jsonl
from steadytrain.train.checkpoint.catalog import is_legacy, list_checkpoints, restore, state_file
from steadytrain.train.checkpoint.files import read_rng, set_rng_state
from steadytrain.train.checkpoint.writer import CheckpointFailed, checkpoint_name
from steadytrain.train.job import files as runfiles
from steadytrain.train.job.resume import apply_hyperparameters
from steadytrain.train.job.state import TrainState
from steadytrain.train.setup.distributed import DistInfo, barrier, from_main

if TYPE_CHECKING:
    from steadytrain.accumulate import NonFiniteEvent
    from steadytrain.train.job.core import Job
    from steadytrain.train.setup.config import RunConfig

__all__ = [
    "ROLLED_BACK",
    "Restorable",
    "fresh_optimizer_state",
    "keep_for_rollback",
    "restorable",
    "restore_checkpoint",
    "restore_rng",
    "rollback",
]

log = logging.getLogger("steadytrain.train")

ROLLED_BACK = "rolled back"
"""What :func:`rollback` returns when the job continues from an earlier checkpoint (the loop restarts its data)."""


def keep_for_rollback(job: Job) -> set[int]:
    """Checkpoints retention keeps whatever ``checkpoint.keep_last`` says: those rollbacks went back to (the
    weights a spike's hunt replays), and every one a later spike could roll back to: from the newest at or before
    ``step + 1 - spike.skip_batches`` (the target of a spike at the next step) on, or all of them when none is
    that old yet (a later spike's target moves forward as the run does)."""
    keep = set(job.spikes.restored)
    if job.cfg.spike.policy != "rollback":
        return keep
    found = [s for s, _ in list_checkpoints(job.run.checkpoints)]
    bound = job.state.step + 1 - job.cfg.spike.skip_batches
    older = [s for s in found if s <= bound]
    return keep | {s for s in found if not older or s >= older[-1]}


def fresh_optimizer_state(optimizer: torch.optim.Optimizer, step: int) -> None:
    """A state restored from step 0 starts with no optimizer state, as the run did: saving the optimizer before its
    first step makes ``torch.distributed.checkpoint`` create its state with a step of its own (AdamW's step count
    would be one ahead, its bias correction shifted for the whole run)."""
    if step == 0:
        optimizer.state.clear()


@dataclass(frozen=True)
class Restorable:
    """The parts of a job a restore writes into (a resume builds them before its :class:`Job` exists)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: TrainState
    hyper: list[dict[str, Any]] | None
    """Every param group's settings as this config built them (see :func:`~.resume.hyperparameters`); None: the
    checkpoint's own settings stay (an own loop's optimizer and scheduler, restored as they were saved)."""
    info: DistInfo
    run_cfg: RunConfig


def restore_checkpoint(parts: Restorable, path: Path) -> dict[str, Any]:
    """The one way a job goes back to a checkpoint, for a resume and a spike's rollback alike: each rank its shards
    of the model and optimizer (an optimizer state from step 0 dropped, see :func:`fresh_optimizer_state`), the train
    state (counters, scheduler, accumulator, data position, validation, spike window), this config's
    hyper-parameters from the restored step on (:func:`~steadytrain.train.job.resume.apply_hyperparameters`: a
    resume's new LR is not undone by a later rollback to a checkpoint saved before it), each rank's random streams.
    Returns what the checkpoint held."""
    info = parts.info
    saved = restore(path, parts.model, parts.optimizer, no_dist=info.backend is None)  # each rank its shards
    fresh_optimizer_state(parts.optimizer, saved["step"])
    parts.state.load_state_dict(saved["train"], is_main=info.is_main, where=state_file(path))
    if parts.hyper is not None:
        apply_hyperparameters(parts.optimizer, parts.scheduler, parts.hyper)
    restore_rng(info, parts.state.step, parts.run_cfg, path, saved)
    return saved


def restorable(job: Job) -> Restorable:
    """The parts of a running ``job`` a restore writes into."""
    return Restorable(job.model, job.optimizer, job.acc.scheduler, job.state, job.hyper, job.info, job.cfg.run)


def rollback(job: Job, event: NonFiniteEvent) -> str:
    """Recover from the spike refused at ``job.state.step`` (see the module docstring); :data:`ROLLED_BACK`, or
    why the run stops (the spike is then recorded with ``action: stop``; the caller ends the run)."""
    guard, cfg, step, batch = job.spikes, job.cfg.spike, job.state.step, job.ds.global_step
    batches = (guard.recent[-(cfg.skip_batches - 1) :] if cfg.skip_batches > 1 else []) + [batch]
    job.metrics.flush()
    with contextlib.suppress(CheckpointFailed):  # logged; its files are removed and an older one is the target
        job.writer.wait()  # an in-flight save completes: it may be the one to go back to
    # rank 0 renames the complete checkpoints: its listing decides for every rank
    found = [s for s, _ in list_checkpoints(job.run.checkpoints) if s <= step - cfg.skip_batches]
    target_step = from_main(job.info, found[-1] if found else -1)
    why = None
    if guard.rollbacks >= cfg.max_rollbacks:
        why = f"{guard.rollbacks} rollback(s) already (spike.max_rollbacks={cfg.max_rollbacks})"
    elif step - cfg.skip_batches < 0:
        why = f"spike.skip_batches={cfg.skip_batches} reaches back before the run's start: lower it"
    elif target_step < 0:
        why = f"no checkpoint at or before step {step - cfg.skip_batches} to roll back to"
    if why is not None:
        guard.record(step, event, guard.limits, batch, action="stop")
        return f"loss spike at step {step}: {why}; see {job.run.spikes} and: steadytrain spikes report {job.run.path}"
    target = dict(list_checkpoints(job.run.checkpoints)).get(target_step) or job.run.checkpoints / checkpoint_name(
        target_step
    )
    n = guard.rollbacks + 1
    guard.record(step, event, guard.limits, batch, action="rollback", rollback_to=target_step, rollback=n)
    skipped, restored = list(guard.skipped), [*guard.restored, target_step]
    job.beat.enter("restore")
    restore_checkpoint(restorable(job), target)  # C's window and recent batches; what happened since: set back below
    job.beat.enter("all_reduce")  # the refused step's end, as before the rollback
    if job.clock is not None:
        job.clock.rolled_back(target_step)
    restored = [s for s in restored if s <= target_step]
    guard.rollbacks, guard.skipped, guard.restored = n, skipped, restored  # what happened since C is not undone
    guard.pass_over(batches)
    job.step.ended = None
    if job.info.is_main:
        for s, path in list_checkpoints(job.run.checkpoints):  # states the run has gone back from: never resumed
            if s > target_step:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        runfiles.truncate_logs(job.run, target_step, rollbacks=None)
        row = {"step": step, "rollback_to": target_step, "skipped_batches": batches, "rollback": n}
        append_jsonl(job.run.metrics, row)
        if job.metrics.layers is not None and (kept := job.metrics.layers.rolled_back(step, n)):
            append_jsonl(job.run.layers, *kept)  # what the spike's layers saw, as its metrics row, stays
        log.warning(
            "step %d: rolled back to step %d (rollback %d of at most %d); global batch(es) %s are passed over",
            step,
            target_step,
            n,
            cfg.max_rollbacks,
            batches,
        )
    barrier(job.info)  # the logs are cut before any rank writes past the checkpoint again
    return ROLLED_BACK


def restore_rng(info: DistInfo, step: int, run_cfg: RunConfig, path: Path, saved: dict[str, Any]) -> None:
    """Each rank's generator states as saved; on another world size (or from a single-file checkpoint of an
    earlier version, which kept rank 0's torch CPU state alone) streams derived from the seed, said once."""
    from steadytrain.env import seed_everything

    if is_legacy(path):
        torch.set_rng_state(saved["rng"])
        if info.world_size > 1 and info.is_main:
            log.warning("resume: %s keeps rank 0's torch CPU random state alone: every rank continues it", path.name)
        return
    same = saved["world_size"] == info.world_size
    rng = read_rng(path, info.rank) if same else None
    if rng is not None:
        set_rng_state(rng, str(path / "rng" / f"rank-{info.rank:05d}.json"))
        return
    seed_everything((run_cfg.seed * 1_000_003 + step * 1_009 + info.rank) % 2**63, run_cfg.deterministic)
    if info.is_main or same:
        why = (
            f"the checkpoint holds no random state for rank {info.rank}"
            if same
            else f"the checkpoint was saved on {saved['world_size']} rank(s), this run has {info.world_size}"
        )
        log.warning(
            "resume: %s: random streams are derived anew from run.seed, the step and the rank (random layers do not "
            "continue the saved streams)",
            why,
        )
