"""What a training job is built from before its run directory is claimed, and the metrics it starts with.

Split from :mod:`steadytrain.train.job.loop` (which calls both) so the loop stays readable: the pieces
(plan, data, model, optimizer, accumulator), built the same way on every rank, and the run's metrics log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from steadytrain.accumulate import GradientAccumulator
from steadytrain.data import EvalSet, ShardedDataset
from steadytrain.data.sourcemap import SourceMap
from steadytrain.rundir.layout import RunDir
from steadytrain.train.hf.model import hf_run_files
from steadytrain.train.job.spikes import SpikeGuard
from steadytrain.train.job.state import TrainState
from steadytrain.train.observe.layers import LayerMonitor
from steadytrain.train.observe.metrics import MetricsLog, Progress
from steadytrain.train.observe.sources import SourceLosses
from steadytrain.train.observe.throughput import Throughput
from steadytrain.train.observe.trackers import start_trackers
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo, wrap_model
from steadytrain.train.setup.holdout import HeldOut
from steadytrain.train.setup.mesh import join_mesh
from steadytrain.train.setup.mixture import source_map, training_data, validation_data
from steadytrain.train.setup.models import build_model
from steadytrain.train.setup.pieces import (
    RunPlan,
    build_accumulator,
    build_optimizer,
    data_path,
    fsdp_policy,
    model_context,
    resolve_plan,
)
from steadytrain.train.setup.speed import CompiledModel, speed_up
from steadytrain.train.setup.tensor_parallel import apply_tensor_parallel

__all__ = ["Pieces", "build_pieces", "start_metrics"]

log = logging.getLogger("steadytrain.train")


@dataclass
class Pieces:
    """What the job builds before its run directory is claimed (nothing is written yet)."""

    plan: RunPlan
    held: HeldOut
    ds: ShardedDataset
    evalset: EvalSet | None
    model: torch.nn.Module
    compiled: CompiledModel | None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    acc: GradientAccumulator
    hf_files: dict[str, str]
    info: DistInfo
    """The job's place on every rank, with its layout (:func:`~steadytrain.train.setup.mesh.join_mesh`)."""
    sources: SourceMap | None = None
    """``data.sources``: the mixture's sources and shard ids, as ``sources.json`` has them (None: one dataset)."""


def build_pieces(cfg: TrainConfig, info: DistInfo) -> Pieces:
    """Every piece of the job on this rank, laid out over the ranks as ``distributed`` says (a mesh is built here:
    every rank calls this)."""
    from steadytrain.env import seed_everything

    info = join_mesh(info, cfg.distributed)  # a refused shape is refused on every rank alike, before any file
    seed_everything(cfg.run.seed, cfg.run.deterministic)
    path = data_path(cfg)
    layout = resolve_plan(cfg, info.dp_size, None)
    ds, held, mix = training_data(cfg, info, layout.global_batch_size, layout.accumulation_steps)
    plan = resolve_plan(cfg, info.dp_size, ds.steps_per_epoch, ds.dropped_per_epoch)
    evalset = validation_data(cfg, info, ds, held, mix)  # refused here, before any step
    torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank
    model = build_model(cfg.model.name, cfg.model.kwargs(), context=model_context(cfg, path))
    hf_files = hf_run_files(model, path) if info.is_main else {}  # config.json, tokenizer: `export --format hf`
    model = apply_tensor_parallel(model, info)  # torchtitan's order: tensor parallel, checkpointing, compile, shard
    compiled = speed_up(model, cfg.model, announce=info.is_main)  # checkpointing, then compile: before the wrap
    # DDP broadcasts rank 0's weights when built; fully_shard keeps each rank's shard of the equal, seeded weights
    model = wrap_model(model, info, None, fsdp_policy(cfg, info.kind))
    optimizer = build_optimizer(cfg, model, plan.lr, info.device)
    scaler = torch.amp.GradScaler(info.device.type) if cfg.precision == "fp16" else None
    acc = build_accumulator(cfg, model, optimizer, plan, scaler)
    sources = source_map(cfg, mix, ds) if mix is not None else None
    return Pieces(plan, held, ds, evalset, model, compiled, optimizer, scaler, acc, hf_files, info, sources)


def start_metrics(
    cfg: TrainConfig, info: DistInfo, p: Pieces, run: RunDir, state: TrainState, spikes: SpikeGuard,
    meter: Throughput,
) -> MetricsLog:  # fmt: skip
    """The run's metrics, from the step it starts at (its trackers started there), and its layer monitor (the
    accumulator's observer, ``monitor.layers: norms``)."""
    plan, mon = p.plan, cfg.monitor
    layers = None
    if mon.layers == "norms":
        every = mon.every_steps or cfg.run.log_every
        layers = LayerMonitor(p.model, mon.group, every, lambda: state.step + 1)
        p.acc.observer = layers
        if info.is_main and plan.total_steps // every == state.step // every:  # no multiple of it left to run
            log.info(
                "monitor.every_steps=%d%s: no step from %d to %d is monitored; layers.jsonl gets refused steps only "
                "(give a smaller monitor.every_steps for layer norms)",
                every, "" if mon.every_steps else " (run.log_every)", state.step + 1, plan.total_steps,
            )  # fmt: skip
    return MetricsLog(
        run,
        info,
        items_per_step=plan.global_batch_size,
        max_grad_norm=cfg.clip.max_grad_norm,
        total_steps=plan.total_steps,
        elapsed_before=state.elapsed_before,
        progress=Progress(plan.total_steps, state.step) if info.is_main else None,
        spikes=spikes if spikes.collects else None,
        throughput=meter,
        layers=layers,
        sources=SourceLosses(p.sources.names, info) if p.sources is not None else None,
        trackers=start_trackers(run, cfg, info, step=state.step),
    )
