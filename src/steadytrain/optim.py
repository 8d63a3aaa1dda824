"""Layer-wise adaptive optimizers for large-batch training: LARS and LAMB.

Both scale each parameter's update by a per-layer *trust ratio* (weight norm over update norm), so that
every layer moves by a similar fraction of its own norm regardless of its gradient scale.

Each param group accepts an ``adapt`` key (``True``, ``False`` or ``None``). ``None`` (the default) means
"adapt iff ``p.ndim > 1``", which excludes biases and normalization weights from the trust ratio. A
parameter that is not adapted gets a trust ratio of exactly 1 **and no weight decay**, whatever the group's
``weight_decay`` says. :func:`exclude_bias_and_norm` builds the two usual groups explicitly.

The last trust ratio used for each parameter is kept in ``optimizer.state[p]["trust_ratio"]`` (a 0-dim
tensor) for inspection and logging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["LAMB", "LARS", "NO_DECAY_KINDS", "decay_groups", "exclude_bias_and_norm"]

_NORM_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _check(name: str, arg: str, value: Any, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {arg}={value!r} must be {valid}")


def _is_adapted(p: torch.Tensor, adapt: bool | None) -> bool:
    return p.ndim > 1 if adapt is None else adapt


def _trust(numer: torch.Tensor, denom: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``ratio`` where both norms are positive, else exactly 1 (no host sync)."""
    return torch.where((numer > 0) & (denom > 0), ratio, torch.ones_like(ratio))


def _dense_grad(name: str, p: torch.Tensor) -> torch.Tensor:
    if p.grad.is_sparse:
        raise RuntimeError(f"{name} does not support sparse gradients")
    return p.grad


class _Layerwise(Optimizer):
    """Shared by LARS and LAMB: groups are validated (the defaults and each added one); ``step`` runs the closure
    and updates each group with ``_step_group``."""

    @staticmethod
    def _validate(g: dict[str, Any]) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._validate(self.param_groups[-1])

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None`` without a closure.

        Raises:
            RuntimeError: If a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss


