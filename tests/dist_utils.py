"""Spawn real ``torch.distributed`` ranks on gloo (CPU) inside pytest.

Workers are module-level functions ``fn(rank, world_size, out_dir, *args)``; each rank writes what
it measured with :func:`save` and the test reads it back with :func:`load_all`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from steadytrain.train.setup.distributed import quiesce


def _entry(rank: int, fn, world_size: int, tmp: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, Path(tmp), *args)
        # No rank tears down its connections while a peer still finishes the last collective.
        dist.barrier()
        quiesce(world_size)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, tmp_path: Path, *args) -> None:
    """Run ``fn`` on ``world_size`` gloo ranks; an exception on any rank fails the test."""
    mp.spawn(_entry, args=(fn, world_size, str(tmp_path), args), nprocs=world_size, join=True)


def save(out_dir: Path, rank: int, obj) -> None:
    torch.save(obj, out_dir / f"rank{rank}.pt")


def load_all(out_dir: Path, world_size: int) -> list:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
