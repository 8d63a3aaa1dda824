"""Strict JSON, the one parser of every JSON file and JSON-lines record the project reads (:mod:`steadytrain._io`):
no NaN/Infinity, no number that overflows to infinity, no key twice in one object; every problem one
:class:`~steadytrain.errors.UserError` naming where."""

from __future__ import annotations

import json
import math
from typing import Any

from steadytrain._text import brief, one_line
from steadytrain.errors import UserError

__all__ = ["parse_json"]


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 would silently become inf
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json.loads would keep the last one silently
            raise ValueError(f"key {brief(key)} is given twice in one object")
        out[key] = value
    return out


def parse_json(text: str, where: str, what: str) -> Any:
    """Strict JSON: no NaN/Infinity, no number that overflows to infinity, no key twice in one object."""
    try:
        return json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except json.JSONDecodeError as err:
        line = f"line {err.lineno}: " if "\n" in text.strip() else ""
        raise UserError(f"{where}: {what} is not valid JSON ({line}{err.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: {what} nests too deeply to be read") from None
    except ValueError as err:
        raise UserError(f"{where}: {what} is not valid JSON ({one_line(err)})") from None
