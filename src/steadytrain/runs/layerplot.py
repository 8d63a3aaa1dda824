"""``plots/layers.png``: each layer's gradient norm and update ratio over the monitored steps, as two heatmaps.

Rows are the layers in model order (the first at the top), columns the monitored steps as written (one column
each, so a refused step between two regular ones is as wide as they are; a step trained again after a rollback
is a second column). At most :data:`MAX_ROWS` layers are drawn, the first in model order (the title says so when
there are more: a row must be a few pixels high to be seen). Both colour scales are logarithmic, within
:data:`SCALE` (a value beyond it takes the scale's end colour); a null (not finite, or no update applied) or zero
value is left blank (grey). Loss spikes (``metrics.jsonl`` rows with ``spike: true``, and rolled-back spikes) are
marked with a vertical line through their column, rollbacks with a dashed line after the rolled-back try.
Drawn as :mod:`.plots` draws: the object API on the Agg canvas, a fixed size, written atomically and marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain.diagnose.layers import layer_order, read_layers, tries
from steadytrain.runs.plots import DPI, _label, _save
from steadytrain.runs.record import RunRecord

__all__ = ["SIZE", "layers_plot"]

SIZE = (8.0, 7.0)
"""Inches: two heatmaps stacked."""
MAX_LABELS = 32
"""At most this many layer names on the y axis (every k-th beyond)."""
MAX_ROWS = 100
"""At most this many layers drawn (the first in model order): a panel is some 270 pixels high."""
SCALE = (1e-150, 1e150)
"""The colour scales' limits: matplotlib's log scale fails on values near the ends of the float range."""
PANELS = (
    ("grad_norm", "gradient norm by layer (before clipping)", "grad norm (L2, before clipping)", "magma"),
    ("update_ratio", "update ratio by layer", "update ratio ‖Δw‖ / ‖w‖ (per step)", "viridis"),
)


def _grid(groups: list[list[dict[str, Any]]], layers: list[str], key: str) -> Any:
    """A layers x columns masked array of ``key``; null and zero cells masked (no colour on a log scale); rows of
    layers not in ``layers`` left out."""
    import numpy as np

    where = {layer: i for i, layer in enumerate(layers)}
    grid = np.full((len(layers), len(groups)), np.nan)
    for j, group in enumerate(groups):
        for row in group:
            if row[key] is not None and row[key] > 0 and row["layer"] in where:
                grid[where[row["layer"]], j] = row[key]
    return np.ma.masked_invalid(grid)


def _marks(rec: RunRecord, groups: list[list[dict[str, Any]]]) -> tuple[list[int], list[int]]:
    """Columns of the loss spikes, and the columns after which a rollback went back (the rolled-back tries)."""
    keys = [(g[0]["step"], g[0].get("rollback")) for g in groups]
    rolled = [i for i, (_, n) in enumerate(keys) if n is not None]
    spike_steps = {r["step"] for r in rec.metrics if r.get("spike")}
    spikes = [i for i, (s, n) in enumerate(keys) if n is None and s in spike_steps]
    for row in rec.rollbacks:  # a rollback whose rows carry no rollback key: the last try of its step
        if not any(keys[i] == (row["step"], row.get("rollback")) for i in rolled):
            rolled += [i for i, (s, _) in enumerate(keys) if s == row["step"]][-1:]
    return sorted(set(spikes) | set(rolled)), sorted(set(rolled))


def _ticks(groups: list[list[dict[str, Any]]], most: int = 8) -> tuple[list[int], list[str]]:
    """At most ``most`` columns spread from the first to the last, labelled with their steps."""
    n = len(groups)
    count = min(n, most)
    at = sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(count)})
    return at, [str(groups[i][0]["step"]) for i in at]


def _panel(fig: Any, ax: Any, cax: Any, grid: Any, layers: list[str], spec: tuple[str, str, str, str]) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    _, title, unit, cmap = spec
    if grid.count() == 0:
        ax.text(0.5, 0.5, "nothing recorded (null or 0 at every step)", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
        ax.set_xlim(-0.5, grid.shape[1] - 0.5)
        ax.set_ylim(len(layers) - 0.5, -0.5)
    else:
        low, high = (min(max(float(x), SCALE[0]), SCALE[1]) for x in (grid.min(), grid.max()))
        norm = LogNorm(vmin=low, vmax=high if high > low else low * 10)
        colours = colormaps[cmap].with_extremes(bad="0.88")  # a blank cell: grey, not a colour of the scale
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=colours, norm=norm)
        fig.colorbar(image, cax=cax, label=unit).minorticks_off()  # decades are enough; the minor ticks cost time
    if grid.count() == 0:
        cax.set_axis_off()
    every = max(1, -(-len(layers) // MAX_LABELS))
    ax.set_yticks(range(0, len(layers), every), [_label(name) for name in layers[::every]], fontsize=7)
    ax.set(ylabel="layer (model order)", title=title)


def _canvas() -> tuple[Any, list[Any], list[Any]]:
    """The figure, its two panels and their colour bars, at fixed places: a layout engine would spend most of the
    plot's time (some 0.6 s of 0.8) measuring tick labels to place four axes whose places do not change."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    top = fig.add_axes((0.17, 0.55, 0.66, 0.39))
    bottom = fig.add_axes((0.17, 0.09, 0.66, 0.39), sharex=top)
    top.tick_params(labelbottom=False)
    caxes = [fig.add_axes((0.85, 0.55, 0.02, 0.39)), fig.add_axes((0.85, 0.09, 0.02, 0.39))]
    return fig, [top, bottom], caxes


def layers_plot(rec: RunRecord, path: Path) -> Path | None:
    """Draw ``plots/layers.png`` from ``RUN/layers.jsonl`` (see the module docstring); None, and nothing written,
    when the run recorded no layer norms.

    Raises:
        UserError: a damaged ``layers.jsonl`` (names ``file:line``), or the plot cannot be written.
    """
    rows = read_layers(rec.run.path)
    if not rows:
        return None
    groups, layers = tries(rows), layer_order(rows)
    shown = f" (the first {MAX_ROWS} of {len(layers)} layers)" if len(layers) > MAX_ROWS else ""
    layers = layers[:MAX_ROWS]
    spikes, rolled = _marks(rec, groups)
    fig, axes, caxes = _canvas()
    for ax, cax, spec in zip(axes, caxes, PANELS, strict=True):
        _panel(fig, ax, cax, _grid(groups, layers, spec[0]), layers, spec)
        for i, x in enumerate(spikes):
            ax.axvline(x, color="tab:red", linewidth=1, alpha=0.8,
                       label=f"loss spike ({len(spikes)})" if not i else None)  # fmt: skip
        for i, x in enumerate(rolled):
            ax.axvline(x + 0.5, color="tab:purple", linestyle="--", linewidth=1.2,
                       label=f"rolled back after this try ({len(rolled)})" if not i else None)  # fmt: skip
    if spikes or rolled:
        axes[0].legend(loc="upper right", fontsize=7)
    at, labels = _ticks(groups)
    axes[1].set_xticks(at, labels)
    axes[1].set_xlabel("monitored optimizer step (one column each; grey: not finite, no update, or 0)")
    axes[0].set_title(f"{_label(rec.name)}: {PANELS[0][1]}{shown}")
    return _save(fig, path)
