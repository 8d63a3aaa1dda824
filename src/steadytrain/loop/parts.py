"""What an open :class:`~steadytrain.loop.run.Run` holds: the trainer's writers, built for a loop of your own.

:func:`build_parts` makes them once the directory is open (every rank, in the same order: the checkpoint writer and
the watchdog may hold collectives), restores a checkpoint when resuming, and cuts the logs at it. :func:`close_parts`
ends them. Each writer is the one ``steadytrain train`` uses (:class:`MetricsLog`, :class:`SpikeGuard`,
:class:`LayerMonitor`, :class:`CheckpointWriter`, :func:`restore_checkpoint`, the watchdog, the trackers, the report).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from steadytrain._io import brief
from steadytrain._mapping import flatten
from steadytrain._text import error_text
from steadytrain.errors import UserError
from steadytrain.loop.checks import check_ids
from steadytrain.loop.opening import Opened, Origin
from steadytrain.loop.settings import RunSettings
from steadytrain.rundir.layout import RunDir
from steadytrain.train.checkpoint.writer import CheckpointFailed, CheckpointWriter
from steadytrain.train.job.files import record_environment, truncate_logs
from steadytrain.train.job.records import record_nonfinite, write_exposure, write_nonfinite_report
from steadytrain.train.job.restore import Restorable, restore_checkpoint
from steadytrain.train.job.resume import record_resume
from steadytrain.train.job.spikes import SpikeGuard
from steadytrain.train.job.state import TrainState
from steadytrain.train.observe.callbacks import Callbacks, load_callbacks
from steadytrain.train.observe.layers import LayerMonitor
from steadytrain.train.observe.metrics import MetricsLog, Progress
from steadytrain.train.observe.timeline import AttemptClock, start_clock
from steadytrain.train.observe.trackers import end_run, open_trackers
from steadytrain.train.observe.watchdog import Beat, Watchdog, start_watchdog
from steadytrain.train.setup.distributed import DistInfo


class Run(Protocol):
    """What the writers here read of an open :class:`~steadytrain.loop.run.Run` (named here, so that module and
    this one do not import each other)."""

    settings: RunSettings
    config: dict[str, Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    accumulator: Any
    step: int
    _loss: torch.Tensor | None
    _micros: int


__all__ = ["LoopParts", "build_parts", "close_parts", "fill_tags", "run_info", "tag_of"]

log = logging.getLogger("steadytrain.loop")


@dataclass
class LoopParts:
    """The writers and state of one open Run."""

    info: DistInfo
    run: RunDir
    origin: Origin
    lock: Any
    state: TrainState
    spikes: SpikeGuard
    metrics: MetricsLog
    writer: CheckpointWriter
    beat: Beat
    watchdog: Watchdog | None
    callbacks: Callbacks
    clock: AttemptClock | None = None
    """This attempt's account of its time (``timeline.jsonl``), on rank 0."""
    plan_pending: bool = True
    """``plan.json`` does not have the micro-batch size yet (written at the first step's end)."""
    micro: int | None = None
    """The first micro-batch's number of examples (from its ids), for ``plan.json``."""

    def close_step(self, run: Run, step: int, event: Any, *, spike: bool = False) -> None:
        """Optimizer step ``step`` ended, in the Run's loop or a framework's (:mod:`.external`): the counters, the
        heartbeat, a refused step's ledger line and ``exposure.json`` (a collective: every rank refuses the same
        steps; a spike's record is the spike guard's), ``plan.json`` once."""
        run.step = self.state.step = step
        self.beat.stepped(step)
        if event is not None and not spike:
            self.state.consecutive_skips += 1
            record_nonfinite(self.run, self.info, step, event)
            write_exposure(self.run, self.info, self.state, None)
        elif event is None:
            self.state.consecutive_skips = 0
        if self.plan_pending:
            self.write_plan(run)

    def write_plan(self, run: Run) -> None:
        """Rank 0: ``plan.json`` with the batch factors the first step showed (micro-batch size from its ids)."""
        self.plan_pending = False
        micro = self.micro
        if not self.info.is_main or not micro:
            return
        from steadytrain._io import load_json

        plan = load_json(self.run.plan, what="batch plan") if self.run.plan.is_file() else {}
        k, w = run.accumulator.accumulation_steps, self.info.world_size
        plan |= {"micro_batch_size": micro, "accumulation_steps": k, "world_size": w}
        plan["global_batch_size"] = micro * k * w
        self.run.write_json(self.run.plan, plan)
        self.metrics.items_per_step = micro * k * w


