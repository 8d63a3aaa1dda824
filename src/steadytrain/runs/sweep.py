"""``steadytrain sweep CONFIG --factors ... --steps N``: is the linear-scaling LR right for this batch?

The seed: the linear scaling rule is a heuristic, less reliable at large scale-ups; validate it with
a learning-rate sweep at the target effective batch, centred on the linear estimate. Each trial is a
short training (same seed, data and schedule shape) at LR = factor x (base LR x global batch / base
batch), in its own run directory under one sweep directory. The sweep writes ``sweep.json``,
``sweep.md`` (a table) and ``loss_vs_lr.png``, names the best factor and says whether the estimate
held up. Trials run one after another; under torchrun every trial uses all ranks.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain._io import write_text_atomic
from steadytrain.errors import UserError
from steadytrain.runs.record import load_run, smooth

__all__ = ["HELD_UP_WITHIN", "Sweep", "linear_estimate", "parse_factors", "sweep"]

log = logging.getLogger("steadytrain.runs")

LARGE_SCALE_UP = 8
"""A scale-up from the base batch from which the seed calls the linear rule less reliable (its example: 256 -> 2048)."""
HELD_UP_WITHIN = 0.01
"""The estimate held up when its smoothed final loss is within this fraction of the best trial's."""


@dataclass
class Sweep:
    """What :func:`sweep` found."""

    dir: Path
    estimate: float
    scale_up: float | None
    trials: list[dict[str, Any]]
    best_factor: float | None
    held_up: bool | None
    sentence: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "dir": str(self.dir)}


def parse_factors(text: str) -> list[float]:
    """``"0.25,0.5,1,2,4"`` -> ``[0.25, 0.5, 1.0, 2.0, 4.0]`` (positive, finite, distinct).

    Example:
        >>> parse_factors("1, 0.5,2")
        [0.5, 1.0, 2.0]
    """
    try:
        factors = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--factors {text!r}: give numbers separated by commas, e.g. 0.25,0.5,1,2,4") from None
    if not factors or any(not math.isfinite(f) or f <= 0 for f in factors) or len(set(factors)) != len(factors):
        raise UserError(f"--factors {text!r}: give distinct positive numbers, e.g. 0.25,0.5,1,2,4")
    return sorted(factors)


def linear_estimate(cfg: Any, world_size: int) -> tuple[float, float | None]:
    """The linear-scaling LR for the config's effective batch, and the scale-up factor k (None: unscaled)."""
    from steadytrain.schedule import scale_lr
    from steadytrain.train.setup import batch_plan

    global_batch = batch_plan(cfg, world_size).global_batch_size
    base = cfg.batch.base_batch_size
    if base is None:
        return cfg.batch.base_lr, None
    return scale_lr(cfg.batch.base_lr, base, global_batch, "linear"), global_batch / base


def _trial_config(cfg: Any, factor: float, steps: int) -> Any:
    """The config with LR = factor x the linear estimate (the linear rule from a scaled base LR)."""
    trial = cfg.model_copy(deep=True)
    trial.batch.base_lr = cfg.batch.base_lr * factor
    trial.batch.scaling = "linear"
    trial.run.max_steps = steps
    trial.run.name = f"{cfg.run.name}-lr-x{factor:g}"
    return trial


def _trial(cfg: Any, factor: float, steps: int, where: Path) -> dict[str, Any]:
    from steadytrain.train.loop import TrainingStopped, train

    stopped = None
    try:
        train(_trial_config(cfg, factor, steps), run_dir=where)
    except TrainingStopped as err:
        stopped = str(err)
    rec = load_run(where)
    losses = rec.column("loss")
    finite = [x for x in losses if x is not None]
    final, smoothed = (losses or [None])[-1], (smooth(losses) or [None])[-1]
    # Diverged: stopped, ended non-finite, or ended above where it started.
    diverged = bool(stopped) or final is None or smoothed is None or (bool(finite) and smoothed > finite[0])
    return {
        "factor": factor,
        "lr": rec.plan.get("lr"),
        "final_loss": final,
        "smoothed_loss": smoothed,
        "steps": len(rec.metrics),
        "skipped": sum(bool(r.get("skipped")) for r in rec.metrics),
        "diverged": diverged,
        "stopped": stopped,
        "run_dir": str(where),
    }


