"""How shards were produced, and which ones were produced differently from the rest.

A shard-selective failure is usually a shard made differently: another pipeline version, a schema
change, another source, an interrupted write. Comparing each shard's provenance with the majority
of shards names those differences directly.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from steadytrain._io import brief
from steadytrain.data.index import DatasetError

__all__ = ["IGNORED", "healthy_shards", "majority_provenance", "provenance_differences", "provenance_outliers"]

# Differ from shard to shard by construction (time written; which input files, padding and skipped lines
# an ingested shard holds): not evidence of a different production.
IGNORED = frozenset({"created_at", "sources", "pad_tokens", "skipped_lines"})


def _key(value: Any) -> str:
    return repr(value)


def majority_provenance(dataset: Any, *, ignore: frozenset[str] = IGNORED) -> dict[str, Any]:
    """For every provenance field, the value most shards have (``None`` counts as a value).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> ds = NS(shards=[NS(id=i, provenance={"v": "1.1" if i == 3 else "1.0"}) for i in range(5)])
        >>> majority_provenance(ds)
        {'v': '1.0'}
    """
    fields = sorted({k for s in dataset.shards for k in s.provenance} - ignore)
    out = {}
    for f in fields:
        counts = Counter(_key(s.provenance.get(f)) for s in dataset.shards)
        top = counts.most_common(1)[0][0]
        out[f] = next(s.provenance.get(f) for s in dataset.shards if _key(s.provenance.get(f)) == top)
    return out


def provenance_differences(dataset: Any, shard_id: int, *, ignore: frozenset[str] = IGNORED) -> dict[str, tuple]:
    """Fields where shard ``shard_id`` differs from the majority: ``field -> (its value, majority value)``.

    Raises:
        DatasetError: the dataset has no shard ``shard_id``.
    """
    shard = next((s for s in dataset.shards if s.id == shard_id), None)
    if shard is None:
        where = f"{dataset.path}: " if hasattr(dataset, "path") else ""
        raise DatasetError(f"{where}no shard {brief(shard_id)} (see `steadytrain data provenance` for the ids)")
    major = majority_provenance(dataset, ignore=ignore)
    return {f: (shard.provenance.get(f), v) for f, v in major.items() if _key(shard.provenance.get(f)) != _key(v)}


def provenance_outliers(dataset: Any, *, ignore: frozenset[str] = IGNORED) -> dict[int, dict[str, tuple]]:
    """Every shard with at least one provenance field unlike the majority, with those fields."""
    major = majority_provenance(dataset, ignore=ignore)
    out = {}
    for s in dataset.shards:
        diffs = {f: (s.provenance.get(f), v) for f, v in major.items() if _key(s.provenance.get(f)) != _key(v)}
        if diffs:
            out[s.id] = diffs
    return out


def healthy_shards(dataset: Any, *, ignore: frozenset[str] = IGNORED) -> list[int]:
    """The shards presumed healthy: those whose provenance matches the majority in every field.

    This is the default set to infer a schema from before validating the rest. When no shard matches
    the majority in every field (each differs somewhere), every shard is returned: there is no
    majority production to trust more than the others.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> ds = NS(shards=[NS(id=i, provenance={"v": "1.1" if i == 3 else "1.0"}) for i in range(5)])
        >>> healthy_shards(ds)
        [0, 1, 2, 4]
    """
    odd = provenance_outliers(dataset, ignore=ignore)
    return [s.id for s in dataset.shards if s.id not in odd] or [s.id for s in dataset.shards]
