"""``RUN/timeline.jsonl``: every attempt's clock, the file ``steadytrain goodput`` reads.

Each attempt of a run (the first start, each resume, restart or requeue) appends lines to the same file, never
rewrites it (a resume cuts ``metrics.jsonl`` back to its checkpoint; the time spent past it is what this file
keeps). One line is ``{"attempt", "event", "t", "step", "seconds"}``: ``attempt`` names the attempt (its process,
host and start), ``event`` is ``start`` (written when the attempt's first step begins; it adds ``started_at``, the
process's start, ``resumed_at``, the step it resumed from or null, ``world_size`` and ``compiled``), ``interval`` (with
each logging interval's metrics rows), ``checkpoint`` (at each save) or ``end`` (it adds ``how``: ``finished``,
``stopped``, ``failed`` or ``hang``). ``t`` is the wall clock (seconds since the epoch) when the line was written,
``step`` the optimizer steps done, and ``seconds`` the attempt's time so far by cause (:data:`CAUSES`, ``train``:
the time of the steps it trained, before what a later restart throws away), measured on one monotonic clock
per attempt.

The reader is lenient by design: a line that cannot be read (a kill mid-write, a hand edit) is left out with a note
saying where, never a reason to lose the rest of the account.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import present, read_log_bytes

__all__ = ["CAUSES", "EVENTS", "TIMELINE", "Attempt", "read_timeline", "seal"]

TIMELINE = "timeline.jsonl"
CAUSES = (
    "startup",
    "compile",
    "data_wait",
    "checkpoint_save",
    "checkpoint_restore",
    "evaluation",
    "lost_progress",
    "skipped_steps",
    "restart_gap",
    "hang",
    "straggler",
    "other",
)
"""Where a run's time went besides the steps that count, in the order the account lists them."""
EVENTS = ("start", "interval", "checkpoint", "end")
HOWS = ("finished", "stopped", "failed", "hang")


@dataclass
class Attempt:
    """One attempt as its lines tell it: the first line's fields, and the lines in order."""

    name: str
    lines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def start(self) -> dict[str, Any] | None:
        return next((line for line in self.lines if line["event"] == "start"), None)

    @property
    def last(self) -> dict[str, Any]:
        return self.lines[-1]


def seal(path: Path) -> None:
    """Before an attempt appends: a last line an earlier attempt was killed writing gets its newline, so it stays
    one damaged line (the reader notes it) instead of swallowing the first new one."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            whole = f.read(1) == b"\n"
    except FileNotFoundError:
        return
    if not whole:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)


def read_timeline(path: Path) -> tuple[list[Attempt], list[str]]:
    """The attempts in the order they started, and notes on every line left out (and why)."""
    if not present(path):
        return [], []
    attempts: dict[str, Attempt] = {}
    notes: list[str] = []
    for n, raw in enumerate(read_log_bytes(path, what="timeline").split(b"\n"), start=1):
        if not raw.strip():
            continue
        line, why = _line(raw)
        if line is None:
            notes.append(f"{path.name} line {n}: {why}: left out")
            continue
        attempts.setdefault(line["attempt"], Attempt(line["attempt"])).lines.append(line)
    return list(attempts.values()), notes


def _line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    try:
        line = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError):
        return None, "cut short or not JSON (an attempt killed while writing it?)"
    if not isinstance(line, dict):
        return None, "not a JSON object"
    if not isinstance(line.get("attempt"), str) or line.get("event") not in EVENTS:
        return None, "no attempt name or an unknown event"
    if not _number(line.get("t")) or not _count(line.get("step")):
        return None, "its time or step is not a number"
    seconds = line.get("seconds")
    if not isinstance(seconds, dict) or not all(
        isinstance(k, str) and _number(v) and v >= 0 for k, v in seconds.items()
    ):
        return None, "its seconds are not a mapping of causes to non-negative numbers"
    if line["event"] == "start" and not (_number(line.get("started_at")) and _optional_count(line.get("resumed_at"))):
        return None, "a start line without its process start or its resume step"
    return line, ""


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _optional_count(x: Any) -> bool:
    return x is None or _count(x)
