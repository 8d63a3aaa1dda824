"""``steadytrain sweep CONFIG --factors ... --steps N``: is the linear-scaling LR right for this batch?

The seed: the linear scaling rule is a heuristic, less reliable at large scale-ups; validate it with
a learning-rate sweep at the target effective batch, centred on the linear estimate. Each trial is a
short training (same seed, data and schedule shape) at LR = factor x (base LR x global batch / base
batch), in its own run directory under one sweep directory. The sweep writes ``sweep.json``,
``sweep.md`` (a table) and ``loss_vs_lr.png``, names the best factor and says whether the estimate
held up. Trials run one after another; under torchrun every trial uses all ranks.

The same sweep (factors, steps, ranks and config) run again into its ``--sweep-dir`` picks up where it stopped
(``resuming: k of n trials done``; the trial a signal stopped resumes from its checkpoint), and once finished trains
nothing and says so (``sweep-state.json`` records what was asked and each trial done). Any other sweep there is
refused before anything trains.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain._check import check_int
from steadytrain._io import brief, ensure_dir, load_json, write_text_atomic
from steadytrain._text import md
from steadytrain.errors import UserError
from steadytrain.runs.record import load_run, smooth

__all__ = [
    "FACTOR_RANGE",
    "HELD_UP_WITHIN",
    "MAX_TRIALS",
    "Sweep",
    "check_factors",
    "factor_tag",
    "linear_estimate",
    "parse_factors",
    "sweep",
]

log = logging.getLogger("steadytrain.runs")

LARGE_SCALE_UP = 8
"""A scale-up from the base batch from which the seed calls the linear rule less reliable (its example: 256 -> 2048)."""
HELD_UP_WITHIN = 0.01
"""The estimate held up when its smoothed final loss is within this fraction of the best trial's."""
MAX_TRIALS = 12
"""Factors (training runs) one sweep may start: a finer look is a second sweep around the best factor."""
FACTOR_RANGE = (1e-6, 1e6)
"""Multiples of the linear estimate a sweep may try: beyond, it is no longer a sweep around the estimate."""


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


def factor_tag(factor: float) -> str:
    """How a factor names its trial (``lr-x0.5``, ``lr-x1e-05``): 6 digits, no ``+`` (not allowed in a run name).

    Example:
        >>> factor_tag(0.25), factor_tag(1e6), factor_tag(2.0)
        ('0.25', '1e06', '2')
    """
    return f"{factor:g}".replace("+", "")


def check_factors(factors: list[float], source: str = "factors") -> list[float]:
    """``factors`` sorted, if a sweep can run them: 2 to :data:`MAX_TRIALS` distinct finite numbers in
    :data:`FACTOR_RANGE`; else a :class:`UserError` starting with ``source`` that says what to give.

    Example:
        >>> check_factors([2, 0.5, 1])
        [0.5, 1.0, 2.0]
    """
    low, high = FACTOR_RANGE
    for f in factors:
        if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f <= 0:
            raise UserError(f"{source}: {brief(f)} is not a positive finite number: give e.g. 0.25,0.5,1,2,4")
        if not low <= f <= high:
            raise UserError(f"{source}: factor {f:g} is outside {low:g}..{high:g} (multiples of the linear estimate)")
    tags = [factor_tag(f) for f in factors]
    if len(set(tags)) != len(tags):
        raise UserError(f"{source}: give distinct factors (equal to 6 significant digits: {', '.join(tags)})")
    if len(factors) < 2:
        raise UserError(f"{source}: give at least 2 distinct factors (e.g. 0.5,1,2): one trial compares nothing")
    if len(factors) > MAX_TRIALS:
        raise UserError(
            f"{source}: {len(factors)} factors would start {len(factors)} training runs: at most {MAX_TRIALS} "
            "per sweep (sweep again around the best factor for a finer look)"
        )
    return sorted(float(f) for f in factors)


def parse_factors(text: str) -> list[float]:
    """``"0.25,0.5,1,2,4"`` -> ``[0.25, 0.5, 1.0, 2.0, 4.0]`` (see :func:`check_factors`).

    Example:
        >>> parse_factors("1, 0.5,2")
        [0.5, 1.0, 2.0]
    """
    source = f"--factors {brief(text)}"
    try:
        factors = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{source}: give numbers separated by commas, e.g. 0.25,0.5,1,2,4") from None
    return check_factors(factors, source)


