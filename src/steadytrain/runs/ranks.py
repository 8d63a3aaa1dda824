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
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import present, read_jsonl
from steadytrain._text import brief, short
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir

__all__ = ["ABS_S", "REL", "SHARE", "RanksReport", "stragglers"]

REL, ABS_S, SHARE = 0.25, 0.010, 0.8
_TIMES = ("data_s", "forward_s", "backward_s", "all_reduce_s")
_MAX_S = 1e9
"""Seconds in one interval above which a value is not a measured time (31 years): the file is damaged."""
_MAX_STEP = 2**63 - 1


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


def _is_int(value: Any, low: int, high: int = _MAX_STEP) -> bool:
    return type(value) is int and low <= value <= high  # JSON's true and false are not numbers here


def _bad_key(row: Any) -> str | None:
    """The first key of a rank-times row that is missing or out of range (None: the row is sound)."""
    if not isinstance(row, dict):
        return "the row"
    if not _is_int(row.get("step"), 1):
        return "step"
    if not _is_int(row.get("rank"), 0):
        return "rank"
    if not _is_int(row.get("steps"), 1, row["step"]):
        return "steps"
    for key in _TIMES:
        value = row.get(key)
        if type(value) not in (int, float) or not 0 <= value <= _MAX_S:
            return key
    return None if row.get("host") is None or isinstance(row.get("host"), str) else "host"


def _rows(path: Path) -> dict[int, dict[int, dict[str, Any]]]:
    by_step: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    lines: dict[tuple[int, int], int] = {}
    for line, row in read_jsonl(path, what="ranks.jsonl"):
        if (key := _bad_key(row)) is not None:
            value = brief(row if key == "the row" else row.get(key))
            raise UserError(
                f"{path}:{line}: {key} = {value}: not a rank-times row (step, rank and steps are integers, "
                "1 <= steps <= step; data_s, forward_s, backward_s and all_reduce_s are seconds, 0 or more; host is "
                "a string): the file is damaged: correct or remove that line"
            )
        first = lines.setdefault((row["step"], row["rank"]), line)
        if first != line:  # one row per rank per interval: a second one would silently replace the first
            raise UserError(
                f"{path}:{line}: rank {row['rank']} at step {row['step']} is on line {first} too: the file is "
                "damaged (rows appended twice?): remove one of them"
            )
        by_step[row["step"]][row["rank"]] = row
    return by_step


def _median_without(ordered: list[float], i: int) -> float:
    """The median of ``ordered`` (sorted) without its element at position ``i``: no new list per rank."""
    n = len(ordered) - 1
    at = lambda j: ordered[j if j < i else j + 1]  # noqa: E731
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def stragglers(run_dir: str | Path) -> RanksReport:
    """The straggler test of the module docstring over ``RUN/ranks.jsonl``."""
    run = open_run_dir(Path(run_dir))
    path, parity = run.path / "ranks.jsonl", _parity(run.path / "parity.jsonl")
    if not present(path):
        why = "no rank times recorded (a run on one rank, or from before they were recorded)"
        return RanksReport([], {}, why, parity=parity)
    by_step = _rows(path)
    own: dict[int, list[float]] = defaultdict(list)
    slow: dict[int, list[float]] = defaultdict(list)
    hosts: dict[int, str | None] = {}
    slow_hosts: dict[int, Counter] = defaultdict(Counter)
    for rows in by_step.values():
        per_step = {r: (row["data_s"] + row["forward_s"]) / row["steps"] for r, row in rows.items()}
        order = sorted(per_step, key=per_step.__getitem__)
        ordered = [per_step[r] for r in order]
        for i, r in enumerate(order):
            row = rows[r]
            hosts[r] = row.get("host")
            own[r].append(per_step[r])
            if len(ordered) < 2:
                continue
            base = _median_without(ordered, i)
            excess = per_step[r] - base
            if excess > max(REL * base, ABS_S):
                slow[r].append(excess * row["steps"])
                slow_hosts[r][row.get("host")] += 1  # a rank moved to other machines (a resume) keeps its slow one
    n = len(by_step)
    found = [
        _straggler(r, costs, n, slow_hosts[r].most_common(1)[0][0], by_step)
        for r, costs in sorted(slow.items())
        if len(costs) >= max(2, SHARE * n)
    ]
    ranks = {r: round(1e3 * statistics.median(v), 3) for r, v in own.items()}
    compared = any(len(rows) > 1 for rows in by_step.values())
    return RanksReport(found, ranks, _sentence(found, n, len(ranks), compared), n, hosts, parity)


def _parity(path: Path) -> list[dict[str, Any]]:
    """``parity.jsonl``'s records, each checked (a damaged line is one error naming it)."""
    if not present(path):
        return []
    out = []
    for line, row in read_jsonl(path, what="parity.jsonl"):
        ok = isinstance(row, dict) and _is_int(row.get("step"), 1) and _is_int(row.get("rank"), 0)
        tensors = row.get("tensors") if ok else None
        ok = ok and isinstance(tensors, list) and all(isinstance(t, str) for t in tensors)
        if not ok or not (row.get("host") is None or isinstance(row["host"], str)):
            raise UserError(
                f"{path}:{line}: {brief(row)} is not a parity record (it needs step >= 1 and rank >= 0, integers, "
                "tensors, a list of parameter names, and host, a string): correct or remove that line"
            )
        out.append(row)
    return out


def _straggler(r: int, costs: list[float], n: int, host: str | None, by_step: dict) -> Straggler:
    cost = sum(costs)
    return Straggler(r, host, len(costs), n, round(1e3 * cost / _steps(by_step, r), 3), round(cost, 3))


def _steps(by_step: dict[int, dict[int, dict[str, Any]]], rank: int) -> int:
    return max(1, sum(rows[rank]["steps"] for rows in by_step.values() if rank in rows))


def _sentence(found: list[Straggler], intervals: int, ranks: int, compared: bool) -> str:
    if not compared:  # no straggler test was made: an empty file, or rows of one rank (a file cut by hand?)
        return f"no straggler test: no interval holds two ranks' times ({ranks} ranks, {intervals} intervals)"
    if not found:
        return f"no straggler: no rank was consistently slower than the others ({ranks} ranks, {intervals} intervals)"
    parts = [
        f"rank {s.rank}"
        + (f" on {short(s.host)}" if s.host else "")
        + f" was slower in {s.slow_intervals} of {s.intervals} intervals, by {s.excess_ms_per_step:.1f} ms per "
        f"step: the others waited {s.cost_s:.2f} s for it"
        for s in found
    ]
    return "straggler: " + "; ".join(parts) + " (its data loading or forward; look at that machine)"
