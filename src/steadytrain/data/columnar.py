"""Columns of a window, converted once, sliced per micro-batch.

The rank's rows of a window are converted from Arrow in one pass per column (numeric columns to
tensors, fixed-length numeric lists to 2-D tensors, anything else to Python lists); a micro-batch
is then a set of slices: tensor views and list slices. There is no per-example Python work for
numeric columns. Every tensor is writable, so torch never warns and the user's code may modify a
micro-batch in place: a column is used in the memory Arrow decoded or gathered it into where that
memory is mutable (the table is the reader's own, fresh from one read), else copied once.
``to_columns`` therefore takes the table over: its mutable buffers become the tensors' memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = ["concat_columns", "numpy_view", "split_columns", "to_arrays", "to_columns"]

_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)


def _is_numeric(t: pa.DataType) -> bool:
    return any(is_type(t) for is_type in _NUMERIC)


def _owned(chunks: list[pa.Array], type_: pa.DataType) -> np.ndarray:
    """Numeric ``chunks`` as one writable NumPy array. One chunk whose memory Arrow allocated for this
    read (mutable: a decoded shard, a gather) and that holds its values as they are (no nulls, not
    bit-packed) is used in place; anything else is copied once. Never read-only memory: torch would warn,
    and a micro-batch tensor must be safe to modify in place."""
    if len(chunks) > 1:
        return np.concatenate([c.to_numpy(zero_copy_only=False) for c in chunks])  # nulls become NaN
    arr = chunks[0] if chunks else pa.array([], type=type_)
    buf = arr.buffers()[1]
    if arr.null_count == 0 and not pa.types.is_boolean(arr.type) and buf is not None and buf.is_mutable:
        dtype = np.dtype(arr.type.to_pandas_dtype())
        return np.frombuffer(buf, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
    return np.array(arr.to_numpy(zero_copy_only=False))


def _convert(col: pa.ChunkedArray | pa.Array) -> np.ndarray | list:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    t = col.type
    if pa.types.is_dictionary(t) and _is_numeric(t.value_type):
        return _convert(col.cast(t.value_type))  # dictionary-encoded numbers are numbers: a tensor
    if _is_numeric(t):
        return _owned(chunks, t)
    if pa.types.is_fixed_size_list(t) and col.null_count == 0 and _is_numeric(t.value_type):
        flat = _owned([c.flatten() for c in chunks], t.value_type)  # token ids, feature vectors: [rows, size]
        return flat.reshape(len(col), t.list_size)
    if pa.types.is_dictionary(t) or (_is_text(t) and _few_distinct(col)):
        return _via_dictionary(col)
    return col.to_pylist()


_SAMPLE = 1024  # rows sampled (evenly spaced) to judge a text column's cardinality


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _few_distinct(col: pa.ChunkedArray | pa.Array) -> bool:
    """Whether a text column looks categorical: at most one distinct value per 8 rows of an even sample."""
    if len(col) < 4 * _SAMPLE or col.null_count:
        return False
    sample = col.take(pa.array(np.linspace(0, len(col) - 1, _SAMPLE, dtype=np.int64)))
    return pc.count_distinct(sample).as_py() <= _SAMPLE // 8


def _via_dictionary(col: pa.ChunkedArray | pa.Array) -> list:
    """A categorical column as a list whose rows share one Python object per distinct value: 2.4x faster
    than ``to_pylist`` for 20 categories in 400k rows, and the memory of the distinct values only."""
    arr = col if pa.types.is_dictionary(col.type) else pc.dictionary_encode(col)
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if arr.null_count or arr.dictionary.null_count:
        return arr.to_pylist()
    values = np.array([*arr.dictionary.to_pylist(), None], dtype=object)[:-1]  # never a 2-D array of tuples
    return values[arr.indices.to_numpy(zero_copy_only=False)].tolist()


def numpy_view(chunk: pa.Array) -> np.ndarray | None:
    """A numeric chunk (or a fixed-size list of numbers) as a read-only NumPy view of its memory (``[rows, size]``
    for a list); None when there is none (text, nulls, booleans: :func:`to_arrays` converts those)."""
    try:
        if pa.types.is_fixed_size_list(chunk.type) and chunk.null_count == 0:
            return chunk.flatten().to_numpy(zero_copy_only=True).reshape(len(chunk), chunk.type.list_size)
        return chunk.to_numpy(zero_copy_only=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, NotImplementedError):
        return None


def to_arrays(table: pa.Table) -> dict[str, Any]:
    """Every column of ``table`` converted once: NumPy arrays (numeric) or lists (what :func:`to_columns` wraps)."""
    return {name: _convert(table.column(name)) for name in table.column_names}


def to_columns(table: pa.Table) -> dict[str, Any]:
    """Every column of ``table`` converted once: tensors (numeric) or lists."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in to_arrays(table).items()}


_GROUP = 64  # micro-batch pieces made at a time


def split_columns(cols: dict[str, Any], sizes: list[int]) -> Iterator[dict[str, Any]]:
    """Consecutive pieces of ``sizes`` rows (together all rows): tensor views and list slices.

    Tensors are cut ``_GROUP`` pieces at a time with one ``Tensor.split`` (about 1.8 us a view, against
    3.8 us for ``t[a:b]``). Cutting a whole window at once is as fast per view but keeps thousands of
    objects alive that Python's cycle collector then walks again and again (0.81-0.86x a hand-written
    Arrow loop, bench/data.py --batched); a group keeps at most ``_GROUP`` per column.
    """
    start = 0
    for g in range(0, len(sizes), _GROUP):
        group = sizes[g : g + _GROUP]
        total = sum(group)
        bounds = list(itertools.pairwise(itertools.accumulate(group, initial=start)))
        cut: dict[str, Any] = {}
        for name, col in cols.items():
            if isinstance(col, torch.Tensor):
                cut[name] = col.narrow(0, start, total).split(group)
            else:
                cut[name] = [col[a:b] for a, b in bounds]
        for i in range(len(group)):
            yield {name: pieces[i] for name, pieces in cut.items()}
        start += total


def concat_columns(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Pieces of one micro-batch from consecutive windows, joined column by column."""
    if len(pieces) == 1:
        return pieces[0]
    out: dict[str, Any] = {}
    for name, first in pieces[0].items():
        parts = [p[name] for p in pieces]
        out[name] = torch.cat(parts) if isinstance(first, torch.Tensor) else [x for part in parts for x in part]
    return out
