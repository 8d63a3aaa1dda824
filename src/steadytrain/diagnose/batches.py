"""The examples a replay runs: one optimizer step's global batch or one shard's rows, as training loaded them.

A replay (``nan hunt``, ``spikes hunt``, ``triage``) must see exactly the examples the run saw: the same order,
load-time policy, transform and held-out rows, and, after spike rollbacks, the later batches a step moved on to.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from steadytrain.data import BatchedDataset, global_batch
from steadytrain.diagnose.settings import ReplaySettings

__all__ = ["batch_of", "shard_batch", "step_batch", "take_rows"]


def take_rows(batch: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """The examples ``rows`` (positions, ascending) of ``batch``: every field, tensors and lists alike."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run (the sweep's chunks): views
        a, b = int(rows[0]), int(rows[-1]) + 1
        return {k: v[a:b] for k, v in batch.items()}
    idx = torch.from_numpy(rows)
    return {k: v[idx] if isinstance(v, Tensor) else [v[i] for i in rows] for k, v in batch.items()}


def shard_batch(settings: ReplaySettings, shard: int) -> dict[str, Any]:
    """The shard's rows as the run loaded them (after its load-time policy), in file order, as one batch."""
    common = {"shards": [shard], "shuffle": False, "schema": settings.schema, "policy": settings.policy}
    rows = len(BatchedDataset(settings.data, batch_size=1, **common))  # rows the policy keeps
    transform = settings.transform  # the run's data.transform, as training applied it
    return global_batch(settings.data, 0, global_batch_size=rows, seed=0, transform=transform, **common)


def batch_of(step: int, skipped: list[int]) -> int:
    """The global batch (0-based) optimizer ``step`` trained on: the ``step``-th of those not ``skipped`` (spike
    rollbacks pass batches over, so later steps train on later batches).

    Example:
        >>> batch_of(41, []), batch_of(41, [40]), batch_of(39, [40]), batch_of(42, [40, 41])
        (40, 41, 38, 43)
    """
    b = step - 1
    for x in sorted(skipped):
        if x <= b:
            b += 1
    return b


def step_batch(settings: ReplaySettings, step: int) -> dict[str, Any]:
    """The global batch optimizer ``step`` (1-based) trained on, rollbacks' skipped batches accounted for."""
    if settings.mixture is not None:
        return settings.mixture.batch(batch_of(step, settings.skipped_batches))
    return global_batch(
        settings.data,
        batch_of(step, settings.skipped_batches),
        global_batch_size=settings.global_batch_size,
        seed=settings.seed,
        shuffle_window=settings.shuffle_window,
        shards=settings.shards,
        schema=settings.schema,
        policy=settings.policy,
        transform=settings.transform,
        rows=settings.rows,  # records held out for validation: never in a step
    )
