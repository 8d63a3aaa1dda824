"""Each rank's time per phase, gathered once per logging interval into ``RUN/ranks.jsonl``.

The loop's heartbeat (:class:`~steadytrain.train.observe.watchdog.Beat`) counts the seconds each rank spends in
``data`` (waiting for its micro-batch), ``forward``, ``backward`` and ``all_reduce`` (the end of a cycle and the
step's collectives). At every ``run.log_every`` boundary, right after the metrics' own all-reduce, the ranks
all-gather those few numbers (one small collective at a step where every rank already meets; none on other steps)
and rank 0 appends one row per rank: ``step``, ``rank``, ``host``, ``steps`` (in the interval), ``data_s``,
``forward_s``, ``backward_s``, ``all_reduce_s``. A rank that is slower than the others makes them wait in their
collectives; ``steadytrain ranks RUN`` (:mod:`steadytrain.runs.ranks`) reads the rows and names it.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from steadytrain._io import append_jsonl
from steadytrain.train.job.core import Job

__all__ = ["PHASES", "host", "record_rank_times", "waited"]

PHASES = ("data", "forward", "backward", "all_reduce")


def record_rank_times(job: Job) -> None:
    """Gather this interval's seconds per phase from every rank (every rank calls it at the same step)."""
    if job.info.backend is None or job.info.world_size < 2:
        return
    steps = job.beat.steps_since_take  # what the seconds cover: a rollback's steps too; after a resume, its own
    spent = job.beat.take()
    mine = torch.tensor([spent.get(p, 0.0) for p in PHASES], dtype=torch.float64, device=job.info.device)
    every = [torch.empty_like(mine) for _ in range(job.info.world_size)]
    dist.all_gather(every, mine)  # one small collective per logging interval: each rank's seconds per phase
    if not job.info.is_main:
        return
    table = torch.stack(every).cpu().tolist()  # host read, once per interval, on rank 0 only
    if job.clock is not None:
        job.clock.waited(waited(table))
    rows = [
        {"step": job.state.step, "rank": r, "host": host(job, r), "steps": steps}
        | {f"{p}_s": round(v, 6) for p, v in zip(PHASES, values, strict=True)}
        for r, values in enumerate(table)
    ]
    append_jsonl(job.run.path / "ranks.jsonl", *rows)


def host(job: Job, rank: int) -> str | None:
    """Rank ``rank``'s hostname (rank 0 has every rank's, from the environment gather at start)."""
    return job.hosts[rank] if job.hosts and rank < len(job.hosts) else None


def waited(table: list[list[float]]) -> float:
    """Seconds the job waited for its slowest rank in an interval: the slowest rank's own time (``data`` and
    ``forward``: its work before it meets the others) less the median of the other ranks' own time."""
    own = sorted(row[0] + row[1] for row in table)
    return max(0.0, own[-1] - statistics.median(own[:-1])) if len(own) > 1 else 0.0
