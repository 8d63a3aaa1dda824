"""A finished (or stopped) run's model and data settings, rebuilt for a single-process replay.

``steadytrain.diagnose.hunt`` replays one shard or one optimizer step of a run. Building the model
is train's business (the registry, the tabular model's statistics, checkpoints), so diagnose calls
:func:`run_model` here rather than knowing how; it gets back a plain model and plain settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from steadytrain._io import load_json
from steadytrain.errors import UserError
from steadytrain.train.checkpoint import list_checkpoints, load_checkpoint
from steadytrain.train.config import load_config
from steadytrain.train.models import build_model
from steadytrain.train.rundir import open_run_dir
from steadytrain.train.setup import data_path, load_schema, model_context

__all__ = ["choose_checkpoint", "run_model"]


def choose_checkpoint(ckpt_dir: Path, before_step: int | None) -> tuple[Path, str | None]:
    """The newest checkpoint at or before ``before_step`` (None: the newest); when none precedes it,
    the earliest, with a note saying so."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise UserError(f"{ckpt_dir}: no checkpoint to replay from (the run wrote none)")
    if before_step is None:
        return found[-1][1], None
    earlier = [p for step, p in found if step <= before_step]
    if earlier:
        return earlier[-1], None
    step, path = found[0]
    return path, (
        f"no checkpoint precedes step {before_step + 1}: using the earliest, {path.name} (step {step}); "
        "its weights come from after the failure"
    )


def run_model(
    run_dir: str | Path, *, checkpoint: str | Path | None = None, before_step: int | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """The run's model with a checkpoint's weights, and the settings a replay needs.

    Args:
        run_dir: the run directory.
        checkpoint: a checkpoint file; default: the newest at or before ``before_step``.
        before_step: the last optimizer step whose weights may be used.

    Returns:
        ``(model, settings)``; settings hold ``data`` (path), ``schema`` (a Schema or None), ``policy``,
        ``seed``, ``global_batch_size``, ``micro_batch_size``, ``shuffle_window``, ``checkpoint``,
        ``checkpoint_step`` and ``note`` (or None).
    """
    run = open_run_dir(Path(run_dir))
    cfg = load_config(run.config)
    note = None
    if checkpoint is None:
        checkpoint, note = choose_checkpoint(run.checkpoints, before_step)
    state = load_checkpoint(checkpoint)
    path = data_path(cfg)
    model = build_model(cfg.model.name, cfg.model.kwargs(), context=model_context(cfg, path))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise UserError(f"{checkpoint}: does not fit the run's model ({str(err).splitlines()[0][:200]})") from None
    plan = load_json(run.plan, what="plan") if run.plan.exists() else {}
    settings = {
        "data": path,
        "schema": load_schema(cfg),
        "policy": cfg.data.policy,
        "seed": cfg.run.seed,
        "global_batch_size": plan.get("global_batch_size", cfg.batch.global_batch_size),
        "micro_batch_size": cfg.batch.micro_batch_size,
        "shuffle_window": cfg.data.shuffle_window,
        "checkpoint": str(checkpoint),
        "checkpoint_step": int(state["step"]),
        "note": note,
    }
    return model, settings
