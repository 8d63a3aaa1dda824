"""A mixture run (``data.sources``) read per source: its ``sources.json``, the per-source columns of
``metrics.jsonl`` and the summary's table of sources.

``sources.json`` (:mod:`steadytrain.data.sourcemap`) names the sources, their weights, the weight schedule, the
source ``run.epochs`` counts and what was seen of each. The last training row of each logging interval carries
``loss/<name>`` (the mean training loss of that source's examples in the interval; null when not finite or when
the interval had none) and ``mix/<name>`` (the fraction of the interval's examples from that source); evaluation
rows carry ``val_loss/<name>`` and ``val_items/<name>`` for the sources with held-out data. A single-source run
has no ``sources.json``: nothing here applies to it.

Everything the report reads is checked before anything is drawn, as :func:`~steadytrain.runs.record.load_run`
checks the other files: a damaged value is one :class:`~steadytrain.errors.UserError` naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steadytrain._check import check_finite, check_int, check_type
from steadytrain._text import brief, md, short
from steadytrain.data.sourcemap import SOURCES_FILE, SOURCES_FIX, SourceMap, read_sources
from steadytrain.errors import UserError
from steadytrain.rundir.schema import METRICS_FIX
from steadytrain.runs.record import RunRecord
from steadytrain.schedule import MAX_COUNT

__all__ = [
    "SourceRow",
    "load_mixture",
    "mixture_rows",
    "planned_shares",
    "series",
    "source_rows",
    "summary_lines",
]

DASH = "—"
"""A value the run did not record (a source with no ``loss/<name>`` yet, no exposure)."""


def load_mixture(rec: RunRecord) -> SourceMap | None:
    """The run's sources (None: a single-source run), with every value the report reads checked: the weights
    and the schedule in ``sources.json``, its exposure counts, each per-source column of ``metrics.jsonl``.

    Raises:
        UserError: ``sources.json`` is not JSON or not of its shape, or a per-source value is of the wrong type
            (names the file and the key, with the fix).
    """
    path = rec.run.path / SOURCES_FILE
    sources = read_sources(rec.run.path)
    if sources is None:
        return None
    try:
        _check_sources(sources)
    except UserError as err:
        raise UserError(f"{path}: {err}: {SOURCES_FIX}") from None
    for row in [*rec.metrics, *rec.evals]:
        for name in sources.names:
            for key in (f"loss/{name}", f"mix/{name}", f"val_loss/{name}"):
                try:
                    _number(row, key, minimum=0.0 if key.startswith("mix/") else None)
                except UserError as err:
                    raise UserError(f"{rec.run.metrics}: step {row['step']}: {err}; {METRICS_FIX}") from None
    return sources


def _number(row: dict[str, Any], key: str, minimum: float | None = None) -> float | None:
    value = row.get(key)
    return None if value is None else check_finite(key if len(key) <= 80 else brief(key), value, minimum=minimum)


def _weights(name: str, weights: dict[str, Any], names: list[str]) -> None:
    """Each weight a finite number >= 0, and one of a source in ``names`` above 0 (they are normalised)."""
    for key, w in weights.items():
        check_finite(f"{name}.{brief(key)}", w, minimum=0.0)
    if not sum(float(weights.get(n, 0.0)) for n in names) > 0:
        raise UserError(f"{name} are all 0 or name no source: one source needs a weight > 0")


def _check_sources(sources: SourceMap) -> None:
    names = sources.names
    _weights("the sources' weights", {s.name: s.weight for s in sources.spans}, names)
    for i, entry in enumerate(sources.schedule):
        check_type(f"schedule[{i}]", entry, dict)
        check_int(f"schedule[{i}].step", entry.get("step"), 1, maximum=MAX_COUNT)
        _weights(f"schedule[{i}].weights", check_type(f"schedule[{i}].weights", entry.get("weights"), dict), names)
    for name, seen in sources.exposure.items():
        where = f"exposure.{brief(name)}"
        check_type(where, seen, dict)
        if seen.get("examples") is not None:
            check_int(f"{where}.examples", seen["examples"], 0, maximum=MAX_COUNT)
        if seen.get("epochs") is not None and check_finite(f"{where}.epochs", seen["epochs"], minimum=0.0) > MAX_COUNT:
            raise UserError(f"{where}.epochs={brief(seen['epochs'])} is too large: at most {MAX_COUNT}")


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float | None]]:
    """The steps of the rows that carry ``key`` (the last row of each logging interval) and its values there
    (None: not finite, or no example of the source in the interval); values checked by :func:`load_mixture`."""
    found = [(int(r["step"]), r[key]) for r in rows if key in r]
    return [s for s, _ in found], [None if v is None else float(v) for _, v in found]


def planned_shares(sources: SourceMap) -> list[tuple[int, list[float]]]:
    """``(first step, normalised weights)`` of each piece of the plan: the sources' weights from step 1, then each
    schedule entry from its step (a source an entry does not name has weight 0 there), in step order."""
    names = sources.names
    pieces = [(1, [s.weight for s in sources.spans])]
    pieces += [(int(e["step"]), [float(e["weights"].get(n, 0.0)) for n in names]) for e in sources.schedule]
    pieces.sort(key=lambda p: p[0])  # stable: of two entries at one step, the later in the file holds
    return [(step, [w / sum(weights) for w in weights]) for step, weights in pieces]


@dataclass(frozen=True)
class SourceRow:
    """One source in the summary's table; a ``(step, value)`` is None where the run recorded none."""

    name: str
    weight: float
    share: float
    """The weight normalised over the sources (the share of each batch at step 1)."""
    examples: int | None
    epochs: float | None
    final: tuple[int, float | None] | None
    """The last ``loss/<name>`` (value None: not finite), intervals without an example of the source passed over."""
    best: tuple[int, float | None] | None
    best_of: str
    """``validation`` (the lowest ``val_loss/<name>``: the source has held-out data) or ``training``."""


