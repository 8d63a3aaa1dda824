"""A non-finite loss whose gradients are finite is a refused step, like a non-finite gradient norm.

``F.cross_entropy`` over a micro-batch whose targets are all ``ignore_index`` is NaN (0/0) with zero gradients;
a detached NaN or inf term in a loss does the same. The oracle is a plain-PyTorch loop that never saw the bad cycle.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steadytrain.accumulate import GradientAccumulator, NonFiniteGradientError
from steadytrain.schedule import warmup_schedule

K, IGNORE = 3, -100


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def micro_batches(cycles: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(cycles * K)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cause: str | None) -> torch.Tensor:
    """The micro-batch's mean loss, made non-finite by ``cause`` with finite gradients."""
    if cause == "ignore_index":
        y = torch.full_like(y, IGNORE)  # every target masked: the mean over 0 targets
    loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
    if cause in ("nan_term", "inf_term"):
        loss = loss + torch.tensor(math.nan if cause == "nan_term" else math.inf)  # carries no gradient
    return loss


def reference(batches, skip_cycle: int) -> nn.Module:
    """A hand-written loop (SGD, mean of K micro-batch means) that never ran cycle ``skip_cycle``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for c in range(len(batches) // K):
        if c == skip_cycle:
            continue
        for x, y in batches[c * K : (c + 1) * K]:
            (F.cross_entropy(model(x), y) / K).backward()
        opt.step()
        opt.zero_grad()
    return model


def run(batches, *, bad: tuple[int, int], cause: str, use_items: bool = False, **kw):
    """Train on ``batches`` through the accumulator; micro-batch ``bad = (cycle, position)`` gets ``cause``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = warmup_schedule(opt, 0, 10, decay="constant")
    acc = GradientAccumulator(model, opt, accumulation_steps=K, scheduler=sched, **kw)
    for i, (x, y) in enumerate(batches):
        with acc.micro_batch(num_items=len(x) if use_items else None, tag=i) as mb:
            mb.backward(loss_of(model, x, y, cause if divmod(i, K) == bad else None))
    return model, acc, sched


@pytest.mark.parametrize("use_items", [False, True])
@pytest.mark.parametrize("cause", ["ignore_index", "nan_term", "inf_term"])
def test_the_cycle_is_refused_and_the_run_equals_one_without_it(cause, use_items):
    batches = micro_batches(3)
    model, acc, sched = run(batches, bad=(1, 2), cause=cause, use_items=use_items, max_grad_norm=1e6)
    assert (acc.optimizer_steps, acc.skipped_steps) == (2, 1)
    assert sched.last_epoch == 2  # the refused step did not advance the schedule
    for p, q in zip(model.parameters(), reference(batches, skip_cycle=1).parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    (event,) = acc.nonfinite_events
    assert event.reason == "nonfinite_loss" and event.action == "skip"
    assert math.isfinite(event.grad_norm)  # the gradients were finite: only the loss says the batch is broken
    assert event.cycle == 1 and event.nonfinite_micro_batches == (2,) and event.tags == (3, 4, 5)
    assert "non-finite loss" in event.message()


@pytest.mark.parametrize("kw", [{}, {"clip_value": 0.5}])
def test_refused_without_global_norm_clipping_too(kw):
    batches = micro_batches(2)
    _, acc, _ = run(batches, bad=(0, 0), cause="ignore_index", **kw)
    assert (acc.optimizer_steps, acc.skipped_steps) == (1, 1)
    assert acc.nonfinite_events[0].reason == "nonfinite_loss"


def test_raise_policy_raises_and_names_the_loss():
    with pytest.raises(NonFiniteGradientError, match=r"non-finite loss.*optimizer step 0"):
        run(micro_batches(1), bad=(0, 1), cause="ignore_index", on_nonfinite="raise")


def test_ignore_policy_steps_on_the_finite_gradients():
    batches = micro_batches(2)
    model, acc, _ = run(batches, bad=(0, 1), cause="nan_term", on_nonfinite="ignore")
    assert (acc.optimizer_steps, acc.skipped_steps) == (2, 0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nan_loss_with_a_nan_norm_keeps_the_gradient_reason():
    """Both non-finite: the classic reason (the ledger and triage read it as before)."""
    batches = micro_batches(1)
    batches[1] = (batches[1][0].clone(), batches[1][1])
    batches[1][0][0, 0] = math.nan
    _, acc, _ = run(batches, bad=(9, 9), cause="", max_grad_norm=1.0)
    assert acc.nonfinite_events[0].reason == "nonfinite_grad_norm"


def test_the_refused_step_costs_no_second_host_read(monkeypatch):
    """The loss is read with the norm: one ``tolist`` per step, as before the check existed."""
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or original(t))
    run(micro_batches(2), bad=(0, 0), cause="ignore_index", max_grad_norm=1.0)
    # step 0: the norm and the K losses in one read; the refused step's positions (its record); step 1 as step 0
    assert reads == [1 + K, 1, 1 + K]
