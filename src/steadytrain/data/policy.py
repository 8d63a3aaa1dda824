"""Load-time policies: ``raise`` at the first violating example, ``drop`` violating rows, or ``clamp`` what can be."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from steadytrain._io import brief
from steadytrain.data.masks import _as_array, _comparable, _is_list, check_table
from steadytrain.data.schema import POLICIES, Schema, SchemaViolationError, _short, dtype_name
from steadytrain.errors import UserError

__all__ = ["PolicyCounts", "apply_policy"]


@dataclass
class PolicyCounts:
    """Rows dropped and rows clamped by :func:`apply_policy`, and violating rows per field and kind."""

    dropped: int = 0
    clamped: int = 0
    by_field: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_state(cls, value: object) -> PolicyCounts:
        """Counts from a state's ``counts`` (``dataclasses.asdict`` form); a :class:`UserError` if malformed.

        Example:
            >>> PolicyCounts.from_state({"dropped": 2, "clamped": 0, "by_field": {"x": {"nan": 2}}}).dropped
            2
        """

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        by_field = value.get("by_field", {}) if isinstance(value, dict) else None
        if (
            not isinstance(value, dict)
            or set(value) - {"dropped", "clamped", "by_field"}
            or not all(count(value.get(k, 0)) for k in ("dropped", "clamped"))
            or not isinstance(by_field, dict)
            or not all(isinstance(f, str) and isinstance(k, dict) for f, k in by_field.items())
            or not all(isinstance(n, str) and count(c) for k in by_field.values() for n, c in k.items())
        ):
            raise UserError(
                f"ShardedDataset state: 'counts' = {brief(value)} is malformed (counts are integers >= 0): "
                "not a state_dict() of this version"
            )
        return cls(value.get("dropped", 0), value.get("clamped", 0), {f: dict(k) for f, k in by_field.items()})

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
        b = _bound(lo, t, False)
        arr = pc.if_else(pc.less(_comparable(arr), b.cast(_comparable(arr).type)), b, arr)
    if hi is not None:
        b = _bound(hi, t, True)
        arr = pc.if_else(pc.greater(_comparable(arr), b.cast(_comparable(arr).type)), b, arr)
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
        >>> from steadytrain.data.schema import FieldSpec
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
