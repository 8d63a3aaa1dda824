"""The shape of a checkpoint's ``state.json``, checked once, where it is read (as :mod:`steadytrain.rundir.schema`
checks run files).

A resume, a spike rollback, ``eval`` and ``export`` all read ``state.json`` through
:func:`~steadytrain.train.checkpoint.files.read_state`, which calls :func:`check_state` before any value is used:
the step and world size, the exposure counts, the scheduler, accumulator, data position, validation and
spike-window states, and the nesting depth. A missing key, a wrong type, a negative or absurd number
(``step: -5`` would cut the metrics log; a shard id of 10**18 would allocate exabytes) is one
:class:`~steadytrain.errors.UserError` naming ``state.json`` and the key, raised before anything in the run
directory changes. The stateful parts then check what only they can (a data position against its dataset,
an accumulator against its model). Unknown keys are allowed: a newer steadytrain may add some.
"""

from __future__ import annotations

import math
from typing import Any

from steadytrain._check import check_int, check_type
from steadytrain._io import brief
from steadytrain.errors import UserError
from steadytrain.rundir.schema import KINDS, MAX_DEPTH, check_depth, check_fields

__all__ = ["MAX_SHARD_ID", "check_resumable", "check_state"]

MAX_SHARD_ID = 2**31 - 1
"""The largest shard id an exposure count may name (a dataset's ids are far below; the counts are held in an
array indexed by id, so a larger one would be an allocation, not a count)."""

FIX = "the checkpoint is damaged (edited by hand?)"


def _numbers(name: str, value: Any) -> list[float]:
    """A list of numbers (a non-finite float is data here: a grad norm may have been inf)."""
    for i, x in enumerate(check_type(name, value, list)):
        if isinstance(x, bool) or not isinstance(x, int | float) or (isinstance(x, int) and abs(x) > 2**63):
            raise UserError(f"{name}[{i}]={brief(x)} must be a number")
    return value


def _finite_numbers(name: str, value: Any) -> list[float]:
    for i, x in enumerate(_numbers(name, value)):
        if not math.isfinite(x):
            raise UserError(f"{name}[{i}]={brief(x)} is not a finite number")
    return value


def _exposure(name: str, value: Any) -> dict[str, int]:
    """``{"<shard id>": examples seen}``: ids are decimal integers in ``[0, MAX_SHARD_ID]``, counts >= 0."""
    for key, count in check_type(name, value, dict).items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= MAX_SHARD_ID):
            raise UserError(f"{name}: key {brief(key)} is not a shard id (an integer from 0 to {MAX_SHARD_ID})")
        KINDS["count"](f"{name}.{key}", count)
    return value


KINDS_HERE = {
    **KINDS,
    "list": lambda n, v: check_type(n, v, list),
    "numbers": _numbers,
    "finite numbers": _finite_numbers,
    "exposure": _exposure,
    "world size": lambda n, v: check_int(n, v, 1, maximum=2**31 - 1),
}

REQUIRED: dict[str, str] = {
    "step": "count",
    "world_size": "world size",
    "train": "mapping",
    "model": "mapping",
    "optimizer": "mapping",
    "train.step": "count",
}
"""Keys every checkpoint has had, and the kind of each."""
RESUMABLE: dict[str, str] = {
    "train.scheduler": "mapping",
    "train.scheduler.last_epoch": "count",
    "train.scheduler.base_lrs": "finite numbers",
    "train.accumulator": "mapping",
    "train.data": "mapping",
    "train.data.epoch": "count",
}
"""What a training run resumes from (a checkpoint written by the library alone may hold the step only)."""
OPTIONAL: dict[str, str] = {
    "train.epoch": "count",
    "train.consecutive_skips": "count",
    "train.elapsed_s": "nonnegative",
    "train.exposure": "exposure",
    "train.scaler": "mapping",
    "train.validation": "mapping",
    "train.validation.every_steps": "positive",
    "train.spikes": "mapping",
    "train.scheduler._step_count": "count",
    "train.scheduler._last_lr": "finite numbers",
    "train.scheduler.lr_lambdas": "list",
    "train.accumulator.accumulation_steps": "positive",
    "train.accumulator.micro_steps": "count",
    "train.accumulator.optimizer_steps": "count",
    "train.accumulator.skipped_steps": "count",
    "train.accumulator.items_seen": "count",
    "train.accumulator.nonfinite_events": "list",
    "train.accumulator.cycle": "mapping",
    "train.data.micro": "count",
    "train.data.step": "count",
}
"""Keys a checkpoint may lack (older versions, parts a run does not use) or hold as null."""
VALIDATION: dict[str, str] = {"best_loss": "number", "best_step": "count", "bad": "count"}
SPIKES: dict[str, str] = {
    "rollbacks": "count",
    "skipped": "shard list",
    "recent": "shard list",
    "restored": "shard list",
    "detector": "mapping",
}
DETECTOR: dict[str, str] = {"count": "count", "loss": "numbers", "grad_norm": "numbers"}