def linear_estimate(cfg: Any, world_size: int) -> tuple[float, float | None]:
    """The linear-scaling LR for the config's effective batch, and the scale-up factor k (None: unscaled)."""
    from steadytrain.schedule import scale_lr
    from steadytrain.train.setup.pieces import batch_plan

    global_batch = batch_plan(cfg, world_size).global_batch_size
    base = cfg.batch.base_batch_size
    if base is None:
        return cfg.batch.base_lr, None
    return scale_lr(cfg.batch.base_lr, base, global_batch, "linear"), global_batch / base


def _trial_config(cfg: Any, factor: float, steps: int) -> Any:
    """The config with LR = factor x the linear estimate (the linear rule from a scaled base LR), validated."""
    from pydantic import ValidationError

    from steadytrain.train.setup.config import error_line

    suffix = f"-lr-x{factor_tag(factor)}"
    trial = cfg.model_copy(deep=True)
    try:  # the config validates each assignment
        trial.batch.base_lr = cfg.batch.base_lr * factor
        trial.batch.scaling = "linear"
        trial.run.max_steps = steps
        trial.run.name = cfg.run.name[: 100 - len(suffix)] + suffix
    except ValidationError as err:
        raise UserError(error_line(err, f"the trial at factor {factor:g}")) from None
    return trial


def _trial_configs(cfg: Any, factors: list[float], steps: int, root: Path, world: int, resumed: bool) -> list[Any]:
    """Every trial's config, checked before the first one trains: a bad factor costs no training. ``resumed``: the
    same sweep ran here before, and the trial it was stopped in is resumed (its directory may exist)."""
    from steadytrain.train.setup.pieces import batch_plan

    out = []
    for factor in factors:
        trial = _trial_config(cfg, factor, steps)
        lr = batch_plan(trial, world).lr
        if lr is not None and not (math.isfinite(lr) and lr > 0):
            raise UserError(f"--factors: factor {factor:g} gives LR {lr}: not a usable learning rate; lower it")
        where = root / f"lr-x{factor_tag(factor)}"
        if where.exists() and not (resumed and factor == factors[0]):
            raise UserError(f"{where} exists (an earlier sweep?): choose another --sweep-dir (runs are never replaced)")
        out.append(trial)
    return out


def _name(path: Path) -> str:
    """A directory's own name, also for ``.`` (symlinks not followed)."""
    return Path(os.path.abspath(path)).name or str(path)


def _sweep_dir(path: str | Path) -> Path:
    return ensure_dir(path, "--sweep-dir")


STATE = "sweep-state.json"
"""What the sweep asked for (factors, steps, world size, config) and each trial done: written before the first trial
and after each one, so the same sweep run again resumes (or, finished, trains nothing)."""
SWEEP_FILES = ("sweep.json", "sweep.md", "loss_vs_lr.png", STATE)


def _request(cfg: Any, factors: list[float], steps: int, world: int) -> dict[str, Any]:
    """What makes two sweeps the same one, as JSON reads it back."""
    asked = {"factors": factors, "steps": steps, "world_size": world, "config": cfg.to_dict()}
    return json.loads(json.dumps(asked, allow_nan=False, default=str))


