"""Loss normalization: which weight each micro-batch's backward gets, and the factor that finishes the mean.

Two modes. Without item counts every micro-batch weighs ``1/K`` (the seed's divide-by-K); a partial
cycle is rescaled by ``K/m`` at its end. With ``num_items`` each micro-batch backwards its mean loss
times its item count (times a rank-uniform scale ``s``, below), so the accumulated gradient is a sum
over items; at the end of the cycle the global item count ``N`` is all-reduced once and the factor
``world / (s * N)`` (world undoes the data-parallel average) turns that sum into the exact mean.

Item counts may be device tensors. Their validity (>= 0, finite) is decided on the device and read
with the step's one host sync, so a bad count costs no extra synchronisation; Python numbers are
checked at once.

fp16 needs one more thing: a sum over ``N`` items of fp16 gradients overflows at 65504 (and an item
count above 65504 is already ``inf`` in fp16). Losses are therefore weighted in float32, and in fp16
runs (fp16 parameters, or a ``GradScaler``) the weight carries a scale ``s = world / N_prev`` from the
previous cycle's global count (the same float on every rank, already read on the host), so the
accumulated gradient stays near the mean's magnitude. The first cycle estimates ``N_prev`` from the
first micro-batch's counts with one small all-reduce, once per run. ``s`` cancels exactly in the
factor; float32, bf16 and float64 runs keep ``s = 1``, so a float64 run gives the exact mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from steadytrain._check import check_finite
from steadytrain.accumulate.sync import DataParallel, all_reduce
from steadytrain.errors import UserError

__all__ = [
    "ItemCounts",
    "ItemScale",
    "check_num_items",
    "count_dtype",
    "global_counts",
    "item_factor",
    "mean_factor",
    "scale_loss",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_num_items(value: object) -> float | Tensor | None:
    """A micro-batch's item count, checked as far as is possible without a host sync.

    A Python number must be finite and >= 0 (a :class:`UserError` at once). A tensor must hold one
    real number; its value is checked on the device at the end of the cycle (see :class:`ItemCounts`).
    """
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise UserError(f"num_items has shape {tuple(value.shape)}: pass one count (a 0-dim tensor or a number)")
        if value.dtype == torch.bool or value.is_complex():
            raise UserError(f"num_items has dtype {value.dtype}: pass a count (an integer or real number)")
        value = value.reshape(()) if value.ndim else value  # counts rarely carry a graph: skip no-op calls
        return value.detach() if value.requires_grad else value
    return check_finite("num_items", value, minimum=0.0)


def count_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


@dataclass
class ItemCounts:
    """The item counts of one cycle on this rank: Python numbers summed, tensors kept for the device check."""

    python: float = 0.0
    tensors: list[Tensor] = field(default_factory=list)
    invalid: int = 0
    """Invalid counts known on the host (only from a restored checkpoint: live ones are judged on the device)."""

    def add(self, n: float | Tensor) -> None:
        if isinstance(n, Tensor):
            self.tensors.append(n)
        else:
            self.python += n

    def local(self, device: torch.device) -> Tensor:
        """``[sum, invalid]`` on this rank, on ``device``, without a host sync.

        ``invalid`` is 0 when every count is finite and >= 0, else positive or NaN: ``max(0, -min)``
        of the counts (NaN propagates, ``-inf`` gives ``inf``), plus the restored invalid count. It
        stays meaningful when summed over ranks, so the all-reduce that sums the counts carries it.
        """
        dtype = count_dtype(device)
        known = [self.python, float(self.invalid)]
        if not self.tensors:
            return torch.tensor(known, dtype=dtype, device=device)
        same = all(x.device == self.tensors[0].device for x in self.tensors)
        t = torch.stack(self.tensors if same else [x.to(device) for x in self.tensors]).to(device, dtype)
        # +inf or NaN shows in the sum, negatives (and -inf) in the min.
        counted = torch.stack([t.sum(), t.amin().clamp(max=0.0).neg()])
        return counted if known == [0.0, 0.0] else counted + torch.tensor(known, dtype=dtype, device=device)

    def to_state(self) -> tuple[float, int]:
        """``(sum, invalid)`` as Python numbers (reads device counts: a host sync, fine at checkpoint time)."""
        if not self.tensors:
            return self.python, self.invalid
        total, invalid = self.local(self.tensors[0].device).tolist()  # the state is saved as JSON numbers
        return total, int(invalid != 0)  # NaN != 0 too


def global_counts(
    items: ItemCounts | None, losses: list[Tensor] | None, device: torch.device, layout: DataParallel
) -> tuple[Tensor | None, list[Tensor] | Tensor | None]:
    """The cycle's item counts ``[N, invalid]`` over every data-parallel rank, and its losses: as they are on one
    process, summed over the ranks otherwise (not finite when one was not). One all-reduce for both (per mesh
    dimension), none on one process: every rank then divides by the same count and refuses alike."""
    local = items.local(device) if items is not None else None
    if not layout.groups or (local is None and losses is None):
        return local, losses
    if losses is None:
        return all_reduce(local, layout), None  # every rank divides by the global count: one batch's mean
    # float64: K float32 losses summed over the ranks cannot overflow it
    loss_sum = torch.stack([x.to(device) for x in losses]).to(count_dtype(device)).sum().reshape(1)
    if local is None:
        return None, all_reduce(loss_sum, layout)
    both = all_reduce(torch.cat([local, loss_sum]), layout)
    return both[:2], both[2:]


class ItemScale:
    """The rank-uniform scale ``s`` of item weights (1 unless fp16 gradients could overflow)."""

    def __init__(self, enabled: bool, accumulation_steps: int, layout: DataParallel) -> None:
        self.enabled = enabled
        self.value: float | Tensor | None = None if enabled else 1.0
        self._k, self._layout = accumulation_steps, layout

    def prepare(self, num_items: float | Tensor, device: torch.device) -> None:
        """Before the first weighted micro-batch of an fp16 run: estimate ``s`` (one all-reduce, once per run)."""
        if self.value is not None:
            return
        if self._layout.groups or isinstance(num_items, Tensor):
            first = torch.as_tensor(num_items).to(device, count_dtype(device)).reshape(())
            # the global count: every rank must take the same s, or the ranks' gradients would be weighted apart
            first = all_reduce(first.clone(), self._layout) if self._layout.groups else first
            # Only an estimate (it cancels in the factor): an invalid count must not leave s at NaN forever.
            first = first.nan_to_num(nan=1.0, posinf=1.0).clamp(min=1.0)
            self.value = self._layout.size / (self._k * first)
        else:
            self.value = 1.0 / (self._k * max(float(num_items), 1.0))

    def weight(self, num_items: float | Tensor) -> float | Tensor:
        """The backward weight of a micro-batch holding ``num_items`` items."""
        s = self.value
        return num_items if isinstance(s, float) and s == 1.0 else num_items * s  # type: ignore[operator]

    def update(self, global_items: float) -> None:
        """After a cycle whose global count was read on the host: ``s = world / N`` for the next cycle."""
        if self.enabled and math.isfinite(global_items) and global_items > 0:
            self.value = self._layout.size / global_items

    def state(self) -> float | None:
        return float(self.value) if isinstance(self.value, Tensor) else self.value

    def load(self, value: float | None) -> None:
        if self.enabled:
            self.value = value
        # A checkpoint from an fp32 run resumed in fp16 (or back) keeps this run's own scale.


def scale_loss(loss: Tensor, weight: float | Tensor) -> Tensor:
    """``loss * weight`` in float32 at least: an fp16 loss times a token count overflows at 65504."""
    if loss.dtype in LOW_PRECISION:
        loss = loss.float()
    return loss * weight


def mean_factor(accumulation_steps: int, micro: int) -> float:
    """Without items: a cycle of ``micro`` micro-batches weighed ``1/K`` each becomes the mean of their means."""
    return accumulation_steps / micro


def item_factor(totals: Tensor, world: int, scale: float | Tensor | None) -> Tensor:
    """With items: the factor ``world / (s * N)`` that makes the accumulated sum the exact global mean.

    Kept in float64 (float32 on MPS): the scaling later applies it at each gradient's own precision.
    """
    total = totals[0]
    if not (isinstance(scale, float) and scale == 1.0):
        total = total * scale  # type: ignore[operator]
    return world / total
