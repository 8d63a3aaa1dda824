"""A mixture run's data (``data.sources``): its reader, its hold-out and validation per source, its source map.

Each source is opened, held out (``eval.holdout_shards`` / ``eval.holdout_fraction`` apply to each source alike)
and read as a single-source run would read it; :class:`~steadytrain.data.mixture.MixedDataset` mixes them.
Everything here is refused before the run directory exists: a source that is not a dataset or holds out all of
itself, two sources of the same data, sources whose columns or token vocabularies differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from steadytrain._check import exact_weight
from steadytrain.data import BatchedDataset, EvalSet, open_dataset
from steadytrain.data.evalset import MixedEvalSet
from steadytrain.data.mixture import MixedDataset, source_seed
from steadytrain.data.sourcemap import SourceMap, SourceSpan
from steadytrain.errors import UserError
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.holdout import HeldOut, holdout
from steadytrain.train.setup.pieces import (
    build_dataset,
    build_evalset,
    data_path,
    load_schema,
    load_transform,
    token_context,
)

__all__ = [
    "Mixture",
    "build_mixture",
    "mixture_evalset",
    "mixture_holdout",
    "source_map",
    "training_data",
    "validation_data",
]


@dataclass(frozen=True)
class Mixture:
    """The sources' paths, their shard-id offsets and what each holds out."""

    names: list[str]
    paths: list[Path]
    offsets: list[int]
    ids: list[int]
    """Each source's span of shard ids (its dataset's largest shard id, plus one)."""
    held: list[HeldOut]

    def combined(self) -> HeldOut:
        """The hold-out of all sources as one record (``plan.json``): held-out shards by mixture id."""
        shards = [o + s for o, h in zip(self.offsets, self.held, strict=True) for s in h.shards or ()]
        notes = [f"{n}: {h.note}" for n, h in zip(self.names, self.held, strict=True) if h.note]
        return HeldOut(shards=shards or None, note="; ".join(notes) or None)


def _weights(cfg: TrainConfig) -> tuple[list[Fraction], list[tuple[int, list[Fraction]]]]:
    names = [s.name for s in cfg.data.sources]
    first = [exact_weight(f"data.sources {s.name} weight", s.weight) for s in cfg.data.sources]
    later = [
        (e.step - 1, [exact_weight(f"data.mix_schedule step {e.step}", e.weights[n], zero=True) for n in names])
        for e in cfg.data.mix_schedule or ()
    ]
    return first, later


def mixture_holdout(cfg: TrainConfig) -> Mixture:
    """Open every source (one line naming the source when one is not a dataset, holds out all of itself, or is
    another source's data again) and hold out its validation part."""
    names, paths, offsets, ids, held, offset, seen = [], [], [], [], [], 0, {}
    for s in cfg.data.sources:
        path = Path(s.path)
        try:
            if not path.exists():
                raise UserError(f"path {s.path!r} does not exist: give the source's dataset directory")
            ds = open_dataset(path)
            held.append(holdout(cfg, path, 1))
        except UserError as err:
            raise UserError(f"data.sources {s.name}: {err}") from None
        if (twin := seen.setdefault(ds.fingerprint(), s)) is not s:
            raise UserError(
                f"data.sources: {s.name!r} ({s.path!r}) holds the same data as {twin.name!r} ({twin.path!r}): a global "
                "batch could hold one example twice; list it once, with the two weights added"
            )
        names.append(s.name)
        paths.append(path)
        offsets.append(offset)
        ids.append(max(ds.shard_ids, default=-1) + 1)
        offset += ids[-1]
    _same_tokens(names, paths)
    return Mixture(names, paths, offsets, ids, held)


def _same_tokens(names: list[str], paths: list[Path]) -> None:
    """Token datasets of one vocabulary and sequence length (a model reads them all)."""
    first = token_context(open_dataset(paths[0]).provenance)
    for name, path in zip(names[1:], paths[1:], strict=True):
        mine = token_context(open_dataset(path).provenance)
        for key in ("vocab_size", "seq_len"):
            if mine.get(key) != first.get(key):
                theirs, ours = (x.get(key, "none recorded") for x in (mine, first))
                raise UserError(
                    f"data.sources: source {name!r} has {key} {theirs}, source {names[0]!r} {ours}: "
                    "a mixture's token sources must share one tokenizer and sequence length (re-ingest one of them)"
                )


