"""The validation pass: the mean per-example loss over the validation examples, the same on any world size.

Every rank evaluates its disjoint slice (:class:`~steadytrain.data.EvalSet`) with the model in
``eval()`` mode under ``torch.no_grad()``; the sums of the per-example losses (float64), the counts
and the non-finite counts are all-reduced once and read in one host sync. The pass leaves training
as it found it: the model's mode, and every random stream (``torch.random.fork_rng``: CPU and the
current CUDA device) are restored, and it reads its own data, so a run with evaluation trains
bit for bit like one without.

Under DDP the wrapped module is called directly (a DDP forward would synchronise buffers, and ranks
may hold one micro-batch more than others); under FSDP2 every forward is a collective, so every rank
runs :attr:`EvalSet.forwards` of them, padding with a real batch whose losses are not counted.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steadytrain.data import EvalSet
from steadytrain.train.job.cadence import AutoCadence
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.models import check_losses

__all__ = ["EvalResult", "Validation", "evaluate", "precision_context"]

log = logging.getLogger("steadytrain.train")


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: ``val_loss`` (None when not finite), the examples counted, the non-finite ones."""

    val_loss: float | None
    val_items: int
    nonfinite: int
    sources: dict[str, tuple[float | None, int]] = field(default_factory=dict)
    """A mixture's validation per source that holds some out: ``{name: (val_loss, val_items)}``."""

    def row(self, step: int) -> dict[str, Any]:
        """The ``metrics.jsonl`` row: ``step``, ``val_loss``, ``val_items`` (and ``val_nonfinite`` when any; a
        mixture's ``val_loss/<name>`` and ``val_items/<name>``)."""
        out: dict[str, Any] = {"step": step, "val_loss": self.val_loss, "val_items": self.val_items}
        for name, (loss, items) in self.sources.items():
            out |= {f"val_loss/{name}": loss, f"val_items/{name}": items}
        return out | ({"val_nonfinite": self.nonfinite} if self.nonfinite else {})


def precision_context(device: torch.device, precision: str) -> Any:
    """The autocast the run's forward passes use (``fp32``: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _callable(model: nn.Module) -> tuple[nn.Module, bool]:
    """What to call, and whether every rank must call it equally often (FSDP2: a forward is a collective)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, False
    from torch.distributed.fsdp import FSDPModule

    return model, isinstance(model, FSDPModule)


def _losses(out: Any, n: int) -> torch.Tensor:
    """Per-example losses ``[n]`` as float64 (a scalar mean counts as ``n`` equal losses)."""
    out = check_losses(out, n).detach().double()
    return out.expand(n) if out.dim() == 0 else out


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def evaluate(
    model: nn.Module,
    evalset: EvalSet,
    info: DistInfo,
    *,
    precision: str = "fp32",
    stop: Callable[..., bool] | None = None,
) -> EvalResult | None:
    """The validation loss of ``model`` over ``evalset`` on every rank (a collective when distributed).

    ``stop`` (every rank passes one or none): asked before each of the :attr:`EvalSet.forwards` passes (every rank as
    often, a rank with fewer examples too) and once with ``last=True`` after them; when it says True on every rank
    (:meth:`~steadytrain.train.job.stop.StopRequest.poll`) the evaluation ends there and None is returned."""
    net, lockstep = _callable(model)
    was_training = net.training
    names = getattr(evalset, "names", [])  # a mixture's sources: a loss sum and a count per source too
    totals = torch.zeros(3 + 2 * len(names), dtype=torch.float64, device=info.device)  # loss sum, examples, non-finite
    devices = [info.device] if info.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        net.eval()
        try:
            first, passes = None, 0
            for batch in evalset:
                if stop is not None and stop():
                    return None
                first, passes = first or batch, passes + 1
                n = len(batch["index"])
                with precision_context(info.device, precision):
                    losses = _losses(net(_to(batch, info.device)), n)
                _count(totals, losses, batch["source"] if names else None)
            for _ in range(evalset.forwards - passes if lockstep or stop is not None else 0):  # as many on every rank
                if stop is not None and stop():
                    return None
                if lockstep:  # a forward is a collective
                    with precision_context(info.device, precision):
                        net(_to(first or evalset.pad_batch(), info.device))
            if stop is not None and stop(last=True):
                return None
        finally:
            net.train(was_training)
    if info.backend is not None:
        dist.all_reduce(totals)  # each rank saw its share of the held-out set: the loss is over all of it
        if info.tp > 1:
            totals /= info.tp  # the ranks of one tensor-parallel group evaluated the same examples
    values = totals.tolist()  # host sync, once per evaluation: the result is logged and compared
    loss_sum, items, nonfinite = values[:3]
    if nonfinite:
        log.warning("evaluation: %d of %d validation losses are not finite", int(nonfinite), int(items))
    per = {
        name: (_mean(s, c), int(c))
        for name, s, c in zip(names, values[3 : 3 + len(names)], values[3 + len(names) :], strict=True)
        if c
    }
    return EvalResult(_mean(loss_sum, items), int(items), int(nonfinite), per)


