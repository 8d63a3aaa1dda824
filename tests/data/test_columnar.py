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


def _text_columns() -> dict[str, pa.ChunkedArray]:
    rng = np.random.default_rng(3)
    cats = np.array(["a", "b'\n\"", "ünï", ""])  # quotes, newlines, non-ASCII and the empty string
    few = cats[rng.integers(0, 4, 6000)]
    with_null = few.tolist()
    with_null[4321] = None
    return {
        "categories": pa.chunked_array([pa.array(few[:2500]), pa.array(few[2500:])]),
        "categories, one null": pa.chunked_array([pa.array(with_null)]),
        "large_string": pa.chunked_array([pa.array(few, type=pa.large_string())]),
        "unique": pa.chunked_array([pa.array([f"doc {i}" for i in range(6000)])]),
        "mostly one value, then unique": pa.chunked_array([pa.array(["x"] * 5000 + [f"u{i}" for i in range(1000)])]),
        "dictionaries differ per chunk": pa.chunked_array(
            [pa.array(few[:3000]).dictionary_encode(), pa.array(few[3000:][::-1]).dictionary_encode()]
        ),
        "dictionary of lists": pa.chunked_array(
            [pa.DictionaryArray.from_arrays(pa.array([0, 1, 0] * 2000, pa.int8()), pa.array([[1, 2], [3]]))]
        ),
        "dictionary with a null": pa.chunked_array(
            [pa.DictionaryArray.from_arrays(pa.array([0, None, 1] * 2000, pa.int8()), pa.array([[1, 2], [3]]))]
        ),
    }


@pytest.mark.parametrize("name", list(_text_columns()))
def test_text_and_dictionary_columns_are_the_python_values(name):
    col = _text_columns()[name]
    got = to_columns(pa.table({"c": col}))["c"]
    ref = col.to_pylist()  # pyarrow decodes dictionaries itself
    assert isinstance(got, list) and got == ref
    got[0] = "changed"  # each micro-batch's list is its own
    assert to_columns(pa.table({"c": col}))["c"] == ref


def test_dictionary_encoded_numbers_stay_a_tensor():
    values = np.array([0.5, -2.0, 0.5, 7.0] * 3)
    col = pa.chunked_array([pa.array(values[:5]).dictionary_encode(), pa.array(values[5:]).dictionary_encode()])
    x = to_columns(pa.table({"x": col}))["x"]
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float64
    np.testing.assert_array_equal(x.numpy(), values)


@pytest.mark.parametrize("shuffle", [False, True])
def test_reader_and_workers_give_each_row_its_stored_values(tmp_path, shuffle):
    """Through ``BatchedDataset`` and two loader workers (pickled hand-off): every row of every micro-batch
    is the row its (shard, index) names in the Parquet file, read back with pyarrow."""
    from steadytrain.data import BatchedDataset, DatasetWriter, open_dataset
    from steadytrain.data.loader import MicroBatchLoader

    rng = np.random.default_rng(11)
    cats = np.array(["cat", 'say "hi"', "two\nlines", "ünï"])
    with DatasetWriter(tmp_path, provenance={"pipeline_version": "1"}) as w:
        for _ in range(2):
            n = 4500
            w.write_shard(
                pa.table(
                    {
                        "label": cats[rng.integers(0, 4, n)],
                        "level": pa.array(rng.integers(0, 3, n) * 1.5).dictionary_encode(),
                        "x": rng.standard_normal(n),
                        "text": [f"doc {i}" for i in range(n)],
                    }
                )
            )
    ds = open_dataset(tmp_path)
    stored = {s.id: ds.read_shard(s.id).to_pydict() for s in ds.shards}
    for workers in (0, 2):
        reader = BatchedDataset(tmp_path, batch_size=256, accumulation_steps=2, seed=3, shuffle=shuffle)
        rows = 0
        for mb in MicroBatchLoader(reader, num_workers=workers, prefetch=2):
            assert isinstance(mb["label"], list) and mb["level"].dtype == torch.float64
            for j, (s, i) in enumerate(zip(mb["shard"].tolist(), mb["index"].tolist(), strict=True)):
                ref = stored[s]
                assert mb["label"][j] == ref["label"][i] and mb["text"][j] == ref["text"][i]
                assert mb["x"][j].item() == ref["x"][i] and mb["level"][j].item() == ref["level"][i]
            rows += len(mb["label"])
        assert rows == reader.steps_per_epoch * reader.global_batch_size > 8000
