"""The examples of a shard whose own loss is out of line with the other shards' (``spikes hunt``).

The spike's counterpart of the non-finite sweep in :mod:`.hunt`: the run's model (with the weights the
first spike involving the shard started from) computes every example's loss, in eval mode and without
gradients, over the suspect shard and over reference shards (the healthy ones: provenance of the
majority). An example is an outlier when its loss exceeds the reference losses' median by more than
``threshold`` median absolute deviations *and* is at least ``min_ratio`` times that median: the run's own
spike rule (``spike.threshold``, ``spike.min_ratio``), applied to single examples against healthy ones.

References:
    Hampel's median/MAD outlier rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from steadytrain.errors import UserError

__all__ = ["REFERENCE_SHARDS", "example_losses", "loss_outliers"]

REFERENCE_SHARDS = 4
"""Healthy shards whose examples set what a normal loss is (a few thousand examples is plenty)."""


def example_losses(model: nn.Module, batch: dict[str, Any], chunk: int) -> np.ndarray:
    """Every example's loss (float64), ``chunk`` examples per forward pass; one host read per chunk."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    n = len(batch["index"])
    out = np.empty(n, dtype=np.float64)
    with torch.no_grad():
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            sub = {
                k: (v[start:stop].to(device) if isinstance(v, torch.Tensor) else v[start:stop])
                for k, v in batch.items()
            }
            losses = model(sub)
            if not isinstance(losses, torch.Tensor) or losses.shape != (stop - start,):
                got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise UserError(
                    f"the model returned {got} for {stop - start} examples: finding outlying examples needs a model "
                    "that returns per-example losses (forward(batch) -> tensor [batch])"
                )
            out[start:stop] = losses.double().cpu().numpy()
    return out


def loss_outliers(
    losses: np.ndarray, reference: np.ndarray, *, threshold: float, min_ratio: float
) -> tuple[np.ndarray, float]:
    """Positions of ``losses`` beyond the limit set by ``reference`` (see the module docstring), and the limit.

    Example:
        >>> ref = np.array([1.0, 2.0, 3.0])  # median 2, MAD 1: the limit is max(2 + 10 x 1, 3 x 2)
        >>> rows, limit = loss_outliers(np.array([1.0, 50.0, 2.0]), ref, threshold=10, min_ratio=3)
        >>> rows.tolist(), limit
        ([1], 12.0)
    """
    ref = reference[np.isfinite(reference)]
    if not len(ref):
        raise UserError("no reference example has a finite loss: nothing to compare the shard's losses with")
    med = float(np.median(ref))
    mad = float(np.median(np.abs(ref - med)))
    limit = max(med + threshold * mad, min_ratio * med)
    bad = np.isfinite(losses) & (losses > med + threshold * mad) & (losses >= min_ratio * med)
    return np.flatnonzero(bad | ~np.isfinite(losses)), limit
