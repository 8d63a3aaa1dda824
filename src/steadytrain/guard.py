"""Loss-spike detection: a running median and MAD kept on the device, one flag per step, no host read.

A step is a spike when its value (the global step loss, the global gradient norm, or either) exceeds
the median ``m`` of the previous ``window`` accepted values by more than ``threshold`` median absolute
deviations ``d`` *and* is at least ``min_ratio`` times ``m``::

    spike  <=>  step > warmup_steps  and  window values seen  and  v > m + threshold * d  and  v >= min_ratio * m

The second condition keeps a flat curve (tiny ``d``) from firing on noise. A spike, a non-finite
value and a refused step are not added to the window (the statistics stay those of healthy steps).
Everything is a tensor operation on the values' device: :meth:`SpikeDetector.update` returns the
flag as a 0-dim bool tensor, which the caller reads together with whatever it reads anyway (the
accumulator's one host read of the step, or the metrics' read at the logging interval).

Both metrics are always tracked (row 0: loss, row 1: gradient norm), so the loss limit is known for
attributing a gradient-norm spike to examples too.

References:
    Hampel's median/MAD outlier rule; Lightning ``SpikeDetection``; PaLM (Chowdhery et al. 2022, sec. 5.1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from steadytrain._check import check_finite, check_int
from steadytrain.errors import UserError

__all__ = ["METRICS", "SpikeDetector", "SpikeLimits"]

METRICS = ("loss", "grad_norm", "both")


class SpikeLimits:
    """The statistics steps were judged by: device tensors of shape ``[2, n]`` (row 0 the loss, row 1 the
    gradient norm; one column per step), read only for a spike's record."""

    __slots__ = ("limit", "mad", "median", "value")

    def __init__(self, value: Tensor, median: Tensor, mad: Tensor, limit: Tensor) -> None:
        self.value, self.median, self.mad, self.limit = value, median, mad, limit

    def read(self, i: int = 0) -> dict[str, list[float]]:
        """Step ``i``'s values on the host, ``{value, median, mad, limit}`` each ``[loss, grad_norm]`` (one read)."""
        # host read, for a spike's record (the log and spikes.jsonl take numbers)
        values = torch.stack([self.value[:, i], self.median[:, i], self.mad[:, i], self.limit[:, i]]).tolist()
        return dict(zip(("value", "median", "mad", "limit"), values, strict=True))


