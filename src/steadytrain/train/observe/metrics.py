"""Per-step metrics: kept on the device, read once per logging interval, written by rank 0.

Each optimizer step adds its loss (a device tensor: no host sync) and the accumulator's step
result (whose norm was already read in the step's one host sync). Every ``log_every`` steps the
interval's losses are averaged over ranks in one all-reduce and read in one host sync; rank 0
appends one ``metrics.jsonl`` line per step (one write and fsync per interval), then mirrors the same rows
to the run's experiment trackers (:mod:`~steadytrain.train.observe.trackers`), and updates the progress display.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from steadytrain._io import append_jsonl
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir
from steadytrain.train.observe.layers import tracker_fields
from steadytrain.train.observe.throughput import peak_mem_mb
from steadytrain.train.setup.distributed import DistInfo

__all__ = ["MEASURED", "MetricsLog", "plain_value"]

log = logging.getLogger("steadytrain.train")


MEASURED = frozenset(
    {"step", "loss", "lr", "grad_norm", "clipped", "skipped", "items", "items_per_s", "step_s", "elapsed_s", "spike",
     "checkpoint_s", "tokens_per_s", "flops_per_s", "mfu", "peak_mem_mb", "rollback", "rollback_to",
     "skipped_batches", "val_loss", "val_items", "val_nonfinite", "early_stop", "val_time_s"}
)  # fmt: skip
"""Keys of a ``metrics.jsonl`` row the run measures itself (``run.log`` refuses them)."""


def plain_value(key: str, value: Any) -> Any:
    """A logged value as ``metrics.jsonl`` holds it: a number, text, a flag or null (a one-element tensor is read;
    a non-finite number is written as null, as the run's own are)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UserError(f"run.log({key}=tensor of shape {tuple(value.shape)}): give one number")
        value = value.item()  # host read: the caller asked to log it
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise UserError(f"run.log({key}={type(value).__name__}): give a number, a string, a flag or None")


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _now() -> float:
    """The host clock every timing here reads (one place: a test may move it)."""
    return time.perf_counter()


@dataclass
class _Pending:
    step: int
    loss: torch.Tensor
    lr: float
    grad_norm: float
    skipped: bool
    t: float
    spike: bool = False
    aside: dict[str, float] = field(default_factory=dict)
    """Seconds spent outside training since the previous step, by kind (``eval``, ``checkpoint``)."""


@dataclass
class MetricsLog:
    """Collects per-step metrics and writes them once per interval."""

    run: RunDir
    info: DistInfo
    items_per_step: int
    max_grad_norm: float | None
    total_steps: int
    elapsed_before: float = 0.0
    progress: Any = None
    _pending: list[_Pending] = field(default_factory=list)
    _t0: float = field(default_factory=lambda: _now())
    _t_last: float = field(default_factory=lambda: _now())
    _aside: dict[str, float] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)
    spikes: Any = None
    """A ``warn`` :class:`~steadytrain.train.job.spikes.SpikeGuard`: judges the interval's losses, read with them."""
    trackers: Any = None
    """The run's :class:`~steadytrain.train.observe.trackers.Trackers` (rank 0): each row written goes to them too,
    after it is on disk. The job finishes them after the run's report."""
    layers: Any = None
    """The run's :class:`~steadytrain.train.observe.layers.LayerMonitor` (``monitor.layers: norms``): its rows are
    written to ``layers.jsonl`` with the interval's metrics, and reach the trackers on their step's row."""
    sources: Any = None
    """A mixture's :class:`~steadytrain.train.observe.sources.SourceLosses`: the interval's last row gets
    ``loss/<name>`` and ``mix/<name>`` per source."""
    throughput: Any = None
    """A :class:`~steadytrain.train.observe.throughput.Throughput`: rows get ``tokens_per_s``, ``flops_per_s``,
    ``mfu`` (the known ones, from ``items_per_s``) and ``peak_mem_mb`` (read once per flush: no device sync)."""

    clock: Any = None
    """The attempt's :class:`~steadytrain.train.observe.timeline.AttemptClock` (rank 0): told each step's end, and
    given a line with each interval's rows."""
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Keys a loop or a callback adds to a step's row (:meth:`add_keys`), by step: merged into it when written."""

    @property
    def pending_steps(self) -> list[int]:
        """The steps whose rows are added and not yet written (:meth:`flush` writes them)."""
        return [p.step for p in self._pending]

    def add_keys(self, step: int, keys: dict[str, Any], last: int) -> None:
        """``run.log(step, **keys)``: the keys join step ``step``'s row (``last``: the step ended last), which must
        not be written yet; the keys the run measures itself are refused."""
        if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= last:
            raise UserError(f"run.log(step={step!r}): give the number of a step the loop has ended (1 to {last})")
        if step not in {p.step for p in self._pending}:
            raise UserError(
                f"run.log(step={step}): that step's row is written already; log a step's keys before its row is "
                "written (at the next logging interval or checkpoint)"
            )
        for key, value in keys.items():
            if key in MEASURED:
                raise UserError(f"run.log({key}=...): the run measures {key} itself; log yours under another name")
            self.extra.setdefault(step, {})[key] = plain_value(key, value)

    def add(
        self, step: int, loss: torch.Tensor, lr: float, grad_norm: float, skipped: bool, spike: bool = False
    ) -> None:
        pending = _Pending(step, loss.detach().float(), lr, grad_norm, skipped, _now(), spike, self._aside)
        self._pending.append(pending)
        self._aside = {}
        if self.clock is not None:
            self.clock.step(skipped or spike)

    @contextlib.contextmanager
    def aside(self, kind: str) -> Iterator[Callable[[], float]]:
        """Time spent on ``kind`` (``eval``, ``checkpoint``) between optimizer steps: left out of the next step's
        ``step_s`` and ``items_per_s`` (a ``checkpoint`` is that row's ``checkpoint_s``). Yields the seconds
        spent so far, as a function."""
        start = _now()
        try:
            yield lambda: _now() - start
        finally:
            self._aside[kind] = self._aside.get(kind, 0.0) + _now() - start

    def add_eval(self, row: dict[str, Any]) -> None:
        """An evaluation's row (:meth:`EvalResult.row`), after the training rows up to its step (every rank
        calls it: the pending rows' flush is a collective)."""
        self.flush()
        if not self.info.is_main:
            return
        append_jsonl(self.run.metrics, row)
        if self.trackers is not None:
            self.trackers.log_rows([row])
        loss = "not finite" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        log.info("step %d/%d  val_loss %s over %d examples", row["step"], self.total_steps, loss, row["val_items"])

    def elapsed(self) -> float:
        return self.elapsed_before + _now() - self._t0

    def flush(self, durable: bool = True) -> list[dict[str, Any]]:
        """Average the interval's losses over ranks (one collective, one host sync) and write them; ``durable``:
        on disk before this returns (before a checkpoint, at the end), else left to the kernel (a logging
        interval's rows: a kill of the process keeps them, and rows past the last checkpoint are written again by a
        resume anyway)."""
        if not self._pending:
            return []
        losses = torch.stack([p.loss for p in self._pending])
        if self.info.backend is not None:
            dist.all_reduce(losses, op=dist.ReduceOp.SUM)  # the logged loss is the global batch's, not this rank's
            losses /= self.info.world_size
        steps = [p.step for p in self._pending]
        if self.spikes is not None:  # the spike flags ride on this read: no host read of their own
            flags = self.spikes.judge(steps, losses, [p.grad_norm for p in self._pending])
            # host sync, once per logging interval: the rows are written (and tracked) as Python numbers
            values = torch.cat([losses, flags.to(losses.dtype)]).tolist()
            values, flagged = values[: len(steps)], [f > 0 for f in values[len(steps) :]]
            flagged = self.spikes.settle(steps, flagged, values, [p.skipped for p in self._pending])
            for p in (p for p, f in zip(self._pending, flagged, strict=True) if f):
                p.spike = True
            self.spikes.judged(steps, flagged)
        else:
            values = losses.tolist()  # host sync, once per logging interval: the rows are Python numbers
        rows = []
        mem = {"peak_mem_mb": peak_mem_mb(self.info.device)} if self.throughput is not None else {}
        for p, loss in zip(self._pending, values, strict=True):
            rows.append(self._row(p, loss, max(p.t - self._t_last - sum(p.aside.values()), 1e-9)) | mem)
            self._t_last = p.t
        self._pending.clear()
        if self.sources is not None:  # a collective, on every rank
            rows[-1] |= self.sources.take()
        self.last = rows[-1]
        layer_rows = self.layers.take() if self.layers is not None else []
        if self.info.is_main:
            append_jsonl(self.run.metrics, *rows, sync=durable)
            if layer_rows:
                append_jsonl(self.run.layers, *layer_rows, sync=durable)
            if self.trackers is not None:
                fields = tracker_fields(layer_rows)
                self.trackers.log_rows([r | fields.get(r["step"], {}) for r in rows])
            if self.progress is not None:
                self.progress.update(rows[-1], self.total_steps)
            if self.clock is not None:
                self.clock.interval(rows[-1]["step"])
        return rows

    def _row(self, p: _Pending, loss: float, seconds: float) -> dict[str, Any]:
        """The step's row; ``seconds``: its own time (the time set aside for evaluation and checkpoints left out)."""
        clipped = self.max_grad_norm is not None and math.isfinite(p.grad_norm) and p.grad_norm > self.max_grad_norm
        row = {
            "step": p.step,
            "loss": _finite_or_none(loss),
            "lr": p.lr,
            "grad_norm": _finite_or_none(p.grad_norm),
            "clipped": bool(clipped and not p.skipped),
            "skipped": p.skipped,
            "items": self.items_per_step,
            "items_per_s": round(self.items_per_step / seconds, 3),
            "step_s": round(seconds, 6),
            "elapsed_s": round(self.elapsed_before + p.t - self._t0, 3),
        }
        if p.aside.get("checkpoint"):
            row["checkpoint_s"] = round(p.aside["checkpoint"], 3)
        if self.throughput is not None:
            row |= self.throughput.fields(row["items_per_s"])
        row = row | {"spike": True} if p.spike else row
        return row | self.extra.pop(p.step) if p.step in self.extra else row


