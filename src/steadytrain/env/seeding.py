"""Seeding and determinism, recorded so a manifest says which knobs were on."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np

__all__ = ["seed_everything"]

# cuBLAS needs a fixed workspace for deterministic results (CUDA >= 10.2); ":4096:8" is NVIDIA's documented value.
CUBLAS_DETERMINISTIC = ":4096:8"


def seed_everything(seed: int, deterministic: bool = False) -> dict[str, Any]:
    """Seed Python, NumPy and torch (CPU and every CUDA device); optionally make torch deterministic.

    With ``deterministic=True`` also: ``torch.use_deterministic_algorithms(True)`` (an op without a
    deterministic implementation raises), cuDNN deterministic and not benchmarking, and
    ``CUBLAS_WORKSPACE_CONFIG`` set to ``:4096:8`` unless already set (it must be set before the
    first cuBLAS call to take effect).

    Args:
        seed: a non-negative integer below 2**32.
        deterministic: also switch torch to deterministic algorithms.

    Returns:
        What was set, for the run's manifest.

    Raises:
        ValueError: ``seed`` is not an integer in [0, 2**32).

    Example:
        >>> import torch
        >>> _ = seed_everything(7); a = torch.rand(2)
        >>> _ = seed_everything(7); torch.equal(a, torch.rand(2))
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32)")
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every device, CUDA included
    os.environ["PYTHONHASHSEED"] = str(seed)  # for subprocesses (this process's hash seed is fixed at start)
    record: dict[str, Any] = {"seed": seed, "deterministic": deterministic}
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        record["CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    return record
