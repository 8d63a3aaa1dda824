"""Every shard a reader yields has the same columns and types: those of the first shard of the selection.

Parquet lets each shard carry its own schema, so a dataset can hold a shard with a column missing, an
extra one, or a dtype changed (a re-run of the pipeline, a hand-written shard). Read one example at a
time, such a shard would silently yield examples with other keys or types; concatenated into a
micro-batch, it would fail inside pyarrow. :class:`ColumnGuard` checks each shard's table against the
*reference* (the lowest selected shard id, whose Parquet footer alone is read) before anything is
yielded, and refuses a difference with a :class:`DatasetError` naming both shards and every difference.
Columns in another order are the same schema: they are put in the reference's order.

Both readers (:mod:`~steadytrain.data.sharded`, per example; :mod:`~steadytrain.data.batched`, the
global order) select shards and check their shared arguments here, so neither imports the other.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from steadytrain._check import check_int
from steadytrain._io import brief
from steadytrain.data.format import CorruptShardError, Dataset, DatasetError
from steadytrain.data.index import RESERVED_COLUMNS
from steadytrain.data.schema import POLICIES
from steadytrain.errors import UserError

__all__ = ["ColumnGuard", "check_reader_args", "schema_differences", "select_shards"]


def schema_differences(table: pa.Schema, reference: pa.Schema, ref_name: str) -> list[str]:
    """What ``table`` has unlike ``reference``: missing and extra columns, changed types (empty if alike).

    Example:
        >>> a = pa.schema([("x", pa.float64()), ("y", pa.int64())])
        >>> schema_differences(pa.schema([("x", pa.string())]), a, "shard 0")
        ["column 'y' is missing", "column 'x' is string, not double as in shard 0"]
    """
    mine = {f.name: f.type for f in table}
    ref = {f.name: f.type for f in reference}
    out = [f"column {brief(n)} is missing" for n in ref if n not in mine]
    out += [f"column {brief(n)} is not in {ref_name}" for n in mine if n not in ref]
    changed = [(n, t) for n, t in ref.items() if n in mine and mine[n] != t]
    out += [f"column {brief(n)} is {mine[n]}, not {t} as in {ref_name}" for n, t in changed]
    return out


class ColumnGuard:
    """Checks every table a reader loads against the reference shard's columns and types.

    Args:
        dataset: the opened dataset.
        shard_ids: the selection, sorted; its first readable shard is the reference.
        verify: verify the reference shard's checksum before reading its footer.
        skip_corrupt: a corrupt reference is passed over (the next shard is the reference), not raised.
    """

    def __init__(self, dataset: Dataset, shard_ids: list[int], *, verify: bool, skip_corrupt: bool = False):
        self.dataset, self.shard_ids = dataset, sorted(shard_ids)
        self.verify, self.skip_corrupt = verify, skip_corrupt
        self._reference: tuple[int, pa.Schema] | None = None

    def reference(self) -> tuple[int, pa.Schema]:
        """``(shard id, schema)`` the other shards must match (read once, from one Parquet footer)."""
        if self._reference is None:
            for sid in self.shard_ids:
                try:
                    self._reference = (sid, self.dataset.read_schema(sid, verify=self.verify))
                    break
                except CorruptShardError:
                    if not self.skip_corrupt:
                        raise
            else:
                raise DatasetError(f"{self.dataset.path}: no selected shard is readable")
        return self._reference

    def conform(self, sid: int, table: pa.Table) -> pa.Table:
        """``table`` (shard ``sid``) with the reference's columns in its order; a :class:`DatasetError` if it
        has other columns or types, or a column the reader adds (``shard``, ``index``)."""
        if clash := [c for c in RESERVED_COLUMNS if c in table.column_names]:
            raise DatasetError(
                f"{self.dataset.path}: shard {sid} has its own column {clash[0]!r}, which the reader adds to "
                "every example: rename it in the data"
            )
        ref_id, ref = self.reference()
        if table.schema.equals(ref, check_metadata=False):
            return table
        diffs = schema_differences(table.schema, ref, f"shard {ref_id}")
        if diffs:
            raise DatasetError(
                f"{self.dataset.path}: shard {sid} does not have the columns of shard {ref_id}: {'; '.join(diffs)}. "
                "Every shard must have the same columns and types: rewrite it, or leave it out with shards=[...]"
            )
        table = table.select(ref.names)
        try:
            return table.cast(ref)  # nullability or field metadata only: the types are equal
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
            raise DatasetError(f"{self.dataset.path}: shard {sid}: {brief(str(err))}") from None


def select_shards(dataset: Dataset, shards: list[int] | None) -> list[int]:
    """The sorted shard ids to read: all of the dataset's, or ``shards``, each once and each in the index.

    Raises:
        DatasetError: ``shards`` is not a list of integers, names an id twice, or names one not in the index.
    """
    if shards is None:
        return sorted(dataset.shard_ids)
    if isinstance(shards, str | bytes) or not hasattr(shards, "__iter__"):
        raise DatasetError(f"shards={brief(shards)} must be a list of shard ids")
    ids = []
    for s in shards:
        try:
            if isinstance(s, bool | np.bool_):
                raise TypeError
            ids.append(operator.index(s))  # int, numpy integers
        except TypeError:
            raise DatasetError(f"shards: {brief(s)} is not a shard id (an integer)") from None
    if not ids:
        raise DatasetError("shards=[] selects no shard: give at least one id, or None for all")
    if twice := [s for s, n in Counter(ids).items() if n > 1]:
        raise DatasetError(f"shards: {twice[0]} is listed twice: each shard is read once per epoch")
    if unknown := sorted(set(ids) - set(dataset.shard_ids)):
        raise DatasetError(f"{dataset.path}: shards={brief(unknown)} are not in the index")
    return sorted(ids)


def check_reader_args(*, rank: Any, world_size: Any, seed: Any, epoch: Any, policy: Any, flags: dict[str, Any]) -> None:
    """The arguments both readers share, checked alike: a UserError naming the argument and the fix."""
    check_int("world_size", world_size, 1)
    if check_int("rank", rank, 0) >= world_size:
        raise UserError(f"rank={rank} must be in [0, world_size={world_size})")
    check_int("seed", seed, 0)
    check_int("epoch", epoch, 0)
    if policy not in POLICIES:
        raise UserError(f"policy={brief(policy)} is unknown: use one of {', '.join(POLICIES)}")
    for name, flag in flags.items():
        if not isinstance(flag, bool | np.bool_):
            raise UserError(f"{name}={brief(flag)} must be True or False")