def verdict(trials: list[dict[str, Any]], scale_up: float | None) -> tuple[float | None, bool | None, str]:
    """The best factor (lowest smoothed final loss among trials that did not diverge), whether the
    linear estimate (factor 1) held up, and one sentence saying so."""
    ok = [t for t in trials if not t["diverged"]]
    if not ok:
        return None, False, "every trial diverged: the linear estimate is far too high here; sweep lower factors"
    best = min(ok, key=lambda t: t["smoothed_loss"])
    head = f"best factor {best['factor']:g} (LR {best['lr']:.3g}, smoothed final loss {best['smoothed_loss']:.4g})"
    k = f" at a scale-up of ×{scale_up:g} from the base batch" if scale_up else ""
    one = next((t for t in trials if t["factor"] == 1), None)
    if one is None:
        return best["factor"], None, f"{head}; factor 1 (the linear estimate) was not tried: add it to --factors"
    if one["diverged"]:
        return best["factor"], False, f"{head}; the linear estimate diverged{k}: it did not hold up, use a lower LR"
    gap = (one["smoothed_loss"] - best["smoothed_loss"]) / abs(best["smoothed_loss"])
    if best is one or gap <= HELD_UP_WITHIN:
        within = "" if best is one else f" (within {gap:.1%} of the best)"
        return best["factor"], True, f"{head}; the linear-scaling estimate held up{k}{within}"
    why = (
        "the rule is a starting point, less reliable at large scale-ups"
        if scale_up and scale_up >= LARGE_SCALE_UP
        else "short trials: confirm with longer ones"
    )
    text = f"{head}; the linear-scaling estimate did not hold up{k}: factor {best['factor']:g} beat it by {gap:.1%}"
    return best["factor"], False, f"{text} in smoothed loss ({why})"


def _table(result: Sweep) -> str:
    lines = [
        f"# LR sweep {result.dir.name}",
        "",
        f"Linear-scaling estimate: LR {result.estimate:.4g}"
        + (f" (scale-up ×{result.scale_up:g})" if result.scale_up else " (unscaled base LR)"),
        "",
        "| factor | LR | final loss | smoothed loss | diverged? | run |",
        "|---|---|---|---|---|---|",
    ]
    for t in result.trials:
        fmt = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
        lines.append(
            f"| {t['factor']:g} | {t['lr']:.4g} | {fmt(t['final_loss'])} | {fmt(t['smoothed_loss'])} | "
            f"{'yes' if t['diverged'] else 'no'} | {Path(t['run_dir']).name} |"
        )
    lines += ["", result.sentence, "", "![loss against LR](loss_vs_lr.png)"]
    return "\n".join(lines) + "\n"


def sweep(cfg: Any, factors: list[float], steps: int, sweep_dir: str | Path) -> Sweep:
    """Train one short run per factor under ``sweep_dir``; write the table, the plot and ``sweep.json``.

    Args:
        cfg: the :class:`~steadytrain.train.config.TrainConfig` to sweep (its batch plan is the target).
        factors: multiples of the linear-scaling estimate to try.
        steps: optimizer steps per trial.
        sweep_dir: the sweep's directory; each trial's run directory is new inside it (never overwritten).
    """
    import json

    from steadytrain.runs.plots import sweep_plot

    world = int(os.environ.get("WORLD_SIZE", "1"))
    estimate, scale_up = linear_estimate(cfg, world)
    root = Path(sweep_dir)
    root.mkdir(parents=True, exist_ok=True)
    trials = []
    for n, factor in enumerate(factors, start=1):
        log.info("trial %d/%d: factor %g, LR %.4g, %d steps", n, len(factors), factor, factor * estimate, steps)
        trials.append(_trial(cfg, factor, steps, root / f"lr-x{factor:g}"))
    best, held, text = verdict(trials, scale_up)
    result = Sweep(root, estimate, scale_up, trials, best, held, text)
    if int(os.environ.get("RANK", "0")) == 0:
        write_text_atomic(root / "sweep.json", json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
        try:
            sweep_plot(trials, estimate, f"{root.name}: loss against learning rate ({steps} steps)",
                       root / "loss_vs_lr.png")  # fmt: skip
        except Exception as err:  # the table and the verdict stand without the picture
            log.warning("%s: could not draw loss_vs_lr.png: %s: %s", root, type(err).__name__, err)
        write_text_atomic(root / "sweep.md", _table(result))
    return result
