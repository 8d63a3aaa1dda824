"""What the command-line tests share: the installed command, one command run in this process, the shape of a
user error.

:func:`in_process` runs ``steadytrain.cli.main(argv)`` in the test process: no 3.5 s of imports per launch. What a
command may leave behind in the process is put back after each call: environment variables, ``sys.path``, the
working directory, torch's determinism flag, thread count and CPU random state, the loggers' handlers and levels,
warning filters, the SIGINT/SIGTERM handlers, and modules imported from the call's own ``PYTHONPATH`` (a test's
user-model modules, which the next call may write anew under the same name). :func:`forget_user_modules` drops the
modules a test imported from outside the repository and the installation, once the test is done with them. Torch runs on
one thread during the call, as a launched command does under ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch

EXE = str(Path(sys.executable).with_name("steadytrain"))
ROOT = Path(__file__).resolve().parents[1]
_INSTALLED = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, ROOT / "src"})
_KEEP = (str(ROOT), *_INSTALLED)


def assert_user_error(proc: subprocess.CompletedProcess, *words: str, code: int = 2) -> None:
    """Exit ``code``, exactly one line on stderr holding every one of ``words``, no traceback."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def _loggers() -> dict[str, tuple[list, int, bool]]:
    names = ["", "steadytrain", *[n for n in logging.root.manager.loggerDict if n.startswith("steadytrain.")]]
    return {n: (list(lg.handlers), lg.level, lg.propagate) for n in names for lg in [logging.getLogger(n or None)]}


def _outside(mod: object, roots: tuple[str, ...] | None = None) -> bool:
    """Whether ``mod`` was loaded from under ``roots`` (None: from outside the repository and the installation)."""
    file = getattr(mod, "__file__", None)
    if not file:
        return False
    where = str(Path(file).resolve())
    if roots is None:
        return not where.startswith(_KEEP)
    # A PYTHONPATH may hold the repository, whose .venv and src/ are the installation: never forget those.
    return where.startswith(roots) and not where.startswith(_INSTALLED)


@contextlib.contextmanager
def isolated(env: dict[str, str] | None = None):
    """The process-global state a command changes, restored on exit (see the module docstring)."""
    saved_env, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    deterministic, threads, rng = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), None
    rng = torch.get_rng_state()
    loggers, filters, modules = _loggers(), list(warnings.filters), set(sys.modules)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    env = dict(env or {})
    extra_path = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.update(env)
    sys.path[:0] = extra_path
    importlib.invalidate_caches()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = path
        os.chdir(cwd)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        for name in set(_loggers()) | set(loggers):
            lg = logging.getLogger(name or None)
            lg.handlers[:], lg.level, lg.propagate = loggers.get(name, ([], logging.NOTSET, True))
        warnings.filters[:] = filters
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        roots = tuple(str(Path(p).resolve()) for p in extra_path)
        for name in set(sys.modules) - modules:
            if roots and _outside(sys.modules.get(name), roots):
                del sys.modules[name]


@contextlib.contextmanager
def forget_user_modules():
    """Modules first imported inside the block from outside the repository and the Python installation are
    dropped at its end (a test's user models: the next test may write others under the same name)."""
    before = set(sys.modules)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if _outside(sys.modules.get(name)):
                del sys.modules[name]


def in_process(*argv: str, **env: str) -> subprocess.CompletedProcess:
    """``steadytrain ARGV`` through ``main(argv)`` in this process: its exit code, stdout and stderr."""
    from steadytrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    args = [str(a) for a in argv]
    with isolated(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return subprocess.CompletedProcess([EXE, *args], code, out.getvalue(), err.getvalue())


def launched(*argv: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """``steadytrain ARGV`` as its own process (``OMP_NUM_THREADS=1``): where the process is the point."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([EXE, *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=full)
