"""Stragglers: the rank that is consistently slower than the others, and what it cost the job.

``RUN/ranks.jsonl`` holds, per logging interval and rank, the seconds spent in ``data``, ``forward``, ``backward``
and ``all_reduce`` (:mod:`steadytrain.train.job.ranks`). A rank's own time is its ``data`` and ``forward`` time: the
work before it first meets the others in a step. (Under DDP a backward overlaps its gradient all-reduce, so a rank's
backward compute cannot be told from its wait for the others: a rank slow in its backward alone is not seen.) In
each interval a rank is *slow* when its own time per step exceeds the median of the other ranks' by more than
:data:`REL` of it and more than :data:`ABS_S`; a straggler is slow in at least :data:`SHARE` of the intervals (two
at least). What it cost the job: the sum over intervals of its excess per step times the steps, the time every
other rank waited for it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import read_jsonl
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir

__all__ = ["ABS_S", "REL", "SHARE", "RanksReport", "stragglers"]

REL, ABS_S, SHARE = 0.25, 0.010, 0.8
_KEYS = ("step", "rank", "steps", "data_s", "forward_s", "backward_s", "all_reduce_s")


@dataclass
class Straggler:
    rank: int
    host: str | None
    slow_intervals: int
    intervals: int
    excess_ms_per_step: float
    cost_s: float


@dataclass
class RanksReport:
    """``to_dict``: ``stragglers`` (``rank``, ``host``, ``slow_intervals``, ``intervals``, ``excess_ms_per_step``,
    ``cost_s``), ``ranks`` (each rank's median own time per step, ms) and ``sentence``."""

    stragglers: list[Straggler]
    ranks: dict[int, float]
    sentence: str
    intervals: int = 0
    hosts: dict[int, str | None] = field(default_factory=dict)
    parity: list[dict[str, Any]] = field(default_factory=list)
    """``RUN/parity.jsonl``: each replica that disagreed (``step``, ``rank``, ``host``, ``tensors``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "stragglers": [asdict(s) for s in self.stragglers],
            "ranks": {str(r): ms for r, ms in sorted(self.ranks.items())},
            "sentence": self.sentence,
            "intervals": self.intervals,
            "parity": list(self.parity),
        }


def _rows(path: Path) -> dict[int, dict[int, dict[str, Any]]]:
    by_step: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for line, row in read_jsonl(path, what="ranks.jsonl"):
        bad = not isinstance(row, dict) or any(not isinstance(row.get(k), int | float) for k in _KEYS)
        if bad or row["steps"] <= 0:
            raise UserError(f"{path}:{line}: not a rank-times row (it needs {', '.join(_KEYS)}; steps > 0)")
        by_step[int(row["step"])][int(row["rank"])] = row
    return by_step


def stragglers(run_dir: str | Path) -> RanksReport:
    """The straggler test of the module docstring over ``RUN/ranks.jsonl``."""
    run = open_run_dir(Path(run_dir))
    path, parity = run.path / "ranks.jsonl", _parity(run.path / "parity.jsonl")
    if not path.exists():
        why = "no rank times recorded (a run on one rank, or from before they were recorded)"
        return RanksReport([], {}, why, parity=parity)
    by_step = _rows(path)
    own: dict[int, list[float]] = defaultdict(list)
    slow: dict[int, list[float]] = defaultdict(list)
    hosts: dict[int, str | None] = {}
    for rows in by_step.values():
        per_step = {r: (row["data_s"] + row["forward_s"]) / row["steps"] for r, row in rows.items()}
        for r, row in rows.items():
            hosts[r] = row.get("host")
            own[r].append(per_step[r])
            others = [v for q, v in per_step.items() if q != r]
            if not others:
                continue
            base = statistics.median(others)
            excess = per_step[r] - base
            if excess > max(REL * base, ABS_S):
                slow[r].append(excess * row["steps"])
    n = len(by_step)
    found = [
        Straggler(r, hosts.get(r), len(costs), n, round(1e3 * sum(costs) / _steps(by_step, r), 3), round(sum(costs), 3))
        for r, costs in sorted(slow.items())
        if len(costs) >= max(2, SHARE * n)
    ]
    ranks = {r: round(1e3 * statistics.median(v), 3) for r, v in own.items()}
    return RanksReport(found, ranks, _sentence(found, n, len(ranks)), n, hosts, parity)


def _parity(path: Path) -> list[dict[str, Any]]:
    """``parity.jsonl``'s records, each checked (a damaged line is one error naming it)."""
    if not path.exists():
        return []
    out = []
    for line, row in read_jsonl(path, what="parity.jsonl"):
        ok = isinstance(row, dict) and all(isinstance(row.get(k), int) for k in ("step", "rank"))
        if not ok or not isinstance(row.get("tensors"), list):
            raise UserError(f"{path}:{line}: not a parity record (it needs step, rank and tensors)")
        out.append(row)
    return out


def _steps(by_step: dict[int, dict[int, dict[str, Any]]], rank: int) -> int:
    return max(1, sum(rows[rank]["steps"] for rows in by_step.values() if rank in rows))


def _sentence(found: list[Straggler], intervals: int, ranks: int) -> str:
    if not found:
        return f"no straggler: no rank was consistently slower than the others ({ranks} ranks, {intervals} intervals)"
    parts = [
        f"rank {s.rank}" + (f" on {s.host}" if s.host else "") + f" was slower in {s.slow_intervals} of {s.intervals} "
        f"intervals, by {s.excess_ms_per_step:.1f} ms per step: the others waited {s.cost_s:.2f} s for it"
        for s in found
    ]
    return "straggler: " + "; ".join(parts) + " (its data loading or forward; look at that machine)"
