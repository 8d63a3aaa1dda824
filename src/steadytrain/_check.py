"""Argument checks shared by the layers: the error names the argument, the value and what is allowed."""

from __future__ import annotations

import math
import numbers

from steadytrain._io import brief
from steadytrain.errors import UserError


def check_int(name: str, value: object, minimum: int = 1, *, unit: str = "", maximum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[minimum, maximum]``, else a :class:`UserError` naming ``name``.

    Example:
        >>> check_int("accumulation_steps", 4)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name}={brief(value)} must be an integer >= {minimum}{unit}")
    if maximum is not None and value > maximum:
        raise UserError(f"{name}={brief(value)} is too large: at most {maximum}{unit}")
    return value


def check_finite(name: str, value: object, *, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite float (``> minimum`` if ``strict``, else ``>=``), or a :class:`UserError` naming ``name``.

    Overflow (``10**400``), NaN, infinities, bools and non-numbers are all refused.

    Example:
        >>> check_finite("eps", 1e-6, minimum=0.0)
        1e-06
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name}={brief(value)} must be a number ({type(value).__name__} given)")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{name}={brief(value)} is not a finite number") from None
    if not math.isfinite(out):
        raise UserError(f"{name}={brief(value)} is not a finite number")
    if minimum is not None and (out <= minimum if strict else out < minimum):
        raise UserError(f"{name}={brief(value)} must be {'>' if strict else '>='} {minimum}")
    return out


def check_text(name: str, value: object) -> str:
    """``value`` if it is a string, else a :class:`UserError` naming ``name`` and the type given."""
    if not isinstance(value, str):
        raise UserError(f"{name}={brief(value)} must be a string ({type(value).__name__} given)")
    return value


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool (not 0/1), else a :class:`UserError` naming ``name``."""
    if not isinstance(value, bool):
        raise UserError(f"{name}={brief(value)} must be true or false ({type(value).__name__} given)")
    return value


def check_mapping(name: str, value: object) -> dict:
    """``value`` if it is a mapping (a JSON object), else a :class:`UserError` naming ``name``."""
    if not isinstance(value, dict):
        raise UserError(f"{name}={brief(value)} must be a mapping ({type(value).__name__} given)")
    return value
