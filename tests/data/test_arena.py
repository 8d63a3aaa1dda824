"""``StreamArena``: rows found by stream position, against values computed from the position itself.

Oracle: stream ``j``'s position ``p`` holds the value ``1_000_000 * j + p`` (and its 2-D row ``[p % 60_000, j]``);
blocks are appended as a reader would, in a random read order, and every gather is checked against the closed
form, through growth, compaction, restarts and positions going back."""

from __future__ import annotations

import numpy as np
import pytest

from steadytrain.data.arena import StreamArena


def value(j, p):
    return 1_000_000 * j + np.asarray(p, dtype=np.int64)


class Streams:
    """Three streams of blocks of random sizes, each appended in a random read order (as a window's permutation)."""

    def __init__(self, rng, sizes=(1, 40)):
        self.rng = rng
        self.arena = StreamArena(3)
        self.bounds = [np.cumsum(rng.integers(*sizes, 400)) for _ in range(3)]

    def block_at(self, j, p):
        """``(start, n)`` of stream ``j``'s block holding position ``p``."""
        b = self.bounds[j]
        i = int(np.searchsorted(b, p, side="right"))
        start = int(b[i - 1]) if i else 0
        return start, int(b[i]) - start

    def fill(self, j, lo, hi):
        """What a mixture's reader does: the blocks holding positions ``lo`` to ``hi`` appended."""
        a = self.arena
        if not a.holds(j, lo):
            a.restart(j, self.block_at(j, lo)[0])
        a.keep_from(j, lo)
        while a.stop[j] <= hi:
            start, n = self.block_at(j, int(a.stop[j]))
            order = self.rng.permutation(n)  # the block's k-th position is read as row order[k]
            read = np.empty(n, dtype=np.int64)
            read[order] = value(j, start + np.arange(n))
            cut = int(self.rng.integers(0, n + 1))  # two decoded pieces, as two shards
            pieces = {"v": [(read[:cut], 0), (read[cut:], cut)]}
            rows2 = np.stack([read % 60_000, np.full(n, j)], axis=1).astype(np.uint16)
            pieces["w"] = [(rows2, 0)]
            a.append(j, n, pieces, order)


@pytest.mark.parametrize("trial", range(5))
def test_gathers_match_the_positions_through_growth_compaction_and_restarts(trial):
    rng = np.random.default_rng(trial)
    s = Streams(rng)
    at = [0, 0, 0]
    grew = set()
    for _ in range(120):
        jump = rng.random()
        for j in range(3):
            if jump < 0.05:
                at[j] = int(rng.integers(0, 3000))  # a seek: forward past the region or back before it
            else:
                at[j] += int(rng.integers(0, 60))
        spans = [int(rng.integers(0, 120)) for _ in range(3)]
        for j in range(3):
            s.fill(j, at[j], at[j] + spans[j])
        grew.add(int(s.arena.cap.sum()))
        src = rng.integers(0, 3, 200)
        pos = np.array([at[j] + rng.integers(0, spans[j] + 1) for j in src], dtype=np.int64)
        out = s.arena.gather(src, pos)
        want = 1_000_000 * src + pos
        np.testing.assert_array_equal(out["v"], want)
        np.testing.assert_array_equal(out["w"], np.stack([want % 60_000, src], axis=1).astype(np.uint16))
    assert len(grew) > 2  # the arrays grew several times


def test_a_position_the_region_does_not_hold_is_an_error_not_another_row():
    s = Streams(np.random.default_rng(0))
    s.fill(0, 1000, 1050)
    s.fill(1, 0, 10)
    held = s.arena.gather(np.array([0, 0]), np.array([1000, 1050]))["v"]
    np.testing.assert_array_equal(held, [1000, 1050])
    for past in (int(s.arena.stop[0]), int(s.arena.keep[0]) - 1):  # one after the region, one before it
        with pytest.raises(RuntimeError, match="do not hold"):
            s.arena.gather(np.array([0]), np.array([past]))


def test_a_column_unalike_in_two_blocks_is_widened_to_hold_both():
    a = StreamArena(2)
    a.append(0, 3, {"y": [(np.array([0.5, 1.5, 2.5], dtype=np.float32), 0)]}, None)
    a.append(1, 2, {"y": [(np.array([2**40, 7], dtype=np.int64), 0)]}, None)
    out = a.gather(np.array([1, 0, 1, 0]), np.array([0, 1, 1, 2]))
    assert out["y"].dtype == np.float64  # float32 and int64 together: float64 holds both
    np.testing.assert_array_equal(out["y"], [2.0**40, 1.5, 7.0, 2.5])
    a.append(1, 2, {"y": [(["x", 'a "quoted"\nline'], 0)]}, np.array([1, 0]))
    out = a.gather(np.array([0, 1, 1, 1]), np.array([0, 3, 2, 0]))
    assert out["y"] == [0.5, "x", 'a "quoted"\nline', 2.0**40]  # objects now: a list, each value as it was


def test_rows_of_numbers_become_lists_beside_a_column_of_lists():
    a = StreamArena(1)
    a.append(0, 2, {"t": [(np.array([[1, 2], [3, 4]], dtype=np.int32), 0)]}, None)
    a.append(0, 1, {"t": [([[5, 6, 7]], 0)]}, None)  # a ragged row: lists from here on
    assert a.gather(np.array([0, 0, 0]), np.array([2, 0, 1]))["t"] == [[5, 6, 7], [1, 2], [3, 4]]
