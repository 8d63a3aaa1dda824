"""``GlobalSampler``: one global order for any world size, exact resume, and use as a DataLoader's batch sampler.

The oracle is the order's definition computed here directly with NumPy: epoch ``e`` is
``default_rng([seed, e]).permutation(N)``, step ``s`` is its positions ``[s·G, (s+1)·G)``, split rank-major
then micro-batch by micro-batch into runs of ``B``."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from steadytrain.data import GlobalSampler
from steadytrain.errors import UserError

N, B, SEED = 50, 2, 3
LAYOUTS = [(1, 4), (2, 2), (4, 1)]  # (W, K) with B = 2: G = 8, 6 steps per epoch, 2 examples dropped
G, STEPS = 8, 6


def reference_step(step: int, *, seed: int = SEED, shuffle: bool = True) -> list[int]:
    """The examples of global step ``step`` straight from the order's definition."""
    epoch, s = divmod(step, STEPS)
    order = np.random.default_rng([seed, epoch]).permutation(N) if shuffle else np.arange(N)
    return [int(i) for i in order[s * G : (s + 1) * G]]


def samplers(W: int, K: int, **kw) -> list[GlobalSampler]:
    kw = {"batch_size": B, "accumulation_steps": K, "world_size": W, "seed": SEED} | kw
    return [GlobalSampler(N, rank=r, **kw) for r in range(W)]


def global_steps(ranks: list[GlobalSampler], epochs: int = 1) -> list[list[int]]:
    """Each step's micro-batches over all ranks, concatenated rank-major then by micro-batch."""
    k = ranks[0].layout.accumulation_steps
    per_rank = [[mb for _ in range(epochs) for mb in s] for s in ranks]
    assert len({len(mbs) for mbs in per_rank}) == 1  # every rank the same number of micro-batches
    num_steps = len(per_rank[0]) // k
    return [[i for mbs in per_rank for mb in mbs[step * k : (step + 1) * k] for i in mb] for step in range(num_steps)]


@pytest.mark.parametrize(("W", "K"), LAYOUTS)
def test_every_layout_takes_the_reference_examples_per_step(W, K):
    ranks = samplers(W, K)
    assert all(len(s) == STEPS * K for s in ranks)
    steps = global_steps(ranks)
    assert len(steps) == STEPS
    for s, got in enumerate(steps):
        assert sorted(got) == sorted(reference_step(s))
        assert got == reference_step(s)


def test_an_epoch_covers_distinct_examples_and_drops_the_remainder():
    ranks = samplers(2, 2)
    for epoch in range(2):
        seen = [i for s in global_steps(ranks) for i in s]
        order = np.random.default_rng([SEED, epoch]).permutation(N)
        assert len(seen) == len(set(seen)) == N - N % G
        assert set(seen) == set(range(N)) - {int(i) for i in order[N - N % G :]}


def test_each_epoch_is_reshuffled_and_the_next_iteration_is_the_next_epoch():
    (s,) = samplers(1, 4)
    first, second = [i for mb in s for i in mb], [i for mb in s for i in mb]
    assert s.epoch == 2 and s.global_step == 2 * STEPS
    assert first != second
    assert first == [i for step in range(STEPS) for i in reference_step(step)]
    assert second == [i for step in range(STEPS, 2 * STEPS) for i in reference_step(step)]


def test_without_shuffle_the_order_is_arange():
    steps = global_steps(samplers(2, 2, shuffle=False), epochs=2)
    assert [i for s in steps for i in s] == list(range(STEPS * G)) * 2


def test_resume_mid_step_continues_the_uninterrupted_sequence():
    whole = samplers(2, 2)[1]
    expected = [mb for _ in range(2) for mb in whole]
    s = samplers(2, 2)[1]
    it = iter(s)
    taken = [next(it) for _ in range(5)]
    assert (s.micro, s.step, len(s)) == (5, 2, STEPS * 2 - 5)
    state = json.loads(json.dumps(s.state_dict()))
    resumed = samplers(2, 2)[1]
    resumed.load_state_dict(state)
    assert taken + list(resumed) + list(resumed) == expected


