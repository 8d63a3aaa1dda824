"""The layout of a job's ranks: DDP, FSDP2, or one ``DeviceMesh`` of named dimensions ``(replicate, shard, tp)``.

``distributed.mesh: {replicate: R, shard: S, tp: T}`` with ``R*S*T`` = world size. Ranks are laid out row-major:
global rank ``r`` has tensor-parallel coordinate ``r % T`` and data-parallel rank ``r // T``, so the ``T`` ranks of
one tensor-parallel group are neighbours (one node's fast links) and read the same micro-batches; the data-parallel
degree is ``R*S``. ``{replicate: W}`` is DDP and ``{shard: W}`` FSDP2 exactly as without a mesh; every other shape
builds the mesh with ``init_device_mesh`` and shards with ``fully_shard`` over its ``(replicate, shard)`` submesh
(HSDP: replicas all-reduce, shards reduce-scatter) after the model's tensor-parallel plan
(:mod:`steadytrain.train.setup.tensor_parallel`) has split its layers over ``tp``.
"""

from __future__ import annotations

import dataclasses

from steadytrain.errors import UserError
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.sections import MESH_DIMS, DistributedConfig, mesh_text

__all__ = ["join_mesh", "layout_kind", "mesh_shape"]


def mesh_shape(d: DistributedConfig, world_size: int) -> tuple[int, int, int]:
    """``(R, S, T)`` of the config on ``world_size`` ranks; a UserError naming the three numbers if they do not
    multiply to it.

    Example:
        >>> from steadytrain.train.setup.sections import DistributedConfig
        >>> mesh_shape(DistributedConfig(strategy="fsdp"), 4), mesh_shape(DistributedConfig(mesh="shard=2,tp=2"), 4)
        ((1, 4, 1), (1, 2, 2))
    """
    if d.mesh is None:
        return (1, world_size, 1) if d.strategy == "fsdp" else (world_size, 1, 1)
    r, s, t = shape = d.mesh.shape
    if d.mesh.ranks != world_size:
        raise UserError(
            f"distributed.mesh {mesh_text(shape)} needs {r} x {s} x {t} = {d.mesh.ranks} ranks, this job has "
            f"{world_size}: make replicate x shard x tp equal the world size (torchrun's nnodes x nproc_per_node), or "
            "set distributed.mesh=null (DDP, or FSDP2 with strategy=fsdp)"
        )
    return shape


def layout_kind(shape: tuple[int, int, int]) -> str:
    """``none`` (one rank), ``ddp`` (replicas only), ``fsdp`` (shards only) or ``mesh`` (anything else).

    Example:
        >>> [layout_kind(s) for s in [(1, 1, 1), (4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)]]
        ['none', 'ddp', 'fsdp', 'mesh', 'mesh']
    """
    r, s, t = shape
    if r * s * t == 1:
        return "none"
    if t == 1 and s == 1:
        return "ddp"
    if t == 1 and r == 1:
        return "fsdp"
    return "mesh"


def join_mesh(info: DistInfo, d: DistributedConfig) -> DistInfo:
    """``info`` with its layout: the mesh shape checked against the world size and, for a 2- or 3-dimensional
    layout, the ``DeviceMesh`` built (a collective on every rank: every rank calls it at start)."""
    shape = mesh_shape(d, info.world_size)
    kind = layout_kind(shape)
    if kind != "mesh" or info.backend is None:
        return dataclasses.replace(info, kind=kind)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, shape, mesh_dim_names=MESH_DIMS)
    return dataclasses.replace(info, kind=kind, tp=shape[2], mesh=mesh, shape=shape)
