"""Benchmark: how long ``steadytrain.env.capture()`` takes (it must stay well under a second).

Two figures: ``capture()`` inside a process that has imported torch already (a training job), median
of N calls; and the whole ``steadytrain env capture`` command, median of M runs, which includes
starting Python and importing torch. Compared with ``pip freeze`` (the usual way to list packages).

Usage::

    python bench/env_capture.py [--calls N] [--runs M]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch  # a training process has torch imported already

from steadytrain.env import capture


def wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    capture()  # warm the metadata caches the way a second capture in a job would find them
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        m = capture()
        times.append(time.perf_counter() - start)
    exe = shutil.which("steadytrain", path=str(Path(sys.executable).parent)) or "steadytrain"
    cli = wall([exe, "env", "capture"], args.runs)
    freeze = wall([sys.executable, "-m", "pip", "freeze"], args.runs)
    n = len(m.image["packages"])
    print(f"{n} distributions installed; torch {torch.__version__}")
    print("| what | median ms |")
    print("|---|---:|")
    print(
        f"| `capture()` in a process with torch imported ({args.calls} calls) | {statistics.median(times) * 1e3:.1f} |"
    )
    print(
        f"| `steadytrain env capture` command, incl. Python start and torch import ({args.runs} runs) | "
        f"{cli * 1e3:.0f} |"
    )
    print(f"| `pip freeze` alone, for comparison ({args.runs} runs) | {freeze * 1e3:.0f} |")


if __name__ == "__main__":
    main()
