"""``steadytrain layers RUN [--step S]``: one monitored step's per-layer norms, from ``RUN/layers.jsonl``.

The rows are read and checked by :func:`steadytrain.diagnose.layers.read_layers`; this module picks the step
and lays the table out. A run that recorded no layer norms is not an error (the recording is a setting), a step
without rows is: the message names the nearest steps that have them.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from steadytrain._text import short
from steadytrain.diagnose.layers import LAYERS, NORMS, by_step, read_layers
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir

__all__ = ["NONE_RECORDED", "layer_step", "table_lines"]

NONE_RECORDED = "no layer norms recorded (monitor.layers: off, or monitor.every_steps more than the steps run?)"
"""What a run without ``layers.jsonl`` (or with an empty one) is told."""
_HEADER = ("layer", "grad norm", "param norm", "update norm", "update ratio")


def _nearest(steps: list[int], step: int) -> str:
    """The steps with rows closest to ``step`` below and above it, in words."""
    i = bisect.bisect_left(steps, step)
    near = [s for s in (steps[i - 1] if i else None, steps[i] if i < len(steps) else None) if s is not None]
    return " and ".join(str(s) for s in near)


def layer_step(run_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """``{"step": S, "layers": [rows]}``: the rows of monitored step ``step`` (default: the last step with rows) in
    file order; a step trained twice (a spike rolled back, then the step again) has both tries' rows, the
    rolled-back one's with ``rollback``. ``{"step": None, "layers": []}`` when the run recorded no layer norms.

    Raises:
        UserError: not a run directory, a damaged ``layers.jsonl`` (names ``file:line``), or a ``step`` without
            rows (names the nearest steps that have them).
    """
    run = open_run_dir(Path(run_dir))
    rows = by_step(read_layers(run.path))
    if not rows:
        return {"step": None, "layers": []}
    steps = sorted(rows)
    if step is None:
        step = steps[-1]
    if step not in rows:
        raise UserError(
            f"--step {step}: {LAYERS} has no rows for step {step} (layer norms are recorded every "
            f"monitor.every_steps and at every refused step); the nearest steps with rows: {_nearest(steps, step)}"
        )
    return {"step": step, "layers": rows[step]}


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def table_lines(found: dict[str, Any]) -> list[str]:
    """The text of :func:`layer_step`'s answer: a heading, one line per layer (a rolled-back try of the step under
    a heading of its own), and what ``n/a`` means when it appears. A name longer than
    :data:`~steadytrain._text.SHORT` characters is shortened in the middle, as the plots shorten it (``--json`` has
    it whole).

    Example:
        >>> print("\\n".join(table_lines({"step": 3, "layers": [
        ...     {"step": 3, "layer": "head", "grad_norm": 0.5, "param_norm": 2.0, "update_norm": None,
        ...      "update_ratio": None}]})))
        step 3: 1 layer(s)
          layer  grad norm  param norm  update norm  update ratio
          head         0.5           2          n/a           n/a
        n/a: not finite, or no update applied (a refused step)
    """
    if found["step"] is None:
        return [NONE_RECORDED]
    rows = found["layers"]
    names = [short(r["layer"]) for r in rows]  # a 200 KB name would pad every row
    width = max(len(_HEADER[0]), *map(len, names))
    cols = [len(h) for h in _HEADER[1:]]
    lines, current = [], object()
    for row, name in zip(rows, names, strict=True):
        if row.get("rollback") != current:
            current = row.get("rollback")
            count = sum(1 for r in rows if r.get("rollback") == current)
            tried = f" (the try rolled back: rollback {current})" if current is not None else ""
            again = " (trained again)" if current is None and any("rollback" in r for r in rows) else ""
            lines.append(f"step {found['step']}{tried}{again}: {count} layer(s)")
            lines.append("  " + "  ".join([_HEADER[0].ljust(width), *_HEADER[1:]]))
        cells = [_number(row[k]).rjust(w) for k, w in zip(NORMS, cols, strict=True)]
        lines.append("  " + "  ".join([name.ljust(width), *cells]))
    if any(r[k] is None for r in rows for k in NORMS):
        lines.append("n/a: not finite, or no update applied (a refused step)")
    return lines
