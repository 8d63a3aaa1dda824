"""Fixtures every test module may use, and how ``make test`` spreads the suite over the machine's cores.

``cli``: runs ``steadytrain.cli.main(argv)`` in the test process (no 3.5 s of imports per launch) and
returns the exit code, stdout and stderr (:func:`tests.cli_utils.in_process`, which puts back what a command
changes in the process: environment, ``sys.path``, torch's determinism flag, threads and random state,
loggers, warning filters, signal handlers, user-model modules).
"""

from __future__ import annotations

import pytest

from tests.cli_utils import forget_user_modules, in_process

RANKS = "ranks"
"""The pytest-xdist group of every test marked ``distributed`` (it starts ranks of its own)."""


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) the tests that start ranks of their own
    share one worker, one at a time, so two 2-rank jobs never share the two cores; every other module's tests stay
    together on one worker (a module fixture is built once)."""
    for item in items:
        group = RANKS if item.get_closest_marker("distributed") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _fresh_user_modules():
    """Every test's user-model modules are forgotten after it: the next test may write others under the same name."""
    with forget_user_modules():
        yield


@pytest.fixture
def cli():
    """``cli(*argv) -> CompletedProcess``: the command line, in this process."""
    return in_process
