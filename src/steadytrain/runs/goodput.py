"""``steadytrain goodput RUN``: of the time the run held its machines, how much trained the model, and where the
rest went, across every attempt (``RUN/timeline.jsonl``, :mod:`steadytrain.rundir.timeline`).

Each attempt's own account is its last line: its seconds by cause, measured on one monotonic clock from the
process's start to that line. Between attempts the reader adds what no attempt can know by itself: the
``restart_gap`` (from one attempt's last line to the next one's process start; a wall clock that went back is
noted and counted as no gap), and the ``lost_progress`` of a restart (what the earlier attempt trained past the
checkpoint the next one resumed from). ``productive`` and the causes add up to ``wall_s`` by construction: what no
cause claims is ``other``, shown. A killed attempt's account ends at its last line (each logging interval and
each checkpoint): what it did after that is in the ``restart_gap``.

Whatever the file holds, the account is of the lines the reader kept, and says what it assumed: an attempt whose
start line is lost began at its first line (less the seconds that line accounts) and resumed from that line's
step (the least it can have thrown away of the attempt before); a resume past every step of the attempt before,
a cause this version does not know (counted as ``other``), causes that add up to more than the wall time and a
wall clock that went back between attempts are notes. The notes reach :func:`goodput`'s log too (``compare`` and
``report`` show numbers without them).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import present
from steadytrain._text import short
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, open_run_dir, running_by
from steadytrain.rundir.timeline import CAUSES, TIMELINE, Attempt, read_timeline

__all__ = ["GOODPUT_FILE", "Account", "goodput", "write_goodput"]

log = logging.getLogger("steadytrain.runs")

GOODPUT_FILE = "goodput.json"
_WITHIN = 0.01
"""Seconds by which an attempt's causes may exceed its wall time (rounding) before it is noted."""


@dataclass
class Account:
    """A run's or an attempt's account: ``wall_s`` = ``productive_s`` + the sum of ``badput``."""

    wall_s: float
    productive_s: float
    badput: dict[str, float]
    attempts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "badput": {c: round(self.badput.get(c, 0.0), 3) for c in CAUSES},
            "attempts": self.attempts,
            "notes": self.notes,
        }


def goodput(run_dir: str | Path) -> Account:
    """The run's account from its ``timeline.jsonl`` (a :class:`UserError` when it has none)."""
    run = open_run_dir(Path(run_dir))
    path = run.path / TIMELINE
    if not present(path):
        raise UserError(
            f"{run.path}: no {TIMELINE}: the run was written before steadytrain kept time accounts, or never reached "
            "its first step; nothing to account"
        )
    attempts, notes = read_timeline(path)
    if not attempts:
        raise UserError(f"{path}: no line could be read ({'; '.join(notes[:3]) or 'the file is empty'})")
    account = _account(attempts, notes, running_by(run.path) is not None)
    if account.notes:  # said where the notes are not shown (compare, report): the numbers are of what was read
        n = len(account.notes)
        log.info("%s: %d note%s on the time account (`steadytrain goodput %s` lists them), the first: %s", path, n,
                 "s" if n != 1 else "", run.path, account.notes[0])  # fmt: skip
    return account


def write_goodput(run_dir: str | Path, account: Account | None = None) -> Account:
    """:func:`goodput` (or ``account``, the run's already read), written to ``RUN/goodput.json`` (at the end of
    each attempt)."""
    account = goodput(run_dir) if account is None else account
    run = RunDir(Path(run_dir))
    run.write_json(run.path / GOODPUT_FILE, account.to_dict())
    return account


def _account(attempts: list[Attempt], notes: list[str], running: bool) -> Account:
    rows = [_own(a, i + 1, notes) for i, a in enumerate(attempts)]
    for n, (before, after) in enumerate(itertools.pairwise(rows), start=1):
        gap = after["_start"] - before["_end"]
        if gap < 0:
            notes.append(f"attempt {n + 1} started {-gap:.1f} s before attempt {n}'s last line: the wall clock went "
                         "back between them (or they overlapped); counted as no gap")  # fmt: skip
        after["badput"]["restart_gap"] = max(0.0, gap)
        after["wall_s"] += max(0.0, gap)  # an attempt's wall time includes the wait before it
        lost = _lost(attempts[n - 1], after["_resumed"])
        last = max(line["step"] for line in attempts[n - 1].lines)
        if after["_resumed"] is not None and after["_resumed"] > last:
            notes.append(f"attempt {n + 1} resumed at step {after['_resumed']}, past attempt {n}'s last line (step "
                         f"{last}): killed between a save and its line, or a checkpoint from elsewhere? None of "
                         f"attempt {n}'s steps is counted as lost")  # fmt: skip
        before["productive_s"] -= lost
        before["badput"]["lost_progress"] += lost
    if rows and rows[-1]["how"] == "killed" and running:
        rows[-1]["how"] = "running"
    total = Account(0.0, 0.0, dict.fromkeys(CAUSES, 0.0), notes=notes)
    for row in rows:
        total.wall_s += row["wall_s"]
        total.productive_s += row["productive_s"]
        for cause in CAUSES:
            total.badput[cause] += row["badput"][cause]
        total.attempts.append(_public(row))
    return total


