"""The checks a :class:`~steadytrain.loop.run.Run` makes of what the loop hands it, each a one-line refusal.

Each check stands between a value the user's loop passes and a file every command reads: a step number that would
name a checkpoint or an evaluation row the readers refuse (``run.checkpoint(2.0)``, an evaluation at step 0 or twice
at one step), a ``config`` whose value YAML cannot hold or that names a steadytrain section with a scalar, example
ids that are token ids (a 2-D batch) or none at all. The error names the call, the value and the fix, and nothing
has been written when it is raised.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from steadytrain._io import brief
from steadytrain._mapping import flatten
from steadytrain._yamlio import dump_yaml, parse_yaml
from steadytrain.errors import UserError
from steadytrain.rundir.schema import CONFIG_FIX, EVAL, check_config, check_depth, check_fields
from steadytrain.train.observe.metrics import MEASURED, plain_value

__all__ = ["check_config_mapping", "check_ids", "checkpoint_step", "eval_row"]

_CONFIG_FIX = "a key named as a steadytrain section (model, data, batch, optim, clip, run...) holds its keys: rename it"


def checkpoint_step(step: Any, ended: int) -> int:
    """The step ``run.checkpoint(step)`` saves: the last the loop ended (``ended``), which must be one (>= 1)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise UserError(f"run.checkpoint({brief(step)}): give the step as an integer (the last ended: {ended})")
    if ended == 0:
        raise UserError(f"run.checkpoint({step}): no step has ended yet: checkpoint after the first optimizer step")
    if step != ended:
        raise UserError(f"run.checkpoint({step}): the loop has ended step {ended}: checkpoint that one")
    return step


def eval_row(step: Any, metrics: dict[str, Any], ended: int, last_eval: int) -> dict[str, Any]:
    """The evaluation row ``run.log(step, val_loss=..., ...)`` writes: after a step the loop has ended, after the
    previous evaluation's step (``metrics.jsonl``'s readers take each kind of row in increasing steps), with a
    number for ``val_loss`` and a count for ``val_items``, and none of the keys a training row's Run measures."""
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= ended:
        raise UserError(
            f"run.log(step={brief(step)}, val_loss=...): give the step the evaluation follows, one the loop has "
            f"ended (1 to {ended})"
        )
    if step <= last_eval:
        raise UserError(
            f"run.log(step={step}, val_loss=...): an evaluation of step {last_eval} is written already: log one "
            "evaluation per step, in increasing steps"
        )
    row = {"step": step, "val_loss": plain_value("val_loss", metrics.pop("val_loss"))}
    row["val_items"] = plain_value("val_items", metrics.pop("val_items", 0))
    for key, value in metrics.items():
        if key in MEASURED and key not in EVAL:
            raise UserError(f"run.log({key}=..., val_loss=...): the Run measures {key} itself; use another name")
        row[key] = plain_value(key, value)
    check_fields(row, EVAL, "run.log(val_loss=...)", "give val_loss a number and val_items a count of examples")
    return row


def check_config_mapping(config: Any) -> dict[str, Any]:
    """The loop's ``config`` as ``config.yaml`` will hold it: a mapping of names to YAML data (numbers finite),
    whose keys named like a steadytrain section hold mappings (the readers of ``config.yaml`` take them so)."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise UserError(f"Run(config={type(config).__name__}): give a mapping (a dict of your run's settings) or None")
    data = dict(config)
    check_depth(data, "Run(config=...)")
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # the key of a NaN is named here: a NaN never reads back equal from YAML
        name, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise UserError(f"Run(config=...): {name}={node} is not a finite number: record it as a string")
        if isinstance(node, Mapping):
            for key, child in node.items():
                if not isinstance(key, str):
                    raise UserError(f"Run(config=...): key {brief(key)} under {name or 'the top'}: give string keys")
                stack.append((f"{name}.{key}" if name else key, child))
        elif isinstance(node, list | tuple):
            stack.extend((f"{name}[{i}]", child) for i, child in enumerate(node))
        elif not isinstance(node, str | int | float | bool) and node is not None:
            raise UserError(
                f"Run(config=...): {name}={brief(node)} is a {type(node).__name__}: give plain values (numbers, "
                "strings, lists, dicts; a tensor as a number)"
            )
    try:
        check_config(data, "Run(config=...)")
    except UserError as err:
        raise UserError(str(err).replace(CONFIG_FIX, _CONFIG_FIX)) from None
    try:
        text = dump_yaml(data)
    except Exception as err:  # a value YAML cannot write (an object, a tensor, a set)
        raise UserError(
            f"Run(config=...): {type(err).__name__}: {err}; give plain values (numbers, strings, lists, dicts)"
        ) from None
    back = parse_yaml(text, source="Run(config=...)", what="Run(config=...)")
    if back != data:
        old, new = flatten(data), flatten(back)
        key = next((k for k in old if k not in new or new[k] != old[k]), "a value")
        raise UserError(
            f"Run(config=...): {key}={brief(old.get(key))} does not read back from YAML as written "
            f"({brief(new.get(key))}): give plain numbers, strings, lists and dicts"
        )
    return data


def check_ids(name: str, value: Any) -> torch.Tensor:
    """``value`` as a 1-D int64 host tensor of example ids >= 0 (a list, a NumPy array or a tensor of integers, one
    per example: a column or a row of them is taken, a 2-D batch of token ids is not)."""
    import numpy as np

    plain = isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.ndim == 1 and value.numel()
    if plain and value.device.type == "cpu" and not value.requires_grad and int(value.min()) >= 0:
        return value  # the common case: one reduction, nothing copied
    try:
        t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise UserError(f"{name}={brief(value)}: not integers: give one integer id per example") from None
    if sum(d > 1 for d in t.shape) > 1:
        raise UserError(
            f"{name}: shape {tuple(t.shape)}: give one integer id per example (a 1-D list), not a batch of tokens"
        )
    if t.numel() == 0:
        raise UserError(f"{name}: no ids: give one integer id per example of the micro-batch, or None")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise UserError(f"{name}: {t.dtype} values: give integer example ids")
    t = t.reshape(-1).to(torch.int64)
    if int(t.min()) < 0:
        raise UserError(f"{name}: id {int(t.min())} is negative: give ids >= 0")
    return t
