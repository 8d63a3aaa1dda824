"""``steadytrain train``: the training job, top to bottom.

build (plan, data, model, optimizer, schedule, accumulator) -> run directory and environment ->
resume -> steps (K micro-batches each, through the accumulator) -> metrics, checkpoints, ledger ->
summary. Every rank runs the same number of steps (the data's global order makes them equal);
rank 0 writes the run directory, every rank appends its own non-finite events.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadytrain._io import write_text_atomic
from steadytrain._mapping import flatten
from steadytrain.accumulate import NonFiniteGradientError
from steadytrain.accumulate.events import SPIKE
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, record_owner
from steadytrain.train.checkpoint.catalog import latest_checkpoint
from steadytrain.train.checkpoint.writer import CheckpointFailed, CheckpointWriter
from steadytrain.train.job import files as runfiles
from steadytrain.train.job import restart
from steadytrain.train.job.build import build_pieces, start_metrics
from steadytrain.train.job.core import Interrupted, Job, TrainingStopped
from steadytrain.train.job.ending import end_job
from steadytrain.train.job.evaluate import Validation, precision_context
from steadytrain.train.job.files import ResumeRecord
from steadytrain.train.job.hooks import JobRun, call
from steadytrain.train.job.parity import check_parity, parity_due
from steadytrain.train.job.ranks import record_rank_times
from steadytrain.train.job.records import record_nonfinite, write_exposure
from steadytrain.train.job.restore import (
    ROLLED_BACK,
    Restorable,
    fresh_optimizer_state,
    keep_for_rollback,
    restore_checkpoint,
    rollback,
)
from steadytrain.train.job.resume import RunFinished, hyperparameters
from steadytrain.train.job.spikes import SpikeGuard
from steadytrain.train.job.state import TrainState
from steadytrain.train.job.stop import StopRequest
from steadytrain.train.job.validate import build_validation, start_validation, validate
from steadytrain.train.observe.callbacks import load_callbacks
from steadytrain.train.observe.profiling import StepProfiler
from steadytrain.train.observe.throughput import for_run
from steadytrain.train.observe.timeline import start_clock
from steadytrain.train.observe.watchdog import Beat, start_watchdog
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo, init_distributed, same_everywhere
from steadytrain.train.setup.models import check_losses
from steadytrain.train.setup.pieces import (
    build_loader,
    data_path,
)

__all__ = ["Interrupted", "TrainingStopped", "train"]

log = logging.getLogger("steadytrain.train")


def train(
    cfg: TrainConfig,
    *,
    run_dir: Path | None = None,
    resume: Path | None = None,
    stop_after: int | None = None,
    report: Callable[[str, str | None], Any] | None = None,
    auto_resume: bool = False,
) -> dict[str, Any]:
    """Run the job ``cfg`` describes (or continue ``resume``); returns the summary's numbers.

    ``stop_after`` ends the run after that many optimizer steps while the LR schedule still spans the
    planned total, so the steps taken are exactly the first steps of the full run. ``report`` is called
    on rank 0 with the run directory and why it stopped (None: it finished) when the run has ended, before
    its experiment trackers close: ``steadytrain train`` draws the plots there, so they reach the trackers.
    ``auto_resume``: resume ``run_dir`` if it has a checkpoint, else start it (:mod:`steadytrain.train.job.restart`).
    """
    info = init_distributed(cfg.distributed.backend)  # the process group: every collective below runs on it
    job, ending = None, None
    with contextlib.ExitStack() as signals:
        try:
            job = _build(cfg, info, _Where(run_dir, resume, stop_after, auto_resume), signals)
            summary = _run(job)
            ending = (summary.get("stopped"), "FINISHED")
            return summary
        except TrainingStopped as err:
            ending = (err.reason, "KILLED" if isinstance(err, Interrupted) else "FAILED")
            raise
        finally:
            end_job(info, job, ending, report)  # the report before the ranks part: see steadytrain.train.job.ending


@dataclass(frozen=True)
class _Where:
    """Where a job writes and how far it goes: a new run directory, or the run it resumes; a step limit."""

    run_dir: Path | None
    resume: Path | None
    stop_after: int | None
    auto_resume: bool = False
    """``--auto-resume``: ``run_dir`` is resumed when it has a checkpoint (a restart, recorded as one)."""


def _build(cfg: TrainConfig, info: DistInfo, where: _Where, signals: contextlib.ExitStack) -> Job:
    """The whole job, before its first step: pieces, run directory, state, writer, a resume restored, metrics."""
    beat = Beat()  # the attempt's clock starts here, in its "start" phase (the watchdog reads it from the first step)
    same_everywhere(info, flatten(cfg.to_dict()))  # before anything is built from it: one gather, at start
    p = build_pieces(cfg, info)
    info = p.info  # with its layout: a mesh's tensor-parallel ranks read the same micro-batches
    manifest = runfiles.check_environment(cfg, info)  # before anything is written: a refusal leaves no run dir
    callbacks = load_callbacks(cfg.run.callbacks or ())  # the user's code imported before any file too
    if where.auto_resume:  # rank 0 looks at the run directory; every rank gets its decision
        path = where.run_dir or Path(cfg.run.dir) / cfg.run.name
        found = restart.auto_resume(info, path)
        where = _Where(None if found else path, found, where.stop_after, True)
    run, lock, changes = runfiles.prepare(
        cfg, info, p.plan, run_dir=where.run_dir, resume=where.resume, data=data_path(cfg), held_out=p.held,
        sources=p.sources, flag="--auto-resume" if where.auto_resume else "--resume",
    )  # fmt: skip
    try:
        for name, text in p.hf_files.items():
            write_text_atomic(run.path / name, text)
        validation = build_validation(cfg, p) if p.evalset else None
        spikes = SpikeGuard(cfg.spike, info, run.spikes, warmup_steps=p.plan.warmup_steps)
        state = TrainState(p.acc.scheduler, p.acc, p.ds, p.scaler, validation, spikes)
        writer = CheckpointWriter(
            run.checkpoints, info, use_async=cfg.checkpoint.async_, keep_last=cfg.checkpoint.keep_last
        )
        writer.guard(p.optimizer)  # an asynchronous save's copy of the state completes before the next update
        hyper = hyperparameters(p.optimizer)  # the config's settings, before a checkpoint's replace them
        # a gather: rank 0 compares every rank's image and host with its own (a differing rank is named at start)
        hosts = runfiles.record_environment(info, run, manifest, resume=where.resume is not None)
        if where.resume is not None:
            parts = Restorable(p.model, p.optimizer, p.acc.scheduler, state, hyper, info, cfg.run)
            beat.enter("restore")
            _resume(parts, run, validation, spikes, ResumeRecord(cfg, p.plan, p.held, changes), where.auto_resume)
            beat.enter("start")
        meter = for_run(
            info.device, info.world_size, p.plan.global_batch_size, p.plan.accumulation_steps,
            precision=cfg.precision, peak=cfg.run.peak_flops, is_main=info.is_main,
        )  # fmt: skip
        loader = meter.on_first(build_loader(cfg, p.ds, info.device), p.model, info.is_main)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    job = Job(
        cfg, info, p.plan, run, p.model, p.optimizer, p.acc, p.ds, p.scaler, loader=loader,
        state=state, writer=writer, spikes=spikes, metrics=start_metrics(cfg, info, p, run, state, spikes, meter),
        stop=signals.enter_context(StopRequest(info)),  # its handlers until the job has ended (end_job)
        held_out=p.held, hyper=hyper, validation=validation, lock=lock, changes=changes, compiled=p.compiled,
        stop_after=where.stop_after, beat=beat, hosts=hosts, sources=p.sources,
    )  # fmt: skip
    beat.step = state.step
    job.watchdog = start_watchdog(cfg.distributed.watchdog_s, info, run.path, job.beat)
    if info.is_main:  # the attempt's account, from its first step on (timeline.jsonl)
        job.clock = start_clock(run.path, beat, job.metrics, job.watchdog, step=state.step, resumed=bool(where.resume),
                                world_size=info.world_size, compiled=job.compiled is not None,
                                stop=job.stop)  # fmt: skip
    job.callbacks, job.view = callbacks, JobRun(job)
    if spikes.decides:  # the flag is read with the gradient norm, in the step's one host read
        p.acc.veto = lambda norm: spikes.veto(job.state.step + 1, job.step.loss / job.step.micros, norm)
    return job


def _resume(
    parts: Restorable, run: RunDir, validation: Validation | None, spikes: SpikeGuard, record: ResumeRecord,
    restarted: bool = False,
) -> None:  # fmt: skip
    path = latest_checkpoint(run.checkpoints)
    if path is None:
        raise UserError(f"{run.path}: no checkpoint to resume from (checkpoints/ is empty)")
    restore_checkpoint(parts, path)  # a new LR or schedule applies from here
    step = parts.state.step
    if validation is not None and (ended := validation.ended(step)):
        raise RunFinished(f"--resume {run.path}: {ended}", f"--auto-resume {run.path}: nothing to train: {ended}")
    if parts.info.is_main:
        record_owner(run)  # the first write of a resume: every check before it changed nothing
        if restarted:  # before the logs are cut: the time lost is read from the rows past the checkpoint
            elapsed, size = parts.state.elapsed_before, parts.info.world_size
            restart.record_restart(run, step=step, elapsed_s=elapsed, world_size=size)
        runfiles.truncate_logs(run, step, rollbacks=spikes.rollbacks)
        runfiles.record_resume(run, record, step=step, world_size=parts.info.world_size, checkpoint=path.name)
        log.info("resumed %s at step %d from %s", run.path, step, path.name)


def _run(job: Job) -> dict[str, Any]:
    job.stop.deadline(job.cfg.run.stop_deadline_s, job.beat, job.run.checkpoints)  # a preemption's, until the end
    profiler = _profiler(job)
    runfiles.log_start(job)
    start_validation(job)
    sp = job.cfg.spike
    if sp.policy != "off" and job.info.is_main and sp.window + job.plan.warmup_steps >= _last_step(job):
        log.info(  # a fact of every short run (sweep trials, tests), not a problem: said once, with the plan
            "spike.window=%d after %d warmup step(s) covers the run's %d steps: no step can be judged a spike",
            sp.window, job.plan.warmup_steps, _last_step(job),
        )  # fmt: skip
    if job.cfg.spike.policy == "rollback" and latest_checkpoint(job.run.checkpoints) is None:
        _checkpoint(job)  # the state a spike before the first periodic checkpoint rolls back to
        job.writer.wait_staged()  # its copy of the optimizer state is taken before that state is dropped
        fresh_optimizer_state(job.optimizer, 0)
    stopped = None
    try:
        stopped = _steps(job, profiler)
    finally:
        profiler.close()
        job.metrics.flush()  # the trackers stay open until the run's report is written (end_run)
        if job.metrics.progress is not None:
            job.metrics.progress.close()
    if job.stop.saved != job.state.step:  # a stop agreed right after this step's save has its checkpoint
        _checkpoint(job)
    try:
        job.writer.wait()  # the run ends when its last checkpoint is complete
    except CheckpointFailed as err:
        stopped = stopped or f"{err}: the run's last state is not saved"
    if stopped == job.step.ended:  # early stopping: a run that ends well
        stopped = None
    if not stopped and job.acc.skipped_steps and job.acc.optimizer_steps == 0:
        stopped = f"no update was applied: every one of the {job.state.step} optimizer steps was non-finite and skipped"
    summary = runfiles.finish(job, stopped or job.step.ended)
    if not stopped:
        return summary
    if job.stop.stopped:
        how = f"checkpoint written at step {job.state.step}; resume with: steadytrain train --resume {job.run.path}"
        if job.stop.preempted:  # the scheduler's requeue runs the same command again: --auto-resume continues
            how = f"exit {job.stop.exit_code}: preempted, requeue me; {how} (or the same command with --auto-resume)"
        err: TrainingStopped = Interrupted(f"{stopped}; {how}", job.stop.exit_code)
    else:
        err = TrainingStopped(stopped)
    err.run_dir, err.reason = str(job.run.path), stopped
    raise err


def _profiler(job: Job) -> StepProfiler:
    """The run's profiler (``run.profile``; a no-op when absent)."""
    prof = job.cfg.run.profile
    return StepProfiler(
        prof and prof.start_step, prof.steps if prof else 0, done=job.state.step, last_step=_last_step(job),
        out=job.run.path / "profile", rank=job.info.rank, device=job.info.device,
    )  # fmt: skip


