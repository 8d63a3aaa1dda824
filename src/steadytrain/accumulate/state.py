"""The accumulator's state between micro-batches: the open cycle, and its checkpoint form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from steadytrain.accumulate.normalize import ItemCounts

__all__ = ["Cycle"]


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
        return tuple(flags.nonzero().flatten().tolist())

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
