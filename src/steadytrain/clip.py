"""Gradient clipping: one true global norm, value clipping, and per-parameter norm clipping.

Global-norm clipping (Pascanu et al. 2013) computes ONE norm over every gradient element of every
parameter and rescales all gradients by the same factor, so the direction of the update is kept.
Value clipping clamps each element on its own. Per-parameter norm clipping rescales each tensor by
its own norm: a different algorithm (the one Keras' ``clipnorm`` runs), named here so it is never
mistaken for the global one.

Every function here works on plain tensors, on gradients spread over several devices, and on
DTensor gradients (FSDP2 ``fully_shard``, tensor parallel): the local shard's contribution is
reduced over the mesh dimensions the gradient is sharded on, so every rank sees the true global
norm. None of them synchronises with the host.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from steadytrain._check import check_finite
from steadytrain._dtensor import is_dtensor as _is_dtensor
from steadytrain._dtensor import local as _local
from steadytrain._dtensor import shard_groups as _shard_groups
from steadytrain._io import brief
from steadytrain._norm_kernels import foreach_norms
from steadytrain.errors import UserError

__all__ = [
    "clip_coefficient",
    "clip_grad_global_norm_",
    "clip_grad_per_param_norm_",
    "clip_grad_value_",
    "combine_norms",
    "global_grad_norm",
    "local_norms",
    "scale_grads_",
    "tensor_norms",
]

Parameters = Tensor | Iterable[Tensor]


def _grads(parameters: Parameters) -> list[Tensor]:
    """The gradients of ``parameters``; a :class:`UserError` for anything but tensors (a module, say)."""
    if isinstance(parameters, Tensor):
        return [parameters.grad] if parameters.grad is not None else []
    if isinstance(parameters, nn.Module):
        raise UserError(f"parameters is a module ({type(parameters).__name__}): pass model.parameters()")
    try:
        params = list(parameters)
    except TypeError:
        raise UserError(
            f"parameters={brief(parameters)} must be a tensor or an iterable of tensors, e.g. model.parameters()"
        ) from None
    if bad := next((p for p in params if not isinstance(p, Tensor)), None):
        raise UserError(f"parameters holds {brief(bad)} ({type(bad).__name__}), not a tensor: pass model.parameters()")
    return [p.grad for p in params if p.grad is not None]


def _check_norm_type(norm_type: float | str) -> float:
    """``norm_type`` as a float p > 0 or ``inf``, spelled as torch's ``clip_grad_norm_`` takes it.

    A real number or a string that parses as one (``"inf"``, ``"2"``, ``"2.0"``), as torch accepts;
    refused: bools, tensors, other types, strings that are not numbers, NaN, and the values that are
    not norms (0, negatives, ``-inf``: torch computes a count or the smallest magnitude for them).
    """
    number = isinstance(norm_type, str) or (isinstance(norm_type, numbers.Real) and not isinstance(norm_type, bool))
    try:
        p = float(norm_type) if number else None
    except (ValueError, OverflowError):  # "abc"; an int beyond float range
        p = None
    if p is None:
        kind = "" if isinstance(norm_type, str) else f" ({type(norm_type).__name__})"
        raise UserError(f"norm_type={brief(norm_type)}{kind} is not a number: use 2.0 for L2 or 'inf' for max-abs")
    if not p > 0:  # NaN fails too
        raise UserError(f"norm_type={brief(norm_type)} is not a norm: use a p > 0 (2.0 for L2) or 'inf'")
    return p


def _check_eps(eps: float) -> float:
    """``eps`` as a finite float >= 0: NaN would poison every clipped step, a negative one breaks the bound."""
    return check_finite("eps", eps, minimum=0.0)


def _check_norm_clip(max_norm: float, eps: float) -> tuple[float, float]:
    """``(max_norm, eps)`` checked together: both finite and >= 0, and not both 0 (0 / 0 on a zero gradient)."""
    max_norm, eps = check_finite("max_norm", max_norm, minimum=0.0), _check_eps(eps)
    if max_norm == 0 and eps == 0:
        raise UserError("max_norm=0 with eps=0 divides 0 by 0 on an all-zero gradient: give eps > 0")
    return max_norm, eps


def _reduce_(values: Tensor, norm_type: float, groups: Iterable[dist.ProcessGroup]) -> Tensor:
    """Combine per-rank norms into the norm over all ranks, in place; ``values`` holds norms."""
    groups = list(groups)
    if not groups:
        return values
    if math.isinf(norm_type):
        for g in groups:  # the threshold applies to the whole gradient's norm, not this rank's shard of it
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=g)
        return values
    values.pow_(norm_type)
    for g in groups:  # the whole gradient's norm: each shard's p-th powers summed over the ranks holding them
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=g)
    return values.pow_(1.0 / norm_type)


def _per_tensor_norms(grads: list[Tensor], norm_type: float) -> Tensor:
    """1-D float32 tensor of each gradient's true (mesh-reduced) norm, on the first grad's device."""
    return combine_norms(local_norms(grads, norm_type).unsqueeze(0), grads, norm_type)[0]


def local_norms(tensors: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """1-D: each tensor's norm over what this rank holds of it (a DTensor's local shard); no collective, no host
    sync. :func:`combine_norms` makes them whole-tensor norms."""
    locals_ = [_local(t) for t in tensors]
    device = locals_[0].device
    return torch.stack([n.to(device, non_blocking=True) for n in foreach_norms(locals_, norm_type)])


def combine_norms(norms: Tensor, like: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """Whole-tensor norms from :func:`local_norms` rows (``(k, n)``, column i from tensors laid out as ``like[i]``):
    each DTensor's column is reduced over the mesh dimensions it is sharded on, one collective per set of such
    dimensions for all rows (one under FSDP2; none for plain tensors, whose local norm is the whole norm)."""
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[int]] = defaultdict(list)
    for i, t in enumerate(like):
        if _is_dtensor(t) and (groups := _shard_groups(t)):
            by_groups[groups].append(i)
    for groups, idx in by_groups.items():
        index = torch.tensor(idx, device=norms.device)
        norms[:, index] = _reduce_(norms[:, index].contiguous(), norm_type, groups)
    return norms


@torch.no_grad()
def tensor_norms(*columns: list[Tensor]) -> Tensor:
    """Each tensor's true L2 norm, for one or more lists of tensors laid out alike (say the gradients and the
    parameters of the same parameters): a ``(len(columns), n)`` float32 tensor.

    A DTensor (FSDP2, tensor parallel) contributes its local shard, summed over the mesh dimensions it is
    sharded on, so every rank gets the whole tensor's norm, never its shard's nor a replica counted twice; all
    columns share one collective per set of such dimensions (one under FSDP2, none for plain tensors). No host
    synchronisation. A group of tensors (a layer) has the square root of the sum of their squares as its norm.

    Example:
        >>> tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([12.0])]).tolist()
        [[5.0, 12.0]]
    """
    if not columns or not columns[0]:
        return torch.zeros((len(columns), 0), dtype=torch.float32)
    if any(len(c) != len(columns[0]) for c in columns):
        raise UserError(f"tensor_norms: columns of {[len(c) for c in columns]} tensors: give lists of one length")
    return combine_norms(torch.stack([local_norms(c).float() for c in columns]), columns[0])


@torch.no_grad()
def global_grad_norm(
    parameters: Parameters, norm_type: float | str = 2.0, process_group: dist.ProcessGroup | None = None
) -> Tensor:
    """The norm of all gradients combined, as if every element were in one vector.

    The p-norm is ``(sum over all grads, all elements |g|^p)^(1/p)``; ``inf`` is the largest
    absolute element. fp16/bf16 gradients accumulate in float32. DTensor gradients (FSDP2,
    tensor parallel) contribute their local shard and are summed over the mesh, so the value is
    the same on every rank and for every world size. No host synchronisation.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is read. Parameters with no
            gradient are skipped.
        norm_type: ``p`` of the p-norm (``2.0`` for L2, ``float('inf')`` for max-abs), or a string
            that parses as one (``"inf"``, ``"2"``), as ``torch.nn.utils.clip_grad_norm_`` takes it.
        process_group: an extra group to sum over, e.g. pipeline stages that each hold different
            parameters. Each rank passes only its own parameters.

    Returns:
        A 0-dim float32 tensor (float64 if any gradient is float64) on the device of the first
        gradient (``0.0`` when there is no gradient). A NaN or inf anywhere gives a non-finite
        norm: the caller decides what to do.

    Raises:
        UserError: ``norm_type`` is not a number (or a string of one) or not positive (NaN, 0,
            negative, ``-inf``); a ``ValueError``.

    References:
        Pascanu, Mikolov, Bengio 2013, "On the difficulty of training recurrent neural networks".

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2)); b = torch.nn.Parameter(torch.zeros(1))
        >>> w.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
        >>> float(global_grad_norm([w, b]))
        13.0
    """
    return _total_norm(_grads(parameters), _check_norm_type(norm_type), process_group)


def _total_norm(grads: list[Tensor], norm_type: float, process_group: dist.ProcessGroup | None) -> Tensor:
    if not grads:
        total = torch.zeros((), dtype=torch.float32)
    else:
        total = torch.linalg.vector_norm(_per_tensor_norms(grads, norm_type), norm_type)
    if process_group is not None:
        # Ranks without gradients still take part in the collective, with a zero contribution.
        total = _reduce_(total.reshape(1), norm_type, [process_group]).reshape(())
    return total


def clip_coefficient(norm: Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """The global-norm clipping factor ``min(1, max_norm / (norm + eps))``, as a tensor (no host sync).

    The one place this rule is written: :func:`clip_grad_global_norm_`, :func:`clip_grad_per_param_norm_`
    and :class:`~steadytrain.accumulate.GradientAccumulator` all call it. It keeps ``norm``'s dtype and
    device; a non-finite ``norm`` gives a non-finite (or zero) factor, so callers check the norm first.

    Args:
        norm: the norm(s) to clip, any shape (0-dim for a global norm, 1-D for per-parameter norms).
        max_norm: the largest allowed norm (>= 0, not checked here: the public callers check it).
        eps: added to the norm so an all-zero gradient does not divide by zero (>= 0).

    Returns:
        A tensor shaped like ``norm``: exactly 1 where ``norm + eps <= max_norm``.

    References:
        Pascanu, Mikolov, Bengio 2013; the seed's ``clip_grad_global_norm`` (``steadytrain.reference``).

    Example:
        >>> clip_coefficient(torch.tensor(13.0, dtype=torch.float64), 1.0, eps=0.0).item() == 1 / 13
        True
        >>> float(clip_coefficient(torch.tensor(0.5), 1.0))
        1.0
    """
    return torch.clamp(max_norm / (norm + eps), max=1.0)


def _scale_(grads: list[Tensor], coef: Tensor | float) -> None:
    """Multiply ``grads`` by ``coef`` in place, one fused kernel per (device, dtype) group.

    The factor is applied in the precision of the gradients it scales (float64 gradients get a float64
    factor, others float32): a Python float is never rounded to float32 before a float64 gradient sees it.
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    has_dtensor = any(_is_dtensor(g) for g in grads)
    for g in grads:
        local = _local(g) if has_dtensor else g
        by_key[(local.device, local.dtype)].append(local)
    for (device, dtype), group in by_key.items():
        if isinstance(coef, Tensor):
            factor: Tensor | float = coef.to(device, torch.promote_types(dtype, torch.float32), non_blocking=True)
        else:
            factor = float(coef)  # a Python scalar: torch applies it at the group's own (or float32) precision
        torch._foreach_mul_(group, factor)


