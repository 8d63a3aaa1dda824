"""The binomial tail, in log space (no SciPy): how surprising ``k`` of ``n`` is at rate ``p``."""

from __future__ import annotations

import math
from collections.abc import Iterator

__all__ = ["binomial_sf"]

CUTOFF = 80.0
"""Terms below ``exp(-CUTOFF)`` times the largest are dropped: they change the sum by less than 1e-30 of it."""


def _log_pmf(i: int, n: int, p: float) -> float:
    return math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)


def binomial_sf(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``, accurate far into the tail (down to ~1e-300).

    Args:
        k: observed successes (0 <= k <= n).
        n: trials.
        p: success probability in [0, 1].

    Returns:
        The upper tail probability, including ``k`` itself.

    Example:
        >>> round(binomial_sf(2, 2, 0.5), 6), binomial_sf(0, 5, 0.3)
        (0.25, 1.0)
    """
    if not 0 <= k <= n or not 0.0 <= p <= 1.0:
        raise ValueError(f"binomial_sf needs 0 <= k <= n and 0 <= p <= 1 (got k={k}, n={n}, p={p})")
    if k == 0:
        return 1.0
    if p == 0.0:
        return 0.0
    if p == 1.0:
        return 1.0
    if k > math.floor((n + 1) * p):  # above the mode: the terms from k upward only fall
        return min(1.0, _falling_sum(_log_pmf(i, n, p) for i in range(k, n + 1)))
    # At or below the mode the tail is not small: 1 - P(X < k), summed from k - 1 downward (falling too).
    return min(1.0, max(0.0, 1.0 - _falling_sum(_log_pmf(i, n, p) for i in range(k - 1, -1, -1))))


def _falling_sum(logs: Iterator[float]) -> float:
    """``sum(exp(t))`` over log terms that (past a peak) only fall, stopped once they are :data:`CUTOFF` below
    the largest: a ledger of 10**9 non-finite losses costs a few thousand terms, not 10**9."""
    top, kept = -math.inf, []
    for t in logs:
        if t < top - CUTOFF:
            break
        kept.append(t)
        top = max(top, t)
    return math.exp(top) * math.fsum(math.exp(t - top) for t in kept)
