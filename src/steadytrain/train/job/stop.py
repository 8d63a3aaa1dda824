"""Ctrl-C and SIGTERM: stop at a step boundary every rank agrees on, with a checkpoint.

The first SIGINT or SIGTERM asks the run to stop; the loop asks :meth:`StopRequest.agreed` at every
optimizer step boundary and, when it says stop, writes a checkpoint and the summary and exits
(130 for SIGINT, 143 for SIGTERM) with the command that resumes. Under torchrun the ranks agree
through an all-reduce of one flag on the CPU (gloo) that is started at one boundary and read at the
next, so it never waits on the network in the step and every rank stops after the same step.

A second signal aborts at once (``KeyboardInterrupt``), except within :data:`ECHO_S` of the first:
torchrun forwards the terminal's Ctrl-C (and Slurm its SIGTERM) to ranks that already got it, and
that echo is the same request, not a second one.

The handlers stay until the job has ended (its report written, the ranks parted): a first signal once the
steps are over has nothing left to stop and is only noted (the job ends as it would have), a second aborts;
rank 0, while it writes the report, lets its launcher's death wait for it (:meth:`~StopRequest.holding`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.launcher import death_signal, launcher_gone, launcher_pid

__all__ = ["ECHO_S", "StopRequest"]

log = logging.getLogger("steadytrain.train")

ECHO_S = 1.0
"""Seconds after a first signal during which another is taken as the same request."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Signal handlers for the duration of a run, and the ranks' agreement on when to stop."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.signal: int | None = None
        self.stopped = False
        """Whether the ranks agreed to stop (the loop then writes the checkpoint and exits)."""
        self.ended = False
        """Whether the job is ending (:meth:`settle`): its steps are over, a signal has nothing left to stop."""
        self._at = 0.0
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._flag: torch.Tensor | None = None
        self._work: Any = None
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
            if self.ended:
                log.warning(
                    "%s: the job is already ending: it exits once its last files are written (press Ctrl-C again "
                    "to abort now)",
                    signal.Signals(signum).name,
                )
            else:
                log.warning(
                    "%s: stopping at the next optimizer step boundary with a checkpoint (press Ctrl-C again to "
                    "abort now)",
                    signal.Signals(signum).name,
                )
            return
        if now - self._at < ECHO_S:  # torchrun or Slurm passing on the same request
            return
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: aborted without a checkpoint")

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a signal on another rank"

    def agreed(self) -> bool:
        """Whether to stop now (every rank gets the same answer at the same boundary)."""
        if self.info.backend is None:
            self.stopped = self.signal is not None
            return self.stopped
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag.item())  # stopping is a Python branch; a CPU tensor: no device sync
        if not stop:
            self._flag = torch.tensor([1 if self.signal is not None else 0], dtype=torch.int32)
            # a signal on any rank stops every rank; reduced in the background, read at the next boundary
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        else:
            self._work = None
        self.stopped = stop
        return stop

    @property
    def exit_code(self) -> int:
        return 128 + (self.signal or signal.SIGINT)
