"""Fixtures every test module may use.

``cli``: runs ``steadytrain.cli.main(argv)`` in the test process (no 3.5 s of imports per launch) and
returns the exit code, stdout and stderr. After each test it resets the process-global state a
command leaves behind: torch's determinism flag and thread count, the ``steadytrain`` loggers'
handlers and levels, and user-model modules imported from a test's temporary directory.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import pytest
import torch


@dataclass
class CliResult:
    """What one in-process command gave: ``returncode``, ``stdout``, ``stderr`` (as a subprocess has)."""

    returncode: int
    stdout: str
    stderr: str


def _logger_state() -> dict[str, tuple[list, int, bool]]:
    names = ["steadytrain", *[n for n in logging.root.manager.loggerDict if n.startswith("steadytrain.")]]
    return {n: (list(lg.handlers), lg.level, lg.propagate) for n in names for lg in [logging.getLogger(n)]}


@pytest.fixture
def cli(capsys, tmp_path):
    """``cli(*argv) -> CliResult``: the command line, in this process."""
    from steadytrain.cli import main

    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    loggers = _logger_state()
    modules = set(sys.modules)
    path = list(sys.path)

    def run(*argv: str) -> CliResult:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    yield run
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)
    for name, lg in [(n, logging.getLogger(n)) for n in _logger_state()]:
        handlers, level, propagate = loggers.get(name, ([], logging.NOTSET, True))
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        mod = sys.modules.get(name)
        if str(getattr(mod, "__file__", "") or "").startswith(str(tmp_path.parent)):
            del sys.modules[name]
