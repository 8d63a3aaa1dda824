"""GradientAccumulator on real ranks (gloo, CPU): DDP and FSDP2 against a single-process reference.

Every worker of the module runs in one spawned job (:func:`runs`): one start-up of two ranks, not one per test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from tests.dist_utils import load_all, save, spawn_all

pytestmark = pytest.mark.distributed

# Items per micro-batch: [cycle][rank][micro] — unequal across ranks and across micro-batches.
SIZES = [[[3, 5, 1], [6, 2, 4]], [[2, 2, 7], [1, 9, 3]]]
K, LR = 3, 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def all_data() -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(sum(sum(r) for r in c) for c in SIZES)
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=gen), torch.randn(n, 2, generator=gen)


def chunks(cycle: int, rank: int, poison: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one cycle (global data laid out cycle, rank, micro)."""
    x, y = all_data()
    start = 0
    for c in range(len(SIZES)):
        for r in range(len(SIZES[c])):
            for m, size in enumerate(SIZES[c][r]):
                if (c, r) == (cycle, rank):
                    xb, yb = x[start : start + size].clone(), y[start : start + size].clone()
                    if poison and m == 1:
                        yb[0, 0] = math.nan
                    yield xb, yb
                start += size


def item_loss(model, x, y):
    return (model(x) - y).pow(2).mean(dim=1)


def reference(use_items: bool, world_size: int = 2, cycles: tuple[int, ...] = (0, 1)) -> list[torch.Tensor]:
    """One process, one plain SGD step per cycle (of ``cycles``) over every item of every rank."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for c in cycles:
        total = 0.0
        for r in range(world_size):
            for (x, y), size in zip(chunks(c, r), SIZES[c][r], strict=True):
                losses = item_loss(model, x, y)
                # Item mode: global mean over all items; else the mean of micro-batch means.
                weight = 1.0 / sum(sum(s) for s in SIZES[c]) if use_items else 1.0 / (world_size * K * size)
                total = total + losses.sum() * weight
        total.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


CURRENT = {"micro": -1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each test's workers, run one after another on the same two ranks; name -> its output folder."""
    jobs = {f"ddp-{u}": (ddp_worker, u, -1) for u in (True, False)}
    jobs["ddp-nan"] = (ddp_worker, True, 1)
    # rank 1's micro-batch 1 of cycle 0: a NaN loss whose gradients are finite (a detached NaN term)
    jobs |= {f"ddp-nanloss-{u}": (ddp_worker, u, -1, 1) for u in (True, False)}
    jobs["fsdp-nanloss"] = (fsdp_worker, False, 1)
    jobs |= {f"partial-{w}": (ddp_partial_worker, w) for w in (True, False)}
    jobs |= {f"fsdp-{p}": (fsdp_worker, p) for p in (False, True)}
    return spawn_all(tmp_path_factory.mktemp("accumulate-ranks"), jobs)


def counting_hook(state, bucket):
    state.append(CURRENT["micro"])
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def nan_term(rank: int, cycle: int, micro: int, nan_loss_rank: int) -> float:
    """A detached term added to one micro-batch's loss: NaN on ``nan_loss_rank``'s micro-batch 1 of cycle 0."""
    return math.nan if (rank, cycle, micro) == (nan_loss_rank, 0, 1) else 0.0


