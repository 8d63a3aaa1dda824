"""Benchmark: the share of a run's wall time its default evaluations take, fixed cadence against ``auto``.

A user's dataset (``data ingest`` of Python standard-library sources, 128-byte windows) trained with tiny-lm for
``--steps`` optimizer steps twice per round, in alternating order:

* ``every 25`` -- the former default for a ``data.path`` dataset: 5% held out, every 25 steps, 32 batches;
* ``auto``     -- today's default (``eval.every_steps: auto``): the same held-out set and batches, at the cadence
  chosen at start from the config and re-chosen once from the first evaluation's measured time.

Each run's share is the sum of its evaluation rows' ``val_time_s`` (the pass's own time, the final evaluation
included) over its wall time (the last row's ``elapsed_s`` plus the final evaluation). Prints each round and the
medians. Target: ``auto`` under 5%.

Usage::

    python bench/eval_share.py [--steps 300] [--repeats 3] [--micro 16] [--global-batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

EXE = str(Path(sys.executable).with_name("steadytrain"))
SOURCES = ["json", "email", "http", "logging", "asyncio"]  # standard-library packages: text on every machine


def run(cmd: list[str], **env: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return out.stderr


def share(run_dir: Path) -> tuple[float, int, float]:
    """``(evaluation share of wall time, evaluations, wall seconds)`` of a finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_time_s"] for r in rows if "val_loss" in r]
    train = [r for r in rows if "val_loss" not in r and "elapsed_s" in r]
    wall = train[-1]["elapsed_s"] + evals[-1]  # the final evaluation runs after the last step's row
    return sum(evals) / wall, len(evals), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--global-batch", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eval-share-"))
    lib = Path(sysconfig.get_paths()["stdlib"])
    run([EXE, "data", "ingest", *[str(lib / s) for s in SOURCES], "--out", str(tmp / "data"), "--seq-len", "128",
         "--shard-rows", "512"])  # fmt: skip
    common = [
        f"data.path={tmp / 'data'}", f"run.max_steps={args.steps}", f"batch.micro_batch_size={args.micro}",
        f"batch.global_batch_size={args.global_batch}", "checkpoint.every_steps=100000", "run.log_every=50",
    ]  # fmt: skip
    variants = {"every 25": ["eval.every_steps=25"], "auto": []}
    shares: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.repeats):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            out = tmp / f"{name.replace(' ', '')}-{r}"
            sets = [x for kv in (*common, *variants[name]) for x in ("--set", kv)]
            log = run([EXE, "train", "--run-dir", str(out), *sets])
            s, n, wall = share(out)
            shares[name].append(s)
            said = [line for line in log.splitlines() if "eval.every_steps: auto" in line or "from here" in line]
            print(f"round {r + 1} {name:>8}: {n:3d} evaluations, {s:6.1%} of {wall:6.1f} s" + "".join(
                f"\n    {line.strip()}" for line in said), flush=True)  # fmt: skip
    print()
    for name, values in shares.items():
        each = ", ".join(f"{v:.1%}" for v in values)
        print(f"{name:>8}: median {statistics.median(values):.1%} of the wall time ({each})")


if __name__ == "__main__":
    main()
