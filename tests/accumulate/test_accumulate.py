"""GradientAccumulator against one big-batch step computed in plain PyTorch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from steadytrain.accumulate import GradientAccumulator, NonFiniteGradientError
from steadytrain.schedule import warmup_schedule


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen), torch.randn(n, 2, generator=gen)


def item_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-item losses (one item = one example)."""
    return (model(x) - y).pow(2).mean(dim=1)


def reference_step(model, x, y, lr=0.1, max_norm=None, weights=None):
    """One plain-PyTorch SGD step on the whole batch: the oracle."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = item_loss(model, x, y)
    loss = losses.mean() if weights is None else (losses * weights).sum()
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()


def assert_same_params(a: nn.Module, b: nn.Module, atol=1e-6):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=0)


def run_accumulated(model, chunks, *, k, use_items, lr=0.1, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    acc = GradientAccumulator(model, opt, accumulation_steps=k, **kwargs)
    for x, y in acc.micro_batches(chunks):
        with acc.micro_batch(num_items=len(x) if use_items else None) as mb:
            mb.backward(item_loss(model, x, y).mean())
    return acc


def split(x, y, sizes):
    out, start = [], 0
    for s in sizes:
        out.append((x[start : start + s], y[start : start + s]))
        start += s
    return out


@pytest.mark.parametrize("use_items", [False, True])
def test_k_equal_micro_batches_equal_one_big_batch(use_items):
    x, y = data(16)
    ref, model = make_model(), make_model()
    reference_step(ref, x, y)
    acc = run_accumulated(model, split(x, y, [4, 4, 4, 4]), k=4, use_items=use_items)
    assert acc.optimizer_steps == 1
    assert_same_params(model, ref)


def test_clip_applies_once_to_the_accumulated_gradient():
    x, y = data(16)
    ref, model = make_model(), make_model()
    reference_step(ref, x, y, max_norm=0.05)
    acc = run_accumulated(model, split(x, y, [4, 4, 4, 4]), k=4, use_items=False, max_grad_norm=0.05)
    assert_same_params(model, ref)
    # The recorded norm is the big-batch gradient's norm.
    probe = make_model()
    item_loss(probe, x, y).mean().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()])
    assert math.isclose(acc.last_grad_norm, float(expected), rel_tol=1e-5)


def test_token_weighted_unequal_micro_batches():
    x, y = data(20)
    ref, model = make_model(), make_model()
    reference_step(ref, x, y)  # the mean over all 20 items
    run_accumulated(model, split(x, y, [3, 10, 1, 6]), k=4, use_items=True)
    assert_same_params(model, ref)


def test_without_items_it_is_the_mean_of_micro_batch_means():
    x, y = data(20)
    sizes = [3, 10, 1, 6]
    weights = torch.cat([torch.full((s,), 1.0 / (len(sizes) * s)) for s in sizes])
    ref_means, ref_items, model = make_model(), make_model(), make_model()
    reference_step(ref_means, x, y, weights=weights)
    reference_step(ref_items, x, y)
    run_accumulated(model, split(x, y, sizes), k=4, use_items=False)
    assert_same_params(model, ref_means)
    with pytest.raises(AssertionError):  # and it really is a different update
        assert_same_params(model, ref_items)


def test_no_parameter_changes_before_the_kth_micro_batch():
    x, y = data(16)
    model = make_model()
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)
    for i, (xb, yb) in enumerate(split(x, y, [4, 4, 4, 4])):
        with acc.micro_batch() as mb:
            mb.backward(item_loss(model, xb, yb).mean())
        if i < 3:
            assert mb.result is None
            assert_same_params(model, before, atol=0)
    assert mb.result is not None and mb.result.stepped
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(), strict=True))


def test_ten_micro_batches_at_k4_three_optimizer_and_scheduler_steps():
    x, y = data(40)
    model = make_model()
    calls = {"opt": 0, "zero": 0}

    class CountingSGD(torch.optim.SGD):
        def step(self, closure=None):
            calls["opt"] += 1
            return super().step(closure)

        def zero_grad(self, set_to_none=True):
            calls["zero"] += 1
            return super().zero_grad(set_to_none)

    opt = CountingSGD(model.parameters(), lr=0.1)
    sched = warmup_schedule(opt, warmup_steps=1, total_steps=3)
    acc = GradientAccumulator(model, opt, accumulation_steps=4, scheduler=sched, max_grad_norm=1.0)
    for xb, yb in acc.micro_batches(split(x, y, [4] * 10)):
        with acc.micro_batch() as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    assert acc.micro_steps == 10 and acc.optimizer_steps == 3
    assert calls == {"opt": 3, "zero": 3}
    assert sched.last_epoch == 3


@pytest.mark.parametrize("use_wrapper", [True, False])
def test_partial_last_cycle_normalized_by_what_it_held(use_wrapper):
    x, y = data(24)
    chunks = split(x, y, [4] * 6)  # K=4: one full cycle, then a partial one of 2
    ref, model = make_model(), make_model()
    xa, ya = torch.cat([c[0] for c in chunks[:4]]), torch.cat([c[1] for c in chunks[:4]])
    reference_step(ref, xa, ya)
    xb, yb = torch.cat([c[0] for c in chunks[4:]]), torch.cat([c[1] for c in chunks[4:]])
    reference_step(ref, xb, yb)  # the partial cycle is the mean over ITS 2 micro-batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)
    for cx, cy in acc.micro_batches(chunks) if use_wrapper else chunks:
        with acc.micro_batch() as mb:
            mb.backward(item_loss(model, cx, cy).mean())
    result = acc.finish()
    assert (result is None) == use_wrapper
    assert acc.optimizer_steps == 2
    assert_same_params(model, ref)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_micro_batch_skips_the_cycle_and_the_next_matches(bad):
    x, y = data(32)
    chunks = split(x, y, [4] * 8)
    poisoned = [(c[0], c[1].clone()) for c in chunks]
    poisoned[2][1][1, 1] = bad  # a bad label: that micro-batch's loss is non-finite
    ref, model = make_model(), make_model()
    # Reference: the first cycle never happened; the second is a normal big-batch step.
    reference_step(ref, torch.cat([c[0] for c in chunks[4:]]), torch.cat([c[1] for c in chunks[4:]]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = warmup_schedule(opt, 0, 10, decay="linear")
    acc = GradientAccumulator(model, opt, accumulation_steps=4, scheduler=sched, max_grad_norm=1e6)
    results = []
    for xb, yb in poisoned:
        with acc.micro_batch(tag={"batch": len(results)}) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
        results.append(mb.result)
    assert acc.skipped_steps == 1 and acc.optimizer_steps == 1
    assert not results[3].stepped and results[7].stepped
    assert sched.last_epoch == 1  # the skipped cycle did not advance the schedule
    assert_same_params(model, ref)  # momentum's first step equals plain SGD
    (event,) = acc.nonfinite_events
    assert event.nonfinite_micro_batches == (2,)
    assert event.micro_steps == (0, 3)
    assert event.tags[2] == {"batch": 2}


def test_raise_policy_names_step_and_norm():
    x, y = data(8)
    x[5, 0] = math.nan
    model = make_model()
    with pytest.raises(NonFiniteGradientError, match=r"nan at optimizer step 0.*\[1\]"):
        run_accumulated(model, split(x, y, [4, 4]), k=2, use_items=False, on_nonfinite="raise")


def test_ignore_policy_steps_anyway():
    x, y = data(8)
    x[5, 0] = math.nan
    model = make_model()
    acc = run_accumulated(model, split(x, y, [4, 4]), k=2, use_items=False, on_nonfinite="ignore")
    assert acc.optimizer_steps == 1
    assert not all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
@pytest.mark.parametrize("use_items", [False, True])
def test_fused_path_matches_unfused(opt_cls, use_items):
    x, y = data(26)
    sizes = [3, 10, 1, 6, 2, 4]
    models = {}
    for fused in (False, True):
        model = make_model()
        kwargs = {"lr": 1e-2, "fused": fused}
        if opt_cls is torch.optim.SGD:
            kwargs["momentum"] = 0.9
        opt = opt_cls(model.parameters(), **kwargs)
        acc = GradientAccumulator(model, opt, accumulation_steps=4, max_grad_norm=0.1)
        assert acc._fused == fused
        for _ in range(3):
            for xb, yb in acc.micro_batches(split(x, y, sizes)):
                with acc.micro_batch(num_items=len(xb) if use_items else None) as mb:
                    mb.backward(item_loss(model, xb, yb).mean())
        models[fused] = model
    for p, q in zip(models[True].parameters(), models[False].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_fused_path_skips_nonfinite_without_touching_state():
    x, y = data(8)
    x[1, 1] = math.inf
    model = make_model()
    before = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    acc = run_accumulated(model, split(x, y, [4, 4]), k=2, use_items=False)
    acc2 = GradientAccumulator(model, opt, accumulation_steps=2)
    assert acc.skipped_steps == 1 and acc2.optimizer_steps == 0
    assert_same_params(model, before, atol=0)
    assert len(opt.state) == 0


def test_fp16_grad_scaler_unscales_before_clipping():
    x, y = data(16)
    ref, model = make_model(), make_model()
    reference_step(ref, x, y, max_norm=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = GradientAccumulator(model, opt, accumulation_steps=4, max_grad_norm=0.05, grad_scaler=scaler)
    for xb, yb in split(x, y, [4] * 4):
        with acc.micro_batch() as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    assert acc.optimizer_steps == 1
    # Had the clip seen scaled gradients (x1024) the update would differ by orders of magnitude.
    assert_same_params(model, ref, atol=1e-6)


def test_fp16_grad_scaler_overflow_skips_and_lowers_scale():
    x, y = data(8)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = GradientAccumulator(model, opt, accumulation_steps=2, grad_scaler=scaler, on_nonfinite="raise")
    x[0, 0] = math.inf
    for xb, yb in split(x, y, [4, 4]):
        with acc.micro_batch() as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    assert acc.skipped_steps == 1
    assert scaler.get_scale() == 2.0**9


def test_bf16_autocast_works():
    x, y = data(16)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4, max_grad_norm=1.0)
    for xb, yb in split(x, y, [4] * 4):
        with acc.micro_batch() as mb:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = item_loss(model, xb, yb).mean()
            mb.backward(loss)
    assert acc.optimizer_steps == 1
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    ref = make_model()
    reference_step(ref, x, y)
    assert_same_params(model, ref, atol=5e-2)  # bf16 resolution


def test_state_dict_round_trip_mid_cycle():
    x, y = data(32)
    chunks = split(x, y, [4] * 8)
    straight = make_model()
    run_accumulated(straight, chunks, k=4, use_items=True)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)
    for xb, yb in chunks[:6]:  # stop mid-cycle: 1 step done, 2 micro-batches pending
        with acc.micro_batch(num_items=len(xb)) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict()})

    resumed = make_model(seed=123)  # a fresh process: different init, no grads
    resumed.load_state_dict(state["model"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1)
    opt2.load_state_dict(state["opt"])
    acc2 = GradientAccumulator(resumed, opt2, accumulation_steps=4)
    acc2.load_state_dict(state["acc"])
    assert acc2.micro_steps == 6 and acc2.optimizer_steps == 1
    for xb, yb in chunks[6:]:
        with acc2.micro_batch(num_items=len(xb)) as mb:
            mb.backward(item_loss(resumed, xb, yb).mean())
    assert acc2.optimizer_steps == 2 and acc2.items_seen == 32
    assert_same_params(resumed, straight, atol=0)


def test_a_state_at_a_step_boundary_resumes_with_another_accumulation():
    """Resume on another world size: a step at K=4 (4 x 4 examples), then one at K=2 (2 x 8), same examples."""
    x, y = data(32)
    straight = make_model()
    run_accumulated(straight, split(x, y, [4] * 8), k=4, use_items=True)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)
    for xb, yb in split(x[:16], y[:16], [4] * 4):
        with acc.micro_batch(num_items=len(xb)) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    acc2 = GradientAccumulator(model, opt, accumulation_steps=2)
    acc2.load_state_dict(copy.deepcopy(acc.state_dict()))
    assert (acc2.optimizer_steps, acc2.micro_steps) == (1, 4)
    for xb, yb in split(x[16:], y[16:], [8] * 2):  # same examples per step: 2 micro-batches of 8
        with acc2.micro_batch(num_items=len(xb)) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    assert acc2.optimizer_steps == 2
    assert_same_params(model, straight, atol=1e-6)


def test_a_state_mid_cycle_refuses_another_accumulation():
    x, y = data(8)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)
    with acc.micro_batch() as mb:
        mb.backward(item_loss(model, x, y).mean())
    with pytest.raises(ValueError, match="cycle in progress"):
        GradientAccumulator(model, opt, accumulation_steps=2).load_state_dict(acc.state_dict())


def test_batchnorm_warns_once():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="BatchNorm"):
        GradientAccumulator(model, opt, accumulation_steps=2)


def test_bad_input():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="accumulation_steps"):
        GradientAccumulator(model, opt, accumulation_steps=0)
    with pytest.raises(ValueError, match="on_nonfinite"):
        GradientAccumulator(model, opt, accumulation_steps=1, on_nonfinite="retry")
    with pytest.raises(ValueError, match="not both"):
        GradientAccumulator(model, opt, accumulation_steps=1, max_grad_norm=1.0, clip_value=1.0)
    acc = GradientAccumulator(model, opt, accumulation_steps=2)
    x, y = data(4)
    with acc.micro_batch() as mb:
        mb.backward(item_loss(model, x, y).mean())
        with pytest.raises(RuntimeError, match="twice"):
            mb.backward(item_loss(model, x, y).mean())
    with pytest.raises(RuntimeError, match="outside"):
        mb.backward(item_loss(model, x, y).mean())
    with pytest.raises(ValueError, match="num_items"), acc.micro_batch(num_items=-3):
        pass
    with pytest.raises(ValueError, match="every micro-batch"), acc.micro_batch(num_items=4):
        pass
    with pytest.raises(RuntimeError, match=r"without mb\.backward"), acc.micro_batch():
        pass
    with pytest.raises(ValueError, match="scalar"), acc.micro_batch() as mb:
        mb.backward(item_loss(model, x, y))


def test_value_clipping_after_normalization():
    x, y = data(16)
    ref, model = make_model(), make_model()
    probe = make_model()
    item_loss(probe, x, y).mean().backward()
    torch.nn.utils.clip_grad_value_(probe.parameters(), 0.01)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), probe.parameters(), strict=True):
            p.sub_(0.1 * q.grad)
    run_accumulated(model, split(x, y, [4] * 4), k=4, use_items=False, clip_value=0.01)
    assert_same_params(model, ref)


def test_num_items_as_tensor_matches_int():
    # Token counts usually come from a mask: a tensor, which must not force a host sync per micro-batch.
    x, y = data(20)
    ref, model = make_model(), make_model()
    reference_step(ref, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=4)
    for xb, yb in split(x, y, [3, 10, 1, 6]):
        with acc.micro_batch(num_items=torch.ones(len(xb), dtype=torch.bool).sum()) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
    assert acc.optimizer_steps == 1 and acc.items_seen == 20
    assert_same_params(model, ref)
