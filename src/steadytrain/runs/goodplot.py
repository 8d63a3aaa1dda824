"""``plots/goodput.png``: one stacked bar per attempt, its wall time split into productive time and each cause."""

from __future__ import annotations

from pathlib import Path

from steadytrain.rundir.timeline import CAUSES
from steadytrain.runs.goodput import Account, duration
from steadytrain.runs.plots import _figure, _label, _save

__all__ = ["goodput_plot"]

_PALETTE = ("#2ca02c", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#aec7e8", "#9467bd", "#d62728", "#ff9896",
            "#8c564b", "#e377c2", "#ff7f0e", "#c7c7c7")  # fmt: skip
_COLORS = dict(zip(("productive", *CAUSES), _PALETTE, strict=True))


def goodput_plot(account: Account, name: str, path: Path) -> Path | None:
    """Draw the attempts' accounts (None: no time recorded)."""
    if not account.attempts or account.wall_s <= 0:
        return None
    fig = _figure((8.0, 1.6 + 0.45 * len(account.attempts)))
    ax = fig.add_subplot()
    labels = [f"attempt {a['attempt']} ({a['how']})" for a in account.attempts]
    left = [0.0] * len(account.attempts)
    for part in ("productive", *CAUSES):
        widths = [a["productive_s"] if part == "productive" else a["badput"].get(part, 0.0) for a in account.attempts]
        if not any(w > 0 for w in widths):
            continue
        ax.barh(labels, widths, left=left, color=_COLORS[part], label=part)
        left = [x + w for x, w in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds (wall time, gaps between attempts included)")
    share = f"{account.goodput:.1%}" if account.goodput is not None else "n/a"
    ax.set_title(f"{_label(name)}: goodput {share} of {duration(account.wall_s)}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize="small", frameon=False)
    return _save(fig, path)
