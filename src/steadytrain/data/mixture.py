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

Reading (:mod:`steadytrain.data.arena`): each source's windows are copied as read into its region of one array per
column, with a map from stream position to row; a rank plans a chunk of its micro-batches at once (about 4 MiB of
rows, ending with a step), gathers each column's rows of the chunk in one ``np.take``, and slices micro-batches out
of it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from steadytrain._io import brief
from steadytrain.data.arena import Piece, StreamArena
from steadytrain.data.batched import BatchedDataset, position_state, resume_position
from steadytrain.data.columnar import numpy_view, split_columns, to_arrays
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

_CHUNK_BYTES = 4 << 20  # a chunk of this rank's rows, gathered together: about this much memory
_CHUNK_ROWS = 16384  # at most this many rows (the first chunk is one step: the size of a row is not known yet)
_BLOCK = 64  # steps whose orders are drawn together


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
        self._row_bytes: int | None = None  # bytes of a gathered row (known after the first chunk)
        self._arena = StreamArena(len(names))  # each source's windows a chunk wants, found by stream position
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
        orders = self._orders(first, int(steps.max()) - first + 1, g)
        a = (self.rank * k + m % k) * b
        slots = orders[at, a[:, None] + np.arange(b)]  # [micro-batches, B]
        src = np.zeros(slots.shape, dtype=np.int64)  # the source whose run of the step's slots holds each slot
        for j in range(ends.shape[1] - 1):
            src += slots >= ends[at, j]
        pos = starts[at, src] + slots - (ends - counts)[at, src]
        return src.ravel(), pos.ravel()

    def _orders(self, first: int, n: int, g: int) -> np.ndarray:
        """The orders of the ``g`` slots of steps ``first`` to ``first + n - 1`` (``[n, g]``): step ``s``'s is row
        ``s % 64`` of its block of 64 steps' orders, drawn together from ``(seed, s // 64)`` (one generator per 64
        steps, not per step)."""
        parts, s = [], first
        while s < first + n:
            block = s // _BLOCK
            if self._block is None or self._block[0] != block:
                rng = np.random.default_rng([self.seed, block, 3])
                self._block = block, rng.permuted(np.tile(np.arange(g), (_BLOCK, 1)), axis=1)
            a = s % _BLOCK
            b = min(_BLOCK, a + first + n - s)
            parts.append(self._block[1][a:b])
            s += b - a
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

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

    def _window_at(self, j: int, position: int) -> tuple[int, int, list[int], int]:
        """``(epoch, window, its shards, its first stream position)`` of the window holding source ``j``'s stream
        ``position``."""
        n = self.sizes[j]
        epoch, off = divmod(position, n)
        windows, bounds = self._epoch_windows(j, epoch)
        wi = int(np.searchsorted(bounds, off, side="right"))
        return epoch, wi, windows[wi], epoch * n + (int(bounds[wi - 1]) if wi else 0)

    def _fill(self, j: int, lo: int, hi: int) -> None:
        """Make source ``j``'s region of the arena hold its stream positions ``lo`` to ``hi`` (whole windows)."""
        arena = self._arena
        if not arena.holds(j, lo):
            arena.restart(j, self._window_at(j, lo)[3])
        arena.keep_from(j, lo)
        while arena.stop[j] <= hi:
            epoch, wi, shards, _ = self._window_at(j, int(arena.stop[j]))
            n, columns = self._window_columns(j, epoch, wi, shards)
            arena.append(j, n, columns, self._permutation(j, epoch, wi, shards))

    def _window_columns(self, j: int, epoch: int, wi: int, shards: list[int]) -> tuple[int, dict[str, list[Piece]]]:
        """Source ``j``'s window ``wi`` of ``epoch`` as read: its rows and, per column, the pieces that hold them
        (each decoded shard's memory, copied once into the arena; converted first where NumPy has no view of it:
        text, nulls, booleans), with mixture shard ids and a ``source`` column."""
        table = self.readers[j]._load_window(shards)
        n = table.num_rows
        names = [*self.readers[0].columns.reference()[1].names, "shard", "index"]
        columns: dict[str, list[Piece]] = {}
        unviewed = []
        for name in names:
            views = [numpy_view(c) for c in table.column(name).chunks]
            if not views or any(v is None for v in views):
                unviewed.append(name)
                continue
            pieces, a = [], 0
            for v in views:
                pieces.append((v + self.offsets[j] if name == "shard" else v, a))
                a += len(v)
            columns[name] = pieces
        if unviewed:
            columns.update({k: [(v, 0)] for k, v in to_arrays(table.select(unviewed)).items()})
        columns["source"] = [(np.full(n, j, dtype=np.int64), 0)]
        return n, {name: columns[name] for name in [*names, "source"]}  # the columns in the dataset's order

    def micro_batch_shards(self, m: int) -> list[int]:
        """The mixture shard ids micro-batch ``m`` of this rank's epoch reads (for messages; reads no data)."""
        src, pos = self._slots([m])
        windows: dict[tuple[int, int, int], tuple[Any, np.ndarray, list[int]]] = {}
        out: set[int] = set()
        for j, p in zip(src.tolist(), pos.tolist(), strict=True):
            epoch, wi, shards, start = self._window_at(j, p)
            if (j, epoch, wi) not in windows:
                ends = np.cumsum([self.readers[j]._rows[s] for s in shards])
                windows[(j, epoch, wi)] = self._permutation(j, epoch, wi, shards), ends, shards
            perm, ends, shards = windows[(j, epoch, wi)]
            row = perm[p - start] if perm is not None else p - start
            out.add(shards[int(np.searchsorted(ends, row, side="right"))] + self.offsets[j])
        return sorted(out)

    # -- reading --------------------------------------------------------------------------------------------------

    def _chunk(self, ms: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(m, columns)`` of micro-batches ``ms``: the sources' regions filled, then one gather per column."""
        src, pos = self._slots(ms)
        for j in np.flatnonzero(np.bincount(src, minlength=len(self.names))):
            mine = pos[src == j]
            self._fill(int(j), int(mine.min()), int(mine.max()))
        out = self._arena.gather(src, pos)
        self._row_bytes = sum(v.nbytes if isinstance(v, np.ndarray) else 8 * len(v) for v in out.values()) // len(pos)
        cols = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
        yield from zip(ms, split_columns(cols, [self.layout.batch_size] * len(ms)), strict=True)

    def _chunk_rows(self) -> int:
        """Rows of the next chunk: about ``_CHUNK_BYTES`` of the rows gathered so far (4 MiB: 14k rows of 128
        uint16 tokens, 256 rows of 4096 int32 tokens), at most ``_CHUNK_ROWS``; one step's first."""
        if self._row_bytes is None:
            return self.layout.batch_size * self.layout.accumulation_steps
        return int(min(_CHUNK_ROWS, max(1, _CHUNK_BYTES // max(1, self._row_bytes))))

    def iter_numbered(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(micro-batch number, micro-batch)`` of this rank's remaining micro-batches (in a DataLoader worker,
        that worker's share: micro-batches ``first + wid, first + wid + n, ...``)."""
        worker = get_worker_info()
        wid, nworkers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        mine = list(range(self.micro + wid, len(self), nworkers))
        i, k = 0, self.layout.accumulation_steps
        while i < len(mine):
            end = mine[i] + max(1, self._chunk_rows() // self.layout.batch_size)
            end = max(end - end % k, mine[i] + 1)  # a chunk ends with a step where it can: no step planned twice
            stop = bisect.bisect_left(mine, end, lo=i)
            ms, i = mine[i:stop], stop
            for m, cols in self._chunk(ms):
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
