"""Loss spikes in the training loop: judged alike on every rank, recorded with the examples in play.

:class:`SpikeGuard` holds the :class:`~steadytrain.guard.SpikeDetector` and what a spike's record
needs. How each policy judges a step without a new host read:

- ``warn``: the step runs as usual; at the metrics' logging interval, the interval's all-reduced step
  losses (the tensor the metrics read anyway) go through the detector and the flags are read with
  them (:meth:`judge`). Each rank keeps its steps' micro-batch tags until then.
- ``skip`` and ``rollback``: the decision must come before the update, so the step loss is all-reduced
  (a collective, no host read) and the flag goes to the accumulator's ``veto``, read with the gradient
  norm in the step's one host read. A flagged step is refused like a non-finite one (reason ``spike``).
- ``off``: nothing at all.

Every rank appends its own record of a spike to ``spikes.jsonl`` (:func:`~steadytrain.diagnose.ledger.append_spike`).
The window, the rollbacks so far, the batches skipped and the batches of the last steps are part of
the train state (:meth:`state_dict`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.accumulate.events import SPIKE, NonFiniteEvent
from steadytrain.guard import SpikeDetector, SpikeLimits
from steadytrain.train.setup.config import SpikeConfig
from steadytrain.train.setup.distributed import DistInfo

__all__ = ["SpikeGuard"]

log = logging.getLogger("steadytrain.train")


@dataclass
class _Step:
    """A ``warn`` step awaiting its judgement at the next logging interval."""

    tags: list[dict[str, Any]]
    cycle: int
    micro_steps: tuple[int, int]
    grad_norm: float
    batch: int
    limits: tuple[SpikeLimits, int] | None = None
    """The statistics it was judged by, and its column in them."""


@dataclass
class SpikeGuard:
    """The loop's spike detection and the records of each spike (see the module docstring)."""

    cfg: SpikeConfig
    info: DistInfo
    ledger: Path
    warmup_steps: int = 0
    detector: SpikeDetector | None = None
    tags: list[dict[str, Any]] = field(default_factory=list)
    """The open cycle's micro-batch tags (``warn`` only: the other policies get them from the refusal)."""
    pending: dict[int, _Step] = field(default_factory=dict)
    limits: SpikeLimits | None = None
    """``skip``/``rollback``: the statistics of the step judged last."""
    rollbacks: int = 0
    skipped: list[int] = field(default_factory=list)
    """Global batches never to train on (``rollback``), in the order they were skipped."""
    recent: list[int] = field(default_factory=list)
    """The global batches of the last ``skip_batches`` steps, oldest first."""
    restored: list[int] = field(default_factory=list)
    """The checkpoints (steps) rollbacks went back to: kept by retention (``spikes hunt`` replays from them)."""

    def __post_init__(self) -> None:
        if self.cfg.policy != "off":
            self.detector = SpikeDetector(
                window=self.cfg.window,
                threshold=self.cfg.threshold,
                min_ratio=self.cfg.min_ratio,
                metric=self.cfg.metric,
                warmup_steps=self.warmup_steps,
                device=self.info.device,
            )
        self._skip = set(self.skipped)

    @property
    def decides(self) -> bool:
        """Whether a spike must be known before the update (``skip``, ``rollback``)."""
        return self.cfg.policy in ("skip", "rollback")

    @property
    def collects(self) -> bool:
        """Whether the loop gives each micro-batch's tag to :attr:`tags` (``warn``)."""
        return self.cfg.policy == "warn"

    def skips(self, batch: int) -> bool:
        """Whether the micro-batches of global ``batch`` are passed over (a rolled-back spike's)."""
        return bool(self._skip) and batch in self._skip

    def veto(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """``skip``/``rollback``: optimizer ``step``'s flag from the all-reduced step loss (no host read)."""
        value = loss.detach().float().reshape(1).clone()
        if self.info.backend is not None:
            dist.all_reduce(value)  # every rank judges the same global loss
            value /= self.info.world_size
        refused = ~torch.isfinite(norm) if norm is not None else False  # a non-finite step is not a healthy value
        flag, self.limits = self.detector.update(step, value[0], math.nan if norm is None else norm, refused=refused)
        return flag

    def end_step(self, step: int, acc: Any, grad_norm: float, batch: int) -> None:
        """The step's batch is remembered; ``warn`` keeps its tags for :meth:`judge`."""
        self.recent = ([*self.recent, batch])[-self.cfg.skip_batches :]
        if self.collects:
            n = len(self.tags)
            cycle = acc.optimizer_steps + acc.skipped_steps - 1
            self.pending[step] = _Step(self.tags, cycle, (acc.micro_steps - n, acc.micro_steps - 1), grad_norm, batch)
        self.tags = []

    def judge(self, steps: list[int], losses: torch.Tensor, norms: list[float]) -> torch.Tensor:
        """``warn``: the flags of the interval's steps (device), from their all-reduced losses, judged together on
        the assumption that none is a spike (:meth:`settle` corrects it after the read)."""
        flags, limits = self.detector.judge_interval(steps, losses, norms)
        for i, step in enumerate(steps):
            if step in self.pending:
                self.pending[step].limits = (limits, i)
        self._losses, self._norms = losses, norms
        return flags

    def settle(self, steps: list[int], flags: list[bool], losses: list[float], skipped: list[bool]) -> list[bool]:
        """``warn``, after the read of :meth:`judge`'s flags: the final flags. The steps after the first that did not
        join the window (a spike, a skipped or a non-finite step) are judged again one by one, and their flags
        read (a second read, in such an interval only)."""
        healthy = [not k and math.isfinite(x) for k, x in zip(skipped, losses, strict=True)]
        j = self.detector.settle(flags, healthy)
        if j is None or j + 1 == len(steps):
            return flags
        again = []
        for i in range(j + 1, len(steps)):
            flag, limits = self.detector.update(steps[i], self._losses[i], self._norms[i], refused=skipped[i])
            again.append(flag)
            if steps[i] in self.pending:
                self.pending[steps[i]].limits = (limits, 0)
        return flags[: j + 1] + [bool(f) for f in torch.stack(again).tolist()]  # host read: spike intervals only

    def judged(self, steps: list[int], flags: list[bool]) -> list[int]:
        """``warn``: record the interval's spikes (every rank its own); the pending steps are done. The spikes."""
        spikes = [s for s, f in zip(steps, flags, strict=True) if f and s in self.pending]
        for step in spikes:
            p = self.pending[step]
            event = NonFiniteEvent(
                p.cycle, self.info.rank, p.grad_norm, p.micro_steps, (), tuple(p.tags), "warn", SPIKE
            )
            self.record(step, event, p.limits[0], p.batch, action="warn", column=p.limits[1])
        for step in steps:
            self.pending.pop(step, None)
        return spikes

    def record(
        self,
        step: int,
        event: NonFiniteEvent,
        limits: SpikeLimits,
        batch: int,
        *,
        action: str,
        column: int = 0,
        **extra: Any,
    ) -> dict[str, Any]:
        """Append this rank's record of the spike at ``step`` (reads its statistics and per-example losses)."""
        from steadytrain.diagnose.ledger import append_spike

        stats = limits.read(column)  # host read: spikes only
        loss_over = stats["value"][0] > stats["limit"][0]
        which = 0 if self.cfg.metric == "loss" or (self.cfg.metric == "both" and loss_over) else 1
        judged = {
            "metric": ("loss", "grad_norm")[which],
            **{k: _number(stats[k][which]) for k in ("value", "median", "mad")},
            "threshold": _number(stats["limit"][which]),
            "loss": _number(stats["value"][0]),
            "loss_limit": _number(stats["limit"][0]),
            "batch": batch,
            "action": action,
            **extra,
        }
        event = dataclasses.replace(event, action=action, batch=batch)
        record = append_spike(self.ledger, event, step, judged)
        if self.info.is_main:
            log.warning(
                "step %d: loss spike (%s %.4g > %.4g: median %.4g + %g MADs, >= %g x median); %s",
                step,
                judged["metric"],
                stats["value"][which],
                stats["limit"][which],
                stats["median"][which],
                self.cfg.threshold,
                self.cfg.min_ratio,
                {"warn": "recorded", "skip": "update skipped", "rollback": "rolling back", "stop": "stopping"}[action],
            )
        return record

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict() if self.detector is not None else None,
            "rollbacks": self.rollbacks,
            "skipped": list(self.skipped),
            "recent": list(self.recent),
            "restored": list(self.restored),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (a checkpoint written before spikes were watched has none: a new window)."""
        if not state:
            return
        if self.detector is not None and state.get("detector"):
            self.detector.load_state_dict(state["detector"])
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skipped = [int(b) for b in state.get("skipped", [])]
        self.recent = [int(b) for b in state.get("recent", [])][-self.cfg.skip_batches :]
        self.restored = [int(s) for s in state.get("restored", [])]
        self._skip = set(self.skipped)

    def pass_over(self, batches: list[int]) -> None:
        """Add global ``batches`` to those never trained on."""
        self.skipped += [b for b in batches if b not in self._skip]
        self._skip = set(self.skipped)


def _number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