def _steps(job: Job, profiler: StepProfiler) -> str | None:
    """Optimizer steps until the plan's total; returns why it stopped early, or None."""
    total, resumed = _last_step(job), job.state.step > 0
    while job.state.step < total:
        if not resumed:
            job.ds.set_epoch(job.state.epoch)
        resumed = False
        for mb in job.loader:
            if job.spikes.skipped and job.spikes.skips(job.ds.global_step):
                continue  # a batch a rolled-back spike ended at: never trained on
            try:
                result, loss = _micro_batch(job, mb)
            except NonFiniteGradientError:  # nonfinite.policy=raise: every rank decided the same
                return _raised(job)
            if result is None:
                continue
            reason = _after_step(job, result, loss)
            profiler.step()  # once per optimizer step
            if reason is ROLLED_BACK:
                resumed = True  # the data continues from the checkpoint's position
                break
            if reason or job.state.step >= total:
                return reason
        else:
            job.state.epoch += 1
    return None


def _raised(job: Job) -> str:
    """Record the refused step that ``nonfinite.policy=raise`` stops at; the reason to stop."""
    job.state.step += 1
    event = job.acc.nonfinite_events[-1]
    job.metrics.add(job.state.step, torch.tensor(float("nan")), job.step.lr, event.grad_norm, True)
    record_nonfinite(job.run, job.info, job.state.step, event)
    _exposure(job)  # a collective: every rank raised at this step
    return f"non-finite step {job.state.step} (nonfinite.policy=raise): see {job.run.nonfinite}"


