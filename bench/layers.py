"""Benchmark: what the per-layer monitor (``monitor.layers: norms``) costs a distributed step.

Two ranks on gloo (CPU), a model of ``--blocks`` MLP blocks in a ``ModuleList`` (plus an input and a head: one
layer each), under DDP or FSDP2 (``fully_shard``), K=4 micro-batches per optimizer step through
``GradientAccumulator`` with AdamW and global-norm clipping; the same loop with the accumulator's observer set to
a :class:`~steadytrain.train.observe.layers.LayerMonitor` every ``--every`` steps (the default interval is
``run.log_every``, 10) against without. Rounds alternate the order; the headline is the median paired ratio of
step times. A second line times one monitored step's own work against a plain step.

Usage::

    python bench/layers.py [--strategy ddp|fsdp] [--repeats N] [--steps S] [--width W] [--blocks B] [--every E]
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
from steadytrain.train.observe.layers import LayerMonitor

K, MICRO = 4, 16


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def loop(acc: GradientAccumulator, model: nn.Module, x: torch.Tensor, steps: int, counter: dict) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(K):
            with acc.micro_batch() as m:
                m.backward(model(x).pow(2).mean())
        counter["step"] += 1
    return time.perf_counter() - t0


def worker(rank: int, init: str, out: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model: nn.Module = Net(args.width, args.blocks)
    if args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    acc = GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1.0)
    counter = {"step": 0}
    monitor = LayerMonitor(model, "auto", args.every, lambda: counter["step"] + 1)
    x = torch.randn(MICRO, args.width)
    loop(acc, model, x, 5, counter)  # warm up
    ratios, own = [], []

    def timed(on: bool) -> float:
        acc.observer = monitor if on else None
        return loop(acc, model, x, args.steps, counter)

    for r in range(args.repeats):
        order = [False, True] if r % 2 else [True, False]
        times = {on: timed(on) for on in order}
        ratios.append(times[True] / times[False])
        monitor.take()
        if rank == 0:
            print(f"round {r}: plain {times[False] / args.steps * 1e3:.3f} ms/step, monitored x{ratios[-1]:.3f}")
    acc.observer = None  # one monitored step against one plain step, several times
    for _ in range(args.repeats):
        counter["step"] = 0
        plain = loop(acc, model, x, 1, counter)
        acc.observer, counter["step"] = monitor, args.every - 1
        watched = loop(acc, model, x, 1, counter)
        acc.observer = None
        own.append(watched / plain)
    if rank == 0:
        Path(out).write_text(f"{statistics.median(ratios):.4f} {statistics.median(own):.4f}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratio")
        mp.spawn(worker, args=(f"file://{tmp}/init", out, args), nprocs=2)
        ratio, own = map(float, Path(out).read_text().split())
    print(
        f"median step time with the layer monitor every {args.every} steps / without: {ratio:.3f}; one monitored "
        f"step / one plain step: {own:.3f} (2 ranks, gloo, {args.strategy}, width {args.width}, "
        f"{args.blocks} blocks)"
    )


if __name__ == "__main__":
    main()
