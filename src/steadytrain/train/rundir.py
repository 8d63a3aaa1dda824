"""The run directory: what a run leaves behind, and the rule that one is never overwritten.

``runs/<name>/`` holds ``config.yaml`` (resolved), ``plan.json`` (the batch plan's numbers),
``env.json`` (rank 0's manifest; ``env.ranks.json`` when ranks differ), ``data.json`` (the data's
fingerprint and provenance), ``metrics.jsonl`` (one line
per optimizer step), ``nonfinite.jsonl`` (one line per rank per refused step), ``exposure.json``
(examples seen per shard), ``checkpoints/``, ``plots/`` and ``summary.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from steadytrain._io import write_text_atomic
from steadytrain.errors import UserError

__all__ = ["RunDir", "claim_run_dir", "open_run_dir"]


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    config = property(lambda self: self.path / "config.yaml")
    plan = property(lambda self: self.path / "plan.json")
    env = property(lambda self: self.path / "env.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    nonfinite = property(lambda self: self.path / "nonfinite.jsonl")
    exposure = property(lambda self: self.path / "exposure.json")
    data = property(lambda self: self.path / "data.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    summary = property(lambda self: self.path / "summary.md")

    def write_json(self, path: Path, data: Any) -> None:
        write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")

    def write_config(self, config: dict[str, Any]) -> None:
        write_text_atomic(self.config, yaml.safe_dump(config, sort_keys=False, allow_unicode=True))


def claim_run_dir(path: Path) -> RunDir:
    """Create a new run directory; an existing one is never overwritten (one ``mkdir`` decides, also
    between two processes started at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        raise UserError(
            f"run directory {path} exists: resume it with --resume {path}, or choose another run.name or --run-dir"
        ) from None
    except NotADirectoryError:
        raise UserError(f"run directory {path}: a parent is a file, not a directory") from None
    run = RunDir(path)
    run.checkpoints.mkdir()
    return run


def open_run_dir(path: Path) -> RunDir:
    """An existing run directory (for resume, report, compare); a UserError if it is not one."""
    run = RunDir(Path(path))
    if not run.path.is_dir():
        raise UserError(f"{path}: no such run directory")
    if not run.config.is_file():
        raise UserError(f"{path}: not a steadytrain run directory (no config.yaml)")
    return run
