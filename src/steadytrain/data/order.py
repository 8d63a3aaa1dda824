"""The global example order of an epoch, the same for any world size, accumulation or micro-batch size.

For epoch ``e`` the order is a function of the shards' sizes, ``seed`` and ``e`` alone:

1. the shard ids are permuted with ``rng(seed, e)`` (sorted ids when not shuffling);
2. consecutive groups of ``window`` shards of that order form *windows*;
3. the rows of a window (shard by shard, after the load-time schema policy) are permuted with
   ``rng(seed, e, window number)``;
4. the epoch's sequence is the windows one after another; its first ``steps · G`` positions are
   used (``G = B · K · W``) and the remainder ``N mod G`` is dropped.

Optimizer step ``s`` consumes positions ``[s·G, (s+1)·G)``; within it, rank ``r``'s micro-batch ``k``
(of ``K``) holds the ``B`` positions from ``s·G + (r·K + k)·B``. The split of a step between ranks and
micro-batches is the only thing that depends on ``W``, ``K`` and ``B``, so the examples of every step
are the same for (W=1, K=4), (W=2, K=2) and (W=4, K=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from steadytrain._check import check_int
from steadytrain.errors import UserError

__all__ = ["GlobalLayout", "epoch_windows", "window_permutation"]


@dataclass(frozen=True)
class GlobalLayout:
    """How one optimizer step's ``G = B·K·W`` global positions split into micro-batches.

    Example:
        >>> lay = GlobalLayout(batch_size=2, accumulation_steps=3, world_size=2)
        >>> lay.global_batch_size, lay.micro_batch_start(step=1, micro=2, rank=1)
        (12, 22)
    """

    batch_size: int
    accumulation_steps: int
    world_size: int

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_int("accumulation_steps", self.accumulation_steps)
        check_int("world_size", self.world_size)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.accumulation_steps * self.world_size

    def micro_batch_start(self, *, step: int, micro: int, rank: int) -> int:
        """First global position of rank ``rank``'s micro-batch ``micro`` in optimizer step ``step``."""
        return step * self.global_batch_size + (rank * self.accumulation_steps + micro) * self.batch_size

    def rank_ranges(self, rank: int, first_micro: int, num_steps: int) -> list[tuple[int, int, int]]:
        """``(micro-batch number, start, stop)`` of this rank's micro-batches from ``first_micro`` on."""
        k = self.accumulation_steps
        out = []
        for m in range(first_micro, num_steps * k):
            start = self.micro_batch_start(step=m // k, micro=m % k, rank=rank)
            out.append((m, start, start + self.batch_size))
        return out


def epoch_windows(shard_ids: list[int], *, seed: int, epoch: int, shuffle: bool, window: int) -> list[list[int]]:
    """The epoch's shard order cut into windows of ``window`` shards (the last may be shorter).

    Example:
        >>> epoch_windows([3, 1, 2, 0], seed=0, epoch=0, shuffle=False, window=3)
        [[0, 1, 2], [3]]
    """
    check_int("shuffle_window", window)
    order = sorted(shard_ids)
    if shuffle:
        order = [order[i] for i in np.random.default_rng([seed, epoch]).permutation(len(order))]
    return [order[i : i + window] for i in range(0, len(order), window)]


def window_permutation(n: int, *, seed: int, epoch: int, window_index: int, shuffle: bool) -> np.ndarray | None:
    """The order of a window's ``n`` rows (``None``: as read)."""
    if not shuffle:
        return None
    return np.random.default_rng([seed, epoch, window_index, 1]).permutation(n)


def check_layout_fits(layout: GlobalLayout, num_examples: int, where: str) -> int:
    """Optimizer steps per epoch; a :class:`UserError` if not even one global batch fits."""
    g = layout.global_batch_size
    if num_examples < g:
        raise UserError(
            f"{where}: global batch {g} (batch_size {layout.batch_size} x accumulation_steps "
            f"{layout.accumulation_steps} x world_size {layout.world_size}) is larger than the {num_examples} "
            "examples of an epoch: lower one of them"
        )
    return num_examples // g