def _count(totals: torch.Tensor, losses: torch.Tensor, source: torch.Tensor | None) -> None:
    """Add a batch's losses to ``totals`` (loss sum, examples, non-finite; then per source sums and counts)."""
    totals[:3] += torch.stack([losses.sum(), losses.new_tensor(len(losses)), (~torch.isfinite(losses)).sum().double()])
    if source is not None:
        src, n = source.to(totals.device), (len(totals) - 3) // 2
        totals[3:].index_add_(0, torch.cat([src, src + n]), torch.cat([losses, torch.ones_like(losses)]))


def _mean(total: float, count: float) -> float | None:
    return total / count if count and math.isfinite(total) else None


@dataclass
class Validation:
    """When a run evaluates, the best validation loss so far, and early stopping (part of a checkpoint)."""

    evalset: EvalSet
    every_steps: int | None
    patience: int | None
    auto: AutoCadence | None = None
    """``eval.every_steps: auto``: the cadence is this one's (estimated at start, measured at the first evaluation)."""
    best_loss: float | None = None
    best_step: int | None = None
    bad: int = 0
    """Evaluations since the best one (early stopping counts these)."""

    def due(self, step: int, last: int) -> bool:
        """Whether to evaluate after optimizer ``step`` (``last``: the run's final step, always evaluated)."""
        every = self.auto.every_steps if self.auto is not None else self.every_steps
        return step == last or (every is not None and step % every == 0)

    def record(self, result: EvalResult, step: int) -> tuple[bool, str | None]:
        """Take ``result`` of ``step``: ``(improved, why to stop early or None)``."""
        improved = result.val_loss is not None and (self.best_loss is None or result.val_loss < self.best_loss)
        if improved:
            self.best_loss, self.best_step, self.bad = result.val_loss, step, 0
        else:
            self.bad += 1
        if self.patience is not None and self.bad >= self.patience:
            best = f"best {self.best_loss:.6g} at step {self.best_step}" if self.best_step else "none finite"
            return improved, (
                f"early stopping at step {step}: the validation loss has not improved for {self.bad} "
                f"evaluation(s) (eval.patience={self.patience}; {best})"
            )
        return improved, None

    def ended(self, step: int) -> str | None:
        """Why a run resumed at ``step`` with this state has already ended by early stopping (None: it has not)."""
        if self.patience is None or self.bad < self.patience:
            return None
        return (
            f"the run ended by early stopping at step {step} ({self.bad} evaluation(s) without improvement, "
            f"eval.patience={self.patience}); to train on, raise it: --set eval.patience={self.bad + 1} or more"
        )

    def state_dict(self) -> dict[str, Any]:
        state = {"best_loss": self.best_loss, "best_step": self.best_step, "bad": self.bad}
        if self.auto is not None and self.auto.timed:  # a resume evaluates at the same steps as before
            state["every_steps"] = self.auto.every_steps
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_loss, self.best_step, self.bad = state["best_loss"], state["best_step"], int(state["bad"])
        if self.auto is not None and state.get("every_steps") is not None:  # checked with the checkpoint
            self.auto.every_steps, self.auto.timed = int(state["every_steps"]), True
