"""``ShardedDataset``: whole shards to ranks, deterministically per epoch; every example knows its shard.

Shards (not examples) are assigned: rank ``r`` of ``W`` takes every ``W``-th shard of the epoch's
order, and a rank's DataLoader workers split its shards the same way. So a NaN traced to an example
always names one shard, one rank, one position. Each yielded example is a dict of the columns plus
``shard`` and ``index`` (the row in that shard's file). The position in the epoch is kept in
``state_dict()`` so a resumed run yields exactly the remaining examples.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from steadytrain.data.checks import PolicyCounts, apply_policy
from steadytrain.data.format import CorruptShardError, Dataset, DatasetError, open_dataset
from steadytrain.data.schema import POLICIES

__all__ = ["ShardedDataset", "assign_shards", "collate_examples"]

_ROWS_PER_CHUNK = 8192  # rows converted to Python at a time: bounded memory on large shards


def assign_shards(
    shard_ids: list[int], *, rank: int, world_size: int, epoch: int, seed: int, shuffle: bool
) -> list[int]:
    """The shards rank ``rank`` reads in ``epoch``: disjoint across ranks, together all of them.

    Example:
        >>> assign_shards([0, 1, 2, 3, 4], rank=1, world_size=2, epoch=0, seed=0, shuffle=False)
        [1, 3]
    """
    order = sorted(shard_ids)
    if shuffle:
        order = [order[i] for i in np.random.default_rng([seed, epoch]).permutation(len(order))]
    return order[rank::world_size]


class ShardedDataset(IterableDataset):
    """Iterate a sharded Parquet dataset on one rank, with provenance, validation and exact resume.

    Args:
        path: a dataset directory (see :class:`~steadytrain.data.DatasetWriter`) or an opened ``Dataset``.
        rank: this data-parallel rank.
        world_size: data-parallel ranks.
        shuffle: shuffle the shard order and the examples within each shard, per epoch.
        seed: the shuffle seed (the same on every rank).
        epoch: the epoch to start at (also :meth:`set_epoch`).
        shards: restrict to these shard ids (e.g. ``[47]`` to replay one shard).
        schema: a :class:`~steadytrain.data.Schema` applied at load time with ``policy``.
        policy: ``raise`` (an error naming shard, example, field and value), ``drop`` or ``clamp``.
        skip_corrupt: skip (with a warning, listed in ``skipped_shards``) a shard whose checksum or
            size does not match the index, instead of raising.
        verify: check each shard's sha256 once per process before reading it.

    Raises:
        ValueError: bad rank/world size/policy, or unknown shard ids.
    """

    def __init__(
        self,
        path: str | Path | Dataset,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        shards: list[int] | None = None,
        schema: Any = None,
        policy: str = "raise",
        skip_corrupt: bool = False,
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.dataset = path if isinstance(path, Dataset) else open_dataset(path)
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is unknown: use one of {', '.join(POLICIES)}")
        known = set(self.dataset.shard_ids)
        if shards is not None:
            unknown = sorted(set(shards) - known)
            if unknown:
                raise DatasetError(f"{self.dataset.path}: shards={unknown} are not in the index")
        self.shard_ids = sorted(shards) if shards is not None else sorted(known)
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.schema, self.policy, self.skip_corrupt, self.verify = schema, policy, skip_corrupt, verify
        self.epoch = epoch
        self._shard_pos = 0  # shards of this rank's epoch order fully consumed
        self._row_base, self._chunk = 0, None  # examples yielded from the current shard (see _row)
        self.counts = PolicyCounts()  # rows dropped / clamped by the load-time policy, per field and kind
        self.skipped_shards: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a new shard order when shuffling)."""
        self.epoch, self._shard_pos, self._row = epoch, 0, 0

    def rank_shards(self, epoch: int | None = None) -> list[int]:
        """The shards this rank reads in ``epoch`` (default: the current one), in order."""
        return assign_shards(
            self.shard_ids,
            rank=self.rank,
            world_size=self.world_size,
            epoch=self.epoch if epoch is None else epoch,
            seed=self.seed,
            shuffle=self.shuffle,
        )

    def __len__(self) -> int:
        """Examples of this rank's shards in the current epoch, before any are dropped."""
        return sum(self.dataset.shard(s).records for s in self.rank_shards())

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: resuming yields exactly the examples not yet yielded."""
        return {
            "epoch": self.epoch,
            "shard_pos": self._shard_pos,
            "row": self._row,
            "seed": self.seed,
            "counts": dataclasses.asdict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint seed {state['seed']} != dataset seed {self.seed}: resume with the same seed")
        self.epoch, self._shard_pos, self._row = state["epoch"], state["shard_pos"], state["row"]
        self.counts = PolicyCounts(**state["counts"]) if "counts" in state else PolicyCounts()

    def _load(self, sid: int) -> tuple[pa.Table, np.ndarray] | None:
        try:
            table = self.dataset.read_shard(sid, verify=self.verify)
        except CorruptShardError as err:
            if not self.skip_corrupt:
                raise
            warnings.warn(f"skipping corrupt {err}", stacklevel=3)
            self.skipped_shards.append(sid)
            return None
        indices = np.arange(table.num_rows, dtype=np.int64)
        if self.schema is not None:
            table, indices, counts = apply_policy(table, self.schema, self.policy, shard=sid)
            self.counts.add(counts)
        return table, indices

    @property
    def _row(self) -> int:
        """Examples yielded from the current shard: read off the live chunk iterator, no per-row count."""
        if self._chunk is None:
            return self._row_base
        base, size, it = self._chunk
        return base + size - operator.length_hint(it)

    @_row.setter
    def _row(self, value: int) -> None:
        self._row_base, self._chunk = value, None

    def _prepare(self, sid: int, table: pa.Table, indices: np.ndarray) -> pa.Table:
        """The shard's table in this epoch's order, with ``shard`` and ``index`` columns added."""
        n = table.num_rows
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch, sid]).permutation(n)
            table, indices = table.take(pa.array(order)), indices[order]
        table = table.append_column("shard", pa.array(np.full(n, sid, dtype=np.int64)))
        return table.append_column("index", pa.array(indices))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        wid, nworkers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        if nworkers > 1 and (self._shard_pos or self._row):
            raise RuntimeError("resuming mid-epoch needs num_workers <= 1 (each worker has its own position)")
        order = self.rank_shards()[wid::nworkers]
        for pos in range(self._shard_pos, len(order)):
            loaded = self._load(order[pos])
            if loaded is not None:
                table = self._prepare(order[pos], *loaded)
                start = self._row
                for batch in table.slice(start).to_batches(_ROWS_PER_CHUNK):
                    rows = batch.to_pylist()
                    it = iter(rows)
                    self._chunk = (start, len(rows), it)
                    yield from it  # C-level delegation: no Python work per example, one generator deep
                    start += len(rows)
            self._shard_pos, self._row = pos + 1, 0


def collate_examples(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack a list of example dicts into tensors per column (``shard`` and ``index`` included)."""
    out: dict[str, Any] = {}
    for key in examples[0]:
        values = [e[key] for e in examples]
        try:
            out[key] = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            out[key] = values  # strings, ragged lists: left as a list
    return out
