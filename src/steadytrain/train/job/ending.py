"""How a training job ends on every rank, however it ended: finished, stopped, or crashed.

The order is what a kill at any moment leaves behind. When the steps ended, the last checkpoint is complete
(or the previous one is the latest) and the short ``summary.md`` written before this runs; then the run's lock
is released, and rank 0 writes the report (plots, the full ``summary.md``) and closes its trackers *before* the
ranks part: parting is a barrier and a count in the launcher's rendezvous store, which a dead launcher or peer
breaks, so a run that got this far keeps its report. A first signal meanwhile is noted, not acted on
(:class:`~steadytrain.train.job.stop.StopRequest`), and rank 0 outlives its launcher until the report is written
(:meth:`~steadytrain.train.job.stop.StopRequest.holding`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from steadytrain._text import error_text
from steadytrain.train.job.core import Job
from steadytrain.train.observe.trackers import end_run
from steadytrain.train.setup.distributed import DistInfo, teardown

__all__ = ["end_job"]

log = logging.getLogger("steadytrain.train")


def end_job(
    info: DistInfo, job: Job | None, ending: tuple[str | None, str] | None, report: Callable[..., Any] | None
) -> None:
    """The job's end: the stop flag settled, the writer closed, the lock released, rank 0's report and trackers,
    then the ranks part. ``ending``: why the run stopped (None: it finished) and its status; None: it crashed
    (no report, and a failure to part is logged, not raised over the job's own error)."""
    try:
        if job is not None:
            if job.watchdog is not None:  # the steps are over: an evaluation or a save is no hang
                job.watchdog.stop()
            job.stop.settle()
            job.writer.close()  # a save still in flight (the run failed) completes first
            if job.clock is not None:  # the attempt's last line, before the report reads the account
                job.clock.end(_how(ending), job.state.step)
            if job.lock is not None:
                job.lock.release()
            if info.is_main:
                with job.stop.holding():
                    end_run(job.metrics.trackers, job.run, ending, report)  # ending None: it crashed (no report)
    finally:
        try:  # every rank leaves the process group together, after rank 0's report (see the module docstring)
            teardown(info)
        except Exception as err:
            if ending is not None:
                raise
            log.warning("rank %d: leaving the process group failed too: %s", info.rank, error_text(err))


def _how(ending: tuple[str | None, str] | None) -> str:
    """The attempt's end as ``timeline.jsonl`` names it."""
    if ending is None:
        return "failed"
    reason, status = ending
    return "finished" if reason is None else "stopped" if status == "KILLED" else "failed"
