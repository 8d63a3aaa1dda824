"""What a callback (``run.callbacks``) sees of a ``steadytrain train`` job: the names :class:`steadytrain.Run` has.

See :mod:`steadytrain.train.observe.callbacks` for the events and the contract.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadytrain.train.setup.config import resolved_config

if TYPE_CHECKING:
    from steadytrain.train.job.core import Job

__all__ = ["JobRun", "call"]


class JobRun:
    """A running job as its callbacks see it (``step``, ``path``, ``model``, ``optimizer``, ``config``, ``rank``,
    ``is_main``, ``log``)."""

    def __init__(self, job: Job) -> None:
        self._job = job

    step = property(lambda self: self._job.state.step)
    """The optimizer steps ended so far."""
    path = property(lambda self: Path(self._job.run.path))
    model = property(lambda self: self._job.model)
    optimizer = property(lambda self: self._job.optimizer)
    rank = property(lambda self: self._job.info.rank)
    is_main = property(lambda self: self._job.info.is_main)

    @cached_property
    def config(self) -> dict[str, Any]:
        """The run's resolved config (what ``config.yaml`` holds)."""
        return resolved_config(self._job.cfg)

    def log(self, step: int, **keys: Any) -> None:
        """Add ``keys`` to step ``step``'s ``metrics.jsonl`` row (not written yet: the step just ended)."""
        self._job.metrics.add_keys(step, keys, self._job.state.step)


def call(job: Job, event: str, *args: Any) -> None:
    """Run ``event`` on the job's callbacks (none: nothing)."""
    if job.callbacks:
        job.callbacks.call(event, job.view, *args)
