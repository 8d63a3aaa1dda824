"""The steps of a framework that runs its own backward and optimizer step (a Hugging Face ``Trainer``), written
into an open :class:`~steadytrain.loop.run.Run` by the same writers as the Run's own steps.

A Run normally ends a step itself: its :class:`GradientAccumulator` clips, steps or refuses, and the Run writes the
row. When a framework steps instead, its integration reports what happened with these functions, each taking the
open Run: :func:`start_at` the step a framework resumed from its own checkpoint goes on from; :func:`count` the
examples of a micro-batch (``exposure.json``, and the tag a refused step's record names); :func:`end_step` the end
of an optimizer step (the step count, and for a refused step its line in ``nonfinite.jsonl`` and
``exposure.json``); :func:`add_row` the step's ``metrics.jsonl`` row from the framework's own numbers. Layer norms
go through the Run's :class:`~steadytrain.train.observe.layers.LayerMonitor` (``run.parts.metrics.layers``),
called by the integration at the framework's own points of the step. The Run's ``callbacks`` are not called: the
framework has its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from steadytrain.errors import UserError
from steadytrain.loop.parts import fill_tags, tag_of

if TYPE_CHECKING:
    from steadytrain.accumulate import NonFiniteEvent
    from steadytrain.loop.run import Run

__all__ = ["add_row", "count", "end_step", "start_at"]


def start_at(run: Run, step: int) -> None:
    """The framework goes on from its own checkpoint of step ``step`` (in a new run directory): the Run's steps,
    rows and records continue its numbering."""
    if isinstance(step, bool) or not isinstance(step, int) or step < run.step:
        raise UserError(f"start_at(step={step!r}): give the framework's step to go on from (>= {run.step})")
    run.step = run.parts.state.step = step


def count(run: Run, ids: Any) -> dict[str, Any]:
    """The micro-batch of examples ``ids`` (integers; id ``i`` is index ``i % shard_size`` of shard
    ``i // shard_size``) was trained on: counted in the exposure. Returns its tag (``shard``, ``index``,
    ``losses``: None), which a refused step's :class:`NonFiniteEvent` carries."""
    p = run.parts
    found = tag_of(ids, None, p.origin.shard_size)
    if found is None:
        raise UserError("count(ids=None): give the micro-batch's example ids")
    fill_tags([found], p.origin.shard_size)  # its shards and indices, for a refused step's record
    p.state.count(found["ids"])  # example ids: the exposure divides them into shards
    if p.micro is None:
        p.micro = len(found["index"])
    return found


def end_step(run: Run, step: int, *, event: NonFiniteEvent | None = None) -> None:
    """Optimizer step ``step`` ended (the framework's number: above the last one ended). ``event``: the step was
    refused (no update), recorded in ``nonfinite.jsonl`` with ``exposure.json`` beside it (a collective: every
    rank ends every step, and refuses the same ones)."""
    p = run.parts
    if isinstance(step, bool) or not isinstance(step, int) or step <= run.step:
        raise UserError(f"end_step(step={step!r}): give the framework's step number, above the last ({run.step})")
    p.close_step(run, step, event)


def add_row(run: Run, step: int, *, loss: float, lr: float, grad_norm: float, skipped: bool, steps: int = 1) -> None:
    """Step ``step``'s ``metrics.jsonl`` row, with the framework's loss, learning rate and (pre-clip) gradient
    norm; the Run adds the time, items and ``clipped``. ``steps``: the optimizer steps the row stands for (a
    framework logging every n steps: its loss is their mean), so ``items`` and ``items_per_s`` are the
    interval's. Rows are written every ``log_every`` rows (every rank calls this: the write is a collective);
    ``run.log(step, ...)`` adds keys to the row until then."""
    p = run.parts
    if not 1 <= step <= run.step or any(s >= step for s in p.metrics.pending_steps):
        raise UserError(f"add_row(step={step!r}): give a step that has ended ({run.step} so far) and has no row yet")
    items = _items_per_step(run) * max(int(steps), 1)
    pending = p.metrics.pending_steps
    if pending and (len(pending) >= run.settings.log_every or p.metrics.items_per_step != items):
        p.metrics.flush()  # the rows before hold another interval's items: written with theirs
    p.metrics.items_per_step = items
    value = torch.tensor(loss if loss is not None else math.nan, dtype=torch.float32, device=p.info.device)
    p.metrics.add(step, value, float(lr), math.nan if grad_norm is None else float(grad_norm), bool(skipped))


def _items_per_step(run: Run) -> int:
    """Examples per optimizer step over all ranks: the plan's micro-batch size times accumulation times ranks."""
    p = run.parts
    return (p.micro or 0) * run.accumulator.accumulation_steps * p.info.world_size
