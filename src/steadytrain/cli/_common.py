"""Shared pieces of the command line: the consoles and the error that exits 2."""

from __future__ import annotations

from rich.console import Console

from steadytrain.errors import UserError

# markup=False, highlight=False: data values (provenance, paths, field names) are printed verbatim,
# never read as rich markup ("s3://bucket/[/data]") or recoloured.
console = Console(markup=False, highlight=False, emoji=False)
err_console = Console(stderr=True, markup=False, highlight=False, emoji=False)

__all__ = ["UserError", "console", "err_console"]
