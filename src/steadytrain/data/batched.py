"""Batched mode of ``ShardedDataset``: columnar micro-batches in one global order for any world size.

``ShardedDataset(path, batch_size=B, accumulation_steps=K, rank=r, world_size=W)`` yields this
rank's micro-batches: dicts of column -> tensor (numeric) or list (strings), with ``shard`` and
``index`` always present. The order is defined globally (see :mod:`steadytrain.data.order`), so:

- every rank yields exactly ``steps_per_epoch · K`` micro-batches per epoch (no DDP hang on uneven
  shards); the remainder ``N mod G`` is dropped and reported as ``dropped_per_epoch``;
- optimizer step ``s`` holds the same examples whatever ``W``, ``K`` and ``B`` are (with ``G`` fixed),
  so a run resumes on another number of ranks, and :func:`~steadytrain.data.replay.global_batch`
  replays one step on one process.

What each rank reads: every shard of every window it has a micro-batch in (with ``W`` ranks on one
node the shards are read ``W`` times, from the OS page cache after the first). Memory: one window,
``shuffle_window`` shards as Arrow tables (decoded), plus this rank's rows of it. A larger window
shuffles better and costs proportionally more memory; the default, 8 shards, is a few hundred MB for
shards of ~50 MB decoded. Load-time policies that may drop rows (``drop``, ``clamp``) need each
shard's surviving row count before the first step: a counting pass reads the shards once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import get_worker_info

from steadytrain._check import check_int
from steadytrain._io import brief
from steadytrain.data.columnar import concat_columns, slice_columns, to_columns
from steadytrain.data.columns import ColumnGuard
from steadytrain.data.format import Dataset, DatasetError
from steadytrain.data.order import GlobalLayout, check_layout_fits, epoch_windows, window_permutation
from steadytrain.data.policy import PolicyCounts, apply_policy
from steadytrain.errors import UserError

__all__ = ["DEFAULT_SHUFFLE_WINDOW", "BatchedMode"]

log = logging.getLogger(__name__)

DEFAULT_SHUFFLE_WINDOW = 8  # shards shuffled together
_STATE_KEYS = ("epoch", "micro", "step", "seed", "global_batch_size", "batch_size", "accumulation_steps")
_STATE_KEYS += ("world_size", "shuffle", "shuffle_window", "dataset", "counts")


def _rows(value: Any) -> str | int:
    """The number of rows of a transformed column (an int), or what it is instead (a str)."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        return "0-dim tensor (no rows)"
    try:
        return len(value)
    except TypeError:
        return f"{type(value).__name__} (no rows)"


