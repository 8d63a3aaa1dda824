"""What the hang watchdog found in a run, and the restarts it took: ``RUN/hangs/*/hang.json``, ``restarts.jsonl``.

Read for ``steadytrain hangs RUN`` and for the report; each record is checked (a damaged one is one error naming
the file), never trusted blindly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain._io import load_json, read_jsonl
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, open_run_dir

__all__ = ["HANG_KEYS", "read_hangs", "read_restarts"]

HANG_KEYS = ("step", "stuck_ranks", "phase", "host", "frame")


def read_hangs(run_dir: Path) -> list[dict[str, Any]]:
    """Every hang of the run, oldest first: ``step``, ``stuck_ranks``, ``phase``, ``host``, ``frame`` and
    ``dir`` (the folder holding each rank's stacks)."""
    run = open_run_dir(run_dir)
    found = []
    for path in sorted(run.hangs.glob("step-*/hang.json")) if run.hangs.is_dir() else []:
        record = load_json(path, what="hang record")
        if not isinstance(record, dict) or any(k not in record for k in HANG_KEYS):
            raise UserError(f"{path}: not a hang record (it needs {', '.join(HANG_KEYS)})")
        if not isinstance(record["step"], int) or not isinstance(record["stuck_ranks"], list):
            raise UserError(f"{path}: step must be a number and stuck_ranks a list")
        found.append({k: record[k] for k in HANG_KEYS} | {"dir": str(path.parent)})
    return found


def read_restarts(run: RunDir) -> list[dict[str, Any]]:
    """``restarts.jsonl``'s rows (none when the run never restarted)."""
    if not run.restarts.exists():
        return []
    rows = []
    for line, row in read_jsonl(run.restarts, what="restarts.jsonl"):
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{run.restarts}:{line}: not a restart record")
        rows.append(row)
    return rows
