"""Columns of a window cut into micro-batches: every piece against NumPy slicing of the same rows."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from steadytrain.data.columnar import concat_columns, split_columns, to_columns


def window(n: int) -> pa.Table:
    rng = np.random.default_rng(n)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 50, n * 3)), 3)
    return pa.table({"x": rng.standard_normal(n), "tokens": tokens, "s": [f"r{i}" for i in range(n)]})


@pytest.mark.parametrize("pieces", [1, 63, 64, 65, 200])
def test_pieces_are_the_rows_in_order(pieces):
    rng = np.random.default_rng(pieces)
    sizes = rng.integers(1, 9, pieces).tolist()
    table = window(sum(sizes))
    ref_x = table.column("x").to_numpy()
    ref_tok = np.stack(table.column("tokens").to_pylist())
    got = list(split_columns(to_columns(table), sizes))
    assert [len(p["s"]) for p in got] == sizes
    start = 0
    for n, piece in zip(sizes, got, strict=True):
        np.testing.assert_array_equal(piece["x"].numpy(), ref_x[start : start + n])
        np.testing.assert_array_equal(piece["tokens"].numpy(), ref_tok[start : start + n])
        assert piece["s"] == [f"r{i}" for i in range(start, start + n)]
        start += n


def test_pieces_are_writable_and_independent():
    table = window(10)
    ref = table.column("x").to_numpy().copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a tensor over read-only memory
        first, second = split_columns(to_columns(table), [4, 6])
    first["x"] += 1.0  # the user's code may modify a micro-batch in place
    np.testing.assert_array_equal(first["x"].numpy(), ref[:4] + 1.0)
    np.testing.assert_array_equal(second["x"].numpy(), ref[4:])


def test_read_only_arrow_memory_is_copied_not_aliased():
    values = np.arange(6, dtype=np.int64)
    frozen = pa.py_buffer(values.tobytes())  # immutable, as a memory-mapped file would be
    assert not frozen.is_mutable
    col = pa.Array.from_buffers(pa.int64(), 6, [None, frozen])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = to_columns(pa.table({"x": col}))["x"]
    x += 10  # must not write into (or crash on) Arrow's read-only buffer
    assert x.tolist() == (values + 10).tolist()
    assert col.to_pylist() == values.tolist()


def test_nulls_become_nan_and_chunks_are_joined():
    col = pa.chunked_array([pa.array([1.0, None]), pa.array([3.0])])
    x = to_columns(pa.table({"x": col}))["x"]
    assert torch.isnan(x[1]) and x[[0, 2]].tolist() == [1.0, 3.0]


def test_concat_joins_the_pieces_of_one_micro_batch():
    a, b = split_columns(to_columns(window(7)), [3, 4])
    whole = concat_columns([a, b])
    ref = to_columns(window(7))
    assert torch.equal(whole["x"], ref["x"]) and torch.equal(whole["tokens"], ref["tokens"])
    assert whole["s"] == ref["s"]
