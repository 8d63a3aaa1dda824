"""The shard ids of a mixture run told as their sources': names for the reports, keys for their JSON, and the
records per shard of all the sources together (what the ledgers' ids and indices are checked against).

A mixture run numbers the shards of its sources in one id space (source ``j``'s shard ``k`` is id
``offset_j + k``, :mod:`steadytrain.data.sourcemap`); every ledger and ``exposure.json`` keeps those ids. What
names a shard for a person says which source it is in (``web shard 3 (id 7)``); a single-source run (no
``sources.json``, ``sources`` None here) keeps its plain ``shard 7``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain.data.sourcemap import SourceMap
from steadytrain.errors import UserError

__all__ = ["in_mixture", "mixture_bounds", "shard_name", "source_keys", "sources_phrase"]


def shard_name(sources: SourceMap | None, shard: int) -> str:
    """``"shard 7"`` without sources; ``"web shard 3 (id 7)"`` for a mixture (``"shard 7 (no source)"`` for an
    id no source has).

    Example:
        >>> from steadytrain.data.sourcemap import SourceMap, SourceSpan
        >>> m = SourceMap([SourceSpan("web", "/w", 3.0, 0, 4), SourceSpan("code", "/c", 1.0, 4, 2)])
        >>> shard_name(None, 5), shard_name(m, 5), shard_name(m, 6)
        ('shard 5', 'code shard 1 (id 5)', 'shard 6 (no source)')
    """
    if sources is None:
        return f"shard {shard}"
    return f"{sources.label(shard)} (id {shard})" if sources.source_of(shard) else f"shard {shard} (no source)"


def source_keys(sources: SourceMap | None, shard: int) -> dict[str, Any]:
    """``{"source": name, "source_shard": k}`` to stand beside a shard id in JSON (both None for an id no source
    has); nothing without sources."""
    if sources is None:
        return {}
    found = sources.source_of(shard)
    return {"source": found[0], "source_shard": found[1]} if found else {"source": None, "source_shard": None}


def sources_phrase(sources: SourceMap, shards: list[int]) -> str:
    """Which sources ``shards`` are in: ``in source 'web'``, ``all in source 'web'`` (several shards), ``from
    sources 'web' and 'code'``; ids no source has are said too."""
    names: list[str] = []
    for s in shards:
        found = sources.source_of(s)
        if found and found[0] not in names:
            names.append(found[0])
    quoted = [f"'{n}'" for n in names]
    stray = sum(1 for s in shards if sources.source_of(s) is None)
    tail = f" ({stray} in no source)" if stray and names else ""
    if not names:
        return "in no source of the mixture"
    if len(names) == 1:
        return f"{'all ' if len(shards) > 1 and not stray else ''}in source {quoted[0]}{tail}"
    return f"from sources {', '.join(quoted[:-1])} and {quoted[-1]}{tail}"


def mixture_bounds(sources: SourceMap) -> dict[int, int] | None:
    """Records per shard of every source's dataset, keyed by mixture id (``offset + k``); None when a source's
    data is gone, unreadable, or changed since the run (another fingerprint, or a shard id past the ids the run
    numbered): the ledger's positions then cannot be judged."""
    from steadytrain.data import open_dataset

    out: dict[int, int] = {}
    for span in sources.spans:
        if not Path(span.path).is_dir():
            return None
        try:
            ds = open_dataset(span.path)
            if span.fingerprint and span.fingerprint != ds.fingerprint():
                return None
        except UserError:  # a damaged index is the data's problem, told where the data is read: not the ledger's
            return None
        for shard in ds.shards:
            if shard.id >= span.ids:
                return None
            out[span.offset + shard.id] = shard.records
    return out


def in_mixture(report: Any, shard: int, own: int, source: str) -> Any:
    """A hunt's ``report`` of mixture shard ``shard`` (its own shard ``own`` of source ``source``, where it was
    replayed) told in the mixture's ids, with a note naming the source."""
    offset = shard - own
    report.shard = shard
    report.bad = [[s + offset, i] for s, i in report.bad]
    where = f"shard {shard} is source {source!r}'s shard {own}"
    report.note = f"{report.note}; {where}" if report.note else where
    return report
