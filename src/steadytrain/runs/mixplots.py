"""The pictures of a mixture run (``data.sources``): each source's loss, and the realized mixture against the plan.

``plots/source_loss.png``: one training-loss curve per source (``loss/<name>`` of the last row of each logging
interval), its validation losses (``val_loss/<name>``) as markers in the same colour. ``plots/mixture.png``: the
share of each interval's examples from each source (``mix/<name>``) as a stacked area, each interval drawn over the
steps it covers (the interval ending at step ``s`` covers the steps after the previous logged step, up to ``s``),
and the planned shares (the sources' weights from step 1, then the schedule's, normalised) as dashed step lines at
the top edge of each source's band: where the area's edge leaves its dashed line, the mixture left its plan.

Drawn as :mod:`.plots` draws: the object API on the Agg canvas, a fixed size, written atomically and marked. At
most :data:`MAX_SOURCES` sources are drawn, the first in ``data.sources`` order (the title says so when there are
more).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadytrain.runs.mixture import mixture_rows, planned_shares, series
from steadytrain.runs.plots import STEP, _figure, _label, _points, _save
from steadytrain.runs.record import RunRecord

if TYPE_CHECKING:
    from steadytrain.data.sourcemap import SourceMap

__all__ = ["MAX_SOURCES", "mixture_plot", "plots_for", "source_loss_plot"]

MAX_SOURCES = 20
"""At most this many sources drawn (a legend entry each)."""


def plots_for(sources: SourceMap) -> dict[str, Callable[[RunRecord, Path], Path | None]]:
    """Plot name (``plots/<name>.png``) -> the function drawing it for this mixture, as :data:`.report.PLOTS`."""
    return {
        "source_loss": functools.partial(source_loss_plot, sources=sources),
        "mixture": functools.partial(mixture_plot, sources=sources),
    }


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _title(rec: RunRecord, what: str, names: list[str]) -> str:
    shown = f" (the first {MAX_SOURCES} of {len(names)} sources)" if len(names) > MAX_SOURCES else ""
    return f"{_label(rec.name)}: {what}{shown}"


def _legend(ax: Any, count: int) -> None:
    """The legend below the axes, outside them (a stacked area fills them), in up to 5 columns."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.figure.legend(handles, labels, loc="outside lower center", fontsize="small", ncols=max(1, min(count, 5)))


def source_loss_plot(rec: RunRecord, path: Path, *, sources: SourceMap) -> Path:
    """Each source's training loss per logging interval, its validation loss as markers in the same colour."""
    fig = _figure()
    ax = fig.add_subplot()
    names = sources.names[:MAX_SOURCES]
    any_val = False
    for name, color in zip(names, _colors(len(names)), strict=True):
        steps, losses = _points(*series(rec.metrics, f"loss/{name}"))
        ax.plot(steps, losses, color=color, linewidth=1.5, marker=".", markersize=4, label=_label(name))
        val_steps, val = _points(*series(rec.evals, f"val_loss/{name}"))
        if val_steps:
            any_val = True
            ax.plot(val_steps, val, color=color, marker="o", markersize=6, markeredgecolor="black",
                    markeredgewidth=0.5, linestyle="none")  # fmt: skip
    if any_val:  # one legend entry for every source's markers
        ax.plot([], [], color="0.6", marker="o", markeredgecolor="black", markeredgewidth=0.5, linestyle="none",
                label="validation loss (the source's colour)")  # fmt: skip
    if not any(line.get_xdata().size for line in ax.lines):
        ax.text(0.5, 0.5, "no per-source loss recorded yet (no loss/<source> in metrics.jsonl)", ha="center",
                va="center", transform=ax.transAxes)  # fmt: skip
    title = "training and validation loss per source" if any_val else "training loss per source"
    ax.set(xlabel=STEP, ylabel="loss (mean per example of the source)", title=_title(rec, title, sources.names))
    ax.grid(alpha=0.3)
    _legend(ax, len(names) + any_val)
    return _save(fig, path)


def _realized(rec: RunRecord, names: list[str]) -> tuple[list[int], list[list[float]]]:
    """The stacked area's x (the first step of each interval, then the step after the last) and each source's
    shares, the last repeated (a post-step drawing holds each value up to the next x); a null share is 0."""
    rows = mixture_rows(rec, names)
    if not rows:
        return [], [[] for _ in names]
    steps = [int(r["step"]) for r in rows]
    x = [1, *(s + 1 for s in steps)]
    shares = [[float(r.get(f"mix/{n}") or 0.0) for r in rows] for n in names]
    return x, [y + y[-1:] for y in shares]


def _planned(sources: SourceMap, count: int, end: int) -> tuple[list[int], list[list[float]]]:
    """The x of each piece of the plan (then ``end``) and, per source drawn, the planned top edge of its band:
    the cumulative normalised weight of it and the sources below it."""
    pieces = [(step, shares) for step, shares in planned_shares(sources) if step < end]
    x = [step for step, _ in pieces] + [end]
    tops = []
    for j in range(count):
        edge = [sum(shares[: j + 1]) for _, shares in pieces]
        tops.append(edge + edge[-1:])
    return x, tops


def mixture_plot(rec: RunRecord, path: Path, *, sources: SourceMap) -> Path:
    """The realized mixture as a stacked area against the planned shares (dashed, the top edge of each band)."""
    fig = _figure()
    ax = fig.add_subplot()
    names = sources.names[:MAX_SOURCES]
    colors = _colors(len(names))
    x, shares = _realized(rec, names)
    if x:
        ax.stackplot(x, shares, step="post", colors=colors, alpha=0.45, labels=[_label(n) for n in names])
    else:
        ax.text(0.5, 0.5, "no realized mixture recorded yet (no mix/<source> in metrics.jsonl)", ha="center",
                va="center", transform=ax.transAxes)  # fmt: skip
    last = max([*x[-1:], *(s + 1 for s in rec.steps[-1:]), int(rec.plan.get("total_steps") or 0) + 1, 2])
    steps, tops = _planned(sources, len(names), last)
    for j, (top, color) in enumerate(zip(tops, colors, strict=True)):
        if j < len(sources.names) - 1:  # the last band's top edge is always 1
            ax.step(steps, top, where="post", color=color, linestyle="--", linewidth=2)
    if len(sources.names) > 1:
        ax.plot([], [], color="0.3", linestyle="--", linewidth=2,
                label="planned: top edge of each band (normalised weights)")  # fmt: skip
    ax.set_ylim(0.0, 1.0)
    ax.set_xlim(1, last)
    ax.set(xlabel=STEP, ylabel="share of the interval's examples", title=_title(rec, "mixture, realized and planned",
           sources.names))  # fmt: skip
    ax.grid(alpha=0.3)
    _legend(ax, len(names) + 1)
    return _save(fig, path)
