"""The pictures of a run: loss, learning rate, gradient norm, throughput; two runs overlaid; a sweep.

Figures are drawn with matplotlib's object API on the Agg canvas (no ``pyplot``, no global backend
switch, safe in a notebook or a thread) at a fixed size, and written atomically. Every plot has
labelled axes with units and a title naming the run. Every PNG carries ``Software: steadytrain`` in
its metadata: a plot written where the user chose (``compare --plot``) replaces only a PNG with that
mark, never another file that happens to have the name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from steadytrain._io import brief, one_line, write_atomic
from steadytrain._text import short
from steadytrain.errors import UserError
from steadytrain.runs.record import RunRecord, smooth
from steadytrain.schedule import lr_multiplier

__all__ = [
    "DPI",
    "MARK",
    "SIZE",
    "compare_plot",
    "grad_norm_plot",
    "is_ours",
    "loss_figure",
    "loss_plot",
    "lr_plot",
    "sweep_plot",
    "throughput_plot",
]

SIZE = (8.0, 4.5)
"""Inches: at :data:`DPI` every run plot is 800 x 450 pixels."""
DPI = 100
PNG_OPTIONS = {"compress_level": 1}
"""How the PNGs are compressed: fast (every run ends by drawing its plots)."""
STEP = "optimizer step"
MARK = "steadytrain"
"""The ``Software`` text of every PNG written here."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLANNED_POINTS = 2000
"""At most this many points of the planned LR schedule are drawn (plus the warmup ramp)."""


def _figure(size: tuple[float, float] = SIZE, *, fixed: bool = False) -> Any:
    """A figure on the Agg canvas. ``fixed``: one axes at fixed margins instead of the constrained layout, which
    spends about half of a one-axes plot's time measuring tick labels (the plots of every run take it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout=None if fixed else "constrained")
    if fixed:
        fig.subplots_adjust(left=0.1, right=0.97, bottom=0.11, top=0.92)
    FigureCanvasAgg(fig)
    return fig


def _label(text: str) -> str:
    """A run name, path or layer name inside a title, legend or axis: one line, at most
    :data:`~steadytrain._text.SHORT` characters (:func:`~steadytrain._text.short`, as the text tables), and a ``$``
    is a dollar, not mathtext."""
    return short(text).replace("$", r"\$")


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a regular file holding a PNG whose ``Software`` text chunk is :data:`MARK`."""
    if not path.is_file():  # before opening: a FIFO would block
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    pos = len(PNG_SIGNATURE) if head.startswith(PNG_SIGNATURE) else len(head)
    while pos + 8 <= len(head):
        size, kind = int.from_bytes(head[pos : pos + 4], "big"), head[pos + 4 : pos + 8]
        if kind in (b"IDAT", b"IEND"):  # text chunks written before the image data
            break
        key, _, value = head[pos + 8 : pos + 8 + size].partition(b"\0")
        if kind == b"tEXt" and key == b"Software":
            return value == MARK.encode()
        pos += 12 + size
    return False


def _save(fig: Any, path: Path, *, ours_only: bool = False) -> Path:
    """Write ``fig`` as a marked PNG; with ``ours_only`` an existing file is replaced only if :func:`is_ours`."""
    if ours_only and path.is_file() and not is_ours(path):
        raise UserError(
            f"{path}: exists and is not a steadytrain plot: it is left as it is; choose another path or move it away"
        )
    title = fig.axes[0].get_title() if fig.axes else ""
    meta = {"Software": MARK, "Title": one_line(title)}
    # zlib level 1: a quarter of the default's encoding time for files about a third larger (plots are flat colour)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI, metadata=meta, pil_kwargs=PNG_OPTIONS))
    return path


def _points(steps: list[int], values: list[Any]) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _mark_steps(ax: Any, steps: list[int], label: str, color: str, marker: str) -> None:
    """Markers along the bottom of the axes at ``steps`` (visible whatever the y range)."""
    if steps:
        ax.scatter(steps, [0.03] * len(steps), transform=ax.get_xaxis_transform(), color=color, marker=marker,
                   s=36, zorder=3, label=label, clip_on=False)  # fmt: skip


