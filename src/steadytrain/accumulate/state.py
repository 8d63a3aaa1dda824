"""The accumulator's state between micro-batches: the open cycle, and its checkpoint form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from steadytrain._check import check_int
from steadytrain._io import brief
from steadytrain.accumulate.normalize import ItemCounts
from steadytrain.errors import UserError

__all__ = ["Cycle", "check_state"]

STATE_KEYS = (
    "accumulation_steps",
    "micro_steps",
    "optimizer_steps",
    "skipped_steps",
    "items_seen",
    "last_grad_norm",
    "nonfinite_events",
    "cycle",
    "pending_grads",
)
CYCLE_KEYS = ("micro", "items", "use_items", "losses", "tags", "synced")
_FIX = "pass what GradientAccumulator.state_dict() returned, for this model"


@dataclass
class Cycle:
    """The micro-batches of the cycle in progress on this rank."""

    micro: int = 0
    """Micro-batches recorded so far (each one's gradient is in ``.grad``)."""
    use_items: bool | None = None
    items: ItemCounts = field(default_factory=ItemCounts)
    losses: list[Tensor] = field(default_factory=list)
    """Each micro-batch's detached (unnormalized) loss, for the non-finite record."""
    tags: list[Any] = field(default_factory=list)
    synced: bool = True
    """Whether the last micro-batch ran with gradient sync on."""

    def add(self, loss: Tensor, tag: Any, num_items: float | Tensor | None, *, synced: bool) -> None:
        """Record a micro-batch whose backward completed."""
        self.use_items = num_items is not None
        self.micro += 1
        self.synced = synced
        self.losses.append(loss)
        self.tags.append(tag)
        if num_items is not None:
            self.items.add(num_items)

    def nonfinite_positions(self) -> tuple[int, ...]:
        """Positions whose local loss was not finite (a host sync: only called for a refused step)."""
        if not self.losses:
            return ()
        flags = torch.stack([~torch.isfinite(loss.to(self.losses[0].device)) for loss in self.losses])
        return tuple(flags.nonzero().flatten().tolist())  # host read: the ledger records the refused positions

    def to_state(self) -> dict[str, Any]:
        """A plain dict (reads device values: call it at checkpoint time, not per step)."""
        items, invalid = self.items.to_state() if self.use_items else (None, 0)
        return {
            "micro": self.micro,
            "items": items,
            "invalid_items": invalid,
            "use_items": self.use_items,
            "losses": [float(x) for x in self.losses],
            "tags": list(self.tags),
            "synced": self.synced,
        }

    @classmethod
    def from_state(cls, c: dict[str, Any]) -> Cycle:
        items = ItemCounts(python=c["items"] or 0.0, invalid=c.get("invalid_items", 0))
        return cls(
            micro=c["micro"],
            use_items=c["use_items"],
            items=items,
            losses=[torch.tensor(x) for x in c["losses"]],
            tags=list(c["tags"]),
            synced=c["synced"],
        )


def _keys(value: Any, keys: tuple[str, ...], prefix: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"accumulator state: {prefix or 'the state'}={brief(value)} is not a dict; {_FIX}")
    missing = [prefix + k for k in keys if k not in value]
    if missing:
        raise UserError(f"accumulator state: no {', '.join(missing)} (a partial state?); {_FIX}")
    return value


def check_state(state: Any, params: list[tuple[str, Tensor]]) -> None:
    """Whether ``state`` is one :meth:`GradientAccumulator.load_state_dict` can restore into a model with the
    trainable ``(name, parameter)`` pairs ``params``: every key there, the counters integers, every pending gradient
    one of these parameters' with its shape and dtype. Else one :class:`UserError` naming the key (and for a
    gradient the parameter, the saved shape and the model's), before anything is changed."""
    _keys(state, STATE_KEYS, "")
    for key in ("accumulation_steps", "micro_steps", "optimizer_steps", "skipped_steps"):
        check_int(f"accumulator state: {key}", state[key], int(key == "accumulation_steps"))
    check_int("accumulator state: cycle.micro", _keys(state["cycle"], CYCLE_KEYS, "cycle.")["micro"], 0)
    if not isinstance(state["nonfinite_events"], list):
        raise UserError(f"accumulator state: nonfinite_events={brief(state['nonfinite_events'])} is not a list; {_FIX}")
    pending = state["pending_grads"]
    if pending is None:
        return
    if not isinstance(pending, dict):
        raise UserError(f"accumulator state: pending_grads={brief(pending)} is not a dict; {_FIX}")
    for i, grad in pending.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(params):
            raise UserError(
                f"accumulator state: pending_grads[{brief(i)}]: this model has {len(params)} trainable parameters "
                f"(0 to {len(params) - 1}): the state is of another model; {_FIX}"
            )
        name, param = params[i]
        if not isinstance(grad, Tensor):
            raise UserError(f"accumulator state: pending_grads[{i}] (parameter {name!r}) is not a tensor; {_FIX}")
        if grad.shape != param.shape or grad.dtype != param.dtype:
            raise UserError(
                f"accumulator state: pending_grads[{i}] (parameter {name!r}): saved shape {tuple(grad.shape)} "
                f"{grad.dtype}, this model's {tuple(param.shape)} {param.dtype}: the state is of another model; {_FIX}"
            )
