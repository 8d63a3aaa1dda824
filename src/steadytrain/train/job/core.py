"""What a running training job holds, and how it ends when it does not finish.

One plain object the loop (:mod:`steadytrain.train.job.loop`) and the run files it writes
(:mod:`steadytrain.train.job.files`) share, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from steadytrain.rundir.layout import RunDir
from steadytrain.train.checkpoint.writer import CheckpointWriter
from steadytrain.train.job.evaluate import Validation
from steadytrain.train.job.spikes import SpikeGuard
from steadytrain.train.job.state import TrainState
from steadytrain.train.job.stop import StopRequest
from steadytrain.train.observe.metrics import MetricsLog
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.pieces import RunPlan

__all__ = ["Interrupted", "Job", "TrainingStopped"]


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
class Job:
    """Everything a running job holds."""

    cfg: TrainConfig
    info: DistInfo
    plan: RunPlan
    run: RunDir
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    acc: Any
    ds: Any
    scaler: Any
    metrics: MetricsLog | None = None
    lr: float = 0.0
    step_loss: Any = None
    loader: Any = None
    """``ds``'s micro-batches as the loop reads them (in background workers with ``data.num_workers``)."""
    stop_after: int | None = None
    """Stop after this many optimizer steps, the schedule unchanged (``repro`` re-runs a run's first steps)."""
    lock: Any = None
    """Rank 0's hold on the run directory (released when the job ends)."""
    changes: dict[str, list[Any]] = field(default_factory=dict)
    """What a resume changed in the saved config (``{key: [saved, new]}``)."""
    stop: StopRequest | None = None
    validation: Validation | None = None
    state: TrainState | None = None
    """The step, epoch, counters and the stateful parts a checkpoint saves."""
    writer: CheckpointWriter | None = None
    spikes: SpikeGuard | None = None
    step_micros: int = 0
    """Micro-batches of the open cycle so far (the step loss is their mean)."""
    ended: str | None = None
    """Why a run that succeeded ended before its last planned step (early stopping)."""
    compiled: Any = None
    """What ``model.compile`` compiled (a :class:`~steadytrain.train.setup.speed.CompiledModel`), or None."""
    held_out: Any = None
    """What the run holds out of its data for validation (a :class:`~steadytrain.train.setup.holdout.HeldOut`)."""

    @property
    def compile_s(self) -> float | None:
        """Seconds the compile took (the compiled modules' first calls; None: not compiled or fell back)."""
        c = self.compiled
        return None if c is None or c.eager else round(c.seconds, 1)
