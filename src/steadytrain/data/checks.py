"""Vectorized schema checks: violation masks per field, inference from healthy shards, validation reports,
and the load-time policies ``raise``, ``drop`` and ``clamp``.

Every check uses ``pyarrow.compute`` and NumPy: nothing loops over rows in Python. The schema itself
(:class:`~steadytrain.data.schema.Schema`, its YAML form) lives in :mod:`steadytrain.data.schema`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from steadytrain.data.schema import (
    POLICIES,
    FieldSpec,
    Schema,
    SchemaError,
    SchemaViolationError,
    _short,
    dtype_name,
)

if TYPE_CHECKING:  # any object with ``shard_ids`` and ``read_shard(id) -> pa.Table`` will do
    from steadytrain.data.format import Dataset

__all__ = [
    "FieldViolation",
    "PolicyCounts",
    "ValidationReport",
    "apply_policy",
    "check_table",
    "infer_schema",
    "validate",
]


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _as_array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One contiguous array (zero-copy for a single chunk), dictionary-encoded columns decoded."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _np(mask: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)


def _flatten(arr: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """Leaf values of a (nested) list array and the row each came from; ``(arr, None)`` for a flat array."""
    rows = None
    while _is_list(arr.type):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        parent = np.repeat(np.arange(len(arr)), lengths)  # list_flatten skips null lists, as the 0 lengths do
        rows = parent if rows is None else rows[parent]
        arr = pc.list_flatten(arr)
    return arr, rows


def _to_rows(mask: pa.Array | np.ndarray, rows: np.ndarray | None, n: int) -> np.ndarray:
    mask = mask if isinstance(mask, np.ndarray) else _np(mask)
    if rows is None:
        return mask
    out = np.zeros(n, dtype=bool)
    out[rows[mask]] = True
    return out


@functools.lru_cache(maxsize=256)
def _value_set(vocabulary: tuple, t: pa.DataType) -> pa.Array:
    """The vocabulary as an Arrow array, built once (building it per shard costs more than the check)."""
    return pa.array(list(vocabulary), type=t)


def _clean(values: pa.Array, spec: FieldSpec, is_float: bool) -> bool:
    """True when nothing in ``values`` can violate ``spec``: one cheap pass, no masks (the common case)."""
    if values.null_count:
        return False
    if is_float or pa.types.is_integer(values.type):
        v = values.to_numpy(zero_copy_only=False)
        if is_float and not np.isfinite(v).all():
            return False
        if len(v) and spec.min is not None and v.min() < spec.min:
            return False
        if len(v) and spec.max is not None and v.max() > spec.max:
            return False
    if spec.vocabulary is not None:
        known = pc.is_in(values, value_set=_value_set(tuple(spec.vocabulary), values.type))
        return bool(pc.all(known).as_py() is not False)
    return True


def _check_column(col: pa.ChunkedArray | None, spec: FieldSpec, n: int) -> dict[str, np.ndarray]:
    if col is None:
        return {"missing": np.ones(n, dtype=bool)} if spec.required else {}
    arr = _as_array(col)
    if dtype_name(arr.type) != spec.dtype:
        return {"wrong_type": np.ones(n, dtype=bool)}
    masks = {"missing": _np(arr.is_null())} if spec.required and arr.null_count else {}
    values, rows = _flatten(arr)
    is_float = pa.types.is_floating(values.type)
    if not masks and _clean(values, spec, is_float):
        return {}
    inf = _np(pc.is_inf(values)) if is_float else None
    if is_float:
        masks["non_finite"] = _to_rows(
            inf if spec.allow_nan else ~_np(pc.is_finite(values)) & _np(values.is_valid()), rows, n
        )
    if (is_float or pa.types.is_integer(values.type)) and (spec.min is not None or spec.max is not None):
        out = np.zeros(len(values), dtype=bool)
        if spec.min is not None:
            out |= _np(pc.less(values, spec.min))  # NaN compares false: never out of range
        if spec.max is not None:
            out |= _np(pc.greater(values, spec.max))
        masks["out_of_range"] = _to_rows(out & ~inf if is_float else out, rows, n)  # ±inf is non_finite only
    if spec.vocabulary is not None:
        known = _np(pc.is_in(values, value_set=_value_set(tuple(spec.vocabulary), values.type)))
        masks["unexpected_category"] = _to_rows(~known & _np(values.is_valid()), rows, n)
    return masks


def check_table(table: pa.Table, schema: Schema) -> dict[str, dict[str, np.ndarray]]:
    """Per field and violation kind, a boolean mask over the table's rows; only non-empty masks are returned.

    Kinds (:data:`KINDS`): ``missing`` (required column absent: every row; or a null), ``wrong_type`` (column type
    differs: every row), ``non_finite`` (NaN unless allowed, ±inf always), ``out_of_range`` (finite values outside
    [min, max]) and ``unexpected_category`` (non-null value outside the vocabulary). A row of a list field violates
    when any of its elements does.

    Example:
        >>> schema = Schema({"lang": FieldSpec("string", vocabulary=["en", "de"]), "w": FieldSpec("float64", 0, 1)})
        >>> masks = check_table(pa.table({"lang": ["en", "fr", "de"], "w": [0.5, 0.1, float("nan")]}), schema)
        >>> {f: {k: m.nonzero()[0].tolist() for k, m in kinds.items()} for f, kinds in masks.items()}
        {'lang': {'unexpected_category': [1]}, 'w': {'non_finite': [2]}}
    """
    names = set(table.column_names)
    masks = {}
    for name, spec in schema.fields.items():
        kinds = _check_column(table.column(name) if name in names else None, spec, table.num_rows)
        if kinds := {kind: mask for kind, mask in kinds.items() if mask.any()}:
            masks[name] = kinds
    return masks


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
    ids = list(dataset.shard_ids if shards is None else shards)
    categorical = set(categorical or ())
    stats: dict[str, _Stats] = {}
    for sid in ids:
        table = dataset.read_shard(sid)
        for name in table.column_names:
            arr = _as_array(table.column(name))
            values, _ = _flatten(arr)
            t, dtype = values.type, dtype_name(arr.type)
            if name not in stats:
                vocab = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_boolean(t)
                if name in categorical and not (vocab := vocab or pa.types.is_integer(t)):
                    raise ValueError(
                        f"categorical column {name!r} has dtype {dtype!r}: only integer, string and bool "
                        "columns can have a vocabulary"
                    )
                stats[name] = _Stats(dtype, set() if vocab else None)
            st = stats[name]
            if st.dtype != dtype:
                raise SchemaError(
                    f"shard {sid}: column {name!r} is {dtype!r} but earlier shards have {st.dtype!r}; "
                    "infer the schema from healthy shards only"
                )
            st.shards, st.nulls = st.shards + 1, st.nulls + arr.null_count
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
    if unknown := sorted(categorical - stats.keys()):
        raise ValueError(f"categorical column {unknown[0]!r} is in none of shards {ids}")
    fields = {}
    for name, st in stats.items():
        vocab = sorted(st.vocab) if st.vocab else None
        fields[name] = FieldSpec(st.dtype, st.lo, st.hi, st.nan, vocab, st.shards == len(ids) and not st.nulls)
    return Schema(fields)


@dataclass
class FieldViolation:
    """One field's violations of one kind in one shard; ``examples`` are the first 10 example indices."""

    shard: int
    field: str
    kind: str
    count: int
    examples: list[int]


