"""Benchmark: the batched reader's column code at an earlier commit against the code now, in one process.

Both read the same dataset (``bench/data.py``'s 1M rows in 20 shards) through one ``BatchedDataset``
whose ``split_columns``/``to_columns`` are swapped per pass, interleaved with the hand-written Arrow
loop carrying ``shard``/``index`` (``bench/data.py``). Prints the median seconds per pass and the
median of paired ratios to the raw loop. Use it where the machine's speed moves between sessions.

Usage::

    python bench/reader_ab.py --before e1a9eca [--rounds 9] [--shuffle]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import steadytrain.data.batched as batched
from steadytrain.data import BatchedDataset, open_dataset

sys.path.insert(0, str(Path(__file__).parent))
import data as bench_data  # bench/data.py


def columnar_at(commit: str) -> types.ModuleType:
    """``steadytrain.data.columnar`` as it was at ``commit``, loaded under another name (no file written)."""
    src = subprocess.run(
        ["git", "show", f"{commit}:src/steadytrain/data/columnar.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("columnar_before")
    exec(compile(src, f"{commit}:columnar.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit whose reader code is compared")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--dir", default="/tmp/steadytrain-bench-data")
    args = parser.parse_args()
    path = Path(args.dir)
    bench_data.build(path, 1_000_000)
    files = [path / s.file for s in open_dataset(path).shards]
    old = columnar_at(args.before)
    code = {"before": (old.split_columns, old.to_columns), "now": (batched.split_columns, batched.to_columns)}
    ds = BatchedDataset(path, batch_size=256, shuffle=args.shuffle)
    bench_data.ours_pass(ds, 0)  # verifies checksums once, warms the page cache
    times: dict[str, list[float]] = {"raw": [], "before": [], "now": []}
    for _ in range(args.rounds):
        t = time.perf_counter()
        bench_data.count(bench_data.raw_micro_batches_with_keys(files, 256))
        times["raw"].append(time.perf_counter() - t)
        for name, (split, convert) in code.items():
            batched.split_columns, batched.to_columns = split, convert
            t = time.perf_counter()
            bench_data.ours_pass(ds, 1)
            times[name].append(time.perf_counter() - t)
    for name, v in times.items():
        ratio = statistics.median(r / x for r, x in zip(times["raw"], v, strict=True))
        print(f"{name}: {statistics.median(v):.3f} s per pass, {ratio:.3f}x the raw loop's speed")


if __name__ == "__main__":
    main()
