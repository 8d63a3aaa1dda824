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

With ``--batched``, the batched mode instead (micro-batches of ``B = 256`` as tensors):

* ``raw arrow batches`` -- ``pq.read_table`` per file, record batches of 256, numeric columns to torch
  with ``torch.from_numpy`` and strings to lists: the same work with no global order;
* ``raw + shard/index`` -- the same loop carrying ``shard`` and ``index`` columns (the baseline);
* ``batched``           -- ``ShardedDataset(batch_size=256, shuffle=False)``;
* ``batched+shuf``      -- the default: shard order and rows within a window of 8 shards shuffled;
* ``batched W=2 rank 0`` -- one of two ranks on one machine (it reads every shard of the window and
  keeps half the rows): its time per micro-batch against W=1 is the extra read cost of the window;
* ``per-example``       -- the per-example mode, for examples/s.

Target: batched >= 0.9x the raw loop with shard/index in micro-batches/s; >= 10x the per-example mode in examples/s.

With ``--loading`` (a): a transform calibrated to cost about one model step (an MLP on 1 thread), read
in the training process without prefetch (pays compute + data) and by one background worker
(``MicroBatchLoader``, prefetch 4): time per micro-batch against ``max(compute, data)``; target <= 1.1.
With ``--ingest`` (b): ``bench/ingest.py``.

Usage::

    python bench/data.py [--rows N] [--repeats R] [--dir PATH] [--batched | --loading | --ingest]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from steadytrain.data import BatchedDataset, DatasetWriter, ShardedDataset, infer_schema, open_dataset
from steadytrain.data.loader import MicroBatchLoader

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


def raw_micro_batches(files: list[Path], batch_size: int):
    """A hand-written PyArrow loop: record batches of ``batch_size`` with numeric columns as tensors."""
    for f in files:
        for batch in pq.read_table(f).to_batches(batch_size):
            yield {
                name: torch.from_numpy(col.to_numpy())
                if pa.types.is_floating(col.type) or pa.types.is_integer(col.type)
                else col.to_pylist()
                for name, col in zip(batch.schema.names, batch.columns, strict=True)
            }


def raw_micro_batches_with_keys(files: list[Path], batch_size: int):
    """The same loop carrying what every steadytrain micro-batch carries: ``shard`` and ``index`` tensors."""
    for s, f in enumerate(files):
        table = pq.read_table(f)
        n = table.num_rows
        table = table.append_column("shard", pa.array(np.full(n, s))).append_column("index", pa.array(np.arange(n)))
        for batch in table.to_batches(batch_size):
            yield {
                name: torch.from_numpy(col.to_numpy())
                if pa.types.is_floating(col.type) or pa.types.is_integer(col.type)
                else col.to_pylist()
                for name, col in zip(batch.schema.names, batch.columns, strict=True)
            }


def timed_rounds(methods: dict, repeats: int, baseline: str, work: dict[str, int]) -> None:
    """Interleaved rounds; prints the median rate and the median of paired ratios to ``baseline``."""
    names = list(methods)
    rates: dict[str, list[float]] = {m: [] for m in names}
    ratios: dict[str, list[float]] = {m: [] for m in names}
    for r in range(repeats):
        elapsed = {}
        for m in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            methods[m](r + 1)
            elapsed[m] = time.perf_counter() - t
            rates[m].append(work[m] / elapsed[m])
        for m in names:
            ratios[m].append((work[m] / elapsed[m]) / (work[baseline] / elapsed[baseline]))
    print(f"| method | units/s (median) | ratio to {baseline} (median of paired) |")
    print("|---|---:|---:|")
    for m in names:
        print(f"| {m} | {statistics.median(rates[m]):,.0f} | {statistics.median(ratios[m]):.3f} |")


def batched_main(path: Path, files: list[Path], repeats: int, n: int) -> None:
    b = 256
    w1 = BatchedDataset(path, batch_size=b, shuffle=False)
    w1s = BatchedDataset(path, batch_size=b, shuffle=True)
    w2 = BatchedDataset(path, batch_size=b, world_size=2, rank=0, shuffle=True)
    per_example = ShardedDataset(path, shuffle=False)
    methods = {
        "raw arrow batches": lambda e: count(raw_micro_batches(files, b)),
        "raw + shard/index": lambda e: count(raw_micro_batches_with_keys(files, b)),
        "batched": lambda e: ours_pass(w1, e),
        "batched+shuf": lambda e: ours_pass(w1s, e),
        "batched W=2 rank 0": lambda e: ours_pass(w2, e),
        "per-example": lambda e: ours_pass(per_example, e),
    }
    work = {m: methods[m](0) for m in methods}  # warm-up; micro-batches (examples for per-example) per pass
    print("micro-batches per pass:", {m: v for m, v in work.items() if m != "per-example"})
    timed_rounds(methods, repeats, "raw + shard/index", work)
    # examples/s: batched against per-example
    ex = {m: work[m] * (1 if m == "per-example" else b) for m in methods}
    timed_rounds({m: methods[m] for m in ("per-example", "batched")}, repeats, "per-example", ex)
    print("targets: batched >= 0.9x raw + shard/index; >= 10x per-example in examples/s")


