"""Shared pieces of the command line: the consoles and the error that exits 2."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
from rich.console import Console

from steadytrain._text import one_line
from steadytrain.errors import UserError

# markup=False, highlight=False: data values (provenance, paths, field names) are printed verbatim,
# never read as rich markup ("s3://bucket/[/data]") or recoloured.
console = Console(markup=False, highlight=False, emoji=False)
err_console = Console(stderr=True, markup=False, highlight=False, emoji=False)

__all__ = ["UserError", "console", "err_console", "log_handler", "run_argument"]


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
