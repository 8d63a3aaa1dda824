"""Ctrl-C and preemption: stop where every rank agrees, with a checkpoint of the last finished step.

SIGINT is a person's Ctrl-C. SIGTERM and SIGUSR1 say the allocation ends soon (a preemption: Slurm's time
limit, ``scancel``, ``--signal=B:USR1@SECONDS`` through ``examples/slurm/train.sbatch``, torchrun passing either
on). The first one asks the run to stop; the ranks agree on it (a signal on any rank stops every rank, and a
preemption anywhere makes the stop a preemption everywhere) at these points, each one every rank reaches:

- every optimizer step boundary (:meth:`StopRequest.agreed`): under torchrun an all-reduce of one flag on the
  CPU (gloo) started at one boundary and read at the next, so the step never waits on the network; a signal
  that arrives during a step is agreed at the boundary after the next at the latest;
- every pass of an evaluation (:meth:`StopRequest.poll`, the same kind of flag, one per forward pass; every
  rank runs as many): a preemption abandons the evaluation, which is then no part of the run's metrics (a
  Ctrl-C lets it finish: the person who pressed it can press again);
- right after a checkpoint save (:meth:`StopRequest.after_save`, blocking: a save outlasts it by far): the
  run ends with that checkpoint, without another step.

Then the loop writes the checkpoint (unless it has it already) and the summary, and exits with the command
that resumes: 130 for SIGINT, :data:`REQUEUE_EXIT_CODE` for a preemption ("requeue me": a requeued
``--auto-resume`` continues from that checkpoint).

What is not cut short: a data read that stalls, the first step's compile, a long forward/backward, a
collective, a checkpoint save in progress. Each is a point every rank must pass together (one rank leaving a
collective while another waits in it hangs both), so a stop waits for the next point above. A preemption
therefore arms a deadline as well (``run.stop_deadline_s``, from the first signal, or from the agreement on a
rank that got none): if the process has not ended when it passes, it logs the phase the loop is in, the
step and the latest complete checkpoint, and exits with :data:`REQUEUE_EXIT_CODE` at once. Nothing is left
half-written: a checkpoint becomes one by a rename once complete (a save cut short stays ``.partial`` and the
previous checkpoint is the latest), and a resume drops the ``metrics.jsonl`` rows past its checkpoint. Size
the deadline below the time the scheduler leaves (Slurm's ``KillWait``, 30 s by default; the lead time of
``--signal``): see docs/slurm.md.

A second signal aborts at once (``KeyboardInterrupt``), except within :data:`ECHO_S` of the first:
torchrun forwards the terminal's Ctrl-C (and Slurm its SIGTERM) to ranks that already got it, and
that echo is the same request, not a second one.

The handlers stay until the job has ended (its report written, the ranks parted): a first signal once the
steps are over has nothing left to stop and is only noted (the job ends as it would have), a second aborts;
rank 0, while it writes the report, lets its launcher's death wait for it (:meth:`~StopRequest.holding`).
The job's end (the handlers removed) disarms the deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.train.checkpoint.catalog import latest_checkpoint
from steadytrain.train.observe.watchdog import HANG_EXIT_CODE, Beat
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.launcher import death_signal, launcher_gone, launcher_pid

__all__ = ["ECHO_S", "PREEMPTION", "REQUEUE_EXIT_CODE", "StopRequest", "signal_exit_code"]

log = logging.getLogger("steadytrain.train")

ECHO_S = 1.0
"""Seconds after a first signal during which another is taken as the same request."""
REQUEUE_EXIT_CODE = HANG_EXIT_CODE
"""The exit code of a run a preemption stopped: 75, ``EX_TEMPFAIL``, "requeue me" (the hang watchdog's too):
``steadytrain train --auto-resume`` of the same run directory continues from its latest complete checkpoint."""
PREEMPTION = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that mean the allocation ends soon."""

_SIGNALS = (signal.SIGINT, *PREEMPTION)
_CTRL_C, _PREEMPT = 1, 2
"""What a rank's flag says (0: no signal); the ranks take the largest: a preemption anywhere wins."""


def signal_exit_code(signum: int) -> int:
    """The exit code of a stop by ``signum``: :data:`REQUEUE_EXIT_CODE` for a preemption, else ``128 + signum``."""
    return REQUEUE_EXIT_CODE if signum in PREEMPTION else 128 + signum


def _kind(signum: int | None) -> int:
    return 0 if signum is None else _PREEMPT if signum in PREEMPTION else _CTRL_C


class StopRequest:
    """Signal handlers for the duration of a run, the ranks' agreement on when to stop, and the deadline."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.signal: int | None = None
        self.kind = 0
        """What the ranks agreed on so far (0: nothing, else Ctrl-C or a preemption): the same on every rank."""
        self.stopped = False
        """Whether the ranks agreed to stop (the loop then writes the checkpoint and exits)."""
        self.saved: int | None = None
        """The step whose checkpoint a stop agreed right after its save already has (no second save)."""
        self.ended = False
        """Whether the job is ending (:meth:`settle`): its steps are over, a signal has nothing left to stop."""
        self.on_deadline: Callable[[], Any] | None = None
        """Called on the deadline's thread before the process exits (what must reach the disk first)."""
        self.exit: Callable[[int], Any] = os._exit
        self._at = 0.0
        self._since: float | None = None
        self._deadline: tuple[float, Beat, Path] | None = None
        self._armed, self._over = threading.Event(), threading.Event()
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._flag: torch.Tensor | None = None
        self._work: Any = None
        self._polled: tuple[torch.Tensor, Any] | None = None
        if info.backend is not None:
            # one flag on the CPU: its own gloo group where the job's backend is NCCL (every rank calls this)
            self._group = None if info.backend == "gloo" else dist.new_group(backend="gloo")

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.settle()
        self._over.set()  # the job has ended: the deadline is off
        self._armed.set()

    def settle(self) -> None:
        """The job is ending (finished, stopped or failed): the flag still in flight completes (every rank waits
        for it, so the next collective matches), and a first signal from here on is only noted."""
        self.ended = True
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Rank 0 writing the report of a job that ended: its launcher's death (SIGTERM here, not SIGKILL) waits
        until the report is written; then the rank dies as its peers did (SIGKILL), before any collective."""
        previous = death_signal(signal.SIGTERM)
        try:
            yield
        finally:
            death_signal(previous)
            if launcher_gone():
                log.warning("the launcher (pid %s) is gone: the run's report is written; exiting", launcher_pid())
                os.kill(os.getpid(), previous)

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if launcher_gone():  # its death signal while rank 0 writes the report: :meth:`holding` ends the rank after
            return
        if self.signal is None:
            self.signal, self._at = signum, now
            name = signal.Signals(signum).name
            if _kind(signum) == _PREEMPT:
                self._arm(now)
            if self.ended:
                log.warning(
                    "%s: the job is already ending: it exits once its last files are written (press Ctrl-C again "
                    "to abort now)",
                    name,
                )
            elif _kind(signum) == _PREEMPT:
                within = f" within run.stop_deadline_s={self._deadline[0]:g} s" if self._deadline else ""
                log.warning(
                    "%s: stopping at the next optimizer step boundary with a checkpoint, then exiting %d (requeue "
                    "me)%s; a second signal aborts at once", name, REQUEUE_EXIT_CODE, within,
                )  # fmt: skip
            else:
                log.warning(
                    "%s: stopping at the next optimizer step boundary with a checkpoint (press Ctrl-C again to "
                    "abort now)",
                    name,
                )
            return
        if now - self._at < ECHO_S:  # torchrun or Slurm passing on the same request
            return
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: aborted without a checkpoint")

    @property
    def name(self) -> str:
        if self.signal:
            return signal.Signals(self.signal).name
        return "a preemption signal on another rank" if self.kind == _PREEMPT else "a signal on another rank"

    @property
    def preempted(self) -> bool:
        """Whether the stop is a preemption (SIGTERM, SIGUSR1 on any rank): exit :data:`REQUEUE_EXIT_CODE`."""
        return max(self.kind, _kind(self.signal)) == _PREEMPT

    # -- the agreement --------------------------------------------------------------------------------------------
    def _local(self) -> torch.Tensor:
        return torch.tensor([max(self.kind, _kind(self.signal))], dtype=torch.int32)

    def _take(self, flag: torch.Tensor | int) -> None:
        """A flag every rank reduced (or, alone, this rank's own): what the ranks agree on from here."""
        value = int(flag.item()) if isinstance(flag, torch.Tensor) else flag  # a CPU tensor: no device sync
        if value > self.kind:
            self.kind = value
            if value == _PREEMPT:
                self._arm(time.monotonic())  # a rank without a signal of its own keeps the same deadline

    def _reduce(self, flag: torch.Tensor, *, wait: bool) -> Any:
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=not wait)

    def _read(self) -> None:
        """The flag the last boundary started, read (every rank at the same point)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._take(self._flag)

    def agreed(self) -> bool:
        """Whether to stop now (every rank gets the same answer at the same boundary): a signal before the previous
        boundary, or agreed on since (in an evaluation)."""
        if self.info.backend is None:
            self._take(_kind(self.signal))
        elif not self.kind:  # already agreed (in an evaluation): the flag in flight is left to settle()
            self._read()
            if not self.kind:  # a signal on any rank stops every rank; reduced in the background, read next time
                self._flag = self._local()
                self._work = self._reduce(self._flag, wait=False)
        self.stopped = self.kind > 0
        return self.stopped

    def poll(self, last: bool = False) -> bool:
        """Inside an evaluation: before each forward pass (every rank as many times) and once with ``last`` after
        them. Whether the ranks agreed on a preemption (the evaluation is then abandoned); each call reads the flag
        the previous one started, and the last reads its own (a Ctrl-C is agreed here too, and stops at the
        boundary that follows)."""
        if self.info.backend is None:
            self._take(_kind(self.signal))
            return self.kind == _PREEMPT
        if self._polled is not None:
            flag, work = self._polled
            self._polled = None
            work.wait()
            self._take(flag)
        if self.kind == _PREEMPT:
            return True
        flag = self._local()
        work = self._reduce(flag, wait=last)
        if not last:
            self._polled = (flag, work)
            return False
        self._take(flag)
        return self.kind == _PREEMPT

    def after_save(self, step: int) -> bool:
        """Right after the checkpoint of ``step`` (every rank): whether to stop there, with it (then ``saved``)."""
        if self.info.backend is None:
            self._take(_kind(self.signal))
        elif not self.kind:
            self._read()
            if not self.kind:
                flag = self._local()
                self._reduce(flag, wait=True)  # a signal during the save: agreed now, not after another step
                self._take(flag)
        if self.kind:
            self.stopped, self.saved = True, step
        return self.stopped

    @property
    def exit_code(self) -> int:
        return REQUEUE_EXIT_CODE if self.preempted else 128 + signal.SIGINT

    # -- the deadline ---------------------------------------------------------------------------------------------
    def deadline(self, seconds: float, beat: Beat, checkpoints: Path) -> None:
        """Arm the deadline of a preemption (``run.stop_deadline_s``): its thread waits for the first preemption
        (one that came already counts from when it came), then ``seconds``; ``beat`` and ``checkpoints`` say where
        the run is when it passes."""
        self._deadline = (seconds, beat, checkpoints)
        threading.Thread(target=self._watch, name="steadytrain-stop-deadline", daemon=True).start()

    def _arm(self, now: float) -> None:
        if self._since is None:
            self._since = now
            self._armed.set()

    def _watch(self) -> None:
        self._armed.wait()
        if self._over.is_set() or self._deadline is None or self._since is None:
            return
        seconds, beat, checkpoints = self._deadline
        if self._over.wait(max(0.0, self._since + seconds - time.monotonic())):
            return
        try:
            latest = latest_checkpoint(checkpoints)
            log.error(
                "%s: run.stop_deadline_s=%g s passed while the loop was in phase %s after step %d: exiting now "
                "with %d (requeue me); the latest complete checkpoint is %s",
                self.name, seconds, beat.phase, beat.step, REQUEUE_EXIT_CODE,
                f"{latest.name}: --auto-resume continues from it" if latest else "none: a restart starts anew",
            )  # fmt: skip
            if self.on_deadline is not None:
                self.on_deadline()
        except Exception as err:  # the exit below is the point: nothing may stop it
            log.error("the stop deadline passed; while saying where the run was: %s", err)
        finally:
            logging.shutdown()
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            self.exit(REQUEUE_EXIT_CODE)
