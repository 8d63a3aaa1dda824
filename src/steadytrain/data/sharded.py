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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from steadytrain._check import check_int
from steadytrain._io import brief
from steadytrain.data.batched import BatchedDataset
from steadytrain.data.columns import ColumnGuard, check_reader_args, select_shards
from steadytrain.data.format import CorruptShardError, Dataset, DatasetError, open_dataset
from steadytrain.data.policy import PolicyCounts, apply_policy
from steadytrain.errors import UserError

__all__ = ["ShardedDataset", "assign_shards", "collate_examples", "select_shards"]

_ROWS_PER_CHUNK = 8192  # rows converted to Python at a time: bounded memory on large shards


def _refuse_batched_options(accumulation_steps: object, shuffle_window: object, transform: object) -> None:
    """Batched-mode options given to the per-example mode would be silently ignored: refuse them."""
    given = {"accumulation_steps": accumulation_steps != 1, "shuffle_window": shuffle_window is not None}
    given["transform"] = transform is not None
    if name := next((n for n, g in given.items() if g), None):
        raise UserError(
            f"{name} is an option of the batched mode and would be ignored: give batch_size=B "
            "(micro-batches in the global order), or leave it out"
        )


def _refuse_empty_ranks(world_size: int, shards: int, path: object) -> None:
    """More ranks than shards leave some ranks without a shard: refused on every rank (the ranks with shards would
    wait for the others in their first collective), before anything is read."""
    if world_size <= shards:
        return
    empty = f"rank {shards}" if shards == world_size - 1 else f"ranks {shards}-{world_size - 1}"
    raise UserError(
        f"world_size={world_size} is more ranks than the {shards} shard(s) selected in {brief(str(path))}: whole "
        f"shards go to ranks, so {empty} would get no examples (a rank without examples stalls the others' "
        f"collectives): use at most {shards} ranks, write the data in at least {world_size} shards, or give "
        "batch_size=B (the batched mode splits examples, not shards)"
    )


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
        batch_size: ``B``: construct a :class:`~steadytrain.data.batched.BatchedDataset` instead, which
            yields micro-batches of ``B`` examples in the global order of :mod:`steadytrain.data.order`,
            the same for any world size (``accumulation_steps``, ``shuffle_window`` and ``transform`` are
            its options); ``None`` (default) yields one dict per example, whole shards per rank.

    Raises:
        UserError: bad rank/world size/policy/seed/epoch, a flag that is not a bool, a batched-mode option
            (``accumulation_steps``, ``shuffle_window``, ``transform``) without ``batch_size`` (a ``ValueError``),
            or more ranks (``world_size``) than selected shards: some ranks would get no examples.
        DatasetError: shard ids twice, or not in the index; when read, a shard whose columns or types differ
            from the first selected shard's.
    """

    def __new__(cls, path: Any = None, *, batch_size: int | None = None, skip_corrupt: bool = False, **kwargs: Any):
        """``batch_size=B`` builds the batched reader of the global order (training); ``None`` this one."""
        if batch_size is None:
            return super().__new__(cls)
        if skip_corrupt:
            raise UserError("skip_corrupt needs the per-example mode: in batched mode select shards with shards=[...]")
        return BatchedDataset(path, batch_size=batch_size, **kwargs)

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
        batch_size: int | None = None,
        accumulation_steps: int = 1,
        shuffle_window: int | None = None,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        check_reader_args(
            rank=rank, world_size=world_size, seed=seed, epoch=epoch, policy=policy,
            flags={"shuffle": shuffle, "skip_corrupt": skip_corrupt, "verify": verify},
        )  # fmt: skip
        _refuse_batched_options(accumulation_steps, shuffle_window, transform)
        self.dataset = path if isinstance(path, Dataset) else open_dataset(path)
        self.shard_ids = select_shards(self.dataset, shards)
        _refuse_empty_ranks(world_size, len(self.shard_ids), self.dataset.path)
        self.columns = ColumnGuard(self.dataset, self.shard_ids, verify=verify, skip_corrupt=skip_corrupt)
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, bool(shuffle), seed
        self.schema, self.policy, self.skip_corrupt, self.verify = schema, policy, bool(skip_corrupt), bool(verify)
        self.epoch = epoch
        self._shard_pos = 0  # shards of this rank's epoch order fully consumed
        self._row_base, self._chunk = 0, None  # examples yielded from the current shard (see _row)
        self.counts = PolicyCounts()  # rows dropped / clamped by the load-time policy, per field and kind
        self.skipped_shards: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a new shard order when shuffling)."""
        self.epoch, self._shard_pos, self._row = check_int("epoch", epoch, 0), 0, 0

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

    def _identity(self) -> dict[str, Any]:
        """What a position refers to: the data (ids and checksums), the ranks, the order."""
        return {
            "mode": "example",
            "dataset": self.dataset.fingerprint(self.shard_ids),
            "shards": list(self.shard_ids),
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch, and what it belongs to: resuming yields exactly the examples not yet
        yielded, and :meth:`load_state_dict` refuses a state of other data, ranks or order."""
        return {
            **self._identity(),
            "epoch": self.epoch,
            "shard_pos": self._shard_pos,
            "row": self._row,
            "counts": dataclasses.asdict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position of ``state`` (from :meth:`state_dict` of the same dataset, ranks and seed).

        Raises:
            UserError: the state is malformed, or belongs to another dataset or shard selection, world size,
                rank, seed or shuffle setting (the message names each difference).
        """
        if not isinstance(state, dict):
            raise UserError(f"ShardedDataset state must be a mapping from state_dict(), got {type(state).__name__}")
        mine = self._identity()
        if state.get("mode", "example") != "example":
            raise UserError(f"state is a {brief(state.get('mode'))} state: load it into a dataset of that mode")
        if missing := [k for k in (*mine, "epoch", "shard_pos", "row") if k not in state]:
            raise UserError(f"ShardedDataset state lacks {', '.join(missing)}: not a state_dict() of this version")
        if diffs := [f"{k} {brief(state[k])} != {brief(v)}" for k, v in mine.items() if state[k] != v]:
            raise UserError(
                f"ShardedDataset state belongs to another run ({'; '.join(diffs)}): resume with the same dataset, "
                "shards, world size, rank, seed and shuffle (or start the epoch afresh)"
            )
        epoch = check_int("state epoch", state["epoch"], 0)
        pos = check_int("state shard_pos", state["shard_pos"], 0)
        row = check_int("state row", state["row"], 0)
        order = self.rank_shards(epoch)
        if pos > len(order) or (pos == len(order) and row):
            raise UserError(f"state shard_pos={pos}, row={row} is past the end of the epoch ({len(order)} shards)")
        if pos < len(order) and row > (records := self.dataset.shard(order[pos]).records):
            raise UserError(f"state row={row} is past the end of shard {order[pos]} ({records} records)")
        counts = PolicyCounts.from_state(state["counts"]) if "counts" in state else PolicyCounts()
        self.epoch, self._shard_pos, self._row, self.counts = epoch, pos, row, counts

    def _load(self, sid: int) -> tuple[pa.Table, np.ndarray] | None:
        try:
            table = self.columns.conform(sid, self.dataset.read_shard(sid, verify=self.verify))
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
        """The shard's table in this epoch's order, with ``shard`` and ``index`` columns added (the
        :class:`ColumnGuard` has refused a shard that has its own)."""
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
                if start > table.num_rows:
                    raise DatasetError(
                        f"resumed at row {start} of shard {order[pos]}, which now yields {table.num_rows} examples"
                    )
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
