"""A run directory read back: config, batch plan, environment, data record and per-step metrics.

Every command in :mod:`steadytrain.runs` starts here, so a missing or malformed file is one
:class:`~steadytrain.errors.UserError` naming it, never a traceback in a plot.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import load_json, one_line, present
from steadytrain._mapping import flatten
from steadytrain._yamlio import load_yaml
from steadytrain.diagnose import read_ledger
from steadytrain.diagnose.ledger import SPIKES
from steadytrain.env import EnvManifest
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, open_run_dir
from steadytrain.rundir.schema import (
    check_config,
    check_data,
    check_depth,
    check_plan,
    read_metrics,
    read_resumes,
)

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
    """The training rows of ``metrics.jsonl``, one per optimizer step."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The evaluation rows: ``step``, ``val_loss`` (None when not finite), ``val_items``."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """Spike rollbacks' rows: ``step``, ``rollback_to``, ``skipped_batches``."""
    spikes: list[int] = field(default_factory=list)
    """The optimizer step of each loss spike in ``spikes.jsonl``, in order (a step twice when a rollback's second
    try at it spiked too)."""
    resumes: list[dict[str, Any]] = field(default_factory=list)
    """``resumes.jsonl``: each resume's ``step``, ``world_size`` and ``changes`` (``{key: [old, new]}``)."""

    @property
    def name(self) -> str:
        """The directory's own name, also for ``.`` or ``runs/x/..`` (symlinks are not followed)."""
        return Path(os.path.abspath(self.run.path)).name or str(self.run.path)

    def column(self, key: str) -> list[Any]:
        """One metric per optimizer step (``None`` where it was not finite)."""
        return [row.get(key) for row in self.metrics]

    @property
    def steps(self) -> list[int]:
        return [int(row["step"]) for row in self.metrics]


def _object(path: Path, what: str) -> dict[str, Any] | None:
    if not present(path):
        return None
    value = load_json(path, what=what)
    if not isinstance(value, dict):
        raise UserError(f"{path}: a {what} is a JSON object, not {type(value).__name__}: restore the file")
    return value


def _env(path: Path) -> dict[str, Any] | None:
    """``env.json`` checked against the manifest's own schema (the diff walks every field)."""
    if not present(path):
        return None
    value = load_json(path, what="environment manifest")
    check_depth(value, str(path))
    try:
        return EnvManifest.from_dict(value, source=str(path)).to_dict()
    except UserError as err:
        raise UserError(f"{err}: restore env.json (or delete it: the environment then reads as unknown)") from None


def load_run(path: str | Path) -> RunRecord:
    """Read the run directory ``path``; every file is checked as it is read (see :mod:`._schema`).

    Raises:
        UserError: not a run directory, or one of its files is malformed (names the file, line and key).
    """
    run = open_run_dir(Path(path))
    config = load_yaml(run.config, what="run config") or {}
    if not isinstance(config, dict):
        raise UserError(f"{run.config}: a run config is a mapping of sections, not {type(config).__name__}")
    plan, data = _object(run.plan, "batch plan"), _object(run.data, "data record")
    rollbacks: list[dict[str, Any]] = []
    metrics, evals = read_metrics(run.metrics, rollbacks)
    return RunRecord(
        run=run,
        config=check_config(config, str(run.config)),
        plan=check_plan(plan, str(run.plan)) if plan is not None else {},
        env=_env(run.env),
        data=check_data(data, str(run.data)) if data is not None else None,
        metrics=metrics,
        evals=evals,
        rollbacks=rollbacks,
        spikes=[step for step, _ in sorted({(step, e.batch or 0) for step, e in read_ledger(run.path, SPIKES)})],
        resumes=read_resumes(run.resumes),
    )


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
