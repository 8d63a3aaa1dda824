"""How a model is data-parallel, and the gradient-sync switches the accumulator needs.

Under DDP gradients are all-reduced in the backward of each micro-batch unless ``no_sync()`` is
open; under FSDP2 (``fully_shard``) they are reduce-scattered unless
``set_requires_gradient_sync(False)``. :func:`no_sync` covers both, so every micro-batch but the
last of a cycle runs without communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DataParallel", "all_reduce", "average_grads_", "no_sync"]


def _find_fsdp_mesh(model: nn.Module) -> Any:
    """The device mesh of an FSDP2 module, or None for anything else."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    if not isinstance(model, FSDPModule):
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel layout of one model: which wrapper, over which groups, how many replicas."""

    kind: str
    """``ddp``, ``fsdp`` or ``none``."""
    groups: tuple[Any, ...]
    """Process groups whose sum is the sum over every data-parallel rank (one per mesh dimension)."""
    size: int
    """Number of data-parallel ranks the gradients are averaged over."""
    rank: int
    """This process's global rank (0 without torch.distributed)."""
    mesh: Any = None

    @classmethod
    def of(cls, model: nn.Module) -> DataParallel:
        """Inspect ``model`` (plain, ``DistributedDataParallel`` or FSDP2)."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return cls("ddp", (model.process_group,), dist.get_world_size(model.process_group), rank)
        mesh = _find_fsdp_mesh(model)
        if mesh is not None:
            return cls("fsdp", tuple(mesh.get_group(d) for d in range(mesh.ndim)), mesh.size(), rank, mesh)
        return cls("none", (), 1, rank)


def no_sync(model: nn.Module, layout: DataParallel) -> contextlib.AbstractContextManager:
    """A context in which forward and backward of ``model`` do not synchronize gradients."""
    if layout.kind == "ddp":
        return model.no_sync()
    if layout.kind == "fsdp":
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def all_reduce(values: Tensor, layout: DataParallel) -> Tensor:
    """Sum ``values`` in place over every data-parallel rank (one collective per mesh dimension)."""
    for group in layout.groups:
        dist.all_reduce(values, group=group)  # counts and flags that every rank must decide on alike
    return values


def average_grads_(params: list[torch.nn.Parameter], layout: DataParallel) -> None:
    """Average gradients over the DDP group by hand: the fallback for a partial cycle that ran under no_sync."""
    if not layout.groups:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=layout.groups[0])  # no_sync left each replica its own gradients: DDP's average
    flat.div_(layout.size)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)
