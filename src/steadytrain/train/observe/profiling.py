"""``run.profile``: a :mod:`torch.profiler` trace of chosen optimizer steps, one file per rank.

The profiler records CPU activity (and CUDA kernels on a GPU, with input shapes) for optimizer steps
``start_step`` to ``start_step + steps - 1`` (1-based, as ``metrics.jsonl`` counts), stepped once per
optimizer step (not per micro-batch). Each rank writes ``RUN/profile/rank{r}-steps{a}-{b}.pt.trace.json``:
a Chrome trace (``chrome://tracing``, Perfetto) that TensorBoard's PyTorch profiler plugin also reads
(``tensorboard --logdir RUN/profile``; it finds ``*.pt.trace.json`` files).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepProfiler"]

log = logging.getLogger("steadytrain.train")


class StepProfiler:
    """Profiles optimizer steps ``[first, last]`` of this session; :meth:`step` after each optimizer step.

    Args:
        start_step: the first optimizer step to record (``run.profile.start_step``); None: no profiling.
        steps: how many (``run.profile.steps``).
        done: optimizer steps already taken (a resume's step); the profiled steps still ahead are recorded.
        last_step: the run's last step (a start beyond it is a warning at start, and nothing is recorded).
    """

    def __init__(
        self, start_step: int | None, steps: int, *, done: int, last_step: int, out: Path, rank: int, device: Any
    ) -> None:
        self.prof: Any = None
        self.step_no, self.out, self.rank = done, Path(out), rank
        if start_step is None:
            return
        first, self.last = max(start_step, done + 1), min(start_step + steps - 1, last_step)
        if start_step > last_step:
            if rank == 0:
                log.warning(
                    "run.profile.start_step=%d is after the run's last step (%d): nothing is profiled; "
                    "give a start_step from 1 to %d", start_step, last_step, last_step,
                )  # fmt: skip
            return
        if first > self.last:  # a resume after the profiled steps
            return
        self.first = first
        before = first - done - 1  # steps to pass over; the last of them warms the profiler up
        warmup = 1 if before >= 1 else 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        if getattr(device, "type", "cpu") == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=before - warmup, warmup=warmup, active=self.last - first + 1, repeat=1
            ),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self.prof.start()

    def _write(self, prof: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank{self.rank}-steps{self.first}-{min(self.step_no, self.last)}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        log.info("rank %d: profile of steps %d-%d written to %s", self.rank, self.first, self.step_no, path)

    def step(self) -> None:
        """After each optimizer step: the profiler's schedule moves on; its trace is written after the last."""
        if self.prof is None:
            return
        self.step_no += 1
        self.prof.step()
        if self.step_no >= self.last:
            self.close()

    def close(self) -> None:
        """Stop (a run that ends inside the profiled steps writes what it recorded)."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
