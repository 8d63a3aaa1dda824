"""The process group of a run: torchrun's environment in, DDP or FSDP2 out, a clean teardown.

steadytrain never launches processes or writes a collective of its own: ``torchrun`` (or
``steadytrain train --nproc N``, which hands off to ``torch.distributed.run``) starts the ranks and
sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; multi-node is torchrun's own rendezvous.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steadytrain.errors import UserError
from steadytrain.train.setup.launcher import die_with_launcher

__all__ = [
    "DistInfo",
    "agree",
    "from_main",
    "init_distributed",
    "mixed_precision",
    "same_everywhere",
    "teardown",
    "wrap_model",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process, no process group
    kind: str = "none"
    """How the model is laid out over the ranks: ``none``, ``ddp``, ``fsdp`` or ``mesh`` (:mod:`.mesh`)."""
    tp: int = 1
    """Tensor-parallel degree: the ``tp`` neighbouring ranks of one group read the same micro-batches."""
    mesh: Any = field(default=None, compare=False, repr=False)
    """The ``(replicate, shard, tp)`` ``DeviceMesh`` when ``kind`` is ``mesh``."""
    shape: tuple[int, int, int] | None = None
    """``(replicate, shard, tp)`` when ``kind`` is ``mesh``."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (the micro-batches it reads)."""
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: world size over the tensor-parallel degree."""
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (0: the one that records the group's examples)."""
        return self.rank % self.tp


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer (set by torchrun)") from None


def init_distributed(backend: str = "auto") -> DistInfo:
    """Join the job torchrun started (or run alone); NCCL on GPU and gloo on CPU unless told otherwise. A rank
    dies with its launcher (:func:`~steadytrain.train.setup.launcher.die_with_launcher`)."""
    die_with_launcher()
    world, local = _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        return DistInfo(0, 1, 0, device, None)
    chosen = ("nccl" if cuda else "gloo") if backend == "auto" else backend
    if chosen == "nccl" and not cuda:
        raise UserError("distributed.backend=nccl needs CUDA devices: use gloo (or auto) on CPU")
    if not dist.is_initialized():  # joins torchrun's rendezvous: every later collective needs the group
        dist.init_process_group(chosen)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, device, chosen)


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mixed_precision(precision: str, param_dtype: str | None, reduce_dtype: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a run: bf16 parameters for compute under ``precision: bf16``
    (or as ``distributed.fsdp_param_dtype`` says), gradients reduced in ``reduce_dtype``; None for
    full fp32 (FSDP2's default: no casts at all).

    Example:
        >>> mixed_precision("bf16", None, "fp32").param_dtype
        torch.bfloat16
        >>> mixed_precision("fp32", None, "fp32") is None
        True
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = param_dtype or ("bf16" if precision == "bf16" else "fp32")
    if param == "fp32" and reduce_dtype == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=_DTYPES[param], reduce_dtype=_DTYPES[reduce_dtype])


def wrap_model(model: nn.Module, info: DistInfo, strategy: str | None = None, mp_policy: Any = None) -> nn.Module:
    """DDP, or FSDP2 with every block of each ``nn.ModuleList`` and the root sharded (under ``mp_policy``,
    a :func:`mixed_precision` policy, when given) over all ranks or, for a mesh, over its ``(replicate, shard)``
    submesh (HSDP); alone: as is. ``strategy`` (``ddp``/``fsdp``), else ``info.kind``, says which
    (:func:`~steadytrain.train.setup.mesh.join_mesh`)."""
    model = model.to(info.device)
    if info.backend is None:
        return model
    if (strategy or info.kind) in ("ddp", "none"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # a collective: DDP broadcasts rank 0's parameters and buffers, so every replica starts from the same weights
        return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    policy: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
    if info.mesh is not None:
        policy["mesh"] = info.mesh["replicate", "shard"]  # after the tensor-parallel plan split the layers over tp
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, **policy)
    fully_shard(model, **policy)
    return model


def barrier(info: DistInfo) -> None:
    """Wait for every rank (alone: return): each call site says which file must exist before any rank goes on."""
    if info.backend is not None:
        dist.barrier()  # rank 0 did file work the others depend on (a directory, a log cut, summary.md)


def from_main(info: DistInfo, value: int) -> int:
    """Rank 0's ``value`` on every rank (one broadcast): a decision only rank 0 can see, such as which
    checkpoints are complete (it renames them)."""
    if info.backend is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.broadcast(t, src=0)  # only rank 0 saw the files: every rank must act on its value
    return int(t.item())  # host sync, once per call: the caller decides in Python (which checkpoint to load)


def quiesce(world_size: int, key: str = "steadytrain/teardown", timeout_s: float = 300.0) -> None:
    """Wait until every rank has returned from its last collective, through the rendezvous store.

    A barrier alone is not enough with gloo: the first rank out of it can close its connections while
    a peer is still receiving the barrier's last message, and that peer aborts (SIGABRT). Counting the
    ranks that are out in the store (not a collective) closes that window.
    """
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.005)


def teardown(info: DistInfo) -> None:
    """Leave the process group once no rank uses it any more (a barrier, then :func:`quiesce`)."""
    if info.backend is not None and dist.is_initialized():
        try:
            dist.barrier()  # every rank is past its last collective (a save, an evaluation) before any rank leaves
            quiesce(info.world_size)  # no rank destroys the group while a peer still reads the barrier's last message
        finally:
            dist.destroy_process_group()


def agree(info: DistInfo, error: str | None, where: str = "at start") -> None:
    """Raise the same UserError on every rank if any rank has an ``error`` (one all-reduce, on the device)."""
    if info.backend is not None:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank's failure is every rank's: none waits alone later
        if flag.item() and error is None:  # host sync, once per call: whether to raise is a Python decision
            error = f"another rank failed {where} (its log says why)"
    if error is not None:
        raise UserError(error)


def same_everywhere(info: DistInfo, settings: dict[str, Any], what: str = "config") -> None:
    """Refuse, on every rank, settings that differ between ranks (two agents started with different configs
    would train replicas that silently drift apart): one gather of the flat ``settings`` (``{"a.b": value}``)."""
    if info.backend is None:
        return
    mine = {k: repr(v) for k, v in settings.items()}
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, mine)  # once, at start: every rank's settings, compared on every rank
    error = None
    for rank, theirs in enumerate(every):
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if keys:
            shown = ", ".join(f"{k}={theirs.get(k, '(none)')}" for k in keys[:3])
            error = (
                f"rank {rank} runs another {what} than rank {info.rank} ({shown}{', ...' if len(keys) > 3 else ''}): "
                f"start every rank (every node's torchrun) with the same {what} and --set values"
            )
            break
    if error is not None:
        raise UserError(error)