@torch.no_grad()
def scale_grads_(parameters: Parameters, factor: Tensor | float) -> None:
    """Multiply every gradient by ``factor`` in place: one fused pass per device and dtype, DTensor-aware.

    The factor is applied at the gradients' own precision: float64 gradients are multiplied by a
    float64 factor (so ``scale_grads_(params, 1 / 3)`` on a float64 gradient of 3 gives exactly 1),
    float32, bf16 and fp16 gradients by a float32 one.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is scaled in place.
        factor: a Python number or a 0-dim tensor (a tensor stays on the device: no host sync).

    Raises:
        UserError: ``factor`` is not a finite number nor a 0-dim tensor, or ``parameters`` holds no tensors.

    Example:
        >>> b = torch.nn.Parameter(torch.zeros(1)); b.grad = torch.tensor([12.0])
        >>> scale_grads_([b], torch.tensor(0.5)); b.grad
        tensor([6.])
    """
    if isinstance(factor, Tensor):
        if factor.ndim:
            raise UserError(f"factor has shape {tuple(factor.shape)}: pass a 0-dim tensor or a number")
    else:
        factor = check_finite("factor", factor)
    grads = _grads(parameters)
    if grads:
        _scale_(grads, factor)


@torch.no_grad()
def clip_grad_global_norm_(
    parameters: Parameters,
    max_norm: float,
    *,
    eps: float = 1e-6,
    norm_type: float | str = 2.0,
    process_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Scale every gradient by the same factor so that the global norm is at most ``max_norm``.

    The factor is ``min(1, max_norm / (norm + eps))`` with ``norm`` from :func:`global_grad_norm`.
    Ratios between gradients are unchanged (the update keeps its direction); below the threshold
    gradients are multiplied by exactly 1 and stay bit-identical. No host synchronisation: the
    factor stays a tensor.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped in place.
        max_norm: the largest allowed global norm.
        eps: added to the norm so that an all-zero gradient does not divide by zero.
        norm_type: ``p`` of the p-norm, or ``float('inf')``; a string that parses as one (``"inf"``,
            ``"2.0"``) too, as in ``torch.nn.utils.clip_grad_norm_``.
        process_group: see :func:`global_grad_norm`.

    Returns:
        The global norm before clipping (0-dim float32 tensor).

    Raises:
        UserError: ``max_norm`` or ``eps`` is negative or not finite, or ``norm_type`` is not a number
            (or a string of one) or not positive (a ``ValueError``).

    References:
        Pascanu et al. 2013; the seed's ``clip_grad_global_norm`` (``steadytrain.reference``).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2)); b = torch.nn.Parameter(torch.zeros(1))
        >>> w.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
        >>> float(clip_grad_global_norm_([w, b], max_norm=1.0))
        13.0
        >>> round(float(global_grad_norm([w, b])), 5)
        1.0
    """
    max_norm, eps = _check_norm_clip(max_norm, eps)
    grads = _grads(parameters)  # collected once: the norm and the scaling read the same list
    norm = _total_norm(grads, _check_norm_type(norm_type), process_group)
    if grads:
        _scale_(grads, clip_coefficient(norm, max_norm, eps))
    return norm


@torch.no_grad()
def clip_grad_value_(parameters: Parameters, clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, each independently.

    Unlike norm clipping, this changes the direction of the update: a gradient ``[3, 4]`` beside
    ``[12]`` clipped at 5 becomes ``[3, 4]`` and ``[5]``, so the 5:12 proportion becomes 5:5.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clamped in place.
        clip_value: the largest allowed absolute value of an element.

    Raises:
        UserError: ``clip_value`` is negative or not finite (a ``ValueError``).

    Example:
        >>> b = torch.nn.Parameter(torch.zeros(1)); b.grad = torch.tensor([12.0])
        >>> clip_grad_value_([b], 5.0); b.grad
        tensor([5.])
    """
    clip_value = check_finite("clip_value", clip_value, minimum=0.0)
    by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for g in _grads(parameters):
        local = _local(g)
        by_device[local.device].append(local)
    for group in by_device.values():
        torch._foreach_clamp_min_(group, -clip_value)
        torch._foreach_clamp_max_(group, clip_value)


@torch.no_grad()
def clip_grad_per_param_norm_(parameters: Parameters, max_norm: float, *, eps: float = 1e-6) -> list[Tensor]:
    """Clip each parameter's gradient by ITS OWN L2 norm (not the global norm).

    This is a different algorithm from :func:`clip_grad_global_norm_`: every tensor whose norm
    exceeds ``max_norm`` is rescaled to ``max_norm`` on its own, so layers with large gradients
    are shrunk while small ones are left alone, and the relative size of layers' updates changes.
    It is what Keras' ``clipnorm`` does; it is NOT the global clipping of Pascanu et al. For
    sharded (DTensor) gradients each parameter's norm is still its full norm.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped in place.
        max_norm: the largest allowed L2 norm of each parameter's gradient.
        eps: added to each norm to avoid a division by zero.

    Returns:
        The pre-clip L2 norm of each gradient (0-dim float32 tensors), in parameter order,
        parameters without a gradient omitted.

    Raises:
        UserError: ``max_norm`` or ``eps`` is negative or not finite (a ``ValueError``).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2)); b = torch.nn.Parameter(torch.zeros(1))
        >>> w.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
        >>> [float(n) for n in clip_grad_per_param_norm_([w, b], max_norm=6.0)]
        [5.0, 12.0]
        >>> b.grad  # only the 12 was above 6
        tensor([6.0000])
    """
    max_norm, eps = _check_norm_clip(max_norm, eps)
    grads = _grads(parameters)
    if not grads:
        return []
    norms = _per_tensor_norms(grads, 2.0)
    coefs = clip_coefficient(norms, max_norm, eps)
    for g, c in zip(grads, coefs.unbind(), strict=True):
        local = _local(g)
        local.mul_(c.to(local.device, non_blocking=True))
    return list(norms.unbind())
