"""Rank and host attribution of a run's refused steps: does the trouble follow a machine?

The evidence is the ledger the shard test reads (:mod:`.report`): for each refused step, every rank's
micro-batches and which of their examples had a non-finite (for spikes: outlying) local loss.

The test. Over the refused steps whose trouble was localized (some rank flagged an example), let ``n`` be the
flagged examples and ``k_r`` those flagged on rank ``r``; let ``q_r`` be rank ``r``'s share of the examples in play
in those same steps (every rank's micro-batches). If the flagged values had nothing to do with the rank that
computed them, ``k_r`` would be (bounded by) ``Binomial(n, q_r)``; a rank is a suspect when its upper tail
``P(X >= k_r)``, Bonferroni-corrected over the ranks tested, is below :data:`~.report.ALPHA` **and** its flagged
examples came from at least two shards: a bad shard read by one rank would otherwise incriminate that rank, while
trouble that follows one rank across shards is the rank's (its device or its host), not the data's. Hosts: the same
test with each host's ranks pooled (each ledger line names the host that computed it: a rank resumed on another
machine counts for each of its hosts in turn). The verdict is ``rank-selective`` when the suspect ranks are involved
in at least half of the refused steps; it comes before ``shard-selective``, since a faulty rank concentrates its flags
on whichever shards it happened to read.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain.accumulate import NonFiniteEvent
from steadytrain.diagnose.stats import binomial_sf

__all__ = [
    "RankStats",
    "flagged_examples",
    "flagged_shards",
    "host_key",
    "rank_stats",
    "read_hosts",
    "suspect_hosts",
    "suspects",
]


@dataclass
class RankStats:
    """One rank's (or host's) share of the flagged examples against its share of the examples in play."""

    rank: int | str
    """The rank (an int), or the host (a str) for the pooled test (there, a ledger line without a host counts for
    its rank)."""
    events: int
    """Refused steps in which it flagged an example."""
    flagged: int
    """Flagged examples on it (``k_r``)."""
    expected: float
    """``n * q_r``: what chance would give."""
    p_value: float
    """``P(X >= k_r)`` under ``Binomial(n, q_r)``, uncorrected."""
    shards: int
    """Distinct shards its flagged examples came from."""


def flagged_examples(event: NonFiniteEvent) -> list[tuple[int, int]]:
    """``(shard, index)`` of the examples this rank flagged in this event (a whole micro-batch when the model gave
    no per-example losses)."""
    out = []
    for i, tag in enumerate(event.tags):
        if tag.get("nonfinite") is not None:
            out += [(tag["shard"][j], tag["index"][j]) for j in tag["nonfinite"]]
        elif i in event.nonfinite_micro_batches:
            out += list(zip(tag["shard"], tag["index"], strict=True))
    return out


def flagged_shards(event: NonFiniteEvent) -> list[int]:
    """Shards of the examples this rank flagged in this event."""
    return [shard for shard, _ in flagged_examples(event)]


def rank_stats(
    events: list[tuple[int, NonFiniteEvent]], key: dict[tuple, str] | None = None
) -> tuple[list[RankStats], int]:
    """The test of the module docstring per rank (``key``: :func:`read_hosts`'s hosts, to test each host: a line
    without one is its rank's own unit), and how many localized refused steps it weighed."""
    unit = (lambda s, e: e.rank) if key is None else (lambda s, e: key.get(host_key(s, e), e.rank))
    play: dict[Any, Counter] = defaultdict(Counter)
    flags: dict[Any, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for step, event in events:
        where = (step, event.batch)
        play[where][unit(step, event)] += sum(len(t["shard"]) for t in event.tags)
        flags[where][unit(step, event)] += flagged_shards(event)
    localized = [w for w in play if any(flags[w].values())]
    units = sorted({u for w in play for u in play[w]}, key=str)
    n = sum(len(v) for w in localized for v in flags[w].values())
    total = sum(sum(play[w].values()) for w in localized)
    out = []
    for u in units:
        k = sum(len(flags[w][u]) for w in localized)
        q = sum(play[w][u] for w in localized) / total if total else 0.0
        p = binomial_sf(min(k, n), n, min(q, 1.0)) if n else 1.0
        shards = len({s for w in localized for s in flags[w][u]})
        steps = sum(1 for w in localized if flags[w][u])
        out.append(RankStats(u, steps, k, round(n * q, 3), p, shards))
    return sorted(out, key=lambda s: (s.p_value, str(s.rank))), len(localized)


def suspects(stats: list[RankStats], alpha: float) -> list[RankStats]:
    """Ranks (hosts) beyond chance whose flags follow them across at least two shards."""
    cut = alpha / max(len(stats), 1)
    return [s for s in stats if s.p_value < cut and s.flagged > s.expected and s.shards >= 2]


def host_key(step: int, event: NonFiniteEvent) -> tuple[int, int, int | None]:
    """Where :func:`read_hosts` keeps the host of ``event``'s ledger line."""
    return step, event.rank, event.batch


def read_hosts(run_dir: Path, ledger: str) -> dict[tuple[int, int, int | None], str]:
    """The host of each ledger line (``host``; lines written before it was recorded have none), keyed by
    :func:`host_key`: a rank's host can change during a run (a resume on other machines)."""
    hosts: dict[tuple[int, int, int | None], str] = {}
    path = Path(run_dir) / ledger
    if not path.is_file():
        return hosts
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the ledger's own reader has said what is wrong with it
            if not isinstance(record, dict) or not isinstance(record.get("host"), str):
                continue
            where = (record.get("step"), record.get("rank"), record.get("batch"))
            if all(isinstance(k, int) for k in where[:2]) and isinstance(where[2], int | None):
                hosts.setdefault(where, record["host"])
    return hosts


def suspect_hosts(
    events: list[tuple[int, NonFiniteEvent]], hosts: dict[tuple, str], ranks: list[int], alpha: float
) -> list[str]:
    """The hosts the suspect ranks flagged examples on, and any host the pooled test finds beyond chance."""
    found = {hosts[k] for s, e in events if e.rank in ranks and flagged_shards(e) and (k := host_key(s, e)) in hosts}
    if len(set(hosts.values())) > 1:
        stats, _ = rank_stats(events, hosts)
        found |= {s.rank for s in suspects(stats, alpha) if isinstance(s.rank, str)}  # a line without a host: no host
    return sorted(found)
