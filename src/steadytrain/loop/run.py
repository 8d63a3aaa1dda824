"""``steadytrain.Run``: the guarantees of ``steadytrain train`` around a training loop of your own.

Open it on every rank (under torchrun rank 0 writes what one writer writes), run each micro-batch inside
``run.micro_batch(ids)`` and call ``mb.backward(loss)`` there, as with the :class:`GradientAccumulator` it drives;
``run.checkpoint(step)`` when you want one. At each optimizer step the Run writes, through the trainer's own
writers: the ``metrics.jsonl`` row (the step loss over all ranks, LR, global gradient norm, clipped, skipped, time),
a refused step's line in ``nonfinite.jsonl`` and ``exposure.json`` (the examples in play, by shard), a spike's in
``spikes.jsonl``, the per-layer norms of ``layers.jsonl``, the watchdog's beat. Checkpoints are the trainer's
(sharded, complete or absent, every RNG); ``Run(..., resume=True)`` restores the latest and cuts the logs at it.
At close: ``summary.md`` and ``plots/`` (``steadytrain report``'s), and the experiment trackers get them.

Example:
    >>> import tempfile, torch
    >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with Run(tempfile.mkdtemp() + "/run", model=model, optimizer=opt, report=False) as run:
    ...     for step in range(run.start_step, 3):
    ...         ids = torch.arange(4) + 4 * step
    ...         with run.micro_batch(ids) as mb:
    ...             mb.backward(model(torch.ones(4, 2)).pow(2).mean())
    >>> run.step
    3
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from steadytrain.accumulate import GradientAccumulator, NonFiniteGradientError
from steadytrain.accumulate.events import SPIKE
from steadytrain.errors import UserError
from steadytrain.loop.checks import check_config_mapping, checkpoint_step, eval_row
from steadytrain.loop.opening import Origin, open_run
from steadytrain.loop.parts import LoopParts, build_parts, close_parts, fill_tags, run_info, tag_of
from steadytrain.loop.settings import RunSettings
from steadytrain.train.checkpoint.writer import CheckpointFailed
from steadytrain.train.job.records import write_exposure

__all__ = ["Run"]

log = logging.getLogger("steadytrain.loop")


class Run:
    """A run directory for your own loop (see the module docstring); a context manager every rank opens.

    Args:
        run_dir: where the run is written; never overwritten (``resume=True`` continues it).
        model: the model the loop trains (plain, DDP or FSDP2).
        optimizer: its optimizer.
        scheduler: an LR scheduler the checkpoints save (given to the accumulator the Run makes, which steps it
            once per applied optimizer step; with your own ``accumulator``, its scheduler or None).
        accumulator: your :class:`GradientAccumulator`; None: the Run makes one from ``accumulation_steps``,
            ``max_grad_norm``, ``on_nonfinite`` (as ``run.accumulator``).
        config: your run's settings (a mapping), recorded as given in ``config.yaml``.
        resume: continue ``run_dir`` from its latest complete checkpoint (a fresh start when it has none).
        settings: the rest as keywords (:class:`~steadytrain.loop.settings.RunSettings`): ``shard_size``,
            ``spike``, ``layers``, ``watchdog_s``, ``log_every``, ``trackers``, ``total_steps``, ``sampler``,
            ``state``, ``model_factory``, ``dataset``, ``report``, ...
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        accumulator: GradientAccumulator | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = False,
        **settings: Any,
    ) -> None:
        if not isinstance(run_dir, str | Path) or not str(run_dir).strip():
            raise UserError(f"Run(run_dir={run_dir!r}): give the run directory as a path")
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"Run(model={type(model).__name__}): give the torch.nn.Module your loop trains")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"Run(optimizer={type(optimizer).__name__}): give its torch.optim.Optimizer")
        if not isinstance(resume, bool):
            raise UserError(f"Run(resume={resume!r}): give True or False")
        self.path = Path(run_dir)
        self.settings = RunSettings.build(settings)
        self.config = check_config_mapping(config)
        self.accumulator = self._accumulator(model, optimizer, scheduler, accumulator)
        self.model, self.optimizer, self.resume = model, optimizer, resume
        self.scheduler = self.accumulator.scheduler
        self.start_step = 0
        """The last step the loop trained before this Run was opened (0: a fresh start)."""
        self.step = 0
        """The optimizer steps ended so far (the last one's number)."""
        self._parts: LoopParts | None = None
        self._closed = False
        self._loss: torch.Tensor | None = None
        self._micros = 0
        self._lr = 0.0
        self._inside = False  # in a micro_batch block
        self._pending = False  # a complete cycle the accumulator has not stepped (see _settle)
        self._tags: list[dict[str, Any]] = []  # the open step's micro-batch tags (fill_tags at its end)
        self._last_eval = 0

    def _accumulator(
        self, model: Any, optimizer: Any, scheduler: Any, acc: GradientAccumulator | None
    ) -> GradientAccumulator:
        s = self.settings
        if acc is None:
            return GradientAccumulator(
                model, optimizer, accumulation_steps=s.accumulation_steps, scheduler=scheduler,
                max_grad_norm=s.max_grad_norm, on_nonfinite=s.on_nonfinite,
            )  # fmt: skip
        if not isinstance(acc, GradientAccumulator):
            raise UserError(f"Run(accumulator={type(acc).__name__}): give a steadytrain GradientAccumulator or None")
        if acc.model is not model or acc.optimizer is not optimizer:
            raise UserError("Run(accumulator=...): it drives another model or optimizer than the Run's: give the same")
        if scheduler is not None and acc.scheduler is not scheduler:
            raise UserError("Run(scheduler=...): the accumulator steps another scheduler: give it to the accumulator")
        if acc.micro_steps or acc.optimizer_steps or acc.skipped_steps:
            raise UserError("Run(accumulator=...): it has stepped already: open the Run before the first micro-batch")
        return acc

    # -- opening and closing ---------------------------------------------------------------------------------------
    def __enter__(self) -> Run:
        if self._parts is not None or self._closed:
            raise UserError(f"Run({self.path}): opened already; a Run is opened once (make a new one to resume)")
        info = run_info(self.model)
        s = self.settings
        plan = {
            "accumulation_steps": self.accumulator.accumulation_steps,
            "world_size": info.world_size,
            "lr": self.optimizer.param_groups[0]["lr"] or None,
            "total_steps": s.total_steps,
            "data": s.dataset,
        }
        origin = Origin(s.model_factory, s.dataset, s.shard_size)
        opened = open_run(self.path, info, config=self.config, resume=self.resume, origin=origin,
                          plan={k: v for k, v in plan.items() if v is not None})  # fmt: skip
        try:
            self._parts = build_parts(self, info, opened)
        except BaseException:
            if opened.lock is not None:
                opened.lock.release()
            raise
        self.start_step = self.step = self._last_eval = self._parts.state.step  # evaluations up to it are kept
        return self

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        self.close(failed=err)

    def close(self, failed: BaseException | None = None) -> None:
        """Write the last rows and exposure, wait for the checkpoint in flight, write the report (rank 0), release
        the directory. Every rank calls it (the ``with`` block does); after an exception only this rank's files
        are finished (no collective: a peer may be gone)."""
        if self._closed or self._parts is None:
            self._closed = True
            return
        self._closed = True
        close_parts(self, self._parts, failed)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the ``with`` block ended)."""
        return self._closed

    @property
    def rank(self) -> int:
        return self.parts.info.rank

    @property
    def is_main(self) -> bool:
        return self.parts.info.is_main

    # -- the loop's calls ------------------------------------------------------------------------------------------
    @property
    def parts(self) -> LoopParts:
        if self._parts is None:
            raise UserError(
                f"Run({self.path}) is {'closed' if self._closed else 'not open'}: use it inside `with Run(...) as run:`"
            )
        if self._closed:
            raise UserError(f"Run({self.path}) is closed: open a new Run(..., resume=True) to go on")
        return self._parts

    @contextlib.contextmanager
    def micro_batch(
        self, ids: Any = None, *, num_items: Any = None, tag: Mapping[str, Any] | None = None
    ) -> Iterator[Any]:
        """One micro-batch: forward and ``mb.backward(loss)`` inside. ``ids``: the examples' ids (integers; the Run
        maps id ``i`` to shard ``i // shard_size``, index ``i % shard_size``), or ``tag={"shard", "index"}``;
        ``num_items``: as :meth:`GradientAccumulator.micro_batch`. The step ends with the cycle's last one."""
        p = self.parts
        found = tag_of(ids, tag, p.origin.shard_size)
        self._settle(p)
        if self._micros == 0:
            self._lr = self.optimizer.param_groups[0]["lr"]
        p.beat.enter("forward")
        mb = None
        try:
            with self.accumulator.micro_batch(num_items=num_items, tag=found) as mb:
                self._inside = True
                try:
                    yield _Micro(mb, found)
                finally:
                    self._inside = False
                    if mb.loss is not None:  # its gradient is in: counted even if the block raised after backward
                        self._took(p, mb, found)
                p.beat.enter("all_reduce")  # the cycle's end: the gradient sync, the norm, the update
        except NonFiniteGradientError:  # on_nonfinite="raise": the refused step is recorded, then the error goes on
            self._end_step(p, None)
            raise
        except BaseException:
            # the cycle's last backward ran and the block raised: the accumulator steps it at its next micro-batch
            k = self.accumulator.accumulation_steps
            self._pending = mb is not None and mb.result is None and self._micros >= k
            raise
        p.beat.enter("data")
        if mb.result is not None:
            self._end_step(p, mb.result)

    def _took(self, p: LoopParts, mb: Any, found: dict[str, Any] | None) -> None:
        """A micro-batch whose backward ran: its examples (exposure, the spike record's tags) and loss count."""
        if found is not None:
            ids = found.get("ids")
            # the exposure counts example ids (divided into shards 256 micro-batches at a time); a tag's shards as ids
            p.state.count(ids if ids is not None else found["shard"] * p.origin.shard_size)
            self._tags.append(found)  # shards and indices are filled when a record reads them (fill_tags)
            if p.micro is None:
                p.micro = len(ids if ids is not None else found["index"])
            if p.spikes.collects:
                p.spikes.tags.append(found)
            if p.spikes.detector is not None:
                found["loss"] = mb.loss
        self._loss = mb.loss if mb.position == 0 or self._loss is None else self._loss + mb.loss
        self._micros = mb.position + 1

    def _settle(self, p: LoopParts) -> None:
        """End the step whose last micro-batch block raised after its backward (the loop caught it and goes on):
        the accumulator steps that cycle now, and the Run writes its row as for any step."""
        if self._pending:
            self._pending = False
            result = self.accumulator.finish()
            if result is not None:
                self._end_step(p, result)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a part of your step for the hang watchdog (``forward``, ``backward``, ``all_reduce``, ``eval``...)."""
        p = self.parts
        p.beat.enter(str(name))
        try:
            yield
        finally:
            p.beat.enter("data")

    def _end_step(self, p: LoopParts, result: Any) -> None:
        """The step's records (``result`` None: refused under ``on_nonfinite="raise"``, the accumulator raised)."""
        tags, self._tags = self._tags, []
        loss = self._loss / max(self._micros, 1) if self._loss is not None else torch.tensor(float("nan"))
        self._loss, self._micros = None, 0
        event = self.accumulator.nonfinite_events[-1] if result is None or not result.stepped else None
        spike = event is not None and event.reason == SPIKE
        if event is not None or p.spikes.collects:  # a record will read them: now, or at the spike judgement
            fill_tags(tags, p.origin.shard_size)
        p.close_step(self, self.step + 1, event, spike=spike)
        norm, stepped = (event.grad_norm, False) if result is None else (result.grad_norm, result.stepped)
        p.spikes.end_step(self.step, self.accumulator, norm, self.step - 1)
        if len(p.metrics.pending_steps) >= self.settings.log_every:  # rows of earlier steps: their run.log calls are in
            p.metrics.flush(durable=False)
        p.metrics.add(self.step, loss, self._lr, norm, not stepped, spike)
        if spike:
            p.spikes.record(self.step, event, p.spikes.limits, self.step - 1, action="skip")
        p.callbacks.call("on_step_end", self)

    def log(self, step: int, **metrics: Any) -> None:
        """Add your keys to step ``step``'s ``metrics.jsonl`` row (a step ended and not yet written; the Run measures
        loss, lr and grad_norm itself). ``val_loss`` (with ``val_items``) makes an evaluation row instead."""
        p = self.parts
        if "val_loss" in metrics:
            self._eval_row(p, step, metrics)
            return
        p.metrics.add_keys(step, metrics, self.step)

    def _eval_row(self, p: LoopParts, step: int, metrics: dict[str, Any]) -> None:
        row = eval_row(step, metrics, self.step, self._last_eval)
        self._last_eval = step
        p.metrics.add_eval(row)
        p.callbacks.call("on_evaluate", self, row)

    def checkpoint(self, step: int | None = None) -> None:
        """Save the state after step ``step`` (the last ended; a collective: every rank calls it): model, optimizer,
        scheduler, accumulator, spike window, data position (``sampler``), your ``state`` parts and every rank's
        random streams, with the trainer's writer (asynchronous, complete or absent). A failed save is logged; the
        previous checkpoint stays the latest."""
        p = self.parts
        step = checkpoint_step(self.step if step is None else step, self.step)
        if self._inside:
            raise UserError(f"run.checkpoint({step}): inside run.micro_batch: checkpoint after the block")
        if self._micros:
            raise UserError(
                f"run.checkpoint({step}): {self._micros} micro-batch(es) of step {step + 1} are in progress: "
                "checkpoint after a step's last micro-batch"
            )
        p.beat.enter("checkpoint")
        try:
            with p.metrics.aside("checkpoint"):
                p.metrics.flush()
                exposure = write_exposure(p.run, p.info, p.state, None)
                train = p.state.state_dict(elapsed_s=p.metrics.elapsed(), exposure=exposure)
                with contextlib.suppress(CheckpointFailed):  # logged with its step; the previous stays the latest
                    p.writer.save(step, self.model, self.optimizer, train, frozenset())
                    if p.clock is not None:
                        p.clock.saved(step)
                p.callbacks.call("on_checkpoint", self, step)  # its time is the checkpoint's, not the next step's
        finally:
            p.beat.enter("data")


class _Micro:
    """The accumulator's micro-batch, whose ``backward`` also takes per-example losses (a 1-D tensor: its mean is the
    micro-batch's loss, and which examples went non-finite is recorded with a refused step)."""

    def __init__(self, mb: Any, tag: dict[str, Any] | None) -> None:
        self._mb, self._tag = mb, tag

    def backward(self, loss: torch.Tensor) -> None:
        if isinstance(loss, torch.Tensor) and loss.ndim == 1:
            if self._tag is not None:
                n = len(self._tag["ids"] if self._tag.get("ids") is not None else self._tag["index"])
                if len(loss) != n:
                    raise UserError(
                        f"mb.backward(losses): {len(loss)} per-example losses for {n} ids: "
                        "give one per example, or the scalar mean"
                    )
                self._tag["losses"] = loss.detach()  # flags computed only if the step is refused: no host read
            loss = loss.mean()
        self._mb.backward(loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mb, name)
