"""What a run holds out of its training data for validation (``eval.holdout_shards``, ``eval.holdout_fraction``).

Drawn from the dataset's index and ``run.seed`` alone, so every rank, every resume, ``steadytrain eval`` and the
replays of ``nan``/``spikes hunt`` find the same split without reading a row: whole shards (the training
reader leaves them out), or records of the shards by stored row index (a
:class:`~steadytrain.data.holdout.RowFilter`: training reads every other row). The two sides never share an
example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from steadytrain.data import RowFilter, holdout_records, holdout_shards, open_dataset
from steadytrain.train.setup.config import TrainConfig

__all__ = ["HeldOut", "holdout"]


@dataclass(frozen=True)
class HeldOut:
    """What a run holds out of its training data for validation: whole shards, or records of its shards."""

    shards: list[int] | None = None
    rows: RowFilter | None = None
    """The held-out records (``keep=True``): training reads every other row."""
    note: str | None = None
    """What was held out, in words (said at start)."""

    @property
    def training_rows(self) -> RowFilter | None:
        """The filter training reads through (None: every row of its shards)."""
        return self.rows.inverse() if self.rows is not None else None

    @property
    def empty(self) -> bool:
        return not self.shards and self.rows is None


def holdout(cfg: TrainConfig, path: Path, global_batch_size: int) -> HeldOut:
    """What ``eval.holdout_shards`` or ``eval.holdout_fraction`` holds out of the dataset at ``path``, drawn from
    ``run.seed`` alone (the same on every rank, at every resume, for ``eval`` and ``nan hunt``).

    A fraction holds out ``floor(fraction x shards)`` whole shards when that is at least one, else that fraction of
    the records; nothing (the note says why) when the rest would not fill one global batch.
    """
    e = cfg.eval
    if e.holdout_shards is None and e.holdout_fraction is None:
        return HeldOut()
    ds = open_dataset(path)
    sizes = {s: ds.shard(s).records for s in ds.shard_ids}
    total = sum(sizes.values())
    if e.holdout_shards is not None:
        shards = holdout_shards(list(sizes), e.holdout_shards, cfg.run.seed)
        return HeldOut(shards=shards, note=_shards_note(shards, sizes))
    f = e.holdout_fraction
    pct = f"{f * 100:g}%"
    if (k := math.floor(f * len(sizes) + 1e-9)) >= 1:  # f < 1: never every shard
        shards = holdout_shards(list(sizes), k, cfg.run.seed)
        held = HeldOut(shards=shards, note=_shards_note(shards, sizes))
        left = total - sum(sizes[s] for s in shards)
    else:
        n = round(f * total)
        left = total - n
        rows = holdout_records(sizes, n, cfg.run.seed) if 1 <= n < total else None
        held = HeldOut(rows=rows, note=f"validation: held out {pct} of records ({n} of {total})")
    if held.empty or left < global_batch_size:
        return HeldOut(
            note=f"validation: none: holding out {pct} of the {total} records (eval.holdout_fraction={f:g}) would "
            f"leave fewer than one global batch ({global_batch_size}) to train on; give eval.data for a validation set"
        )
    return held


def _shards_note(shards: list[int], sizes: dict[int, int]) -> str:
    which = f"shard {shards[0]}" if len(shards) == 1 else f"shards {', '.join(map(str, shards))}"
    return f"validation: held out {which} ({sum(sizes[s] for s in shards)} records)"
