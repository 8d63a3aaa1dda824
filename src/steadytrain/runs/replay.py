"""A finished (or stopped) run's model and data settings, rebuilt for a single-process replay.

``steadytrain.diagnose.hunt`` replays one shard or one optimizer step of a run. Building the model
is train's business (the registry, the tabular model's statistics, checkpoints, the seeded initial
weights), so diagnose calls :func:`run_model` here rather than knowing how; it gets back a plain
model and its :class:`~steadytrain.diagnose.settings.ReplaySettings`.

Which weights: the checkpoint of step ``N`` holds the weights after optimizer step ``N``, so the
weights optimizer step ``s`` started from are those after step ``s - 1``. The replay uses the newest
state at or before that step: a checkpoint, or, when the run saved none that early, the run's initial
weights, rebuilt exactly as the training loop built them (same seed, same order of seeding). Never a
later state; when the state is older than the wanted step the settings carry a note that says by how
many steps.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from steadytrain._text import error_text
from steadytrain.data import open_dataset
from steadytrain.data.transform import load_transform
from steadytrain.diagnose.settings import ReplaySettings
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir
from steadytrain.rundir.origin import require_replayable
from steadytrain.rundir.schema import read_metrics, read_plan
from steadytrain.runs.mixreplay import MixtureReplay
from steadytrain.train.checkpoint.catalog import latest_checkpoint, load_checkpoint
from steadytrain.train.setup.config import TrainConfig, load_config
from steadytrain.train.setup.holdout import holdout
from steadytrain.train.setup.models import build_model
from steadytrain.train.setup.pieces import data_path, load_schema, model_context

__all__ = ["choose_checkpoint", "initial_model", "run_model", "weights_note"]


def choose_checkpoint(ckpt_dir: Path, before_step: int | None) -> Path | None:
    """The newest checkpoint at or before ``before_step`` (None: the newest of all).

    None when the run saved none that early: the run's initial weights (:func:`initial_model`) are then
    the newest state at or before ``before_step``. A later checkpoint is never chosen: its weights
    come from after the step being replayed.
    """
    return latest_checkpoint(ckpt_dir, before_step)


def weights_note(weights_step: int | None, before_step: int | None) -> str | None:
    """What a replay should say about its weights: None when they are exactly the ones wanted.

    Args:
        weights_step: the optimizer step after which the weights were taken (0: the initial weights).
        before_step: the step whose weights were wanted (``s - 1`` for a failure at step ``s``); None
            when any state will do (the newest).
    """
    if weights_step is None or before_step is None:
        return None if weights_step != 0 else "the run saved no checkpoint: replaying from its initial weights"
    failing = before_step + 1
    what = "the run's initial weights" if weights_step == 0 else f"the weights after step {weights_step}"
    if weights_step > before_step:
        return (
            f"{what} come from after step {failing} (which started from the weights after step {before_step}): "
            "the replay does not see the weights of the failure"
        )
    if weights_step < before_step:
        return (
            f"no checkpoint at step {before_step}: using {what}, {before_step - weights_step} step(s) before "
            f"step {failing} started; not an exact replay of step {failing}'s weights"
        )
    return None


@contextmanager
def _rng_kept() -> Iterator[None]:
    """Put back Python's, NumPy's and torch's random states (and PYTHONHASHSEED) after reseeding them."""
    py, npy, hashseed = random.getstate(), np.random.get_state(), os.environ.get("PYTHONHASHSEED")
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        if hashseed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = hashseed


def _seeded_model(cfg: TrainConfig, path: Path) -> nn.Module:
    """The model with the weights the run started from, seeded in the order the training loop seeds.

    ``train.loop._build`` runs ``seed_everything(run.seed)``, builds the data (which draws nothing from
    the global generators), then ``torch.manual_seed(run.seed)`` and builds the model. The caller's
    random states are put back afterwards.
    """
    from steadytrain.env import seed_everything

    with _rng_kept():
        seed_everything(cfg.run.seed)  # determinism flags do not change the initial values: not switched on here
        torch.manual_seed(cfg.run.seed)
        return build_model(cfg.model.name, cfg.model.kwargs(), context=model_context(cfg, path))