def run_info(model: torch.nn.Module) -> DistInfo:
    """Where this process sits: the process group the loop made (torchrun's), or a single process."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo(0, 1, 0, device, None)
    from torch.distributed.fsdp import FSDPModule

    kind = "fsdp" if isinstance(model, FSDPModule) else "ddp"
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, device, dist.get_backend(), kind)


def tag_of(ids: Any, tag: Any, shard_size: int) -> dict[str, Any] | None:
    """The micro-batch's tag: shards and indices from example ``ids`` (or the caller's ``tag``); None without."""
    if ids is not None and tag is not None:
        raise UserError("run.micro_batch(ids, tag=...): give the example ids or a tag, not both")
    if tag is not None:
        if not isinstance(tag, dict) or not {"shard", "index"} <= tag.keys():
            raise UserError("run.micro_batch(tag=...): give a dict with 'shard' and 'index' (one per example)")
        shard, index = check_ids("tag['shard']", tag["shard"]), check_ids("tag['index']", tag["index"])
        if shard.shape != index.shape:
            raise UserError(f"run.micro_batch(tag=...): {len(shard)} shard ids for {len(index)} indices")
        losses = tag.get("losses")
        if losses is not None and not (isinstance(losses, torch.Tensor) and losses.shape == index.shape):
            raise UserError(
                f"run.micro_batch(tag={{'losses': {brief(losses)}}}): give a 1-D tensor of one loss per index, or "
                "leave it out (mb.backward(losses) records them)"
            )
        return {**tag, "shard": shard, "index": index, "losses": losses}
    if ids is None:
        return None
    # shard and index are filled at the step's end, for all its micro-batches at once (fill_tags): no torch op here
    return {"ids": check_ids("run.micro_batch(ids)", ids), "shard": None, "index": None, "losses": None}


def fill_tags(tags: list[dict[str, Any]], shard_size: int) -> None:
    """The shards and indices of micro-batches given by ids (:func:`tag_of`), for the steps whose tags are read (a
    refused step's record, a spike's): two ops for the whole step, none for the others."""
    given = [t for t in tags if t.get("ids") is not None and t.get("shard") is None]
    if not given:
        return
    sizes = [len(t["ids"]) for t in given]
    ids = torch.cat([t["ids"] for t in given])
    shard, index = ids // shard_size, ids % shard_size
    for t, s, i in zip(given, shard.split(sizes), index.split(sizes), strict=True):
        t["shard"], t["index"] = s, i


def build_parts(run: Run, info: DistInfo, opened: Opened) -> LoopParts:
    """Every writer of the open run (a collective: every rank, in this order), a checkpoint restored."""
    from steadytrain.env import capture

    s, rd = run.settings, opened.run
    beat = Beat()  # the attempt's clock, in its "start" phase until the first micro-batch
    spikes = SpikeGuard(s.spike_config(), info, rd.spikes)
    state = TrainState(
        run.scheduler, run.accumulator, s.sampler, spikes=spikes, extra=dict(s.state), complete=False,
        shard_size=s.shard_size,
    )  # fmt: skip
    writer = CheckpointWriter(rd.checkpoints, info, use_async=s.async_checkpoint, keep_last=s.keep_last)
    writer.guard(run.optimizer)
    record_environment(info, rd, capture(), resume=opened.checkpoint is not None)  # a gather: every rank
    if opened.checkpoint is not None:
        beat.enter("restore")
        _restore(run, info, rd, opened, state)
        beat.enter("start")
    elif opened.records is not None:  # a resume without a checkpoint: a fresh start
        opened.records()
    if spikes.decides:  # the flag is read with the gradient norm, in the step's one host read
        run.accumulator.veto = lambda norm: spikes.veto(run.step + 1, run._loss / max(run._micros, 1), norm)
    metrics = _metrics(run, info, rd, state, spikes)
    beat.step = state.step
    parts = LoopParts(info, rd, Origin(s.model_factory, s.dataset, s.shard_size), opened.lock, state, spikes,
                      metrics, writer, beat, None, load_callbacks(s.callbacks, "Run(callbacks)"))  # fmt: skip
    parts.watchdog = start_watchdog(s.watchdog_s, info, rd.path, beat)
    if info.is_main:  # the attempt's account (timeline.jsonl): this Run's startup is the script's, to here
        parts.clock = start_clock(rd.path, beat, metrics, parts.watchdog, step=state.step,
                                  resumed=opened.checkpoint is not None, world_size=info.world_size)  # fmt: skip
    return parts


def _restore(run: Run, info: DistInfo, rd: RunDir, opened: Opened, state: TrainState) -> None:
    """The checkpoint into the model, optimizer and every part (the trainer's restore path); the logs cut at it."""
    seed = _Seed(run.settings.seed)
    parts = Restorable(run.model, run.optimizer, run.scheduler, state, None, info, seed)  # type: ignore[arg-type]
    restore_checkpoint(parts, opened.checkpoint)
    if info.is_main:
        if opened.records is not None:  # the checkpoint fits: the run's records may change now
            opened.records()
        truncate_logs(rd, state.step, rollbacks=0)
        record_resume(rd, step=state.step, world_size=info.world_size, checkpoint=opened.checkpoint.name,
                      changes=opened.changes)  # fmt: skip
        log.info("resumed %s at step %d from %s", rd.path, state.step, opened.checkpoint.name)


@dataclass(frozen=True)
class _Seed:
    """What a restore on another world size derives the random streams from."""

    seed: int
    deterministic: bool = False


def _metrics(run: Run, info: DistInfo, rd: RunDir, state: TrainState, spikes: SpikeGuard) -> MetricsLog:
    s = run.settings
    layers = None
    if s.layers:
        layers = LayerMonitor(run.model, "auto", s.layers_every or s.log_every, lambda: state.step + 1)
        run.accumulator.observer = layers
    total = s.total_steps or 0
    trackers = open_trackers(rd, list(s.trackers), info, config=flatten(run.config), step=state.step,
                             mlflow_uri=s.mlflow_uri)  # fmt: skip
    return MetricsLog(
        rd, info, items_per_step=0, max_grad_norm=run.accumulator.max_grad_norm, total_steps=total,
        elapsed_before=state.elapsed_before, progress=Progress(total, state.step) if info.is_main and total else None,
        spikes=spikes if spikes.collects else None, layers=layers, trackers=trackers,
    )  # fmt: skip


def close_parts(run: Run, p: LoopParts, failed: BaseException | None) -> None:
    """End the run (see :meth:`Run.close`)."""
    clean = failed is None
    stopped = None if clean else f"{type(failed).__name__}: {error_text(failed, 200)}"
    try:
        if p.watchdog is not None:
            p.watchdog.stop()
        if clean or p.info.backend is None:  # the collectives only when every rank gets here
            p.metrics.flush()
            write_exposure(p.run, p.info, p.state, None)
        with contextlib.suppress(CheckpointFailed):
            p.writer.wait() if clean else None
        p.writer.close()
        if p.metrics.progress is not None:
            p.metrics.progress.close()
    finally:
        if p.lock is not None:
            p.lock.release()
    if p.clock is not None:  # the attempt's last line, before the report reads the account
        p.clock.end("finished" if clean else "failed", p.state.step)
    if p.info.is_main:
        _nonfinite_report(p)
        report = _report if run.settings.report else None
        end_run(p.metrics.trackers, p.run, (stopped, "FINISHED" if clean else "FAILED"), report)


def _nonfinite_report(p: LoopParts) -> None:
    """``nonfinite_report.json``, as the trainer writes it (a damaged ledger is said, not raised: the run is over)."""
    try:
        write_nonfinite_report(p.run)
    except UserError as err:
        log.warning("%s: no non-finite report: %s", p.run.path, err)


def _report(run_dir: str, stopped: str | None) -> None:
    from steadytrain.runs.report import report

    report(run_dir, stopped=stopped)
