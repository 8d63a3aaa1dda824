"""Building a run's pieces from its config: batch plan, data, model, optimizer, schedule, accumulator.

Each builder is a plain function of the config (and the process's place in the job), so the
training loop reads top to bottom and a test can build any piece alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.data import (
    BatchedDataset,
    EvalSet,
    RowFilter,
    Schema,
    healthy_shards,
    infer_schema,
    open_dataset,
)
from steadytrain.data.loader import MicroBatchLoader, default_num_workers
from steadytrain.data.transform import load_transform
from steadytrain.errors import UserError
from steadytrain.optim import LAMB, LARS, decay_groups
from steadytrain.schedule import BatchPlan, warmup_schedule
from steadytrain.train.hf.model import is_hf
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo, mixed_precision
from steadytrain.train.setup.mesh import layout_kind, mesh_shape
from steadytrain.train.setup.tensor_parallel import check_plan

__all__ = [
    "RunPlan",
    "build_accumulator",
    "build_dataset",
    "build_loader",
    "build_optimizer",
    "data_path",
    "fsdp_policy",
    "resolve_plan",
]


@dataclass(frozen=True)
class RunPlan:
    """The numbers a run is built from: the batch plan, counted in optimizer steps."""

    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    global_batch_size: int
    base_lr: float
    base_batch_size: int | None
    scaling_rule: str
    lr: float
    steps_per_epoch: int | None
    total_steps: int | None
    warmup_steps: int | None
    dropped_per_epoch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def data_path(cfg: TrainConfig) -> Path:
    """The dataset directory: the configured one, or the embedded corpus (written on first use)."""
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    if cfg.data.sources:  # a mixture: what the model is built for (the sources share columns and tokens)
        return Path(cfg.data.sources[0].path)
    from steadytrain.train.setup.corpus import default_corpus

    return default_corpus(cfg.data.seq_len)


def batch_plan(cfg: TrainConfig, world_size: int) -> BatchPlan:
    """The BatchPlan of the config on ``world_size`` ranks (global batch held, accumulation derived)."""
    b = cfg.batch
    return BatchPlan(
        micro_batch_size=b.micro_batch_size,
        accumulation_steps=b.accumulation_steps,
        global_batch_size=b.global_batch_size,
        world_size=world_size,
        base_lr=b.base_lr,
        base_batch_size=b.base_batch_size,
        scaling_rule=b.scaling,
    )


def resolve_plan(cfg: TrainConfig, world_size: int, steps_per_epoch: int | None, dropped: int | None = None) -> RunPlan:
    """Every derived number; without ``steps_per_epoch`` the step counts stay unknown (None)."""
    bp = batch_plan(cfg, world_size)
    total = warmup = None
    if steps_per_epoch is not None:
        # max_steps decides when set (as many epochs as it takes); otherwise the epochs do.
        total = cfg.run.max_steps if cfg.run.max_steps is not None else steps_per_epoch * cfg.run.epochs
        warmup = cfg.batch.warmup_steps
        if warmup is None:
            warmup = math.ceil((cfg.batch.warmup_ratio or 0.0) * total)
        if warmup > total:
            raise UserError(f"batch.warmup_steps={warmup} exceeds the run's {total} optimizer steps: shorten it")
    return RunPlan(
        micro_batch_size=bp.micro_batch_size,
        accumulation_steps=bp.accumulation_steps,
        world_size=world_size,
        global_batch_size=bp.global_batch_size,
        base_lr=cfg.batch.base_lr,
        base_batch_size=cfg.batch.base_batch_size,
        scaling_rule=cfg.batch.scaling,
        lr=float(bp.lr),
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        warmup_steps=warmup,
        dropped_per_epoch=dropped,
    )


def load_schema(cfg: TrainConfig) -> Schema | None:
    return Schema.load(cfg.data.schema_file) if cfg.data.schema_file else None


def build_dataset(
    cfg: TrainConfig,
    path: Path,
    info: DistInfo,
    accumulation_steps: int,
    held_out: list[int] | None = None,
    *,
    rows: RowFilter | None = None,
) -> BatchedDataset:
    """This rank's view of the global order (equal micro-batch counts on every rank), without the ``held_out``
    shards, through ``rows`` (:attr:`~steadytrain.train.setup.holdout.HeldOut.training_rows`: the held-out records left
    out)."""
    shards = None if not held_out else sorted(set(open_dataset(path).shard_ids) - set(held_out))
    return BatchedDataset(
        path,
        shards=shards,
        rank=info.dp_rank,  # the ranks of one tensor-parallel group read the same micro-batches
        world_size=info.dp_size,
        batch_size=cfg.batch.micro_batch_size,
        accumulation_steps=accumulation_steps,
        shuffle=True,
        seed=cfg.run.seed,
        shuffle_window=cfg.data.shuffle_window,
        schema=load_schema(cfg),
        policy=cfg.data.policy,
        transform=load_transform(cfg.data.transform),
        rows=rows,
    )


def build_loader(cfg: TrainConfig, ds: BatchedDataset, device: torch.device) -> MicroBatchLoader:
    """The micro-batches of ``ds``, read ahead by ``data.num_workers`` processes (pinned memory on a GPU)."""
    workers = cfg.data.num_workers if cfg.data.num_workers is not None else default_num_workers()
    return MicroBatchLoader(ds, num_workers=workers, prefetch=cfg.data.prefetch, pin_memory=device.type == "cuda")


def build_evalset(
    cfg: TrainConfig,
    path: Path,
    held_out: list[int] | None,
    info: DistInfo,
    training: BatchedDataset | None,
    *,
    rows: RowFilter | None = None,
) -> EvalSet | None:
    """This rank's slice of the validation set: ``eval.data``, the ``held_out`` shards or the held-out ``rows``
    (:attr:`~steadytrain.train.setup.holdout.HeldOut.rows`); None without one (never the training data itself).
    Refused at start if it does not fit the training data's columns (a DatasetError: one line, before any step)."""
    if not cfg.eval.enabled or (cfg.eval.data is None and not held_out and rows is None):
        return None
    b, schema = cfg.eval.micro_batch_size or cfg.batch.micro_batch_size, load_schema(cfg)
    try:
        evalset = EvalSet(
            Path(cfg.eval.data) if cfg.eval.data is not None else path,
            shards=held_out,
            rank=info.dp_rank,
            world_size=info.dp_size,
            batch_size=b,
            max_examples=cfg.eval.max_batches * b if cfg.eval.max_batches else None,
            schema=schema,
            policy=cfg.data.policy,
            rows=rows if cfg.eval.data is None else None,
        )
        if training is not None:
            evalset.check_fits(training)
    except UserError as err:
        if cfg.eval.data is None:
            raise
        raise UserError(f"eval.data: {err}") from None  # which key to fix
    return evalset


