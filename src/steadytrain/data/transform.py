"""The user's micro-batch transform (``data.transform: package.module:function``), applied and checked.

``transform(mb) -> mb`` takes a micro-batch (a dict of column -> tensor or list, ``shard`` and ``index``
included) and returns one of the same length. It runs where the micro-batch is read: in the training
process, or in each background worker (:mod:`steadytrain.data.loader`). Its own exceptions keep their
type, with a note naming the micro-batch and its shards; what it returns is checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from steadytrain._imports import import_callable
from steadytrain._io import brief
from steadytrain.errors import UserError

__all__ = ["Transform", "apply_transform", "load_transform"]

Transform = Callable[[dict[str, Any]], dict[str, Any]]


def load_transform(spec: Any) -> Transform | None:
    """``None``, a callable, or ``package.module:function`` imported now (a UserError naming ``data.transform``)."""
    if spec is None or callable(spec):
        return spec
    return import_callable(spec, "data.transform", "give package.module:function (micro-batch dict -> dict)")


def _rows(value: Any) -> str | int:
    """The number of rows of a transformed column (an int), or what it is instead (a str)."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        return "0-dim tensor (no rows)"
    try:
        return len(value)
    except TypeError:
        return f"{type(value).__name__} (no rows)"


def apply_transform(transform: Transform, cols: dict[str, Any], where: str) -> dict[str, Any]:
    """``transform(cols)``, checked: a dict of columns of the micro-batch's length, ``shard``/``index`` kept.

    ``where`` names the micro-batch in messages (e.g. ``micro-batch 3 of epoch 0 (shards [4, 7])``).
    """
    try:
        out = transform(cols)
    except Exception as err:  # the user's own error keeps its type (an OOM stays an OOM), told where
        if hasattr(err, "add_note"):
            err.add_note(f"steadytrain: raised by the transform on {where}")
        raise
    if not isinstance(out, dict):
        raise UserError(f"transform returned {type(out).__name__} on {where}, not a dict of columns: return mb")
    if dropped := [c for c in ("shard", "index") if c not in out]:
        raise UserError(f"transform dropped {dropped[0]!r} on {where}: keep it, it names each example's source")
    n = len(cols["shard"])
    for key, value in out.items():
        if not isinstance(key, str):
            raise UserError(f"transform returned column {brief(key)}: a column name is not a string")
        rows = _rows(value)
        if rows != n:
            what = f"{rows} rows" if isinstance(rows, int) else rows
            raise UserError(f"transform changed the batch length on {where}: {key!r} has {what}, not {n} rows")
    return out
