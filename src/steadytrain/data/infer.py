"""Schema inference from shards known to be healthy: types, numeric ranges, vocabularies, required columns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from steadytrain._check import check_int
from steadytrain._io import brief
from steadytrain.data.masks import _as_array, _flatten
from steadytrain.data.schema import FieldSpec, Schema, SchemaError, dtype_name

if TYPE_CHECKING:  # any object with ``shard_ids`` and ``read_shard(id) -> pa.Table`` will do
    from steadytrain.data.format import Dataset

__all__ = ["infer_schema"]


@dataclass
class _Stats:
    dtype: str
    vocab: set[Any] | None
    shards: int = 0
    nulls: int = 0
    nan: bool = False
    lo: Any = None
    hi: Any = None


def infer_schema(
    dataset: Dataset,
    shards: list[int] | None = None,
    *,
    categorical: list[str] | None = None,
    max_categories: int = 1000,
) -> Schema:
    """Infer a schema from shards known to be healthy (default: all of them).

    Per column: the dtype; numeric min/max over the finite values; ``allow_nan`` only if a NaN was seen; for string
    and bool columns, and integer columns named in ``categorical``, the sorted distinct values as vocabulary if there
    are at most ``max_categories``; ``required`` if the column is in every shard and was never null.

    Example:
        >>> from types import SimpleNamespace
        >>> table = pa.table({"lang": ["en", "de", "en"], "age": [31, 7, 52]})
        >>> schema = infer_schema(SimpleNamespace(shard_ids=[0], read_shard=lambda i: table))
        >>> schema.fields["lang"].vocabulary, schema.fields["age"].min, schema.fields["age"].max
        (['de', 'en'], 7, 52)
    """
    check_int("max_categories", max_categories, 0)
    ids = list(dict.fromkeys(dataset.shard_ids if shards is None else shards))
    if not ids:
        raise SchemaError("no shards to infer a schema from: name healthy shards (e.g. --shards 0-39)")
    categorical = set(categorical or ())
    stats: dict[str, _Stats] = {}
    for sid in ids:
        table = dataset.read_shard(sid)
        for name in table.column_names:
            arr = _as_array(table.column(name))
            values, _ = _flatten(arr)
            if name not in stats:
                stats[name] = _new_stats(name, arr.type, values.type, name in categorical)
            st = stats[name]
            if (dtype := dtype_name(arr.type)) != st.dtype:
                raise SchemaError(
                    f"shard {sid}: column {brief(name)} is {dtype!r} but earlier shards have {st.dtype!r}; "
                    "infer the schema from healthy shards only (see `steadytrain data provenance`)"
                )
            _update(st, values, arr.null_count, max_categories)
    if unknown := sorted(categorical - stats.keys()):
        raise SchemaError(
            f"categorical column {brief(unknown[0])} is in none of the shards read "
            f"(columns: {brief(sorted(stats))}): check the name"
        )
    fields = {}
    for name, st in stats.items():
        vocab = sorted(st.vocab) if st.vocab else None
        fields[name] = FieldSpec(st.dtype, st.lo, st.hi, st.nan, vocab, st.shards == len(ids) and not st.nulls)
    return Schema(fields)


def _new_stats(name: str, t: pa.DataType, leaf: pa.DataType, categorical: bool) -> _Stats:
    """Empty statistics of a column; a vocabulary is kept for strings, bools and the integers named categorical."""
    vocab = pa.types.is_string(leaf) or pa.types.is_large_string(leaf) or pa.types.is_boolean(leaf)
    if categorical and not (vocab := vocab or pa.types.is_integer(leaf)):
        raise SchemaError(
            f"categorical column {name!r} has dtype {dtype_name(t)!r}: only integer, string and bool "
            "columns can have a vocabulary; drop it from --categorical"
        )
    return _Stats(dtype_name(t), set() if vocab else None)


def _update(st: _Stats, values: pa.Array, nulls: int, max_categories: int) -> None:
    """Fold one shard's values of a column into its statistics."""
    t = values.type
    st.shards, st.nulls = st.shards + 1, st.nulls + nulls
    if pa.types.is_floating(t):
        st.nan |= bool(pc.any(pc.is_nan(values)).as_py())
        values = values.filter(pc.is_finite(values))
    if pa.types.is_floating(t) or pa.types.is_integer(t):
        lo, hi = (pc.min_max(values)[k].as_py() for k in ("min", "max"))
        st.lo = lo if st.lo is None or lo is None else min(st.lo, lo)
        st.hi = hi if st.hi is None or hi is None else max(st.hi, hi)
    if st.vocab is not None:
        distinct = pc.unique(values.drop_null())
        st.vocab = None if len(distinct) > max_categories else st.vocab | set(distinct.to_pylist())
        if st.vocab is not None and len(st.vocab) > max_categories:
            st.vocab = None