def numeric_stats(path: Path, schema: Schema) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of the schema's numeric fields over the dataset (for standardizing)."""
    ds = open_dataset(path)
    names = [
        n for n, f in schema.fields.items() if f.vocabulary is None and f.dtype.startswith(("int", "uint", "float"))
    ]
    sums = {n: np.zeros(3) for n in names}  # count, sum, sum of squares
    for sid in ds.shard_ids:
        table = ds.read_shard(sid, columns=names)
        for n in names:
            col = pc.cast(table[n], "float64")
            col = pc.filter(col, pc.is_finite(col))
            sums[n] += [len(col), pc.sum(col).as_py() or 0.0, pc.sum(pc.multiply(col, col)).as_py() or 0.0]
    out = {}
    for n, (c, s, q) in sums.items():
        mean = s / c if c else 0.0
        std = math.sqrt(max(q / c - mean * mean, 0.0)) if c else 1.0
        out[n] = (mean, std if std > 0 else 1.0)
    return out


def category_counts(
    path: Path, shards: list[int], categorical: dict[str, list[Any]], label: str, num_classes: int | None, bucket: bool
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per categorical field: label sums ``[V (+1 bucket), classes or 1]`` and counts over ``shards``.

    Values outside the vocabulary are not counted: the bucket row (last, when ``bucket``) stays at 0.
    """
    ds = open_dataset(path)
    width = num_classes or 1
    out = {}
    for name, vocab in categorical.items():
        pos = {v: i for i, v in enumerate(vocab)}
        sums = torch.zeros(len(vocab) + bucket, width, dtype=torch.float64)
        counts = torch.zeros(len(vocab) + bucket, dtype=torch.float64)
        for sid in shards:
            table = ds.read_shard(sid, columns=[name, label])
            idx = torch.tensor([pos.get(v, -1) for v in table[name].to_pylist()], dtype=torch.long)
            y = torch.tensor(table[label].to_numpy(zero_copy_only=False), dtype=torch.float64)
            keep = idx >= 0
            idx, y = idx[keep], y[keep]
            counts.index_add_(0, idx, torch.ones_like(y))
            if num_classes:
                sums.index_put_((idx, y.long()), torch.ones_like(y), accumulate=True)
            else:
                sums[:, 0].index_add_(0, idx, y)
        out[name] = (sums, counts)
    return out


def model_context(cfg: TrainConfig, path: Path) -> dict[str, Any]:
    """What built-in models need from the data: ``seq_len`` and ``vocab_size`` (tiny-lm), schema and
    statistics (tabular).

    A token dataset written by ``steadytrain data ingest`` names its tokenizer's vocabulary and its
    sequence length in the index's provenance: tiny-lm is built for them. The tabular model's vocabulary
    is the given schema's, or one inferred from the shards whose provenance matches the majority (the
    same shards its target-encoding statistics are fitted on).
    """
    ctx: dict[str, Any] = {"seq_len": cfg.data.seq_len}
    if (cfg.model.name == "tiny-lm" or is_hf(cfg.model.name)) and (cfg.data.path or cfg.data.sources) is not None:
        ds = open_dataset(path)
        ctx.update(token_context(ds.provenance))
        if is_hf(cfg.model.name) and ds.shard_ids:  # refused before the run directory, not at the first forward
            ctx["columns"] = ds.read_schema(ds.shard_ids[0], verify=False).names
    if cfg.model.name == "tabular":
        ds = open_dataset(path)
        healthy = healthy_shards(ds)
        schema = load_schema(cfg) or infer_schema(ds, healthy)
        ctx.update(schema=schema, stats=numeric_stats(path, schema))
        ctx["category_counts"] = lambda cat, label, k, bucket: category_counts(path, healthy, cat, label, k, bucket)
    return ctx


def token_context(provenance: dict[str, Any]) -> dict[str, Any]:
    """``seq_len``, ``vocab_size`` and ``eod`` (the end-of-document id: an ``hf:`` model's ``eos_token_id``)
    from an ingested token dataset's provenance (empty for other data)."""
    out: dict[str, Any] = {}
    tokenizer = provenance.get("tokenizer")
    if isinstance(tokenizer, dict) and isinstance(tokenizer.get("vocab_size"), int) and tokenizer["vocab_size"] > 0:
        out["vocab_size"] = tokenizer["vocab_size"]
        eod = tokenizer.get("eod")
        if isinstance(eod, int) and not isinstance(eod, bool) and 0 <= eod < out["vocab_size"]:
            out["eod"] = eod
    if isinstance(provenance.get("seq_len"), int) and provenance["seq_len"] > 0:
        out["seq_len"] = provenance["seq_len"]
    return out


def fsdp_policy(cfg: TrainConfig, kind: str | None = None) -> Any:
    """FSDP2's mixed-precision policy for the run (``precision`` and ``distributed.fsdp_*``); None under DDP.
    ``kind``: the job's layout (``DistInfo.kind``), else as the config says."""
    d = cfg.distributed
    if kind is None:
        kind = layout_kind(d.mesh.shape) if d.mesh is not None else ("fsdp" if d.strategy == "fsdp" else "ddp")
    return mixed_precision(cfg.precision, d.fsdp_param_dtype, d.fsdp_reduce_dtype) if kind in ("fsdp", "mesh") else None


def build_optimizer(cfg: TrainConfig, model: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer (fused AdamW/SGD where the device supports it) over :func:`decay_groups`:
    ``optim.no_decay`` exempts biases and norm parameters from weight decay, for every optimizer alike."""
    o = cfg.optim
    groups = decay_groups(model, o.weight_decay, o.no_decay)
    if not groups:
        raise UserError(f"model.name={cfg.model.name!r} has no trainable parameters: nothing to optimize")
    if o.name == "lars":
        return LARS(groups, lr=lr, momentum=o.momentum)
    if o.name == "lamb":
        return LAMB(groups, lr=lr, betas=o.betas, eps=o.eps)
    fused = o.fused if o.fused is not None else device.type in ("cuda", "cpu")
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps, fused=fused)


def build_accumulator(
    cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, plan: RunPlan, scaler: Any
) -> GradientAccumulator:
    """The accumulator with the run's schedule, clipping and non-finite policy."""
    scheduler = warmup_schedule(
        optimizer, plan.warmup_steps, plan.total_steps, decay=cfg.batch.decay, min_lr_ratio=cfg.batch.min_lr_ratio
    )
    return GradientAccumulator(
        model,
        optimizer,
        accumulation_steps=plan.accumulation_steps,
        scheduler=scheduler,
        max_grad_norm=cfg.clip.max_grad_norm,
        clip_value=cfg.clip.clip_value,
        grad_scaler=scaler,
        on_nonfinite=cfg.nonfinite.policy,
    )


def check_before_launch(cfg: TrainConfig, *, run_dir: Path | None, resume: bool, world_size: int | None = None) -> None:
    """What can be checked once before ``--nproc`` starts the ranks: ``distributed.mesh`` fits ``world_size``, the
    run directory is free and the model builds with its arguments (on the meta device: no memory, any size), its
    built-in tensor-parallel plan included. Raises UserError."""
    from steadytrain.rundir.layout import exists_error

    if world_size is not None:
        mesh_shape(cfg.distributed, world_size)  # 2 ranks of a 4-rank mesh would each say it: say it once
    path = run_dir if run_dir is not None else Path(cfg.run.dir) / cfg.run.name
    if not resume and path.exists():
        raise exists_error(path)
    check_model_args(cfg)


def check_model_args(cfg: TrainConfig, *, user_code: bool = True) -> None:
    """The model builds with its arguments: on the meta device (no memory, any size); a UserError if not.
    The tabular model needs the data's statistics: it is checked where it is built. ``user_code=False``
    checks the built-in models only (``config show`` inspects a config without running its factory)."""
    from steadytrain.train.setup.models import build_model
    from steadytrain.train.setup.speed import check_blocks

    if cfg.model.name == "tiny-lm" or (user_code and cfg.model.name != "tabular"):  # hf: too (from its config)
        with torch.device("meta"):
            model = build_model(cfg.model.name, cfg.model.kwargs(), context={"seq_len": cfg.data.seq_len})
        check_blocks(model, cfg.model)  # model.ac_blocks names a list of blocks; checkpointing has blocks
        check_plan(model, cfg.distributed.mesh.tp if cfg.distributed.mesh is not None else 1)
    elif cfg.model.name == "tabular" and cfg.distributed.mesh is not None and cfg.distributed.mesh.tp > 1:
        raise UserError(
            f"distributed.mesh.tp={cfg.distributed.mesh.tp}: model.name=tabular has no tensor-parallel plan: set tp=1"
        )