def _lowest(found: list[tuple[int, float | None]]) -> tuple[int, float | None] | None:
    """The ``(step, value)`` of the lowest value (the first of equals); ``(last step, None)`` when none is finite."""
    finite = [(s, v) for s, v in found if v is not None]
    if finite:
        return min(finite, key=lambda p: p[1])
    return found[-1] if found else None


def source_rows(rec: RunRecord, sources: SourceMap) -> list[SourceRow]:
    """Each source's row of the summary's table, in the order of ``data.sources``."""
    total = sum(s.weight for s in sources.spans)
    out = []
    for span in sources.spans:
        steps, losses = series(rec.metrics, f"loss/{span.name}")
        mixed = dict(zip(*series(rec.metrics, f"mix/{span.name}"), strict=True))
        kept = [(s, v) for s, v in zip(steps, losses, strict=True) if v is not None or mixed.get(s) != 0]
        val = list(zip(*series(rec.evals, f"val_loss/{span.name}"), strict=True))
        seen = sources.exposure.get(span.name) or {}
        row = SourceRow(
            name=span.name, weight=span.weight, share=span.weight / total, examples=seen.get("examples"),
            epochs=seen.get("epochs"), final=kept[-1] if kept else None,
            best=_lowest(val or kept), best_of="validation" if val else "training",
        )  # fmt: skip
        out.append(row)
    return out


def _loss(found: tuple[int, float | None] | None, what: str = "") -> str:
    if found is None:
        return DASH
    step, value = found
    shown = "n/a (not finite)" if value is None else format(value, ".4g")
    return f"{shown} ({what}step {step})"


def summary_lines(rec: RunRecord, sources: SourceMap) -> list[str]:
    """The summary's Sources part: the source ``run.epochs`` counts, the schedule's steps, and a table of each
    source's weight, examples seen, epochs, final training loss and best loss (every name through ``md``)."""
    largest = (
        f"source {md(short(sources.largest))}" if sources.largest is not None else "a source sources.json does not name"
    )
    changes = sorted({int(e["step"]) for e in sources.schedule})
    schedule = f"; `data.mix_schedule` changes them from step(s) {', '.join(map(str, changes[:20]))}" if changes else ""
    more = f" and {len(changes) - 20} more" if len(changes) > 20 else ""
    lines = [
        f"**Sources.** `run.epochs` counts the epochs of {largest} (the largest). Weights are those from step 1, "
        f"with their share of each batch{schedule}{more} (`plots/mixture.png` shows the realized mixture). Best "
        "loss is the lowest validation loss of a source with held-out data, else its lowest training loss "
        "(each cell says which). Examples and epochs are from `sources.json`.",
        "",
        "| source | weight | examples seen | epochs | final training loss | best loss |",
        "|---|---|---|---|---|---|",
    ]
    for row in source_rows(rec, sources):
        examples = DASH if row.examples is None else str(row.examples)
        epochs = DASH if row.epochs is None else f"{row.epochs:.2f}"
        lines.append(
            f"| {md(short(row.name))} | {row.weight:.4g} ({row.share:.1%}) | {examples} | {epochs} | "
            f"{_loss(row.final)} | {_loss(row.best, row.best_of + ', ')} |"
        )
    return [*lines, ""]


def mixture_rows(rec: RunRecord, names: list[str]) -> list[dict[str, Any]]:
    """The training rows that carry the realized mixture (``mix/<name>`` of any source)."""
    keys = [f"mix/{n}" for n in names]
    return [r for r in rec.metrics if any(k in r for k in keys)]