_SPIN = {"iters": 1}


def costly_transform(mb: dict) -> dict:
    """Work per micro-batch in pure Python and NumPy (as decoding or tokenization would be), calibrated."""
    x = np.tile(mb["f0"].numpy(), 16)
    acc = 0.0
    for _ in range(_SPIN["iters"]):
        acc += float(np.sort(x).sum())
    return {**mb, "extra": torch.full((len(mb["f0"]),), acc)}


def loading_main(path: Path, repeats: int, steps: int = 300) -> None:
    """(a) Background loading: time per micro-batch with a transform that costs about one model step."""
    torch.set_num_threads(1)  # one core computes, the other loads
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    model.append(torch.nn.ReLU()).append(torch.nn.Linear(1024, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(mb: dict) -> None:
        x = torch.stack([mb[f"f{j}"] for j in range(4)], 1).float()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def data(workers: int) -> MicroBatchLoader:
        ds = BatchedDataset(path, batch_size=256, shuffle=False, transform=costly_transform)
        return MicroBatchLoader(ds, num_workers=workers, prefetch=4)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) / steps

    def steady(workers: int, train: bool) -> float:
        """Per micro-batch after the first: a worker's start (a process importing torch) is paid once per
        epoch, not per micro-batch, and is reported apart."""
        it = iter(data(workers))
        first = next(it)
        if train:
            step(first)
        t = time.perf_counter()
        for _, mb in zip(range(steps), it, strict=False):
            if train:
                step(mb)
        return (time.perf_counter() - t) / steps

    def startup() -> float:
        t = time.perf_counter()
        next(iter(data(1)))
        return time.perf_counter() - t

    fixed = next(iter(data(0)))
    compute = lambda: [step(fixed) for _ in range(steps)]  # noqa: E731
    t_c = timed(compute)
    _SPIN["iters"] = 100
    t = time.perf_counter()
    costly_transform(fixed)
    _SPIN["iters"] = max(1, round(100 * t_c / (time.perf_counter() - t)))  # the transform costs about one step
    loops = {
        "compute only": lambda: timed(compute),
        "data only": lambda: steady(0, False),
        "no prefetch (in-process)": lambda: steady(0, True),
        "steadytrain 1 worker": lambda: steady(1, True),
    }
    times: dict[str, list[float]] = {k: [] for k in loops}
    ratios: list[float] = []
    starts = []
    for _ in range(repeats):
        for k, fn in loops.items():
            times[k].append(fn())
        starts.append(startup())
        ratios.append(times["steadytrain 1 worker"][-1] / max(times["compute only"][-1], times["data only"][-1]))
    print(f"transform: {_SPIN['iters']} sorts per micro-batch; {steps} micro-batches of 256 per loop")
    print("| loop | ms per micro-batch (median) |")
    print("|---|---:|")
    for k, v in times.items():
        print(f"| {k} | {1e3 * statistics.median(v):.2f} |")
    print(f"steadytrain / max(compute, data): {statistics.median(ratios):.3f} (median of {repeats}; target <= 1.1)")
    print(f"a 1-worker loader's first micro-batch (once per epoch): {statistics.median(starts):.2f} s (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/steadytrain-bench-data")
    parser.add_argument("--batched", action="store_true", help="measure the batched mode (micro-batches of 256)")
    parser.add_argument("--loading", action="store_true", help="(a) background loading against max(compute, data)")
    parser.add_argument("--ingest", action="store_true", help="(b) data ingest against a hand-written tokenizer loop")
    args = parser.parse_args()
    if args.ingest:
        from ingest import main as ingest_main  # bench/ingest.py

        ingest_main([])
        return
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
    if args.batched:
        batched_main(path, files, args.repeats, dataset.num_records)
        return
    if args.loading:
        loading_main(path, args.repeats)
        return
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
