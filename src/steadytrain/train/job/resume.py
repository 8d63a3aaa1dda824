"""What a resume may change, how a change is applied, and where it is recorded.

``steadytrain train --resume RUN --set key=value`` never ignores a setting. The checkpoint's
optimizer and scheduler states would silently override a new LR, weight decay or schedule; instead
the new config's hyper-parameters are applied from the resume step on. A setting the checkpoint
cannot honour (another model, data, seed, optimizer or global batch) is refused in one line.
Every resume appends a line to ``resumes.jsonl`` (step, world size, what changed) and rewrites
``config.yaml`` and ``plan.json`` when they changed, so the summary never says "8 of 4 planned".
"""

from __future__ import annotations

import json
from typing import Any

import torch

from steadytrain._io import append_jsonl, brief, utc_now
from steadytrain._mapping import flatten
from steadytrain.errors import UserError

__all__ = [
    "RunFinished",
    "apply_hyperparameters",
    "config_changes",
    "hyperparameters",
    "record_resume",
    "refuse_changes",
]


class RunFinished(UserError):
    """A resume of a run with nothing left to train (its planned last step, or its early stop, is behind it):
    ``--resume`` says so as an error; ``--auto-resume`` (a Slurm requeue, a retry after the last step) exits 0
    with :attr:`done`, training and recording nothing."""

    def __init__(self, message: str, done: str | None = None) -> None:
        super().__init__(message)
        self.done = done or message
        """The one line ``--auto-resume`` says (on rank 0)."""


_REFUSED = {
    "model.": "the checkpoint's weights belong to the model it was saved from",
    "data.sources": "the checkpoint's data position is in these sources",
    "data.": "the data position in the checkpoint belongs to that dataset and order",
    "optim.name": "the optimizer state belongs to the optimizer it was saved from",
    "run.seed": "the data order and the random streams follow the seed",
    "eval.holdout_shards": "the shards held out decide which shards the run trains on",
    "eval.holdout_fraction": "the part held out decides which examples the run trains on",
    "run.name": "a resumed run stays in its own directory",
    "run.dir": "a resumed run stays in its own directory",
}
_SPEED = (
    "model.compile",
    "model.compile_fallback",
    "model.activation_checkpointing",
    "model.ac_every",
    "model.ac_blocks",
)
"""How the model runs, not what it is: the same weights under the same names (a resume may change them; a
run saved before they existed has none of them)."""
_SAME_VALIDATION = ("eval.data", "eval.max_batches", "eval.micro_batch_size")
"""What decides which validation examples an evaluation counts: fixed once a run has evaluated, since the
best loss so far (early stopping, ``checkpoint.keep_best``) must compare like with like."""


