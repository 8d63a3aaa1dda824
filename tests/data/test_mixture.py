"""Mixtures: exact per-step counts, one global order at any world size, per-source epochs, schedules, resume.

Oracles: a seat-by-seat allocation with exact fractions written here (the rule in another form), closed forms
(3:1 of 8 is 6 and 2; equal weights over 3 steps of 8 give 8 each), and the single-rank order the other layouts
must reproduce; example identity is ``(shard, index)`` of rows whose values name them."""

from __future__ import annotations

import collections
import math
import random
from fractions import Fraction as F

import numpy as np
import pyarrow as pa
import pytest

from steadytrain._check import exact_weight
from steadytrain.data import BatchedDataset, DatasetError, DatasetWriter
from steadytrain.data.mixing import MixCounts
from steadytrain.data.mixture import MixedDataset, source_seed
from steadytrain.errors import UserError

SEED = 3


def _write(path, sizes, base, extra=None):
    with DatasetWriter(path, provenance={"pipeline_version": "1"}) as w:
        for s, n in enumerate(sizes):
            cols = {"x": np.arange(n, dtype=np.int64) + base + 1000 * s}
            if extra:
                cols[extra] = np.zeros(n)
            w.write_shard(pa.table(cols))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``big``: 5 shards (60 rows); ``small``: 2 shards of 5 rows (10: it runs out every 5 steps at 2 a step)."""
    root = tmp_path_factory.mktemp("mix")
    return _write(root / "big", [12, 9, 15, 11, 13], 0), _write(root / "small", [5, 5], 100_000)


def mixed(paths, weights, *, W=1, K=1, B=8, rank=0, schedule=(), window=2):
    readers = [
        BatchedDataset(p, batch_size=1, seed=source_seed(SEED, j), shuffle_window=window) for j, p in enumerate(paths)
    ]
    offsets = [0, 5][: len(paths)]
    ws = [F(w) for w in weights]
    return MixedDataset(
        ["big", "small"][: len(paths)], readers, offsets, ws, schedule=schedule, batch_size=B, accumulation_steps=K,
        rank=rank, world_size=W, seed=SEED,
    )  # fmt: skip


def flat(lists):
    return [e for part in lists for e in part]


def triples(mb):
    return list(zip(mb["source"].tolist(), mb["shard"].tolist(), mb["x"].tolist(), strict=True))


def steps(ds, n_steps):
    """The examples ``(source, shard, x)`` of each step this rank reads, in order, over ``n_steps`` steps."""
    k, out = ds.layout.accumulation_steps, collections.defaultdict(list)
    epoch = ds.epoch
    while sum(1 for _ in out) < n_steps:
        for m, mb in ds.iter_numbered():
            step = epoch * ds.steps_per_epoch + m // k
            if step >= n_steps:
                return out
            out[step] += triples(mb)
        epoch += 1
        ds.set_epoch(epoch)
    return out


def greedy_counts(weights, g, n_steps, seed):
    """The rule seat by seat with exact fractions: each of a step's ``g`` examples to the source with the largest
    quota left (ties: the source order rotated by ``seed + step``), quotas carried over from step to step."""
    n, total = len(weights), sum(weights)
    carried, out = [F(0)] * n, []
    for s in range(n_steps):
        left = [F(g) * w / total + c for w, c in zip(weights, carried, strict=True)]
        counts = [0] * n
        for _ in range(g):
            j = max(range(n), key=lambda j: (left[j], -((j - seed - s) % n)))
            counts[j] += 1
            left[j] -= 1
        carried = left
        out.append(counts)
    return out


def test_counts_closed_forms():
    assert [MixCounts([F(3), F(1)], global_batch_size=8).counts(s) for s in range(5)] == [[6, 2]] * 5
    mc = MixCounts([F(1)] * 3, global_batch_size=8, seed=5)
    for s in range(0, 30, 3):
        assert [sum(c) for c in zip(*(mc.counts(s + i) for i in range(3)), strict=True)] == [8, 8, 8]
    assert MixCounts([F(1), F(1)], global_batch_size=7).before(1000) == [3500, 3500]


@pytest.mark.parametrize("trial", range(12))
def test_counts_equal_the_seat_by_seat_rule(trial):
    rng = random.Random(trial)
    n, g = rng.randint(2, 5), rng.randint(1, 40)
    weights = [exact_weight("w", rng.choice([1, 2, 3, 0.5, 0.25, 7, 100, 0.001])) for _ in range(n)]
    mc = MixCounts(weights, global_batch_size=g, seed=trial)
    expected = greedy_counts(weights, g, 200, trial)
    assert [mc.counts(s) for s in range(200)] == expected
    total = [0] * n
    for s in range(200):
        total = [a + b for a, b in zip(total, expected[s], strict=True)]
        ideal = [F(g * (s + 1)) * w / sum(weights) for w in weights]
        bound = 1 if all(F(g) * w / sum(weights) >= 1 for w in weights) else 2
        assert all(abs(t - i) < bound for t, i in zip(total, ideal, strict=True)), (s, total, ideal)
    assert mc.before(200) == total and mc.before(37) == [sum(c) for c in zip(*expected[:37], strict=True)]


def test_schedule_takes_effect_at_its_step_and_carries_on():
    mc = MixCounts([F(3), F(1)], global_batch_size=8, schedule=[(4, [F(1), F(1)]), (6, [F(0), F(1)])])
    assert [mc.counts(s) for s in range(8)] == [[6, 2]] * 4 + [[4, 4]] * 2 + [[0, 8]] * 2
    assert mc.before(8) == [32, 32]
    with pytest.raises(UserError, match="must increase"):
        MixCounts([F(1), F(1)], global_batch_size=8, schedule=[(4, [F(1), F(1)]), (4, [F(1), F(2)])])
    with pytest.raises(UserError, match="one of them > 0"):
        MixCounts([F(1), F(1)], global_batch_size=8, schedule=[(4, [F(0), F(0)])])


def test_3_to_1_every_step_holds_6_and_2(sources):
    per_step = steps(mixed(sources, [3, 1]), 20)
    for s in range(20):
        assert collections.Counter(src for src, _, _ in per_step[s]) == {0: 6, 1: 2}, s
        # the examples say where they are from: big's values < 100000 (shards 0-4), small's >= (shards 5, 6)
        assert all((x >= 100_000) == (src == 1) and (shard >= 5) == (src == 1) for src, shard, x in per_step[s])


@pytest.mark.parametrize(("W", "K", "B"), [(2, 2, 2), (4, 1, 2), (2, 1, 4)])
def test_any_world_size_reads_the_same_steps(sources, W, K, B):
    one = steps(mixed(sources, [3, 1], B=8), 16)
    ranks = [steps(mixed(sources, [3, 1], W=W, K=K, B=B, rank=r), 16) for r in range(W)]
    for s in range(16):
        assert [e for r in ranks for e in r[s]] == one[s], s  # rank 0's micro-batches first, each in order


def test_a_small_source_restarts_its_epoch(sources):
    ds = mixed(sources, [3, 1])
    per_step = steps(ds, 15)
    small = [[x for src, _, x in per_step[s] if src == 1] for s in range(15)]
    rows = sorted(100_000 + 1000 * s + i for s in range(2) for i in range(5))
    epochs = [sorted(flat(small[e * 5 : e * 5 + 5])) for e in range(3)]
    assert epochs == [rows] * 3  # every example once per epoch of its own
    assert flat(small[:5]) != flat(small[5:10])  # a new order each epoch
    assert ds.source_epochs(15) == [1, 3]  # big: 90 examples of 60 (its epoch 1); small: 30 of 10 (its epoch 3)


def test_resume_continues_bit_for_bit_on_any_layout(sources):
    straight = steps(mixed(sources, [3, 1], K=2, B=4), 12)
    first = mixed(sources, [3, 1], K=2, B=4)
    it = iter(first)
    for _ in range(2 * 7 + 1):  # seven steps and a micro-batch into the eighth
        next(it)
    state = first.state_dict()
    again = mixed(sources, [3, 1], K=2, B=4)
    again.load_state_dict(state)
    assert again.micro == 15
    rest = [triples(mb) for mb in again]
    assert again.steps_per_epoch == 10  # 60 examples of big at 6 a step: the epoch ends after step 9 (0-based)
    assert rest[0] == straight[7][4:] and flat(rest[1:]) == straight[8] + straight[9]
    at_boundary = {**state, "micro": 14, "step": 7}
    two = [mixed(sources, [3, 1], W=2, K=1, B=4, rank=r) for r in range(2)]
    for d in two:
        d.load_state_dict(at_boundary)
    mbs = [next(iter(d)) for d in two]
    assert flat(triples(mb) for mb in mbs) == straight[7]


def test_a_resume_may_change_the_schedule_only_ahead(sources):
    ds = mixed(sources, [3, 1], schedule=[(10, [F(1), F(1)])])
    it = iter(ds)
    for _ in range(6):
        next(it)
    state = ds.state_dict()
    later = mixed(sources, [3, 1], schedule=[(6, [F(1), F(3)])])  # from step 7: not trained yet
    later.load_state_dict(state)
    assert later.mix.counts(6) == [2, 6] and later.mix.before(6) == [36, 12]
    with pytest.raises(UserError, match=r"weights of step 5, already trained .*from step 7 on"):
        mixed(sources, [3, 1], schedule=[(4, [F(1), F(1)])]).load_state_dict(state)
    with pytest.raises(UserError, match="already trained"):
        mixed(sources, [1, 1]).load_state_dict(state)


def test_state_of_another_mixture_is_refused(sources):
    state = mixed(sources, [3, 1]).state_dict()
    with pytest.raises(UserError, match="sources"):
        mixed(sources[:1], [1]).load_state_dict(state)
    with pytest.raises(UserError, match="not a mixture's state"):
        mixed(sources, [3, 1]).load_state_dict({**state, "mode": "batched"})
    with pytest.raises(UserError, match="one entry per source"):
        mixed(sources, [3, 1]).load_state_dict({**state, "counts": []})


def test_sources_with_other_columns_are_refused(tmp_path, sources):
    other = _write(tmp_path / "other", [10], 0, extra="label")
    with pytest.raises(DatasetError, match=r"source 'small' .* does not have the columns of source 'big'.*label"):
        mixed([sources[0], other], [1, 1])


def test_a_source_smaller_than_its_share_of_a_step_is_refused(sources):
    with pytest.raises(UserError, match=r"source 'small' has 10 examples but a global batch may take up to 17"):
        mixed(sources, [1, 1], B=32)


def test_micro_batch_shards_names_mixture_ids(sources):
    ds = mixed(sources, [3, 1], K=2, B=4)
    mbs = list(zip(range(6), ds, strict=False))
    for m, mb in mbs:
        assert ds.micro_batch_shards(m) == sorted(set(mb["shard"].tolist()))


def test_micro_batch_shards_over_two_epochs_on_rank_1_of_2(sources):
    ds = mixed(sources, [3, 1], W=2, K=2, B=2, rank=1, window=3)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        for m, mb in ds.iter_numbered():
            assert ds.micro_batch_shards(m) == sorted(set(mb["shard"].tolist())), (epoch, m)


def test_background_workers_hand_over_the_in_process_order(sources):
    from steadytrain.data import MicroBatchLoader

    alone = [triples(mb) for mb in mixed(sources, [3, 1], K=2, B=2)]
    ds = mixed(sources, [3, 1], K=2, B=2)
    assert [triples(mb) for mb in MicroBatchLoader(ds, num_workers=2, prefetch=4)] == alone
    assert ds.micro == len(ds)  # the position advanced as they were handed over


@pytest.mark.parametrize("trial", range(6))
def test_a_span_of_whole_quotas_in_closed_form_equals_the_walk(trial):
    """Weights whose quotas are whole examples (closed form in ``span``) against the step-by-step walk, across
    epoch ends of small sources, a schedule entry, and the cache every 1024 steps."""
    rng = random.Random(trial)
    g = rng.choice([8, 12, 64])
    weights = [F(rng.choice([1, 2, 3])) for _ in range(3)]
    sizes = [rng.randint(g, 5 * g) for _ in range(3)]
    schedule = [(rng.randint(1, 1500), [F(1), F(1), F(2)])]
    fast = MixCounts(weights, global_batch_size=g, seed=trial, schedule=schedule, sizes=sizes)
    slow = MixCounts(weights, global_batch_size=g, seed=trial, schedule=schedule, sizes=sizes)
    first = 0
    for n in [rng.randint(1, 700) for _ in range(6)]:
        counts, firsts = fast.span(first, n)
        blocks = [slow.block(s) for s in range(first, first + n)]
        assert counts.tolist() == [c for c, _ in blocks] and firsts.tolist() == [f for _, f in blocks], (first, n)
        first += n
    assert MixCounts(weights, global_batch_size=g, seed=trial, schedule=schedule, sizes=sizes).position(first) == (
        fast.position(first)
    )
    assert fast._cache == slow._cache[: len(fast._cache)] and len(fast._cache) >= first // 1024


@pytest.mark.parametrize("trial", range(4))
def test_spans_that_start_again_inside_the_last_one_equal_the_walk(trial):
    """Readers whose chunks end inside a step ask for that step again (and a seek goes back): every span, from
    whichever remembered state it continues, equals each step asked of a fresh count (carried shares included)."""
    rng = random.Random(trial)
    weights, g = [F(rng.randint(1, 5)) for _ in range(3)], rng.choice([7, 8, 64])
    sizes = [rng.randint(2 * g, 6 * g) for _ in range(3)]
    counts = MixCounts(weights, global_batch_size=g, seed=trial, sizes=sizes)
    first = 0
    for _ in range(60):
        n = rng.randint(1, 40)
        got = counts.span(first, n)
        fresh = MixCounts(weights, global_batch_size=g, seed=trial, sizes=sizes)
        want = [fresh.block(s) for s in range(first, first + n)]
        assert got[0].tolist() == [c for c, _ in want] and got[1].tolist() == [f for _, f in want], (first, n)
        first = max(0, first + n - rng.choice([0, 1, 1, 2, n, 3 * n]))  # on, one step back, or further back


def test_text_flag_and_null_columns_arrive_with_their_rows(tmp_path):
    """Columns NumPy has no view of (text, booleans, a number with nulls) go through Arrow's gather: every row's
    values still match its (shard, index)."""
    paths = []
    for j, sizes in enumerate(([7, 9], [6])):
        with DatasetWriter(tmp_path / f"s{j}", provenance={"pipeline_version": "1"}) as w:
            for s, n in enumerate(sizes):
                key = [f"{j}/{s}/{i}" for i in range(n)]
                y = pa.array([None if i % 4 == 0 else float(i) for i in range(n)], type=pa.float64())
                w.write_shard(pa.table({"key": key, "flag": [i % 2 == 0 for i in range(n)], "y": y}))
        paths.append(tmp_path / f"s{j}")
    ds = mixed(paths, [2, 1], B=3, window=2)
    seen = 0
    for mb in ds:
        assert list(mb) == ["key", "flag", "y", "shard", "index", "source"]  # the dataset's order, whatever the path
        for src, shard, index, key, flag, y in zip(
            mb["source"].tolist(),
            mb["shard"].tolist(),
            mb["index"].tolist(),
            mb["key"],
            mb["flag"],
            mb["y"],
            strict=True,
        ):
            assert key == f"{src}/{shard - (5 if src else 0)}/{index}" and flag == (index % 2 == 0)
            assert (y != y) if index % 4 == 0 else y == index  # NaN where null
            seen += 1
    assert seen == len(ds) * 3


def single_stream(path, j, epochs, window=2):
    """Source ``j``'s stream as one dataset read alone (``BatchedDataset``, its own seed): ``x`` of each position."""
    ds = BatchedDataset(path, batch_size=1, seed=source_seed(SEED, j), shuffle_window=window)
    out = []
    for e in range(epochs):
        ds.set_epoch(e)
        out += [int(mb["x"][0]) for mb in ds]
    return out