@dataclass
class ValidationReport:
    """What :func:`validate` found: the violations and the records checked per shard."""

    violations: list[FieldViolation] = dataclasses.field(default_factory=list)
    records_checked: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def shards_with_violations(self) -> list[int]:
        return sorted({v.shard for v in self.violations})

    def by_shard(self) -> dict[int, list[FieldViolation]]:
        out: dict[int, list[FieldViolation]] = {}
        for v in self.violations:
            out.setdefault(v.shard, []).append(v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records_checked": dict(self.records_checked),
            "violations": [asdict(v) for v in self.violations],
        }

    def __str__(self) -> str:
        lines = [
            f"{sum(self.records_checked.values())} records in {len(self.records_checked)} shards checked: "
            + ("ok" if self.ok else f"violations in shards {self.shards_with_violations}")
        ]
        lines += [
            f"  shard {v.shard}: field {v.field!r} {v.kind} x{v.count} (examples {v.examples})" for v in self.violations
        ]
        return "\n".join(lines)


def validate(dataset: Dataset, schema: Schema, shards: list[int] | None = None) -> ValidationReport:
    """Check every row of the given shards (default: all) against the schema.

    Example:
        >>> from types import SimpleNamespace
        >>> schema = Schema({"lang": FieldSpec("string", vocabulary=["en", "de"])})
        >>> shards = {0: pa.table({"lang": ["en", "de"]}), 47: pa.table({"lang": ["en", "fr-CA", "fr-CA"]})}
        >>> report = validate(SimpleNamespace(shard_ids=[0, 47], read_shard=shards.get), schema)
        >>> report.shards_with_violations, report.violations[0].kind, report.violations[0].examples
        ([47], 'unexpected_category', [1, 2])
    """
    report = ValidationReport()
    for sid in dataset.shard_ids if shards is None else shards:
        table = dataset.read_shard(sid)
        report.records_checked[sid] = table.num_rows
        for name, kinds in check_table(table, schema).items():
            for kind, mask in kinds.items():
                idx = np.flatnonzero(mask)
                report.violations.append(FieldViolation(sid, name, kind, len(idx), idx[:10].tolist()))
    return report