def _done(path: Path, request: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """The trials already done in ``path`` by this same sweep (None: no sweep ran there), and whether it is finished
    (every trial done and ``sweep.json`` written).

    Raises:
        UserError: ``path`` holds an earlier sweep that is not this one (other factors, steps, ranks or config, or
            one without ``sweep-state.json``), or a ``sweep-state.json`` that is not one.
    """
    try:
        earlier = sorted(p.name for p in path.iterdir() if p.name in SWEEP_FILES or p.name.startswith("lr-x"))
    except OSError:  # absent (created), or not a directory (ensure_dir says so)
        return None, False
    if not earlier:
        return None, False
    state = load_json(path / STATE, what="sweep state") if STATE in earlier else None
    if not isinstance(state, dict) or state.get("request") != request:
        shown = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        other = " with other factors, steps, ranks or config" if state is not None else ""
        raise UserError(
            f"--sweep-dir {brief(str(path))}: {shown} {'exists' if len(earlier) == 1 else 'exist'} (an earlier "
            f"sweep{other}): give another --sweep-dir (a sweep never adds to or replaces another; the same sweep run "
            "again resumes)"
        )
    trials = state.get("trials")
    keys = {"factor", "lr", "final_loss", "smoothed_loss", "diverged", "run_dir"}
    if not isinstance(trials, list) or not all(isinstance(t, dict) and keys <= t.keys() for t in trials):
        raise UserError(
            f"{path / STATE}: trials must be a list of the trials' results ({', '.join(sorted(keys))}): the file "
            "was changed by hand; remove it and give another --sweep-dir"
        )
    by = {t["factor"]: t for t in trials}
    done = [by[f] for f in request["factors"] if f in by]
    return done, len(done) == len(request["factors"]) and "sweep.json" in earlier


def _trial(trial_cfg: Any, factor: float, where: Path) -> dict[str, Any]:
    """Train one trial (resuming its run directory, when an interrupted sweep left it) and read its result."""
    from steadytrain.train.job.loop import Interrupted, TrainingStopped, train

    stopped = None
    try:
        train(trial_cfg, run_dir=where, auto_resume=where.exists())
    except Interrupted as err:  # Ctrl-C stops the sweep, not only this trial
        text = f"sweep stopped by a signal during the trial at factor {factor:g}: {err}"
        raise Interrupted(text, err.exit_code) from None
    except TrainingStopped as err:  # diverged: a result of the sweep, not a failure of it
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
        "val_loss": rec.evals[-1].get("val_loss") if rec.evals else None,
        "steps": len(rec.metrics),
        "skipped": sum(bool(r.get("skipped")) for r in rec.metrics),
        "diverged": diverged,
        "stopped": stopped,
        "run_dir": str(where),
    }


def judged_by(trials: list[dict[str, Any]]) -> tuple[str, str]:
    """What ranks the trials: the final validation loss when every one of them has a finite one (training
    loss rewards overfitting), else the smoothed final training loss. ``(key, words)``."""
    if trials and all(t.get("val_loss") is not None for t in trials):
        return "val_loss", "final validation loss"
    return "smoothed_loss", "smoothed final loss"


def verdict(trials: list[dict[str, Any]], scale_up: float | None) -> tuple[float | None, bool | None, str]:
    """The best factor (lowest final validation loss, or smoothed final training loss without one, among
    trials that did not diverge), whether the linear estimate (factor 1) held up, and one sentence saying so."""
    ok = [t for t in trials if not t["diverged"]]
    if not ok:
        return None, False, "every trial diverged: the linear estimate is far too high here; sweep lower factors"
    key, words = judged_by(ok)
    best = min(ok, key=lambda t: t[key])
    head = f"best factor {best['factor']:g} (LR {best['lr']:.3g}, {words} {best[key]:.4g})"
    k = f" at a scale-up of ×{scale_up:g} from the base batch" if scale_up else ""
    one = next((t for t in trials if t["factor"] == 1), None)
    if one is None:
        return best["factor"], None, f"{head}; factor 1 (the linear estimate) was not tried: add it to --factors"
    if one["diverged"]:
        return best["factor"], False, f"{head}; the linear estimate diverged{k}: it did not hold up, use a lower LR"
    gap = (one[key] - best[key]) / abs(best[key])
    if best is one or gap <= HELD_UP_WITHIN:
        within = "" if best is one else f" (within {gap:.1%} of the best)"
        return best["factor"], True, f"{head}; the linear-scaling estimate held up{k}{within}"
    why = (
        "the rule is a starting point, less reliable at large scale-ups"
        if scale_up and scale_up >= LARGE_SCALE_UP
        else "short trials: confirm with longer ones"
    )
    text = f"{head}; the linear-scaling estimate did not hold up{k}: factor {best['factor']:g} beat it by {gap:.1%}"
    return best["factor"], False, f"{text} in {words} ({why})"


