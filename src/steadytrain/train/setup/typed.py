"""The base of every config section: unknown keys refused, every field documented, and one rule for numbers.

Wherever a field takes a number (``int``, ``float``, optional or not, in a list, a tuple or a mapping's values), the
value must be one: text is refused (``'10'``, and ``2_0``, ``0x10`` or ``1:30``, which the config's YAML reads as text:
:mod:`steadytrain._yamlio`), so is ``true``/``false`` (pydantic would take them as 1 or 0), a float where an integer
goes (``3.0``, ``1e3``: write ``3``, ``1000``), NaN and the infinities (``allow_inf_nan=False`` for every section).
Pydantic, left alone, converts ``'10'``, ``true`` and ``3.0`` silently; this rule is checked before it, for every
field of every section at once, so a new key cannot miss it.
"""

from __future__ import annotations

import math
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from steadytrain._text import brief

__all__ = ["Section", "number_problem"]


def _scalar(annotation: Any, value: Any) -> str | None:
    """What ``value`` is instead of the ``int`` or ``float`` ``annotation`` says (None: a number, or for pydantic to
    say: a fraction for an int, NaN or an infinity, a bound), written to follow ``key=value: ``."""
    whole = annotation is int
    if isinstance(value, bool):
        return "a flag, not a number: give a number"
    if isinstance(value, str):
        kind, example = ("an integer", "10") if whole else ("a number", "10, 0.5 or 3e-4")
        why = "YAML reads '10', 2_0 and 0x10 as text"
        return f"text, not {kind} ({why}): write it in digits 0-9 without quotes (e.g. {example})"
    if whole and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return f"a float (as 3.0 and 1e3 are), not an integer: write it as {int(value)}"
    if not whole and isinstance(value, int) and value.bit_length() > 1000:  # float() would overflow (at 1024)
        return "too large a number: at most about 1e300"
    return None


def number_problem(annotation: Any, value: Any) -> tuple[str, str] | None:
    """Where and what ``value`` is instead of the number a field of type ``annotation`` takes, or None:
    ``("", message)`` for the value itself, ``("'a': '3'", message)`` for an item of a mapping or a list.

    Example:
        >>> number_problem(int | None, 3.0)
        ('', 'a float (as 3.0 and 1e3 are), not an integer: write it as 3')
        >>> number_problem(dict[str, float], {"a": 1, "b": True})
        ("'b': true", 'a flag, not a number: give a number')
        >>> number_problem(int | Literal["auto"] | None, "auto") is None
        True
    """
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return number_problem(args[0], value)
    if origin in (Union, types.UnionType):  # a number or None, or also a word (``int | Literal["auto"]``)
        words = [w for a in args if get_origin(a) is Literal for w in get_args(a)]
        rest = [a for a in args if a is not type(None) and get_origin(a) is not Literal]
        if value is None or value in words or len(rest) != 1:
            return None
        return number_problem(rest[0], value)
    if annotation in (int, float):
        problem = _scalar(annotation, value)
        return None if problem is None else ("", problem)
    items: list[tuple[str, Any, Any]] = []
    if origin is dict and isinstance(value, dict):
        items = [(brief(k), args[1], v) for k, v in value.items()]
    elif origin in (list, tuple) and isinstance(value, list | tuple):
        each = args[:1] * len(value) if origin is list or args[1:] == (Ellipsis,) else args
        items = [(f"item {i}", kind, v) for i, (kind, v) in enumerate(zip(each, value, strict=False))]
    for where, kind, item in items:
        if (found := number_problem(kind, item)) is not None:
            shown = str(item).lower() if isinstance(item, bool) else brief(item)
            return f"{where}: {shown}" if not found[0] else f"{where}: {found[0]}", found[1]
    return None


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _a_number_is_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Text, a flag or a float for an integer where a number goes is a mistake (pydantic would convert them)."""
        field = cls.model_fields.get(info.field_name or "")
        found = number_problem(field.annotation, value) if field is not None else None
        if found is None:
            return value
        where, problem = found
        if where:  # inside a mapping or a list: the line names the item
            raise ValueError(f"{where} is {problem}")
        if isinstance(value, bool):  # `key: true is a flag, ...`, as pydantic's own messages would not say
            raise ValueError(f"{str(value).lower()} is {problem}")
        raise PydanticCustomError("not_a_number", problem)  # `key=value: text, not a number ...`
