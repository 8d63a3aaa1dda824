"""What the hang watchdog and ``--auto-resume`` leave in a run, and their one checked reader each.

``hangs/step-NNNNNNNN/`` holds each rank's Python stacks (``rank-RRRRR.txt``) and rank 0's ``hang.json``:
``{"step", "stuck_ranks", "phase", "host", "frame", "ranks"}``. ``restarts.jsonl`` has one line per automatic
restart: ``{"step", "world_size_before", "world_size_after", "reason", "lost_s"}``. Every reader (``steadytrain
hangs``, the report, a restart naming its reason, a resume checking the run's logs) goes through
:func:`read_hang`, :func:`list_hangs` and :func:`read_restarts`: a wrong type, a negative or boolean step, a rank
that is not a number is one :class:`~steadytrain.errors.UserError` naming the file (and line), the key and the
value, so no sentence or terminal line downstream meets a value it cannot show.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from steadytrain._check import check_int, check_type
from steadytrain._io import brief, load_json, read_jsonl
from steadytrain.errors import UserError
from steadytrain.rundir.schema import KINDS, check_depth, check_fields
from steadytrain.schedule import MAX_COUNT

__all__ = [
    "HANG_FILE",
    "HANG_KEYS",
    "RESTART_KEYS",
    "check_hang",
    "check_restart",
    "hang_dir",
    "list_hangs",
    "ranks_text",
    "read_hang",
    "read_restarts",
    "stack_file",
]

HANG_FILE = "hang.json"
HANG_KEYS = ("step", "stuck_ranks", "phase", "host", "frame")
RESTART_KEYS = ("step", "world_size_before", "world_size_after", "reason", "lost_s")
HANG_FIX = "not a hang record the watchdog wrote (damaged? edited by hand?): restore it or move it away"
RESTART_FIX = "the restart record is damaged (edited by hand?): correct or remove that line"
_STEP_DIR = re.compile(r"step-(\d{1,16})")
_STACKS = re.compile(r"rank-\d+\.txt")


def _ranks(name: str, value: Any) -> list[int]:
    ranks = check_type(name, value, list)
    if not ranks:
        raise UserError(f"{name}=[] names no rank: a hang has at least one stuck rank")
    return [check_int(f"{name}[{i}]", r, 0, maximum=MAX_COUNT) for i, r in enumerate(ranks)]


_KINDS = {**KINDS, "ranks": _ranks}
HANG: dict[str, tuple[str, bool]] = {
    "step": ("positive", False),
    "stuck_ranks": ("ranks", False),
    "phase": ("text", False),
    "host": ("text", True),
    "frame": ("text", True),
}
RESTART: dict[str, tuple[str, bool]] = {
    "step": ("count", False),
    "world_size_before": ("positive", True),
    "world_size_after": ("positive", False),
    "reason": ("text", False),
    "lost_s": ("nonnegative", False),
}


def ranks_text(ranks: list[int], shown: int = 16) -> str:
    """A hang's stuck ranks for a line or a sentence, bounded: the first ``shown``, then how many more (a record of
    20,000 stuck ranks stays a short line; ``--json`` and ``hang.json`` have them all).

    Example:
        >>> ranks_text([1, 2]), ranks_text(list(range(20)), 3)
        ('1, 2', '0, 1, 2 and 17 more')
    """
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return ", ".join(str(r) for r in ranks[:shown]) + more


def hang_dir(run: Path, step: int) -> Path:
    """Where the watchdog writes what it found about the hang at optimizer ``step`` (``run``: the run directory)."""
    return Path(run) / "hangs" / f"step-{step:08d}"


def stack_file(where: Path, rank: int) -> Path:
    """Rank ``rank``'s Python stacks in the hang folder ``where``."""
    return where / f"rank-{rank:05d}.txt"


def check_hang(record: Any, where: str) -> dict[str, Any]:
    """``hang.json``: every key of :data:`HANG_KEYS` present and typed (``host`` and ``frame`` may be null);
    ``ranks`` (each rank's report), when there, a mapping."""
    check_depth(record, where)
    if not isinstance(record, dict):
        raise UserError(f"{where}: {brief(record)} is not a hang record (a JSON object); {HANG_FIX}")
    check_fields(record, HANG, where, HANG_FIX, required=True, kinds=_KINDS)
    check_fields(record, {"ranks": ("mapping", True)}, where, HANG_FIX)
    return record


def check_restart(row: Any, where: str) -> dict[str, Any]:
    """One line of ``restarts.jsonl``: every key of :data:`RESTART_KEYS` present and typed (``world_size_before``
    may be null: a run without a plan)."""
    check_depth(row, where)
    if not isinstance(row, dict):
        raise UserError(f"{where}: {brief(row)} is not a restart record (a JSON object); {RESTART_FIX}")
    check_fields(row, RESTART, where, RESTART_FIX, required=True)
    return row


def read_hang(path: Path) -> dict[str, Any]:
    """One ``hang.json``, checked."""
    return check_hang(load_json(path, what="hang record"), str(path))


def list_hangs(hangs: Path) -> list[dict[str, Any]]:
    """Every hang folder under ``hangs`` (``RUN/hangs``), by step: :data:`HANG_KEYS`, ``dir`` and ``stacks`` (the
    names of the ranks' stack files). A folder with stacks and no ``hang.json`` (rank 0 died before writing it)
    is listed with its step and stacks, the other keys None; a folder with neither is not a hang."""
    if not hangs.exists() and not hangs.is_symlink():
        return []
    if not hangs.is_dir():
        raise UserError(f"{hangs}: not a directory (the hang watchdog writes a folder per hang there): move it away")
    found = []
    for folder in hangs.iterdir():
        if not (m := _STEP_DIR.fullmatch(folder.name)) or not folder.is_dir():
            continue
        stacks = sorted(p.name for p in folder.iterdir() if _STACKS.fullmatch(p.name))
        record = folder / HANG_FILE
        if record.exists() or record.is_symlink():
            hang = {k: v for k, v in read_hang(record).items() if k in HANG_KEYS}
            if hang["step"] != int(m.group(1)):
                raise UserError(f"{record}: step={hang['step']} is not its folder's step ({folder.name}); {HANG_FIX}")
        elif stacks:
            hang = dict.fromkeys(HANG_KEYS) | {"step": int(m.group(1))}
        else:
            continue
        found.append(hang | {"dir": str(folder), "stacks": stacks})
    return sorted(found, key=lambda h: (h["step"], h["dir"]))


def read_restarts(path: Path) -> list[dict[str, Any]]:
    """Every line of ``restarts.jsonl`` (none when the run never restarted; a torn last line skipped), checked."""
    return [check_restart(row, f"{path}: line {n}") for n, row in read_jsonl(path, what="restart record")]