def _own(attempt: Attempt, number: int, notes: list[str]) -> dict[str, Any]:
    """What one attempt's lines say of it: its span, its seconds by cause (``other``: what none claims)."""
    start, last, first = attempt.start, attempt.last, attempt.lines[0]
    seconds = last["seconds"]
    if start is not None:
        begun, resumed = float(start["started_at"]), start.get("resumed_at")
    else:  # the latest it can have begun, and the latest step it can have resumed from: the least it lost
        begun, resumed = float(first["t"]) - sum(first["seconds"].values()), first["step"]
        notes.append(f"attempt {number}: its start line is missing; its start and its resume step are taken from its "
                     f"first line (step {resumed})")  # fmt: skip
    _unknown_causes(seconds, number, notes)
    wall = float(last["t"]) - begun
    badput = {c: float(seconds.get(c, 0.0)) for c in CAUSES}
    productive = float(seconds.get("train", 0.0))
    other = wall - productive - sum(badput.values())
    if other < -_WITHIN:
        notes.append(f"attempt {number}: its causes add up to {-other:.2f} s more than its wall time (a damaged "
                     "line?): other is negative")  # fmt: skip
    badput["other"] += other if other < -_WITHIN else max(0.0, other)
    if other >= -_WITHIN and other < 0:
        wall = productive + sum(badput.values())
    return {
        "attempt": number,
        "name": attempt.name,
        "_start": begun,
        "_end": float(last["t"]),
        "wall_s": wall,
        "productive_s": productive,
        "badput": badput,
        "how": last.get("how", "killed") if last["event"] == "end" else "killed",
        "resumed_at": start.get("resumed_at") if start is not None else None,
        "_resumed": resumed,
        "world_size": start.get("world_size") if start is not None else None,
        "steps": [attempt.lines[0]["step"], last["step"]],
    }


def _unknown_causes(seconds: dict[str, float], number: int, notes: list[str]) -> None:
    """A cause this version does not know (a later version's, a hand edit) is counted as ``other``: said so."""
    unknown = sorted(k for k in seconds if k != "train" and k not in CAUSES)
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        named = ", ".join(short(k, 40) for k in unknown[:3]) + more
        total = sum(float(seconds[k]) for k in unknown)
        notes.append(f"attempt {number}: its last line names causes this version does not know ({named}): their "
                     f"{total:.1f} s are counted as other")  # fmt: skip


def _lost(attempt: Attempt, resumed_at: int | None) -> float:
    """What ``attempt`` trained past the step the next attempt resumed from (None: a fresh start: all of it)."""
    step = resumed_at or 0
    kept = 0.0
    for line in attempt.lines:
        if line["step"] <= step:
            kept = float(line["seconds"].get("train", 0.0))
    return max(0.0, float(attempt.last["seconds"].get("train", 0.0)) - kept)


def _public(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if not k.startswith("_")}
    out["wall_s"] = round(out["wall_s"], 3)
    out["productive_s"] = round(out["productive_s"], 3)
    out["goodput"] = round(out["productive_s"] / out["wall_s"], 4) if out["wall_s"] > 0 else None
    out["badput"] = {c: round(v, 3) for c, v in out["badput"].items()}
    return out


def duration(seconds: float) -> str:
    """``1 h 02 min``, ``3 min 05 s``, ``12.3 s``."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def goodput_sentence(account: Account) -> str:
    """One line: the goodput, the wall time, the attempts and the largest cause of badput."""
    if account.goodput is None:
        return "goodput: no time recorded yet"
    worst = max(CAUSES, key=lambda c: account.badput.get(c, 0.0))
    n = len(account.attempts)
    text = (
        f"goodput {account.goodput:.1%}: {duration(account.productive_s)} of {duration(account.wall_s)} trained "
        f"steps that count, over {n} attempt{'s' if n != 1 else ''}"
    )
    if account.badput.get(worst, 0.0) > 0:
        text += f"; most lost to {worst} ({duration(account.badput[worst])})"
    return text


def goodput_lines(account: Account) -> list[str]:
    """``steadytrain goodput``'s text: the sentence, every cause with its share, one line per attempt, the notes."""
    wall = account.wall_s or 1.0
    lines = [goodput_sentence(account), "", f"  {'productive':<19}{duration(account.productive_s):>14}"
             f"{account.productive_s / wall:>8.1%}"]  # fmt: skip
    for cause in CAUSES:
        s = account.badput.get(cause, 0.0)
        lines.append(f"  {cause:<19}{duration(s):>14}{s / wall:>8.1%}")
    lines += ["", f"  {'attempt':<9}{'steps':<15}{'wall':>14}{'goodput':>9}  {'ended':<10}most lost to"]
    for a in account.attempts:
        steps = f"{a['steps'][0]}-{a['steps'][1]}"
        share = "-" if a["goodput"] is None else f"{a['goodput']:.1%}"
        worst = sorted((c for c in CAUSES if a["badput"].get(c, 0.0) >= 0.05), key=lambda c: -a["badput"][c])[:3]
        lost = ", ".join(f"{c} {duration(a['badput'][c])}" for c in worst) or "-"
        lines.append(f"  {a['attempt']:<9}{steps:<15}{duration(a['wall_s']):>14}{share:>9}  {a['how']:<10}{lost}")
    lines += [f"note: {n}" for n in account.notes]
    return lines
