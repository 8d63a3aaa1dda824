"""``StreamArena``: the rows of several streams in one array per column, found by stream position.

A mixture's chunk of micro-batches interleaves examples of several sources. Each source's rows are kept in one
region of an array per column (region ``j`` holds stream positions ``[first_j, stop_j)`` of source ``j``), block
by block (a block is a window: its rows copied as read, one sequential copy per decoded shard), and a map in
stream order gives the arena row of each position (a window's permutation). A chunk is then one gather per column
by arena row (``np.take``): no per-source gather and scatter into place, no permuting copy of a window. A region
slides: whole blocks before the oldest position still wanted (:meth:`StreamArena.keep_from`) are dropped when
room is needed, and the arrays grow by half when a region cannot hold what a chunk wants.

The arrays are reused from window to window: their memory is already touched (writing into a fresh array's
pages costs as much as the copy). A column that arrives unalike in two windows (nulls read as NaN in one, text)
is widened to hold both: a wider dtype, or Python objects (a row of numbers then becomes a list).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Piece", "StreamArena"]

Piece = tuple[Any, int]  # (values: an array or a list, the row of the new block the first of them goes to)


def _objects(values: Any) -> np.ndarray:
    """``values`` as a 1-D array of Python objects (a row of a 2-D array becomes a list)."""
    rows = values.tolist() if isinstance(values, np.ndarray) else values
    return np.fromiter(rows, dtype=object, count=len(rows))


class StreamArena:
    """Regions of ``streams`` streams in one array per column (see the module's docstring)."""

    def __init__(self, streams: int) -> None:
        self.cols: dict[str, np.ndarray] = {}
        self.base = np.zeros(streams, dtype=np.int64)  # arena row of each region's first row
        self.first = np.zeros(streams, dtype=np.int64)  # stream position held at that row
        self.keep = np.zeros(streams, dtype=np.int64)  # positions before this one are no longer wanted
        self.stop = np.zeros(streams, dtype=np.int64)  # one past the last position held
        self.cap = np.zeros(streams, dtype=np.int64)  # rows a region can hold
        self.rowmap = np.zeros(0, dtype=np.int64)  # at region row of position p: the arena row holding p
        self.blocks: list[list[int]] = [[] for _ in range(streams)]  # the first position of each block held

    def holds(self, j: int, position: int) -> bool:
        """Whether stream ``j``'s ``position`` is in its region and still wanted."""
        return bool(self.keep[j] <= position < self.stop[j])

    def restart(self, j: int, position: int) -> None:
        """Empty region ``j``; the next block appended starts at stream ``position``."""
        self.first[j] = self.keep[j] = self.stop[j] = position
        self.blocks[j] = []

    def keep_from(self, j: int, position: int) -> None:
        """Stream ``j``'s positions before ``position`` are no longer wanted: the blocks wholly before it may be
        overwritten (a position past the region keeps it whole: the next block appended starts at its end)."""
        p = min(position, int(self.stop[j]))
        starts = [b for b in self.blocks[j] if b <= p]
        if starts:
            self.keep[j] = max(int(self.keep[j]), starts[-1])
            self.blocks[j] = self.blocks[j][len(starts) - 1 :]
        else:
            self.keep[j] = max(int(self.keep[j]), p)

    def append(self, j: int, n: int, columns: dict[str, list[Piece]], order: np.ndarray | None) -> None:
        """The next ``n`` positions of stream ``j``, a block: each column's pieces written to their rows of the
        block; ``order[k]`` is the block row of the block's ``k``-th position (None: the rows in order)."""
        live = int(self.stop[j] - self.keep[j])
        if int(self.stop[j] - self.first[j]) + n > self.cap[j]:
            if live + n > self.cap[j]:
                self._grow(j, live + n)
            else:
                self._compact(j, live)
        row = int(self.base[j] + self.stop[j] - self.first[j])
        for name, pieces in columns.items():
            for values, at in pieces:
                col = self._fit(name, values)
                if col.dtype == object and not (isinstance(values, np.ndarray) and values.dtype == object):
                    values = _objects(values)
                col[row + at : row + at + len(values)] = values
        self.rowmap[row : row + n] = row + (order if order is not None else np.arange(n))
        self.blocks[j].append(int(self.stop[j]))
        self.stop[j] += n

    def gather(self, src: np.ndarray, pos: np.ndarray) -> dict[str, Any]:
        """Every column's rows of stream ``src[i]``'s position ``pos[i]``, in that order: arrays (lists for
        columns of objects)."""
        if len(pos) and ((pos < self.keep[src]) | (pos >= self.stop[src])).any():
            raise RuntimeError("a mixture chunk wants rows its sources' regions do not hold (a reader bug)")
        idx = self.rowmap[self.base[src] + (pos - self.first[src])]
        out: dict[str, Any] = {}
        for name, col in self.cols.items():
            taken = np.take(col, idx, axis=0)
            out[name] = taken.tolist() if col.dtype == object else taken
        return out

    def _fit(self, name: str, values: Any) -> np.ndarray:
        """Column ``name``'s array, made on first use or widened to hold ``values`` too."""
        col = self.cols.get(name)
        numeric = isinstance(values, np.ndarray) and values.dtype != object
        if col is None:
            shape, dtype = (values.shape[1:], values.dtype) if numeric else ((), np.dtype(object))
            col = np.empty((int(self.cap.sum()), *shape), dtype)
        elif col.dtype == object:
            return col
        elif numeric and values.shape[1:] == col.shape[1:]:
            if not np.can_cast(values.dtype, col.dtype, casting="safe"):
                col = col.astype(np.result_type(col.dtype, values.dtype))
        else:
            col = _objects(col)
        self.cols[name] = col
        return col

    def _compact(self, j: int, live: int) -> None:
        """Move region ``j``'s wanted rows to its start."""
        b, a = int(self.base[j]), int(self.base[j] + self.keep[j] - self.first[j])
        if a > b:
            for col in self.cols.values():
                col[b : b + live] = col[a : a + live]  # NumPy copies overlapping memory safely
            self.rowmap[b : b + live] = self.rowmap[a : a + live] - (a - b)
        self.first[j] = self.keep[j]

    def _grow(self, j: int, need: int) -> None:
        """New arrays where region ``j`` holds ``need`` rows or more (every region keeps its wanted rows)."""
        cap = self.cap.copy()
        cap[j] = max(need, int(cap[j]) * 3 // 2)
        base = np.concatenate([[0], np.cumsum(cap)[:-1]]).astype(np.int64)
        moves = [
            (int(self.base[i] + self.keep[i] - self.first[i]), int(b), int(self.stop[i] - self.keep[i]))
            for i, b in enumerate(base)
        ]
        rowmap = np.empty(int(cap.sum()), dtype=np.int64)
        for a, b, live in moves:
            rowmap[b : b + live] = self.rowmap[a : a + live] - (a - b)
        self.rowmap = rowmap
        for name, col in self.cols.items():
            new = np.empty((int(cap.sum()), *col.shape[1:]), col.dtype)
            for a, b, live in moves:
                new[b : b + live] = col[a : a + live]
            self.cols[name] = new
        self.cap, self.base, self.first = cap, base, self.keep.copy()
