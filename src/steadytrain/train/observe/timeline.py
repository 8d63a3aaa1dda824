"""One clock per attempt: where this attempt's seconds went, appended to ``RUN/timeline.jsonl`` by rank 0.

The clock is the loop's heartbeat (:class:`~steadytrain.train.observe.watchdog.Beat`), which already reads the
time at every phase change: ``start`` (before the first step: imports, process group, model, data) is
``startup``, ``restore`` is ``checkpoint_restore``, ``eval`` is ``evaluation``, ``checkpoint`` is
``checkpoint_save`` (the part the loop waits for), and the phases of a step (``data``, ``forward``, ``backward``,
``all_reduce``, a loop's own) are the step. At each step's end (:meth:`AttemptClock.step`, a few float additions:
no device work, no I/O) the step's seconds go to ``skipped_steps`` when it was refused, else its ``data`` seconds to
``data_wait`` and the rest to ``train``. What the first step of a compiled model costs beyond the median of the
next steps is ``compile``; what the job waited for its slowest rank (``ranks.jsonl``'s gather) is ``straggler``;
the steps a spike rollback throws away are ``lost_progress``. The lines are written with the rows the loop writes
anyway (each logging interval's, each checkpoint's); the hang watchdog writes the last line of an attempt it
ends. Reading the file is :mod:`steadytrain.runs.goodput`'s; its format is :mod:`steadytrain.rundir.timeline`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import append_jsonl
from steadytrain.rundir.timeline import TIMELINE, seal
from steadytrain.train.observe.watchdog import Beat

__all__ = ["AttemptClock", "process_started_at", "start_clock"]

log = logging.getLogger("steadytrain.train")

_PHASES = {"start": "startup", "restore": "checkpoint_restore", "eval": "evaluation", "checkpoint": "checkpoint_save"}
"""Phases outside a step, and the cause their seconds go to."""
_OPEN = _PHASES | {"data": "data_wait"}
"""What a line counts of the time since the last step's end (a stop or a hang can come in the middle of a step)."""
_EARLY = 20
"""Steps after the first whose median is a plain step (what a compiled first step costs beyond it is ``compile``)."""


