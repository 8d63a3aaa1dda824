"""Argument checks shared by the layers: the error names the argument, the value and what is allowed."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Any

from steadytrain._io import brief
from steadytrain.errors import UserError

MAX_SEQ_LEN = 4096
"""The longest sequence (tokens a model sees per window): the bound of the training config's ``data.seq_len``
and of ``data ingest --seq-len``."""


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


_KINDS = {str: "a string", bool: "true or false", dict: "a mapping", list: "a list"}


def check_type(name: str, value: object, kind: type) -> Any:
    """``value`` if it is a ``kind`` (``str``, ``bool``, ``dict`` or ``list``; a bool is not an int here), else a
    :class:`UserError` naming ``name``, what it must be and the type given.

    Example:
        >>> check_type("reason", "nan", str)
        'nan'
    """
    if not isinstance(value, kind):
        raise UserError(f"{name}={brief(value)} must be {_KINDS[kind]} ({type(value).__name__} given)")
    return value


MAX_WEIGHT_DIGITS = 60
"""A weight's exact fraction has at most this many digits in numerator and denominator."""


def exact_weight(name: str, value: object, *, zero: bool = False) -> Fraction:
    """``value`` as an exact fraction (a float as written: ``0.1`` is 1/10), or a :class:`UserError` naming ``name``.

    Example:
        >>> exact_weight("weight", 0.25)
        Fraction(1, 4)
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{name}={value!r} is not a number: give a weight > 0")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{name}={value!r} is not a finite number: give a weight > 0")
    frac = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    if frac < 0 or (frac == 0 and not zero):
        raise UserError(f"{name}={value!r} must be {'>= 0' if zero else '> 0'}")
    if max(len(str(frac.numerator)), len(str(frac.denominator))) > MAX_WEIGHT_DIGITS:
        raise UserError(f"{name}={value!r} is too large or too small a weight: give weights within 1e-30 .. 1e30")
    return frac


INT_TEXT = r"[-+]?[0-9]+"
"""How an integer is written, everywhere a user writes one (a config's YAML, ``--set``, a flag, a mesh): ASCII digits
0-9 with an optional sign. ``2_0``, ``0x10``, ``1:30``, ``1e3``, spaces and other scripts' digits (``٣``) are not."""
FLOAT_TEXT = r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
"""How a number is written (YAML 1.2's core schema): ``10``, ``-0.5``, ``.5``, ``3e-4``, ``1.5E+3``."""
_MAX_DIGITS = 100  # int() refuses more than 4300 digits, slowly; no count the project takes has more than 20


def parse_int(text: str) -> int:
    """``text`` as an integer if it is written as :data:`INT_TEXT` says, else a ValueError naming it and the rule.

    Example:
        >>> parse_int("-12")
        -12
    """
    if not isinstance(text, str) or not re.fullmatch(INT_TEXT, text):
        raise ValueError(f"{brief(text)} is not a whole number: write it in digits 0-9 (e.g. 10)")
    if len(text) > _MAX_DIGITS:
        raise ValueError(f"{brief(text)} is too large: {len(text)} digits (at most {_MAX_DIGITS})")
    return int(text)


def parse_number(text: str) -> float:
    """``text`` as a finite float if it is written as :data:`FLOAT_TEXT` says, else a ValueError naming it.

    Example:
        >>> parse_number("3e-4")
        0.0003
    """
    if not isinstance(text, str) or not re.fullmatch(FLOAT_TEXT, text):
        raise ValueError(f"{brief(text)} is not a number: write it in digits 0-9 (e.g. 10, 0.5 or 3e-4)")
    out = float(text)  # float() of many digits is fast (unlike int()): 1e400 is inf, said below
    if not math.isfinite(out):
        raise ValueError(f"{brief(text)} is too large a number: at most about 1.8e308")
    return out
