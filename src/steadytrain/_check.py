"""Argument checks shared by the layers: the error names the argument, the value and what is allowed."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int = 1, *, unit: str = "") -> int:
    """``value`` if it is an integer (not a bool) ``>= minimum``, else a ValueError naming ``name``.

    Example:
        >>> check_int("accumulation_steps", 4)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{unit}")
    return value
