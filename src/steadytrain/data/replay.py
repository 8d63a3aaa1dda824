"""``global_batch``: replay one optimizer step of the batched global order on one process.

It builds a one-rank batched :class:`~steadytrain.data.sharded.ShardedDataset` (so every argument is
checked as there) and positions it at the step. It lives apart from :mod:`steadytrain.data.batched`,
which ``ShardedDataset`` delegates to, so that neither of those two modules imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain._check import check_int
from steadytrain.data.format import Dataset
from steadytrain.data.sharded import ShardedDataset
from steadytrain.errors import UserError

__all__ = ["global_batch"]


def global_batch(
    path: str | Path | Dataset,
    step: int,
    *,
    global_batch_size: int,
    seed: int,
    epoch: int | None = None,
    shuffle: bool = True,
    shuffle_window: int | None = None,
    shards: list[int] | None = None,
    schema: Any = None,
    policy: str = "raise",
) -> dict[str, Any]:
    """The exact examples of optimizer step ``step``, on one process (replay a step of any world size).

    ``step`` counts optimizer steps from the start of training; with ``epoch`` it counts within that
    epoch. The result holds the step's ``global_batch_size`` examples (``shard``, ``index`` included)
    in global order; every rank's micro-batches of that step together are exactly these examples.
    """
    check_int("step", step, 0)
    ds = ShardedDataset(
        path,
        batch_size=check_int("global_batch_size", global_batch_size),
        shuffle=shuffle,
        seed=seed,
        shuffle_window=shuffle_window,
        shards=shards,
        schema=schema,
        policy=policy,
    )
    spe = ds.steps_per_epoch
    if epoch is None:
        epoch, step = divmod(step, spe)
    elif step >= spe:
        raise UserError(f"step={step} is past the {spe} optimizer steps of an epoch")
    ds.set_epoch(epoch)
    ds._mode.micro = step
    return next(iter(ds))