def initial_model(run_dir: str | Path) -> nn.Module:
    """The run's model with the weights it started from (before optimizer step 1), on the CPU.

    Example (a sketch; ``run`` is a run directory):
        ``initial_model(run).state_dict()`` equals the weights the run's first step started from.
    """
    run = open_run_dir(Path(run_dir))
    require_replayable(run.path, "steadytrain.runs.replay.initial_model")  # an own-loop config is not a TrainConfig
    cfg = load_config(run.config)
    return _seeded_model(cfg, data_path(cfg))


def _load_weights(model: nn.Module, state: dict[str, Any], checkpoint: Path) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # torch's first line is a heading: the next ones name the parameter and shapes
        raise UserError(f"{checkpoint}: does not fit the run's model ({error_text(err)})") from None


def run_model(
    run_dir: str | Path, *, checkpoint: str | Path | None = None, before_step: int | None = None
) -> tuple[nn.Module, ReplaySettings]:
    """The run's model with the weights of a checkpoint (or its initial ones), and the settings a replay needs.

    Args:
        run_dir: the run directory.
        checkpoint: a checkpoint file; default: the newest at or before ``before_step``, or the run's
            initial weights when there is none that early (never a later checkpoint).
        before_step: the step whose weights are wanted (``s - 1`` to replay step ``s``; 0: the initial
            weights); None: the newest.

    Returns:
        ``(model, settings)``: the :class:`~steadytrain.diagnose.settings.ReplaySettings` of the run's data
        and batches, its ``spike`` rule and the global batches its rollbacks passed over; ``checkpoint`` (None
        for the initial weights), ``checkpoint_step`` (0 for the initial weights) and ``note`` (None when the
        weights are exactly those of ``before_step``; else what they are instead).

    Raises:
        UserError: not a run directory, a run of the user's own loop (``loop.json``: its ``config.yaml`` is not a
            training config), an unreadable checkpoint, or one that does not fit the model.
    """
    run = open_run_dir(Path(run_dir))
    require_replayable(run.path, "steadytrain.runs.replay.run_model")  # an own-loop config is not a TrainConfig
    cfg = load_config(run.config)
    path = data_path(cfg)
    rollbacks: list[dict[str, Any]] = []
    last = max((r["step"] for r in read_metrics(run.metrics, rollbacks)[0]), default=None)
    if before_step is not None and last is not None and before_step >= last:
        raise UserError(f"step {before_step + 1}: the run has {last} optimizer steps (metrics.jsonl): give 1 to {last}")
    if checkpoint is None:
        checkpoint = choose_checkpoint(run.checkpoints, before_step)
    model = _seeded_model(cfg, path)  # the initial weights; a checkpoint's replace them
    step = 0
    if checkpoint is not None:
        state = load_checkpoint(checkpoint)
        _load_weights(model, state, Path(checkpoint))
        step = int(state["step"])
    plan = read_plan(run.plan)  # checked: a batch size of text would fail deep in the replay
    held_out = set(plan.get("eval_shards") or ())
    gbs = plan.get("global_batch_size", cfg.batch.global_batch_size)
    settings = ReplaySettings(
        data=path,
        shards=sorted(set(open_dataset(path).shard_ids) - held_out) if held_out and not cfg.data.sources else None,
        rows=holdout(cfg, path, gbs).training_rows
        if cfg.eval.holdout_fraction is not None and not cfg.data.sources
        else None,
        schema=load_schema(cfg),
        policy=cfg.data.policy,
        transform=load_transform(cfg.data.transform),
        seed=cfg.run.seed,
        global_batch_size=gbs,
        micro_batch_size=cfg.batch.micro_batch_size,
        shuffle_window=cfg.data.shuffle_window,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        checkpoint_step=step,
        note=weights_note(step, before_step),
        spike_threshold=cfg.spike.threshold,
        spike_min_ratio=cfg.spike.min_ratio,
        skipped_batches=sorted({b for r in rollbacks for b in r["skipped_batches"]}),
        mixture=MixtureReplay(cfg, gbs) if cfg.data.sources else None,
    )
    return model, settings
