"""Fixtures every test module may use.

``cli``: runs ``steadytrain.cli.main(argv)`` in the test process (no 3.5 s of imports per launch) and
returns the exit code, stdout and stderr (:func:`tests.cli_utils.in_process`, which puts back what a command
changes in the process: environment, ``sys.path``, torch's determinism flag, threads and random state,
loggers, warning filters, signal handlers, user-model modules).
"""

from __future__ import annotations

import pytest

from tests.cli_utils import in_process


@pytest.fixture
def cli():
    """``cli(*argv) -> CompletedProcess``: the command line, in this process."""
    return in_process
