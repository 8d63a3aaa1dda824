"""``GradientAccumulator``: K micro-batches, one optimizer step that equals one big-batch step.

The pieces live beside this file: :mod:`.normalize` (loss weights and the factor that finishes the
mean), :mod:`.sync` (DDP/FSDP2 gradient-sync switches), :mod:`.step` (norm, clip, the one host read,
the decision, the optimizer step), :mod:`.events` (what a cycle reports) and :mod:`.state` (the open
cycle and its checkpoint form). This module composes them and keeps the counters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from steadytrain._check import check_int
from steadytrain.accumulate import normalize
from steadytrain.accumulate.checks import check_parts, warn_batchnorm
from steadytrain.accumulate.events import SPIKE, NonFiniteEvent, NonFiniteGradientError, StepResult, UsageError
from steadytrain.accumulate.state import Cycle, check_state
from steadytrain.accumulate.step import (
    Reading,
    StepConfig,
    apply_and_step,
    norm_and_coefficient,
    read_once,
    refusal,
)
from steadytrain.accumulate.sync import DataParallel, average_grads_, no_sync
from steadytrain.errors import UserError

__all__ = ["GradientAccumulator", "MicroBatch"]


class MicroBatch:
    """One micro-batch inside ``with acc.micro_batch()``: call :meth:`backward` exactly once."""

    def __init__(self, acc: GradientAccumulator, num_items: float | Tensor | None, position: int, tag: Any):
        self._acc = acc
        self.num_items = num_items
        self.position = position
        """Position of this micro-batch in its cycle (0-based)."""
        self.tag = tag
        self.loss: Tensor | None = None
        """The detached loss, set once its backward has completed."""
        self.result: StepResult | None = None
        """Set when this micro-batch ended a cycle."""
        self._open = True

    def backward(self, loss: Tensor) -> None:
        """Backward ``loss`` (the MEAN over this micro-batch's items), normalized for accumulation.

        A backward that raises leaves the micro-batch uncounted (the cycle and the counters are as
        before), so it can be retried, in this block or a new one. Gradients a failed backward had
        already accumulated into ``.grad`` cannot be taken back; autograd's usual failures (a loss
        without a graph, an error in the loss or in a hook) happen before any is written.

        Raises:
            UsageError: outside its ``with`` block, called twice, or a ``loss`` that is not a tensor or does not
                require grad (a ``UserError`` and a ``RuntimeError``).
            UserError: ``loss`` is not a scalar (a ``ValueError``).
        """
        if not self._open:
            raise UsageError("mb.backward() called outside its `with acc.micro_batch() as mb:` block")
        if self.loss is not None:
            raise UsageError("mb.backward() called twice in one micro-batch: use one micro_batch() per backward")
        if not isinstance(loss, Tensor):
            raise UsageError(f"loss is a {type(loss).__name__}, not a tensor: pass the loss tensor the model computed")
        if loss.ndim != 0:
            raise UserError(f"loss has shape {tuple(loss.shape)}: pass the scalar mean over the micro-batch's items")
        if not loss.requires_grad:
            raise UsageError(
                "loss does not require grad: computed under torch.no_grad(), detached, or from a frozen model?"
            )
        self._acc._scaled(loss, self.num_items).backward()
        self.loss = loss.detach()  # only now: a backward that raised is not a micro-batch


class GradientAccumulator:
    """Accumulate K micro-batches into one optimizer step that equals one big-batch step.

    Per micro-batch the caller runs forward and ``mb.backward(loss)`` inside
    ``with acc.micro_batch(...)``. The accumulator normalizes the loss (by micro-batch count, or by
    the global item count when ``num_items`` is given), turns gradient sync off for every micro-batch
    but the last of a cycle (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``), and at the end of
    a cycle unscales (fp16), computes the global norm once, clips, decides once whether the step is
    sound, and runs ``optimizer.step()``, ``scheduler.step()`` and ``zero_grad()`` once each.

    A step is refused (no update on any rank, grads cleared, scheduler not advanced, a
    :class:`NonFiniteEvent` recorded with its ``reason``) when the global norm, or some micro-batch's loss
    on some rank, is not finite (per ``on_nonfinite``), and always when the cycle's item counts cannot
    normalize it: a negative, NaN or infinite ``num_items`` on some micro-batch of some rank, or 0 items
    in all. Under ``on_nonfinite="raise"`` a refusal raises :class:`NonFiniteGradientError` instead of skipping.
    These decisions cost no extra host sync: the item counts and the losses are read with the norm (under
    data parallelism their sums travel in one small all-reduce per step).

    Args:
        model: a plain module, ``DistributedDataParallel``, or an FSDP2 (``fully_shard``) module.
        optimizer: any ``torch.optim.Optimizer``; fused Adam/AdamW/SGD get the folded fast path.
        accumulation_steps: micro-batches per optimizer step (K >= 1).
        scheduler: stepped once per optimizer step (never per micro-batch, never on a skipped step).
        max_grad_norm: clip the global norm of the accumulated gradient to this (finite, > 0).
        clip_value: or clamp each element to ``[-clip_value, clip_value]`` (finite, > 0; not both).
        grad_scaler: a ``torch.amp.GradScaler`` for fp16; gradients are unscaled before the norm.
            With a scaler a non-finite step is its overflow signal: skipped and the scale lowered,
            whatever ``on_nonfinite`` says.
        on_nonfinite: ``skip`` (no update, event recorded), ``raise`` (:class:`NonFiniteGradientError`)
            or ``ignore`` (step anyway on a non-finite norm; invalid item counts are still skipped).
        norm_type: p of the global norm (> 0, or ``inf``).
        eps: added to the norm in the clip coefficient (finite, >= 0).

    Raises:
        UserError: a bad argument, named with its value (a ``ValueError``).

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
        self.accumulation_steps = check_int("accumulation_steps", accumulation_steps)
        check_parts(model, optimizer, scheduler, grad_scaler)
        self.model, self.optimizer, self.scheduler, self.grad_scaler = model, optimizer, scheduler, grad_scaler
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise UserError(
                f"the model ({type(model).__name__}) has no parameters that require grad: nothing to train "
                "(all frozen? call requires_grad_() on the ones to train)"
            )
        self._step = StepConfig.build(
            optimizer,
            self._params,
            grad_scaler=grad_scaler,
            max_grad_norm=max_grad_norm,
            clip_value=clip_value,
            on_nonfinite=on_nonfinite,
            norm_type=norm_type,
            eps=eps,
        )
        self._device = self._params[0].device
        self._layout = DataParallel.of(model)
        fp16 = grad_scaler is not None or any(p.dtype == torch.float16 for p in self._params)
        self._item_scale = normalize.ItemScale(fp16, accumulation_steps, self._layout)
        warn_batchnorm(model, accumulation_steps)
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.items_seen: float = 0
        self.last_grad_norm: float | None = None
        self.nonfinite_events: list[NonFiniteEvent] = []
        self._cycle = Cycle()
        self._active: MicroBatch | None = None
        self._data_ends = False
        self.veto: Callable[[Tensor | None], Tensor | None] | None = None
        """Optional: called at the end of each cycle with the normalized global norm (a device tensor, or None
        when not computed); a 0-dim bool device tensor it returns is read with the step's one host sync, and
        True refuses the step (reason ``spike``: no update on any rank, recorded, never raised). It must give
        every rank the same answer (build it from all-reduced values)."""
        self.observer: Any = None
        """Optional: watches the end of each cycle. ``observer.observes(refused) -> bool`` is asked once per
        cycle after the step's host read; when True, ``before_update(params, factor, stepped)`` sees the
        gradients before they are clipped (``factor`` normalizes them, as it does the global norm) and
        ``after_update(params)`` the parameters after the update (or, on a refused step, before its gradients
        are cleared). Every rank gets the same calls: they may hold collectives."""

    # The validated settings, readable as before.
    max_grad_norm = property(lambda self: self._step.max_grad_norm)
    clip_value = property(lambda self: self._step.clip_value)
    on_nonfinite = property(lambda self: self._step.on_nonfinite)
    norm_type = property(lambda self: self._step.norm_type)
    eps = property(lambda self: self._step.eps)
    _fused = property(lambda self: self._step.fused)

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
                every micro-batch of a cycle or on none. A Python number must be finite and >= 0
                (checked now); a one-element tensor is checked on the device with the step's one
                host sync (no sync per micro-batch), and an invalid one refuses the step.
            tag: anything identifying the data (shard, example indices); kept for non-finite events.

        A cycle that an exception left complete but not stepped (raised in the block after the backward
        of its last micro-batch) is stepped first.

        Raises:
            UserError: a bad ``num_items``, or ``num_items`` on some micro-batches of a cycle only.
            UsageError: a micro-batch is already open, or the block ended without ``mb.backward``.
        """
        if self._active is not None:
            raise UsageError("micro_batch() is already open: finish one micro-batch before starting the next")
        if self._cycle.micro and self._cycle.synced:
            self._end_cycle()  # complete, left unstepped by an exception raised after its last backward
        cycle = self._cycle
        num_items = normalize.check_num_items(num_items)
        if cycle.micro and cycle.use_items != (num_items is not None):
            raise UserError("num_items must be given on every micro-batch of a cycle or on none")
        if num_items is not None:
            self._item_scale.prepare(num_items, self._device)
        last = cycle.micro + 1 >= self.accumulation_steps or self._data_ends
        mb = self._active = MicroBatch(self, num_items, cycle.micro, tag)
        try:
            with contextlib.nullcontext() if last else no_sync(self.model, self._layout):
                yield mb
        finally:
            mb._open = False
            self._active = None
            if mb.loss is not None:  # its gradient is in .grad: count it, even if the block raised after
                cycle.add(mb.loss, tag, num_items, synced=last)
                self.micro_steps += 1
        if mb.loss is None:
            raise UsageError("a micro_batch() block ended without mb.backward(loss)")
        if last:
            mb.result = self._end_cycle()

    def _scaled(self, loss: Tensor, num_items: float | Tensor | None) -> Tensor:
        """The loss to backward: weighted for accumulation (in float32 at least), then loss-scaled (fp16)."""
        if num_items is not None:
            # Items: backward the item-weighted sum; world / (s * N) is folded into the step.
            scaled = normalize.scale_loss(loss, self._item_scale.weight(num_items))
        else:
            scaled = normalize.scale_loss(loss, 1.0 / self.accumulation_steps)
        return self.grad_scaler.scale(scaled) if self.grad_scaler is not None else scaled

    def finish(self) -> StepResult | None:
        """Step a partial last cycle, if one is pending (not needed with :meth:`micro_batches`)."""
        if self._cycle.micro == 0:
            return None
        if not self._cycle.synced:
            if self._layout.kind == "fsdp":
                raise RuntimeError(
                    "a partial cycle ran without FSDP gradient sync: iterate with acc.micro_batches(data) so the last "
                    "micro-batch of the data is synchronized"
                )
            average_grads_(self._params, self._layout)  # the cycle ran under no_sync: its gradients are still local
        return self._end_cycle()

    # -- the end of a cycle ----------------------------------------------------------------------

    def _end_cycle(self) -> StepResult:
        cycle, self._cycle = self._cycle, Cycle()
        index = self.optimizer_steps + self.skipped_steps
        # Under skip/raise the losses are read too: a NaN loss can come with finite (zero) gradients.
        items, losses = cycle.items if cycle.use_items else None, cycle.losses if self._step.guard else None
        totals, losses = normalize.global_counts(items, losses, self._device, self._layout)
        if totals is not None:
            factor: Tensor | float = normalize.item_factor(totals, self._layout.size, self._item_scale.value)
        else:
            factor = normalize.mean_factor(self.accumulation_steps, cycle.micro)
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        norm, coef = norm_and_coefficient(self._params, factor, self._step)
        veto = self.veto(norm) if self.veto is not None else None
        reading = read_once(norm, totals, veto, losses)  # the one host sync of the step
        self.last_grad_norm = reading.norm
        if reading.items_valid:
            self.items_seen += reading.items  # type: ignore[operator]
            self._item_scale.update(reading.items)  # type: ignore[arg-type]
        reason = refusal(reading, self._step)
        watch = self.observer is not None and self.observer.observes(reason is not None)
        if watch:
            self.observer.before_update(self._params, factor, stepped=reason is None)
        if reason is not None:
            if watch:
                self.observer.after_update(self._params)
            return self._refuse(cycle, index, reading, reason)
        apply_and_step(self._params, self.optimizer, coef, self._step, self.grad_scaler)
        if watch:
            self.observer.after_update(self._params)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return StepResult(index, cycle.micro, reading.norm, True, reading.items)

    def _refuse(self, cycle: Cycle, index: int, reading: Reading, reason: str) -> StepResult:
        """No update: record the event, clear the grads, keep the scheduler; raise if the policy says so."""
        raising = self.grad_scaler is None and self.on_nonfinite == "raise" and reason != SPIKE
        event = NonFiniteEvent(
            cycle=index,
            rank=self._layout.rank,
            grad_norm=reading.norm,
            micro_steps=(self.micro_steps - cycle.micro, self.micro_steps - 1),
            nonfinite_micro_batches=cycle.nonfinite_positions(),
            tags=tuple(cycle.tags),
            action="raise" if raising else "skip",
            reason=reason,
            num_items=reading.items,
        )
        self.nonfinite_events.append(event)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        if self.grad_scaler is not None:
            self.grad_scaler.update()  # after unscale_: lowers the scale if it recorded an overflow
        elif raising:
            raise NonFiniteGradientError(event.message(self.optimizer_steps))
        return StepResult(index, cycle.micro, reading.norm, False, reading.items)

    # -- checkpointing ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters, the position in the cycle and, mid-cycle, the gradients accumulated so far."""
        pending = None
        if self._cycle.micro:
            if self._layout.kind == "fsdp":
                raise RuntimeError("state_dict() mid-cycle is not supported with FSDP2: checkpoint after a step")
            pending = {i: p.grad.detach().clone() for i, p in enumerate(self._params) if p.grad is not None}
        return {
            "accumulation_steps": self.accumulation_steps,
            "micro_steps": self.micro_steps,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "items_seen": self.items_seen,
            "last_grad_norm": self.last_grad_norm,
            "nonfinite_events": [e.as_dict() for e in self.nonfinite_events],
            "item_scale": self._item_scale.state(),
            "cycle": self._cycle.to_state(),
            "pending_grads": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; mid-cycle it also restores the accumulated gradients.

        A state saved at a cycle boundary (no micro-batch pending) loads into any ``accumulation_steps``:
        that is how a run resumes on another world size with the same global batch.
        """
        check_state(state, [(n, p) for n, p in self.model.named_parameters() if p.requires_grad])  # before changes
        if state["accumulation_steps"] != self.accumulation_steps and state["cycle"]["micro"]:
            raise UserError(
                f"checkpoint has accumulation_steps={state['accumulation_steps']} and a cycle in progress, this "
                f"accumulator {self.accumulation_steps}: resume with the same value, or from a step boundary"
            )
        for key in ("micro_steps", "optimizer_steps", "skipped_steps", "items_seen", "last_grad_norm"):
            setattr(self, key, state[key])
        self.nonfinite_events = [NonFiniteEvent.from_dict(e) for e in state["nonfinite_events"]]
        self._item_scale.load(state.get("item_scale"))
        self._cycle = Cycle.from_state(state["cycle"])
        for p in self._params:
            p.grad = None
        for i, g in (state["pending_grads"] or {}).items():
            self._params[i].grad = g.detach().clone().to(self._params[i].device)
