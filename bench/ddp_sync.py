"""Benchmark: gradient all-reduces per optimizer step under DDP, with and without no_sync.

Two ranks on gloo (CPU), K=4 micro-batches per optimizer step, an MLP of a few million
parameters. Compares

* ``steadytrain`` -- ``GradientAccumulator``: ``no_sync`` over every micro-batch but the last, so
  one gradient synchronisation per optimizer step;
* ``naive DDP``   -- the plain loop that calls ``backward`` on every micro-batch inside DDP, which
  all-reduces the gradients K times per optimizer step.

A DDP communication hook counts bucket all-reduces. Rounds alternate the order; the headline is
the median paired time ratio. Both produce the same parameters (checked).

Usage::

    python bench/ddp_sync.py [--repeats N] [--steps S] [--width W]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from steadytrain.accumulate import GradientAccumulator

K, MICRO = 4, 16


def counting_allreduce(state, bucket):
    state["calls"] += 1
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def make(width: int) -> tuple[nn.Module, dict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    model = nn.parallel.DistributedDataParallel(base)
    counter = {"calls": 0}
    model.register_comm_hook(counter, counting_allreduce)
    return model, counter, torch.optim.SGD(model.parameters(), lr=1e-3)


def run_steadytrain(model, opt, acc, batches) -> None:
    for x, y in batches:
        with acc.micro_batch() as mb:
            mb.backward(nn.functional.cross_entropy(model(x), y))


def run_naive(model, opt, batches) -> None:
    for i, (x, y) in enumerate(batches):
        (nn.functional.cross_entropy(model(x), y) / K).backward()
        if (i + 1) % K == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(MICRO, args.width, generator=gen), torch.randint(0, 10, (MICRO,), generator=gen))
        for _ in range(K * args.steps)
    ]
    ours, ours_calls, ours_opt = make(args.width)
    acc = GradientAccumulator(ours, ours_opt, accumulation_steps=K)
    naive, naive_calls, naive_opt = make(args.width)
    # Warm-up and check: one optimizer step each from the same init gives the same parameters.
    run_steadytrain(ours, ours_opt, acc, batches[:K])
    run_naive(naive, naive_opt, batches[:K])
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours.parameters(), naive.parameters(), strict=True))
    times: dict[str, list[float]] = {"steadytrain": [], "naive DDP": []}
    calls: dict[str, list[float]] = {"steadytrain": [], "naive DDP": []}
    ratios = []
    for r in range(args.repeats):
        order = ["steadytrain", "naive DDP"] if r % 2 == 0 else ["naive DDP", "steadytrain"]
        for name in order:
            counter = ours_calls if name == "steadytrain" else naive_calls
            counter["calls"] = 0
            dist.barrier()
            start = time.perf_counter()
            if name == "steadytrain":
                run_steadytrain(ours, ours_opt, acc, batches)
            else:
                run_naive(naive, naive_opt, batches)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
            calls[name].append(counter["calls"] / args.steps)
        ratios.append(times["steadytrain"][-1] / times["naive DDP"][-1])
    if rank == 0:
        n = sum(p.numel() for p in ours.parameters())
        lines = [
            f"2 ranks, gloo, K={K}, micro-batch {MICRO}, MLP width {args.width} ({n / 1e6:.1f}M params), "
            f"{args.steps} optimizer steps x {args.repeats} rounds; same parameters after one step: {same}",
            "| method | bucket all-reduces / optimizer step | median ms / optimizer step | ratio to naive |",
            "|---|---|---|---|",
        ]
        for name in times:
            ratio = statistics.median(ratios) if name == "steadytrain" else 1.0
            lines.append(
                f"| {name} | {statistics.median(calls[name]):.0f} | {statistics.median(times[name]) * 1e3:.1f} "
                f"| {ratio:.3f} |"
            )
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.md")
        mp.spawn(worker, args=(2, f"file://{tmp}/init", args, out), nprocs=2, join=True)
        with open(out) as f:
            print(f.read(), end="")


if __name__ == "__main__":
    main()
