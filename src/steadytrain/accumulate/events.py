"""What the end of a cycle reports: :class:`StepResult` always, :class:`NonFiniteEvent` when it refused to step.

``NonFiniteEvent`` is the one record of a refused step in steadytrain: the training loop writes it
to the run's non-finite ledger and ``diagnose`` reads it back, so its fields are a contract. A step
is refused for one of the :data:`REASONS`: a non-finite global gradient norm (the classic NaN/inf), a
non-finite loss on some rank whose gradients stayed finite (a cross-entropy over only ``ignore_index``
targets is NaN with zero gradients), or item counts that cannot normalize a gradient (a negative or
non-finite ``num_items`` on some micro-batch of some rank, or a cycle holding no items at all).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from steadytrain.errors import UserError

__all__ = [
    "INVALID_ITEMS",
    "NONFINITE_LOSS",
    "NONFINITE_NORM",
    "NO_ITEMS",
    "ON_NONFINITE",
    "REASONS",
    "SPIKE",
    "NonFiniteEvent",
    "NonFiniteGradientError",
    "StepResult",
    "UsageError",
]

ON_NONFINITE = ("skip", "raise", "ignore")

NONFINITE_NORM = "nonfinite_grad_norm"
"""The global gradient norm was NaN or inf."""
NONFINITE_LOSS = "nonfinite_loss"
"""Some micro-batch's loss was NaN or inf on some rank while the global gradient norm was finite: the loss carried
no gradient of its non-finite part (every target ``ignore_index``, a detached NaN term). Stepping would train on a
batch whose loss says it is broken."""
INVALID_ITEMS = "invalid_num_items"
"""Some micro-batch on some rank gave a negative, NaN or infinite ``num_items``."""
NO_ITEMS = "no_items"
"""The cycle held 0 items over all ranks: there is no mean to step on."""
SPIKE = "spike"
"""The step's loss or gradient norm was far out of line with the previous steps' (:mod:`steadytrain.guard`), and
the caller's ``veto`` refused it: a finite step, recorded with the spike ledger, never raised."""
REASONS = (NONFINITE_NORM, NONFINITE_LOSS, INVALID_ITEMS, NO_ITEMS, SPIKE)

_EXPLAIN = {
    NONFINITE_NORM: "non-finite global gradient norm",
    NONFINITE_LOSS: "non-finite loss on some rank (every target ignore_index? a NaN term without a gradient?)",
    INVALID_ITEMS: "a negative, NaN or infinite num_items on some micro-batch of some rank "
    "(give each micro-batch its count of items, >= 0)",
    NO_ITEMS: "the cycle held 0 items on every rank (there is no mean to step on)",
    SPIKE: "loss spike (far above the running median)",
}


class NonFiniteGradientError(RuntimeError):
    """A step was refused (non-finite norm or loss, or invalid item counts) and ``on_nonfinite="raise"``."""


class UsageError(UserError, RuntimeError):
    """The accumulator used out of order (a second ``backward``, nested blocks, a block without a backward,
    a loss that cannot be backwarded): a :class:`UserError`, and a ``RuntimeError`` as before."""


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
    """Items of the cycle summed over all ranks, when ``num_items`` was given (as read, even if invalid)."""


@dataclass(frozen=True)
class NonFiniteEvent:
    """A cycle that did not step: why, and what was in play on this rank.

    Example:
        >>> e = NonFiniteEvent(cycle=3, rank=0, grad_norm=float("nan"), micro_steps=(12, 15),
        ...                    nonfinite_micro_batches=(2,))
        >>> e.reason, e.action
        ('nonfinite_grad_norm', 'skip')
    """

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
    """``skip`` or ``raise``: what the accumulator did."""
    reason: str = NONFINITE_NORM
    """One of :data:`REASONS`: why the step was refused."""
    num_items: float | None = None
    """The cycle's global item total as read (NaN or negative when ``reason`` is about items)."""
    batch: int | None = None
    """The global batch (0-based, over epochs) the cycle trained on, when the caller knows it: after a spike's
    rollback the same optimizer step number trains on another batch."""

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (JSON-friendly if the tags are) that :meth:`from_dict` reads back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NonFiniteEvent:
        """The inverse of :meth:`as_dict`; records written before ``reason`` existed read as a norm event."""
        return cls(**{**data, "micro_steps": tuple(data["micro_steps"]), "tags": tuple(data.get("tags", ()))})

    def message(self, optimizer_step: int | None = None) -> str:
        """One sentence for logs and :class:`NonFiniteGradientError`: what, where, and the suspects.

        Args:
            optimizer_step: the optimizer step the cycle would have made, when known.
        """
        first, last = self.micro_steps
        suspects = list(self.nonfinite_micro_batches) or "none"
        what = _EXPLAIN.get(self.reason, self.reason)
        if self.reason == NONFINITE_NORM:
            what = f"{what} {self.grad_norm}"
        elif self.reason in (SPIKE, NONFINITE_LOSS):
            what = f"step refused: {what}; global gradient norm {self.grad_norm:.4g}"
        else:
            what = f"step refused: {what} (global num_items total {self.num_items})"
        where = f" at optimizer step {optimizer_step}" if optimizer_step is not None else ""
        return (
            f"{what}{where} (cycle {self.cycle}, micro-steps {first}-{last}, rank {self.rank}); "
            f"micro-batches with a non-finite local loss: {suspects}"
        )
