"""Benchmark: examples/s of a 2-source mixture (``MixedDataset``) against the single-source reader on the same rows.

``--rows`` rows (default 200k) of a token dataset's shape, a ``tokens`` column of ``fixed_size_list<uint16>[129]``
(random ids below 50,257) and a float32 ``weight`` column, written once in ``--shards`` shards of equal size, laid
out two ways from the same shard contents:

* ``single``  -- one dataset of all the shards, read by ``BatchedDataset(batch_size=B, accumulation_steps=K,
  world_size=1, shuffle=True, shuffle_window=8)``;
* ``mixture`` -- the first 75% of the shards as source ``a``, the rest as source ``b``, weights 3:1, read by
  ``MixedDataset`` as a run builds it (``train/setup/mixture.py``: each source a ``BatchedDataset`` with
  ``batch_size=1`` seeded with ``source_seed(seed, j)``, the same window of 8) with the same ``B``, ``K`` and
  global batch. Mixture shard ids are the single dataset's (source ``b``'s offset is ``a``'s shard count).

With weights in the ratio of the sources' sizes, one mixture epoch reads each source once: one pass reads the same
number of rows as the single reader's pass (the same rows when ``G`` divides both sources; checked in the warm-up).
Each round times one full pass of micro-batches of each, in rotated order, no transform, in this process; the
ratio is mixture / single in examples/s, paired per round, and its median is the figure. Target: >= 0.9.
``--profile`` prints the top functions of one pass of each under cProfile instead.

Usage::

    python bench/mixture.py [--rows N] [--shards S] [--batch-sizes 16,256] [--accumulation K] [--repeats R]
                            [--dir PATH] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa

from steadytrain.data import BatchedDataset, DatasetWriter, MixedDataset, open_dataset
from steadytrain.data.mixture import source_seed

SEQ = 129  # seq_len 128 + 1, as an ingested token dataset stores it
VOCAB = 50_257
WINDOW = 8
SEED = 0
PROVENANCE = {"pipeline_version": "1.0", "schema_version": 1, "source": "bench-mixture"}


def build(root: Path, rows: int, shards: int) -> tuple[Path, Path, Path]:
    """``root/all`` (every shard), ``root/a`` (the first 75% of them) and ``root/b`` (the rest): the same rows."""
    paths = root / "all", root / "a", root / "b"
    if all((p / "index.json").exists() for p in paths):
        if (open_dataset(paths[0]).num_records, len(open_dataset(paths[0]).shards)) == (rows, shards):
            return paths
        raise SystemExit(f"{root} holds datasets of other --rows/--shards: give another --dir")
    rng = np.random.default_rng(0)
    split = shards * 3 // 4
    per = rows // shards
    with DatasetWriter(paths[0], provenance=PROVENANCE) as single:
        for s in range(shards):
            n = per if s < shards - 1 else rows - per * (shards - 1)
            tokens = rng.integers(0, VOCAB, (n, SEQ), dtype=np.uint16)
            flat = pa.array(tokens.reshape(-1))
            table = pa.table(
                {
                    "tokens": pa.FixedSizeListArray.from_arrays(flat, SEQ),
                    "weight": pa.array(rng.random(n, dtype=np.float32)),
                }
            )
            single.write_shard(table)
            with DatasetWriter(paths[1] if s < split else paths[2], provenance=PROVENANCE) as part:
                part.write_shard(table)
    return paths


def readers(paths: tuple[Path, Path, Path], b: int, k: int) -> tuple[BatchedDataset, MixedDataset]:
    single = BatchedDataset(
        paths[0], batch_size=b, accumulation_steps=k, shuffle=True, seed=SEED, shuffle_window=WINDOW
    )
    sources = [
        BatchedDataset(p, batch_size=1, seed=source_seed(SEED, j), shuffle_window=WINDOW)
        for j, p in enumerate(paths[1:])
    ]
    offsets = [0, len(sources[0].shard_ids)]
    sizes = [s.dataset.num_records for s in sources]
    weights = [Fraction(n, sum(sizes)) for n in sizes]
    mixture = MixedDataset(
        ["a", "b"], sources, offsets, weights, batch_size=b, accumulation_steps=k, seed=SEED, world_size=1
    )
    return single, mixture


def one_pass(ds: BatchedDataset | MixedDataset, epoch: int) -> int:
    """Examples read by one full pass (epoch ``epoch``) of micro-batches."""
    ds.set_epoch(epoch)
    n = 0
    for mb in ds:
        n += len(mb["weight"])
    return n


def warm_up(single: BatchedDataset, mixture: MixedDataset) -> int:
    """One untimed pass of each (checksums verified, page cache warm); the rows of the two passes compared."""
    seen = {}
    for name, ds in (("single", single), ("mixture", mixture)):
        ds.set_epoch(0)
        keys = [mb["shard"].numpy() * 1_000_000 + mb["index"].numpy() for mb in ds]
        seen[name] = np.sort(np.concatenate(keys))
    same = len(seen["single"]) == len(seen["mixture"]) and bool((seen["single"] == seen["mixture"]).all())
    assert len(seen["single"]) == len(seen["mixture"]), {k: len(v) for k, v in seen.items()}
    print(
        f"  one pass: {len(seen['single']):,} examples each; "
        f"{'the same rows' if same else 'the same count (each drops its own remainder)'}"
    )
    return len(seen["single"])


def timed(single: BatchedDataset, mixture: MixedDataset, repeats: int) -> float:
    """Rounds of one pass each, order rotated; prints each round and returns the median paired ratio."""
    methods = {"single": single, "mixture": mixture}
    names = list(methods)
    ratios = []
    rates: dict[str, list[float]] = {m: [] for m in names}
    print("  | round | first | single ex/s | mixture ex/s | mixture / single |")
    print("  |---:|---|---:|---:|---:|")
    for r in range(repeats):
        rate = {}
        order = names[r % len(names) :] + names[: r % len(names)]
        for m in order:
            t = time.perf_counter()
            n = one_pass(methods[m], r + 1)
            rate[m] = n / (time.perf_counter() - t)
            rates[m].append(rate[m])
        ratios.append(rate["mixture"] / rate["single"])
        print(f"  | {r + 1} | {order[0]} | {rate['single']:,.0f} | {rate['mixture']:,.0f} | {ratios[-1]:.3f} |")
    med = statistics.median(ratios)
    print(
        f"  median: single {statistics.median(rates['single']):,.0f} ex/s, "
        f"mixture {statistics.median(rates['mixture']):,.0f} ex/s, **mixture / single {med:.3f}** (target >= 0.9)"
    )
    return med


def profile(single: BatchedDataset, mixture: MixedDataset, top: int) -> None:
    """cProfile of one pass of each: the functions with the most time of their own, and the cumulative view."""
    for name, ds in (("single", single), ("mixture", mixture)):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        one_pass(ds, 1)
        prof.disable()
        print(f"  {name}: one pass {time.perf_counter() - t:.3f} s under cProfile")
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
            body = out.getvalue()
            print(body[body.find("   ncalls") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--batch-sizes", default="16,256", help="micro-batch sizes B, one run each")
    parser.add_argument("--accumulation", type=int, default=4, help="K: micro-batches per optimizer step")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the datasets are written (default: a temp dir)")
    parser.add_argument("--profile", action="store_true", help="cProfile one pass of each instead of timing")
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="steadytrain-bench-mixture-") as tmp:
        root = Path(args.dir or tmp)
        start = time.perf_counter()
        paths = build(root, args.rows, args.shards)
        sizes = [open_dataset(p).num_records for p in paths]
        mib = sum(s.bytes for s in open_dataset(paths[0]).shards) / 2**20
        w = Fraction(sizes[1], sizes[2])
        print(
            f"{sizes[0]:,} rows in {args.shards} shards ({mib:.1f} MiB); sources a {sizes[1]:,} / b {sizes[2]:,} "
            f"rows, weights {w.numerator}:{w.denominator}"
            f"; window {WINDOW}; ready in {time.perf_counter() - start:.1f} s"
        )
        medians = {}
        for b in (int(x) for x in args.batch_sizes.split(",")):
            single, mixture = readers(paths, b, args.accumulation)
            print(f"B={b}, K={args.accumulation}, G={mixture.global_batch_size}, W=1:")
            warm_up(single, mixture)
            if args.profile:
                profile(single, mixture, args.top)
            else:
                medians[b] = timed(single, mixture, args.repeats)
        if medians:
            print("mixture / single (median of paired):", ", ".join(f"B={b}: {v:.3f}" for b, v in medians.items()))


if __name__ == "__main__":
    main()
