"""Batch plan and schedules against the seed's worked example and closed forms."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from steadytrain.schedule import (
    BatchPlan,
    effective_batch_size,
    lr_multiplier,
    optimizer_steps,
    scale_lr,
    warmup_schedule,
)


def lrs_over(sched: torch.optim.lr_scheduler.LRScheduler, opt: torch.optim.Optimizer, n: int) -> list[float]:
    """LR used at each of ``n`` optimizer steps."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def sgd(lr: float) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


# --- the seed's worked example: 256 @ 1e-3 -> 2048 by accumulating 8 -> 8e-3 ----------------------


def test_seed_example_linear_scaling():
    plan = BatchPlan(micro_batch_size=256, accumulation_steps=8, base_lr=1e-3, base_batch_size=256)
    assert plan.global_batch_size == 2048
    assert plan.scale_factor == 8
    assert math.isclose(plan.lr, 8e-3, rel_tol=1e-12)


def test_seed_example_same_lr_by_larger_physical_batch():
    # The seed: a larger physical batch or 8 accumulated micro-batches give the same effective batch and LR.
    physical = BatchPlan(micro_batch_size=2048, base_lr=1e-3, base_batch_size=256)
    accumulated = BatchPlan(micro_batch_size=256, global_batch_size=2048, base_lr=1e-3, base_batch_size=256)
    assert accumulated.accumulation_steps == 8
    assert physical.global_batch_size == accumulated.global_batch_size == 2048
    assert math.isclose(physical.lr, accumulated.lr, rel_tol=1e-12)


def test_seed_example_warmup_ramps_to_scaled_lr():
    plan = BatchPlan(micro_batch_size=256, accumulation_steps=8, base_lr=1e-3, base_batch_size=256)
    opt = sgd(plan.lr)
    sched = warmup_schedule(opt, warmup_steps=1000, total_steps=5000, decay="constant")
    lrs = lrs_over(sched, opt, 1200)
    # Starts small, rises linearly, reaches 8e-3 at the end of warmup and stays there.
    assert lrs[0] < 8e-3 / 100
    diffs = [b - a for a, b in itertools.pairwise(lrs[:1001])]
    assert all(math.isclose(d, 8e-3 / 1001, rel_tol=1e-6) for d in diffs)
    assert math.isclose(lrs[1000], 8e-3, rel_tol=1e-12)
    assert max(lrs) == pytest.approx(8e-3)
    assert all(math.isclose(x, 8e-3, rel_tol=1e-12) for x in lrs[1000:])


def test_effective_batch_includes_all_three_factors():
    assert effective_batch_size(32, 4, 8) == 1024
    plan = BatchPlan(micro_batch_size=32, accumulation_steps=4, world_size=8)
    assert plan.global_batch_size == 1024


def test_scaling_rules_closed_form():
    assert math.isclose(scale_lr(0.1, 256, 1024, "linear"), 0.4)
    assert math.isclose(scale_lr(0.1, 256, 1024, "sqrt"), 0.2)
    assert scale_lr(0.1, 256, 1024, "none") == 0.1
    assert math.isclose(scale_lr(0.1, 256, 64, "linear"), 0.025)  # scaling down works too


def test_accumulation_derived_from_target_global_batch():
    plan = BatchPlan(micro_batch_size=32, world_size=8, global_batch_size=1024)
    assert plan.accumulation_steps == 4


# --- errors name the numbers and the fix -----------------------------------------------------------


def test_inconsistent_global_batch_names_the_three_factors():
    with pytest.raises(ValueError) as err:
        BatchPlan(micro_batch_size=32, accumulation_steps=4, world_size=8, global_batch_size=1000)
    msg = str(err.value)
    for piece in ("1000", "micro 32", "accum 4", "world 8", "1024", "change one"):
        assert piece in msg


def test_indivisible_target_says_which_values_work():
    with pytest.raises(ValueError) as err:
        BatchPlan(micro_batch_size=32, world_size=8, global_batch_size=1000)
    msg = str(err.value)
    assert "768" in msg and "1024" in msg and "256" in msg


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": 8, "accumulation_steps": 0}, "accumulation_steps"),
        ({"micro_batch_size": 8, "world_size": -1}, "world_size"),
        ({"micro_batch_size": 8, "base_lr": 1e-3, "base_batch_size": 8, "scaling_rule": "cubic"}, "scaling_rule"),
        ({"micro_batch_size": 8, "base_batch_size": 8}, "base_lr"),
        ({"micro_batch_size": 8, "dataset_size": 100, "warmup_steps": 5, "warmup_ratio": 0.1}, "not both"),
        ({"micro_batch_size": 8, "dataset_size": 80, "warmup_steps": 11}, "warmup_steps=11"),
        ({"micro_batch_size": 8, "warmup_ratio": 0.1}, "dataset_size"),
        ({"micro_batch_size": 8, "dataset_size": 80, "warmup_ratio": 1.5}, "warmup_ratio"),
        ({"micro_batch_size": 2.5}, "micro_batch_size"),
    ],
)
def test_bad_input_names_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        BatchPlan(**kwargs)


# --- steps are optimizer steps ---------------------------------------------------------------------


def test_optimizer_steps_is_ceil():
    assert optimizer_steps(10, 4) == 3
    assert optimizer_steps(12, 4) == 3
    assert optimizer_steps(0, 4) == 0
    assert optimizer_steps(7, 1) == 7


