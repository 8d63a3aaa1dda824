"""NumPy reference implementations, exactly as the seed writes them: the oracle for tests.

These are deliberately naive (a Python loop, a host-side ``if``); the torch implementations in
:mod:`steadytrain.clip` must agree with them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["clip_grad_by_value", "clip_grad_global_norm"]


def clip_grad_global_norm(
    gradients: list[np.ndarray], max_norm: float, eps: float = 1e-6
) -> tuple[list[np.ndarray], float]:
    """Seed algorithm: one L2 norm over all gradients; rescale all by ``max_norm / (norm + eps)`` if above.

    Args:
        gradients: one array per parameter.
        max_norm: the largest allowed global norm.
        eps: keeps the division finite for an all-zero gradient.

    Returns:
        The (possibly rescaled) gradients and the global norm before clipping.

    Example:
        >>> _, norm = clip_grad_global_norm([np.array([3.0, 4.0]), np.array([12.0])], 1.0)
        >>> float(norm)
        13.0
    """
    global_norm = np.sqrt(sum(np.sum(g**2) for g in gradients))
    if global_norm > max_norm:
        scale = max_norm / (global_norm + eps)
        gradients = [g * scale for g in gradients]
    return gradients, float(global_norm)


def clip_grad_by_value(gradients: list[np.ndarray], clip_value: float) -> list[np.ndarray]:
    """Seed algorithm: clamp every entry to ``[-clip_value, clip_value]`` independently.

    Example:
        >>> clip_grad_by_value([np.array([12.0])], 5.0)[0].tolist()
        [5.0]
    """
    return [np.clip(g, -clip_value, clip_value) for g in gradients]