def _median(sorted_values: Tensor) -> Tensor:
    """Median along the last dimension of sorted values (the mean of the two middle ones when it is even)."""
    w = sorted_values.shape[-1]
    return (sorted_values[..., (w - 1) // 2] + sorted_values[..., w // 2]) / 2


class SpikeDetector:
    """Median/MAD spike detection over the last ``window`` healthy values of the loss and the gradient norm.

    Args:
        window: previous values the statistics are over; nothing is flagged before that many were seen.
        threshold: MADs above the median a spike must exceed.
        min_ratio: and at least this many times the median.
        metric: ``loss``, ``grad_norm`` or ``both`` (either one fires).
        warmup_steps: optimizer steps (1-based, inclusive) at which nothing is flagged.
        device: where the window lives (the loss's device).

    Example:
        >>> d = SpikeDetector(window=4, threshold=5.0, min_ratio=2.0)
        >>> flags = [bool(d.update(step, torch.tensor(v))[0]) for step, v in enumerate([1, 1.1, .9, 1, 1.05, 9], 1)]
        >>> flags
        [False, False, False, False, False, True]
    """

    def __init__(
        self,
        *,
        window: int,
        threshold: float,
        min_ratio: float,
        metric: str = "loss",
        warmup_steps: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.window = check_int("spike.window", window, 2)
        self.threshold = check_finite("spike.threshold", threshold, minimum=0.0)
        self.min_ratio = check_finite("spike.min_ratio", min_ratio, minimum=0.0)
        if metric not in METRICS:
            raise UserError(f"spike.metric={metric!r} is unknown: use one of {', '.join(METRICS)}")
        self.metric = metric
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.device = torch.device(device)
        self.hist = torch.zeros(2, self.window, dtype=torch.float64, device=self.device)
        """The last ``window`` healthy values, oldest first (row 0: loss, row 1: gradient norm)."""
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)
        """Healthy values added so far (a device counter: whether a value is added depends on its flag)."""
        self._use = torch.tensor(
            [[metric in ("loss", "both")], [metric in ("grad_norm", "both")]], dtype=torch.bool, device=self.device
        )
        self._interval: tuple[Tensor, int] | None = None

    def _judge(self, windows: Tensor, v: Tensor) -> tuple[Tensor, SpikeLimits]:
        """``windows`` ``[2, n, w]`` (each step's previous values) against ``v`` ``[2, n]``: flags ``[n]``, limits."""
        med = _median(windows.sort(dim=-1).values)
        mad = _median((windows - med[..., None]).abs().sort(dim=-1).values)
        over = (torch.isfinite(v) & (v > med + self.threshold * mad) & (v >= self.min_ratio * med) & self._use).any(0)
        return over, SpikeLimits(v, med, mad, torch.maximum(med + self.threshold * mad, self.min_ratio * med))

    def _values(self, loss: Tensor | float, grad_norm: Tensor | float) -> Tensor:
        return torch.stack([torch.as_tensor(x, device=self.device).double().reshape(-1) for x in (loss, grad_norm)])

    def update(
        self,
        step: int,
        loss: Tensor | float,
        grad_norm: Tensor | float = math.nan,
        *,
        refused: bool | Tensor = False,
    ) -> tuple[Tensor, SpikeLimits]:
        """Judge optimizer ``step``'s values against the window, then add them unless flagged or refused.

        Args:
            step: the optimizer step (1-based); at or below ``warmup_steps`` nothing is flagged.
            loss: the global step loss (a 0-dim tensor on the detector's device, or a number).
            grad_norm: the global gradient norm (NaN when not computed: the norm is then never a spike).
            refused: the step was refused for another reason (non-finite): judged, never added (a bool, or a
                0-dim bool tensor when only the device knows).

        Returns:
            ``(flag, limits)``: a 0-dim bool tensor (no host read) and the statistics it was judged by.
        """
        v = self._values(loss, grad_norm)  # [2, 1]
        over, limits = self._judge(self.hist[:, None, :], v)
        flag = over[0] & (self.count >= self.window) & (step > self.warmup_steps)
        if refused is not True:
            add = ~flag & torch.isfinite(v[0, 0])
            if isinstance(refused, Tensor):
                add = add & ~refused
            self.hist = torch.where(add, torch.cat([self.hist[:, 1:], v], dim=1), self.hist)
            self.count = self.count + add.long()
        return flag, limits

    def judge_interval(
        self, steps: list[int], losses: Tensor, grad_norms: Tensor | list[float]
    ) -> tuple[Tensor, SpikeLimits]:
        """Several consecutive steps at once (a logging interval), on the assumption that each joins the window:
        a fixed number of operations for the interval, no host read. Call :meth:`settle` with the flags once
        they are read: it says from which step on the assumption failed (those steps are judged again)."""
        n = len(steps)
        v = self._values(losses, torch.as_tensor(grad_norms, dtype=torch.float64))  # [2, n]
        seq = torch.cat([self.hist, v], dim=1)
        over, limits = self._judge(seq.unfold(1, self.window, 1)[:, :n], v)
        ready = self.count + torch.arange(n, device=self.device) >= self.window
        late = torch.tensor([s > self.warmup_steps for s in steps], device=self.device)
        self._interval = (seq, n)
        return over & ready & late, limits

    def settle(self, flags: list[bool], healthy: list[bool]) -> int | None:
        """After :meth:`judge_interval`'s flags were read: the window takes the interval's values up to the first
        step that does not join it (flagged, or not ``healthy``: refused or non-finite); that step's index is
        returned (the steps after it must be judged again, one by one, with :meth:`update`), or None when every
        step joined (all flags stand)."""
        seq, n = self._interval
        self._interval = None
        j = next((i for i in range(n) if flags[i] or not healthy[i]), None)
        taken = n if j is None else j
        self.hist = seq[:, taken : taken + self.window]
        self.count = self.count + taken
        return j

    def state_dict(self) -> dict[str, Any]:
        """The window as plain data (one host read: at a checkpoint), oldest first."""
        count = int(self.count)  # host read: checkpoint time only
        n = min(count, self.window)
        rows = self.hist[:, self.window - n :].tolist() if n else [[], []]  # the window is saved as JSON numbers
        return {"window": self.window, "count": count, "loss": rows[0], "grad_norm": rows[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a window of another size keeps the newest values that fit."""
        if not isinstance(state, dict) or not {"count", "loss", "grad_norm"} <= set(state):
            raise UserError("spike state is not a SpikeDetector.state_dict() (count, loss, grad_norm)")
        count = check_int("spike state count", state["count"], 0)
        loss, norm = list(state["loss"]), list(state["grad_norm"])
        if len(loss) != len(norm) or len(loss) != min(count, len(loss)) or len(loss) > count:
            raise UserError(f"spike state holds {len(loss)} losses and {len(norm)} norms for count {count}: damaged")
        keep = min(len(loss), self.window)
        loss, norm = loss[len(loss) - keep :], norm[len(norm) - keep :]
        values = torch.zeros(2, self.window, dtype=torch.float64)
        values[0, self.window - keep :] = torch.tensor(loss, dtype=torch.float64)
        values[1, self.window - keep :] = torch.tensor(norm, dtype=torch.float64)
        full = keep == self.window  # full when the saved window held at least this window's values
        self.hist = values.to(self.device)
        self.count = torch.tensor(self.window if full else keep, dtype=torch.int64, device=self.device)