def best_eval(rec: RunRecord) -> dict | None:
    """The evaluation row with the lowest finite validation loss (the first of equals), or None."""
    finite = [r for r in rec.evals if r.get("val_loss") is not None]
    return min(finite, key=lambda r: r["val_loss"]) if finite else None


def applied_losses(rec: RunRecord) -> list[float | None]:
    """Each step's loss, None on a refused (skipped) step: its update was never applied, and a refused spike's
    loss (thousands of times the others) would flatten the curve and the smoothed loss (it is marked instead)."""
    return [None if r.get("skipped") else r.get("loss") for r in rec.metrics]


def loss_plot(rec: RunRecord, path: Path) -> Path:
    """:func:`loss_figure`, written to ``path``."""
    return _save(loss_figure(rec), path)


def loss_figure(rec: RunRecord) -> Any:
    """Raw and smoothed training loss; skipped (non-finite) steps, loss spikes, rollbacks and resumes marked; the
    validation loss beside it, its best step marked."""
    fig = _figure(fixed=True)
    ax = fig.add_subplot()
    steps, loss = rec.steps, applied_losses(rec)
    ax.plot(*_points(steps, loss), color="tab:blue", alpha=0.35, linewidth=1, label="loss (raw)")
    ax.plot(*_points(steps, smooth(loss)), color="tab:blue", linewidth=2, label="loss (smoothed)")
    spikes = set(rec.spikes)
    skipped = [r["step"] for r in rec.metrics if r.get("skipped") and r["step"] not in spikes]
    _mark_steps(ax, skipped, f"skipped non-finite step ({len(skipped)})", "tab:red", "x")
    _mark_steps(ax, sorted(spikes), f"loss spike ({len(spikes)})", "tab:purple", "^")
    _mark_restarts(ax, rec)
    if rec.evals:
        val = [r.get("val_loss") for r in rec.evals]
        ax.plot(*_points([r["step"] for r in rec.evals], val), color="tab:orange", marker="o", markersize=3,
                linewidth=2, label="validation loss")  # fmt: skip
        if (best := best_eval(rec)) is not None:
            ax.axvline(best["step"], color="tab:orange", linestyle=":", linewidth=1)
            label = f"best validation {best['val_loss']:.4g} (step {best['step']})"
            ax.plot([best["step"]], [best["val_loss"]], marker="*", markersize=12, color="tab:orange",
                    linestyle="none", label=label)  # fmt: skip
    title = "training and validation loss" if rec.evals else "training loss"
    ax.set(xlabel=STEP, ylabel="loss (mean per example)", title=f"{_label(rec.name)}: {title}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return fig


def _mark_restarts(ax: Any, rec: RunRecord) -> None:
    """Spike rollbacks (the steps trained again shaded, a dashed line at the step each went back from, labelled
    ``S→C``) and resumes (a dash-dotted line at each resume's step, from ``resumes.jsonl``)."""
    top = ax.get_xaxis_transform()
    for i, row in enumerate(rec.rollbacks):  # the steps trained again after going back
        ax.axvspan(row["rollback_to"], row["step"], color="tab:purple", alpha=0.12, linewidth=0,
                   label=f"rolled back ({len(rec.rollbacks)})" if i == 0 else None)  # fmt: skip
    if rec.rollbacks:
        ax.vlines([r["step"] for r in rec.rollbacks], 0, 1, transform=top, colors="tab:purple", linestyles="--",
                  linewidth=1, gid="rollbacks")  # fmt: skip
        for row in rec.rollbacks:
            ax.annotate(f"{row['step']}→{row['rollback_to']}", (row["step"], 0.97), xycoords=top, fontsize=7,
                        color="tab:purple", ha="right", va="top", rotation=90)  # fmt: skip
    if rec.resumes:
        ax.vlines([r["step"] for r in rec.resumes], 0, 1, transform=top, colors="0.3", linestyles="-.",
                  linewidth=1, label=f"resumed ({len(rec.resumes)})", gid="resumes")  # fmt: skip


def schedule_steps(total: int, warmup: int, points: int = PLANNED_POINTS) -> list[int]:
    """The steps at which to draw the planned schedule: every warmup step and the one after, then at most
    ``points`` more spread over the run (a plan of 10**12 steps is drawn as fast as one of 100).

    Example:
        >>> schedule_steps(6, 1), len(schedule_steps(10**12, 5))
        ([1, 2, 3, 4, 5, 6], 2005)
    """
    if total < 1:
        return []
    ramp = range(1, min(warmup + 1, total) + 1)
    n = min(total, points)
    spread = (1 + (total - 1) * i // max(n - 1, 1) for i in range(n))
    return sorted({*ramp, *spread}) if warmup <= points else sorted({*spread, warmup + 1})


def schedule_lrs(rec: RunRecord, steps: list[int]) -> list[float] | None:
    """The LR the plan's schedule gives each (1-based) optimizer step, when the plan has its numbers."""
    plan, batch = rec.plan, rec.config.get("batch") or {}
    if not isinstance(plan.get("lr"), int | float) or not plan.get("total_steps"):
        return None
    warmup, total = int(plan.get("warmup_steps") or 0), int(plan["total_steps"])
    decay, floor = batch.get("decay", "cosine"), float(batch.get("min_lr_ratio", 0.0))
    # Step s trains with the LR after s - 1 scheduler steps (the scheduler steps after the update).
    return [plan["lr"] * lr_multiplier(s - 1, warmup_steps=warmup, total_steps=total, decay=decay, min_lr_ratio=floor)
            for s in steps]  # fmt: skip


def lr_plot(rec: RunRecord, path: Path) -> Path:
    """The LR each step used, against the planned schedule; the end of warmup marked."""
    fig = _figure(fixed=True)
    ax = fig.add_subplot()
    steps = rec.steps
    where = schedule_steps(rec.plan.get("total_steps") or 0, rec.plan.get("warmup_steps") or 0)
    planned = schedule_lrs(rec, where)
    if planned:
        ax.plot(where, planned, color="0.75", linewidth=5, label="schedule (planned)")
    ax.plot(*_points(steps, rec.column("lr")), color="tab:green", linewidth=1.5, label="LR used")
    warmup = rec.plan.get("warmup_steps")
    if warmup:
        # Steps 1..warmup ramp up; step warmup + 1 is the first at the peak.
        ax.axvline(warmup + 1, color="tab:purple", linestyle=":", label=f"end of warmup: peak from step {warmup + 1}")
    peak = rec.plan.get("lr")
    ylabel = f"learning rate (peak {peak:.3g})" if isinstance(peak, int | float) else "learning rate"
    ax.set(xlabel=STEP, ylabel=ylabel, title=f"{_label(rec.name)}: learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def grad_norm_plot(rec: RunRecord, path: Path) -> Path:
    """Global gradient norm before clipping, the clip threshold, clipped and skipped steps marked."""
    fig = _figure(fixed=True)
    ax = fig.add_subplot()
    steps, norms = _points(rec.steps, rec.column("grad_norm"))
    ax.plot(steps, norms, color="tab:orange", linewidth=1.5, label="global grad norm (before clipping)")
    clipped = [(r["step"], r["grad_norm"]) for r in rec.metrics if r.get("clipped") and r.get("grad_norm") is not None]
    if clipped:
        ax.scatter(*zip(*clipped, strict=True), color="tab:red", s=18, zorder=3, label=f"clipped ({len(clipped)})")
    threshold = (rec.config.get("clip") or {}).get("max_grad_norm")
    if threshold:
        ax.axhline(threshold, color="black", linestyle="--", linewidth=1, label=f"clip threshold {threshold:g}")
    skipped = [r["step"] for r in rec.metrics if r.get("skipped")]
    _mark_steps(ax, skipped, f"skipped non-finite step ({len(skipped)})", "tab:red", "x")
    if norms and min(norms) > 0 and max(norms) / min(norms) > 100:
        ax.set_yscale("log")
    ax.set(xlabel=STEP, ylabel="global L2 norm of the gradient", title=f"{_label(rec.name)}: gradient norm")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def throughput_plot(rec: RunRecord, path: Path) -> Path:
    """Examples per second of each optimizer step: its own time, evaluation and checkpoints left out (``step_s``; a
    run written before steadytrain set that time aside shows a dip after each evaluation)."""
    fig = _figure(fixed=True)
    ax = fig.add_subplot()
    ax.plot(*_points(rec.steps, rec.column("items_per_s")), color="tab:cyan", linewidth=1.5, label="per step")
    ax.plot(*_points(rec.steps, smooth(rec.column("items_per_s"))), color="tab:blue", linewidth=2, label="smoothed")
    ax.set(xlabel=STEP, ylabel="throughput (examples / s, all ranks)", title=f"{_label(rec.name)}: training throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def compare_plot(a: RunRecord, b: RunRecord, first_divergent: int | None, path: Path) -> Path:
    """Both runs' losses overlaid, and their relative difference per step below; ``path`` is a new ``.png``
    file or a plot this module wrote (nothing else is replaced)."""
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot {brief(str(path))}: the plot is a PNG: name a .png file")
    fig = _figure((8.0, 6.0))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    top.plot(*_points(a.steps, a.column("loss")), color="tab:blue", linewidth=2, label=f"A: {_label(a.name)}")
    top.plot(*_points(b.steps, b.column("loss")), color="tab:orange", linestyle="--", linewidth=1.5,
             label=f"B: {_label(b.name)}")  # fmt: skip
    lb = dict(zip(b.steps, b.column("loss"), strict=True))
    rel = [
        (s, abs(x - lb[s]) / max(abs(x), abs(lb[s])))
        for s, x in zip(a.steps, a.column("loss"), strict=True)
        if x is not None and lb.get(s) is not None and x != lb[s]
    ]
    if rel:
        bottom.semilogy(*zip(*rel, strict=True), color="tab:red", marker=".", linewidth=1)
    else:
        bottom.text(0.5, 0.5, "losses identical at every common step", ha="center", va="center",
                    transform=bottom.transAxes)  # fmt: skip
    for ax in (top, bottom):
        if first_divergent is not None:
            label = f"first difference (step {first_divergent})"
            ax.axvline(first_divergent, color="tab:red", linestyle=":", label=label)
        ax.grid(alpha=0.3)
    top.set(ylabel="training loss (mean per example)", title=f"{_label(a.name)} vs {_label(b.name)}: training loss")
    top.legend(loc="upper right")
    bottom.set(xlabel=STEP, ylabel="relative difference\n|A − B| / max(|A|, |B|)")
    return _save(fig, path, ours_only=True)


def sweep_plot(trials: list[dict[str, Any]], estimate: float, title: str, path: Path) -> Path:
    """Final and smoothed loss against the LR (log axis), diverged trials marked, the estimate marked."""
    fig = _figure()
    ax = fig.add_subplot()
    ok = [t for t in trials if not t["diverged"] and t["smoothed_loss"] is not None]
    if ok:
        ax.plot([t["lr"] for t in ok], [t["smoothed_loss"] for t in ok], marker="o", linewidth=2,
                color="tab:blue", label="smoothed final loss")  # fmt: skip
        ax.scatter([t["lr"] for t in ok], [t["final_loss"] for t in ok], color="tab:blue", alpha=0.4,
                   label="final loss")  # fmt: skip
    for t in ok:
        ax.annotate(f"×{t['factor']:g}", (t["lr"], t["smoothed_loss"]), textcoords="offset points", xytext=(4, 6))
    if ok:
        best = min(ok, key=lambda t: t["smoothed_loss"])
        ax.scatter([best["lr"]], [best["smoothed_loss"]], marker="*", s=220, color="tab:green", zorder=4,
                   label=f"best: factor {best['factor']:g}")  # fmt: skip
    bad = [t for t in trials if t["diverged"]]
    _mark_steps(ax, [t["lr"] for t in bad], f"diverged ({len(bad)})", "tab:red", "x")
    ax.axvline(estimate, color="0.4", linestyle="--", label=f"linear-scaling estimate {estimate:.3g}")
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate (log scale)", ylabel="training loss at the last step", title=_label(title))
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best")
    return _save(fig, path, ours_only=True)
