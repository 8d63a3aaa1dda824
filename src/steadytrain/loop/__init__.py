"""Your own training loop with steadytrain's guarantees: :class:`Run` writes the run directory every command reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._lazy import export_lazily

if TYPE_CHECKING:
    from steadytrain.loop.run import Run

__all__ = ["Run"]

export_lazily(__name__, {"Run": "steadytrain.loop.run"})
