"""Forward hooks on every module that note, on the device, whether each output was finite.

One flag per module call, in execution order (a module's hook fires when its forward returns, so a
child comes before its parent), and optionally per row; the flags stay on the device and are read
once per forward pass (:meth:`Probe.flags`, :meth:`Probe.first`), never per module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ROOT", "Probe"]

ROOT = "(model)"
"""The name reported for the model itself (its qualified name is the empty string)."""


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


class Probe:
    """Forward hooks on every module of ``model``; use as a context manager (the hooks are removed on exit).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with Probe(model) as probe:
        ...     _ = model(torch.tensor([[float("nan"), 0.0]]))
        >>> probe.first()
        '0'
    """

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[tuple[str, Tensor]] = []
        self.rows: int | None = None
        """Rows of the batch being run: outputs with this many rows are attributed row by row."""
        self.row_bad: Tensor | None = None
        """Per row: some batch-first output of that row was non-finite (set after :meth:`reset` with ``rows``)."""
        self.unattributed: Tensor | None = None
        """Some non-finite output that is not batch-first (cannot be pinned to rows)."""
        self._handles = [m.register_forward_hook(self._hook(name or ROOT)) for name, m in model.named_modules()]

    def _flag(self, t: Tensor) -> Tensor:
        # A sum is NaN/inf when any element is (and, for float32, only when the row's magnitude passes
        # ~3e38, where the run has diverged anyway): one reduction instead of a mask the size of the output.
        if self.row_bad is not None and t.dim() >= 1 and t.shape[0] == self.rows:
            per_row = ~torch.isfinite(t.reshape(self.rows, -1).sum(1, dtype=torch.float32))
            self.row_bad |= per_row.to(self.row_bad.device)
            return per_row  # reduced only when read (flags)
        flag = ~torch.isfinite(t.sum(dtype=torch.float32))
        if self.unattributed is not None:
            self.unattributed |= flag.to(self.unattributed.device)
        return flag

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            flags = [self._flag(t) for t in _tensors(output)]
            if flags:
                self.calls.append((name, flags[0] if len(flags) == 1 else torch.stack([f.any() for f in flags]).any()))

        return hook

    def reset(self, rows: int | None = None, device: torch.device | str = "cpu") -> None:
        """Forget the calls recorded so far (before the next forward pass); with ``rows``, attribute by row."""
        self.calls.clear()
        self.rows = rows
        self.row_bad = torch.zeros(rows, dtype=torch.bool, device=device) if rows is not None else None
        self.unattributed = torch.zeros((), dtype=torch.bool, device=device) if rows is not None else None

    def flags(self) -> list[bool]:
        """Whether each recorded call's output was non-finite (one host read)."""
        if not self.calls:
            return []
        return torch.stack([f.any() for _, f in self.calls]).tolist()  # host read: first() names the module that failed

    def first(self) -> str | None:
        """The qualified name of the first module (in execution order) whose output was non-finite."""
        return next((name for (name, _), bad in zip(self.calls, self.flags(), strict=True) if bad), None)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