def _table(result: Sweep) -> str:
    """The text of ``sweep.md``: names and the sentence through :func:`~steadytrain._text.md`; numbers as formatted."""
    lines = [
        f"# LR sweep {md(_name(result.dir))}",
        "",
        f"Linear-scaling estimate: LR {result.estimate:.4g}"
        + (f" (scale-up ×{result.scale_up:g})" if result.scale_up else " (unscaled base LR)"),
        "",
        "| factor | LR | final loss | smoothed loss | validation loss | diverged? | run |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in result.trials:
        fmt = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
        lines.append(
            f"| {t['factor']:g} | {fmt(t['lr'])} | {fmt(t['final_loss'])} | {fmt(t['smoothed_loss'])} | "
            f"{fmt(t.get('val_loss'))} | "
            f"{'yes' if t['diverged'] else 'no'} | {md(Path(t['run_dir']).name)} |"
        )
    lines += ["", md(result.sentence), "", "![loss against LR](loss_vs_lr.png)"]
    return "\n".join(lines) + "\n"


def sweep(cfg: Any, factors: list[float], steps: int, sweep_dir: str | Path) -> Sweep:
    """Train one short run per factor under ``sweep_dir``; write the table, the plot and ``sweep.json``.

    Args:
        cfg: the :class:`~steadytrain.train.setup.config.TrainConfig` to sweep (its batch plan is the target).
        factors: multiples of the linear-scaling estimate to try.
        steps: optimizer steps per trial.
        sweep_dir: the sweep's directory; each trial's run directory is new inside it (never overwritten). The
            same sweep run there again resumes it, or, finished, trains nothing and returns its result.

    Raises:
        UserError: factors a sweep cannot run (:func:`check_factors`), a trial config or LR that is not
            valid, a ``sweep_dir`` holding another sweep, a ``sweep_dir`` that cannot be a directory; all before
            the first trial trains.
        Interrupted: SIGINT/SIGTERM during a trial (``exit_code`` 130/75): no further trial starts.
    """
    from steadytrain.runs.plots import sweep_plot

    factors = check_factors(factors)
    check_int("steps", steps)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    estimate, scale_up = linear_estimate(cfg, world)
    request = _request(cfg, factors, steps, world)
    earlier, finished = _done(Path(sweep_dir), request)
    trials = list(earlier or [])
    todo = [f for f in factors if f not in {t["factor"] for t in trials}]
    configs = _trial_configs(cfg, todo, steps, Path(sweep_dir), world, resumed=earlier is not None)
    root = _sweep_dir(sweep_dir)
    main = int(os.environ.get("RANK", "0")) == 0
    if finished:
        log.info("%s: this sweep is finished (%d of %d trials done): nothing to train", root, len(trials), len(factors))
        return Sweep(root, estimate, scale_up, trials, *verdict(trials, scale_up))
    if earlier is not None:
        log.info("resuming: %d of %d trials done (%s)", len(trials), len(factors), root)
    elif main:
        write_text_atomic(root / STATE, json.dumps({"request": request, "trials": []}, allow_nan=False) + "\n")
    for factor, trial_cfg in zip(todo, configs, strict=True):
        n = len(trials) + 1
        log.info("trial %d/%d: factor %g, LR %.4g, %d steps", n, len(factors), factor, factor * estimate, steps)
        trials.append(_trial(trial_cfg, factor, root / f"lr-x{factor_tag(factor)}"))
        if main:
            write_text_atomic(root / STATE, json.dumps({"request": request, "trials": trials}, allow_nan=False) + "\n")
    trials.sort(key=lambda t: t["factor"])
    best, held, text = verdict(trials, scale_up)
    result = Sweep(root, estimate, scale_up, trials, best, held, text)
    if main:
        write_text_atomic(root / "sweep.json", json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
        try:
            sweep_plot(trials, estimate, f"{_name(root)}: loss against learning rate ({steps} steps)",
                       root / "loss_vs_lr.png")  # fmt: skip
        except Exception as err:  # the table and the verdict stand without the picture
            log.warning("%s: could not draw loss_vs_lr.png: %s: %s", root, type(err).__name__, err)
        write_text_atomic(root / "sweep.md", _table(result))
    return result
