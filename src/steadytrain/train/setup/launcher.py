"""A rank dies with the process that launched it (torchrun's agent, or ``steadytrain train --nproc``).

torchrun starts every rank in a session of its own, so a ``kill -9`` of the launcher, or of its process
group (a closed terminal, a scheduler's hard kill), does not reach the ranks: they trained on as orphans
of init, writing the run directory, and ended in tracebacks when they next needed the rendezvous store the
launcher held. So every rank asks the kernel for a signal when its parent dies (Linux ``PR_SET_PDEATHSIG``),
or, where there is no ``prctl``, watches its parent's pid from a thread.

The signal is SIGKILL: the launcher is gone, so is the rendezvous store, and the peers die at the same
moment, so no collective (an agreed stop, a checkpoint) could be trusted to finish: a rank that tried
might hang. Nothing is lost that a resume needs: a checkpoint becomes one by a rename once complete, the
rows of ``metrics.jsonl`` past it are dropped by ``--resume``, the run's lock is the kernel's. The one
exception is rank 0 writing the report of a job that has ended (:func:`death_signal` switches it to
SIGTERM there, which waits for the report: see :meth:`~steadytrain.train.job.stop.StopRequest.holding`).
The kernel's signal follows the parent *thread* that started the rank: torchrun's agent starts its ranks
from its main thread, which lives as long as the agent.

Only a process a launcher started is watched: ``RANK`` set, and torchrun's ``TORCHELASTIC_RUN_ID`` or
:data:`LAUNCHER_PID` (which ``--nproc`` sets to its own pid, so a launcher that died before the rank
looked is noticed too; under a bare torchrun the parent is the one the rank first sees).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

__all__ = ["LAUNCHER_PID", "death_signal", "die_with_launcher", "launcher_gone", "launcher_pid"]

log = logging.getLogger("steadytrain.train")

LAUNCHER_PID = "STEADYTRAIN_LAUNCHER_PID"
"""The environment variable ``steadytrain train --nproc`` gives its ranks: its own pid, their parent."""

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
_launcher: int | None = None
_signal = signal.SIGKILL
_prctl = False


def _launched() -> bool:
    env = os.environ
    return "RANK" in env and ("TORCHELASTIC_RUN_ID" in env or LAUNCHER_PID in env)


def launcher_pid() -> int | None:
    """The pid of the process this rank dies with (None: not watched)."""
    return _launcher


def launcher_gone() -> bool:
    """Whether this rank's launcher has died (it has a parent other than the one it started under)."""
    return _launcher is not None and os.getppid() != _launcher


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch() -> None:
    """Where there is no ``prctl``: the parent's pid, twice a second; its death signal once, as the kernel would."""
    event = threading.Event()
    while not event.wait(_POLL_S):
        if launcher_gone():
            os.kill(os.getpid(), _signal)
            return


def die_with_launcher() -> None:
    """Arm this rank to die with its launcher (a no-op outside one, or when armed); call it early, on the main
    thread. A launcher that has already died ends the rank here."""
    global _launcher, _prctl
    if _launcher is not None or not _launched():
        return
    raw = os.environ.pop(LAUNCHER_PID, None)  # this rank's own: a process it starts has another parent
    try:
        _launcher = int(raw) if raw else os.getppid()
    except ValueError:
        _launcher = os.getppid()
    _prctl = _set_pdeathsig(_signal)
    if not _prctl:
        threading.Thread(target=_watch, name="steadytrain-launcher-watch", daemon=True).start()
    if launcher_gone():  # it died before the signal was asked for: the kernel will not send it now
        log.warning("rank %s: its launcher (pid %d) is gone: exiting", os.environ.get("RANK"), _launcher)
        os.kill(os.getpid(), _signal)


def death_signal(sig: int) -> int:
    """Make ``sig`` the signal this rank gets when its launcher dies; the previous one. A launcher that died
    meanwhile is :func:`launcher_gone` (the kernel signals a death once)."""
    global _signal
    previous, _signal = _signal, signal.Signals(sig)
    if _prctl:
        _set_pdeathsig(_signal)
    return previous
