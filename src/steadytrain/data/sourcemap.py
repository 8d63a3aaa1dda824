"""Which source of a mixture a shard id belongs to, and the run file that says so (``sources.json``).

A mixture run (``data.sources``) numbers the shards of all its sources in one id space, so the records that
name shards (``exposure.json``, the non-finite ledger, spike records, every micro-batch's ``shard`` column)
need no second key: source ``j``'s shard ``k`` is id ``offset_j + k``, with ``offset_0 = 0`` and
``offset_{j+1} = offset_j + ids_j`` (``ids_j``: the largest shard id of source ``j``'s dataset, plus one).

``sources.json`` in the run directory holds the sources (name, path, weight, offset, ids, records per epoch,
fingerprint), the weight schedule, the source ``run.epochs`` counts, and per source the examples seen, its
epoch and its examples per shard (its own shard ids): written by rank 0 at start and with every ``exposure.json``.
A single-source run has no ``sources.json``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._check import check_finite, check_int, check_type
from steadytrain._io import load_json, present
from steadytrain._text import brief
from steadytrain.errors import UserError
from steadytrain.schedule import MAX_COUNT

__all__ = ["SOURCES_FILE", "SOURCES_FIX", "SourceMap", "SourceSpan", "mixture_fingerprint", "read_sources"]

SOURCES_FILE = "sources.json"
SOURCES_FIX = "the file is damaged: restore it from the run's checkpoint directory or remove it"


def mixture_fingerprint(parts: list[tuple[str, str]]) -> str:
    """A mixture's fingerprint from its sources' names and fingerprints, in order (``data.json``, reader states).

    Example:
        >>> mixture_fingerprint([("web", "ab12"), ("code", "cd34")])
        'mix(web=ab12;code=cd34)'
    """
    return "mix(" + ";".join(f"{name}={fp}" for name, fp in parts) + ")"


@dataclass(frozen=True)
class SourceSpan:
    """One source of a mixture: its shard ids are ``offset .. offset + ids - 1``."""

    name: str
    path: str
    weight: float
    offset: int
    ids: int
    records: int = 0
    """Examples in one epoch of the source (after the hold-out and the load-time policy)."""
    fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class SourceMap:
    """The sources of a mixture run, in their order, and what was seen of each (``sources.json``).

    Example:
        >>> m = SourceMap([SourceSpan("web", "/w", 3.0, 0, 4), SourceSpan("code", "/c", 1.0, 4, 2)])
        >>> m.source_of(5), m.label(5), m.source_of(6)
        (('code', 1), 'code shard 1', None)
    """

    spans: list[SourceSpan]
    schedule: list[dict[str, Any]] = field(default_factory=list)
    largest: str | None = None
    exposure: dict[str, Any] = field(default_factory=dict)
    """Per source name: ``examples``, ``epoch``, ``epochs`` (examples / records) and ``shards`` (own id -> count)."""

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.spans]

    def source_of(self, shard_id: int) -> tuple[str, int] | None:
        """``(source name, its own shard id)`` of a mixture shard id; None when no source has it."""
        starts = [s.offset for s in self.spans]
        i = bisect.bisect_right(starts, shard_id) - 1
        if i < 0 or shard_id >= self.spans[i].offset + self.spans[i].ids:
            return None
        return self.spans[i].name, shard_id - self.spans[i].offset

    def label(self, shard_id: int) -> str:
        """``"<source> shard <k>"`` for messages (``"shard <id>"`` when no source has it)."""
        found = self.source_of(shard_id)
        return f"{found[0]} shard {found[1]}" if found else f"shard {shard_id}"

    def with_exposure(self, exposure: dict[int, int], epochs: list[int]) -> SourceMap:
        """This map with what was seen of each source: ``exposure`` (examples per mixture shard id, all ranks) and
        ``epochs`` (each source's epoch now: how many times it ran out)."""
        seen: dict[str, Any] = {}
        for span, epoch in zip(self.spans, epochs, strict=True):
            own = {k - span.offset: n for k, n in sorted(exposure.items()) if span.offset <= k < span.offset + span.ids}
            total = sum(own.values())
            seen[span.name] = {
                "examples": total,
                "epoch": epoch,
                "epochs": round(total / span.records, 6) if span.records else None,
                "shards": {str(k): n for k, n in own.items()},
            }
        return SourceMap(self.spans, self.schedule, self.largest, seen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": [s.to_dict() for s in self.spans],
            "schedule": self.schedule,
            "largest": self.largest,
            "exposure": self.exposure,
        }


def read_sources(run_dir: str | Path) -> SourceMap | None:
    """The run's :class:`SourceMap` (None: not a mixture run, no ``sources.json``).

    Raises:
        UserError: ``sources.json`` is not JSON or not of this shape (named, with the fix).
    """
    path = Path(run_dir) / SOURCES_FILE
    if not present(path):
        return None
    data = load_json(path, what="mixture sources")
    try:
        if not isinstance(data, dict):
            raise UserError(f"{brief(data)} is not a mixture's sources (a JSON object)")
        entries = check_type("sources", data.get("sources"), list)
        spans = [_span(i, entry) for i, entry in enumerate(entries)]
        if not spans:
            raise UserError("sources=[] names no source")
        names = [s.name for s in spans]
        if (twice := next((n for i, n in enumerate(names) if n in names[:i]), None)) is not None:
            raise UserError(f"sources: the name {brief(twice)} is given to two sources")
        for i, (before, span) in enumerate(zip([None, *spans], spans, strict=False)):
            at = 0 if before is None else before.offset + before.ids  # one id space, each source after the last
            if span.offset != at:
                raise UserError(f"sources[{i}].offset={span.offset} must be {at} (the ids of the sources before it)")
        schedule, largest, exposure = (data.get(k) for k in ("schedule", "largest", "exposure"))
        return SourceMap(
            spans,
            [] if schedule is None else check_type("schedule", schedule, list),
            None if largest is None else check_type("largest", largest, str),
            {} if exposure is None else check_type("exposure", exposure, dict),
        )
    except UserError as err:
        raise UserError(f"{path}: {err}: {SOURCES_FIX}") from None


def _span(i: int, entry: Any) -> SourceSpan:
    """``sources[i]`` of ``sources.json``, each value of its own type (a UserError naming the key, else)."""
    where = f"sources[{i}]"
    check_type(where, entry, dict)
    texts = {k: check_type(f"{where}.{k}", entry.get(k, "" if k == "fingerprint" else None), str)
             for k in ("name", "path", "fingerprint")}  # fmt: skip
    if "\x00" in texts["path"]:
        raise UserError(f"{where}.path={brief(texts['path'])} is not a path (it holds a NUL byte)")
    weight = check_finite(f"{where}.weight", entry.get("weight"), minimum=0.0)
    counts = {k: check_int(f"{where}.{k}", entry.get(k, 0 if k == "records" else None), 0, maximum=MAX_COUNT)
              for k in ("offset", "ids", "records")}  # fmt: skip
    return SourceSpan(texts["name"], texts["path"], weight, **counts, fingerprint=texts["fingerprint"])