class Progress:
    """A live progress line on a terminal; plain log lines otherwise (CI, files, pipes)."""

    def __init__(self, total_steps: int, start_step: int) -> None:
        self.rich = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.rich = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.rich.add_task("train", total=total_steps, completed=start_step, info="")
            self.rich.start()

    def update(self, row: dict[str, Any], total: int) -> None:
        loss = "nan" if row["loss"] is None else f"{row['loss']:.4f}"
        norm = "nan" if row["grad_norm"] is None else f"{row['grad_norm']:.3g}"
        info = f"loss {loss}  lr {row['lr']:.3g}  grad_norm {norm}  {row['items_per_s']:.0f} items/s"
        if row.get("tokens_per_s") is not None:
            info += f"  {row['tokens_per_s']:.0f} tok/s"
        if row.get("mfu") is not None:
            info += f"  mfu {row['mfu']:.1%}"
        if row.get("peak_mem_mb") is not None:
            info += f"  mem {row['peak_mem_mb']:.0f} MiB"
        if self.rich is not None:
            self.rich.update(self.task, completed=row["step"], info=info)
        else:
            eta = row["elapsed_s"] / max(row["step"], 1) * (total - row["step"])
            log.info("step %d/%d  %s  eta %.0fs", row["step"], total, info, eta)

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()
