"""Validation examples for evaluation: one fixed order, disjoint contiguous slices per rank, nothing dropped.

Training drops the examples past the last full global batch and shuffles; evaluation must count
every validation example exactly once, in any world size. The examples are taken in the dataset's
order (shard ids ascending, rows as stored, after the load-time schema policy); the first
``max_examples`` of them (all by default) are split into ``W`` contiguous slices whose sizes differ
by at most one, and each rank reads its slice in micro-batches of ``batch_size``. Every rank runs
:attr:`EvalSet.forwards` forward passes (the most any rank needs), so sharded models, whose forward
passes are collectives, stay in step: a rank with fewer examples gets empty micro-batches at the end,
marked by :attr:`EvalSet.real` (use a copy of a real batch and count none of it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from steadytrain._check import check_int
from steadytrain.data.batched import BatchedDataset
from steadytrain.data.columns import ColumnGuard, schema_differences
from steadytrain.data.format import DatasetError, open_dataset
from steadytrain.data.holdout import RowFilter
from steadytrain.errors import UserError

__all__ = ["EvalSet", "holdout_shards", "rank_slice"]


def holdout_shards(shard_ids: list[int], n: int, seed: int) -> list[int]:
    """``n`` of ``shard_ids`` drawn from ``seed`` alone (any world size draws the same), sorted.

    Example:
        >>> holdout_shards(list(range(10)), 2, seed=0) == holdout_shards(list(range(10)), 2, seed=0)
        True
    """
    ids = sorted(shard_ids)
    if check_int("holdout shards", n) >= len(ids):
        raise UserError(
            f"holding out {n} of the dataset's {len(ids)} shards leaves none to train on: hold out fewer "
            "(eval.holdout_shards) or give a separate validation set (eval.data)"
        )
    picked = np.random.default_rng([seed, 0x5EED]).choice(len(ids), size=n, replace=False)
    return sorted(ids[i] for i in picked)


def rank_slice(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``n`` positions: disjoint, contiguous, together all of them.

    Example:
        >>> [rank_slice(10, r, 4) for r in range(4)]
        [(0, 2), (2, 5), (5, 7), (7, 10)]
    """
    return n * rank // world_size, n * (rank + 1) // world_size


class EvalSet:
    """This rank's validation micro-batches (dicts of columns with ``shard`` and ``index``)."""

    def __init__(
        self,
        path: str | Path,
        *,
        shards: list[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int,
        max_examples: int | None = None,
        schema: Any = None,
        policy: str = "raise",
        rows: RowFilter | None = None,
    ) -> None:
        """``rows``: read only the rows this filter lets through (records held out of the training shards;
        ``shards`` absent: the shards it names)."""
        check_int("batch_size", batch_size)
        dataset = open_dataset(path)
        if shards is None and rows is not None and rows.keep:
            shards = [s for s in rows.rows if len(rows.rows[s])]
        chosen = sorted(dataset.shard_ids) if shards is None else sorted(shards)
        count = (lambda s: rows.count(s, dataset.shard(s).records)) if rows else (lambda s: dataset.shard(s).records)
        if not chosen or sum(count(s) for s in chosen) == 0:
            raise DatasetError(f"{dataset.path}: the validation set has no examples (shards {chosen})")
        self._data = BatchedDataset(
            dataset, shards=chosen, batch_size=1, shuffle=False, schema=schema, policy=policy, rows=rows
        )  # the global order, read through the one batched reader; this rank's ranges are chosen below
        total = self._data.num_examples
        self.num_examples = total if max_examples is None else min(total, check_int("max_examples", max_examples))
        self.start, self.stop = rank_slice(self.num_examples, rank, world_size)
        self.batch_size = batch_size
        self.forwards = math.ceil(math.ceil(self.num_examples / world_size) / batch_size)
        """Forward passes every rank runs (the largest slice's micro-batches)."""
        self.shard_ids = chosen
        self.dataset = dataset

    def check_fits(self, training: BatchedDataset) -> None:
        """A :class:`DatasetError` when these examples do not have the training data's columns and types."""
        train_id, train_schema = training.columns.reference()
        mine_id, mine = ColumnGuard(self.dataset, self.shard_ids, verify=True).reference()
        if diffs := schema_differences(mine, train_schema, f"the training data (shard {train_id})"):
            raise DatasetError(
                f"{self.dataset.path}: the validation set (shard {mine_id}) does not fit the training data: "
                f"{'; '.join(diffs)}"
            )

    @property
    def real(self) -> int:
        """This rank's micro-batches that hold examples (the rest of :attr:`forwards` are padding)."""
        return math.ceil((self.stop - self.start) / self.batch_size)

    def pad_batch(self) -> dict[str, Any]:
        """The first micro-batch of the whole validation order (what a rank with no examples forwards)."""
        ranges = [(0, 0, min(self.batch_size, self.num_examples))]
        return next(cols for _, cols in self._data.iter_positions(ranges))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This rank's :attr:`real` micro-batches, in order."""
        b = self.batch_size
        ranges = ((i, a, min(a + b, self.stop)) for i, a in enumerate(range(self.start, self.stop, b)))
        for _, cols in self._data.iter_positions(ranges):
            yield cols


class MixedEvalSet:
    """The validation examples of a mixture's sources, one source after another, each batch with a ``source``
    column (the source's number) and mixture shard ids; the interface of :class:`EvalSet`."""

    def __init__(self, parts: list[tuple[int, EvalSet]], names: list[str], offsets: list[int]) -> None:
        self.parts, self.names, self.offsets = parts, list(names), list(offsets)
        self.forwards = sum(p.forwards for _, p in parts)
        self.num_examples = sum(p.num_examples for _, p in parts)

    @property
    def real(self) -> int:
        return sum(p.real for _, p in self.parts)

    def _tagged(self, j: int, batch: dict[str, Any]) -> dict[str, Any]:
        n = len(batch["index"])
        return {**batch, "shard": batch["shard"] + self.offsets[j], "source": torch.full((n,), j, dtype=torch.int64)}

    def pad_batch(self) -> dict[str, Any]:
        j, part = self.parts[0]
        return self._tagged(j, part.pad_batch())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for j, part in self.parts:
            for batch in part:
                yield self._tagged(j, batch)