def ddp_worker(rank, world_size, out, use_items, poison_rank, nan_loss_rank=-1):
    model = nn.parallel.DistributedDataParallel(make_model())
    calls: list[int] = []
    model.register_comm_hook(calls, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = GradientAccumulator(model, opt, accumulation_steps=K, max_grad_norm=1e6)
    micro = 0
    for c in range(len(SIZES)):
        for m, (xb, yb) in enumerate(chunks(c, rank, poison=(rank == poison_rank and c == 0))):
            CURRENT["micro"] = micro
            with acc.micro_batch(num_items=len(xb) if use_items else None, tag=(c, rank)) as mb:
                mb.backward(item_loss(model, xb, yb).mean() + nan_term(rank, c, m, nan_loss_rank))
            micro += 1
    save(
        out,
        rank,
        {
            "params": [p.detach().clone() for p in model.module.parameters()],
            "calls": calls,
            "optimizer_steps": acc.optimizer_steps,
            "skipped": acc.skipped_steps,
            "items_seen": acc.items_seen,
            "events": acc.nonfinite_events,
        },
    )


@pytest.mark.parametrize("use_items", [True, False])
def test_ddp_equals_single_process_global_mean(runs, use_items):
    ref = reference(use_items)
    for r in load_all(runs[f"ddp-{use_items}"], 2):
        for got, want in zip(r["params"], ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert r["optimizer_steps"] == 2 and r["skipped"] == 0
        # Gradient all-reduce only ever ran during the last micro-batch of a cycle (2, 5).
        assert r["calls"] and set(r["calls"]) == {K - 1, 2 * K - 1}
        if use_items:
            assert r["items_seen"] == sum(sum(sum(s) for s in c) for c in SIZES)


def test_ddp_nan_on_one_rank_both_skip(runs):
    results = load_all(runs["ddp-nan"], 2)
    for r in results:
        assert r["skipped"] == 1 and r["optimizer_steps"] == 1
        assert all(torch.isfinite(p).all() for p in r["params"])
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    # Only rank 1 saw a non-finite local loss, in its micro-batch 1.
    assert results[1]["events"][0].nonfinite_micro_batches == (1,)
    assert results[0]["events"][0].nonfinite_micro_batches == ()
    assert results[1]["events"][0].tags[1] == (0, 1)


def ddp_partial_worker(rank, world_size, out, use_wrapper):
    model = nn.parallel.DistributedDataParallel(make_model())
    calls: list[int] = []
    model.register_comm_hook(calls, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)  # 3 micro-batches: a partial cycle
    data = list(chunks(0, rank))
    for i, (xb, yb) in enumerate(acc.micro_batches(data) if use_wrapper else data):
        CURRENT["micro"] = i
        with acc.micro_batch(num_items=len(xb)) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    acc.finish()
    save(out, rank, {"params": [p.detach().clone() for p in model.module.parameters()], "calls": calls})


@pytest.mark.parametrize("use_wrapper", [True, False])
def test_ddp_partial_cycle_synchronized(runs, use_wrapper):
    model = make_model()
    losses = [item_loss(model, x, y) for r in range(2) for x, y in chunks(0, r)]
    torch.cat(losses).mean().backward()
    with torch.no_grad():
        ref = [p - LR * p.grad for p in model.parameters()]
    for r in load_all(runs[f"partial-{use_wrapper}"], 2):
        for got, want in zip(r["params"], ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        # With the wrapper the last micro-batch of the data is the one DDP synchronizes.
        assert set(r["calls"]) == ({2} if use_wrapper else set())


def fsdp_worker(rank, world_size, out, partial=False, nan_loss_rank=-1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reduce_calls: list[int] = []
    # FSDP2 reduce-scatters gradients through one of these (the name depends on the torch release).
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(name):
        def reduce_scatter(*args, **kwargs):
            reduce_calls.append(CURRENT["micro"])
            return originals[name](*args, **kwargs)

        return reduce_scatter

    for n in names:
        setattr(dist, n, counting(n))
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = GradientAccumulator(model, opt, accumulation_steps=K + 1 if partial else K, max_grad_norm=1e6)
    micro = 0
    for c in range(len(SIZES)):
        # partial: K+1 per cycle, so each cycle of K micro-batches is a partial one ended by the data.
        data = list(chunks(c, rank))
        for m, (xb, yb) in enumerate(acc.micro_batches(data) if partial else data):
            CURRENT["micro"] = micro
            with acc.micro_batch(num_items=len(xb)) as mb:
                mb.backward(item_loss(model, xb, yb).mean() + nan_term(rank, c, m, nan_loss_rank))
            micro += 1
    for n, fn in originals.items():
        setattr(dist, n, fn)
    save(
        out,
        rank,
        {
            "params": [p.full_tensor() for p in model.parameters()],
            "calls": reduce_calls,
            "steps": acc.optimizer_steps,
            "events": acc.nonfinite_events,
        },
    )


@pytest.mark.parametrize("partial", [False, True])
def test_fsdp2_equals_single_process_global_mean(runs, partial):
    ref = reference(use_items=True)
    for r in load_all(runs[f"fsdp-{partial}"], 2):
        assert r["steps"] == 2
        for got, want in zip(r["params"], ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        # Gradients were reduce-scattered only in the last micro-batch of each cycle.
        assert set(r["calls"]) == {K - 1, 2 * K - 1}


@pytest.mark.parametrize("job", ["ddp-nanloss-True", "ddp-nanloss-False", "fsdp-nanloss"])
def test_a_nan_loss_with_finite_gradients_on_one_rank_is_refused_on_both(runs, job):
    """Rank 1's loss is NaN in cycle 0 while every gradient is finite: both ranks refuse that step (no update), so
    the parameters are those of the reference that only ever stepped on cycle 1."""
    use_items = job != "ddp-nanloss-False"
    ref = reference(use_items, cycles=(1,))
    results = load_all(runs[job], 2)
    for r in results:
        assert r.get("skipped", 1) == 1 and r.get("optimizer_steps", r.get("steps")) == 1
        for got, want in zip(r["params"], ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        (event,) = r["events"]
        assert event.reason == "nonfinite_loss" and math.isfinite(event.grad_norm) and event.cycle == 0
    assert results[1]["events"][0].nonfinite_micro_batches == (1,)
    assert results[0]["events"][0].nonfinite_micro_batches == ()
