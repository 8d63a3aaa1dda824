"""The end of a cycle: one global norm, one clip coefficient, one host read, one decision, one step.

In order: the normalized global norm (``norm * factor``: the gradient is normalized lazily), the
coefficient ``factor * clip_coefficient(norm)``, then the ONE host sync of the step, which reads the
norm, the global item count and the number of invalid item counts together. From those numbers every
rank takes the same decision (the norm comes from synchronized or mesh-reduced gradients, the counts
from an all-reduce): step, or refuse for one of the reasons in :mod:`.events`. A step applies the
coefficient (folded into a fused optimizer's ``grad_scale`` when it can be) and runs the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from steadytrain._check import check_finite
from steadytrain.accumulate.events import (
    INVALID_ITEMS,
    NO_ITEMS,
    NONFINITE_LOSS,
    NONFINITE_NORM,
    ON_NONFINITE,
    SPIKE,
)
from steadytrain.clip import (
    _check_eps,
    _check_norm_type,
    clip_coefficient,
    clip_grad_value_,
    global_grad_norm,
    scale_grads_,
)
from steadytrain.errors import UserError

__all__ = ["Reading", "StepConfig", "apply_and_step", "norm_and_coefficient", "read_once", "refusal"]


@dataclass(frozen=True)
class StepConfig:
    """The fixed settings of the end-of-cycle step, validated once at construction."""

    max_grad_norm: float | None
    clip_value: float | None
    norm_type: float
    eps: float
    on_nonfinite: str
    scaler: bool
    """A ``GradScaler`` is in use: a non-finite step is its overflow signal (always skipped)."""
    fused: bool
    """The optimizer takes the coefficient as ``grad_scale`` (fused Adam/AdamW/SGD, no float64 params)."""

    @property
    def guard(self) -> bool:
        """Whether a non-finite norm stops the step (skip or raise)."""
        return self.on_nonfinite != "ignore" or self.scaler

    @property
    def need_norm(self) -> bool:
        return self.max_grad_norm is not None or self.guard

    @classmethod
    def build(cls, optimizer: torch.optim.Optimizer, params: list[Tensor], *, grad_scaler: object, **kw) -> StepConfig:
        """Check every argument now, not K backward passes later; the error names the argument and the fix."""
        on_nonfinite = kw["on_nonfinite"]
        if on_nonfinite not in ON_NONFINITE:
            raise UserError(f"on_nonfinite={on_nonfinite!r} is unknown: use one of {', '.join(ON_NONFINITE)}")
        max_grad_norm, clip_value = kw["max_grad_norm"], kw["clip_value"]
        if max_grad_norm is not None and clip_value is not None:
            raise UserError("give max_grad_norm (global-norm clipping) or clip_value (value clipping), not both")
        if max_grad_norm is not None:
            max_grad_norm = check_finite("max_grad_norm", max_grad_norm, minimum=0.0, strict=True)
        if clip_value is not None:
            clip_value = check_finite("clip_value", clip_value, minimum=0.0, strict=True)
        fused = (
            grad_scaler is None
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(g.get("fused") for g in optimizer.param_groups)
            # grad_scale is float32: a float64 run scales its gradients itself, at float64.
            and not any(p.dtype == torch.float64 for p in params)
        )
        return cls(
            max_grad_norm=max_grad_norm,
            clip_value=clip_value,
            norm_type=_check_norm_type(kw["norm_type"]),
            eps=_check_eps(kw["eps"]),
            on_nonfinite=on_nonfinite,
            scaler=grad_scaler is not None,
            fused=bool(fused),
        )


def _is_one(x: Tensor | float) -> bool:
    """A Python 1.0 (a tensor is never assumed to be one: checking it would sync with the device)."""
    return isinstance(x, float) and x == 1.0


def norm_and_coefficient(
    params: list[Tensor], factor: Tensor | float, cfg: StepConfig
) -> tuple[Tensor | None, Tensor | float]:
    """The normalized gradient's global norm (None when not needed) and the one coefficient to apply.

    The gradients still hold the un-normalized sum: the norm is scaled by ``factor`` instead of the
    gradients, and the coefficient ``factor * min(1, max_norm / (norm + eps))`` is applied once.
    """
    if not cfg.need_norm:
        return None, factor
    norm = global_grad_norm(params, cfg.norm_type)
    if not _is_one(factor):
        norm = norm * factor
    if cfg.max_grad_norm is None:
        return norm, factor
    clip = clip_coefficient(norm, cfg.max_grad_norm, cfg.eps)
    return norm, clip if _is_one(factor) else factor * clip


@dataclass(frozen=True)
class Reading:
    """What the step's one host sync read."""

    norm: float
    """The normalized global norm (NaN when not computed)."""
    items: float | None = None
    """The global item count (None without ``num_items``)."""
    invalid: float = 0.0
    """0 when every item count on every rank was finite and >= 0; positive or NaN otherwise."""
    vetoed: bool = False
    """The caller's ``veto`` flag (a loss spike) was set."""
    losses: float = 0.0
    """The cycle's losses summed over its micro-batches and ranks: not finite when one of them was not (0 when the
    policy does not look at them)."""

    @property
    def items_valid(self) -> bool:
        return self.items is not None and self.invalid == 0 and math.isfinite(self.items) and self.items >= 0


