"""Benchmark: sharded, asynchronous checkpoints against a synchronous save and against torch.save.

(a), (b): two ranks on gloo (CPU), an MLP of ``--layers`` square Linear layers (``--width``; the
default is ~103M parameters) under FSDP2 with AdamW after one step (the full model+optimizer state:
~1.23 GB). Per round, each rank saves with :class:`~steadytrain.train.checkpoint.writer.CheckpointWriter`:

(a) blocked time: synchronous save (the whole write) against asynchronous save, where the loop is
    blocked for the call plus the wait of the next ``optimizer.step`` for the staging copy. Two
    asynchronous figures: the worst case (the step comes at once: the whole copy blocks) and with one
    forward/backward between the save and the step (what a training loop does);
(b) each rank's peak resident-memory growth during a save (sampled every 2 ms from /proc) as a
    fraction of the full model+optimizer state (a full gather on rank 0 is >= 1.0).

(c) one process: save and load throughput (GB/s of the state) of our synchronous save and restore
    against ``torch.save``/``torch.load`` + ``load_state_dict`` of the same state dicts.

Medians over ``--repeats`` rounds; files go to a temporary directory (page cache: the machine's
memory bandwidth more than its disk). Usage::

    python bench/checkpoint.py [--repeats N] [--width W] [--layers L] [--no-fsync]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from steadytrain.train.checkpoint.catalog import restore
from steadytrain.train.checkpoint.writer import CheckpointWriter
from steadytrain.train.setup.distributed import DistInfo

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The peak resident memory above the starting point while the block runs (a 2 ms sampler)."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.growth = self.peak - self.base


def build(width: int, layers: int, shard: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if shard:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, x


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the full (unsharded) model+optimizer state."""
    sd_m, sd_o = get_state_dict(model, opt)
    n = sum(t.numel() * t.element_size() for t in sd_m.values())
    for s in sd_o["state"].values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


def one_save(writer: CheckpointWriter, step: int, model, opt, x, between: bool) -> tuple[float, int]:
    with PeakRSS() as mem:
        before = writer.blocked_s
        writer.save(step, model, opt, {}, frozenset())
        if between:
            model(x).pow(2).mean().backward()  # the next step's work overlaps the staging copy
        writer.wait_staged()  # where the next optimizer.step would wait
        blocked = writer.blocked_s - before
        writer.wait()  # the background write (not blocking a loop: measured apart)
    return blocked, mem.growth


def worker(rank: int, init: str, root: str, args: argparse.Namespace, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    info = DistInfo(rank, 2, rank, torch.device("cpu"), "gloo")
    model, opt, x = build(args.width, args.layers, shard=True)
    full = state_bytes(model, opt)
    rows: dict[str, list[float]] = {"sync": [], "async": [], "async+step": [], "mem_sync": [], "mem_async": []}
    sync = CheckpointWriter(Path(root) / "sync", info, use_async=False, keep_last=1)
    asyn = CheckpointWriter(Path(root) / "async", info, use_async=True, keep_last=1)
    for r in range(args.repeats + 1):  # round 0 warms up (the staging pool is allocated there)
        blocked, mem = one_save(sync, r + 1, model, opt, x, False)
        a_blocked, a_mem = one_save(asyn, r + 1, model, opt, x, False)
        s_blocked, _ = one_save(asyn, r + 100, model, opt, x, True)
        if not r:
            cold = a_mem / full  # the first asynchronous save allocates the staging pool (kept for the next ones)
        if r:
            rows["sync"].append(blocked)
            rows["async"].append(a_blocked)
            rows["async+step"].append(s_blocked)
            rows["mem_sync"].append(mem / full)
            rows["mem_async"].append(a_mem / full)
    asyn.close()
    out[rank] = {k: statistics.median(v) for k, v in rows.items()} | {"full_gb": full / 1e9, "mem_cold": cold}
    dist.destroy_process_group()


def throughput(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """(c): one process, GB/s of save and load, ours (sync) against torch.save/torch.load."""
    model, opt, _ = build(args.width, args.layers, shard=False)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    gb = state_bytes(model, opt) / 1e9
    rows: dict[str, list[float]] = {"save": [], "load": [], "torch_save": [], "torch_save_fsync": [], "torch_load": []}
    writer = CheckpointWriter(root / "one", info, use_async=False, keep_last=1)
    for r in range(args.repeats):
        t0 = time.perf_counter()
        writer.save(r + 1, model, opt, {}, frozenset())
        rows["save"].append(gb / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        restore(root / "one" / f"step-{r + 1:08d}", model, opt, no_dist=True)
        rows["load"].append(gb / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, root / "plain.pt")
        rows["torch_save"].append(gb / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        with open(root / "durable.pt", "wb") as f:  # what a checkpoint must be: on disk, not in the page cache
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        rows["torch_save_fsync"].append(gb / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        state = torch.load(root / "plain.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rows["torch_load"].append(gb / (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--no-fsync", action="store_true", help="(c) alone, every fsync skipped: the writer's floor")
    args = parser.parse_args()
    if args.no_fsync:  # what the durability costs: our files against torch.save, both left in the page cache
        os.fsync = lambda fd: None
        root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
        try:
            c = throughput(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"no fsync: save {c['save']:.2f} GB/s vs torch.save {c['torch_save']:.2f} GB/s "
            f"({c['save'] / c['torch_save']:.2f}x)"
        )
        return
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            init = f"file://{root / 'init'}"
            mp.spawn(worker, args=(init, str(root), args, out), nprocs=2, join=True)
            ranks = dict(out)
        shutil.rmtree(root / "sync", ignore_errors=True)
        c = throughput(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = args.width * (args.width + 1) * args.layers
    full = ranks[0]["full_gb"]
    print(f"model: {params / 1e6:.1f}M parameters, AdamW; full state {full:.2f} GB; FSDP2 on 2 gloo ranks")
    for rank, m in sorted(ranks.items()):
        print(
            f"rank {rank}: blocked sync {m['sync']:.3f} s, async {m['async']:.3f} s "
            f"(ratio {m['async'] / m['sync']:.3f}; with a step between {m['async+step'] / m['sync']:.3f}); "
            f"peak memory growth / full state: sync {m['mem_sync']:.3f}, async {m['mem_async']:.3f} "
            f"(first async save, allocating the staging pool: {m['mem_cold']:.3f})"
        )
    print(
        f"one process: save (fsynced) {c['save']:.2f} GB/s vs torch.save {c['torch_save']:.2f} GB/s "
        f"(ratio {c['save'] / c['torch_save']:.2f}), vs torch.save + fsync {c['torch_save_fsync']:.2f} GB/s "
        f"(ratio {c['save'] / c['torch_save_fsync']:.2f}); load {c['load']:.2f} GB/s vs torch.load "
        f"{c['torch_load']:.2f} GB/s (ratio {c['load'] / c['torch_load']:.2f})"
    )


if __name__ == "__main__":
    main()
