"""What a running training job holds, and how it ends when it does not finish.

One plain object the loop (:mod:`steadytrain.train.job.loop`) and the run files it writes
(:mod:`steadytrain.train.job.files`) share, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from filelock import FileLock

from steadytrain.accumulate import GradientAccumulator
from steadytrain.data import ShardedDataset
from steadytrain.data.sourcemap import SourceMap
from steadytrain.rundir.layout import RunDir
from steadytrain.train.checkpoint.writer import CheckpointWriter
from steadytrain.train.job.evaluate import Validation
from steadytrain.train.job.spikes import SpikeGuard
from steadytrain.train.job.state import TrainState
from steadytrain.train.job.stop import StopRequest
from steadytrain.train.observe.callbacks import Callbacks
from steadytrain.train.observe.metrics import MetricsLog
from steadytrain.train.observe.timeline import AttemptClock
from steadytrain.train.observe.watchdog import Beat, Watchdog
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.holdout import HeldOut
from steadytrain.train.setup.pieces import RunPlan
from steadytrain.train.setup.speed import CompiledModel

__all__ = ["Interrupted", "Job", "StepScratch", "TrainingStopped"]


class TrainingStopped(RuntimeError):
    """The run failed: it stopped before its last step (too many consecutive non-finite steps), or no
    step applied an update; its checkpoint and short summary are written."""

    exit_code = 1
    run_dir: str | None = None
    """The run directory (the command writes its report after the job)."""
    reason: str | None = None
    """Why it stopped, for the report (the message adds how to resume)."""


class Interrupted(TrainingStopped):
    """SIGINT/SIGTERM stopped the run at a step boundary; a checkpoint is written, ``--resume`` continues."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class StepScratch:
    """What the loop carries between micro-batches and steps, apart from the :class:`Job` it runs."""

    lr: float = 0.0
    """The LR of the step in progress (the first param group's), for its metrics row."""
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """The sum of the open cycle's micro-batch losses (a device tensor: no host read)."""
    micros: int = 0
    """Micro-batches of the open cycle so far (the step loss is their mean)."""
    ended: str | None = None
    """Why a run that succeeded ends before its last planned step (early stopping); None while it goes on."""


@dataclass
class Job:
    """Everything a running job holds, built once and fully by :func:`steadytrain.train.job.loop.train` before its
    first step. Optional fields are optional by nature (no validation set, no fp16 scaler, no compile, no step
    limit, no lock on ranks other than 0), never filled in later."""

    cfg: TrainConfig
    info: DistInfo
    plan: RunPlan
    run: RunDir
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    acc: GradientAccumulator
    ds: ShardedDataset
    scaler: torch.amp.GradScaler | None
    loader: Iterable[dict[str, Any]]
    """``ds``'s micro-batches as the loop reads them (in background workers with ``data.num_workers``)."""
    state: TrainState
    """The step, epoch, counters and the stateful parts a checkpoint saves."""
    writer: CheckpointWriter
    spikes: SpikeGuard
    metrics: MetricsLog
    stop: StopRequest
    held_out: HeldOut
    """What the run holds out of its data for validation."""
    hyper: list[dict[str, Any]]
    """Every param group's settings as this config built them: a restore (resume or rollback) puts them back."""
    validation: Validation | None = None
    lock: FileLock | None = None
    """Rank 0's hold on the run directory (released when the job ends)."""
    changes: dict[str, list[Any]] = field(default_factory=dict)
    """What a resume changed in the saved config (``{key: [saved, new]}``)."""
    compiled: CompiledModel | None = None
    """What ``model.compile`` compiled, or None."""
    stop_after: int | None = None
    """Stop after this many optimizer steps, the schedule unchanged (``repro`` re-runs a run's first steps)."""
    step: StepScratch = field(default_factory=StepScratch)
    """The loop's scratch between micro-batches and steps."""
    beat: Beat = field(default_factory=Beat)
    """Where the loop is (step, phase), for the hang watchdog: attribute writes only."""
    watchdog: Watchdog | None = None
    """The hang watchdog's thread (``distributed.watchdog_s``), or None."""
    hosts: list[str | None] | None = None
    """Every rank's hostname, on rank 0 (from the environment gather at start); None on other ranks."""
    sources: SourceMap | None = None
    """A mixture's sources (``data.sources``), as ``sources.json`` holds them; None: one dataset."""
    callbacks: Callbacks | None = None
    """``run.callbacks``, loaded before the first step (None: none)."""
    view: Any = None
    """The job as its callbacks see it (:class:`~steadytrain.train.job.hooks.JobRun`)."""
    clock: AttemptClock | None = None
    """This attempt's account of its time (``timeline.jsonl``), on rank 0; None on other ranks."""

    @property
    def compile_s(self) -> float | None:
        """Seconds the compile took (the compiled modules' first calls; None: not compiled or fell back)."""
        c = self.compiled
        return None if c is None or c.eager else round(c.seconds, 1)
