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
