"""Columns of a window, converted once, sliced per micro-batch.

The rank's rows of a window are converted from Arrow in one pass per column (numeric columns to
tensors, fixed-length numeric lists to 2-D tensors, anything else to Python lists); a micro-batch
is then a set of slices: tensor views and list slices. There is no per-example Python work for
numeric columns. The arrays are made writable (one copy per window) so torch never warns and a
micro-batch tensor can be modified in place by the user's code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = ["concat_columns", "slice_columns", "split_columns", "to_columns"]

_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)


def _is_numeric(t: pa.DataType) -> bool:
    return any(is_type(t) for is_type in _NUMERIC)


def _convert(col: pa.ChunkedArray | pa.Array) -> np.ndarray | list:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) > 1 and _is_numeric(col.type):  # one copy, straight into a writable array
        return np.concatenate([c.to_numpy(zero_copy_only=False) for c in chunks])
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if _is_numeric(arr.type):
        return np.array(arr.to_numpy(zero_copy_only=False))  # nulls become NaN
    if pa.types.is_fixed_size_list(arr.type) and arr.null_count == 0 and _is_numeric(arr.type.value_type):
        flat = arr.flatten().to_numpy(zero_copy_only=False)  # token ids, feature vectors: [rows, size]
        return np.array(flat).reshape(len(arr), arr.type.list_size)
    return arr.to_pylist()


def to_columns(table: pa.Table) -> dict[str, Any]:
    """Every column of ``table`` converted once: tensors (numeric) or lists."""
    out: dict[str, Any] = {}
    for name in table.column_names:
        col = _convert(table.column(name))
        out[name] = torch.from_numpy(col) if isinstance(col, np.ndarray) else col
    return out


def slice_columns(cols: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``[start, stop)`` of every column (views, no copies for tensors)."""
    return {name: col[start:stop] for name, col in cols.items()}


def split_columns(cols: dict[str, Any], sizes: list[int]) -> Iterator[dict[str, Any]]:
    """Consecutive pieces of ``sizes`` rows (together all rows): views and list slices, each made as it is
    taken. Making a window's pieces all at once (``Tensor.split``) is faster per view, but keeps thousands
    of objects alive that Python's cycle collector then walks again and again: 0.81-0.86x a hand-written
    Arrow loop against 1.0x this way (bench/data.py --batched)."""
    start = 0
    for n in sizes:
        yield slice_columns(cols, start, start + n)
        start += n


def concat_columns(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Pieces of one micro-batch from consecutive windows, joined column by column."""
    if len(pieces) == 1:
        return pieces[0]
    out: dict[str, Any] = {}
    for name, first in pieces[0].items():
        parts = [p[name] for p in pieces]
        out[name] = torch.cat(parts) if isinstance(first, torch.Tensor) else [x for part in parts for x in part]
    return out
