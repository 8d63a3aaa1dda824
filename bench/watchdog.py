"""Benchmark: what the hang watchdog costs a distributed step.

Two ranks on gloo (CPU), a DDP MLP, K=4 micro-batches per optimizer step through ``GradientAccumulator``,
with the loop's heartbeat writes (``Beat.phase`` per phase, ``Beat.step`` per step, as the training loop does)
and the watchdog thread running, against the same loop without either. The watchdog polls every
``--watchdog-s / 5`` seconds (at most 5 s): the default 600 s polls every 5 s; ``--watchdog-s 1`` polls every
0.2 s, a stress case. Rounds alternate the order; the headline is the median paired ratio of step times.

With ``--diagnostics`` the measured half also gathers each rank's seconds per phase every 10 steps
(``ranks.jsonl``) and checks replica parity every 100 (the defaults' ratio of a 1-in-10 logging interval).

Usage::

    python bench/watchdog.py [--repeats N] [--steps S] [--width W] [--watchdog-s S] [--diagnostics]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.train.job.parity import check_parity, parity_due
from steadytrain.train.job.ranks import record_rank_times
from steadytrain.train.observe.watchdog import Beat, start_watchdog
from steadytrain.train.setup.distributed import DistInfo

K, MICRO = 4, 16
LOG_EVERY, PARITY_EVERY = 10, 100


def loop(
    acc: GradientAccumulator, model: nn.Module, x: torch.Tensor, steps: int, beat: Beat | None, job: Any = None
) -> float:
    """``steps`` optimizer steps; with ``beat``, the loop's heartbeat; with ``job``, also the per-interval rank
    times (every ``LOG_EVERY`` steps) and the replica parity check (every ``PARITY_EVERY`` steps)."""
    t0 = time.perf_counter()
    for step in range(steps):
        for _ in range(K):
            with acc.micro_batch() as m:
                if beat is not None:
                    beat.enter("forward")
                loss = model(x).pow(2).mean()
                if beat is not None:
                    beat.enter("backward")
                m.backward(loss)
                if beat is not None:
                    beat.enter("all_reduce")
            if beat is not None:
                beat.enter("data")
        if beat is not None:
            beat.step = step + 1
        if job is not None:
            job.state.step += 1
            if job.state.step % LOG_EVERY == 0:
                record_rank_times(job)
            if parity_due(job):
                check_parity(job)
    return time.perf_counter() - t0


def worker(rank: int, init: str, out: str, run: str, args: argparse.Namespace) -> None:
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
    beat = Beat()
    job = None
    if args.diagnostics:  # what the training loop's job offers these two functions, nothing more
        cfg = SimpleNamespace(distributed=SimpleNamespace(parity_every_steps=PARITY_EVERY, strategy="ddp",
                              on_parity="warn"), run=SimpleNamespace(log_every=LOG_EVERY))  # fmt: skip
        job = SimpleNamespace(cfg=cfg, info=info, model=model, beat=beat, state=SimpleNamespace(step=0),
                              run=SimpleNamespace(path=Path(run)))  # fmt: skip
    loop(acc, model, x, 5, None)  # warm up
    ratios = []

    def timed(b: Beat | None) -> float:
        if b is None:
            return loop(acc, model, x, args.steps, None)
        dog = start_watchdog(args.watchdog_s, info, Path(run), b)  # its thread runs only in this half
        try:
            return loop(acc, model, x, args.steps, b, job)
        finally:
            dog.stop()

    for r in range(args.repeats):
        order = [None, beat] if r % 2 else [beat, None]
        times = {id(b): timed(b) for b in order}
        ratios.append(times[id(beat)] / times[id(None)])
        if rank == 0:
            base_ms = times[id(None)] / args.steps * 1e3
            print(f"round {r}: plain {base_ms:.3f} ms/step, with the watchdog x{ratios[-1]:.3f}", flush=True)
    if rank == 0:
        Path(out).write_text(f"{statistics.median(ratios):.4f}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--watchdog-s", type=float, default=600.0)
    p.add_argument(
        "--diagnostics", action="store_true", help="also the rank times (every 10 steps) and parity (every 100)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratio")
        mp.spawn(worker, args=(f"file://{tmp}/init", out, tmp, args), nprocs=2)
        ratio = float(Path(out).read_text())
    print(
        f"median step time with the watchdog / without: {ratio:.3f} "
        f"(2 ranks, gloo, width {args.width}, watchdog_s {args.watchdog_s:g}"
        f"{', rank times and parity' if args.diagnostics else ''})"
    )


if __name__ == "__main__":
    main()
