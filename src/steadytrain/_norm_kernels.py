"""Per-tensor gradient norms, float32-accurate on large CPU tensors (private to :mod:`steadytrain.clip`).

On CPU, torch's norm kernel keeps a few long float32 running sums (measured here: relative error 2.4e-3
on a 38.6M-element tensor, GPT-2's embedding), and with ``dtype=float32`` on fp16/bf16 input it takes a
slow path (~20x, it casts the whole tensor). Large CPU tensors are therefore reduced in short rows, then
over the row norms; fp16/bf16 rows are cast to float32 one cache-sized chunk at a time. Everything else
goes through one fused ``torch._foreach_norm`` per (device, dtype) group.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

__all__ = ["foreach_norms"]

_ROW = 2048  # elements per row of the two-level reduction
_BIG = 1 << 16  # contiguous CPU tensors at least this large take the row-wise path
_STAGE = 1 << 20  # fp16/bf16 elements cast to float32 per step (a reused 4 MiB buffer)


def _rows_norm(flat: Tensor, norm_type: float) -> Tensor:
    """Norms of the ``_ROW``-element rows of a 1-D tensor, plus one for its tail."""
    n = flat.numel()
    m = n // _ROW
    parts = []
    if m:
        parts.append(torch.linalg.vector_norm(flat[: m * _ROW].view(m, _ROW), norm_type, dim=1))
    if m * _ROW < n:
        parts.append(torch.linalg.vector_norm(flat[m * _ROW :], norm_type).reshape(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cpu_big_norm(t: Tensor, norm_type: float, buf: Tensor | None) -> Tensor:
    """Norm of one large contiguous CPU tensor, float32-accurate; ``buf``: float32 staging for fp16/bf16."""
    flat = t.view(-1)
    if buf is None:
        return torch.linalg.vector_norm(_rows_norm(flat, norm_type), norm_type)
    rows = []
    for chunk in flat.split(buf.numel()):
        b = buf[: chunk.numel()]
        b.copy_(chunk)
        rows.append(_rows_norm(b, norm_type))
    return torch.linalg.vector_norm(torch.cat(rows), norm_type)


def _cpu_big_norms(
    tensors: list[Tensor], idx: list[int], norm_type: float, acc: torch.dtype | None
) -> dict[int, Tensor]:
    """Row-wise norms of the large contiguous CPU tensors among ``tensors[i] for i in idx``."""
    big = [i for i in idx if tensors[i].numel() >= _BIG and tensors[i].is_contiguous()]
    if not big:
        return {}
    size = min(_STAGE, max(tensors[i].numel() for i in big))
    buf = torch.empty(size, dtype=torch.float32) if acc is not None else None
    return {i: _cpu_big_norm(tensors[i], norm_type, buf) for i in big}


def foreach_norms(tensors: list[Tensor], norm_type: float) -> list[Tensor]:
    """Per-tensor norms accumulated in float32, one fused kernel per (device, dtype) group."""
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_key[(t.device, t.dtype)].append(i)
    out: list[Tensor | None] = [None] * len(tensors)
    for (device, dtype), idx in by_key.items():
        # Low-precision grads square into float32: an fp16 sum of squares overflows at 65504.
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        if device.type == "cpu" and math.isfinite(norm_type) and dtype.is_floating_point:
            big = _cpu_big_norms(tensors, idx, norm_type, acc)
            for i, n in big.items():
                out[i] = n
            idx = [i for i in idx if i not in big]
        if not idx:
            continue
        group = [tensors[i] for i in idx]
        for i, n in zip(idx, torch._foreach_norm(group, norm_type, dtype=acc), strict=True):
            out[i] = n
    return out  # type: ignore[return-value]
