"""The hang watchdog: when no rank makes progress for ``distributed.watchdog_s``, name the rank that is behind.

The loop writes its step and phase into a :class:`Beat` (two attribute writes: no I/O, no lock, no collective, no
host read). A background thread on every rank publishes its beat to the process group's store (the one torchrun's
rendezvous provides; a file store under ``init_method=file://``) when its step changed, at most once per poll,
and during the phases that are progress without a step (``eval``, ``checkpoint``, the rank's first step, which
compiles) a refreshed beat each poll. Rank 0's thread reads every rank's beat each poll; when none changed for
``watchdog_s`` it declares the hang in the store. Then every rank writes the Python stack of each of its threads to
``RUN/hangs/step-XXXXXXXX/rank-RRRRR.txt`` and its report (step, phase, host, innermost frame of its main thread)
to the store; rank 0 compares the reports and writes ``hang.json``: the stuck ranks are those furthest behind
(lowest step, then earliest phase: ``data`` < ``forward`` < ``backward`` < ``all_reduce``), a rank that did not
report within the grace period counts as stuck with phase ``unknown``. Every rank then exits with
:data:`HANG_EXIT_CODE` so that torchrun's restart (and ``--auto-resume``) takes over.

A single process has no peer to wait on: the watchdog runs only with a process group.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from steadytrain._io import write_text_atomic
from steadytrain.rundir.hangs import HANG_FILE, hang_dir, stack_file
from steadytrain.train.setup.distributed import DistInfo, from_main

__all__ = ["HANG_EXIT_CODE", "Beat", "Watchdog", "hang_dir", "start_watchdog", "watchdog_seconds"]

log = logging.getLogger("steadytrain.train")

HANG_EXIT_CODE = 75
"""The exit code of every rank of a job the watchdog called hung (``EX_TEMPFAIL``: try again)."""
ORDER = {"data": 0, "forward": 1, "backward": 2, "all_reduce": 3}
"""Where in a step a rank is; a rank at an earlier phase of the same step is behind."""
PROGRESS = frozenset({"start", "eval", "checkpoint"})
"""Phases that make progress without finishing a step (``start``: a rank's first step, with its compile)."""
GRACE_S = 10.0
"""How long rank 0 waits for the other ranks' reports, and they for its ``hang.json``, before exiting."""
DEFAULT_S = 600.0


def watchdog_seconds(setting: float | None, world_size: int) -> float:
    """``distributed.watchdog_s``: None means 600 s with more than one rank under torchrun, else off (0)."""
    if setting is not None:
        return float(setting)
    return DEFAULT_S if world_size > 1 and "TORCHELASTIC_RUN_ID" in os.environ else 0.0


@dataclass
class Beat:
    """The loop's position: the optimizer steps done and the phase of the step in progress; and the seconds spent
    in each phase since :meth:`take` (a clock read per phase change: no device work, no host read)."""

    step: int = 0
    phase: str = "start"
    spent: dict[str, float] = field(default_factory=dict)
    since: float = field(default_factory=lambda: time.perf_counter())
    steps_since_take: int = 0
    """Optimizer steps ended since the last :meth:`take` (``ranks.jsonl``'s ``steps``): counted, not subtracted,
    since a spike's rollback sets the step back and a resume starts past the last take."""

    def stepped(self, step: int) -> None:
        """An optimizer step ended; ``step`` steps are done."""
        self.step = step
        self.steps_since_take += 1

    total: dict[str, float] = field(default_factory=dict)
    """The seconds per phase since the beat began (never taken): the attempt's clock
    (:class:`~steadytrain.train.observe.timeline.AttemptClock` reads it)."""

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[self.phase] = self.spent.get(self.phase, 0.0) + now - self.since
        self.total[self.phase] = self.total.get(self.phase, 0.0) + now - self.since
        self.phase, self.since = phase, now

    def totals(self) -> dict[str, float]:
        """:attr:`total` with the phase in progress counted up to now (nothing changed: any thread may ask)."""
        phase, since = self.phase, self.since
        out = dict(self.total)
        out[phase] = out.get(phase, 0.0) + time.perf_counter() - since
        return out

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last call (the phase in progress counted up to now); the count of
        :attr:`steps_since_take` starts again."""
        self.enter(self.phase)
        spent, self.spent, self.steps_since_take = self.spent, {}, 0
        return spent


@dataclass
class Watchdog:
    """The watchdog thread of one rank (see the module docstring); :meth:`start`, then :meth:`stop` at the end."""

    beat: Beat
    store: Any
    """The process group's store, under a prefix of this attempt."""
    rank: int
    world_size: int
    run: Path
    timeout_s: float
    poll_s: float = 0.0
    exit: Any = os._exit
    on_hang: Any = None
    """Rank 0, before it exits: called with the seconds from the last progress to the verdict (the attempt's
    clock writes its last line)."""
    _last_change: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _main: int = field(default_factory=threading.get_ident)
    _thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self.poll_s = self.poll_s or max(0.05, min(5.0, self.timeout_s / 5))
        self._thread = threading.Thread(target=self._watch, name="steadytrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5)

    # -- the thread -----------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        published, refresh, seen, first = None, 0, None, self.beat.step
        self._last_change = time.monotonic()
        try:
            while not self._stop.wait(self.poll_s):
                step, phase = self.beat.step, self.beat.phase
                if phase in PROGRESS or step == first:
                    refresh += 1  # progress without a step: a new value each poll
                value = json.dumps([step, refresh if (phase in PROGRESS or step == first) else 0])
                if value != published:
                    self.store.set(f"beat/{self.rank}", value)
                    published = value
                if self.rank == 0:
                    now_seen = self._beats()
                    if now_seen != seen:
                        seen, self._last_change = now_seen, time.monotonic()
                    elif seen is not None and time.monotonic() - self._last_change > self.timeout_s:
                        self.store.set("hang", str(min(s for s, _ in seen) + 1))
                if self.store.check(["hang"]):
                    self._hung(int(self.store.get("hang")))
                    return
        except Exception as err:  # the watchdog never takes a healthy job down with it
            if not self._stop.is_set():
                log.warning("rank %d: the hang watchdog stopped: %s", self.rank, err)

    def _beats(self) -> tuple[tuple[int, int], ...] | None:
        keys = [f"beat/{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return None  # a rank has not started its steps yet
        return tuple(tuple(json.loads(v)) for v in self.store.multi_get(keys))

    def _hung(self, step: int) -> None:
        """Write this rank's stacks and report; rank 0 writes ``hang.json``; then exit (whatever fails meanwhile:
        a rank that stays would hold the restart up until torchrun kills it)."""
        where = hang_dir(self.run, step)
        try:
            where.mkdir(parents=True, exist_ok=True)
            report = self._report()
            write_text_atomic(stack_file(where, self.rank), _stacks(report))
            self.store.set(f"report/{self.rank}", json.dumps(report))
            if self.rank == 0:
                _write_hang(where, step, self._reports())
                log.error("hang at step %d: see %s", step, where / HANG_FILE)
                if self.on_hang is not None:
                    self.on_hang(time.monotonic() - self._last_change)
                self.store.set("done", "1")
                time.sleep(min(1.0, self.poll_s * 2))  # the others read it before this rank's store goes
            else:
                deadline = time.monotonic() + GRACE_S
                while not self.store.check(["done"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except Exception as err:  # rank 0's store gone: it has written hang.json and exited
            log.debug("rank %d: after the hang: %s", self.rank, err)
        finally:
            logging.shutdown()
            self.exit(HANG_EXIT_CODE)

    def _report(self) -> dict[str, Any]:
        frame = sys._current_frames().get(self._main)
        return {
            "rank": self.rank,
            "step": self.beat.step + 1,
            "phase": self.beat.phase,
            "host": socket.gethostname(),
            "frame": _frame(frame),
        }

    def _reports(self) -> dict[int, dict[str, Any] | None]:
        keys = {r: f"report/{r}" for r in range(self.world_size)}
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.05)
        return {r: json.loads(self.store.get(k)) if self.store.check([k]) else None for r, k in keys.items()}


def _frame(frame: Any) -> str | None:
    """``file:line in function: source`` of the innermost frame, or None."""
    if frame is None:
        return None
    summary = traceback.extract_stack(frame, limit=1)[-1]
    return f"{summary.filename}:{summary.lineno} in {summary.name}: {(summary.line or '').strip()}"


def _stacks(report: dict[str, Any]) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    head = f"rank {report['rank']} on {report['host']}, step {report['step']}, phase {report['phase']}\n"
    parts = [head]
    for ident, frame in sys._current_frames().items():
        parts.append(f"\nThread {names.get(ident, ident)} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "".join(parts)


def _write_hang(where: Path, step: int, reports: dict[int, dict[str, Any] | None]) -> None:
    """``hang.json``: the ranks furthest behind, their phase, host and innermost frame."""

    def position(r: dict[str, Any] | None) -> tuple[int, int]:
        return (-1, -1) if r is None else (r["step"], ORDER.get(r["phase"], len(ORDER)))

    behind = min(position(r) for r in reports.values())
    stuck = sorted(rank for rank, r in reports.items() if position(r) == behind)
    first = reports[stuck[0]] or {}
    record = {
        "step": step,
        "stuck_ranks": stuck,
        "phase": first.get("phase", "unknown"),
        "host": first.get("host"),
        "frame": first.get("frame"),
        "ranks": {str(rank): r for rank, r in reports.items()},
    }
    write_text_atomic(where / HANG_FILE, json.dumps(record, indent=2) + "\n")


def start_watchdog(setting: float | None, info: DistInfo, run: Path, beat: Beat) -> Watchdog | None:
    """The rank's watchdog thread, started (None: off, or no process group). Its keys in the store are this
    attempt's: a restart runs on the same rendezvous store, so rank 0 counts the attempts (one broadcast, at start)."""
    seconds = watchdog_seconds(setting, info.world_size)
    if seconds <= 0 or info.backend is None or not dist.is_initialized():
        return None
    base = dist.distributed_c10d._get_default_store()
    attempt = from_main(info, base.add("steadytrain/watchdog/attempts", 1) if info.is_main else 0)
    store = dist.PrefixStore(f"steadytrain/watchdog/{attempt}", base)
    dog = Watchdog(beat, store, info.rank, info.world_size, run, seconds)
    return dog.start()
