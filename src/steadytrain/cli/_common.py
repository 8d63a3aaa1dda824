"""Shared pieces of the command line: the console and the error that exits 2."""

from __future__ import annotations

import click
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


class UserError(click.ClickException):
    """Bad input from the user: one line on stderr, exit code 2."""

    exit_code = 2
