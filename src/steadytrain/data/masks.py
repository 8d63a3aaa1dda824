"""Vectorized schema checks: a violation mask per field and kind over a table's rows.

Every check uses ``pyarrow.compute`` and NumPy: nothing loops over rows in Python. The schema itself
(:class:`~steadytrain.data.schema.Schema`, its YAML form) lives in :mod:`steadytrain.data.schema`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from steadytrain.data.schema import FieldSpec, Schema, dtype_name

__all__ = ["check_table"]


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _as_array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """One contiguous array (zero-copy for a single chunk), dictionary-encoded columns decoded."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _comparable(values: pa.Array) -> pa.Array:
    """``values`` in a type pyarrow compares: float16 (which has no comparison kernels) as float32, exactly."""
    return values.cast(pa.float32()) if pa.types.is_float16(values.type) else values


def _limit(bound: float, t: pa.DataType) -> pa.Scalar:
    """A ``min``/``max`` as a scalar to compare values of type ``t`` with: an integer of that type when it fits
    (a Python int beyond int64 makes no scalar of its own, as ``max: 2**64 - 1`` of a uint64), else a float64."""
    if pa.types.is_integer(t) and isinstance(bound, int):
        try:
            return pa.scalar(bound, t)
        except (pa.ArrowException, OverflowError):
            pass
    try:
        return pa.scalar(float(bound), pa.float64())
    except OverflowError:  # beyond any float: below or above every value
        return pa.scalar(math.copysign(math.inf, bound), pa.float64())


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
        cmp = _comparable(values)
        if spec.min is not None:
            out |= _np(pc.less(cmp, _limit(spec.min, cmp.type)))  # NaN compares false: never out of range
        if spec.max is not None:
            out |= _np(pc.greater(cmp, _limit(spec.max, cmp.type)))
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
