"""Micro-batch transforms the background-loading tests name as ``tests.loader_utils:...`` (importable in
the workers and in a training subprocess run from the repository root)."""

from __future__ import annotations

import os
import signal

import torch
from torch.utils.data import get_worker_info

BAD_SHARD = 3


def reverse(mb: dict) -> dict:
    """Each sequence read backwards: a change the model sees, the same wherever it runs."""
    return {**mb, "tokens": torch.flip(mb["tokens"], dims=[1])}


def raise_on_bad_shard(mb: dict) -> dict:
    if (mb["shard"] == BAD_SHARD).any():
        raise ValueError(f"cannot transform a row of shard {BAD_SHARD}")
    return mb


def die_on_bad_shard(mb: dict) -> dict:
    """A worker process killed (as the out-of-memory killer would) when it meets the bad shard."""
    if get_worker_info() is not None and (mb["shard"] == BAD_SHARD).any():
        os.kill(os.getpid(), signal.SIGKILL)
    return mb


def many_kinds(mb: dict) -> dict:
    """Columns of every kind a transform may return: small tensors of several dtypes (handed over pickled),
    bfloat16 (NumPy has none) and a tensor over 1 MiB (both in shared memory), a non-contiguous view,
    a NumPy array and a list of strings (as the transform made them)."""
    n = len(mb["tokens"])
    tokens = mb["tokens"].long()
    return {
        **mb,
        "f16": tokens.to(torch.float16),
        "bf16": tokens.to(torch.bfloat16),
        "flag": tokens > 100,
        "i8": tokens.to(torch.int8),
        "view": tokens[:, ::2],
        "big": tokens.double().repeat(1, 4096)[:, : (1 << 18) // n + 1],
        "np": tokens.numpy() * 2,
        "words": [f'row {i} "quoted"\n' for i in range(n)],
    }
