"""Replays of a mixture run (``data.sources``): its global batches, and the source a shard id belongs to.

A mixture's step holds examples of several sources in one order (:class:`~steadytrain.data.mixture.MixedDataset`):
:meth:`MixtureReplay.batch` rebuilds global batch ``b`` on one process exactly as the run's ranks read it. A hunt in
a shard replays that shard in its own source: :meth:`MixtureReplay.source` gives the settings of that source (its
path, its order seed, what it holds out) and the shard's own id there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from steadytrain.data import open_dataset
from steadytrain.data.mixture import MixedDataset, source_seed
from steadytrain.diagnose.settings import ReplaySettings
from steadytrain.errors import UserError
from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.mixture import Mixture, build_mixture, mixture_holdout

__all__ = ["MixtureReplay"]


class MixtureReplay:
    """What replays of the mixture run of ``cfg`` read (``base``: the run's replay settings)."""

    def __init__(self, cfg: TrainConfig, global_batch_size: int) -> None:
        self.cfg, self.global_batch_size = cfg, global_batch_size
        self.mix: Mixture = mixture_holdout(cfg)
        self._ds: MixedDataset | None = None

    def batch(self, b: int) -> dict[str, Any]:
        """Global batch ``b`` (0-based, counted over the run) as the run read it: all its examples, in order."""
        if self._ds is None:
            info = DistInfo(0, 1, 0, torch.device("cpu"), None)
            self._ds = build_mixture(self.cfg, self.mix, info, 1, batch_size=self.global_batch_size)
        self._ds.seek(b)
        return next(iter(self._ds))

    def source(self, base: ReplaySettings, shard: int) -> tuple[ReplaySettings, int, str]:
        """``base`` for the source mixture shard ``shard`` is from, the shard's own id in it, the source's name."""
        mix = self.mix
        for j, (offset, ids) in enumerate(zip(mix.offsets, mix.ids, strict=True)):
            if offset <= shard < offset + ids:
                path, held = mix.paths[j], mix.held[j]
                shards = sorted(set(open_dataset(path).shard_ids) - set(held.shards)) if held.shards else None
                found = dataclasses.replace(
                    base, data=path, shards=shards, rows=held.training_rows, mixture=None,
                    seed=source_seed(self.cfg.run.seed, j),
                )  # fmt: skip
                return found, shard - offset, mix.names[j]
        raise UserError(
            f"shard {shard}: no source of this mixture has it (ids 0 to {mix.offsets[-1] + mix.ids[-1] - 1})"
        )
