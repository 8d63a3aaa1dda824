"""The one error type for bad input from a user: a file, a field, a flag or an argument.

Every library error a person can cause and fix (``DatasetError``, ``SchemaError``, ``ContractError``,
``ManifestError``, ...) is a :class:`UserError`. The command line prints its message as one line on
stderr and exits 2, with no traceback; the message names the file or field, the value and the fix.
It subclasses ``ValueError`` so code that caught ``ValueError`` keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: the message names what was wrong (file, field, value) and how to fix it."""

    exit_code = 2
