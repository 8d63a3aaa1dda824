"""Benchmark: what the Ctrl-C/SIGTERM agreement costs a distributed step.

Two ranks on gloo (CPU), a DDP MLP, K=4 micro-batches per optimizer step through
``GradientAccumulator``. Compares the same loop with and without ``StopRequest.agreed()`` at every
step boundary (an asynchronous all-reduce of one int32 flag started at one boundary and read at the
next). Rounds alternate the order; the headline is the median paired ratio of step times.

Usage::

    python bench/stop_flag.py [--repeats N] [--steps S] [--width W]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.train.job.stop import StopRequest
from steadytrain.train.setup.distributed import DistInfo

K, MICRO = 4, 16


def loop(acc: GradientAccumulator, model: nn.Module, x: torch.Tensor, steps: int, stop: StopRequest | None) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(K):
            with acc.micro_batch() as m:
                m.backward(model(x).pow(2).mean())
        if stop is not None and stop.agreed():
            break
    return time.perf_counter() - t0


def worker(rank: int, init: str, out: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    w = args.width
    base = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
    model = nn.parallel.DistributedDataParallel(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    acc = GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1.0)
    x = torch.randn(MICRO, w)
    info = DistInfo(rank, 2, rank, torch.device("cpu"), "gloo")
    loop(acc, model, x, 5, None)  # warm up
    ratios = []
    for r in range(args.repeats):
        with StopRequest(info) as stop:
            order = [None, stop] if r % 2 else [stop, None]
            times = {id(s): loop(acc, model, x, args.steps, s) for s in order}
        ratios.append(times[id(stop)] / times[id(None)])
        base_ms = times[id(None)] / args.steps * 1e3
        if rank == 0:
            print(f"round {r}: plain {base_ms:.3f} ms/step, with agreement x{ratios[-1]:.3f}", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{statistics.median(ratios):.4f}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratio")
        mp.spawn(worker, args=(f"file://{tmp}/init", out, args), nprocs=2)
        ratio = float(Path(out).read_text())
    print(f"median step time with the stop agreement / without: {ratio:.3f} (2 ranks, gloo, width {args.width})")


if __name__ == "__main__":
    main()