@pytest.mark.parametrize("chunk", ["default", "one micro-batch"])
def test_each_step_takes_the_next_examples_of_each_source_read_alone(sources, monkeypatch, chunk):
    """Step ``s`` holds source ``j``'s stream positions ``[first, first + count)`` (``MixCounts.block``) of the order
    a one-dataset reader gives it; chunks of one micro-batch (every region slides and restarts) read the same."""
    import steadytrain.data.mixture as mixture

    if chunk != "default":
        monkeypatch.setattr(mixture, "_CHUNK_ROWS", 1)
    ds = mixed(sources, [3, 1], K=2, B=4)
    per_step = steps(ds, 30)
    streams = [single_stream(p, j, 8) for j, p in enumerate(sources)]
    for s in range(30):
        counts, firsts = ds.mix.block(s)
        for j in range(2):
            want = streams[j][firsts[j] : firsts[j] + counts[j]]
            assert sorted(x for src, _, x in per_step[s] if src == j) == sorted(want), (s, j)


def test_a_chunk_holds_about_chunk_bytes_of_rows_and_ends_with_a_step(sources, monkeypatch):
    """Rows here are 32 bytes (x, shard, index, source: int64 each): a budget of 16 rows gives chunks of 4
    micro-batches of 4 (two steps of K=2); the first chunk, before a row's size is known, is one step."""
    import steadytrain.data.mixture as mixture

    monkeypatch.setattr(mixture, "_CHUNK_BYTES", 16 * 32)
    ds = mixed(sources, [3, 1], K=2, B=4)
    sizes = []
    plan = ds._chunk
    monkeypatch.setattr(ds, "_chunk", lambda ms: (sizes.append(list(ms)), plan(ms))[1])
    assert sum(1 for _ in ds) == len(ds)
    whole, rest = divmod(len(ds) - 2, 4)
    assert [len(ms) for ms in sizes] == [2] + [4] * whole + ([rest] if rest else [])
    assert all(ms[-1] % 2 == 1 for ms in sizes)  # each ends with a step's last micro-batch


