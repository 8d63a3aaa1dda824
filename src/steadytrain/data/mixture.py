"""``MixedDataset``: micro-batches of a weighted mixture of datasets, in one global order for any world size.

Each source is a stream: its epochs one after another, each in the order a single-source run would read it
(:mod:`steadytrain.data.order`: shards shuffled in windows, rows within a window, from the source's own seed); a
source that runs out starts its next epoch on its own. A step takes a source's examples from one epoch (the few
left at an epoch's end that do not fit a step's count are passed over), so no step holds an example twice.
Optimizer step ``s`` takes ``c_j(s)`` examples of source ``j`` (:class:`~steadytrain.data.mixing.MixCounts`:
exactly the weighted share, per step) from where that source's stream stands; the ``G`` examples are then put in
an order drawn from the seed and ``s`` (row ``s mod 64`` of 64 orders drawn from ``(seed, s // 64)``), and split
between ranks and micro-batches as a single source's step is. So step ``s`` holds the same examples for any world
size, accumulation and micro-batch size with ``G`` fixed, and after any resume.

Shards are numbered in one id space (:mod:`steadytrain.data.sourcemap`): source ``j``'s shard ``k`` is
``offset_j + k`` in the ``shard`` column, and a ``source`` column holds ``j``. The training loop sees the
interface of :class:`~steadytrain.data.batched.BatchedDataset`; its "epoch" here is a stretch of
``steps_per_epoch`` steps: the steps one pass over the largest-weighted source takes at its initial weight.

Reading: each source's window is read, put in its stream order (one gather) and converted once (one cached window
per source); a rank plans a chunk of its micro-batches at once and copies each of their examples once, from its
source's window into its place, then slices micro-batches out of the chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from steadytrain._io import brief
from steadytrain.data.batched import BatchedDataset, position_state, resume_position
from steadytrain.data.columnar import split_columns, to_arrays
from steadytrain.data.columns import schema_differences
from steadytrain.data.format import DatasetError
from steadytrain.data.mixing import MixCounts
from steadytrain.data.order import GlobalLayout, epoch_windows, window_permutation
from steadytrain.data.policy import PolicyCounts
from steadytrain.data.sourcemap import mixture_fingerprint
from steadytrain.data.transform import Transform, apply_transform
from steadytrain.errors import UserError

__all__ = ["MixedDataset", "source_seed"]

log = logging.getLogger(__name__)

_CHUNK_ROWS = 4096  # rows of this rank read and converted together
_BLOCK = 64  # steps whose orders are drawn together


def _place(out: dict[str, Any], cols: dict[str, Any], dest: np.ndarray, rows: np.ndarray, n: int) -> None:
    """Copy ``cols``' ``rows`` to rows ``dest`` of ``out`` (``n`` rows, made on first use). A column converted
    unalike in two windows (nulls read as NaN in one) is widened to hold both: a wider dtype, or a list."""
    for name, col in cols.items():
        have = out.get(name)
        if have is None:
            have = out[name] = np.empty((n, *col.shape[1:]), col.dtype) if isinstance(col, np.ndarray) else [None] * n
        if isinstance(have, np.ndarray) and isinstance(col, np.ndarray) and have.shape[1:] == col.shape[1:]:
            if not np.can_cast(col.dtype, have.dtype, casting="safe"):
                have = out[name] = have.astype(np.result_type(have.dtype, col.dtype))
            have[dest] = col[rows]
            continue
        if isinstance(have, np.ndarray):
            have = out[name] = have.tolist()
        for d, r in zip(dest.tolist(), rows.tolist(), strict=True):
            have[d] = col[r].tolist() if isinstance(col, np.ndarray) else col[r]


def _view(chunk: pa.Array) -> np.ndarray | None:
    """A numeric chunk (or a fixed-size list of numbers) as a NumPy view of its memory; None when there is none."""
    try:
        if pa.types.is_fixed_size_list(chunk.type) and chunk.null_count == 0:
            return chunk.flatten().to_numpy(zero_copy_only=True).reshape(len(chunk), chunk.type.list_size)
        return chunk.to_numpy(zero_copy_only=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, NotImplementedError):
        return None


def perm_inverse(perm: np.ndarray) -> np.ndarray:
    """Where each row goes: ``inverse[perm[i]] = i``."""
    inverse = np.empty(len(perm), dtype=np.int64)
    inverse[perm] = np.arange(len(perm))
    return inverse


def _runs(values: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """``(value, start, stop)`` of each run of equal values of a sorted array."""
    cuts = np.flatnonzero(values[1:] != values[:-1]) + 1
    bounds = [0, *cuts.tolist(), len(values)]
    for a, b in itertools.pairwise(bounds):
        yield int(values[a]), a, b


def source_seed(seed: int, j: int) -> int:
    """The order seed of source ``j`` (source 0 keeps the run's seed)."""
    return seed if j == 0 else (seed * 1_000_003 + j) % 2**63


class MixedDataset(IterableDataset):
    """This rank's micro-batches of a mixture's global order; the position is kept for an exact resume.

    Args:
        names: the sources' names, in order.
        readers: each source's reader (a :class:`BatchedDataset` with ``batch_size=1``, ``world_size=1``,
            seeded with :func:`source_seed`): its shards, rows, schema policy and hold-out.
        offsets: each source's first shard id in the mixture's id space.
        weights, schedule: the weights from step 0, and ``(0-based step, weights)`` changes.
        batch_size, accumulation_steps, rank, world_size, seed: as for :class:`BatchedDataset`.
        largest: the source whose passes are the mixture's epochs (default: the largest initial weight).
        transform: ``transform(mb) -> mb`` applied to every micro-batch.
    """

    def __init__(
        self,
        names: list[str],
        readers: list[BatchedDataset],
        offsets: list[int],
        weights: list[Fraction],
        *,
        schedule: list[tuple[int, list[Fraction]]] = (),
        batch_size: int,
        accumulation_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        largest: int | None = None,
        transform: Transform | None = None,
    ) -> None:
        super().__init__()
        self.names, self.readers, self.offsets = list(names), list(readers), list(offsets)
        self.layout = GlobalLayout(batch_size, accumulation_steps, world_size)
        self.rank, self.world_size, self.seed, self.transform = rank, world_size, seed, transform
        self.sizes = [sum(r._rows.values()) for r in readers]
        self.mix = MixCounts(
            weights, global_batch_size=self.layout.global_batch_size, seed=seed, schedule=schedule, sizes=self.sizes
        )
        self.columns = readers[0].columns  # what a validation set must match
        self._check_columns()
        self._check_sizes()
        self.largest = max(range(len(names)), key=lambda j: (weights[j], -j)) if largest is None else largest
        share = Fraction(self.layout.global_batch_size) * weights[self.largest] / sum(weights)
        self.steps_per_epoch = max(1, math.floor(self.sizes[self.largest] / share))
        self.dropped_per_epoch = 0
        self.shard_ids = sorted(o + s for o, r in zip(offsets, readers, strict=True) for s in r.shard_ids)
        self.fingerprint = mixture_fingerprint([(n, r.fingerprint) for n, r in zip(names, readers, strict=True)])
        self.epoch, self.micro = 0, 0
        self._windows: dict[tuple[int, int], tuple[list[list[int]], np.ndarray]] = {}
        self._table: dict[int, tuple[tuple[int, int], Any]] = {}  # per source: its last window, converted
        self._buffers: dict[tuple[int, str], np.ndarray] = {}  # per source and column: the window's memory
        self._block: tuple[int, np.ndarray] | None = None  # the last block of steps' orders drawn

    def _check_columns(self) -> None:
        for name, r in zip(self.names, self.readers, strict=True):
            if "source" in r.columns.reference()[1].names:
                raise DatasetError(
                    f"data.sources: source {name!r} ({r.dataset.path}) has its own column 'source', which a mixture "
                    "adds to every example: rename it in the data"
                )
        _, ref = self.readers[0].columns.reference()
        for name, r in zip(self.names[1:], self.readers[1:], strict=True):
            _, mine = r.columns.reference()
            if diffs := schema_differences(mine, ref, f"source {self.names[0]!r}"):
                raise DatasetError(
                    f"data.sources: source {name!r} ({r.dataset.path}) does not have the columns of source "
                    f"{self.names[0]!r}: {'; '.join(diffs)}: give sources with the same columns"
                )

    def _check_sizes(self) -> None:
        """Every step's examples of a source fit in one of its epochs: a step takes at most ``ceil(G*w) + 1``
        (the share carried in adds at most one)."""
        for start in self.mix.starts:
            top = [math.ceil(w * self.layout.global_batch_size) + 1 for w in self.mix.weights_at(start)]
            for name, n, size, w in zip(self.names, top, self.sizes, self.mix.weights_at(start), strict=True):
                if w and n > size:
                    raise UserError(
                        f"data.sources: source {name!r} has {size} examples but a global batch may take up to {n} of "
                        f"them (from step {start + 1}): it would hold some twice; give it a smaller weight or more data"
                    )

    @property
    def global_batch_size(self) -> int:
        return self.layout.global_batch_size

    @property
    def num_examples(self) -> int:
        return sum(self.sizes)

    @property
    def global_step(self) -> int:
        """The global step (0-based) of the micro-batch yielded last (as :attr:`BatchedDataset.global_step`)."""
        return self.epoch * self.steps_per_epoch + max(self.micro - 1, 0) // self.layout.accumulation_steps

    def __len__(self) -> int:
        return self.steps_per_epoch * self.layout.accumulation_steps

    set_epoch = BatchedDataset.set_epoch
    seek = BatchedDataset.seek

    @property
    def steps_taken(self) -> int:
        """Global steps whose micro-batches this rank has taken so far."""
        return self.epoch * self.steps_per_epoch + self.micro // self.layout.accumulation_steps

    def source_epochs(self, step: int) -> list[int]:
        """Each source's epoch at global ``step`` (how many times it has run out before it)."""
        return [p // n for p, n in zip(self.mix.position(step), self.sizes, strict=True)]

    # -- the order ------------------------------------------------------------------------------------------------

    def _slots(self, ms: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(source, stream position)`` of each example of this rank's micro-batches ``ms``, in their order: each
        step's order drawn and its counts walked once, the slots of all the micro-batches found together."""
        k, b, g = self.layout.accumulation_steps, self.layout.batch_size, self.layout.global_batch_size
        m = np.asarray(ms, dtype=np.int64)
        steps = self.epoch * self.steps_per_epoch + m // k
        first = int(steps.min())
        counts, starts = self.mix.span(first, int(steps.max()) - first + 1)
        ends = np.cumsum(counts, axis=1)
        at = (steps - first)[:, None]  # ms increase: their steps are first, first + 1, ...
        orders = np.stack([self._order(s, g) for s in range(first, int(steps.max()) + 1)])
        a = (self.rank * k + m % k) * b
        slots = orders[at, a[:, None] + np.arange(b)]  # [micro-batches, B]
        src = np.zeros(slots.shape, dtype=np.int64)  # the source whose run of the step's slots holds each slot
        for j in range(ends.shape[1] - 1):
            src += slots >= ends[at, j]
        pos = starts[at, src] + slots - (ends - counts)[at, src]
        return src.ravel(), pos.ravel()

    def _order(self, step: int, g: int) -> np.ndarray:
        """Step ``step``'s order of its ``g`` slots: row ``step % 64`` of its block of 64 steps' orders, drawn
        together from ``(seed, step // 64)`` (one generator per 64 steps, not per step)."""
        block = step // _BLOCK
        if self._block is None or self._block[0] != block:
            rng = np.random.default_rng([self.seed, block, 3])
            self._block = block, rng.permuted(np.tile(np.arange(g), (_BLOCK, 1)), axis=1)
        return self._block[1][step % _BLOCK]

    def _epoch_windows(self, j: int, epoch: int) -> tuple[list[list[int]], np.ndarray]:
        """Source ``j``'s windows of ``epoch`` and the stream offset (within the epoch) where each ends."""
        key = (j, epoch)
        if key not in self._windows:
            r = self.readers[j]
            if len(self._windows) > 64:
                self._windows.clear()
            windows = epoch_windows(r.shard_ids, seed=r.seed, epoch=epoch, shuffle=r.shuffle, window=r.window)
            self._windows[key] = windows, np.cumsum([sum(r._rows[s] for s in w) for w in windows])
        return self._windows[key]

    def _permutation(self, j: int, epoch: int, wi: int, shards: list[int]) -> np.ndarray | None:
        """The row order of source ``j``'s window ``wi`` of ``epoch`` (None: as read)."""
        r = self.readers[j]
        n = sum(r._rows[s] for s in shards)
        return window_permutation(n, seed=r.seed, epoch=epoch, window_index=wi, shuffle=r.shuffle)

    def _locate(self, j: int, positions: np.ndarray) -> Iterator[tuple[int, int, list[int], np.ndarray, np.ndarray]]:
        """``(epoch, window, its shards, which of positions, their places in the window's stream order)`` of
        source ``j``'s stream ``positions`` (increasing), window by window."""
        n = self.sizes[j]
        epochs = positions // n
        for e, a, b in _runs(epochs):  # sorted: runs of one epoch, then of one window
            off = positions[a:b] % n
            windows, bounds = self._epoch_windows(j, e)
            for wi, c, d in _runs(np.searchsorted(bounds, off, side="right")):
                yield e, wi, windows[wi], np.arange(a + c, a + d), off[c:d] - (bounds[wi - 1] if wi else 0)

    def _window(self, j: int, epoch: int, wi: int, shards: list[int]) -> dict[str, Any]:
        """Source ``j``'s window ``wi`` of ``epoch``, its rows in the order its stream reads them, converted once
        (arrays and lists, with mixture shard ids and ``source``); each chunk then copies its rows out of it."""
        cached = self._table.get(j)
        if cached is None or cached[0] != (epoch, wi):
            table = self.readers[j]._load_window(shards)
            perm = self._permutation(j, epoch, wi, shards)
            names = [*self.readers[0].columns.reference()[1].names, "shard", "index"]
            inverse = perm_inverse(perm) if perm is not None else None
            cols = {name: self._permuted(j, name, table.column(name), inverse) for name in names}
            if any(c is None for c in cols.values()):  # a column NumPy cannot view: one Arrow gather of them all
                taken = table.take(pa.array(perm)) if perm is not None else table.combine_chunks()
                cols = to_arrays(taken.select(names))
            cols["shard"] = cols["shard"] + self.offsets[j]
            cols["source"] = np.full(table.num_rows, j, dtype=np.int64)
            cached = self._table[j] = ((epoch, wi), cols)
        return cached[1]

    def _permuted(self, j: int, name: str, col: pa.ChunkedArray, inverse: np.ndarray | None) -> np.ndarray | None:
        """Column ``name`` of source ``j``'s window in stream order (``inverse``: where each row read goes; None: as
        read), scattered from the decoded shards into a buffer this reader keeps per source and column (memory
        already touched: a fresh gather's page faults cost as much as the gather); None for a column without a NumPy
        view (text, nulls, booleans)."""
        views = [_view(c) for c in col.chunks]
        if not views or any(v is None for v in views):
            return None
        n, shape, dtype = len(col), views[0].shape[1:], views[0].dtype
        buf = self._buffers.get((j, name))
        if buf is None or len(buf) < n or buf.shape[1:] != shape or buf.dtype != dtype:
            buf = self._buffers[(j, name)] = np.empty((n, *shape), dtype)
        out, a = buf[:n], 0
        for v in views:
            out[inverse[a : a + len(v)] if inverse is not None else slice(a, a + len(v))] = v
            a += len(v)
        return out

    def micro_batch_shards(self, m: int) -> list[int]:
        """The mixture shard ids micro-batch ``m`` of this rank's epoch reads (for messages; reads no data)."""
        src, pos = self._slots([m])
        out: set[int] = set()
        for j in np.unique(src):
            r, p = self.readers[j], np.sort(pos[src == j])
            for e, wi, shards, _, rows in self._locate(int(j), p):
                perm = self._permutation(int(j), e, wi, shards)
                rows = perm[rows] if perm is not None else rows
                sizes = np.cumsum([r._rows[s] for s in shards])
                ids = np.asarray(shards)[np.searchsorted(sizes, rows, side="right")]
                out.update((ids + self.offsets[j]).tolist())
        return sorted(out)

    # -- reading --------------------------------------------------------------------------------------------------

    def _chunk(self, ms: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(m, columns)`` of micro-batches ``ms``: each example copied once, from its source's converted window
        into its place in the chunk."""
        src, pos = self._slots(ms)
        out: dict[str, Any] = {}
        for j in np.flatnonzero(np.bincount(src, minlength=len(self.names))):
            mine = np.flatnonzero(src == j)
            order = np.argsort(pos[mine], kind="stable")
            dest = mine[order]
            for e, wi, shards, sel, rows in self._locate(int(j), pos[mine][order]):
                _place(out, self._window(int(j), e, wi, shards), dest[sel], rows, len(src))
        cols = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
        yield from zip(ms, split_columns(cols, [self.layout.batch_size] * len(ms)), strict=True)

    def iter_numbered(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(micro-batch number, micro-batch)`` of this rank's remaining micro-batches (in a DataLoader worker,
        that worker's share: micro-batches ``first + wid, first + wid + n, ...``)."""
        worker = get_worker_info()
        wid, nworkers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        mine = list(range(self.micro + wid, len(self), nworkers))
        per = max(1, _CHUNK_ROWS // self.layout.batch_size)
        for i in range(0, len(mine), per):
            for m, cols in self._chunk(mine[i : i + per]):
                if self.transform is not None:
                    where = f"micro-batch {m} of epoch {self.epoch} (shards {torch.unique(cols['shard']).tolist()})"
                    cols = apply_transform(self.transform, cols, where)
                yield m, cols

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for m, mb in self.iter_numbered():
            self.micro = m + 1
            yield mb

    # -- state ----------------------------------------------------------------------------------------------------

    def _schedule_text(self) -> list[list[Any]]:
        return [[s, [str(w) for w in self.mix.weights_at(s)]] for s in self.mix.starts]

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": "mixture",
            **position_state(self.layout, self.epoch, self.micro, self.seed, self.rank),
            "dataset": self.fingerprint,
            "sources": list(self.names),
            "schedule": self._schedule_text(),
            "counts": [dataclasses.asdict(r.counts) for r in self.readers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume as :meth:`BatchedDataset.load_state_dict` does; the weights of every step already trained must
        be the saved ones (a schedule may change only from the step the run resumes at)."""
        if not isinstance(state, dict) or state.get("mode") != "mixture":
            raise UserError("state is not a mixture's state (a run of one dataset resumed with data.sources?)")
        for key, mine, why in (
            ("sources", list(self.names), "other sources"),
            ("dataset", self.fingerprint, "another dataset or shard selection in a source"),
            ("seed", self.seed, "another seed gives another order"),
            ("global_batch_size", self.layout.global_batch_size, "optimizer steps would hold other examples"),
        ):
            if state.get(key) != mine:
                raise UserError(
                    f"state {key}={brief(state.get(key))} != this mixture's {brief(mine)}: {why}; resume with the same"
                )
        epoch, micro = resume_position(state, self.layout, self.steps_per_epoch)
        done = epoch * self.steps_per_epoch + micro // self.layout.accumulation_steps
        self._check_past(state.get("schedule"), done)
        counts = state.get("counts")
        if not isinstance(counts, list) or len(counts) != len(self.readers):
            raise UserError(f"state counts={brief(counts)} is not one entry per source: the state was edited")
        parsed = [PolicyCounts.from_state(c) for c in counts]
        for r, c in zip(self.readers, parsed, strict=True):
            r.counts = c
        self.epoch, self.micro = epoch, micro

    def _check_past(self, saved: Any, done: int) -> None:
        """A UserError unless the saved schedule gives the same weights as this one to every step before ``done``."""
        try:
            theirs = [(int(s), [Fraction(w) for w in ws]) for s, ws in saved]
            old = MixCounts(theirs[0][1], global_batch_size=self.layout.global_batch_size, schedule=theirs[1:])
        except (TypeError, ValueError, ZeroDivisionError, IndexError, UserError) as err:
            raise UserError(
                f"state schedule={brief(saved)} is not a mixture schedule ({err}): the state was edited"
            ) from None
        for s in sorted({0, *old.starts, *self.mix.starts}):
            if s < done and old.weights_at(s) != self.mix.weights_at(s):
                was = ", ".join(f"{n}={float(w):g}" for n, w in zip(self.names, old.weights_at(s), strict=True))
                raise UserError(
                    f"data.mix_schedule changes the weights of step {s + 1}, already trained ({was}): a resume may "
                    f"change the mixture only from step {done + 1} on"
                )
