"""The keyword settings of :class:`steadytrain.Run`, checked at once: a wrong name or value is one line naming it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from steadytrain._check import check_int
from steadytrain._imports import SPEC
from steadytrain.errors import UserError
from steadytrain.train.observe.trackers import TRACKERS

__all__ = ["RunSettings"]

SPIKE_POLICIES = ("off", "warn", "skip")
INT64_MAX = 2**63 - 1
"""The largest shard size and seed: example ids are int64, and a seed seeds torch's int64 generators."""


@dataclass(frozen=True)
class RunSettings:
    """Everything a Run takes beyond its model, optimizer, scheduler, accumulator, config and resume."""

    accumulation_steps: int = 1
    """Micro-batches per optimizer step of the accumulator the Run makes (with yours: yours)."""
    max_grad_norm: float | None = None
    """The global-norm clip of the accumulator the Run makes."""
    on_nonfinite: str = "skip"
    """``skip``, ``raise`` or ``ignore`` (the accumulator the Run makes)."""
    shard_size: int = 1000
    """Example ids map to shards of this many (id // shard_size): what ``nan report`` attributes to."""
    spike: Mapping[str, Any] | str = "off"
    """``off``, ``warn``, ``skip``, or a mapping of the trainer's ``spike`` keys (``policy``, ``window``,
    ``threshold``, ``min_ratio``, ``metric``). ``rollback`` needs the trainer's loop (it restarts the data)."""
    layers: bool = False
    """Per-layer gradient, weight and update norms to ``layers.jsonl`` every ``layers_every`` steps."""
    layers_every: int | None = None
    """Default: ``log_every``."""
    watchdog_s: float | None = None
    """The hang watchdog (with a process group): seconds without progress; None: 600 under torchrun, 0: off."""
    log_every: int = 10
    """Steps per ``metrics.jsonl`` write (one all-reduce and one host read of the losses per write)."""
    trackers: tuple[str, ...] = ()
    """Experiment trackers: ``tensorboard``, ``wandb``, ``mlflow``."""
    mlflow_uri: str | None = None
    total_steps: int | None = None
    """The steps the loop plans (a progress line and ``plan.json``; optional)."""
    seed: int = 0
    """Where the random streams are derived from when a resume runs on another world size."""
    sampler: Any = None
    """The loop's data position (a :class:`~steadytrain.data.GlobalSampler`, or anything with ``state_dict`` and
    ``load_state_dict``): checkpointed as the run's data position."""
    state: Mapping[str, Any] = field(default_factory=dict)
    """More stateful parts by name (``state_dict()`` of JSON data), checkpointed and restored."""
    model_factory: str | None = None
    """``package.module:function`` that builds the model (recorded for the commands that replay it)."""
    dataset: str | None = None
    """``package.module:function`` returning the map-style dataset whose item ``i`` is example id ``i`` (a dict of
    tensors, the batch ``model_factory``'s model takes): recorded, and with ``model_factory`` what ``nan hunt``
    replays a refused step or a shard of this run with."""
    report: bool = True
    """Write ``summary.md`` and ``plots/`` at close."""
    keep_last: int = 3
    async_checkpoint: bool = True
    callbacks: tuple[Any, ...] = ()
    """Objects (or ``package.module:factory`` specs) with ``on_step_end(run)``, ``on_evaluate(run, row)``,
    ``on_checkpoint(run, step)`` (see :mod:`steadytrain.train.observe.callbacks`)."""

    @classmethod
    def build(cls, given: dict[str, Any]) -> RunSettings:
        names = {f.name for f in fields(cls)}
        if unknown := sorted(set(given) - names):
            raise UserError(f"Run({unknown[0]}=...): no such setting; the settings are: {', '.join(sorted(names))}")
        s = cls(**given)
        s.check()
        return s

    def check(self) -> None:
        for name in ("accumulation_steps", "shard_size", "log_every", "keep_last"):
            check_int(f"Run({name})", getattr(self, name), 1, maximum=INT64_MAX if name == "shard_size" else None)
        for name in ("layers_every", "total_steps"):
            if getattr(self, name) is not None:
                check_int(f"Run({name})", getattr(self, name), 1 if name == "layers_every" else 0)
        check_int("Run(seed)", self.seed, 0, maximum=INT64_MAX)
        if self.max_grad_norm is not None and not _positive(self.max_grad_norm):
            raise UserError(f"Run(max_grad_norm={self.max_grad_norm!r}): give a finite number > 0, or None")
        if self.watchdog_s is not None and (not _number(self.watchdog_s) or self.watchdog_s < 0):
            raise UserError(f"Run(watchdog_s={self.watchdog_s!r}): give seconds >= 0 (0: off), or None")
        if self.on_nonfinite not in ("skip", "raise", "ignore"):
            raise UserError(f"Run(on_nonfinite={self.on_nonfinite!r}): give skip, raise or ignore")
        for flag in ("layers", "report", "async_checkpoint"):
            if not isinstance(getattr(self, flag), bool):
                raise UserError(f"Run({flag}={getattr(self, flag)!r}): give True or False")
        if not isinstance(self.trackers, list | tuple) or not all(t in TRACKERS for t in self.trackers):
            raise UserError(f"Run(trackers={self.trackers!r}): give a list of {', '.join(TRACKERS)} ([]: none)")
        for name in ("model_factory", "dataset", "mlflow_uri"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or "\n" in value or "\x00" in value):
                raise UserError(f"Run({name}={value!r}): give one line of text, or None")
        for name in ("model_factory", "dataset"):
            value = getattr(self, name)
            if value is not None and not SPEC.match(value):
                raise UserError(f"Run({name}={value!r}): give package.module:function")
        if not isinstance(self.state, Mapping) or not all(isinstance(k, str) and k for k in self.state):
            raise UserError("Run(state=...): give a mapping of names to stateful objects")
        for name, part in {"sampler": self.sampler, **dict(self.state)}.items():
            if part is not None and not (hasattr(part, "state_dict") and hasattr(part, "load_state_dict")):
                raise UserError(f"Run state {name!r} ({type(part).__name__}) has no state_dict/load_state_dict")
        self.spike_config()

    def spike_config(self) -> Any:
        """The trainer's ``spike`` section these settings give (checked as the trainer checks it)."""
        from pydantic import ValidationError

        from steadytrain.train.setup.config import SpikeConfig, error_line

        given = {"policy": self.spike} if isinstance(self.spike, str) else self.spike
        if not isinstance(given, Mapping):
            raise UserError(f"Run(spike={self.spike!r}): give {', '.join(SPIKE_POLICIES)} or a mapping of spike keys")
        given = {"policy": "off", **given}
        if given["policy"] not in SPIKE_POLICIES:
            raise UserError(
                f"Run(spike policy={given['policy']!r}): give {', '.join(SPIKE_POLICIES)} (rollback restarts the "
                "data from a checkpoint, which only steadytrain train's loop can do)"
            )
        try:
            return SpikeConfig(**given)
        except ValidationError as err:
            raise UserError(error_line(err, "Run(spike=...)")) from None
        except TypeError as err:
            raise UserError(f"Run(spike=...): {err}") from None


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: Any) -> bool:
    return _number(x) and x > 0
