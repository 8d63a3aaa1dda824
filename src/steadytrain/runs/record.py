"""A run directory read back: config, batch plan, environment, data record and per-step metrics.

Every command in :mod:`steadytrain.runs` starts here, so a missing or malformed file is one
:class:`~steadytrain.errors.UserError` naming it, never a traceback in a plot.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import brief, load_json, load_yaml, one_line, read_text
from steadytrain.errors import UserError
from steadytrain.train.rundir import RunDir, open_run_dir

__all__ = ["RunRecord", "flatten", "load_run", "shown", "smooth"]


@dataclass
class RunRecord:
    """What one run directory holds, as plain data."""

    run: RunDir
    config: dict[str, Any]
    plan: dict[str, Any]
    env: dict[str, Any] | None
    """``env.json`` (rank 0's manifest); ``None`` when absent."""
    data: dict[str, Any] | None
    """``data.json`` (fingerprint and provenance of the data the run saw); ``None`` for older runs."""
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.run.path.name

    def column(self, key: str) -> list[Any]:
        """One metric per optimizer step (``None`` where it was not finite)."""
        return [row.get(key) for row in self.metrics]

    @property
    def steps(self) -> list[int]:
        return [int(row["step"]) for row in self.metrics]


def _metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(read_text(path, what="metrics log").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{n}: not a JSON line ({err.msg}): the metrics log is damaged") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path}:{n}: {brief(row)} has no integer 'step': the metrics log is damaged")
        rows.append(row)
    return rows


def _optional_json(path: Path, what: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    value = load_json(path, what=what)
    if not isinstance(value, dict):
        raise UserError(f"{path}: a {what} is a JSON object, not {type(value).__name__}")
    return value


def load_run(path: str | Path) -> RunRecord:
    """Read the run directory ``path``.

    Raises:
        UserError: not a run directory, or one of its files is malformed (names the file).
    """
    run = open_run_dir(Path(path))
    config = load_yaml(run.config, what="run config") or {}
    if not isinstance(config, dict):
        raise UserError(f"{run.config}: a run config is a mapping of sections, not {type(config).__name__}")
    return RunRecord(
        run=run,
        config=config,
        plan=_optional_json(run.plan, "batch plan") or {},
        env=_optional_json(run.env, "environment manifest"),
        data=_optional_json(run.path / "data.json", "data record"),
        metrics=_metrics(run.metrics),
    )


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b": leaf}`` (lists are leaves).

    Example:
        >>> flatten({"batch": {"base_lr": 0.01, "betas": [0.9, 0.95]}, "precision": "fp32"})
        {'batch.base_lr': 0.01, 'batch.betas': [0.9, 0.95], 'precision': 'fp32'}
    """
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, child in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(child, dict) and child:
            out.update(flatten(child, name))
        else:
            out[name] = child
    return out


def smooth(values: list[float | None]) -> list[float | None]:
    """A debiased exponential moving average over the finite values (``None`` stays ``None``).

    The span is a tenth of the series (1 to 50 steps), so a short run is barely smoothed and a long
    one loses its step-to-step noise; debiasing (as in Adam) keeps the first values unshrunk.

    Example:
        >>> smooth([4.0, None, 2.0])
        [4.0, None, 2.0]
    """
    span = max(1, min(50, len(values) // 10))
    beta = 1.0 - 2.0 / (span + 1)
    out: list[float | None] = []
    avg, weight = 0.0, 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        avg = beta * avg + (1 - beta) * v
        weight = beta * weight + (1 - beta)
        out.append(avg / weight)
    return out


def shown(value: Any) -> str:
    """A value inside a sentence: ``none`` for a missing one (no GPU: no driver), always one line.

    Example:
        >>> shown(None), shown("535.104.05")
        ('none', '535.104.05')
    """
    return "none" if value is None else one_line(value)