def _random_mixture(tmp_path, rng):
    """A random accepted mixture: two sources of random shards, a window, weights, a layout ``(W, K, B)``."""
    while True:
        root = tmp_path / str(rng.random())
        paths = [
            _write(root / name, [rng.randint(1, 9) for _ in range(rng.randint(1, 6))], base)
            for name, base in (("big", 0), ("small", 100_000))
        ]
        window, layout = rng.randint(1, 3), rng.choice([(1, 1, 3), (2, 2, 1), (2, 1, 2), (4, 1, 1)])
        weights = [F(rng.randint(1, 5)), F(rng.randint(1, 5))]

        def build(batch_size, accumulation_steps=1, rank=0, world_size=1, paths=paths, window=window, w=weights):
            readers = [
                BatchedDataset(p, batch_size=1, seed=source_seed(SEED, j), shuffle_window=window)
                for j, p in enumerate(paths)
            ]
            return MixedDataset(
                ["big", "small"], readers, [0, len(readers[0].shard_ids)], w, seed=SEED, batch_size=batch_size,
                accumulation_steps=accumulation_steps, rank=rank, world_size=world_size,
            )  # fmt: skip

        try:
            build(math.prod(layout))
        except UserError:  # a source smaller than its share of a step: refused (tested above)
            continue
        return paths, window, layout, build