def _check(data: dict[str, Any], spec: dict[str, str], where: str, *, required: bool, nullable: bool) -> None:
    kinds = {key: (kind, nullable) for key, kind in spec.items()}
    check_fields(data, kinds, where, FIX, required=required, kinds=KINDS_HERE)


def check_state(state: dict[str, Any], where: str) -> dict[str, Any]:
    """``state`` (a parsed ``state.json``) if every value a reader uses has its type and range; else one
    :class:`UserError` naming ``where`` (the file) and the key.

    Example:
        >>> try:
        ...     check_state({"step": -5}, "state.json")
        ... except UserError as err:
        ...     print(err)
        state.json: step=-5 must be an integer >= 0; the checkpoint is damaged (edited by hand?)
    """
    check_depth(state, where, MAX_DEPTH)
    _check(state, REQUIRED, where, required=True, nullable=False)
    _check(state, RESUMABLE, where, required=False, nullable=False)
    _check(state, OPTIONAL, where, required=False, nullable=True)
    train = state["train"]
    if train["step"] != state["step"]:
        raise UserError(f"{where}: train.step={train['step']} differs from step={state['step']}; {FIX}")
    if isinstance(train.get("validation"), dict):
        validation = {f"train.validation.{k}": v for k, v in VALIDATION.items()}
        _check(state, validation, where, required=True, nullable=True)
    spikes = train.get("spikes")
    if isinstance(spikes, dict):
        _check(state, {f"train.spikes.{k}": v for k, v in SPIKES.items()}, where, required=False, nullable=True)
        if isinstance(spikes.get("detector"), dict):
            detector = {f"train.spikes.detector.{k}": v for k, v in DETECTOR.items()}
            _check(state, detector, where, required=True, nullable=False)
            _check(state, {"train.spikes.detector.window": "positive"}, where, required=False, nullable=False)
    _check_consistent(train, where)
    return state


def _get(train: dict[str, Any], key: str) -> Any:
    """``train``'s value at the dotted ``key`` (None where a part is absent or not a mapping)."""
    node: Any = train
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _check_consistent(train: dict[str, Any], where: str) -> None:
    """Values of the right type that no run could have written together: the scheduler steps exactly when the
    accumulator applies an update, an update is at most one per step, an epoch ends after at least one step, the
    best validation step is one already taken, a checkpoint's accumulation cycle holds fewer micro-batches than
    a cycle (each of these, left alone, would resume silently on another learning rate, epoch or early stop)."""
    step = train["step"]
    updates = _get(train, "accumulator.optimizer_steps")
    rules = [
        ("scheduler.last_epoch", "==", "accumulator.optimizer_steps", _get(train, "scheduler.last_epoch"), updates),
        ("accumulator.optimizer_steps", "<=", "step", updates, step),
        ("data.epoch", "<=", "step", _get(train, "data.epoch"), step),
        ("validation.best_step", "<=", "step", _get(train, "validation.best_step"), step),
        ("accumulator.cycle.micro", "<", "accumulator.accumulation_steps", _get(train, "accumulator.cycle.micro"),
         _get(train, "accumulator.accumulation_steps")),
    ]  # fmt: skip
    for left, op, right, a, b in rules:
        if not isinstance(a, int) or not isinstance(b, int):
            continue  # absent (an older or library-only checkpoint): nothing to compare
        if not {"==": a == b, "<=": a <= b, "<": a < b}[op]:
            raise UserError(f"{where}: train.{left}={a} where train.{right}={b} (must be {op}); {FIX}")


def check_resumable(train: dict[str, Any], where: str) -> None:
    """A UserError naming ``where`` and the key unless ``train`` (a checked state's ``train``) holds what a
    training run resumes from: the scheduler, accumulator and data states."""
    _check({"train": train}, RESUMABLE, where, required=True, nullable=False)
