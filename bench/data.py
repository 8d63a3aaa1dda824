"""Benchmark: examples/s of ``ShardedDataset`` against iterating the same Parquet files with PyArrow.

A generated dataset of ``--rows`` rows (default 1M) in 20 shards: four float64 features, a string
category (20 values) and an int64 label. Compared, interleaved, one full pass each per round:

* ``raw pyarrow``      -- a generator over ``pq.read_table`` per file, ``to_pylist()`` per 8192-row
  batch: the dicts a hand-written PyArrow dataset would yield;
* ``raw + shard/index`` -- the same with the two fields every steadytrain example carries;
* ``steadytrain``      -- ``ShardedDataset(shuffle=False)``: the same plus ``shard``/``index`` keys;
* ``steadytrain+shuf`` -- the default: shard order and in-shard order shuffled per epoch;
* ``+ validation``     -- with an inferred schema applied at load (policy ``raise``).

Checksums are verified once per process (the first pass, untimed warm-up). Ratios are medians of
paired ratios over the rounds. Targets: >= 0.9x raw without validation, >= 0.7x with.

Usage::

    python bench/data.py [--rows N] [--repeats R] [--dir PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from steadytrain.data import DatasetWriter, ShardedDataset, infer_schema, open_dataset

SHARDS = 20


def build(path: Path, rows: int) -> None:
    if (path / "index.json").exists() and open_dataset(path).num_records == rows:
        return
    rng = np.random.default_rng(0)
    cats = np.array([f"c{i:02d}" for i in range(20)])
    per = rows // SHARDS
    with DatasetWriter(path, provenance={"pipeline_version": "1.0", "schema_version": 1, "source": "bench"}) as w:
        for s in range(SHARDS):
            n = per if s < SHARDS - 1 else rows - per * (SHARDS - 1)
            cols = {f"f{j}": rng.standard_normal(n) for j in range(4)}
            cols["category"] = cats[rng.integers(0, 20, n)]
            cols["label"] = rng.integers(0, 10, n)
            w.write_shard(pa.table(cols))


def raw_examples(files: list[Path]):
    """What a hand-written PyArrow dataset yields: one dict per row, file after file."""
    for f in files:
        for batch in pq.read_table(f).to_batches(8192):
            yield from batch.to_pylist()


def raw_examples_with_keys(files: list[Path]):
    """The same, plus the ``shard`` and ``index`` fields every steadytrain example carries."""
    for s, f in enumerate(files):
        table = pq.read_table(f)
        n = table.num_rows
        table = table.append_column("shard", pa.array(np.full(n, s))).append_column("index", pa.array(np.arange(n)))
        for batch in table.to_batches(8192):
            yield from batch.to_pylist()


def count(examples) -> int:
    n = 0
    for _row in examples:
        n += 1
    return n


def ours_pass(ds: ShardedDataset, epoch: int) -> int:
    ds.set_epoch(epoch)
    return count(ds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/steadytrain-bench-data")
    args = parser.parse_args()
    path = Path(args.dir)
    start = time.perf_counter()
    build(path, args.rows)
    dataset = open_dataset(path)
    files = [path / s.file for s in dataset.shards]
    schema = infer_schema(dataset)
    print(
        f"{dataset.num_records:,} rows in {len(files)} shards ({sum(s.bytes for s in dataset.shards) / 2**20:.1f} MiB)"
        f", ready in {time.perf_counter() - start:.1f} s"
    )
    methods = {
        "raw pyarrow": lambda e: count(raw_examples(files)),
        "raw + shard/index": lambda e: count(raw_examples_with_keys(files)),
        "steadytrain": (lambda d: lambda e: ours_pass(d, e))(ShardedDataset(path, shuffle=False)),
        "steadytrain+shuf": (lambda d: lambda e: ours_pass(d, e))(ShardedDataset(path, shuffle=True)),
        "+ validation": (lambda d: lambda e: ours_pass(d, e))(ShardedDataset(path, shuffle=False, schema=schema)),
        "+ validation+shuf": (lambda d: lambda e: ours_pass(d, e))(ShardedDataset(path, shuffle=True, schema=schema)),
    }
    for fn in methods.values():  # warm-up: verifies checksums once, warms the page cache
        assert fn(0) == dataset.num_records
    rates: dict[str, list[float]] = {m: [] for m in methods}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    names = list(methods)
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        elapsed = {}
        for m in order:
            t = time.perf_counter()
            methods[m](r + 1)
            elapsed[m] = time.perf_counter() - t
            rates[m].append(dataset.num_records / elapsed[m])
        for m in names:
            ratios[m].append(elapsed["raw pyarrow"] / elapsed[m])
    print("| method | examples/s (median) | ratio to raw (median of paired) |")
    print("|---|---:|---:|")
    for m in names:
        print(f"| {m} | {statistics.median(rates[m]):,.0f} | {statistics.median(ratios[m]):.3f} |")
    print("targets: >= 0.9x raw without validation, >= 0.7x with")


if __name__ == "__main__":
    main()
