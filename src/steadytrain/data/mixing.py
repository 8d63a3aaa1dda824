"""How many examples of each source every optimizer step of a mixture holds: exact integers, per step.

A mixture of ``J`` sources with weights ``w`` (normalised to sum 1) and a global batch of ``G`` examples:
step ``s`` holds ``c_j(s)`` examples of source ``j``, ``sum_j c_j(s) = G`` exactly. The counts follow the
largest-remainder rule (Hamilton) applied to each step's quota plus the share carried from the steps before:

    q_j(s) = G·w_j(s) + d_j(s)        d_j(0) = 0,   d_j(s+1) = q_j(s) - c_j(s)

``c_j(s)`` is ``floor(q_j)`` and the ``G - sum floor`` remaining examples go to the largest remainders (ties:
sources in an order rotated by ``seed + s``, so no source is always last). Every ``c_j(s) >= 0``. So the
cumulative count ``C_j(s) = sum_{t<s} c_j(t)`` stays within one example of ``sum_{t<s} G·w_j(t)`` (when every
source's share of a step is at least one example; a source whose share is below one example per step gets
its examples every few steps, within two), and over any window of steps the counts match the weights as
closely as integers allow, within two examples. The weights are exact fractions (``0.1`` is 1/10) and every
quota is an integer in units of ``1/D``: no rounding drifts, on any machine, over any number of steps.

Weights may change at given steps (``schedule``): piecewise constant; at each change the carried share starts
afresh (``d = 0``), so a source weighted 0 from there gets no example, and the bound above holds again from that
step. Counts depend on the step and the weights up to it, never on the world size or on where a run resumed.

With each source's epoch size (``sizes``), :meth:`MixCounts.block` also says where in its stream a step's examples
of each source are: a step never takes a source's examples across the end of one of its epochs (the few left that
its count does not fit are passed over, as a single-source epoch drops its remainder), so a step never holds the
same example twice.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from steadytrain._check import check_int
from steadytrain.errors import UserError

__all__ = ["MixCounts"]

_CACHE_EVERY = 1024  # steps between cached cumulative counts (random access costs at most this many steps)


class MixCounts:
    """Per-step example counts of ``len(weights)`` sources in global batches of ``global_batch_size``.

    Args:
        weights: the weights from step 0 on (exact fractions, at least one > 0).
        global_batch_size: ``G``, examples per optimizer step.
        seed: rotates the order in which equal remainders get the step's last examples.
        schedule: ``(step, weights)`` pairs, steps 0-based and increasing: those weights from that step on (the
            share carried over starts afresh there).
        sizes: each source's examples per epoch: a step's examples of a source then lie within one of its epochs.

    Example:
        >>> mc = MixCounts([Fraction(3), Fraction(1)], global_batch_size=8)
        >>> mc.counts(0), mc.before(10)
        ([6, 2], [60, 20])
    """

    def __init__(
        self,
        weights: list[Fraction],
        *,
        global_batch_size: int,
        seed: int = 0,
        schedule: list[tuple[int, list[Fraction]]] = (),
        sizes: list[int] | None = None,
    ) -> None:
        self.g = check_int("global_batch_size", global_batch_size)
        self.seed = seed
        self.n = len(weights)
        segments = [(0, list(weights)), *[(s, list(w)) for s, w in schedule]]
        for i, (start, w) in enumerate(segments):
            if len(w) != self.n or not any(x > 0 for x in w) or any(x < 0 for x in w):
                raise UserError(f"mixture weights at step {start}: give {self.n} weights >= 0, one of them > 0")
            if i and start <= segments[i - 1][0]:
                raise UserError(f"mixture schedule steps must increase: {start} after {segments[i - 1][0]}")
        self.starts = [s for s, _ in segments]
        # every quota in units of 1/D: D the least common multiple of the segments' weight totals (as integers)
        ints = []
        for _, w in segments:
            den = math.lcm(*(x.denominator for x in w))
            ints.append([int(x * den) for x in w])
        self.d = math.lcm(*(sum(a) for a in ints))
        self.quota = [[self.g * a * (self.d // sum(ints_)) for a in ints_] for ints_ in ints]
        self.sizes = list(sizes) if sizes is not None else None
        self._fresh = set(self.starts[1:])  # a schedule entry starts its weights afresh: nothing carried into it
        zero = ([0] * self.n, [0] * self.n, [0] * self.n)
        self._cache: list[tuple[list[int], ...]] = [zero]  # (taken, carried, passed over) every 1024 steps
        self._marks: list[tuple[int, tuple[list[int], ...]]] = [(0, zero)]  # the states of the last 2 steps asked for

    def _segment(self, step: int) -> list[int]:
        i = 0
        while i + 1 < len(self.starts) and self.starts[i + 1] <= step:
            i += 1
        return self.quota[i]

    def _step(self, step: int, carried: list[int]) -> list[int]:
        """The counts of ``step`` from the share carried into it (updated in place to the share carried out)."""
        d, n = self.d, self.n
        if step in self._fresh:
            carried[:] = [0] * n  # a source weighted 0 from here gets nothing: it carries no share into it
        q = [a + c for a, c in zip(self._segment(step), carried, strict=True)]
        counts = [max(x // d, 0) for x in q]
        left = self.g - sum(counts)
        rot = (self.seed + step) % n
        if left > 0:  # the largest remainders (negative quotas last): at most one more each
            order = sorted(range(n), key=lambda j: (-(q[j] - counts[j] * d), (j - rot) % n))
            for j in order[:left]:
                counts[j] += 1
        while left < 0:  # only when a quota is negative: take back the seats of smallest value
            j = min((j for j in range(n) if counts[j]), key=lambda j: (q[j] - counts[j] * d + d, -((j - rot) % n)))
            counts[j] -= 1
            left += 1
        for j in range(n):
            carried[j] = q[j] - counts[j] * d
        return counts

    def _pass_over(self, counts: list[int], taken: list[int], passed: list[int]) -> None:
        """A step never takes a source's examples across the end of its epoch: the few left that its count does
        not fit are passed over (``passed`` grows), so no step holds one example twice."""
        for j, (c, n) in enumerate(zip(counts, self.sizes or (), strict=False)):
            at = (taken[j] + passed[j]) % n
            if at + c > n:
                passed[j] += n - at

    def _state_at(self, step: int) -> tuple[list[int], ...]:
        """``(examples taken, carried share, examples passed over)`` of each source before ``step``."""
        check_int("step", step, 0)
        k = min(step // _CACHE_EVERY, len(self._cache) - 1)
        first, state = k * _CACHE_EVERY, self._cache[k]
        for mark, kept in self._marks:  # readers ask in order (again for a step a chunk ended in): continue from there
            if first <= mark <= step:
                first, state = mark, kept
        taken, carried, passed = (list(x) for x in state)
        for s in range(first, step):
            self._advance(s, taken, carried, passed)
        self._mark(step, taken, carried, passed)
        return taken, carried, passed

    def _mark(self, step: int, *state: list[int]) -> None:
        """Remember the state before ``step`` (with the one remembered before it)."""
        self._marks = [*self._marks[-1:], (step, tuple(list(x) for x in state))]

    def _advance(self, s: int, taken: list[int], carried: list[int], passed: list[int]) -> tuple[list[int], list[int]]:
        """Step ``s``: ``(counts, first stream positions)`` as :meth:`block`; the state moved past it (in place),
        cached every 1024 steps."""
        counts = self._step(s, carried)
        self._pass_over(counts, taken, passed)
        first = [t + p for t, p in zip(taken, passed, strict=True)]
        for j, c in enumerate(counts):
            taken[j] += c
        if (s + 1) % _CACHE_EVERY == 0 and (s + 1) // _CACHE_EVERY == len(self._cache):
            self._cache.append((list(taken), list(carried), list(passed)))
        return counts, first

    def span(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`block` of each of steps ``first .. first + n - 1`` (``(counts, first positions)``, ``[n, J]``
        arrays), in one walk: a reader's chunk of steps. Steps whose quotas are whole examples (``G * w_j`` an
        integer: nothing is carried) take the same counts every step: their positions are computed at once."""
        taken, carried, passed = self._state_at(first)
        steady = self._steady(first, n, taken, carried, passed)
        if steady is None:
            rows = [self._advance(s, taken, carried, passed) for s in range(first, first + n)]
            steady = np.array([c for c, _ in rows], dtype=np.int64), np.array([f for _, f in rows], dtype=np.int64)
        self._mark(first + n, taken, carried, passed)
        return steady

    def _steady(
        self, first: int, n: int, taken: list[int], carried: list[int], passed: list[int]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`span` in closed form when its steps lie in one stretch of weights whose quotas are whole examples
        and nothing is carried into it (None otherwise); the state is moved past them (in place) and cached."""
        quota = self._segment(first)
        fresh = first in self._fresh or not any(carried)
        inside = all(s <= first or s >= first + n for s in self.starts)
        if self.sizes is None or not (fresh and inside) or any(q % self.d for q in quota):
            return None
        counts = np.array([q // self.d for q in quota], dtype=np.int64)
        t = np.arange(n, dtype=np.int64)
        firsts = np.empty((n, self.n), dtype=np.int64)
        extra = np.zeros((n, self.n), dtype=np.int64)  # examples passed over up to and including each step
        for j, (c, size) in enumerate(zip(counts.tolist(), self.sizes, strict=True)):
            start = taken[j] + passed[j]
            if c:
                at = start % size
                fit, per = (size - at) // c, size // c  # steps left in this epoch; steps in a whole one
                passes = np.where(t < fit, 0, 1 + (t - fit) // per)
                extra[:, j] = np.where(passes == 0, 0, size - at - fit * c + (passes - 1) * (size - per * c))
            firsts[:, j] = start + t * c + extra[:, j]
        carried[:] = [0] * self.n
        for b in range(first // _CACHE_EVERY + 1, (first + n) // _CACHE_EVERY + 1):  # the cached states inside
            if b == len(self._cache):
                k = b * _CACHE_EVERY - first  # steps from first to the cached boundary
                at_b = [x + int(c) * k for x, c in zip(taken, counts, strict=True)]
                self._cache.append(
                    (at_b, [0] * self.n, [p + int(e) for p, e in zip(passed, extra[k - 1], strict=True)])
                )
        for j in range(self.n):
            taken[j] += int(counts[j]) * n
            passed[j] += int(extra[n - 1, j])
        return np.tile(counts, (n, 1)), firsts

    def before(self, step: int) -> list[int]:
        """Examples of each source in steps ``0 .. step-1``."""
        return self._state_at(step)[0]

    def counts(self, step: int) -> list[int]:
        """Examples of each source in step ``step`` (they sum to the global batch)."""
        return self._step(step, self._state_at(step)[1])

    def block(self, step: int) -> tuple[list[int], list[int]]:
        """``(counts, first stream positions)`` of ``step``: source ``j``'s examples in it are its stream positions
        ``[first_j, first_j + counts_j)`` (with ``sizes``: within one epoch of the source)."""
        return self._advance(step, *self._state_at(step))  # on copies of the state: the state stays

    def position(self, step: int) -> list[int]:
        """Each source's stream position before ``step`` (examples taken and passed over)."""
        taken, _, passed = self._state_at(step)
        return [t + p for t, p in zip(taken, passed, strict=True)]

    def weights_at(self, step: int) -> list[Fraction]:
        """The normalised weights in force at ``step``."""
        q = self._segment(step)
        return [Fraction(x, self.g * self.d) for x in q]