class BatchedMode:
    """The state and iteration of the batched mode; :class:`ShardedDataset` delegates to it."""

    def __init__(
        self,
        dataset: Dataset,
        shard_ids: list[int],
        *,
        rank: int,
        layout: GlobalLayout,
        shuffle: bool,
        seed: int,
        window: int | None,
        schema: Any,
        policy: str,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None,
        verify: bool,
    ) -> None:
        if transform is not None and not callable(transform):
            raise UserError(f"transform={transform!r} is not callable: give a function mb -> mb")
        self.dataset, self.shard_ids, self.rank, self.layout = dataset, shard_ids, rank, layout
        window = DEFAULT_SHUFFLE_WINDOW if window is None else window
        self.shuffle, self.seed, self.window = shuffle, seed, check_int("shuffle_window", window)
        self.schema, self.policy, self.transform, self.verify = schema, policy, transform, verify
        self.columns = ColumnGuard(dataset, shard_ids, verify=verify)
        self.fingerprint = dataset.fingerprint(shard_ids)
        self.counts = PolicyCounts()
        self._rows = self._row_counts()
        total = sum(self._rows.values())
        self.steps_per_epoch = check_layout_fits(layout, total, str(dataset.path))
        self.dropped_per_epoch = total - self.steps_per_epoch * layout.global_batch_size
        self.epoch, self.micro = 0, 0  # micro-batches of this rank consumed in the epoch

    def _row_counts(self) -> dict[int, int]:
        """Rows per shard as the order sees them (after a policy that may drop rows)."""
        if self.schema is None or self.policy == "raise":
            return {sid: self.dataset.shard(sid).records for sid in self.shard_ids}
        log.info("counting the rows the %s policy keeps in %d shards", self.policy, len(self.shard_ids))
        return {sid: self._read(sid, count=False).num_rows for sid in self.shard_ids}

    def _read(self, sid: int, *, count: bool = True) -> pa.Table:
        table = self.columns.conform(sid, self.dataset.read_shard(sid, verify=self.verify))  # no shard/index
        indices = np.arange(table.num_rows, dtype=np.int64)
        if self.schema is not None:
            table, indices, counts = apply_policy(table, self.schema, self.policy, shard=sid)
            if count:
                self.counts.add(counts)
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
                off = 0
                for m, a, b, stop in ranges:
                    pending.append(slice_columns(part, off, off + b - a))
                    off += b - a
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

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for m, cols in self.iter_columns():
            mb = cols
            if self.transform is not None:
                mb = self._apply_transform(mb, cols, m)
            self.micro = m + 1
            yield mb

    def _apply_transform(self, mb: dict[str, Any], cols: dict[str, Any], m: int) -> dict[str, Any]:
        """``transform(mb)``, checked: a dict of columns of the micro-batch's length, ``shard``/``index`` kept."""
        where = f"micro-batch {m} of epoch {self.epoch} (shards {torch.unique(cols['shard']).tolist()})"
        try:
            out = self.transform(mb)
        except Exception as err:  # the user's own error keeps its type (an OOM stays an OOM), told where
            if hasattr(err, "add_note"):
                err.add_note(f"steadytrain: raised by the transform on {where}")
            raise
        if not isinstance(out, dict):
            raise UserError(f"transform returned {type(out).__name__} on {where}, not a dict of columns: return mb")
        if dropped := [c for c in ("shard", "index") if c not in out]:
            raise UserError(f"transform dropped {dropped[0]!r} on {where}: keep it, it names each example's source")
        n = len(cols["shard"])
        for key, value in out.items():
            if not isinstance(key, str):
                raise UserError(f"transform returned column {brief(key)}: a column name is not a string")
            rows = _rows(value)
            if rows != n:
                what = f"{rows} rows" if isinstance(rows, int) else rows
                raise UserError(f"transform changed the batch length on {where}: {key!r} has {what}, not {n} rows")
        return out

    def state_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "mode": "batched",
            "epoch": self.epoch,
            "micro": self.micro,
            "step": self.micro // lay.accumulation_steps,
            "seed": self.seed,
            "global_batch_size": lay.global_batch_size,
            "batch_size": lay.batch_size,
            "accumulation_steps": lay.accumulation_steps,
            "world_size": lay.world_size,
            "rank": self.rank,
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
            raise UserError("state is not a batched ShardedDataset state (per-example state into a batched dataset?)")
        if missing := [k for k in _STATE_KEYS if k not in state]:
            raise UserError(
                f"batched state lacks {', '.join(missing)}: not a ShardedDataset.state_dict() of this version"
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
        epoch = check_int("state epoch", state["epoch"], 0)
        b, k, w = (check_int(f"state {key}", state[key]) for key in ("batch_size", "accumulation_steps", "world_size"))
        if b * k * w != lay.global_batch_size:
            raise UserError(
                f"state batch_size {b} x accumulation_steps {k} x world_size {w} != its global_batch_size "
                f"{lay.global_batch_size}: the state was edited"
            )
        micro = check_int("state micro", state["micro"], 0)
        if micro > self.steps_per_epoch * k:
            raise UserError(
                f"state micro={micro} is past the end of the epoch ({self.steps_per_epoch * k} micro-batches)"
            )
        if state["step"] != micro // k:
            raise UserError(f"state step={brief(state['step'])} != micro {micro} // accumulation_steps {k}: edited?")
        counts = PolicyCounts.from_state(state["counts"])
        same_layout = (b, k, w) == (lay.batch_size, lay.accumulation_steps, lay.world_size)
        if not same_layout and micro % k:
            raise UserError(
                "state was saved in the middle of an optimizer step: with another world size, accumulation or "
                "batch size, resume from a state saved at a step boundary"
            )
        self.epoch, self.counts = epoch, counts
        self.micro = micro if same_layout else (micro // k) * lay.accumulation_steps
