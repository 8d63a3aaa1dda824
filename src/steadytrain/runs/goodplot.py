"""``plots/goodput.png``: one stacked bar per attempt, its wall time split into productive time and each cause.

A run of many attempts (a crash loop, weeks of requeues) keeps a picture's height: past :data:`BARS` attempts, the
first and the last are drawn one by one and those between as one bar of their sums.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain.rundir.timeline import CAUSES
from steadytrain.runs.goodput import Account, duration
from steadytrain.runs.plots import _figure, _label, _save

__all__ = ["BARS", "goodput_plot"]

BARS = 30
"""The most bars drawn, whatever the number of attempts."""
_PALETTE = ("#2ca02c", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#aec7e8", "#9467bd", "#d62728", "#ff9896",
            "#8c564b", "#e377c2", "#ff7f0e", "#c7c7c7")  # fmt: skip
_COLORS = dict(zip(("productive", *CAUSES), _PALETTE, strict=True))


def goodput_plot(account: Account, name: str, path: Path) -> Path | None:
    """Draw the attempts' accounts (None: no time recorded)."""
    if not account.attempts or account.wall_s <= 0:
        return None
    bars = _bars(account.attempts)
    fig = _figure((8.0, 1.6 + 0.45 * len(bars)))
    ax = fig.add_subplot()
    labels = [_label(label) for label, _ in bars]
    left = [0.0] * len(bars)
    for part in ("productive", *CAUSES):
        widths = [a["productive_s"] if part == "productive" else a["badput"].get(part, 0.0) for _, a in bars]
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


def _bars(attempts: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, account)`` of each bar: every attempt, or past :data:`BARS` the first and last ones and one bar
    summing those between."""
    if len(attempts) <= BARS:
        return [(f"attempt {a['attempt']} ({a['how']})", a) for a in attempts]
    head, tail = attempts[: BARS // 2], attempts[len(attempts) - (BARS - BARS // 2 - 1) :]
    middle = attempts[len(head) : len(attempts) - len(tail)]
    summed = {
        "productive_s": sum(a["productive_s"] for a in middle),
        "badput": {c: sum(a["badput"].get(c, 0.0) for a in middle) for c in CAUSES},
    }
    label = f"attempts {middle[0]['attempt']}-{middle[-1]['attempt']} ({len(middle)}, summed)"
    return [*_bars(head), (label, summed), *_bars(tail)]