def test_a_step_boundary_state_resumes_on_another_world_size():
    src = samplers(2, 2)
    for s in src:
        it = iter(s)
        for _ in range(3 * 2):  # 3 optimizer steps of K = 2
            next(it)
    state = src[0].state_dict()
    for W, K in [(4, 1), (1, 4)]:
        ranks = samplers(W, K)
        for r in ranks:
            r.load_state_dict(state)
            assert r.global_step == 3
        rest = global_steps(ranks, epochs=2)  # the rest of epoch 0, then epoch 1
        assert rest == [reference_step(step) for step in range(3, 2 * STEPS)]


def test_state_at_equals_the_state_after_that_many_steps():
    for k in [0, 3, STEPS, STEPS + 2]:
        s = GlobalSampler(N, batch_size=B, accumulation_steps=2, world_size=2, seed=SEED)
        it = itertools.chain(s, s)  # the second ``iter(s)`` starts where the first ended: the next epoch
        for _ in range(k * 2):
            next(it)
        assert s.state_dict() == s.state_at(k)
        assert (s.epoch, s.micro) == (k // STEPS, (k % STEPS) * 2)


@pytest.mark.parametrize("step", [0, 4, STEPS + 1])
def test_indices_is_the_union_of_the_ranks_micro_batches(step):
    ranks = samplers(2, 2)
    assert ranks[0].indices(step) == global_steps(ranks, epochs=2)[step] == reference_step(step)


def test_works_as_a_dataloader_batch_sampler():
    ds = TensorDataset(torch.arange(N) * 10)
    s = GlobalSampler(N, batch_size=B, accumulation_steps=2, rank=1, world_size=2, seed=SEED)
    loader = DataLoader(ds, batch_sampler=s)
    assert len(loader) == STEPS * 2
    got = [batch[0].tolist() for _ in range(2) for batch in loader]
    # rank 1 of (W=2, K=2): the second half of every step
    halves = [reference_step(step)[4:] for step in range(2 * STEPS)]
    want = [[10 * i for i in half[2 * m : 2 * m + 2]] for half in halves for m in range(2)]
    assert got == want


def saved(**kw) -> dict:
    s = GlobalSampler(N, batch_size=B, accumulation_steps=2, world_size=2, seed=SEED, **kw)
    it = iter(s)
    next(it)  # micro 1: in the middle of an optimizer step
    return s.state_dict()


@pytest.mark.parametrize(
    ("state", "kw", "name"),
    [
        (saved(), {"seed": SEED + 1}, "seed"),
        (saved(), {"num_examples": N + 1}, "num_examples"),
        (saved(), {"shuffle": False}, "shuffle"),
        (saved(), {"batch_size": 4}, "global_batch_size"),
        (saved(), {"accumulation_steps": 4, "world_size": 1}, "middle of an optimizer step"),
        ({**saved(), "micro": 99}, {}, "micro"),
        ({"epoch": 0}, {}, "missing"),
    ],
)
def test_a_state_of_another_order_or_a_mid_step_layout_change_is_refused(state, kw, name):
    args = {"num_examples": N, "batch_size": B, "accumulation_steps": 2, "world_size": 2, "seed": SEED} | kw
    s = GlobalSampler(args.pop("num_examples"), **args)
    with pytest.raises(UserError, match=name) as err:
        s.load_state_dict(state)
    assert "\n" not in str(err.value)
    assert (s.epoch, s.micro) == (0, 0)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"num_examples": 0}, "num_examples"),
        ({"num_examples": 2.5}, "num_examples"),
        ({"num_examples": 7}, "global batch 8"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"seed": -1}, "seed"),
        ({"shuffle": "yes"}, "shuffle"),
        ({"drop_last": False}, "drop_last"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(kw, name):
    args = {"num_examples": N, "batch_size": B, "accumulation_steps": 2, "world_size": 2} | kw
    with pytest.raises(UserError, match=name) as err:
        GlobalSampler(args.pop("num_examples"), **args)
    assert "\n" not in str(err.value)
