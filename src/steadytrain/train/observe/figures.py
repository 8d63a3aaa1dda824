"""A run's throughput figures from its ``metrics.jsonl`` rows: what ``summary.md`` says of them.

Plain numbers in, plain numbers out (no torch): ``steadytrain report`` reads a finished run with these, and
:mod:`~steadytrain.train.observe.throughput` (which measures them during the run) exports them too.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["describe", "summarize"]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The run's figures from its training rows: median ``tokens_per_s``, ``flops_per_step`` (over all ranks),
    mean and median ``mfu``, the largest ``peak_mem_mb``; the first row (startup, the FLOP count) left out of the
    rates when there are others. Only the figures the rows hold."""

    def column(key: str, rows: list[dict[str, Any]]) -> list[float]:
        return [r[key] for r in rows if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]

    timed = rows[1:] if len(rows) > 1 else rows
    per_step = [
        r["flops_per_s"] / r["items_per_s"] * r["items"]
        for r in timed
        if all(isinstance(r.get(k), int | float) for k in ("flops_per_s", "items", "items_per_s")) and r["items_per_s"]
    ]
    mfu = column("mfu", timed)
    out = {
        "tokens_per_s": _median(column("tokens_per_s", timed)),
        "flops_per_step": _median(per_step),
        "mfu_mean": sum(mfu) / len(mfu) if mfu else None,
        "mfu_median": _median(mfu),
        "peak_mem_mb": max(column("peak_mem_mb", rows), default=None),
    }
    return {k: v for k, v in out.items() if v is not None}


def describe(figures: dict[str, Any]) -> str | None:
    """One line of :func:`summarize`'s figures for ``summary.md``; None when it has none."""
    parts = []
    if figures.get("tokens_per_s") is not None:
        parts.append(f"median {figures['tokens_per_s']:.4g} tokens/s")
    if figures.get("flops_per_step") is not None:
        parts.append(f"{figures['flops_per_step']:.4g} FLOPs per optimizer step (forward + backward, all ranks)")
    if figures.get("mfu_mean") is not None:
        parts.append(f"MFU mean {figures['mfu_mean']:.2%}, median {figures['mfu_median']:.2%}")
    if figures.get("peak_mem_mb") is not None:
        parts.append(f"peak memory {figures['peak_mem_mb']:.0f} MiB (rank 0)")
    return "; ".join(parts) or None
