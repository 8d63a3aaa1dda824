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
test with each host's ranks pooled (each rank's ledger lines say its host). The verdict is ``rank-selective`` when
the suspect ranks are involved in at least half of the refused steps; it comes before ``shard-selective``, since a
faulty rank concentrates its flags on whichever shards it happened to read.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain.accumulate import NonFiniteEvent
from steadytrain.diagnose.stats import binomial_sf

__all__ = ["RankStats", "flagged_examples", "flagged_shards", "rank_stats", "read_hosts", "suspect_hosts", "suspects"]


@dataclass
class RankStats:
    """One rank's (or host's) share of the flagged examples against its share of the examples in play."""

    rank: int | str
    """The rank (an int), or the host (a str) for the pooled test."""
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
    events: list[tuple[int, NonFiniteEvent]], key: dict[int, Any] | None = None
) -> tuple[list[RankStats], int]:
    """The test of the module docstring per rank (``key`` maps a rank to the unit tested: its host), and how many
    localized refused steps it weighed."""
    unit = (lambda r: r) if key is None else (lambda r: key.get(r, f"rank {r}"))
    play: dict[Any, Counter] = defaultdict(Counter)
    flags: dict[Any, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for step, event in events:
        where = (step, event.batch)
        play[where][unit(event.rank)] += sum(len(t["shard"]) for t in event.tags)
        flags[where][unit(event.rank)] += flagged_shards(event)
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


def read_hosts(run_dir: Path, ledger: str) -> dict[int, str]:
    """Each rank's host, from its own ledger lines (``host``; lines written before it was recorded have none)."""
    hosts: dict[int, str] = {}
    path = Path(run_dir) / ledger
    if not path.is_file():
        return hosts
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the ledger's own reader has said what is wrong with it
            if isinstance(record, dict) and isinstance(record.get("rank"), int) and isinstance(record.get("host"), str):
                hosts.setdefault(record["rank"], record["host"])
    return hosts


def suspect_hosts(events: list[tuple[int, NonFiniteEvent]], hosts: dict[int, str], ranks: list[int], alpha: float):
    """The hosts of the suspect ranks, and any host the pooled test finds beyond chance."""
    found = {hosts[r] for r in ranks if r in hosts}
    if len(set(hosts.values())) > 1:
        stats, _ = rank_stats(events, hosts)
        found |= {str(s.rank) for s in suspects(stats, alpha)}
    return sorted(found)