def config_changes(saved: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """``{key: [saved, new]}`` for every leaf that differs (lists and tuples compare as lists).

    Example:
        >>> config_changes({"batch": {"base_lr": 0.003}}, {"batch": {"base_lr": 0.5}})
        {'batch.base_lr': [0.003, 0.5]}
    """
    a, b = flatten(saved), flatten(new)

    def plain(v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if plain(a.get(k)) != plain(b.get(k))}


def _why_refused(key: str, old: Any, new: Any, evaluated: bool) -> str | None:
    """Why a resume cannot change ``key`` from ``old`` to ``new`` (None: it can)."""
    if key in _SPEED or key == "data.mix_schedule":  # the data state refuses a change to a step already trained
        return None
    why = next((w for prefix, w in _REFUSED.items() if key == prefix or key.startswith(prefix)), None)
    if why is None and key == "precision" and "fp16" in (old, new):
        why = "fp16 keeps a loss-scaler state that the other precisions do not have"
    if why is None and evaluated and key in _SAME_VALIDATION:
        why = "the best validation loss so far was measured on the examples it selects (compare like with like)"
    return why


def _refuse_mixture(changes: dict[str, list[Any]], step: int, run: str) -> None:
    """A UserError for a mixture change a resume at ``step`` cannot make: the weights of a step already trained, or
    the weights of ``data.sources`` (they are step 1's: the schedule changes them from a later step). ``run``: the
    flag and the run directory, as the user gave them."""
    if "data.mix_schedule" in changes and (past := _past_weights(*changes["data.mix_schedule"], step)) is not None:
        old = _weights_at(changes["data.mix_schedule"][0], past)
        had = "data.sources' weights" if old is None else ", ".join(f"{k}={v:g}" for k, v in old.items())
        raise UserError(
            f"{run}: data.mix_schedule changes the weights of step {past}, already trained with {had} (the "
            f"checkpoint is at step {step}): a resume may change the mixture only from step {step + 1} on"
        )
    old, new = changes.get("data.sources", (None, None))
    if isinstance(old, list) and isinstance(new, list) and _without_weights(old) == _without_weights(new):
        raise UserError(
            f"{run}: data.sources weights are the weights from step 1, already trained: to change them from "
            f"step {step + 1} on, keep data.sources and add {{step: {step + 1}, weights: {{...}}}} to data.mix_schedule"
        )


def _without_weights(sources: list[Any]) -> list[Any]:
    return [{k: v for k, v in s.items() if k != "weight"} if isinstance(s, dict) else s for s in sources]


def _entries(schedule: Any) -> list[dict[str, Any]]:
    return [e for e in schedule or () if isinstance(e, dict) and isinstance(e.get("step"), int)]


def _weights_at(schedule: Any, t: int) -> Any:
    """The weights ``schedule`` gives step ``t`` (None: ``data.sources``')."""
    found = [e for e in _entries(schedule) if e["step"] <= t]
    return found[-1].get("weights") if found else None


def _past_weights(old: Any, new: Any, step: int) -> int | None:
    """The first step up to ``step`` whose mixture weights the schedule change ``old -> new`` changes (None: none)."""

    steps = sorted({e["step"] for e in _entries(old) + _entries(new) if e["step"] <= step})
    return next((t for t in steps if _weights_at(old, t) != _weights_at(new, t)), None)


def refuse_changes(
    changes: dict[str, list[Any]],
    saved_plan: dict[str, Any],
    plan: dict[str, Any],
    step: int,
    run: str,
    *,
    evaluated: bool = False,
    flag: str = "--resume",
) -> None:
    """A UserError for the first change a resume from optimizer ``step`` cannot honour (``evaluated``: the
    saved run had a validation set; ``flag``: how the user asked for it, ``--resume`` or ``--auto-resume``)."""
    _refuse_mixture(changes, step, f"{flag} {run}")
    for key, (old, new) in changes.items():
        if why := _why_refused(key, old, new, evaluated):
            keep = json.dumps(old) if old is None or isinstance(old, bool | int | float) else brief(old)
            raise UserError(
                f"{flag} {run}: {key} cannot change ({brief(old)} -> {brief(new)}) because {why}; "
                f"start a new run to change it, or keep it with --set {key}={keep}"
            )
    old_g, new_g = saved_plan.get("global_batch_size"), plan.get("global_batch_size")
    if old_g is not None and old_g != new_g:
        raise UserError(
            f"{flag} {run}: the global batch cannot change ({old_g} -> {new_g}): the data position counts "
            "global batches; keep batch.global_batch_size (micro batch and world size may change)"
        )
    total = plan.get("total_steps")
    if total is not None and total <= step:
        extend = f"extend it with --set run.max_steps=N (N > {step})"
        raise RunFinished(
            f"--resume {run}: the run is at optimizer step {step} and plans {total}: nothing to do; {extend}",
            f"--auto-resume {run}: the run had already finished (optimizer step {step} of {total}): nothing to "
            f"train, nothing recorded; to train on, {extend}",
        )


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings but its parameters, as the config built them (before a load)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: Any, groups: list[dict[str, Any]]
) -> list[float]:
    """Put the config's settings back after a checkpoint's optimizer/scheduler state replaced them.

    Each group gets its configured settings and peak LR (``initial_lr``, the scheduler's base); its
    LR is then the new schedule's at the checkpoint's step: ``peak x multiplier(step)``, the same
    formula (and float) as a run that never stopped. Returns the LRs set.
    """
    if len(groups) != len(optimizer.param_groups):
        raise UserError(
            f"checkpoint has {len(optimizer.param_groups)} parameter groups, this config builds {len(groups)}"
        )
    for group, fresh in zip(optimizer.param_groups, groups, strict=True):
        group.update(fresh)
    scheduler.base_lrs = [g["initial_lr"] for g in groups]
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() reports
    return lrs


def record_resume(run: Any, *, step: int, world_size: int, checkpoint: str, changes: dict[str, list[Any]]) -> None:
    """Append this resume to ``RUN/resumes.jsonl`` (one write and fsync)."""
    append_jsonl(
        run.resumes,
        {"step": step, "time": utc_now(), "world_size": world_size, "checkpoint": checkpoint, "changes": changes},
    )
