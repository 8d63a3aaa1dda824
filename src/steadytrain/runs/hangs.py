"""What the hang watchdog found in a run, and the restarts it took: ``RUN/hangs/*/hang.json``, ``restarts.jsonl``.

Read for ``steadytrain hangs RUN`` and for the report through the checked readers of
:mod:`steadytrain.rundir.hangs` (a damaged record is one error naming the file and line, never trusted blindly);
:func:`hang_lines` shows them on a terminal, every value on its line (escaped) and bounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steadytrain._text import one_line, short
from steadytrain.rundir import hangs as records
from steadytrain.rundir.layout import RunDir, open_run_dir

__all__ = ["FRAME_CHARS", "HANG_KEYS", "hang_lines", "read_hangs", "read_restarts"]

HANG_KEYS = records.HANG_KEYS
FRAME_CHARS = 300
"""The most characters of a frame ``hangs`` prints (``--json`` and the stack files have it whole)."""


def read_hangs(run_dir: Path) -> list[dict[str, Any]]:
    """Every hang of the run, by step: ``step``, ``stuck_ranks``, ``phase``, ``host``, ``frame``, ``dir`` (the
    folder holding each rank's stacks) and ``stacks`` (their file names). A hang whose ``hang.json`` is missing
    (rank 0 died before writing it) has only its step, folder and stacks; the other keys are None."""
    return records.list_hangs(open_run_dir(run_dir).hangs)


def read_restarts(run: RunDir) -> list[dict[str, Any]]:
    """``restarts.jsonl``'s rows, checked (none when the run never restarted)."""
    return records.read_restarts(run.restarts)


def hang_lines(run_dir: str, found: list[dict[str, Any]]) -> list[str]:
    """``steadytrain hangs``'s lines: per hang its step, stuck ranks, phase, host, innermost frame and stacks."""
    if not found:
        return [f"{one_line(run_dir)}: no hang recorded"]
    out = []
    for h in found:
        if h["stuck_ranks"] is None:
            out.append(f"step {h['step']}: no {records.HANG_FILE} (rank 0 stopped before writing it): see the stacks")
        else:
            ranks = records.ranks_text(h["stuck_ranks"])
            host = "an unknown host" if h["host"] is None else short(h["host"])
            frame = "an unknown frame (the rank did not report)" if h["frame"] is None else _frame(h["frame"])
            out += [f"step {h['step']}: rank(s) {ranks} stuck in {short(h['phase'])} on {host}", f"  at {frame}"]
        out.append(f"  stacks: {one_line(h['dir'])}{_files(h['stacks'])}")
    return out


def _files(names: list[str], shown: int = 4) -> str:
    if not names:
        return " (no stack file)"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f" ({', '.join(map(one_line, names[:shown]))}{more})"


def _frame(frame: str) -> str:
    text = one_line(frame)
    if len(text) <= FRAME_CHARS:
        return text
    return f"{short(text, FRAME_CHARS)} ({len(frame)} characters: the stack files and --json have it whole)"