def read_once(
    norm: Tensor | None,
    totals: Tensor | None,
    veto: Tensor | None = None,
    losses: list[Tensor] | Tensor | None = None,
) -> Reading:
    """The one host sync per optimizer step (skip or step must be decided): norm, item counts, the
    caller's veto flag and the cycle's losses (this rank's 0-dim losses, or their sum over the ranks)."""
    if totals is None and veto is None and (losses is None or norm is None):
        return Reading(math.nan if norm is None else float(norm))  # host read: skip or step is a Python decision
    if isinstance(losses, list):
        losses = [x if x.device == norm.device else x.to(norm.device) for x in losses]  # type: ignore[union-attr]
        if totals is None and veto is None:  # one process: the norm and the losses in one stack, one read
            values = torch.stack([norm, *losses]).tolist()  # type: ignore[list-item]
            return Reading(values[0], losses=sum(values[1:]))
        losses = torch.stack(losses)
    parts = [t.reshape(-1).double() for t in (norm, totals, veto, losses) if t is not None]
    values = torch.cat([t.to(parts[0].device) for t in parts]).tolist()  # the one read: skip or step is decided here
    value = values.pop(0) if norm is not None else math.nan
    items, invalid = (values.pop(0), values.pop(0)) if totals is not None else (None, 0.0)
    vetoed = bool(values.pop(0)) if veto is not None else False
    return Reading(value, items, invalid, vetoed, sum(values))  # what is left: the losses (none: 0)


def refusal(reading: Reading, cfg: StepConfig) -> str | None:
    """Why this cycle must not step (a reason from :mod:`.events`), or None to step.

    Item counts that cannot normalize (negative, NaN, inf, or 0 in all) always refuse, whatever the
    policy: stepping would be gradient ascent, a NaN update, or a step on no data. A non-finite norm,
    then a non-finite loss with a finite norm, refuse unless ``on_nonfinite="ignore"`` (and no
    ``GradScaler``). Last, the caller's veto (a spike).
    """
    if reading.items is not None:
        if not reading.items_valid:
            return INVALID_ITEMS
        if reading.items == 0:
            return NO_ITEMS
    if cfg.guard and not math.isfinite(reading.norm):
        return NONFINITE_NORM
    if cfg.guard and not math.isfinite(reading.losses):
        return NONFINITE_LOSS
    return SPIKE if reading.vetoed else None


def _apply_coefficient(
    params: list[Tensor], optimizer: torch.optim.Optimizer, coef: Tensor | float, cfg: StepConfig
) -> bool:
    """Scale (and value-clip) the gradients, or fold the scale into a fused optimizer; True if folded."""
    rescale = not _is_one(coef)
    if cfg.clip_value is not None:
        if rescale:
            scale_grads_(params, coef)
        clip_grad_value_(params, cfg.clip_value)
        return False
    if cfg.fused and rescale:
        # The fused kernel divides every gradient by grad_scale as it reads it: no extra pass.
        coef_t = coef if isinstance(coef, Tensor) else torch.tensor(coef, dtype=torch.float64)
        device = params[0].device if params else coef_t.device
        optimizer.grad_scale = (1.0 / coef_t).to(device, torch.float32)
        return True
    if rescale:
        scale_grads_(params, coef)
    return False


def apply_and_step(
    params: list[Tensor], optimizer: torch.optim.Optimizer, coef: Tensor | float, cfg: StepConfig, grad_scaler
) -> None:
    """Apply the coefficient and run ``optimizer.step()`` (through the ``GradScaler`` when there is one)."""
    folded = _apply_coefficient(params, optimizer, coef, cfg)
    try:
        if grad_scaler is not None:
            grad_scaler.step(optimizer)
            grad_scaler.update()
        else:
            optimizer.step()
    finally:
        if folded:
            del optimizer.grad_scale
