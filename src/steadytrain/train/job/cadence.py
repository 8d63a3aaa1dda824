"""How often a run evaluates when its config leaves it to steadytrain (``eval.every_steps: auto``).

A fixed cadence costs a share of the run that depends on the model, the data and the machine: every 25 steps of
32 batches took a quarter of an HF GPT-2 run's wall time. ``auto`` keeps the evaluations under :data:`BUDGET`
of the wall time instead, in two moves:

- at start, from the config alone: an evaluation is a forward pass over its examples, about a third of a training
  step's forward and backward over as many, so it costs ``examples / (3 x global batch)`` steps' time, and the
  cadence is the smallest round number of steps (at least :data:`FLOOR`) that keeps that under the budget;
- after the first evaluation, from the clock: its measured seconds against the measured seconds per step since
  the start (checkpoints and all: the budget is of the wall time). When that needs a longer cadence, it takes it
  from there on (every rank the same: the ranks' longest), says so, and keeps it in checkpoints, so a resumed run
  evaluates at the same steps.

The final step is always evaluated, whatever the cadence. An explicit ``eval.every_steps`` always wins.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from steadytrain.train.setup.distributed import DistInfo

__all__ = ["AUTO", "BUDGET", "FLOOR", "AutoCadence", "round_up"]

AUTO = "auto"
BUDGET = 0.05
"""The largest share of a run's wall time its default evaluations may take."""
FLOOR = 25
"""Never more often than every 25 steps (the embedded demo's cadence): a curve of a few points per hundred steps."""
_ROUND = (1.0, 2.0, 2.5, 5.0)


def round_up(x: float) -> int:
    """The smallest of 25, 50, 100, 200, 250, 500, 1000, 2000, ... that is at least ``x`` (and :data:`FLOOR`)."""
    x = max(float(FLOOR), x) if math.isfinite(x) else 10.0**12
    exp = math.floor(math.log10(x))  # x >= 10^exp, so every candidate below 10^exp is too small
    return min(v for e in (exp, exp + 1) for m in _ROUND if (v := int(m * 10**e)) >= x)


class AutoCadence:
    """The evaluation cadence of an ``auto`` run: estimated at start, re-chosen once from the first evaluation."""

    def __init__(self, examples: int, global_batch: int, total_steps: int) -> None:
        self.cost_steps = examples / (3 * global_batch)
        """An evaluation's estimated cost, in steps' time."""
        self.every_steps = round_up(self.cost_steps / BUDGET)
        self.total_steps = total_steps
        self.timed = False
        """Whether the first evaluation's time has chosen the cadence (then it is not estimated again)."""
        self._clock: tuple[float, int] | None = None

    def note(self) -> str:
        """What was chosen at start, for the run's log."""
        when = (
            f"every {self.every_steps} steps"
            if self.every_steps < self.total_steps
            else f"at the last step only (every {self.every_steps} steps would be past step {self.total_steps})"
        )
        how = "kept" if self.timed else "estimated at start, measured at the first evaluation"
        return (
            f"validation {when} (eval.every_steps: auto: an evaluation costs about {self.cost_steps:.2g} steps' "
            f"time, under {BUDGET:.0%} of the run; {how}; set eval.every_steps to choose)"
        )

    def start(self, step: int) -> None:
        """The clock starts at ``step`` (a fresh run's 0, or the step a run resumes at)."""
        self._clock = (time.perf_counter(), step)

    def measured(self, step: int, eval_s: float, info: DistInfo) -> str | None:
        """After the evaluation at ``step`` took ``eval_s`` seconds: the cadence from the clock (once per run), and
        what changed (None: nothing). Every rank calls it at the same step (a small all-reduce: the ranks' longest)."""
        if self.timed or self._clock is None or step <= self._clock[1]:
            return None
        self.timed = True
        t0, step0 = self._clock
        step_s = max(time.perf_counter() - t0 - eval_s, 1e-9) / (step - step0)
        wanted = float(round_up(eval_s / (BUDGET * step_s)))
        if info.backend is not None:
            agreed = torch.tensor([wanted], dtype=torch.float64, device=info.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank evaluates at the same steps
            wanted = float(agreed.item())  # host read, once per run
        if wanted <= self.every_steps:
            return None
        before, self.every_steps = self.every_steps, int(wanted)
        return (
            f"validation took {eval_s:.3g} s = {eval_s / step_s:.3g} steps' time: every {self.every_steps} steps "
            f"from here (was {before}) keeps it under {BUDGET:.0%} of the run (eval.every_steps: auto)"
        )