def build_mixture(
    cfg: TrainConfig, mix: Mixture, info: DistInfo, accumulation_steps: int, *, batch_size: int | None = None
) -> MixedDataset:
    """This rank's view of the mixture's global order (``batch_size``: the micro-batch, default the config's)."""
    schema = load_schema(cfg)
    readers = []
    for j, (name, path, held) in enumerate(zip(mix.names, mix.paths, mix.held, strict=True)):
        shards = None if not held.shards else sorted(set(open_dataset(path).shard_ids) - set(held.shards))
        try:
            reader = BatchedDataset(
                path, shards=shards, batch_size=1, seed=source_seed(cfg.run.seed, j),
                shuffle_window=cfg.data.shuffle_window, schema=schema, policy=cfg.data.policy, rows=held.training_rows,
            )  # fmt: skip
            readers.append(reader)
        except UserError as err:
            raise UserError(f"data.sources {name}: {err}") from None
    first, later = _weights(cfg)
    return MixedDataset(
        mix.names, readers, mix.offsets, first, schedule=later, batch_size=batch_size or cfg.batch.micro_batch_size,
        accumulation_steps=accumulation_steps, rank=info.dp_rank, world_size=info.dp_size, seed=cfg.run.seed,
        transform=load_transform(cfg.data.transform),
    )  # fmt: skip


def mixture_evalset(cfg: TrainConfig, mix: Mixture, info: DistInfo, training: MixedDataset) -> MixedEvalSet | None:
    """This rank's validation examples of every source that holds some out (None: none does): each source's as a
    single-source run's (:func:`~steadytrain.train.setup.pieces.build_evalset`), checked against its reader."""
    parts = [
        (j, part)
        for j, (path, held, reader) in enumerate(zip(mix.paths, mix.held, training.readers, strict=True))
        if (part := build_evalset(cfg, path, held.shards, info, reader, rows=held.rows)) is not None
    ]
    return MixedEvalSet(parts, mix.names, mix.offsets) if parts else None


def training_data(
    cfg: TrainConfig, info: DistInfo, global_batch_size: int, accumulation_steps: int
) -> tuple[BatchedDataset | MixedDataset, HeldOut, Mixture | None]:
    """This rank's training reader, what the run holds out, and its mixture (None: ``data.path``, one dataset)."""
    if cfg.data.sources is None:
        path = data_path(cfg)
        held = holdout(cfg, path, global_batch_size)
        ds = build_dataset(cfg, path, info, accumulation_steps, held.shards, rows=held.training_rows)
        return ds, held, None
    mix = mixture_holdout(cfg)
    ds = build_mixture(cfg, mix, info, accumulation_steps)
    total = cfg.run.max_steps or ds.steps_per_epoch * cfg.run.epochs
    if late := [e.step for e in cfg.data.mix_schedule or () if e.step > total]:
        raise UserError(
            f"data.mix_schedule step {late[0]} is beyond the run's {total} steps (run.max_steps={cfg.run.max_steps}, "
            f"run.epochs={cfg.run.epochs}): it would never apply; remove it or train longer"
        )
    return ds, mix.combined(), mix


def validation_data(
    cfg: TrainConfig, info: DistInfo, ds: BatchedDataset | MixedDataset, held: HeldOut, mix: Mixture | None
) -> EvalSet | MixedEvalSet | None:
    """This rank's validation examples: ``eval.data``, or what :func:`training_data` held out (of each source)."""
    if mix is None or cfg.eval.data is not None:
        shards, rows = (held.shards, held.rows) if mix is None else (None, None)
        return build_evalset(cfg, data_path(cfg), shards, info, ds, rows=rows)
    return mixture_evalset(cfg, mix, info, ds) if cfg.eval.enabled else None


def source_map(cfg: TrainConfig, mix: Mixture, ds: MixedDataset) -> SourceMap:
    """The run's ``sources.json`` before its first step (nothing seen yet)."""
    spans = [
        SourceSpan(s.name, str(Path(s.path).resolve()), s.weight, o, k, n, r.dataset.fingerprint())
        for s, o, k, r, n in zip(cfg.data.sources, mix.offsets, mix.ids, ds.readers, ds.sizes, strict=True)
    ]
    schedule = [{"step": e.step, "weights": dict(e.weights)} for e in cfg.data.mix_schedule or ()]
    return SourceMap(spans, schedule, mix.names[ds.largest])
