"""``steadytrain eval RUN``: a run's checkpoint evaluated on its validation set (or another dataset).

The model is built and wrapped as the run built it (DDP or FSDP2 under torchrun, alone otherwise),
its weights are a checkpoint's, and the pass is :func:`~steadytrain.train.job.evaluate.evaluate`, the
one the training loop runs, with the run's ``eval`` settings (micro-batch size, ``max_batches``):
so ``eval RUN --step S`` gives the value ``metrics.jsonl`` recorded at step ``S``. A run trained on a
``distributed.mesh`` of another number of ranks is evaluated on the ranks this command has (the checkpoint reshards):
FSDP2 over them when the mesh sharded the model, else DDP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, open_run_dir
from steadytrain.rundir.origin import require_replayable
from steadytrain.rundir.schema import read_plan
from steadytrain.train.checkpoint.catalog import checkpoint_at, restore
from steadytrain.train.job.evaluate import evaluate
from steadytrain.train.setup.config import TrainConfig, load_config
from steadytrain.train.setup.distributed import DistInfo, init_distributed, teardown, wrap_model
from steadytrain.train.setup.holdout import HeldOut, holdout
from steadytrain.train.setup.mesh import join_mesh
from steadytrain.train.setup.mixture import training_data, validation_data
from steadytrain.train.setup.models import build_model
from steadytrain.train.setup.pieces import (
    build_dataset,
    build_evalset,
    data_path,
    fsdp_policy,
    model_context,
    resolve_plan,
)
from steadytrain.train.setup.tensor_parallel import apply_tensor_parallel

__all__ = ["evaluate_run"]


def _held_out(run: RunDir, held: HeldOut) -> list[int] | None:
    """The shards the run held out: ``plan.json``'s list, or the same draw from ``run.seed`` (``held``) where the
    plan does not record it (never None for a run that held shards out: that would evaluate on training shards)."""
    if not held.shards:
        return None
    saved = read_plan(run.plan).get("eval_shards")
    return saved if saved is not None else held.shards


def _evalset(cfg: TrainConfig, run: RunDir, info: DistInfo, data: Path | None) -> Any:
    """The validation set the run used (its held-out shards or records, or ``eval.data``), or ``data`` in its place."""
    if cfg.data.sources is not None:
        return _mixture_evalset(cfg, info, data)
    path = data_path(cfg)
    layout = resolve_plan(cfg, info.dp_size, None)
    held = holdout(cfg, path, layout.global_batch_size)  # the run's own draw
    shards, rows = _held_out(run, held), held.rows
    training = build_dataset(cfg, path, info, layout.accumulation_steps, shards, rows=held.training_rows)
    if data is not None:
        none = {"data": str(data), "holdout_shards": None, "holdout_fraction": None}
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=none)})
        shards, rows = None, None
    elif not cfg.eval.enabled or (cfg.eval.data is None and held.empty):
        why = held.note.removeprefix("validation: none: ") if held.note else "no eval section"
        raise UserError(f"the run has no validation set ({why}): give one with --data PATH")
    return build_evalset(cfg, path, shards, info, training, rows=rows)


def _mixture_evalset(cfg: TrainConfig, info: DistInfo, data: Path | None) -> Any:
    """A mixture run's validation set: what each source holds out (per source), or ``data`` in its place."""
    layout = resolve_plan(cfg, info.dp_size, None)
    training, held, mix = training_data(cfg, info, layout.global_batch_size, layout.accumulation_steps)
    if data is not None:
        none = {"data": str(data), "holdout_shards": None, "holdout_fraction": None}
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=none)})
    found = validation_data(cfg, info, training, held, mix)
    if found is None:
        raise UserError("the run has no validation set (no source holds data out): give one with --data PATH")
    return found


def _on_these_ranks(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` laid out on ``world_size`` ranks: as it is when its mesh (if any) has that many ranks, else without
    the mesh (FSDP2 when the mesh sharded or split the model, else DDP)."""
    d = cfg.distributed
    if d.mesh is None or d.mesh.ranks == world_size:
        return cfg
    strategy = "fsdp" if d.mesh.shard > 1 or d.mesh.tp > 1 else "ddp"
    return cfg.model_copy(update={"distributed": d.model_copy(update={"mesh": None, "strategy": strategy})})


def evaluate_run(run_dir: str | Path, *, step: int | None = None, data: str | Path | None = None) -> dict[str, Any]:
    """``{"step", "val_loss", "val_items"}`` of the run's checkpoint at ``step`` (default: the latest).

    Raises:
        UserError: not a run, a run of the user's own loop (``loop.json``), no such checkpoint, no validation set,
            a dataset that does not fit.
    """
    run = open_run_dir(Path(run_dir))
    require_replayable(run.path, "eval")  # before the config: an own-loop run's would build the default model
    cfg = load_config(run.config)
    path = checkpoint_at(run.checkpoints, step)
    info = init_distributed(cfg.distributed.backend)  # under torchrun the ranks share the evaluation set
    try:
        cfg = _on_these_ranks(cfg, info.world_size)  # a run of 4 ranks is evaluated alone, as its checkpoint allows
        info = join_mesh(info, cfg.distributed)
        evalset = _evalset(cfg, run, info, Path(data) if data else None)
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model.name, cfg.model.kwargs(), context=model_context(cfg, data_path(cfg)))
        # as the run wrapped it (DDP broadcasts rank 0's weights here), so each rank loads the shards it holds
        model = wrap_model(apply_tensor_parallel(model, info), info, None, fsdp_policy(cfg, info.kind))
        state = restore(path, model, None, no_dist=info.backend is None)  # each rank reads what it holds
        result = evaluate(model, evalset, info, precision=cfg.precision)
        return result.row(int(state["step"])) | {"checkpoint": str(path)}
    finally:  # every rank leaves the group together, whatever happened, so no peer is left in a collective
        teardown(info)
