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
saying where, never a reason to lose the rest of the account. So is a line that does not fit its attempt's
others: one after the attempt's end line, a start line after its other lines, a time that goes back (one monotonic
clock per attempt), and every line under a name that started twice (two attempts under one name, a file appended
to itself: whose line is whose cannot be told). Numbers are bounded (times and durations to the year 10000, steps
to 2**63), so no account is infinite.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import present, read_log_bytes
from steadytrain._text import short

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
_LATEST = 253402300800
"""Seconds since the epoch of the year 10000: a wall-clock reading or a duration past it is damage."""
_MAX_STEP = 2**63 - 1
_LONGEST = 64 * 1024
"""Bytes: an attempt's lines are under 2 KB (its name, a dozen causes); a longer line is damage, left unparsed."""
_LISTED = 20
"""Left-out lines noted one by one; those after them are counted in one note."""


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
    one damaged line (the reader notes it) instead of swallowing the first new one. Anything but a regular file
    (a FIFO, a device, a directory) is an ``OSError`` at once, never a wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file: the attempt's clock cannot be appended to it", str(path))
        whole = st.st_size == 0 or os.pread(fd, 1, st.st_size - 1) == b"\n"
    finally:
        os.close(fd)
    if not whole:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)


def read_timeline(path: Path) -> tuple[list[Attempt], list[str]]:
    """The attempts in the order they started, and notes on every line left out (and why): the first
    :data:`_LISTED` one by one, the rest counted in one note."""
    if not present(path):
        return [], []
    reader = _Reader(path.name)
    for n, raw in enumerate(read_log_bytes(path, what="timeline").split(b"\n"), start=1):
        if raw.strip():
            reader.add(n, raw)
    return list(reader.attempts.values()), reader.all_notes()


@dataclass
class _Reader:
    """The lines read so far, by attempt; a line that does not fit its attempt's others is left out, noted."""

    file: str
    attempts: dict[str, Attempt] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)
    twice: dict[str, int] = field(default_factory=dict)
    """Attempt names with a second start line, and its line: which attempt wrote their later lines is unknown."""
    more: Counter[str] = field(default_factory=Counter)
    span: list[int] = field(default_factory=list)

    def add(self, n: int, raw: bytes) -> None:
        line, why = _line(raw)
        if line is None:
            return self._leave(n, why)
        why, kind = self._misfit(n, line)
        if why:
            return self._leave(n, why, kind)
        name = line["attempt"]
        self.attempts.setdefault(name, Attempt(name)).lines.append(line)
        if line["event"] == "end":
            self.ended.add(name)
        return None

    def _misfit(self, n: int, line: dict[str, Any]) -> tuple[str, str]:
        """Why ``line`` cannot be its attempt's next (and the kind of reason), or ``("", "")``."""
        name = line["attempt"]
        if name in self.twice:
            kind = "its attempt's name started twice"
            return f"attempt {short(name)} started twice (line {self.twice[name]}): whose line this is is unknown", kind
        attempt = self.attempts.get(name)
        if attempt is None:
            return "", ""
        if name in self.ended:
            return "after its attempt's end line", "after its attempt's end line"
        if line["event"] == "start" and attempt.start is not None:
            self.twice[name] = n
            why = f"a second start line for attempt {short(name)} (two attempts under one name?): it and the name's"
            return why + " later lines", "its attempt's name started twice"
        if line["event"] == "start":
            return "a start line after its attempt's other lines", "out of order"
        if line["t"] < attempt.last["t"]:
            back = attempt.last["t"] - line["t"]
            return (
                f"its time goes back {back:.3f} s from its attempt's line before (one clock per attempt)",
                "out of order",
            )
        return "", ""

    def _leave(self, n: int, why: str, kind: str = "") -> None:
        if len(self.notes) < _LISTED:
            self.notes.append(f"{self.file} line {n}: {why}: left out")
            return
        self.more[kind or why] += 1
        self.span = [self.span[0] if self.span else n, n]

    def all_notes(self) -> list[str]:
        if not self.more:
            return self.notes
        count = sum(self.more.values())
        kinds = "; ".join(f"{k}: {c}" for k, c in self.more.most_common(3)) + ("; ..." if len(self.more) > 3 else "")
        first, last = self.span
        lines = "line" if count == 1 else "lines"
        return [*self.notes, f"{self.file} lines {first} to {last}: {count} more {lines} left out ({kinds})"]


def _line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    if len(raw) > _LONGEST:
        return None, f"longer than any line an attempt writes (over {_LONGEST} bytes)"
    try:
        line = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError):
        return None, "cut short or not JSON (an attempt killed while writing it?)"
    if not isinstance(line, dict):
        return None, "not a JSON object"
    if not isinstance(line.get("attempt"), str) or line.get("event") not in EVENTS:
        return None, "no attempt name or an unknown event"
    if not _number(line.get("t")) or not _count(line.get("step")):
        return None, "its time or step is not a number in range"
    seconds = line.get("seconds")
    if not isinstance(seconds, dict) or not all(isinstance(k, str) and _number(v) for k, v in seconds.items()):
        return None, "its seconds are not a mapping of causes to non-negative numbers in range"
    if line["event"] == "start":
        return _start(line)
    if line["event"] == "end" and (not isinstance(line.get("how"), str) or line["how"] not in HOWS):
        return None, f"an end line whose how is not one of {', '.join(HOWS)}"
    return line, ""


def _start(line: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    world = line.get("world_size")
    if not (_number(line.get("started_at")) and _optional_count(line.get("resumed_at"))):
        return None, "a start line whose process start or resume step is missing or out of range"
    if world is not None and not (_count(world) and world >= 1):
        return None, "a start line whose world size is not a positive whole number"
    if line["started_at"] > line["t"]:
        return None, "a start line whose process start is after its own time"
    return line, ""


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def _number(x: Any) -> bool:
    """A wall-clock reading or a duration: a number from 0 to :data:`_LATEST` (NaN, infinities and 400-digit
    integers are not)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= _LATEST


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_STEP


def _optional_count(x: Any) -> bool:
    return x is None or _count(x)
