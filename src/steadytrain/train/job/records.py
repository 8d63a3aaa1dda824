"""The one writer of a run's refused-step records: ``nonfinite.jsonl`` (each rank its own lines) and
``exposure.json`` (examples seen per shard over all ranks, rank 0).

``steadytrain train`` and :class:`steadytrain.Run` (a user's own loop) both write through these two functions, so the
files ``nan report`` and ``spikes report`` read have one shape whoever trained the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from steadytrain.data.sourcemap import SOURCES_FILE, SourceMap
from steadytrain.rundir.layout import RunDir
from steadytrain.train.job.state import TrainState
from steadytrain.train.setup.distributed import DistInfo

__all__ = ["record_nonfinite", "write_exposure", "write_nonfinite_report"]

log = logging.getLogger("steadytrain.train")


def record_nonfinite(run: RunDir, info: DistInfo, step: int, event: Any) -> None:
    """Append this rank's record of refused ``step`` to the ledger (one write and fsync: survives a kill)."""
    from steadytrain.diagnose.ledger import append_event

    if info.tp_rank == 0:  # a tensor-parallel group saw the same examples: its first rank records them once
        append_event(run.nonfinite, event, step)
    log.warning("step %d skipped on rank %d: %s", step, info.rank, event.message(step))


def write_exposure(
    run: RunDir,
    info: DistInfo,
    state: TrainState,
    shard_ids: Iterable[int] | None,
    sources: Callable[[dict[int, int]], SourceMap] | None = None,
) -> dict[int, int]:
    """Examples seen per shard over all ranks, written by rank 0 to ``exposure.json`` (a collective: every rank
    calls it). ``sources``: a mixture's sources with this exposure (``sources.json`` gets them too)."""
    exposure = state.global_exposure(info, shard_ids)
    if info.is_main:
        run.write_json(run.exposure, {str(k): v for k, v in sorted(exposure.items())})
        if sources is not None:  # a mixture: what was seen of each source
            run.write_json(run.path / SOURCES_FILE, sources(exposure).to_dict())
    return exposure


def write_nonfinite_report(run: RunDir) -> str | None:
    """Rank 0, at a run's end: the diagnosis of its refused steps as ``nonfinite_report.json`` beside the ledger
    (the report and ``summary.md`` read its sentence); the sentence, or None when no step was refused."""
    from steadytrain.diagnose import report

    if not run.nonfinite.is_file():
        return None
    rep = report(run.path)
    run.write_json(run.path / "nonfinite_report.json", rep.to_dict())
    log.warning("non-finite steps: %s", rep.sentence)
    return rep.sentence
