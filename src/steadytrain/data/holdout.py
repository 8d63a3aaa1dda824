"""Records held out of a dataset for validation: which rows, drawn from a seed, and a filter the readers apply.

A :class:`RowFilter` names rows by shard id and *stored* row index (the ``index`` column every reader adds),
so it selects the same examples whatever load-time policy drops or clamps, whatever the world size. The
training side reads every row but the held-out ones (``keep=False``), the validation side only those
(``keep=True``, :meth:`RowFilter.inverse`): the two never share an example.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from steadytrain._check import check_int
from steadytrain.errors import UserError

__all__ = ["RowFilter", "holdout_records"]


@dataclass(frozen=True, eq=False)
class RowFilter:
    """Rows of a dataset by shard id and stored row index: read only these (``keep``) or every row but these."""

    rows: Mapping[int, np.ndarray]
    """Shard id -> the sorted, distinct stored row indices named."""
    keep: bool = False

    @property
    def total(self) -> int:
        """Rows named, over every shard."""
        return sum(len(r) for r in self.rows.values())

    def inverse(self) -> RowFilter:
        """The other side: the rows this filter leaves out, and only them."""
        return RowFilter(self.rows, keep=not self.keep)

    def passes(self, shard: int, indices: np.ndarray) -> np.ndarray:
        """Which of a shard's rows (their stored ``indices``) this filter lets through, as a boolean mask."""
        named = np.isin(indices, self.rows.get(shard, np.empty(0, dtype=np.int64)))
        return named if self.keep else ~named

    def count(self, shard: int, records: int) -> int:
        """Rows of a shard of ``records`` rows that pass (every row kept by the load-time policy)."""
        named = len(self.rows.get(shard, ()))
        return named if self.keep else records - named

    def digest(self) -> str:
        """A short digest of the side and the rows named (it joins the readers' dataset fingerprint)."""
        h = hashlib.sha256(b"keep" if self.keep else b"drop")
        for shard in sorted(self.rows):
            h.update(np.int64(shard).tobytes() + np.asarray(self.rows[shard], dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def holdout_records(sizes: Mapping[int, int], n: int, seed: int) -> RowFilter:
    """``n`` of the records of shards with ``sizes`` (shard id -> rows), drawn from ``seed`` alone (any world
    size draws the same); the held-out side (``keep=True``).

    Example:
        >>> held = holdout_records({0: 10, 1: 10}, 3, seed=0)
        >>> held.total, held.digest() == holdout_records({1: 10, 0: 10}, 3, seed=0).digest()
        (3, True)
    """
    ids = sorted(sizes)
    total = sum(sizes[s] for s in ids)
    if not 1 <= check_int("held-out records", n) < total:
        raise UserError(
            f"holding out {n} of the dataset's {total} records leaves none to train on, or holds out none: "
            "hold out a fraction that leaves both (eval.holdout_fraction), or give eval.data"
        )
    picked = np.sort(np.random.default_rng([seed, 0x5EED, 1]).choice(total, size=n, replace=False))
    starts = np.cumsum([0, *[sizes[s] for s in ids]])
    which = np.searchsorted(starts, picked, side="right") - 1
    rows = {ids[i]: picked[which == i] - starts[i] for i in np.unique(which)}
    return RowFilter({int(s): r.astype(np.int64) for s, r in rows.items()}, keep=True)
