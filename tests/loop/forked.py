"""A loop killed with SIGKILL in a process of its own, without a new interpreter's imports: a fork of the test's.

The child runs ``fn(*args)`` and ends with its exit code (a SIGKILL it sends itself: ``-9``); the parent has
imported torch and steadytrain already, so the child starts in milliseconds where a fresh ``python`` takes seconds.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any


def _child(fn: Callable[..., Any], args: tuple) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        fn(*args)
    except BaseException:
        os._exit(1)
    os._exit(0)


def exit_code(fn: Callable[..., Any], *args: Any, timeout: float = 300) -> int | None:
    """Run ``fn(*args)`` in a forked child; its exit code (``-9``: killed by SIGKILL; None: still running at
    ``timeout``, then killed)."""
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(fn, args))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None
    return proc.exitcode
