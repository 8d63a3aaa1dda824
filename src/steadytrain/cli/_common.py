"""Shared pieces of the command line: the consoles, the error that exits 2, the number types of every flag."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from steadytrain._check import parse_int, parse_number
from steadytrain._text import one_line
from steadytrain.errors import UserError

# markup=False, highlight=False: data values (provenance, paths, field names) are printed verbatim,
# never read as rich markup ("s3://bucket/[/data]") or recoloured.
console = Console(markup=False, highlight=False, emoji=False)
err_console = Console(stderr=True, markup=False, highlight=False, emoji=False)

__all__ = ["Number", "UserError", "WholeNumber", "console", "err_console", "log_handler", "run_argument"]


class _OneLine(logging.Formatter):
    """Every log record on one line: a run directory or data value holding a newline or a terminal
    escape sequence is shown escaped, never interpreted by the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        return one_line(super().format(record))


def log_handler(prefix: str = "") -> logging.Handler:
    """The stderr handler every command logs through."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(f"{prefix}%(message)s"))
    return handler


def _existing(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A RUN that does not exist is refused here, before the command imports torch (a mistyped path answers in a
    fraction of a second, not after seconds of imports), in the words the library uses."""
    if value is not None and not Path(value).exists():
        raise UserError(f"{value}: no such run directory")
    return value


run_argument = click.argument("run", type=click.Path(file_okay=False), callback=_existing)
"""The RUN argument of every command that reads a run directory."""


class _Digits:
    """A number flag's text read by the project's one rule (:mod:`steadytrain._check`) before click's range check;
    no range in ``--help`` for a type without bounds (click's would read ``x<=None``)."""

    parse: Any = None
    """``parse_int`` or ``parse_number``: a ValueError naming the text and the rule."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            try:
                value = type(self).parse(value)
            except ValueError as err:
                self.fail(str(err), param, ctx)  # type: ignore[attr-defined]
        return super().convert(value, param, ctx)  # type: ignore[misc]

    def _describe_range(self) -> str:
        unbounded = self.min is None and self.max is None  # type: ignore[attr-defined]
        return "" if unbounded else super()._describe_range()  # type: ignore[misc]


class WholeNumber(_Digits, click.IntRange):
    """The type of every integer flag: digits 0-9 with an optional sign, as in a config and a mesh
    (:func:`steadytrain._check.parse_int`: ``int()`` alone would take ``1_0`` as 10 and ``٣`` as 3), within
    ``[min, max]`` like ``click.IntRange``."""

    parse = staticmethod(parse_int)


class Number(_Digits, click.FloatRange):
    """The type of every number flag: digits 0-9 as in a config (:func:`steadytrain._check.parse_number`:
    ``float()`` alone would take ``1_0``, ``٣``, ``nan`` and ``inf``), within ``[min, max]`` like
    ``click.FloatRange``."""

    parse = staticmethod(parse_number)