def test_plan_steps_counted_in_optimizer_steps():
    # 1000 examples on 2 ranks, micro 16: each rank 500 examples = 32 micro-batches (last has 4).
    plan = BatchPlan(micro_batch_size=16, accumulation_steps=5, world_size=2, dataset_size=1000, epochs=3)
    assert plan.micro_batches_per_epoch == math.ceil(500 / 16) == 32
    assert plan.steps_per_epoch == math.ceil(32 / 5) == 7
    assert plan.total_steps == 21


def test_warmup_ratio_in_optimizer_steps():
    plan = BatchPlan(micro_batch_size=16, accumulation_steps=4, dataset_size=6400, epochs=2, warmup_ratio=0.1)
    assert plan.total_steps == 2 * 6400 // 64 == 200
    assert plan.warmup_steps == 20  # not 80: warmup is not counted in micro-batches


def test_large_scale_up_suggests_sweep():
    plan = BatchPlan(micro_batch_size=256, accumulation_steps=32, base_lr=1e-3, base_batch_size=256)
    assert any("sweep" in n for n in plan.notes)
    sweep = plan.lr_sweep(num=5, factor=2.0)
    assert math.isclose(sweep[2], plan.lr)
    assert all(math.isclose(b / a, 2.0) for a, b in itertools.pairwise(sweep))


def test_plan_is_frozen():
    plan = BatchPlan(micro_batch_size=8)
    with pytest.raises(AttributeError):
        plan.micro_batch_size = 16  # type: ignore[misc]


def test_scheduler_step_count_matches_optimizer_steps():
    # A loop over 37 micro-batches at K=4 steps the scheduler once per optimizer step: 10 times.
    total_micro, k = 37, 4
    steps = optimizer_steps(total_micro, k)
    opt = sgd(1.0)
    sched = warmup_schedule(opt, warmup_steps=2, total_steps=steps, decay="linear")
    for micro in range(total_micro):
        if (micro + 1) % k == 0 or micro + 1 == total_micro:
            opt.step()
            sched.step()
    assert sched.last_epoch == steps == 10
    # The schedule ended where a 10-step schedule ends: at min_lr_ratio (0).
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)


# --- closed-form schedule values -------------------------------------------------------------------


def test_cosine_closed_form():
    w, t, peak = 4, 12, 0.5
    opt = sgd(peak)
    lrs = lrs_over(warmup_schedule(opt, w, t, decay="cosine", min_lr_ratio=0.1), opt, t + 2)
    for s in range(w):
        assert math.isclose(lrs[s], peak * (s + 1) / (w + 1))
    assert math.isclose(lrs[w], peak)  # the peak right at warmup_steps
    assert math.isclose(lrs[8], peak * (0.1 + 0.9 * 0.5))  # half-way through the decay: cos(pi/2) = 0
    assert math.isclose(lrs[6], peak * (0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2))
    assert math.isclose(lrs[12], peak * 0.1) and math.isclose(lrs[13], peak * 0.1)  # holds at the floor


def test_linear_closed_form():
    opt = sgd(1.0)
    lrs = lrs_over(warmup_schedule(opt, 0, 10, decay="linear"), opt, 11)
    assert lrs == pytest.approx([1 - s / 10 for s in range(11)])


def test_multiplier_is_a_pure_function_of_the_step():
    values = [lr_multiplier(s, warmup_steps=3, total_steps=9, decay="cosine") for s in range(12)]
    again = [lr_multiplier(s, warmup_steps=3, total_steps=9, decay="cosine") for s in range(12)]
    assert values == again
    assert max(values) == 1.0 and values.index(1.0) == 3


def test_scheduler_state_dict_round_trip():
    opt = sgd(1.0)
    sched = warmup_schedule(opt, 3, 10)
    lrs_over(sched, opt, 5)
    opt2 = sgd(1.0)
    sched2 = warmup_schedule(opt2, 3, 10)
    sched2.load_state_dict(sched.state_dict())
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert lrs_over(sched2, opt2, 5) == pytest.approx(lrs_over(sched, opt, 5))


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"warmup_steps": -1, "total_steps": 10}, "warmup_steps"),
        ({"warmup_steps": 11, "total_steps": 10}, "exceeds"),
        ({"warmup_steps": 1, "total_steps": 10, "decay": "step"}, "decay"),
        ({"warmup_steps": 1, "total_steps": 10, "min_lr_ratio": 2.0}, "min_lr_ratio"),
    ],
)
def test_schedule_bad_input(kwargs, word):
    with pytest.raises(ValueError, match=word):
        warmup_schedule(sgd(1.0), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"step": -5}, "step=-5"),
        ({"step": -1}, "step=-1"),
        ({"step": True}, "step=True"),
        ({"step": 1.5}, "step=1.5"),
        ({"warmup_steps": -2}, "warmup_steps=-2"),
        ({"total_steps": -1}, "total_steps=-1"),
    ],
)
def test_multiplier_refuses_a_step_that_is_no_step(kwargs, word):
    """lr_multiplier(step=-5) gave (-5 + 1) / (3 + 1) = -1: a negative LR. Every step -> multiplier refuses it."""
    args = {"step": 2, "warmup_steps": 3, "total_steps": 7} | kwargs
    step = args.pop("step")
    with pytest.raises(ValueError, match=re.escape(word)):
        lr_multiplier(step, **args)
    assert lr_multiplier(0, warmup_steps=3, total_steps=7) == 0.25  # step 0: (0 + 1) / (3 + 1), the first step


def test_the_schedulers_multiplier_refuses_a_negative_step():
    sched = warmup_schedule(sgd(1.0), warmup_steps=3, total_steps=7)
    (multiplier,) = sched.lr_lambdas
    assert multiplier(1) == 0.5  # (1 + 1) / (3 + 1)
    with pytest.raises(ValueError, match="step=-1"):
        multiplier(-1)
