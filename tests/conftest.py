"""Fixtures every test module may use, and how ``make test`` spreads the suite over the machine's cores.

``tiny_run``: ``tiny_run(*items) -> Path``, a finished TINY run on a small text dataset (``tiny_data``), trained
once per distinct ``items`` for the whole session (per worker); a test that changes it works on ``copy_run(run, ...)``.

``planted``: the runs of :mod:`tests.planted` (a cause planted on rank 1 of 2 gloo ranks, and a clean run), trained
once per session on one spawned pair.

``cli``: runs ``steadytrain.cli.main(argv)`` in the test process (no 3.5 s of imports per launch) and
returns the exit code, stdout and stderr (:func:`tests.cli_utils.in_process`, which puts back what a command
changes in the process: environment, ``sys.path``, torch's determinism flag, threads and random state,
loggers, warning filters, signal handlers, user-model modules).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_utils import forget_user_modules, in_process
from tests.train_utils import TINY, train, write_text_dataset

RANKS = "ranks"
"""The pytest-xdist group of every test marked ``distributed`` (it starts ranks of its own)."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the items
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) the tests that start ranks of their own
    share one worker, one at a time, so two 2-rank jobs never share the two cores; every other module's tests stay
    together on one worker (a module fixture is built once)."""
    for item in items:
        group = RANKS if item.get_closest_marker("distributed") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # The ranks group is the longest and runs on one worker: first, so it does not end the run alone.
    items.sort(key=lambda item: not item.get_closest_marker("distributed"))


@pytest.hookimpl(trylast=True)  # after pytest-xdist has written the groups into the test ids
def pytest_collection_finish(session):
    """Refuse a run whose groups did not take: ranks on both workers would share the two cores, silently slower."""
    if not getattr(session.config.option, "loadgroup", False) or not session.items:
        return
    if not any("@" in item.nodeid for item in session.items):
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup did not apply the test groups under pytest {pytest.__version__}; "
            "install the pytest that pyproject.toml's dev extra names (pip install -e '.[dev]')"
        )


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test runs torch on one thread, as a launched command does under ``OMP_NUM_THREADS=1``: the suite runs
    one test per core (``-n 2``), and two threads each would oversubscribe them (a spawned rank sets its own)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_user_modules():
    """Every test's user-model modules are forgotten after it: the next test may write others under the same name."""
    with forget_user_modules():
        yield


@pytest.fixture
def cli():
    """``cli(*argv) -> CompletedProcess``: the command line, in this process."""
    return in_process


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """400 byte sequences (33 bytes) of this project's source in 4 shards."""
    return write_text_dataset(tmp_path_factory.mktemp("tiny-data"), [100] * 4)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_data):
    """``tiny_run(*items) -> Path``: a finished run of ``TINY`` on ``tiny_data`` with ``items`` set (``key=value``),
    trained the first time these items are asked for and shared after. Treat it as read-only: copy it to change it."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*items: str) -> Path:
        if items not in runs:
            where = tmp_path_factory.mktemp("tiny-run") / "run"
            train(where, *TINY, f"data.path={tiny_data}", *items)
            runs[items] = where
        return runs[items]

    return run


@pytest.fixture(scope="session")
def planted(tmp_path_factory):
    """:class:`tests.planted.Planted`: the planted-cause runs, trained the first time a test asks for them."""
    from tests.planted import train_planted

    return train_planted(tmp_path_factory.mktemp("planted"))
