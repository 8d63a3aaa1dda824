"""Batch size and learning rate: the effective batch, LR scaling, and schedules in optimizer steps.

The effective batch the optimizer sees is ``micro_batch_size x accumulation_steps x world_size``;
dropping any factor under-scales the learning rate. Every count here (warmup, decay, total) is in
OPTIMIZER steps, never micro-batches: a scheduler stepped per micro-batch runs ``K`` times too fast.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from steadytrain._check import check_finite, check_int
from steadytrain.errors import UserError

if TYPE_CHECKING:  # torch is imported only where a scheduler is built: `steadytrain plan` stays fast.
    import torch

__all__ = [
    "SCALING_RULES",
    "BatchPlan",
    "effective_batch_size",
    "lr_multiplier",
    "optimizer_steps",
    "scale_lr",
    "warmup_schedule",
]

SCALING_RULES = ("linear", "sqrt", "none")
DECAYS = ("cosine", "linear", "constant")
# Past this scale-up the linear rule is known to be unreliable (the seed; Goyal et al. 2017 stop at 32).
LARGE_SCALE_FACTOR = 8.0
MAX_COUNT = 2**53  # batch sizes, steps and data sizes stay exact as floats (LR ratios are floats)
MAX_SWEEP = 1000


def _count(name: str, value: object, minimum: int = 1, *, unit: str = "") -> int:
    return check_int(name, value, minimum, unit=unit, maximum=MAX_COUNT)


def _check_warmup(warmup: object, total: int | None) -> int:
    """Warmup length: an integer >= 0, in optimizer steps, not longer than the run."""
    warmup = _count("warmup_steps", warmup, 0, unit=" (counted in optimizer steps)")
    if total is not None and warmup > total:
        raise UserError(f"warmup_steps={warmup} exceeds the run's {total} optimizer steps: shorten the warmup")
    return warmup


def _ceil_div(a: int, b: int) -> int:
    return -(a // -b)


def effective_batch_size(micro_batch_size: int, accumulation_steps: int, world_size: int) -> int:
    """Examples per optimizer step: micro batch per device x accumulation steps x data-parallel ranks.

    Example:
        >>> effective_batch_size(32, 4, 8)
        1024
    """
    return (
        _count("micro_batch_size", micro_batch_size)
        * _count("accumulation_steps", accumulation_steps)
        * _count("world_size", world_size)
    )


def scale_lr(base_lr: float, base_batch_size: int, batch_size: int, rule: str = "linear") -> float:
    """Scale a learning rate tuned at ``base_batch_size`` to ``batch_size``.

    ``linear`` multiplies by ``k = batch_size / base_batch_size`` (Goyal et al. 2017), ``sqrt`` by
    ``sqrt(k)`` (Krizhevsky 2014; common for Adam-type optimizers), ``none`` keeps ``base_lr``.
    A heuristic, not a law: at large ``k`` sweep around this estimate.

    References:
        Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour".

    Example:
        >>> scale_lr(1e-3, 256, 2048)
        0.008
    """
    if rule not in SCALING_RULES:
        raise UserError(f"scaling rule {rule!r} is unknown: use one of {', '.join(SCALING_RULES)}")
    base_lr = check_finite("base_lr", base_lr, minimum=0.0, strict=True)
    k = _count("batch_size", batch_size) / _count("base_batch_size", base_batch_size)
    lr = base_lr * {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]
    if not (math.isfinite(lr) and lr > 0):
        raise UserError(f"base_lr={base_lr:g} scaled {rule} by {k:g} gives lr={lr:g}: not a usable learning rate")
    return lr


def optimizer_steps(total_micro_batches: int, accumulation_steps: int) -> int:
    """Optimizer steps taken over ``total_micro_batches``: a partial last cycle is a step too.

    Example:
        >>> optimizer_steps(10, 4)
        3
    """
    _count("total_micro_batches", total_micro_batches, 0)
    return _ceil_div(total_micro_batches, _count("accumulation_steps", accumulation_steps))


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int, decay: str = "cosine", min_lr_ratio: float = 0.0
) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, then decay.

    Warmup: ``(step + 1) / (warmup_steps + 1)`` for ``step < warmup_steps``, so the first step
    already learns and the peak (1.0) is reached at ``step == warmup_steps``. Decay over the
    remaining ``total_steps - warmup_steps`` steps: ``cosine`` and ``linear`` go from 1 to
    ``min_lr_ratio``; ``constant`` stays at 1. Steps past ``total_steps`` hold the final value.

    Raises:
        UserError: (a ``ValueError``) ``step``, ``warmup_steps`` or ``total_steps`` not an integer >= 0: a negative
            step is no step of any schedule (the warmup line would give a negative LR).

    Example:
        >>> [round(lr_multiplier(s, warmup_steps=3, total_steps=7, decay="linear"), 2) for s in range(8)]
        [0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    _count("step", step, 0, unit=" (a 0-based optimizer step)")
    _count("warmup_steps", warmup_steps, 0, unit=" (counted in optimizer steps)")
    _count("total_steps", total_steps, 0, unit=" (counted in optimizer steps)")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay == "linear":
        shape = 1.0 - progress
    else:
        raise UserError(f"decay={decay!r} is unknown: use one of {', '.join(DECAYS)}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """An LR scheduler: linear warmup to each group's LR, then ``decay``; step it once per OPTIMIZER step.

    The optimizer's current ``lr`` is the peak. See :func:`lr_multiplier` for the curve.

    Args:
        optimizer: the optimizer whose groups' ``lr`` is the peak learning rate.
        warmup_steps: optimizer steps of linear warmup (0 for none).
        total_steps: optimizer steps in the whole run (warmup included).
        decay: ``cosine``, ``linear`` or ``constant`` after warmup.
        min_lr_ratio: the final LR as a fraction of the peak.

    Returns:
        A ``torch.optim.lr_scheduler.LambdaLR`` (an ``LRScheduler``).

    Raises:
        ValueError: negative or inconsistent step counts, an unknown decay, a ratio outside [0, 1].

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=8e-3)
        >>> sched = warmup_schedule(opt, warmup_steps=3, total_steps=10)
        >>> [round(g["lr"], 6) for g in opt.param_groups]
        [0.002]
    """
    _check_warmup(warmup_steps, _count("total_steps", total_steps))
    if decay not in DECAYS:
        raise UserError(f"decay={decay!r} is unknown: use one of {', '.join(DECAYS)}")
    if not 0.0 <= check_finite("min_lr_ratio", min_lr_ratio) <= 1.0:
        raise UserError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")

    import torch

    def multiplier(step: int) -> float:
        return lr_multiplier(
            step, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay, min_lr_ratio=min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """Every batch-size and learning-rate number of a run, derived once and checked for consistency.

    Give the micro batch and EITHER the accumulation steps OR a target global batch (or both, if
    they agree); optionally the LR tuned at a base batch size, the data size and the warmup. All
    step counts are optimizer steps.

    Example:
        >>> plan = BatchPlan(micro_batch_size=256, accumulation_steps=8, base_lr=1e-3, base_batch_size=256)
        >>> plan.global_batch_size, plan.lr
        (2048, 0.008)
    """

    micro_batch_size: int
    """Examples per forward/backward on one device."""
    accumulation_steps: int | None = None
    """Micro-batches accumulated per optimizer step; derived from ``global_batch_size`` if omitted."""
    world_size: int = 1
    """Data-parallel ranks."""
    global_batch_size: int | None = None
    """Target effective batch; derived when omitted, checked when given."""
    base_lr: float | None = None
    """Learning rate known to work at ``base_batch_size``."""
    base_batch_size: int | None = None
    """The batch size ``base_lr`` was tuned at; without it the LR is used as given."""
    scaling_rule: str = "linear"
    """``linear``, ``sqrt`` or ``none``."""
    dataset_size: int | None = None
    """Examples in one epoch (all ranks together)."""
    epochs: int = 1
    """Passes over the data."""
    warmup_steps: int | None = None
    """Warmup length in optimizer steps (give this or ``warmup_ratio``)."""
    warmup_ratio: float | None = None
    """Warmup as a fraction of the total optimizer steps (needs ``dataset_size``)."""

    scale_factor: float = field(init=False)
    """``global_batch_size / base_batch_size`` (1.0 without a base)."""
    lr: float | None = field(init=False)
    """The scaled learning rate: the peak after warmup."""
    micro_batches_per_epoch: int | None = field(init=False)
    """Micro-batches each rank runs per epoch (the last one may be short)."""
    steps_per_epoch: int | None = field(init=False)
    """Optimizer steps per epoch (a partial last cycle counts)."""
    total_steps: int | None = field(init=False)
    """Optimizer steps over all epochs."""
    notes: tuple[str, ...] = field(init=False)
    """Advice derived from the numbers (large scale-up, short warmup ...)."""

    def __post_init__(self) -> None:
        micro = _count("micro_batch_size", self.micro_batch_size)
        world = _count("world_size", self.world_size)
        accum, global_batch = self.accumulation_steps, self.global_batch_size
        if accum is None and global_batch is None:
            accum = 1
        if accum is None:
            global_batch = _count("global_batch_size", global_batch)
            accum = self._derive_accumulation(global_batch, micro, world)
        _count("accumulation_steps", accum)
        product = _count("effective batch (micro x accumulation x world)", effective_batch_size(micro, accum, world))
        if global_batch is not None and global_batch != product:
            raise UserError(
                f"global batch {global_batch} != micro {micro} x accum {accum} x world {world} (= {product}): "
                "change one of them, or omit accumulation_steps to derive it"
            )
        self._set("accumulation_steps", accum)
        self._set("global_batch_size", product)
        self._derive_lr(product)
        self._derive_steps(micro, accum, world)

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @staticmethod
    def _derive_accumulation(global_batch: int, micro: int, world: int) -> int:
        per_step = micro * world
        if global_batch % per_step:
            below, above = (global_batch // per_step) * per_step, (global_batch // per_step + 1) * per_step
            options = " or ".join(str(v) for v in (below, above) if v > 0)
            raise UserError(
                f"global batch {global_batch} is not divisible by micro {micro} x world {world} (= {per_step}): "
                f"use a global batch of {options}, or another micro batch"
            )
        return global_batch // per_step

    def _derive_lr(self, global_batch: int) -> None:
        if self.scaling_rule not in SCALING_RULES:
            raise UserError(f"scaling_rule={self.scaling_rule!r} is unknown: use one of {', '.join(SCALING_RULES)}")
        notes: list[str] = []
        if self.base_lr is None:
            if self.base_batch_size is not None:
                raise UserError("base_batch_size is set but base_lr is not: give the LR tuned at that batch size")
            self._set("scale_factor", 1.0)
            self._set("lr", None)
        elif self.base_batch_size is None:
            self._set("scale_factor", 1.0)
            self._set("lr", scale_lr(self.base_lr, global_batch, global_batch, "none"))
            notes.append("no base_batch_size: base_lr is used unscaled for the effective batch")
        else:
            self._set("scale_factor", global_batch / _count("base_batch_size", self.base_batch_size))
            self._set("lr", scale_lr(self.base_lr, self.base_batch_size, global_batch, self.scaling_rule))
            if self.scale_factor > LARGE_SCALE_FACTOR and self.scaling_rule != "none":
                notes.append(
                    f"scale factor {self.scale_factor:g} > {LARGE_SCALE_FACTOR:g}: the {self.scaling_rule} rule is "
                    "less reliable this far out; sweep the LR around this estimate (lr_sweep) and consider LARS/LAMB"
                )
        self._set("notes", tuple(notes))

    def _derive_steps(self, micro: int, accum: int, world: int) -> None:
        epochs = _count("epochs", self.epochs)
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise UserError("give warmup_steps or warmup_ratio, not both")
        if self.warmup_ratio is not None and not 0.0 <= check_finite("warmup_ratio", self.warmup_ratio) <= 1.0:
            raise UserError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1]")
        if self.dataset_size is None:
            for name in ("micro_batches_per_epoch", "steps_per_epoch", "total_steps"):
                self._set(name, None)
            if self.warmup_ratio is not None:
                raise UserError("warmup_ratio needs dataset_size to count the total steps: give dataset_size")
            if self.warmup_steps is not None:
                _check_warmup(self.warmup_steps, None)
            return
        size = _count("dataset_size", self.dataset_size)
        # Each rank gets ceil(size / world) examples (a distributed sampler pads the last ranks).
        micro_batches = _ceil_div(_ceil_div(size, world), micro)
        steps = optimizer_steps(micro_batches, accum)
        self._set("micro_batches_per_epoch", micro_batches)
        self._set("steps_per_epoch", steps)
        self._set("total_steps", steps * epochs)
        if self.warmup_ratio is not None:
            self._set("warmup_steps", math.ceil(self.warmup_ratio * self.total_steps))
        if self.warmup_steps is not None:
            _check_warmup(self.warmup_steps, self.total_steps)
        if size < self.global_batch_size:
            self._set("notes", (*self.notes, f"dataset_size {size} < global batch {self.global_batch_size}"))

    def lr_sweep(self, num: int = 5, factor: float = 2.0) -> list[float]:
        """Learning rates for a sweep centred on the scaled estimate: ``lr * factor**i``, geometric.

        Example:
            >>> BatchPlan(micro_batch_size=256, accumulation_steps=8, base_lr=1e-3, base_batch_size=256).lr_sweep(3)
            [0.004, 0.008, 0.016]
        """
        if self.lr is None:
            raise UserError("lr_sweep needs base_lr: give the LR tuned at base_batch_size")
        check_int("num", num, maximum=MAX_SWEEP)
        if not check_finite("factor", factor) > 1.0:
            raise UserError(f"factor={factor} must be > 1")
        half = (num - 1) / 2
        try:
            lrs = [self.lr * factor ** (i - half) for i in range(num)]
        except OverflowError:
            lrs = [math.inf]
        if not all(math.isfinite(x) and x > 0 for x in lrs):
            raise UserError(
                f"an LR sweep of {num} points x{factor:g} apart around {self.lr:g} leaves the float range: "
                "use fewer points or a smaller factor"
            )
        return lrs

    def to_dict(self) -> dict:
        """Every input and derived number, JSON-serializable."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d
