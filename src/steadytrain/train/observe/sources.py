"""A mixture run's training loss and realized mixture per source, per logging interval.

Every micro-batch adds its per-example losses (the ones the model already returns: no extra forward) to one
sum per source, on the device, and its examples to one count per source, on the host. When the metrics are
written (every ``run.log_every`` steps, and before each evaluation: an *interval*), the sums and counts of every
rank are all-reduced with them (one collective, one host read) and the interval's last ``metrics.jsonl`` row gets,
per source ``<name>``:

- ``loss/<name>``: the mean per-example loss of that source's examples in the interval (null when it had
  none, when the model returns a scalar loss, or when the mean is not finite);
- ``mix/<name>``: that source's share of the interval's examples (the realized mixture).

The ranks of one tensor-parallel group read the same examples: only the first of them counts them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from steadytrain.train.setup.distributed import DistInfo

__all__ = ["SourceLosses"]


class SourceLosses:
    """Per-source loss sums and example counts of the current logging interval (see the module docstring)."""

    def __init__(self, names: list[str], info: DistInfo) -> None:
        self.names, self.info = list(names), info
        self._sums = torch.zeros(len(names), dtype=torch.float64, device=info.device)
        self._counts = np.zeros(len(names), dtype=np.int64)  # examples per source
        self._measured = np.zeros(len(names), dtype=np.int64)  # of them, with a per-example loss

    def add(self, out: torch.Tensor, source: torch.Tensor, on_device: torch.Tensor | None = None) -> None:
        """A micro-batch's model output (per-example losses ``[n]``, or a scalar) and its ``source`` column (on the
        host; ``on_device``: the same column where the losses are, when the batch was moved there)."""
        counts = np.bincount(source.numpy(), minlength=len(self.names))
        self._counts += counts
        if out.dim() == 1:
            where = on_device if on_device is not None else source.to(self._sums.device)
            self._sums.index_add_(0, where, out.detach().double())
            self._measured += counts

    def take(self) -> dict[str, Any]:
        """The interval's ``loss/<name>`` and ``mix/<name>`` over all ranks, and a fresh interval (a collective:
        every rank calls it; one host read)."""
        n = len(self.names)
        counts = torch.from_numpy(np.concatenate([self._counts, self._measured])).double().to(self._sums.device)
        both = torch.cat([self._sums, counts])
        if self.info.tp_rank:
            both.zero_()  # counted once per tensor-parallel group
        if self.info.backend is not None:
            dist.all_reduce(both)
        values = both.tolist()  # host read, once per logging interval, beside the metrics' own
        sums, seen, measured = values[:n], values[n : 2 * n], values[2 * n :]
        self._sums.zero_()
        self._counts[:] = 0
        self._measured[:] = 0
        total = sum(seen)
        out: dict[str, Any] = {}
        for name, s, m in zip(self.names, sums, measured, strict=True):
            out[f"loss/{name}"] = s / m if m and math.isfinite(s) else None
        for name, c in zip(self.names, seen, strict=True):
            out[f"mix/{name}"] = round(c / total, 6) if total else None
        return out
