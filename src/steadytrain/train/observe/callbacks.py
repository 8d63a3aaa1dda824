"""Your code at a run's moments, in ``steadytrain train`` and in a :class:`steadytrain.Run` alike.

``run.callbacks: [package.module:factory, ...]`` (or ``Run(callbacks=[...])``, objects or the same specs): each
factory is called once with no argument and returns an object with any of ``on_step_end(run)``,
``on_evaluate(run, row)`` and ``on_checkpoint(run, step)``. ``run`` is the run in progress: ``run.step``,
``run.path``, ``run.model``, ``run.optimizer``, ``run.config``, ``run.rank``, ``run.is_main`` and
``run.log(step, **keys)``, which adds keys to that step's ``metrics.jsonl`` row (e.g. a sample's text). Every rank
calls them at the same points (a callback may hold a collective). One that raises is logged with its error and is
off for the rest of the run: your code never takes a run down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from steadytrain._imports import import_callable
from steadytrain._text import error_text
from steadytrain.errors import UserError

__all__ = ["EVENTS", "Callbacks", "load_callbacks"]

log = logging.getLogger("steadytrain.train")

EVENTS = ("on_step_end", "on_evaluate", "on_checkpoint")


def load_callbacks(specs: Sequence[Any], key: str = "run.callbacks") -> Callbacks:
    """The callbacks ``specs`` name (``package.module:factory`` strings, or objects already built)."""
    built = []
    for i, spec in enumerate(specs or ()):
        if isinstance(spec, str):
            factory = import_callable(spec, f"{key}[{i}]", "give package.module:factory")
            try:
                spec = factory()
            except Exception as err:  # the user's factory: its error, named
                raise UserError(
                    f"{key}[{i}]={spec!r}: the factory raised {type(err).__name__}: {error_text(err)}"
                ) from None
        if not any(callable(getattr(spec, e, None)) for e in EVENTS):
            raise UserError(f"{key}[{i}]: {type(spec).__name__} has none of {', '.join(EVENTS)}: nothing to call")
        built.append(spec)
    return Callbacks(built)


class Callbacks:
    """The loaded callbacks; :meth:`call` runs one event on each that has it."""

    def __init__(self, found: list[Any]) -> None:
        self.found = found

    def __bool__(self) -> bool:
        return bool(self.found)

    def call(self, event: str, run: Any, *args: Any) -> None:
        for cb in list(self.found):
            fn = getattr(cb, event, None)
            if not callable(fn):
                continue
            try:
                fn(run, *args)
            except UserError:
                raise  # a refusal of the run's own API (run.log misused): the user's to fix, said as such
            except Exception as err:
                log.warning(
                    "callback %s: %s raised %s: %s; it is off for the rest of this run",
                    type(cb).__name__, event, type(err).__name__, error_text(err),
                )  # fmt: skip
                self.found.remove(cb)
