"""``BatchedDataset``: columnar micro-batches in one global order for any world size (for training).

``BatchedDataset(path, batch_size=B, accumulation_steps=K, rank=r, world_size=W)`` yields this rank's
micro-batches: dicts of column -> tensor (numeric) or list (strings), with ``shard`` and ``index``
always present. The order is defined globally (see :mod:`steadytrain.data.order`), so:

- every rank yields exactly ``steps_per_epoch · K`` micro-batches per epoch (no DDP hang on uneven
  shards); the remainder ``N mod G`` is dropped and reported as ``dropped_per_epoch``;
- optimizer step ``s`` holds the same examples whatever ``W``, ``K`` and ``B`` are (with ``G`` fixed),
  so a run resumes on another number of ranks, and :func:`global_batch` replays one step on one process.

What each rank reads: every shard of every window it has a micro-batch in (with ``W`` ranks on one
node the shards are read ``W`` times, from the OS page cache after the first). Memory: one window,
``shuffle_window`` shards as Arrow tables (decoded), plus this rank's rows of it. A larger window
shuffles better and costs proportionally more memory; the default, 8 shards, is a few hundred MB for
shards of ~50 MB decoded. Load-time policies that may drop rows (``drop``, ``clamp``) need each
shard's surviving row count before the first step: a counting pass reads the shards once.

The per-example reader, :class:`~steadytrain.data.sharded.ShardedDataset`, shares the column guard and
argument checks of :mod:`steadytrain.data.columns`; this module imports nothing from it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from steadytrain._check import check_int
from steadytrain._io import brief
from steadytrain.data.columnar import concat_columns, split_columns, to_columns
from steadytrain.data.columns import ColumnGuard, check_reader_args, select_shards
from steadytrain.data.format import Dataset, DatasetError, open_dataset
from steadytrain.data.holdout import RowFilter
from steadytrain.data.order import GlobalLayout, check_layout_fits, epoch_windows, window_permutation
from steadytrain.data.policy import PolicyCounts, apply_policy
from steadytrain.data.transform import Transform, apply_transform
from steadytrain.errors import UserError

__all__ = ["DEFAULT_SHUFFLE_WINDOW", "BatchedDataset", "global_batch", "position_state", "resume_position"]

log = logging.getLogger(__name__)

DEFAULT_SHUFFLE_WINDOW = 8  # shards shuffled together
_STATE_KEYS = ("epoch", "micro", "step", "seed", "global_batch_size", "batch_size", "accumulation_steps")
_STATE_KEYS += ("world_size", "shuffle", "shuffle_window", "dataset", "counts")


class BatchedDataset(IterableDataset):
    """This rank's micro-batches of the epoch's global order; the position is kept for an exact resume.

    Args:
        path: a dataset directory or an opened ``Dataset``.
        batch_size: ``B``, examples per micro-batch.
        accumulation_steps: ``K``, micro-batches per optimizer step.
        rank, world_size: this data-parallel rank of ``W``.
        shuffle, seed, epoch: the order (shards shuffled in windows, rows within a window), per epoch.
        shards: restrict to these shard ids.
        schema, policy: a :class:`~steadytrain.data.Schema` applied at load time (``raise | drop | clamp``).
        verify: check each shard's sha256 once per process before reading it.
        shuffle_window: shards whose rows are shuffled together (memory: this many shards; default 8).
        transform: ``transform(mb) -> mb``, a vectorized hook applied to every micro-batch.
        rows: a :class:`~steadytrain.data.holdout.RowFilter`: only the rows it lets through are read (records
            held out for validation), selected by stored row index after the load-time policy.

    Raises:
        UserError: a bad argument (named, with the fix); DatasetError: shards not in the index, or
            an epoch too small for one global batch.
    """

    def __init__(
        self,
        path: str | Path | Dataset,
        *,
        batch_size: int,
        accumulation_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        shards: list[int] | None = None,
        schema: Any = None,
        policy: str = "raise",
        verify: bool = True,
        shuffle_window: int | None = None,
        transform: Transform | None = None,
        rows: RowFilter | None = None,
    ) -> None:
        super().__init__()
        check_reader_args(
            rank=rank, world_size=world_size, seed=seed, epoch=epoch, policy=policy,
            flags={"shuffle": shuffle, "verify": verify},
        )  # fmt: skip
        if transform is not None and not callable(transform):
            raise UserError(f"transform={transform!r} is not callable: give a function mb -> mb")
        self.dataset = path if isinstance(path, Dataset) else open_dataset(path)
        self.shard_ids = select_shards(self.dataset, shards)
        self.layout = GlobalLayout(batch_size, accumulation_steps, world_size)
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, bool(shuffle), seed
        window = DEFAULT_SHUFFLE_WINDOW if shuffle_window is None else shuffle_window
        self.window = check_int("shuffle_window", window)
        self.schema, self.policy, self.transform, self.verify = schema, policy, transform, bool(verify)
        self.rows = rows
        self.columns = ColumnGuard(self.dataset, self.shard_ids, verify=self.verify)
        self.fingerprint = self.dataset.fingerprint(self.shard_ids) + (f"+rows-{rows.digest()}" if rows else "")
        self.counts = PolicyCounts()  # rows dropped / clamped by the load-time policy, per field and kind
        self._rows = self._row_counts()
        total = sum(self._rows.values())
        self.steps_per_epoch = check_layout_fits(self.layout, total, str(self.dataset.path))
        self.dropped_per_epoch = total - self.steps_per_epoch * self.layout.global_batch_size
        self.epoch, self.micro = epoch, 0  # micro-batches of this rank consumed in the epoch

    @property
    def global_batch_size(self) -> int:
        """``G = batch_size x accumulation_steps x world_size``."""
        return self.layout.global_batch_size

    @property
    def num_examples(self) -> int:
        """Examples in an epoch's global order, after the load-time policy."""
        return self.steps_per_epoch * self.layout.global_batch_size + self.dropped_per_epoch

    @property
    def global_step(self) -> int:
        """The global batch (0-based, counted over epochs: ``epoch x steps_per_epoch + step``) that the
        micro-batch yielded last belongs to; a training loop names the batches it skips by it."""
        return self.epoch * self.steps_per_epoch + max(self.micro - 1, 0) // self.layout.accumulation_steps

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a new order when shuffling)."""
        self.epoch, self.micro = check_int("epoch", epoch, 0), 0

    def seek(self, step: int, *, epoch: int | None = None) -> None:
        """Position at optimizer step ``step`` of ``epoch`` (default: counted from the start of training, over
        epochs): the next micro-batch yielded is this rank's first of that step."""
        check_int("step", step, 0)
        if epoch is None:
            epoch, step = divmod(step, self.steps_per_epoch)
        elif step >= self.steps_per_epoch:
            raise UserError(f"step={step} is past the {self.steps_per_epoch} optimizer steps of an epoch")
        self.epoch, self.micro = check_int("epoch", epoch, 0), step * self.layout.accumulation_steps

    def _row_counts(self) -> dict[int, int]:
        """Rows per shard as the order sees them (after a policy that may drop rows)."""
        if self.schema is None or self.policy == "raise":
            records = {sid: self.dataset.shard(sid).records for sid in self.shard_ids}
            return {sid: self.rows.count(sid, n) for sid, n in records.items()} if self.rows else records
        log.info("counting the rows the %s policy keeps in %d shards", self.policy, len(self.shard_ids))
        return {sid: self._read(sid, count=False).num_rows for sid in self.shard_ids}

    def _read(self, sid: int, *, count: bool = True) -> pa.Table:
        table = self.columns.conform(sid, self.dataset.read_shard(sid, verify=self.verify))  # no shard/index
        indices = np.arange(table.num_rows, dtype=np.int64)
        if self.schema is not None:
            table, indices, counts = apply_policy(table, self.schema, self.policy, shard=sid)
            if count:
                self.counts.add(counts)
        if self.rows is not None:
            mask = self.rows.passes(sid, indices)
            table, indices = table.filter(pa.array(mask)), indices[mask]
        table = table.append_column("shard", pa.array(np.full(table.num_rows, sid, dtype=np.int64)))
        return table.append_column("index", pa.array(indices, type=pa.int64()))

    def _load_window(self, shards: list[int]) -> pa.Table:
        tables = [self._read(sid) for sid in shards]
        for sid, t in zip(shards, tables, strict=True):
            if t.num_rows != self._rows[sid]:
                raise DatasetError(f"shard {sid}: {t.num_rows} rows now, {self._rows[sid]} when counted (changed?)")
        return pa.concat_tables(tables, promote_options="none") if len(tables) > 1 else tables[0]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.layout.accumulation_steps

    def _my_micro_batches(self, wid: int, nworkers: int) -> Iterator[tuple[int, int, int]]:
        """``(m, start, stop)`` of this rank's (and worker's) remaining micro-batches, in order."""
        k, first = self.layout.accumulation_steps, self.micro
        for m in range(first, len(self)):
            if (m - first) % nworkers == wid:
                start = self.layout.micro_batch_start(step=m // k, micro=m % k, rank=self.rank)
                yield m, start, start + self.layout.batch_size

    def iter_columns(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(micro-batch number, columns)`` of this rank's remaining micro-batches in the epoch."""
        worker = get_worker_info()
        wid, nworkers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        return self.iter_positions(self._my_micro_batches(wid, nworkers))

    def iter_positions(self, ranges: Iterable[tuple[int, int, int]]) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(key, columns)`` of each ``(key, start, stop)`` range of the epoch's global order, in the order
        given; ranges must increase and not overlap. Each window is read and converted once."""
        mine = iter(ranges)
        nxt = next(mine, None)
        pending: list[dict[str, Any]] = []
        ws = 0
        windows = epoch_windows(
            self.shard_ids, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, window=self.window
        )
        for wi, shards in enumerate(windows):
            we = ws + sum(self._rows[s] for s in shards)
            ranges = []  # (m, a, b, stop): the part [a, b) of micro-batch m inside this window
            while nxt is not None and nxt[1] < we:
                m, start, stop = nxt
                if stop > ws:
                    ranges.append((m, max(start, ws), min(stop, we), stop))
                if stop > we:
                    break  # continues in the next window
                nxt = next(mine, None)
            if ranges:
                part = to_columns(self._take(self._load_window(shards), ranges, ws, wi))  # converted once
                pieces = split_columns(part, [b - a for _, a, b, _ in ranges])  # views, made as taken
                for (m, _, b, stop), piece in zip(ranges, pieces, strict=True):
                    pending.append(piece)
                    if b == stop:
                        yield m, concat_columns(pending)
                        pending = []
            ws = we
            if nxt is None:
                return

    def _take(self, table: pa.Table, ranges: list[tuple[int, int, int, int]], ws: int, wi: int) -> pa.Table:
        """This rank's rows of a window, in consumption order: one gather (or a zero-copy slice)."""
        perm = window_permutation(
            table.num_rows, seed=self.seed, epoch=self.epoch, window_index=wi, shuffle=self.shuffle
        )
        if perm is None and all(r[1] == n[2] for r, n in zip(ranges[1:], ranges, strict=False)):
            return table.slice(ranges[0][1] - ws, ranges[-1][2] - ranges[0][1])  # contiguous: no copy
        pos = np.concatenate([np.arange(a - ws, b - ws) for _, a, b, _ in ranges])
        return table.take(pa.array(perm[pos] if perm is not None else pos))

    def micro_batch_shards(self, m: int) -> list[int]:
        """The shards micro-batch ``m`` of this rank's epoch reads (for messages; reads no data)."""
        k = self.layout.accumulation_steps
        start = self.layout.micro_batch_start(step=m // k, micro=m % k, rank=self.rank)
        stop, ws, out = start + self.layout.batch_size, 0, set()
        windows = epoch_windows(
            self.shard_ids, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, window=self.window
        )
        for wi, shards in enumerate(windows):
            sizes = [self._rows[s] for s in shards]
            we = ws + sum(sizes)
            if start < we and stop > ws:
                perm = window_permutation(
                    we - ws, seed=self.seed, epoch=self.epoch, window_index=wi, shuffle=self.shuffle
                )
                pos = np.arange(max(start, ws) - ws, min(stop, we) - ws)
                rows = perm[pos] if perm is not None else pos
                out.update(np.asarray(shards)[np.searchsorted(np.cumsum(sizes), rows, side="right")].tolist())
            ws = we
        return sorted(out)

    def iter_numbered(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(micro-batch number, micro-batch)`` of this rank's remaining micro-batches, transformed; in a
        DataLoader worker, that worker's share. The position is not advanced (see ``__iter__``)."""
        for m, cols in self.iter_columns():
            if self.transform is None:
                yield m, cols
            else:
                where = f"micro-batch {m} of epoch {self.epoch} (shards {torch.unique(cols['shard']).tolist()})"
                yield m, apply_transform(self.transform, cols, where)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for m, mb in self.iter_numbered():
            self.micro = m + 1
            yield mb

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": "batched",
            **position_state(self.layout, self.epoch, self.micro, self.seed, self.rank),
            "shuffle": self.shuffle,
            "shuffle_window": self.window,
            "dataset": self.fingerprint,
            "counts": dataclasses.asdict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the same layout continues at the next micro-batch; another ``W``/``K``/``B`` with the
        same global batch continues at the next optimizer step. Nothing changes unless the whole state
        is sound (every field checked; a position past the end of the epoch is refused)."""
        if not isinstance(state, dict) or state.get("mode") != "batched":
            raise UserError("state is not a BatchedDataset state (a per-example state into a batched dataset?)")
        if missing := [k for k in _STATE_KEYS if k not in state]:
            raise UserError(
                f"batched state lacks {', '.join(missing)}: not a BatchedDataset.state_dict() of this version"
            )
        lay = self.layout
        for key, mine, why in (
            ("dataset", self.fingerprint, "another dataset or shard selection"),
            ("seed", self.seed, "another seed gives another order"),
            ("global_batch_size", lay.global_batch_size, "optimizer steps would hold other examples"),
            ("shuffle", self.shuffle, "another order"),
            ("shuffle_window", self.window, "another order"),
        ):
            if state[key] != mine or type(state[key]) is not type(mine):
                raise UserError(
                    f"state {key}={brief(state[key])} != this dataset's {mine!r}: {why}; resume with the same"
                )
        counts = PolicyCounts.from_state(state["counts"])
        self.epoch, self.micro = resume_position(state, lay, self.steps_per_epoch)
        self.counts = counts


def position_state(lay: GlobalLayout, epoch: int, micro: int, seed: int, rank: int) -> dict[str, Any]:
    """The position part of a reader's state (what :func:`resume_position` reads back)."""
    return {
        "epoch": epoch,
        "micro": micro,
        "step": micro // lay.accumulation_steps,
        "seed": seed,
        "global_batch_size": lay.global_batch_size,
        "batch_size": lay.batch_size,
        "accumulation_steps": lay.accumulation_steps,
        "world_size": lay.world_size,
        "rank": rank,
    }


def resume_position(state: dict[str, Any], lay: GlobalLayout, steps_per_epoch: int) -> tuple[int, int]:
    """``(epoch, micro)`` to continue from a saved position (its own ``batch_size``, ``accumulation_steps``,
    ``world_size``, ``epoch``, ``micro``, ``step``) in ``lay``: the next micro-batch with the same layout, else the
    next optimizer step; a :class:`UserError` for a position that is not sound."""
    epoch = check_int("state epoch", state["epoch"], 0)
    b, k, w = (check_int(f"state {key}", state[key]) for key in ("batch_size", "accumulation_steps", "world_size"))
    if b * k * w != lay.global_batch_size:
        raise UserError(
            f"state batch_size {b} x accumulation_steps {k} x world_size {w} != its global_batch_size "
            f"{lay.global_batch_size}: the state was edited"
        )
    micro = check_int("state micro", state["micro"], 0)
    if micro > steps_per_epoch * k:
        raise UserError(f"state micro={micro} is past the end of the epoch ({steps_per_epoch * k} micro-batches)")
    if state["step"] != micro // k:
        raise UserError(f"state step={brief(state['step'])} != micro {micro} // accumulation_steps {k}: edited?")
    same_layout = (b, k, w) == (lay.batch_size, lay.accumulation_steps, lay.world_size)
    if not same_layout and micro % k:
        raise UserError(
            "state was saved in the middle of an optimizer step: with another world size, accumulation or "
            "batch size, resume from a state saved at a step boundary"
        )
    return epoch, micro if same_layout else (micro // k) * lay.accumulation_steps


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
    transform: Transform | None = None,
    rows: RowFilter | None = None,
) -> dict[str, Any]:
    """The exact examples of optimizer step ``step``, on one process (replay a step of any world size).

    ``step`` counts optimizer steps from the start of training; with ``epoch`` it counts within that
    epoch. The result holds the step's ``global_batch_size`` examples (``shard``, ``index`` included)
    in global order; every rank's micro-batches of that step together are exactly these examples
    (with ``transform``, the training run's ``data.transform``, applied to them as one micro-batch; with
    ``rows``, the run's filter of records held out for validation, read as training read them).
    """
    check_int("step", step, 0)
    ds = BatchedDataset(
        path,
        batch_size=check_int("global_batch_size", global_batch_size),
        shuffle=shuffle,
        seed=seed,
        shuffle_window=shuffle_window,
        shards=shards,
        schema=schema,
        policy=policy,
        transform=transform,
        rows=rows,
    )
    ds.seek(step, epoch=epoch)
    return next(iter(ds))