@pytest.mark.parametrize("trial", range(6))
def test_random_mixtures_take_each_source_in_its_own_order(tmp_path, monkeypatch, trial):
    """Random shard sizes, windows, weights (carried shares, examples passed over at epoch ends), layouts and chunk
    budgets: on every rank, step ``s``'s examples of each source are its next ones read alone, and the ranks
    together hold the one-rank step."""
    import steadytrain.data.mixture as mixture

    rng = random.Random(trial)
    paths, window, (W, K, B), build = _random_mixture(tmp_path, rng)
    monkeypatch.setattr(mixture, "_CHUNK_BYTES", 32 * rng.randint(1, 40))
    one, n = build(W * K * B), 25
    ref = steps(one, n)
    ranks = [steps(build(B, K, r, W), n) for r in range(W)]
    streams = [single_stream(p, j, n * W * K * B // one.sizes[j] + 2, window) for j, p in enumerate(paths)]
    for s in range(n):
        assert [e for r in ranks for e in r[s]] == ref[s], s
        counts, firsts = one.mix.block(s)
        for j in range(2):
            want = streams[j][firsts[j] : firsts[j] + counts[j]]
            assert sorted(x for src, _, x in ref[s] if src == j) == sorted(want), (s, j)


def test_a_column_with_nulls_in_one_source_only_keeps_every_value(tmp_path):
    """``y`` is int64 without nulls in source 0 and has nulls in source 1 (read as float64 with NaN): both arrive
    in one column wide enough for both, each row's value exact (2**40 + i is exact in float64)."""
    paths = []
    for j, n in enumerate((23, 11)):
        with DatasetWriter(tmp_path / f"s{j}", provenance={"pipeline_version": "1"}) as w:
            y = pa.array([None if j and i % 3 == 0 else 2**40 + i for i in range(n)], type=pa.int64())
            w.write_shard(pa.table({"y": y}))
        paths.append(tmp_path / f"s{j}")
    seen = 0
    for mb in mixed(paths, [2, 1], B=3, window=1):
        for src, index, y in zip(mb["source"].tolist(), mb["index"].tolist(), mb["y"].tolist(), strict=True):
            assert (y != y) if src and index % 3 == 0 else y == 2**40 + index  # NaN where null
            seen += 1
    assert seen > 20