class LARS(_Layerwise):
    """SGD with momentum and layer-wise adaptive rate scaling (LARS).

    For each parameter ``p`` with gradient ``g``, if ``p`` is adapted::

        d = g + weight_decay * p
        trust = trust_coefficient * ||p|| / (||d|| + eps)   if ||p|| > 0 and ||d|| > 0, else 1
        d = trust * d

    otherwise ``d = g`` (no weight decay, trust ratio 1). Then, as in :class:`torch.optim.SGD` without
    dampening: ``v = momentum * v + d`` (``v = d`` on the first step), the update is ``d + momentum * v``
    with Nesterov or ``v`` without, and ``p -= lr * update``.

    Args:
        params: Parameters or param groups. Groups may override any default and set ``adapt``
            (``True``/``False``/``None``; ``None`` adapts iff ``p.ndim > 1``).
        lr: Learning rate, ``>= 0``.
        momentum: Momentum factor in ``[0, 1)``.
        weight_decay: L2 penalty added to the gradient of adapted parameters, ``>= 0``.
        trust_coefficient: LARS coefficient (eta) scaling the trust ratio, ``> 0``.
        eps: Added to the update norm in the trust ratio's denominator, ``>= 0``.
        nesterov: Use Nesterov momentum (requires ``momentum > 0``).

    Raises:
        ValueError: If a hyperparameter is out of range (also for per-group overrides).
        RuntimeError: From :meth:`step`, if a gradient is sparse.

    References:
        You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks", arXiv:1708.03888 (2017).

    Example:
        >>> import torch
        >>> from steadytrain.optim import LARS, exclude_bias_and_norm
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LARS(exclude_bias_and_norm(model, weight_decay=1e-4), lr=1.0, trust_coefficient=0.02)
        >>> model(torch.randn(8, 4)).pow(2).mean().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["trust_ratio"].ndim
        0
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            adapt=None,
        )
        super().__init__(params, defaults)  # add_param_group validates every group, defaults merged in

    @staticmethod
    def _validate(g: dict[str, Any]) -> None:
        _check("LARS", "lr", g["lr"], g["lr"] >= 0, ">= 0")
        _check("LARS", "momentum", g["momentum"], 0 <= g["momentum"] < 1, "in [0, 1)")
        _check("LARS", "weight_decay", g["weight_decay"], g["weight_decay"] >= 0, ">= 0")
        _check("LARS", "trust_coefficient", g["trust_coefficient"], g["trust_coefficient"] > 0, "> 0")
        _check("LARS", "eps", g["eps"], g["eps"] >= 0, ">= 0")
        _check("LARS", "nesterov", g["nesterov"], not g["nesterov"] or g["momentum"] > 0, "False when momentum=0")
        _check("LARS", "adapt", g["adapt"], g["adapt"] in (None, True, False), "True, False or None")

    def _step_group(self, group: dict[str, Any]) -> None:
        mom = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            d = _dense_grad("LARS", p)
            state = self.state[p]
            if _is_adapted(p, group["adapt"]):
                d = d.add(p, alpha=group["weight_decay"])
                w_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d)
                trust = _trust(w_norm, d_norm, group["trust_coefficient"] * w_norm / (d_norm + group["eps"]))
                d = d.mul(trust)
            else:
                trust = torch.ones((), dtype=p.dtype, device=p.device)
            state["trust_ratio"] = trust
            if mom > 0:
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = d.clone()
                else:
                    buf.mul_(mom).add_(d)
                d = d.add(buf, alpha=mom) if group["nesterov"] else buf
            p.add_(d, alpha=-group["lr"])


class LAMB(_Layerwise):
    """Adam with layer-wise trust ratios (LAMB).

    For each parameter ``p`` with gradient ``g`` at step ``t`` (starting at 1)::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)     # if bias_correction, else m, v
        r = m_hat / (sqrt(v_hat) + eps)

    If ``p`` is adapted: ``r = r + weight_decay * p`` and ``trust = ||p|| / ||r||`` when both norms are
    positive (then clamped to at most ``clamp_trust`` if given), else exactly 1. A parameter that is not
    adapted gets no weight decay and ``trust = 1``. Finally ``p -= lr * trust * r``.

    Args:
        params: Parameters or param groups. Groups may override any default and set ``adapt``
            (``True``/``False``/``None``; ``None`` adapts iff ``p.ndim > 1``).
        lr: Learning rate, ``>= 0``.
        betas: Coefficients ``(b1, b2)`` of the moment averages, each in ``[0, 1)``.
        eps: Added to ``sqrt(v_hat)`` for numerical stability, ``>= 0``.
        weight_decay: Decoupled weight decay added to the update of adapted parameters, ``>= 0``.
        clamp_trust: Upper bound on the computed trust ratio (``> 0``), or ``None`` for no bound.
        bias_correction: Divide the moments by ``1 - beta**t``.

    Raises:
        ValueError: If a hyperparameter is out of range (also for per-group overrides).
        RuntimeError: From :meth:`step`, if a gradient is sparse.

    References:
        You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
        arXiv:1904.00962 (2019).

    Example:
        >>> import torch
        >>> from steadytrain.optim import LAMB, exclude_bias_and_norm
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LAMB(exclude_bias_and_norm(model, weight_decay=0.01), lr=1e-3)
        >>> model(torch.randn(8, 4)).pow(2).mean().backward()
        >>> opt.step()
        >>> opt.state[model.bias]["trust_ratio"].item()
        1.0
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_trust: float | None = None,
        bias_correction: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            clamp_trust=clamp_trust,
            bias_correction=bias_correction,
            adapt=None,
        )
        super().__init__(params, defaults)  # add_param_group validates every group, defaults merged in

    @staticmethod
    def _validate(g: dict[str, Any]) -> None:
        _check("LAMB", "lr", g["lr"], g["lr"] >= 0, ">= 0")
        _check("LAMB", "betas", g["betas"], len(g["betas"]) == 2, "a pair (beta1, beta2)")
        for i, beta in enumerate(g["betas"]):
            _check("LAMB", f"betas[{i}]", beta, 0 <= beta < 1, "in [0, 1)")
        _check("LAMB", "eps", g["eps"], g["eps"] >= 0, ">= 0")
        _check("LAMB", "weight_decay", g["weight_decay"], g["weight_decay"] >= 0, ">= 0")
        ct = g["clamp_trust"]
        _check("LAMB", "clamp_trust", ct, ct is None or ct > 0, "None or > 0")
        _check("LAMB", "adapt", g["adapt"], g["adapt"] in (None, True, False), "True, False or None")

    def _step_group(self, group: dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = _dense_grad("LAMB", p)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            c1, c2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            r = (m / c1) / ((v / c2).sqrt() + group["eps"])
            if _is_adapted(p, group["adapt"]):
                r.add_(p, alpha=group["weight_decay"])
                w_norm, r_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(r)
                ratio = w_norm / r_norm
                if group["clamp_trust"] is not None:
                    ratio = ratio.clamp(max=group["clamp_trust"])
                trust = _trust(w_norm, r_norm, ratio)
                r.mul_(trust)
            else:
                trust = torch.ones((), dtype=p.dtype, device=p.device)
            state["trust_ratio"] = trust
            p.add_(r, alpha=-group["lr"])


NO_DECAY_KINDS = ("bias", "norm")
"""What ``optim.no_decay`` may name: ``bias`` (parameters named ``bias``), ``norm`` (every parameter of a
normalization layer, and any other parameter of fewer than 2 dimensions: scales and gains)."""


def _is_norm_layer(module: nn.Module) -> bool:
    return isinstance(module, _NORM_LAYERS) or type(module).__name__.endswith("Norm")


def decay_groups(
    model: nn.Module, weight_decay: float, no_decay: Iterable[str] = NO_DECAY_KINDS
) -> list[dict[str, Any]]:
    """Split a model's trainable parameters into a decayed group and one exempt from weight decay.

    One rule for every optimizer: a parameter is exempt when ``"bias"`` is in ``no_decay`` and its name is
    ``bias``, or when ``"norm"`` is in ``no_decay`` and it belongs to a normalization layer (torch's, or any
    module whose class name ends in ``Norm``) or has fewer than 2 dimensions. With both (the default) every
    parameter of fewer than 2 dimensions is exempt; with ``()`` everything is decayed. The decayed group has
    ``adapt=True`` and the exempt one ``weight_decay=0.0, adapt=False`` (the LARS/LAMB trust ratio skips it).
    Empty groups are left out; frozen and shared parameters are skipped / listed once. Each group carries
    ``names`` (parameter names, for the start-up listing; torch keeps extra keys of a param group).

    Raises:
        ValueError: a negative ``weight_decay`` or an unknown kind in ``no_decay``.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        >>> [len(g["params"]) for g in decay_groups(model, 0.1)], len(decay_groups(model, 0.1, [])[0]["params"])
        ([2, 4], 6)
    """
    _check("decay_groups", "weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    kinds = set(no_decay)
    _check("decay_groups", "no_decay", sorted(kinds), kinds <= set(NO_DECAY_KINDS), f"a subset of {NO_DECAY_KINDS}")
    decayed, exempt = _split(model, kinds, frozen=False)
    groups = [
        {"params": list(decayed.values()), "names": list(decayed), "weight_decay": weight_decay, "adapt": True},
        {"params": list(exempt.values()), "names": list(exempt), "weight_decay": 0.0, "adapt": False},
    ]
    return [g for g in groups if g["params"]]


def _split(model: nn.Module, kinds: set[str], *, frozen: bool) -> tuple[dict[str, nn.Parameter], ...]:
    """``(decayed, exempt)`` by name, each parameter once (shared ones under their first name)."""
    decayed: dict[str, nn.Parameter] = {}
    exempt: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        norm = _is_norm_layer(module)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not (frozen or p.requires_grad):
                continue
            seen.add(id(p))
            full = f"{module_name}.{name}" if module_name else name
            skip = ("bias" in kinds and name == "bias") or ("norm" in kinds and (norm or p.ndim < 2))
            (exempt if skip else decayed)[full] = p
    return decayed, exempt


def exclude_bias_and_norm(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The two usual groups for :class:`LARS` and :class:`LAMB`: ``[adapted, excluded]``.

    :func:`decay_groups` with ``bias`` and ``norm`` exempt, always two groups (either may be empty), and
    frozen parameters included.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        >>> adapted, excluded = exclude_bias_and_norm(model, weight_decay=1e-4)
        >>> len(adapted["params"]), len(excluded["params"])
        (2, 4)
    """
    _check("exclude_bias_and_norm", "weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    adapted, excluded = _split(model, set(NO_DECAY_KINDS), frozen=True)
    return [
        {"params": list(adapted.values()), "weight_decay": weight_decay, "adapt": True},
        {"params": list(excluded.values()), "weight_decay": 0.0, "adapt": False},
    ]