@dataclass
class PolicyCounts:
    """Rows dropped and rows clamped by :func:`apply_policy`, and violating rows per field and kind."""

    dropped: int = 0
    clamped: int = 0
    by_field: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def add(self, other: PolicyCounts) -> PolicyCounts:
        """Accumulate ``other`` into these counts (in place) and return them."""
        self.dropped, self.clamped = self.dropped + other.dropped, self.clamped + other.clamped
        for name, kinds in other.by_field.items():
            mine = self.by_field.setdefault(name, {})
            for kind, count in kinds.items():
                mine[kind] = mine.get(kind, 0) + count
        return self


def _bound(bound: float, t: pa.DataType, upper: bool) -> pa.Scalar:
    """``bound`` as a value of type ``t`` that lies inside the range (rounded towards it)."""
    if pa.types.is_integer(t):
        info = np.iinfo(t.to_pandas_dtype())
        return pa.scalar(min(max(math.floor(bound) if upper else math.ceil(bound), int(info.min)), int(info.max)), t)
    ftype = np.dtype(t.to_pandas_dtype()).type
    b = ftype(bound)
    if (float(b) > bound) if upper else (float(b) < bound):  # float32(0.1) > 0.1: step back inside (compare in f64)
        b = np.nextafter(b, ftype(-np.inf if upper else np.inf))
    return pa.scalar(b, t)


def _clip(arr: pa.Array, lo: float | None, hi: float | None) -> pa.Array:
    """Clip every leaf value of ``arr`` (lists rebuilt around the clipped values); NaN and nulls are kept."""
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        values = arr.values.slice(arr.offset * t.list_size, len(arr) * t.list_size)
        return pa.FixedSizeListArray.from_arrays(_clip(values, lo, hi), type=t, mask=arr.is_null())
    if _is_list(t):
        offsets = arr.offsets
        start, stop = offsets[0].as_py(), offsets[-1].as_py()
        values = _clip(arr.values.slice(start, stop - start), lo, hi)
        cls = pa.LargeListArray if pa.types.is_large_list(t) else pa.ListArray
        return cls.from_arrays(pc.subtract(offsets, start), values, type=t, mask=arr.is_null())
    if lo is not None:
        arr = pc.if_else(pc.less(arr, b := _bound(lo, t, False)), b, arr)
    if hi is not None:
        arr = pc.if_else(pc.greater(arr, b := _bound(hi, t, True)), b, arr)
    return arr


