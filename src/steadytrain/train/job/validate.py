"""The run's validation: when it evaluates (``eval.every_steps``, or ``auto``: :mod:`.cadence`), what it says at
start, and one evaluation after a step with its row, its best loss and early stopping."""

from __future__ import annotations

import logging
from typing import Any

from steadytrain.train.job.cadence import AUTO, AutoCadence
from steadytrain.train.job.core import Job
from steadytrain.train.job.evaluate import Validation, evaluate
from steadytrain.train.job.hooks import call
from steadytrain.train.setup.config import TrainConfig

__all__ = ["build_validation", "start_validation", "validate"]

log = logging.getLogger("steadytrain.train")


def build_validation(cfg: TrainConfig, p: Any) -> Validation:
    """When the run evaluates: ``eval.every_steps``, or ``auto`` from the run's pieces ``p``; its early stopping."""
    every = cfg.eval.every_steps
    auto = AutoCadence(p.evalset.num_examples, p.plan.global_batch_size, p.plan.total_steps) if every == AUTO else None
    return Validation(p.evalset, None if auto else every, cfg.eval.patience, auto)


def start_validation(job: Job) -> None:
    """Said at start (rank 0): what validation holds out, and an ``auto`` cadence with its reason; its clock starts."""
    held = job.held_out
    if job.info.is_main and held.note:  # what validation holds out (here: a refusal is 1 line)
        (log.warning if held.empty else log.info)("%s", held.note)
    if job.validation is not None and (auto := job.validation.auto) is not None:
        auto.start(job.state.step)
        if job.info.is_main:
            log.info("%s", auto.note())


def validate(job: Job) -> bool:
    """Evaluate after this step (every rank), write its row (``val_time_s``: the pass's own time); whether a checkpoint
    must keep it as the best. Its time is set aside: the next step's ``step_s`` and ``items_per_s`` leave it out.
    A preemption the ranks agree on during the pass abandons it: no row, and ``job.stop`` says stop."""
    job.beat.enter("eval")  # progress, however long it takes
    with job.metrics.aside("eval") as spent:
        # sums over every rank's slice of the held-out set: the loss of the whole set, equal on every world size
        result = evaluate(job.model, job.validation.evalset, job.info, precision=job.cfg.precision, stop=job.stop.poll)
        if result is None:  # every rank agreed on a preemption in it: the stop follows at this step (the loop)
            if job.info.is_main:
                log.warning(
                    "evaluation at step %d abandoned: %s; it is not part of the run's metrics",
                    job.state.step, job.stop.name,
                )  # fmt: skip
            return False
        eval_s = spent()
        row = result.row(job.state.step) | {"val_time_s": round(eval_s, 3)}
        improved, stop = job.validation.record(result, job.state.step)
        job.metrics.add_eval(row | ({"early_stop": True} if stop else {}))  # the reason, for report
    call(job, "on_evaluate", row)
    auto = job.validation.auto
    if auto is not None and (change := auto.measured(job.state.step, eval_s, job.info)) and job.info.is_main:
        log.info("%s", change)  # once per run, at the first evaluation: a longer cadence from here
    if stop is not None and job.info.is_main:
        log.info("%s", stop)
    job.step.ended = stop
    return improved and job.cfg.checkpoint.keep_best
