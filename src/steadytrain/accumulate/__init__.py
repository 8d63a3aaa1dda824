"""Gradient accumulation that equals one big batch, with one gradient sync per optimizer step.

``GradientAccumulator`` runs in the user's own loop. Per micro-batch the user does forward and
``mb.backward(loss)`` inside ``with acc.micro_batch(...)``; the accumulator

* normalizes: without item counts every micro-batch weighs equally (the seed's divide-by-K; a
  partial cycle divides by what it held); with ``num_items`` the gradient is the exact mean over
  every item of the cycle on every rank (the item count is all-reduced once per cycle and 1/N is
  folded into the step, so no host sync happens per micro-batch) — :mod:`.normalize`;
* synchronizes once: under DDP ``no_sync`` (under FSDP2 ``set_requires_gradient_sync(False)``)
  covers forward and backward of every micro-batch but the last of a cycle — :mod:`.sync`;
* at the end of a cycle, in order: unscale (fp16 ``GradScaler``), one global norm, clip, one
  decision read with one host sync (identical on all ranks: the norm is computed from synchronized
  or mesh-reduced gradients, the item counts are all-reduced), ``optimizer.step()``,
  ``scheduler.step()``, ``zero_grad()`` — each once — :mod:`.step`;
* refuses a step whose norm is not finite or whose item counts cannot normalize it, and records a
  :class:`NonFiniteEvent` saying why — :mod:`.events`.

For fused torch optimizers (``fused=True`` Adam/AdamW/SGD) the normalization and clip coefficient
are handed to the optimizer as ``grad_scale`` (the contract ``torch.amp.GradScaler`` uses), so the
gradients are read once for the norm and once by the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._lazy import export_lazily

if TYPE_CHECKING:
    from steadytrain.accumulate.accumulator import GradientAccumulator, MicroBatch
    from steadytrain.accumulate.events import (
        ON_NONFINITE,
        NonFiniteEvent,
        NonFiniteGradientError,
        StepResult,
        UsageError,
    )

__all__ = [
    "ON_NONFINITE",
    "GradientAccumulator",
    "MicroBatch",
    "NonFiniteEvent",
    "NonFiniteGradientError",
    "StepResult",
    "UsageError",
]

# each name's submodule, imported on the name's first use: reading a ledger's events does not import torch
export_lazily(
    __name__,
    {
        "GradientAccumulator": "accumulator",
        "MicroBatch": "accumulator",
        "ON_NONFINITE": "events",
        "NonFiniteEvent": "events",
        "NonFiniteGradientError": "events",
        "StepResult": "events",
        "UsageError": "events",
    },
)
