"""What :class:`~steadytrain.accumulate.GradientAccumulator` checks of its parts when it is built: the wrong kind of
object refused at construction (not K backward passes later), and BatchNorm under accumulation said."""

from __future__ import annotations

import warnings

from torch import nn

from steadytrain._io import brief
from steadytrain.errors import UserError

__all__ = ["check_parts", "warn_batchnorm"]


def check_parts(model: object, optimizer: object, scheduler: object, grad_scaler: object) -> None:
    """Refuse, at construction, an argument of the wrong kind (not K backward passes later)."""
    if not isinstance(model, nn.Module):
        raise UserError(f"model={brief(model)} is a {type(model).__name__}, not a torch.nn.Module")
    for name, obj, needs in (
        ("optimizer", optimizer, ("step", "zero_grad", "param_groups")),
        ("scheduler", scheduler, ("step",)),
        ("grad_scaler", grad_scaler, ("scale", "unscale_", "update")),
    ):
        required = name == "optimizer"
        if (obj is not None or required) and (lacks := [a for a in needs if not hasattr(obj, a)]):
            raise UserError(f"{name}={brief(obj)} ({type(obj).__name__}) has no {lacks[0]!r}: not a torch {name}")


def warn_batchnorm(model: nn.Module, accumulation_steps: int) -> None:
    if accumulation_steps > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        warnings.warn(
            f"the model has BatchNorm and accumulation_steps={accumulation_steps}: its statistics are computed "
            "per micro-batch, not over the effective batch (use GroupNorm/LayerNorm, or accept the approximation)",
            stacklevel=3,
        )
