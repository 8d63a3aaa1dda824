"""What a tensor holds on this rank, and the mesh dimensions it is sharded on (plain tensors and DTensors alike):
the pieces :mod:`steadytrain.clip` builds its sharding-correct norms from."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

try:  # DTensor is absent on builds without torch.distributed.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - depends on the torch build
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["is_dtensor", "local", "shard_groups"]


def is_dtensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(grad: Tensor) -> Tensor:
    """The tensor this rank holds: the local shard of a DTensor, else the tensor itself."""
    if not is_dtensor(grad):
        return grad
    if any(p.is_partial() for p in grad.placements):
        # A pending-reduction gradient has no meaningful local norm: reduce it first.
        from torch.distributed.tensor import Replicate

        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    return grad.to_local()  # under no_grad: the local tensor itself, so in-place ops reach the DTensor


def shard_groups(grad: Tensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups of the mesh dimensions along which a DTensor is sharded."""
    mesh = grad.device_mesh
    # FSDP2 over a tensor-parallel parameter shards it with a ``_StridedShard``, which is not ``is_shard()``: every
    # placement that is neither replicated nor a pending sum holds part of the tensor
    return tuple(mesh.get_group(d) for d, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial()))
