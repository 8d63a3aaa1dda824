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
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch
import torch.distributed as dist

from steadytrain._io import append_jsonl
from steadytrain.train.job.core import Job
from steadytrain.train.job.ranks import host
from steadytrain.train.observe.throughput import unwrap

__all__ = ["check_parity", "parity_due"]

log = logging.getLogger("steadytrain.train")


def parity_due(job: Job) -> bool:
    every = job.cfg.distributed.parity_every_steps
    return (
        bool(every)
        and job.info.backend is not None
        and job.info.world_size > 1
        and job.info.kind == "ddp"
        and job.state.step % every == 0
    )


def _named(job: Job) -> list[tuple[str, torch.Tensor]]:
    return list(unwrap(job.model).named_parameters())  # the user's names, without DDP's or compile's prefix


def _checksums(params: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Per tensor: its sum and the sum of its absolute values, accumulated in float64 (no float64 copy made)."""
    with torch.no_grad():
        values = [p.detach() for _, p in params]
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


def check_parity(job: Job) -> str | None:
    """Compare the replicas (every rank, the same step); why to stop (``on_parity: stop``), or None."""
    params = _named(job)
    mine = _checksums(params)
    every = [torch.empty_like(mine) for _ in range(job.info.world_size)]
    dist.all_gather(every, mine)  # one small collective per check: every rank's checksums
    table = torch.stack(every).cpu().tolist()  # host read, once per check: the comparison is a Python decision
    bad, reference, tie = _disagreeing(table)
    if not bad:
        return None
    n = len(params)
    for rank in bad:
        pairs = zip(_key(table[rank]), reference, strict=True)
        differ = sorted({params[i % n][0] for i, (a, b) in enumerate(pairs) if a != b})
        if job.info.is_main:
            record = {"step": job.state.step, "rank": rank, "host": host(job, rank), "tensors": differ}
            append_jsonl(job.run.path / "parity.jsonl", record | ({"tie": True} if tie else {}))
            log.warning(
                "replicas disagree at step %d: rank %d differs from %s in %s",
                job.state.step, rank, "rank 0 (two replicas: a tie)" if tie else "the majority", ", ".join(differ[:5]),
            )  # fmt: skip
    if job.cfg.distributed.on_parity != "stop":
        return None
    good = next(r for r, row in enumerate(table) if _key(row) == reference)
    with torch.no_grad():
        for _, p in params:  # every replica made equal to an agreeing rank's before the checkpoint
            dist.broadcast(p.data, src=good)
    ranks = ", ".join(str(r) for r in bad)
    return (
        f"replicas disagree at step {job.state.step}: rank(s) {ranks} held other parameter values than rank {good} "
        f"(see {job.run.path / 'parity.jsonl'}); the checkpoint holds rank {good}'s; check that machine's device"
    )
