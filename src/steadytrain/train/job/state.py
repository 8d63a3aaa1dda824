"""A run's progress as one object: counters, exposure, and the state of its stateful parts.

:class:`TrainState` holds the optimizer step, the epoch, the consecutive non-finite steps, the wall
time before a resume and the examples seen per shard, with the scheduler, accumulator, data
position, loss scaler and validation it saves and restores (as torchtitan's trainer state does).
``state_dict()`` is JSON data: a checkpoint's ``state.json`` carries it, nothing is pickled.
Examples seen per shard are counted on the host, per rank; :meth:`count` adds a micro-batch's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from steadytrain.errors import UserError
from steadytrain.train.checkpoint.files import from_json, to_json
from steadytrain.train.checkpoint.schema import check_resumable
from steadytrain.train.job.evaluate import Validation
from steadytrain.train.setup.distributed import DistInfo

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Where a run is, and the stateful parts a checkpoint restores."""

    scheduler: Any
    accumulator: Any
    data: Any
    scaler: Any = None
    validation: Validation | None = None
    spikes: Any = None
    """The :class:`~steadytrain.train.job.spikes.SpikeGuard` (its window, rollbacks and skipped batches)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further stateful parts by name (what an own loop registers with :class:`steadytrain.Run`): each one's
    ``state_dict()`` is JSON data, saved under ``extra.<name>``."""
    complete: bool = True
    """A trainer's state: the scheduler, accumulator and data position are required in a checkpoint it restores
    (an own loop's may have no scheduler or sampler)."""
    step: int = 0
    epoch: int = 0
    consecutive_skips: int = 0
    """Non-finite (skipped) optimizer steps in a row up to now (``nonfinite.max_consecutive_skips``)."""
    elapsed_before: float = 0.0
    """Wall time of the run before this process resumed it."""
    exposure: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Examples seen per shard id by this rank (rank 0 also holds the counts from before a resume); read it
    through :meth:`global_exposure`, which adds the micro-batches :meth:`count` holds."""
    shard_size: int | None = None
    """An own loop's: :meth:`count` takes example ids, and id ``i`` is of shard ``i // shard_size`` (divided when
    counted, for 256 micro-batches at once)."""
    _uncounted: list[torch.Tensor] = field(default_factory=list)

    def count(self, shard: torch.Tensor) -> None:
        """Add a micro-batch's examples (``shard``: each example's shard id, a host tensor; with :attr:`shard_size`
        its example ids); counted when the exposure is next read, or every 256 micro-batches (one bincount then,
        not one per micro-batch)."""
        self._uncounted.append(shard)
        if len(self._uncounted) >= 256:
            self._fold()

    def _fold(self) -> np.ndarray:
        """The exposure with every micro-batch added so far."""
        if self._uncounted:
            ids = np.concatenate([s.numpy().reshape(-1) for s in self._uncounted])
            self._uncounted.clear()
            if self.shard_size:
                ids = ids // self.shard_size
            counts = np.bincount(ids, minlength=len(self.exposure))  # NumPy: no torch op overhead
            if len(counts) > len(self.exposure):
                grown = np.zeros(len(counts), dtype=np.int64)
                grown[: len(self.exposure)] = self.exposure
                self.exposure = grown
            self.exposure += counts
        return self.exposure

    def state_dict(self, *, elapsed_s: float, exposure: dict[int, int]) -> dict[str, Any]:
        """JSON data; ``exposure``: every rank's counts (a collective gathers them); ``elapsed_s``: the wall time."""
        return to_json(
            {
                "step": self.step,
                "epoch": self.epoch,
                "consecutive_skips": self.consecutive_skips,
                "elapsed_s": elapsed_s,
                "exposure": {str(k): v for k, v in sorted(exposure.items())},
                **({"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}),
                "accumulator": self.accumulator.state_dict(),
                **({"data": self.data.state_dict()} if self.data is not None else {}),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "validation": self.validation.state_dict() if self.validation is not None else None,
                "spikes": self.spikes.state_dict() if self.spikes is not None else None,
                **({"extra": {k: v.state_dict() for k, v in self.extra.items()}} if self.extra else {}),
            },
            "train state",
        )

    def load_state_dict(self, state: dict[str, Any], *, is_main: bool, where: str = "state.json") -> None:
        """Restore ``state`` (the exposure counts on rank 0 alone: it carries the global counts on); ``where``
        names the file in errors. Its types and ranges were checked when it was read
        (:func:`~steadytrain.train.checkpoint.schema.check_state`); each part here checks what only it can."""
        if self.complete:
            check_resumable(state, where)
        state = from_json(state, f"{where}: train")
        extra = state.get("extra") if isinstance(state.get("extra"), dict) else {}
        parts = {  # loaded in this order; None: this run has no such part, or the checkpoint none for it
            "scheduler": self.scheduler,
            "accumulator": self.accumulator,  # taken at a step boundary: any K (world size)
            "scaler": self.scaler if state.get("scaler") else None,
            "data": self.data,
            "validation": self.validation if state.get("validation") else None,
            "spikes": self.spikes,  # None in the checkpoint: a new window
            **{f"extra.{k}": v for k, v in self.extra.items()},
        }
        part = "exposure"
        try:
            saved = {int(k): int(v) for k, v in (state.get("exposure") or {}).items()} if is_main else {}
            if foreign := sorted(set(saved) - set(getattr(self.data, "shard_ids", saved))):
                raise UserError(f"shard {foreign[0]} is not a shard this run trains on")
            for part, target in parts.items():
                saved_part = extra.get(part[6:], None) if part.startswith("extra.") else state.get(part)
                if part.startswith("extra.") and part[6:] not in extra:
                    raise UserError("the checkpoint holds no such part (it was not registered when it was saved)")
                if target is not None:
                    target.load_state_dict(saved_part)
        except (UserError, KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            why = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
            fix = "the checkpoint does not fit this run or is damaged"
            raise UserError(f"{where}: train.{part}: {why}: {fix}") from None
        data = state.get("data")
        self.step = int(state["step"])
        self.epoch = int(data.get("epoch", 0)) if isinstance(data, dict) else 0
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self._uncounted.clear()
        self.exposure = np.zeros(max(saved, default=-1) + 1, dtype=np.int64)
        for shard, n in saved.items():
            self.exposure[shard] = n

    def global_exposure(self, info: DistInfo, shard_ids: Any) -> dict[int, int]:
        """Examples seen per shard over all ranks (a collective: every rank calls it). ``shard_ids``: the dataset's
        (None: the shards seen so far, an own loop's; one more small all-reduce agrees on their number)."""
        exposure = self._fold()
        size = max(max(() if shard_ids is None else shard_ids, default=-1) + 1, len(exposure))
        if shard_ids is None and info.backend is not None:  # no dataset names the shards: the ranks agree on a size
            longest = torch.tensor([size], dtype=torch.int64, device=info.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)  # the counts' all-reduce below needs one length
            size = int(longest.item())
        counts = torch.zeros(size, dtype=torch.int64)
        counts[: len(exposure)] = torch.from_numpy(exposure)
        if info.tp_rank:
            counts.zero_()  # the ranks of one tensor-parallel group saw the same examples: counted once
        if info.backend is not None:
            on = counts.to(info.device)  # NCCL reduces device tensors only
            dist.all_reduce(on)  # the ledger's denominator: examples seen on every rank, not just this one
            counts = on.cpu()  # host read, at a checkpoint or a refused step: the exposure is written as JSON
        return {s: int(n) for s, n in enumerate(counts.tolist()) if n}
