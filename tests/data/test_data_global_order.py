"""Batched mode: one global order for any world size, equal steps on every rank, exact resume across W.

The oracle is the layout's own definition checked across configurations: with G fixed, the multiset
of (shard, index) of every optimizer step must not depend on (W, K, B); and a single-process
``global_batch`` must equal the union of the ranks' micro-batches."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DataLoader

from steadytrain.data import DatasetWriter, FieldSpec, Schema, ShardedDataset, global_batch
from steadytrain.errors import UserError
from tests.dist_utils import load_all, save, spawn

SEED = 7
CONFIGS = [(1, 6, 2), (2, 3, 2), (3, 2, 2), (4, 3, 1)]  # (W, K, B) with G = 12


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """9 shards of unequal sizes (3..17 rows), a float, an int and a string column."""
    path = tmp_path_factory.mktemp("uneven")
    rng = np.random.default_rng(0)
    with DatasetWriter(path, provenance={"pipeline_version": "1"}) as w:
        for s in range(9):
            n = int(rng.integers(3, 18))
            w.write_shard(
                pa.table({"x": np.arange(n) + 100.0 * s, "y": np.arange(n) % 3, "t": [f"{s}/{i}" for i in range(n)]})
            )
    return path


def rank_micro_batches(path, *, W, K, B, rank, epoch=0, **kw):
    ds = ShardedDataset(path, rank=rank, world_size=W, batch_size=B, accumulation_steps=K, seed=SEED, **kw)
    ds.set_epoch(epoch)
    return ds, list(ds)


def pairs(mb) -> list[tuple[int, int]]:
    return list(zip(mb["shard"].tolist(), mb["index"].tolist(), strict=True))


def steps_of(path, *, W, K, B, epoch=0, **kw) -> tuple[dict[int, list], list[int], ShardedDataset]:
    per_step: dict[int, list] = collections.defaultdict(list)
    counts = []
    for r in range(W):
        ds, mbs = rank_micro_batches(path, W=W, K=K, B=B, rank=r, epoch=epoch, **kw)
        counts.append(len(mbs))
        for i, mb in enumerate(mbs):
            assert len(mb["shard"]) == B
            per_step[i // K] += pairs(mb)
    return {s: sorted(v) for s, v in per_step.items()}, counts, ds


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_step_holds_the_same_examples_for_any_world_size(uneven, shuffle):
    ref, _, ref_ds = steps_of(uneven, W=1, K=12, B=1, shuffle=shuffle)
    total = ref_ds.dataset.num_records
    assert ref_ds.global_batch_size == 12
    assert len(ref) == ref_ds.steps_per_epoch == total // 12
    assert ref_ds.dropped_per_epoch == total % 12
    seen = [p for v in ref.values() for p in v]
    assert len(seen) == len(set(seen)) == total - total % 12  # all but the remainder, once each
    for W, K, B in CONFIGS:
        got, counts, ds = steps_of(uneven, W=W, K=K, B=B, shuffle=shuffle)
        assert got == ref, (W, K, B)
        assert counts == [ds.steps_per_epoch * K] * W  # equal micro-batch counts on every rank


def test_a_new_epoch_reorders_and_the_shuffle_mixes_shards(uneven):
    e0, _, _ = steps_of(uneven, W=2, K=3, B=2, epoch=0)
    e1, _, _ = steps_of(uneven, W=2, K=3, B=2, epoch=1)
    assert e0 != e1
    assert any(len({s for s, _ in v}) > 1 for v in e0.values())  # steps draw from several shards


def test_columns_are_tensors_and_strings_are_lists(uneven):
    _, mbs = rank_micro_batches(uneven, W=1, K=1, B=5, rank=0)
    mb = mbs[0]
    assert mb["x"].dtype == torch.float64 and mb["y"].dtype == torch.int64
    assert mb["shard"].dtype == torch.int64 and mb["index"].dtype == torch.int64
    assert isinstance(mb["t"], list)
    # Every row is the one its (shard, index) names.
    for s, i, x, t in zip(mb["shard"].tolist(), mb["index"].tolist(), mb["x"].tolist(), mb["t"], strict=True):
        assert x == 100.0 * s + i and t == f"{s}/{i}"


@pytest.mark.parametrize("which", [0, 1, -1])
def test_global_batch_is_the_union_of_the_ranks_micro_batches(uneven, which):
    steps, _, _ = steps_of(uneven, W=2, K=3, B=2)
    step = sorted(steps)[which]
    gb = global_batch(uneven, step, global_batch_size=12, seed=SEED)
    assert sorted(pairs(gb)) == steps[step]


def test_global_batch_counts_steps_across_epochs(uneven):
    _, _, ds = steps_of(uneven, W=1, K=1, B=12)
    spe = ds.steps_per_epoch
    e1, _, _ = steps_of(uneven, W=1, K=1, B=12, epoch=1)
    assert sorted(pairs(global_batch(uneven, spe + 2, global_batch_size=12, seed=SEED))) == e1[2]
    assert sorted(pairs(global_batch(uneven, 2, global_batch_size=12, seed=SEED, epoch=1))) == e1[2]


@pytest.mark.parametrize(("new_world", "k", "b"), [(1, 6, 2), (4, 3, 1)])
def test_resume_on_another_world_size_continues_the_same_steps(uneven, new_world, k, b):
    ref, _, _ = steps_of(uneven, W=2, K=3, B=2)
    states = []
    for r in range(2):
        ds = ShardedDataset(uneven, rank=r, world_size=2, batch_size=2, accumulation_steps=3, seed=SEED)
        it = iter(ds)
        for _ in range(3 * 3):  # three optimizer steps
            next(it)
        states.append(ds.state_dict())
    resumed: dict[int, list] = collections.defaultdict(list)
    for r in range(new_world):
        ds = ShardedDataset(uneven, rank=r, world_size=new_world, batch_size=b, accumulation_steps=k, seed=SEED)
        ds.load_state_dict(states[0])
        for i, mb in enumerate(ds):
            resumed[3 + i // k] += pairs(mb)
    assert {s: sorted(v) for s, v in resumed.items()} == {s: v for s, v in ref.items() if s >= 3}


def test_resume_mid_step_same_layout_continues_at_the_next_micro_batch(uneven):
    _, full = rank_micro_batches(uneven, W=2, K=3, B=2, rank=1)
    ds = ShardedDataset(uneven, rank=1, world_size=2, batch_size=2, accumulation_steps=3, seed=SEED)
    it = iter(ds)
    for _ in range(4):
        next(it)
    again = ShardedDataset(uneven, rank=1, world_size=2, batch_size=2, accumulation_steps=3, seed=SEED)
    again.load_state_dict(ds.state_dict())
    assert [pairs(mb) for mb in again] == [pairs(mb) for mb in full[4:]]


def test_resume_refuses_another_global_batch_seed_or_mid_step_relayout(uneven):
    ds = ShardedDataset(uneven, world_size=2, batch_size=2, accumulation_steps=3, seed=SEED)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    with pytest.raises(UserError, match="global_batch_size"):
        ShardedDataset(uneven, world_size=2, batch_size=2, accumulation_steps=2, seed=SEED).load_state_dict(state)
    with pytest.raises(UserError, match="seed"):
        ShardedDataset(uneven, world_size=2, batch_size=2, accumulation_steps=3, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="middle of an optimizer step"):
        ShardedDataset(uneven, world_size=1, batch_size=2, accumulation_steps=6, seed=SEED).load_state_dict(state)


def test_workers_yield_the_same_micro_batches_in_the_same_order(uneven):
    ds = ShardedDataset(uneven, rank=1, world_size=2, batch_size=2, accumulation_steps=3, seed=SEED)
    plain = [pairs(mb) for mb in DataLoader(ds, batch_size=None, num_workers=0)]
    ds.set_epoch(0)  # the position is kept across iterations (for resume): start the epoch again
    workers = [pairs(mb) for mb in DataLoader(ds, batch_size=None, num_workers=2)]
    assert workers == plain and len(plain) == ds.steps_per_epoch * 3


def test_drop_policy_keeps_ranks_equal_and_the_order_global(tmp_path):
    with DatasetWriter(tmp_path) as w:
        for s in range(6):
            x = np.arange(10, dtype=np.float64) + 10 * s
            if s in (1, 4):
                x[[2, 5, 7]] = -1.0  # violates min=0: dropped
            w.write_shard(pa.table({"x": x}))
    schema = Schema({"x": FieldSpec("float64", min=0.0)})
    ref, _, ref_ds = steps_of(tmp_path, W=1, K=4, B=2, schema=schema, policy="drop")
    assert ref_ds.steps_per_epoch == (60 - 6) // 8 and ref_ds.dropped_per_epoch == (60 - 6) % 8
    got, counts, ds = steps_of(tmp_path, W=2, K=2, B=2, schema=schema, policy="drop")
    assert got == ref and counts == [ds.steps_per_epoch * 2] * 2
    bad = {(1, 2), (1, 5), (1, 7), (4, 2), (4, 5), (4, 7)}
    assert not bad & {p for v in got.values() for p in v}


def test_transform_is_applied_and_checked(uneven):
    def double(mb):
        return {**mb, "x2": mb["x"] * 2}

    _, mbs = rank_micro_batches(uneven, W=1, K=1, B=4, rank=0, transform=double)
    torch.testing.assert_close(mbs[0]["x2"], mbs[0]["x"] * 2)
    with pytest.raises(UserError, match="not a dict"):
        rank_micro_batches(uneven, W=1, K=1, B=4, rank=0, transform=lambda mb: [mb])
    with pytest.raises(UserError, match="batch length"):
        rank_micro_batches(uneven, W=1, K=1, B=4, rank=0, transform=lambda mb: {**mb, "x": mb["x"][:2]})


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2, "accumulation_steps": 0}, "accumulation_steps"),
        ({"batch_size": 2, "world_size": 0}, "world_size"),
        ({"batch_size": 10_000}, "larger than"),
        ({"batch_size": 2, "shuffle_window": 0}, "shuffle_window"),
        ({"batch_size": 2, "transform": 3}, "transform"),
    ],
)
def test_bad_arguments_name_the_argument(uneven, kw, word):
    with pytest.raises(UserError, match=word):
        ShardedDataset(uneven, **kw)


def test_per_example_mode_is_unchanged_without_batch_size(uneven):
    ds = ShardedDataset(uneven, shuffle=False)
    first = next(iter(ds))
    assert set(first) == {"x", "y", "t", "shard", "index"} and isinstance(first["x"], float)


# --- 2-rank gloo DDP over shards of unequal sizes: no hang, equal steps ------------------------


def _ddp_worker(rank: int, world: int, out: Path, path: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steadytrain.accumulate import GradientAccumulator

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ds = ShardedDataset(path, rank=rank, world_size=world, batch_size=3, accumulation_steps=2, seed=SEED)
    acc = GradientAccumulator(model, opt, accumulation_steps=2)
    for mb in ds:
        with acc.micro_batch() as m:
            x = mb["x"].float().unsqueeze(1) / 1000
            m.backward((model(x) - x).pow(2).mean())
    save(out, rank, (acc.optimizer_steps, ds.steps_per_epoch))


@pytest.mark.distributed
def test_ddp_over_unequal_shards_finishes_with_equal_steps(uneven, tmp_path):
    spawn(_ddp_worker, 2, tmp_path, str(uneven))
    results = load_all(tmp_path, 2)
    assert results[0] == results[1]
    assert results[0][0] == results[0][1] > 0