def _micro_batch(job: Job, mb: dict[str, Any]) -> tuple[Any, torch.Tensor]:
    """One forward and backward inside the accumulator; the step's result when it ended a cycle.

    The micro-batch's tag carries its shards and example indices (host tensors, from the data) and,
    when the model returns per-example losses, which of them were non-finite: a device tensor computed
    from this rank's own losses before the backward (so before any all-reduce), read only if the step
    is refused (see :func:`steadytrain.diagnose.ledger.event_record`). No host sync here.
    """
    dev = job.info.device
    if dev.type == "cpu":
        batch = mb  # already where the model is
    else:
        batch = {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
    shard, index = mb["shard"], mb["index"]
    job.state.count(shard)
    autocast = precision_context(dev, job.cfg.precision)
    job.step.lr = job.optimizer.param_groups[0]["lr"]
    tag: dict[str, Any] = {"shard": shard, "index": index, "losses": None}
    if job.spikes.collects:
        job.spikes.tags.append(tag)
    beat = job.beat
    with job.acc.micro_batch(tag=tag) as m:
        beat.enter("forward")
        with autocast:
            out = job.model(batch)
        loss = check_losses(out, len(index)).float().mean()
        if out.dim() == 1:
            tag["losses"] = out.detach()  # per-example; its flags are computed only if the step is refused
        if job.metrics.sources is not None:
            job.metrics.sources.add(out, mb["source"], batch["source"])  # per source: a device op, no host read
        detached = loss.detach()
        if job.spikes.detector is not None:  # a spike's record of a model that returns a scalar loss
            tag["loss"] = detached
        beat.enter("backward")
        m.backward(loss)
        beat.enter("all_reduce")  # the end of a cycle: the gradient sync, the global norm, the update
        # before the with block ends (and the cycle with it): the accumulator's veto judges the step loss
        job.step.loss = detached if m.position == 0 else job.step.loss + detached
        job.step.micros = m.position + 1
    beat.enter("data")
    if m.result is None:
        return None, job.step.loss
    return m.result, job.step.loss / job.step.micros  # the step's mean loss: divided once per step


def _after_step(job: Job, result: Any, loss: torch.Tensor) -> str | None:
    job.state.step += 1
    job.beat.stepped(job.state.step)
    job.beat.enter("all_reduce")  # the metrics' and the stop flag's collectives
    spike = not result.stepped and job.acc.nonfinite_events[-1].reason == SPIKE
    if spike and job.cfg.spike.policy == "rollback":
        outcome = rollback(job, job.acc.nonfinite_events[-1])
        if outcome is not ROLLED_BACK:  # spike.max_rollbacks: the refused step is the run's last
            job.metrics.add(job.state.step, loss, job.step.lr, result.grad_norm, True, True)
        return outcome
    job.spikes.end_step(job.state.step, job.acc, result.grad_norm, job.ds.global_step)
    job.metrics.add(job.state.step, loss, job.step.lr, result.grad_norm, not result.stepped, spike)
    if spike:
        job.spikes.record(
            job.state.step, job.acc.nonfinite_events[-1], job.spikes.limits, job.ds.global_step, action="skip"
        )
    elif result.stepped:
        job.state.consecutive_skips = 0
    else:
        job.state.consecutive_skips += 1
        record_nonfinite(job.run, job.info, job.state.step, job.acc.nonfinite_events[-1])
        # Every rank refused this step, so every rank joins this collective: the ledger's denominator
        # (examples seen per shard) is on disk with each event, and survives a kill.
        _exposure(job)
    cfg = job.cfg
    call(job, "on_step_end")  # before the row is written: the callback's run.log keys join it
    if job.state.step % cfg.run.log_every == 0:
        job.metrics.flush(durable=False)  # an all-reduce on every rank at the same step: the global batch's loss
        record_rank_times(job)  # one small all-gather at the same step: each rank's time per phase (ranks.jsonl)
    # an evaluation due at this step runs before a stop is honoured: a resume starts after this step
    best = (
        validate(job) if job.validation is not None and job.validation.due(job.state.step, _last_step(job)) else False
    )
    if parity_due(job) and (why := check_parity(job)):  # every rank at the same step: one small all-gather
        return why  # on_parity: stop; the checkpoint follows (in _run), of the replicas made equal
    if job.stop.agreed() and not job.step.ended:  # one all-reduce: a signal on any rank stops all at this step
        return f"interrupted by {job.stop.name} at step {job.state.step}"  # the checkpoint follows (in _run)
    if (
        (job.state.step % cfg.checkpoint.every_steps == 0 or best)
        and job.state.step < _last_step(job)
        and not job.step.ended
    ):
        _checkpoint(job)
        if job.stop.after_save(job.state.step):  # a signal during the save: the run ends with it, no further step
            return f"interrupted by {job.stop.name} at step {job.state.step}"
    job.beat.enter("data")
    if job.step.ended:
        return job.step.ended
    if job.state.consecutive_skips >= cfg.nonfinite.max_consecutive_skips:
        return (
            f"{job.state.consecutive_skips} consecutive non-finite steps (nonfinite.max_consecutive_skips="
            f"{cfg.nonfinite.max_consecutive_skips}) at step {job.state.step}: see {job.run.nonfinite}"
        )
    return None


def _exposure(job: Job) -> dict[int, int]:
    """``exposure.json`` (and a mixture's ``sources.json``) now: a collective, every rank calls it."""
    mix = job.sources
    seen = None if mix is None else lambda e: mix.with_exposure(e, job.ds.source_epochs(job.ds.steps_taken))
    return write_exposure(job.run, job.info, job.state, job.ds.shard_ids, seen)


def _last_step(job: Job) -> int:
    """The step the run ends after: the plan's total, or ``stop_after`` (``repro``) when sooner."""
    return min(job.plan.total_steps, job.stop_after or job.plan.total_steps)


def _checkpoint(job: Job) -> None:
    """Save this step (every rank its shards; in the background with ``checkpoint.async``); the step's records
    reach the disk first (a checkpoint is never newer than ``metrics.jsonl``: a kill after it loses no row a
    resume would not write again)."""
    # its time is set aside: the next step's step_s leaves it out (and that row's checkpoint_s holds it); every
    # save is made by _run, after it has started the metrics
    job.beat.enter("checkpoint")  # progress, however long it takes
    with job.metrics.aside("checkpoint"):
        job.metrics.flush()
        exposure = _exposure(job)
        elapsed = job.metrics.elapsed()
        train = functools.partial(job.state.state_dict, elapsed_s=elapsed, exposure=exposure)  # rank 0 calls it
        keep = {job.validation.best_step} if job.validation and job.cfg.checkpoint.keep_best else set()
        keep |= keep_for_rollback(job)
        with contextlib.suppress(CheckpointFailed):  # logged with its step; the previous one stays the latest
            job.writer.save(job.state.step, job.model, job.optimizer, train, frozenset(keep - {None}))
            if job.clock is not None:
                job.clock.saved(job.state.step)
        call(job, "on_checkpoint", job.state.step)  # its time is the checkpoint's, not the next step's