def process_started_at() -> float:
    """When this process started (seconds since the epoch): Linux's ``/proc`` (its start in clock ticks since boot,
    placed by the uptime read now: to 10 ms; the boot time ``/proc/stat`` gives is whole seconds); elsewhere, when
    this module was imported (the imports before it are then not counted as ``startup``)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        now = time.time()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


@dataclass
class AttemptClock:
    """This attempt's account (rank 0): built when the run directory is known, :meth:`begin` at the first step."""

    path: Path
    beat: Beat
    compiled: bool = False
    started_at: float = field(default_factory=process_started_at)
    name: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    """Cumulative seconds by cause, as of the last step's end (``train``: the steps trained)."""
    _last: dict[str, float] = field(default_factory=dict)
    _first: float | None = None
    _early: list[float] = field(default_factory=list)
    _saved: dict[int, tuple[float, float]] = field(default_factory=dict)
    """``train`` and ``lost_progress`` seconds at each checkpoint this attempt saved, by step (a rollback to it
    throws away what was trained since)."""
    _epoch: float = field(default_factory=lambda: time.time())
    _perf: float = field(default_factory=lambda: time.perf_counter())
    _ended: bool = False
    _off: bool = False
    """``timeline.jsonl`` cannot be appended to (not a regular file): nothing is written."""

    def __post_init__(self) -> None:
        self.path = Path(self.path) / TIMELINE
        self.name = f"{socket.gethostname()}:{os.getpid()}:{self.started_at:.3f}"

    def begin(self, step: int, resumed_at: int | None, world_size: int) -> None:
        """The attempt's first line: written when its first step begins (what came before is its startup)."""
        try:
            seal(self.path)
        except OSError as err:  # a FIFO, a directory: never waited on; this attempt's time is not accounted
            log.warning("%s: %s: this attempt's time is not accounted (move it away)", self.path, err)
            self._off = True
        now = self.beat.totals()
        for phase, total in now.items():  # a restore, an evaluation before the first step: their own causes
            if phase != "start":
                self._add(_PHASES.get(phase, "startup"), total)
        # startup: from the process's start to here, less those (the imports before the beat began too)
        before = self._wall() - self.started_at - sum(t for p, t in now.items() if p != "start")
        self._add("startup", max(0.0, before))
        self._last = now
        extra = {"started_at": round(self.started_at, 3), "resumed_at": resumed_at, "world_size": world_size}
        self._write("start", step, extra | {"compiled": self.compiled}, sync=True)

    def step(self, skipped: bool) -> None:
        """An optimizer step ended (``skipped``: refused, non-finite or a spike): its seconds by phase since the
        previous step's end go to their causes."""
        now = self.beat.totals()
        spent = 0.0
        data = 0.0
        for phase, total in now.items():
            delta = total - self._last.get(phase, 0.0)
            if phase in _PHASES:
                self._add(_PHASES[phase], delta)
            elif phase == "data":
                data = delta
            else:
                spent += delta
        self._last = now
        if skipped:
            self._add("skipped_steps", spent + data)
            return
        self._add("data_wait", data)
        self._add("train", spent)
        if self._first is None:
            self._first = spent
        elif len(self._early) < _EARLY:
            self._early.append(spent)

    def waited(self, seconds: float) -> None:
        """The job waited ``seconds`` for its slowest rank (from the interval's gather): ``straggler``."""
        self._add("straggler", seconds)

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was saved (its line, synced: the checkpoint is never newer than the clock)."""
        self._saved[step] = (self.seconds.get("train", 0.0), self.seconds.get("lost_progress", 0.0))
        self._write("checkpoint", step, {}, sync=True)

    def rolled_back(self, to_step: int) -> None:
        """A spike rollback to the checkpoint of ``to_step``: the steps trained since it are lost (those an earlier
        rollback to it already counted, once)."""
        self.step(skipped=True)  # the refused step, and the restore (its own cause)
        kept = max((s for s in self._saved if s <= to_step), default=None)
        train, lost = self._saved[kept] if kept is not None else (0.0, 0.0)
        since = self.seconds.get("train", 0.0) - train - (self.seconds.get("lost_progress", 0.0) - lost)
        self._add("lost_progress", max(0.0, since))
        self._saved = {s: v for s, v in self._saved.items() if s <= to_step}

    def interval(self, step: int) -> None:
        """A logging interval's rows were written: the account so far (left to the kernel, as the rows are)."""
        self._write("interval", step, {}, sync=False)

    def end(self, how: str, step: int, hang_s: float | None = None) -> None:
        """The attempt's last line (``how``: finished, stopped, failed, hang); once."""
        if self._ended:
            return
        self._ended = True
        self._write("end", step, {"how": how}, sync=True, hang_s=hang_s)

    def account(self, hang_s: float | None = None) -> dict[str, float]:
        """The seconds by cause now: the last step's account, the phases outside a step since then and the wait for
        data since then (a step under way is not trained yet: its other phases are no cause), and the carve-outs
        (``compile``, ``straggler``, ``lost_progress``) taken from ``train``."""
        out = dict(self.seconds)
        now = self.beat.totals()
        for phase, cause in _OPEN.items():
            out[cause] = out.get(cause, 0.0) + now.get(phase, 0.0) - self._last.get(phase, 0.0)
        if hang_s is not None:  # the hang's seconds are the open phase's last ones: counted once
            out["hang"] = hang_s
            if (cause := _OPEN.get(self.beat.phase)) is not None:
                out[cause] = max(0.0, out[cause] - hang_s)
        if self.compiled and self._first is not None and self._early:
            out["compile"] = max(0.0, self._first - statistics.median(self._early))
        carved = sum(out.get(k, 0.0) for k in ("compile", "straggler", "lost_progress"))
        out["train"] = out.get("train", 0.0) - carved
        return {k: round(max(v, 0.0), 6) for k, v in out.items() if v}

    def _wall(self) -> float:
        """Now, on the attempt's one monotonic clock placed in wall time (a wall clock that jumps does not move it)."""
        return self._epoch + time.perf_counter() - self._perf

    def _add(self, cause: str, seconds: float) -> None:
        self.seconds[cause] = self.seconds.get(cause, 0.0) + seconds

    def _write(self, event: str, step: int, extra: dict[str, Any], *, sync: bool, hang_s: float | None = None) -> None:
        if self._off:
            return
        line = {"attempt": self.name, "event": event, "t": round(self._wall(), 3), "step": step} | extra
        line["seconds"] = self.account(hang_s)
        try:
            append_jsonl(self.path, line, sync=sync)
        except OSError as err:  # the account is lost for this line; the training goes on
            log.warning("%s: cannot append the attempt's clock: %s", self.path, err)


def start_clock(
    path: Path, beat: Beat, metrics: Any, watchdog: Any, *, step: int, resumed: bool, world_size: int,
    compiled: bool = False, stop: Any = None,
) -> AttemptClock:  # fmt: skip
    """Rank 0, the attempt's first step about to begin: its clock, told each step by ``metrics`` (a
    :class:`~steadytrain.train.observe.metrics.MetricsLog`), its start line written, and its last line written by
    whatever ends the attempt from another thread: the hang ``watchdog`` and a preemption's deadline (``stop``, a
    :class:`~steadytrain.train.job.stop.StopRequest`); None: none."""
    clock = metrics.clock = AttemptClock(path, beat, compiled=compiled)
    clock.begin(step, step if resumed else None, world_size)
    if watchdog is not None:
        watchdog.on_hang = lambda seconds: clock.end("hang", beat.step, hang_s=seconds)
    if stop is not None:
        stop.on_deadline = lambda: clock.end("stopped", beat.step)
    return clock
