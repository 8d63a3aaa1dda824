"""The recorder behind :class:`steadytrain.integrations.hf.SteadytrainCallback`: a plain class (no transformers
import) whose ``on_*`` methods follow a Hugging Face ``Trainer``'s events and write the run through an open
:class:`steadytrain.Run` (:mod:`steadytrain.loop.external`). What it writes, prevents and cannot prevent: see
:mod:`steadytrain.integrations.hf`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.accumulate.events import NONFINITE_LOSS, NONFINITE_NORM, NonFiniteEvent, NonFiniteGradientError
from steadytrain.clip import global_grad_norm
from steadytrain.errors import UserError
from steadytrain.loop import external
from steadytrain.loop.opening import check_config_mapping
from steadytrain.loop.run import Run
from steadytrain.loop.settings import RunSettings
from steadytrain.train.observe.metrics import MEASURED

__all__ = ["Recorder"]

log = logging.getLogger("steadytrain.integrations")

ARGS_KEY = "training_arguments"
"""Where ``config.yaml`` holds the ``TrainingArguments``."""
OWNED = {"accumulation_steps": "gradient_accumulation_steps", "max_grad_norm": "max_grad_norm",
         "total_steps": "max_steps"}  # fmt: skip
"""Run settings the ``TrainingArguments`` give (their names there)."""
NOT_HERE = {
    **dict.fromkeys(("sampler", "state", "keep_last", "async_checkpoint", "seed"), "the Trainer checkpoints itself"),
    "spike": "the Trainer steps itself (spike detection needs steadytrain's step)",
    "callbacks": "give the Trainer your callbacks",
}
"""Run settings the callback cannot honour, and why."""


class Recorder:
    """Writes a steadytrain run directory from a ``transformers.Trainer`` (:mod:`steadytrain.integrations.hf`); add
    it to the Trainer's ``callbacks``.

    Args:
        run_dir: where the run is written (never overwritten: a new directory per ``trainer.train()``).
        shard_size: example id ``i`` is index ``i % shard_size`` of shard ``i // shard_size``.
        layers: per-layer norms to ``layers.jsonl`` at the steps the Trainer logs.
        config: your run's settings (a mapping), recorded in ``config.yaml`` beside the ``TrainingArguments``.
        run_settings: more :class:`steadytrain.Run` settings: ``layers_every``, ``log_every``, ``on_nonfinite``,
            ``trackers``, ``mlflow_uri``, ``watchdog_s`` (default 0: off; the Trainer's evaluations and saves
            happen between steps), ``model_factory``, ``dataset``, ``report``. The ``TrainingArguments`` give the
            accumulation steps, the clip and the steps.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        shard_size: int = 1000,
        layers: bool = True,
        config: Mapping[str, Any] | None = None,
        **run_settings: Any,
    ) -> None:
        if not isinstance(run_dir, str | Path) or not str(run_dir).strip():
            raise UserError(f"SteadytrainCallback(run_dir={run_dir!r}): give the run directory as a path")
        for key in run_settings:
            if key in OWNED:
                raise UserError(
                    f"SteadytrainCallback({key}=...): the Trainer's TrainingArguments({OWNED[key]}=...) set it; "
                    "leave it out"
                )
            if key in NOT_HERE:
                raise UserError(f"SteadytrainCallback({key}=...): {NOT_HERE[key]}; leave it out")
        self.settings = {"shard_size": shard_size, "layers": layers, "watchdog_s": 0, **run_settings}
        RunSettings.build(dict(self.settings))  # a wrong setting fails here, not when training begins
        self.config = check_config_mapping(config)
        if ARGS_KEY in self.config:
            raise UserError(
                f"SteadytrainCallback(config=...): {ARGS_KEY!r} is where the TrainingArguments go; rename it"
            )
        self.path = Path(run_dir)
        self.run: Run | None = None
        """The open :class:`steadytrain.Run` (from the Trainer's ``on_train_begin`` until ``on_train_end``)."""
        self._params: list[torch.Tensor] = []
        self._clip = False
        self._micro_steps = 0
        self._micro = 0
        self._cycle: list[dict[str, Any] | None] = []
        self._losses: list[torch.Tensor] = []
        self._event: NonFiniteEvent | None = None
        self._refused: set[int] = set()
        self._watched = False
        self._measured: dict[int, float] = {}
        self._last_row = 0
        self._loss_hidden = False

    # -- the companion's call ---------------------------------------------------------------------------------------
    def micro_batch(self, ids: Any, *, losses: torch.Tensor | None = None, loss: torch.Tensor | None = None) -> None:
        """The micro-batch the Trainer is training on: its examples' ``ids`` (counted in ``exposure.json``), each
        one's loss (``losses``, 1-D, kept for a refused step's record) and the micro-batch's loss as the Trainer
        computed it (``loss``, checked at the step's end: a non-finite one refuses the step). The ids are copied to
        the host (the exposure is counted there); the losses stay on the device."""
        run = self._open("micro_batch")
        tag = external.count(run, ids)
        if losses is not None:
            if not isinstance(losses, torch.Tensor) or losses.shape != (len(tag["index"]),):
                got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise UserError(f"micro_batch(losses={got}): give one loss per example id ({len(tag['index'])})")
            tag["losses"] = losses.detach()
        self._cycle.append(tag)
        if loss is not None:
            self._losses.append(loss.detach().float().reshape(()))

    def close(self, failed: BaseException | None = None) -> None:
        """Finish the run directory (the last rows, ``exposure.json``, the report); the Trainer's ``on_train_end``
        calls it. Call it yourself with the error when ``trainer.train()`` raised."""
        if self.run is not None and not self.run.closed:
            self._settle_layers(None, None)
            self.run.close(failed=failed)

    def _open(self, what: str) -> Run:
        if self.run is None or self.run.closed:
            raise UserError(f"SteadytrainCallback.{what}: no run is open (it opens when trainer.train() begins)")
        return self.run

    # -- the Trainer's events ---------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:  # fmt: skip
        if self.run is not None:
            raise UserError(
                f"SteadytrainCallback({self.path}): its run is written already; give each trainer.train() a new "
                "SteadytrainCallback and run directory"
            )
        self._clip = bool(args.max_grad_norm) and args.max_grad_norm > 0
        settings = {**self.settings, "accumulation_steps": args.gradient_accumulation_steps,
                    "max_grad_norm": float(args.max_grad_norm) if self._clip else None,
                    "total_steps": state.max_steps or None}  # fmt: skip
        config = {**self.config, ARGS_KEY: _yaml_safe(args.to_dict())}
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch optimizer inside it
        run = Run(self.path, model=model, optimizer=inner, config=config, **settings)
        self.run = run.__enter__()
        run.parts.micro = args.train_batch_size
        external.start_at(run, state.global_step)  # > 0: the Trainer resumed from its own checkpoint
        self._last_row = state.global_step
        self._params = [p for p in model.parameters() if p.requires_grad]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._cycle, self._losses, self._micro = [], [], 0
        if self.run is not None and not self.run.closed:
            self.run.parts.beat.enter("forward")  # the attempt's clock: the step's work, to its end

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None and not self.run.closed and self.run.parts.beat.phase != "eval":
            self.run.parts.beat.enter("eval")  # the Trainer's evaluation, until the next step begins

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._micro += 1
        self._micro_steps += 1

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None or self.run.closed:
            return
        self._micro += 1
        self._micro_steps += 1
        step = state.global_step + 1
        norm, reason = self._verdict()
        monitor = self.run.parts.metrics.layers
        watch = monitor is not None and self._logs(step, args, state) and step % self._layers_every() == 0
        if watch:
            monitor.before_update(self._params, 1.0, stepped=reason is None)
            self._measured[step] = norm
        if reason is None:
            self._watched = watch
            return
        if watch:
            monitor.after_update(self._params)
        self._event = self._refuse(step, norm, reason)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._watched and self.run is not None:
            self.run.parts.metrics.layers.after_update(self._params)
        self._watched = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None or self.run.closed:
            return
        event, self._event = self._event, None
        external.end_step(self.run, state.global_step, event=event)
        self.run.parts.beat.enter("data")  # to the next step's begin: its batch (and the Trainer's logging, saves)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.run is None or self.run.closed or not logs:
            return
        step = state.global_step
        if "loss" in logs and step > self._last_row:
            self._row(step, logs)
        elif "eval_loss" in logs and 0 <= step <= self.run.step:
            extra = {k: v for k, v in logs.items() if k != "eval_loss" and _number(v) and k not in MEASURED}
            self.run.log(step, val_loss=logs["eval_loss"], **extra)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # -- the parts of a step ----------------------------------------------------------------------------------------
    def _verdict(self) -> tuple[float, str | None]:
        """The norm of the gradients the optimizer is given, and why the step must not be taken (None: take it):
        one host read; the verdict summed over the ranks (the losses differ by rank)."""
        norm = global_grad_norm(self._params).float()
        device = norm.device
        loss = torch.zeros((), device=device)
        if self._losses:  # the companion's: a non-finite one among them makes the sum non-finite
            loss = torch.stack([x.to(device) for x in self._losses]).sum()
        flags = torch.stack([~torch.isfinite(norm), ~torch.isfinite(loss)]).float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flags = flags.to(self.run.parts.info.device)
            dist.all_reduce(flags)  # every rank refuses the same steps
        value, bad_norm, bad_loss = torch.cat([norm.reshape(1), flags.to(device)]).tolist()  # the step's host read
        self._loss_hidden |= bool(bad_loss)
        if self.run.settings.on_nonfinite == "ignore":
            return value, None
        return value, NONFINITE_NORM if bad_norm else NONFINITE_LOSS if bad_loss else None

    def _refuse(self, step: int, norm: float, reason: str) -> NonFiniteEvent:
        """The refused step's event (what was in play on this rank); its gradients cleared, so the Trainer's
        ``optimizer.step()`` applies nothing; under ``on_nonfinite="raise"`` recorded and raised at once."""
        raising = self.run.settings.on_nonfinite == "raise"
        positions: list[int] = []
        if self._losses:  # host read: only for a refused step
            positions = [i for i, x in enumerate(torch.stack(self._losses).tolist()) if not math.isfinite(x)]
        event = NonFiniteEvent(
            cycle=step - 1,
            rank=self.run.parts.info.rank,
            grad_norm=norm,
            micro_steps=(self._micro_steps - self._micro, self._micro_steps - 1),
            nonfinite_micro_batches=tuple(positions),
            tags=tuple(self._cycle),
            action="raise" if raising else "skip",
            reason=reason,
        )
        for p in self._params:
            p.grad = None
        self._refused.add(step)
        if raising:
            external.end_step(self.run, step, event=event)
            err = NonFiniteGradientError(event.message(step))
            self.close(failed=err)
            raise err
        return event

    def _row(self, step: int, logs: dict[str, Any]) -> None:
        """The Trainer's training log as step ``step``'s ``metrics.jsonl`` row, with its extra numbers."""
        grad_norm = logs.get("grad_norm")
        self._settle_layers(step, grad_norm)
        loss = math.nan if self._loss_hidden else logs["loss"]
        external.add_row(self.run, step, loss=loss, lr=logs.get("learning_rate", math.nan), grad_norm=grad_norm,
                         skipped=step in self._refused, steps=step - self._last_row)  # fmt: skip
        self._last_row, self._loss_hidden = step, False
        extra = {k: v for k, v in logs.items() if k not in ("loss", "grad_norm", "learning_rate") and k not in MEASURED}
        if extra := {k: v for k, v in extra.items() if _number(v)}:
            self.run.log(step, **extra)

    def _settle_layers(self, step: int | None, grad_norm: Any) -> None:
        """Step ``step``'s layer rows made pre-clip with the Trainer's norm of it; under a clip, the rows of a
        measured step the Trainer did not log (its pre-clip norm unknown) are dropped, never written clipped."""
        monitor = self.run.parts.metrics.layers if self.run is not None else None
        if monitor is None or not self._measured:
            return
        measured, self._measured = self._measured, {}
        if not self._clip:
            return
        norm = measured.get(step) if step is not None else None
        factor = None
        if norm and grad_norm is not None and math.isfinite(norm) and math.isfinite(float(grad_norm)):
            factor = float(grad_norm) / norm
        kept = []
        for row in monitor.rows:
            if row["step"] in measured and row["step"] != step:
                log.debug("step %d: no Trainer log, so no pre-clip norm: its layer rows are left out", row["step"])
                continue
            if row["step"] == step and factor is not None and row["grad_norm"] is not None:
                row["grad_norm"] *= factor
            kept.append(row)
        monitor.rows = kept

    def _logs(self, step: int, args: Any, state: Any) -> bool:
        """Whether the Trainer logs step ``step`` (its ``DefaultFlowCallback``'s rule)."""
        if step == 1 and args.logging_first_step:
            return True
        every = state.logging_steps
        return args.logging_strategy == "steps" and bool(every) and step % every == 0

    def _layers_every(self) -> int:
        s = self.run.settings
        return s.layers_every or s.log_every


def _yaml_safe(value: Any) -> Any:
    """``value`` as ``config.yaml`` holds it: mappings, lists, plain numbers, strings, flags and nulls; a
    non-finite number or any other object as its text."""
    if isinstance(value, enum.Enum):
        return _yaml_safe(value.value)
    if isinstance(value, Mapping):
        return {str(k): _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_yaml_safe(v) for v in value]
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else str(value)
    return str(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
