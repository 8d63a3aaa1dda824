"""Gradient accumulation that equals one big batch, with one gradient sync per optimizer step.

``GradientAccumulator`` runs in the user's own loop. Per micro-batch the user does forward and
``mb.backward(loss)`` inside ``with acc.micro_batch(...)``; the accumulator

* normalizes: without item counts every micro-batch weighs equally (the seed's divide-by-K; a
  partial cycle divides by what it held); with ``num_items`` the gradient is the exact mean over
  every item of the cycle on every rank (the item count is all-reduced once per cycle and 1/N is
  folded into the step, so no host sync happens per micro-batch);
* synchronizes once: under DDP ``no_sync`` (under FSDP2 ``set_requires_gradient_sync(False)``)
  covers forward and backward of every micro-batch but the last of a cycle;
* at the end of a cycle, in order: unscale (fp16 ``GradScaler``), one global norm, clip, one
  finiteness decision (identical on all ranks: the norm is computed from synchronized or
  mesh-reduced gradients), ``optimizer.step()``, ``scheduler.step()``, ``zero_grad()`` — each once.

For fused torch optimizers (``fused=True`` Adam/AdamW/SGD) the normalization and clip coefficient
are handed to the optimizer as ``grad_scale`` (the contract ``torch.amp.GradScaler`` uses), so the
gradients are read once for the norm and once by the step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from steadytrain._check import check_int
from steadytrain.clip import clip_grad_value_, global_grad_norm, scale_grads_

__all__ = [
    "ON_NONFINITE",
    "GradientAccumulator",
    "MicroBatch",
    "NonFiniteEvent",
    "NonFiniteGradientError",
    "StepResult",
]

ON_NONFINITE = ("skip", "raise", "ignore")


class NonFiniteGradientError(RuntimeError):
    """The global gradient norm was NaN or inf and ``on_nonfinite="raise"``."""


@dataclass(frozen=True)
class StepResult:
    """What the end of a cycle did."""

    cycle: int
    """Index of this cycle among all cycles (stepped and skipped), 0-based."""
    micro_batches: int
    """Micro-batches the cycle held (fewer than K for a partial last cycle)."""
    grad_norm: float
    """Pre-clip global norm of the normalized gradient (NaN when not computed)."""
    stepped: bool
    """Whether ``optimizer.step()`` ran."""
    num_items: float | None = None
    """Items of the cycle summed over all ranks, when ``num_items`` was given."""


@dataclass(frozen=True)
class NonFiniteEvent:
    """A cycle whose global gradient norm was not finite: what was in play on this rank."""

    cycle: int
    rank: int
    grad_norm: float
    micro_steps: tuple[int, int]
    """Global micro-step indices [first, last] of the cycle."""
    nonfinite_micro_batches: tuple[int, ...]
    """Positions in the cycle whose local loss was not finite on this rank."""
    tags: tuple[Any, ...] = ()
    """The ``tag`` given to each micro-batch of the cycle (e.g. shard and example indices)."""
    action: str = "skip"


class MicroBatch:
    """One micro-batch inside ``with acc.micro_batch()``: call :meth:`backward` exactly once."""

    def __init__(self, acc: GradientAccumulator, num_items: int | float | Tensor | None, position: int, tag: Any):
        self._acc = acc
        self.num_items = num_items
        self.position = position
        """Position of this micro-batch in its cycle (0-based)."""
        self.tag = tag
        self.loss: Tensor | None = None
        self.result: StepResult | None = None
        """Set when this micro-batch ended a cycle."""
        self._open = True

    def backward(self, loss: Tensor) -> None:
        """Backward ``loss`` (the MEAN over this micro-batch's items), normalized for accumulation.

        Raises:
            RuntimeError: outside its ``with`` block, or called twice.
            ValueError: ``loss`` is not a scalar.
        """
        if not self._open:
            raise RuntimeError("mb.backward() called outside its `with acc.micro_batch() as mb:` block")
        if self.loss is not None:
            raise RuntimeError("mb.backward() called twice in one micro-batch: use one micro_batch() per backward")
        if loss.ndim != 0:
            raise ValueError(f"loss has shape {tuple(loss.shape)}: pass the scalar mean over the micro-batch's items")
        self.loss = loss.detach()
        acc = self._acc
        # Items: backward the item-weighted sum; 1/N (global) is folded into the step.
        scaled = loss * self.num_items if self.num_items is not None else loss / acc.accumulation_steps
        if acc.grad_scaler is not None:
            scaled = acc.grad_scaler.scale(scaled)
        scaled.backward()


@dataclass
class _Cycle:
    micro: int = 0
    items: Any = None  # int, float or Tensor; None without num_items
    use_items: bool | None = None
    losses: list[Tensor] = field(default_factory=list)
    tags: list[Any] = field(default_factory=list)
    synced: bool = True  # the last micro-batch ran with gradient sync on


def _is_one(x: Tensor | float) -> bool:
    """A Python 1.0 (a tensor is never assumed to be one: checking it would sync with the device)."""
    return isinstance(x, float) and x == 1.0


def _find_fsdp_mesh(model: nn.Module):
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    if not isinstance(model, FSDPModule):
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


class GradientAccumulator:
    """Accumulate K micro-batches into one optimizer step that equals one big-batch step.

    Args:
        model: a plain module, ``DistributedDataParallel``, or an FSDP2 (``fully_shard``) module.
        optimizer: any ``torch.optim.Optimizer``; fused Adam/AdamW/SGD get the folded fast path.
        accumulation_steps: micro-batches per optimizer step (K >= 1).
        scheduler: stepped once per optimizer step (never per micro-batch, never on a skipped step).
        max_grad_norm: clip the global norm of the accumulated gradient to this.
        clip_value: or clamp each element to ``[-clip_value, clip_value]`` (not both).
        grad_scaler: a ``torch.amp.GradScaler`` for fp16; gradients are unscaled before the norm.
            With a scaler a non-finite step is its overflow signal: skipped and the scale lowered,
            whatever ``on_nonfinite`` says.
        on_nonfinite: ``skip`` (no update on any rank, grads cleared, scheduler not advanced,
            event recorded), ``raise`` (:class:`NonFiniteGradientError`) or ``ignore``.
        norm_type: p of the global norm.
        eps: added to the norm in the clip coefficient.

    Raises:
        ValueError: a bad argument, named with its value.

    References:
        torchtitan's global-token normalization; optax ``apply_if_finite``; Pascanu et al. 2013.

    Example:
        >>> model = nn.Linear(3, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=1.0)
        >>> for x in acc.micro_batches([torch.ones(4, 3)] * 3):
        ...     with acc.micro_batch(num_items=len(x)) as mb:
        ...         mb.backward(model(x).pow(2).mean())
        >>> acc.optimizer_steps, acc.micro_steps, acc.items_seen
        (2, 3, 12.0)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        accumulation_steps: int,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        clip_value: float | None = None,
        grad_scaler: Any = None,
        on_nonfinite: str = "skip",
        norm_type: float = 2.0,
        eps: float = 1e-6,
    ) -> None:
        check_int("accumulation_steps", accumulation_steps)
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is unknown: use one of {', '.join(ON_NONFINITE)}")
        if max_grad_norm is not None and clip_value is not None:
            raise ValueError("give max_grad_norm (global-norm clipping) or clip_value (value clipping), not both")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0 (None disables clipping)")
        if clip_value is not None and not clip_value > 0:
            raise ValueError(f"clip_value={clip_value} must be > 0 (None disables value clipping)")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm, self.clip_value, self.grad_scaler = max_grad_norm, clip_value, grad_scaler
        self.on_nonfinite, self.norm_type, self.eps = on_nonfinite, norm_type, eps
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._mesh = _find_fsdp_mesh(model)
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        if self._ddp:
            self._dp_groups = [model.process_group]
            self._dp_size = dist.get_world_size(model.process_group)
        elif self._mesh is not None:
            self._dp_groups = [self._mesh.get_group(d) for d in range(self._mesh.ndim)]
            self._dp_size = self._mesh.size()
        else:
            self._dp_groups, self._dp_size = [], 1
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # A non-finite norm stops the step (skip or raise); with a GradScaler it is its overflow signal.
        self._guard = on_nonfinite != "ignore" or grad_scaler is not None
        self._need_norm = max_grad_norm is not None or self._guard
        self._fused = (
            grad_scaler is None
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(g.get("fused") for g in optimizer.param_groups)
        )
        if accumulation_steps > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            warnings.warn(
                f"the model has BatchNorm and accumulation_steps={accumulation_steps}: its statistics are computed "
                "per micro-batch, not over the effective batch (use GroupNorm/LayerNorm, or accept the approximation)",
                stacklevel=2,
            )
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.items_seen: float = 0
        self.last_grad_norm: float | None = None
        self.nonfinite_events: list[NonFiniteEvent] = []
        self._cycle = _Cycle()
        self._active: MicroBatch | None = None
        self._data_ends = False

    # -- the per-micro-batch path ---------------------------------------------------------------

    def micro_batches(self, iterable: Iterable) -> Iterator:
        """Yield from ``iterable``, knowing which item is the last, so a partial last cycle is synced and stepped."""
        it = iter(iterable)
        try:
            current = next(it)
        except StopIteration:
            return
        for upcoming in it:
            yield current
            current = upcoming
        self._data_ends = True
        try:
            yield current
        finally:
            self._data_ends = False

    @contextlib.contextmanager
    def micro_batch(self, num_items: int | float | Tensor | None = None, *, tag: Any = None) -> Iterator[MicroBatch]:
        """Context for one micro-batch's forward and backward; steps when it ends a cycle.

        Args:
            num_items: items (tokens, examples) the micro-batch's mean loss is over. Give it on
                every micro-batch of a cycle or on none. A tensor is fine (no host sync).
            tag: anything identifying the data (shard, example indices); kept for non-finite events.
        """
        if self._active is not None:
            raise RuntimeError("micro_batch() is already open: finish one micro-batch before starting the next")
        cycle = self._cycle
        use_items = num_items is not None
        if cycle.micro and cycle.use_items != use_items:
            raise ValueError("num_items must be given on every micro-batch of a cycle or on none")
        if isinstance(num_items, (int, float)) and (isinstance(num_items, bool) or num_items < 0):
            raise ValueError(f"num_items={num_items!r} must be a number >= 0")
        last = cycle.micro + 1 >= self.accumulation_steps or self._data_ends
        mb = MicroBatch(self, num_items, cycle.micro, tag)
        self._active = mb
        try:
            with contextlib.nullcontext() if last else self._no_sync():
                yield mb
        finally:
            mb._open = False
            self._active = None
            if mb.loss is not None:  # its gradient is in .grad: count it, even if the block raised
                self._record(mb, use_items, synced=last)
        if mb.loss is None:
            raise RuntimeError("a micro_batch() block ended without mb.backward(loss)")
        if last:
            mb.result = self._end_cycle()

    def _record(self, mb: MicroBatch, use_items: bool, synced: bool) -> None:
        cycle = self._cycle
        cycle.use_items = use_items
        cycle.micro += 1
        cycle.synced = synced
        cycle.losses.append(mb.loss)
        cycle.tags.append(mb.tag)
        if use_items:
            cycle.items = mb.num_items if cycle.items is None else cycle.items + mb.num_items
        self.micro_steps += 1

    def _no_sync(self):
        if self._ddp:
            return self.model.no_sync()
        if self._mesh is not None:
            return self._fsdp_no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _fsdp_no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def finish(self) -> StepResult | None:
        """Step a partial last cycle, if one is pending (not needed with :meth:`micro_batches`)."""
        if self._cycle.micro == 0:
            return None
        if not self._cycle.synced:
            if self._mesh is not None:
                raise RuntimeError(
                    "a partial cycle ran without FSDP gradient sync: iterate with acc.micro_batches(data) so the last "
                    "micro-batch of the data is synchronized"
                )
            self._all_reduce_grads()
        return self._end_cycle()

    def _all_reduce_grads(self) -> None:
        """DDP fallback for a partial cycle whose last micro-batch ran under no_sync: average grads."""
        if not self._dp_groups:
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self._dp_groups[0])
        flat.div_(self._dp_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)

    # -- the end of a cycle ----------------------------------------------------------------------

    def _global_items(self, items: int | float | Tensor) -> Tensor:
        dtype = torch.float32 if self._device.type == "mps" else torch.float64
        if isinstance(items, Tensor):
            total = items.detach().to(self._device, dtype).reshape(1)
        else:
            total = torch.tensor([float(items)], dtype=dtype, device=self._device)
        for group in self._dp_groups:  # one all-reduce per cycle (per mesh dimension)
            dist.all_reduce(total, group=group)
        return total.reshape(())

    def _end_cycle(self) -> StepResult:
        cycle, self._cycle = self._cycle, _Cycle()
        index = self.optimizer_steps + self.skipped_steps
        items = None
        # The factor that turns the accumulated gradient into the big-batch gradient.
        if cycle.use_items:
            total = self._global_items(cycle.items)
            # DDP/FSDP average over ranks; undo it and divide by the global count instead.
            factor: Tensor | float = (self._dp_size / total.clamp(min=1)).to(torch.float32)
        else:
            factor = self.accumulation_steps / cycle.micro
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        norm_value = math.nan
        coef: Tensor | float = factor
        if self._need_norm:
            norm = global_grad_norm(self._params, self.norm_type)
            norm = norm if _is_one(factor) else norm * factor
            if self.max_grad_norm is not None:
                clip = torch.clamp(self.max_grad_norm / (norm + self.eps), max=1.0)
                coef = clip if _is_one(factor) else factor * clip
        # The one host sync per optimizer step (skip or step must be decided): norm and item count together.
        if self._need_norm and cycle.use_items:
            norm_value, items = torch.stack([norm.to(total.dtype), total]).tolist()
        elif self._need_norm:
            norm_value = float(norm)
        elif cycle.use_items:
            items = float(total)
        if items is not None:
            self.items_seen += items
        self.last_grad_norm = norm_value
        if self._guard and not math.isfinite(norm_value):
            return self._nonfinite(cycle, index, norm_value, items)
        rescale = not _is_one(coef)
        folded = False
        if self.clip_value is not None:
            if rescale:
                scale_grads_(self._params, coef)
            clip_grad_value_(self._params, self.clip_value)
        elif self._fused and rescale:
            # The fused kernel divides every gradient by grad_scale as it reads it: no extra pass.
            coef_t = coef if isinstance(coef, Tensor) else torch.tensor(coef)
            self.optimizer.grad_scale = (1.0 / coef_t).to(self._device, torch.float32)
            folded = True
        elif rescale:
            scale_grads_(self._params, coef)
        try:
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
            else:
                self.optimizer.step()
        finally:
            if folded:
                del self.optimizer.grad_scale
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return StepResult(index, cycle.micro, norm_value, True, items)

    def _nonfinite(self, cycle: _Cycle, index: int, norm_value: float, items: float | None) -> StepResult:
        bad = torch.stack([~torch.isfinite(loss) for loss in cycle.losses]).nonzero().flatten().tolist()
        action = "skip" if self.grad_scaler is not None else self.on_nonfinite
        event = NonFiniteEvent(
            cycle=index,
            rank=self._rank,
            grad_norm=norm_value,
            micro_steps=(self.micro_steps - cycle.micro, self.micro_steps - 1),
            nonfinite_micro_batches=tuple(bad),
            tags=tuple(cycle.tags),
            action=action,
        )
        self.nonfinite_events.append(event)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        if self.grad_scaler is not None:
            self.grad_scaler.update()  # lowers the loss scale after the overflow unscale_ recorded
        elif action == "raise":
            raise NonFiniteGradientError(
                f"non-finite global gradient norm {norm_value} at optimizer step {self.optimizer_steps} "
                f"(cycle {index}, micro-steps {event.micro_steps[0]}-{event.micro_steps[1]}, rank {self._rank}); "
                f"micro-batches with a non-finite local loss: {list(bad) or 'none'}"
            )
        return StepResult(index, cycle.micro, norm_value, False, items)

    # -- checkpointing ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters, the position in the cycle and, mid-cycle, the gradients accumulated so far."""
        cycle = self._cycle
        pending = None
        if cycle.micro:
            if self._mesh is not None:
                raise RuntimeError("state_dict() mid-cycle is not supported with FSDP2: checkpoint after a step")
            pending = {i: p.grad.detach().clone() for i, p in enumerate(self._params) if p.grad is not None}
        items = cycle.items
        return {
            "accumulation_steps": self.accumulation_steps,
            "micro_steps": self.micro_steps,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "items_seen": self.items_seen,
            "last_grad_norm": self.last_grad_norm,
            "nonfinite_events": [asdict(e) for e in self.nonfinite_events],
            "cycle": {
                "micro": cycle.micro,
                "items": float(items) if isinstance(items, Tensor) else items,
                "use_items": cycle.use_items,
                "losses": [float(x) for x in cycle.losses],
                "tags": list(cycle.tags),
                "synced": cycle.synced,
            },
            "pending_grads": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; mid-cycle it also restores the accumulated gradients."""
        if state["accumulation_steps"] != self.accumulation_steps:
            raise ValueError(
                f"checkpoint has accumulation_steps={state['accumulation_steps']}, this accumulator "
                f"{self.accumulation_steps}: resume with the same value"
            )
        for key in ("micro_steps", "optimizer_steps", "skipped_steps", "items_seen", "last_grad_norm"):
            setattr(self, key, state[key])
        self.nonfinite_events = [
            NonFiniteEvent(**{**e, "micro_steps": tuple(e["micro_steps"])}) for e in state["nonfinite_events"]
        ]
        c = state["cycle"]
        self._cycle = _Cycle(
            micro=c["micro"],
            items=c["items"],
            use_items=c["use_items"],
            losses=[torch.tensor(x) for x in c["losses"]],
            tags=list(c["tags"]),
            synced=c["synced"],
        )
        for p in self._params:
            p.grad = None
        for i, g in (state["pending_grads"] or {}).items():
            self._params[i].grad = g.detach().clone().to(self._params[i].device)