def _violation(
    table: pa.Table, schema: Schema, masks: dict[str, dict[str, np.ndarray]], shard: int, offset: int, bad: np.ndarray
) -> SchemaViolationError:
    row = int(np.argmax(bad))
    name, kind = next((f, k) for f, kinds in masks.items() for k, m in kinds.items() if m[row])
    spec, present = schema.fields[name], name in table.column_names
    col = table.column(name) if present else None
    value = col[row].as_py() if col is not None else None
    subject = f"field {name!r} = {_short(value)}" + (
        " has an element that" if col is not None and _is_list(col.type) else ""
    )
    vocab = spec.vocabulary or []
    if kind == "missing":
        detail = (
            f"field {name!r} is null but required"
            if present
            else f"required field {name!r} is missing (columns: {_short(table.column_names)})"
        )
    elif kind == "wrong_type":
        detail = f"field {name!r} = {_short(value)} has type {dtype_name(col.type)}, expected {spec.dtype}"
    elif kind == "non_finite":
        detail = f"{subject} is not finite" + (" (NaN is allowed, ±inf never)" if spec.allow_nan else "")
    elif kind == "out_of_range":
        lo, hi = ("-inf" if spec.min is None else spec.min), ("inf" if spec.max is None else spec.max)
        detail = f"{subject} is outside [{lo}, {hi}]"
    else:
        shown = ", ".join(repr(v) for v in vocab[:3]) + (", ..." if len(vocab) > 3 else "")
        detail = f"{subject} is not in the vocabulary ({len(vocab)} values" + (f", e.g. {shown})" if vocab else ")")
    message = (
        f"shard {shard}, example {offset + row}: {detail} [{int(bad.sum())} of {len(bad)} examples violate the schema]"
    )
    return SchemaViolationError(message, shard=shard, example=offset + row, field=name, kind=kind, value=value)


def apply_policy(
    table: pa.Table, schema: Schema, policy: str, *, shard: int, offset: int = 0
) -> tuple[pa.Table, np.ndarray, PolicyCounts]:
    """Enforce the schema on a table as it is loaded.

    ``raise`` raises :class:`SchemaViolationError` at the first violating example; ``drop`` removes every violating
    row; ``clamp`` clips out-of-range numeric values into [min, max] and drops the rows whose violations cannot be
    clamped (missing, wrong type, non-finite, unexpected category). A table without violations is returned as is.

    Args:
        table: rows ``offset``, ``offset + 1``, ... of shard ``shard``.
        schema: the schema to enforce.
        policy: one of :data:`POLICIES`.
        shard: the shard id, for messages.
        offset: example index (within the shard) of the table's first row.

    Returns:
        The table to use, the int64 example indices (in the shard) of its rows, and the counts: rows ``dropped``,
        kept rows ``clamped`` and, per field and kind, the violating rows of the input.

    Example:
        >>> schema = Schema({"age": FieldSpec("int64", min=0, max=120)})
        >>> table, kept, counts = apply_policy(pa.table({"age": [30, 250, None]}), schema, "clamp", shard=47)
        >>> table["age"].to_pylist(), kept.tolist(), counts.dropped, counts.clamped
        ([30, 120], [0, 1], 1, 1)
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
    masks = check_table(table, schema)
    n = table.num_rows
    if not masks:
        return table, np.arange(offset, offset + n, dtype=np.int64), PolicyCounts()
    counts = PolicyCounts(by_field={f: {k: int(m.sum()) for k, m in kinds.items()} for f, kinds in masks.items()})
    bad, clip = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for kinds in masks.values():
        for kind, mask in kinds.items():
            if policy == "clamp" and kind == "out_of_range":
                clip |= mask
            else:
                bad |= mask
    if policy == "raise":
        raise _violation(table, schema, masks, shard, offset, bad)
    keep = ~bad
    counts.dropped, counts.clamped = int(bad.sum()), int((clip & keep).sum())
    if counts.clamped:
        for name in (f for f, kinds in masks.items() if "out_of_range" in kinds):
            i, spec = table.schema.get_field_index(name), schema.fields[name]
            table = table.set_column(i, table.schema.field(i), _clip(_as_array(table.column(i)), spec.min, spec.max))
    if counts.dropped:
        table = table.filter(pa.array(keep))
    return table, (np.flatnonzero(keep) + offset).astype(np.int64), counts
