"""Replicas that disagree: ranks holding copies of the same parameters compare a checksum of them.

Under DDP every rank holds the whole model and applies the same all-reduced update, so the replicas stay bitwise
equal; a rank whose values differ had them corrupted (a faulty device or host, a stray write), silently: its
gradients still join the all-reduce. Every ``distributed.parity_every_steps`` optimizer steps each rank computes,
on its device, one float64 sum per parameter tensor and one sum of absolute values (a flipped sign changes the
second even where the first cancels); the vectors are all-gathered (one small collective) and compared on the host
(one read). A rank whose vector differs from the most common one is recorded in ``RUN/parity.jsonl`` (``step``,
``rank``, ``host``, ``tensors``: the parameter names that differ). With two replicas there is no majority: the rank
that differs from rank 0 is named, and the record says the vote was a tie. ``distributed.on_parity``: ``warn`` logs
and goes on; ``stop`` (the default) makes every replica equal to an agreeing rank's (a broadcast per tensor from
it) and stops the run with a checkpoint and a report line. FSDP holds shards, not replicas: nothing to compare.
Under HSDP (``distributed.mesh`` with ``replicate`` above 1) the ``replicate`` ranks at one ``(shard, tp)`` position
hold the same shards: each such group is compared (its own majority, or its first rank on a tie) and repaired
within itself, every rank checking the shards it holds.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch
import torch.distributed as dist

from steadytrain._dtensor import local
from steadytrain._io import append_jsonl
from steadytrain.train.job.core import Job
from steadytrain.train.job.ranks import host
from steadytrain.train.observe.throughput import unwrap

__all__ = ["check_parity", "parity_due", "replica_groups"]

log = logging.getLogger("steadytrain.train")


def _replicated(job: Job) -> bool:
    """Whether ranks hold copies of the same values: DDP, or a mesh with more than one replica (HSDP)."""
    info = job.info
    return info.kind == "ddp" or (info.kind == "mesh" and info.shape is not None and info.shape[0] > 1)


def parity_due(job: Job) -> bool:
    every = job.cfg.distributed.parity_every_steps
    return (
        bool(every)
        and job.info.backend is not None
        and job.info.world_size > 1
        and _replicated(job)
        and job.state.step % every == 0
    )


def replica_groups(kind: str, world_size: int, shape: tuple[int, int, int] | None) -> list[list[int]]:
    """The ranks holding the same values: every rank under DDP; under a mesh, the ``replicate`` ranks at each
    ``(shard, tp)`` position (rank ``(r * S + s) * T + t``).

    Example:
        >>> replica_groups("ddp", 2, None), replica_groups("mesh", 4, (2, 2, 1))
        ([[0, 1]], [[0, 2], [1, 3]])
    """
    if kind != "mesh" or shape is None:
        return [list(range(world_size))]
    per = shape[1] * shape[2]
    return [[rep * per + k for rep in range(shape[0])] for k in range(per)]


def _named(job: Job) -> list[tuple[str, torch.Tensor]]:
    return list(unwrap(job.model).named_parameters())  # the user's names, without DDP's or compile's prefix


def _checksums(params: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Per tensor: its sum and the sum of its absolute values, accumulated in float64 (no float64 copy made); of
    this rank's shard for a DTensor (HSDP: the replicas of one position hold the same shard)."""
    with torch.no_grad():
        values = [local(p.detach()) for _, p in params]
        sums = [v.sum(dtype=torch.float64) for v in values]
        return torch.stack(sums + [torch.linalg.vector_norm(v, 1, dtype=torch.float64) for v in values])


def _key(row: list[float]) -> tuple:
    """A rank's checksums as compared: a NaN equals a NaN (replicas whose values are NaN alike agree; ``==`` on
    floats would make every rank differ from every other)."""
    return tuple("nan" if math.isnan(v) else v for v in row)


def _disagreeing(table: list[list[float]]) -> tuple[list[int], tuple, bool]:
    """``(ranks whose checksums differ from the reference, the reference, tie)``: the reference is the most common
    row, or rank 0's when no row has a majority (``tie``)."""
    keys = [_key(row) for row in table]
    top, count = Counter(keys).most_common(1)[0]
    tie = count * 2 <= len(keys)
    reference = keys[0] if tie else top
    return [r for r, key in enumerate(keys) if key != reference], reference, tie


def _record(job: Job, step: int, rank: int, differ: list[str], reference: int, tie: bool) -> None:
    """Rank 0: the line of ``parity.jsonl`` and the warning for a replica that differs from ``reference``'s."""
    record = {"step": step, "rank": rank, "host": host(job, rank), "tensors": differ}
    append_jsonl(job.run.path / "parity.jsonl", record | ({"tie": True} if tie else {}))
    against = f"rank {reference} (two replicas: a tie)" if tie else "the majority"
    log.warning(
        "replicas disagree at step %d: rank %d differs from %s in %s", step, rank, against, ", ".join(differ[:5])
    )


def check_parity(job: Job) -> str | None:
    """Compare the replicas (every rank, the same step); why to stop (``on_parity: stop``), or None."""
    params = _named(job)
    mine = _checksums(params)
    every = [torch.empty_like(mine) for _ in range(job.info.world_size)]
    dist.all_gather(every, mine)  # one small collective per check: every rank's checksums
    table = torch.stack(every).cpu().tolist()  # host read, once per check: the comparison is a Python decision
    n, bad_all, good_of = len(params), [], {}
    for group in replica_groups(job.info.kind, job.info.world_size, job.info.shape):
        bad, reference, tie = _disagreeing([table[r] for r in group])
        good = next(group[i] for i, r in enumerate(group) if _key(table[r]) == reference)
        good_of.update({r: good for r in group})
        for rank in (group[i] for i in bad):
            pairs = zip(_key(table[rank]), reference, strict=True)
            differ = sorted({params[i % n][0] for i, (a, b) in enumerate(pairs) if a != b})
            if job.info.is_main:
                _record(job, job.state.step, rank, differ, good, tie)
            bad_all.append(rank)
    if not bad_all or job.cfg.distributed.on_parity != "stop":
        return None
    good = good_of[job.info.rank]
    group = job.info.mesh.get_group("replicate") if job.info.kind == "mesh" else None
    with torch.no_grad():
        for _, p in params:  # every replica made equal to an agreeing rank's (of its group) before the checkpoint
            dist.broadcast(local(p.data), src=good, group=group)
    ranks = ", ".join(str(r) for r in sorted(bad_all))
    goods = sorted({good_of[r] for r in bad_all})
    return (
        f"replicas disagree at step {job.state.step}: rank(s) {ranks} held other parameter values than rank(s) "
        f"{', '.join(map(str, goods))} (see {job.run.path / 'parity.jsonl'}); the checkpoint holds the agreeing "
        "replicas' values; check that machine's device"
    )
