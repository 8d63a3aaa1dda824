"""``GlobalSampler``: resumable micro-batches of indices in one global order, for a training loop of your own.

``GlobalSampler(len(ds), batch_size=B, accumulation_steps=K, rank=r, world_size=W)`` works over any map-style
dataset (``__len__`` and integer indexing) as ``DataLoader(ds, batch_sampler=sampler)``. It follows the trainer's
layout (see :mod:`steadytrain.data.order`): epoch ``e``'s order is ``default_rng([seed, e]).permutation(N)``
(``arange(N)`` without shuffling), optimizer step ``s`` takes positions ``[s·G, (s+1)·G)`` with
``G = B·K·W``, and rank ``r``'s micro-batch ``k`` holds the ``B`` positions from ``s·G + (r·K + k)·B``. So:

- every rank gets ``steps_per_epoch · K`` micro-batches per epoch (the remainder ``N mod G`` is dropped);
- step ``s`` holds the same examples whatever ``W`` and ``K`` are with ``G`` fixed, so a state saved at a step
  boundary resumes on another number of ranks, and :meth:`GlobalSampler.indices` replays a step on one process.

Iterating yields this rank's micro-batches from the current position to the end of the epoch; handing out the
epoch's last one moves the position to the next epoch, so ``for epoch ...: for idx in sampler:`` and a loop
that re-iterates without end both work. The position counts micro-batches *handed out*: exact for
``state_dict()`` with ``num_workers=0``. A ``DataLoader`` with workers asks for indices ahead of the batches
it has delivered, so there save ``state_at(steps_done)``, the state after the optimizer steps you completed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from steadytrain._check import check_int, check_type
from steadytrain._io import brief
from steadytrain.data.order import GlobalLayout, check_layout_fits
from steadytrain.errors import UserError

__all__ = ["GlobalSampler"]

_STATE_KEYS = ("epoch", "micro", "seed", "num_examples", "global_batch_size", "shuffle")
_STATE_KEYS += ("batch_size", "accumulation_steps", "world_size")


class GlobalSampler(Sampler[list[int]]):
    """This rank's micro-batches (lists of dataset indices) of the epoch's global order, with an exact resume.

    Args:
        num_examples: ``N``, the dataset's length.
        batch_size: ``B``, examples per micro-batch.
        accumulation_steps: ``K``, micro-batches per optimizer step.
        rank, world_size: this data-parallel rank of ``W``.
        seed, shuffle: the order of every epoch (``shuffle=False``: ``0 .. N-1``).
        drop_last: must be true: the ``N mod G`` remainder is always dropped, so every rank takes the same steps.

    Raises:
        UserError: a bad argument (named, with the fix), or ``N`` smaller than one global batch.

    Example:
        >>> s = GlobalSampler(10, batch_size=2, accumulation_steps=2, rank=1, world_size=2, shuffle=False)
        >>> list(s), s.epoch, s.indices(1)
        ([[4, 5], [6, 7]], 1, [0, 1, 2, 3, 4, 5, 6, 7])
    """

    def __init__(
        self,
        num_examples: int,
        *,
        batch_size: int,
        accumulation_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self.num_examples = check_int("num_examples", num_examples)
        self.layout = GlobalLayout(batch_size, accumulation_steps, world_size)  # checks the three
        self.rank = check_int("rank", rank, 0)
        if rank >= world_size:
            raise UserError(f"rank={rank} must be < world_size {world_size}: ranks are 0 .. {world_size - 1}")
        self.seed = check_int("seed", seed, 0)
        self.shuffle = check_type("shuffle", shuffle, bool)
        if not check_type("drop_last", drop_last, bool):
            raise UserError(
                "drop_last=False is not supported: the N mod G remainder is always dropped so that every rank takes "
                "the same number of steps; pass drop_last=True"
            )
        self.steps_per_epoch = check_layout_fits(self.layout, self.num_examples, "GlobalSampler")
        self._epoch = 0
        self._micro = 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its order): the last one computed

    @property
    def epoch(self) -> int:
        """The epoch the next micro-batch comes from."""
        return self._epoch

    @property
    def micro(self) -> int:
        """Micro-batches of this epoch this rank has been handed."""
        return self._micro

    @property
    def step(self) -> int:
        """Optimizer steps completed in this epoch (a step part-way through counts once all ``K`` are handed out)."""
        return self._micro // self.layout.accumulation_steps

    @property
    def global_step(self) -> int:
        """Optimizer steps completed since the start of the first epoch."""
        return self._epoch * self.steps_per_epoch + self.step

    def __len__(self) -> int:
        """Micro-batches this rank has left in the current epoch."""
        return self.steps_per_epoch * self.layout.accumulation_steps - self._micro

    def __iter__(self) -> Iterator[list[int]]:
        epoch, order = self._epoch, self.order(self._epoch)
        ranges = self.layout.rank_ranges(self.rank, self._micro, self.steps_per_epoch)
        for m, start, stop in ranges:
            last = m + 1 == self.steps_per_epoch * self.layout.accumulation_steps
            self._epoch, self._micro = (epoch + 1, 0) if last else (epoch, m + 1)  # counted as handed out
            yield order[start:stop].tolist()

    def order(self, epoch: int) -> np.ndarray:
        """The global order of epoch ``epoch``: all ``N`` dataset indices (the last ``N mod G`` are dropped)."""
        if self._order is None or self._order[0] != epoch:
            n = self.num_examples
            perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (epoch, perm)
        return self._order[1]

    def indices(self, step: int) -> list[int]:
        """The dataset indices of optimizer step ``step`` (counted from the start, across epochs) over all ranks,
        in global order: rank 0's micro-batches, then rank 1's, and so on."""
        check_int("step", step, 0)
        epoch, s = divmod(step, self.steps_per_epoch)
        g = self.layout.global_batch_size
        return self.order(epoch)[s * g : (s + 1) * g].tolist()

    def state_dict(self) -> dict[str, Any]:
        """The position as JSON data; :meth:`load_state_dict` reads it back (on any ``W``/``K`` at a step boundary)."""
        return self._state(self._epoch, self._micro)

    def state_at(self, global_step: int) -> dict[str, Any]:
        """The state after ``global_step`` optimizer steps from the start: what to save when a ``DataLoader`` with
        workers has already asked for indices past the steps trained."""
        epoch, s = divmod(check_int("global_step", global_step, 0), self.steps_per_epoch)
        return self._state(epoch, s * self.layout.accumulation_steps)

    def _state(self, epoch: int, micro: int) -> dict[str, Any]:
        lay = self.layout
        values = (epoch, micro, self.seed, self.num_examples, lay.global_batch_size, self.shuffle)
        values += (lay.batch_size, lay.accumulation_steps, lay.world_size)
        return dict(zip(_STATE_KEYS, values, strict=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next micro-batch with the same layout, else the next optimizer step.

        Raises:
            UserError: a missing or edited key, another dataset size, seed, order or global batch, or a position
                in the middle of an optimizer step loaded with another world size or accumulation.
        """
        check_type("state", state, dict)
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise UserError(f"state is missing {', '.join(missing)}: pass what GlobalSampler.state_dict() returned")
        for key in ("num_examples", "seed", "shuffle", "global_batch_size"):
            mine = self.layout.global_batch_size if key == "global_batch_size" else getattr(self, key)
            if state[key] != mine or isinstance(state[key], bool) != isinstance(mine, bool):
                raise UserError(
                    f"state {key}={brief(state[key])} != this sampler's {mine}: resume with the same {key} as the "
                    "saved run (a new order needs a fresh sampler, without load_state_dict)"
                )
        self._epoch, self._micro = self._resume(state)

    def _resume(self, state: dict[str, Any]) -> tuple[int, int]:
        epoch = check_int("state epoch", state["epoch"], 0)
        b, k, w = (check_int(f"state {key}", state[key]) for key in ("batch_size", "accumulation_steps", "world_size"))
        if b * k * w != self.layout.global_batch_size:
            raise UserError(
                f"state batch_size {b} x accumulation_steps {k} x world_size {w} != its global_batch_size "
                f"{state['global_batch_size']}: the state was edited; save it again with state_dict()"
            )
        micro = check_int("state micro", state["micro"], 0, maximum=self.steps_per_epoch * k)
        lay = self.layout
        if (k, w) != (lay.accumulation_steps, lay.world_size):
            if micro % k:
                raise UserError(
                    f"state micro={micro} is in the middle of an optimizer step (accumulation_steps {k}): with another "
                    "world size or accumulation, resume from a state saved at a step boundary (see state_at)"
                )
            micro = micro // k * lay.accumulation_steps
        end = micro == self.steps_per_epoch * lay.accumulation_steps  # the epoch's last one handed out: next epoch
        return (epoch + 1, 0) if end else (epoch, micro)
