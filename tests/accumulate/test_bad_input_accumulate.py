"""GradientAccumulator and clipping on hostile or careless input (issue 8, section 5).

Oracles: a plain big-batch PyTorch step, closed forms, float64 exact means. Every refused step is
checked for what must NOT happen (no update, no poisoned counter) and for what must happen next
(the following valid cycle is a normal big-batch step).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from steadytrain.accumulate import GradientAccumulator, NonFiniteGradientError
from steadytrain.accumulate.events import INVALID_ITEMS, NO_ITEMS, NONFINITE_NORM, NonFiniteEvent
from steadytrain.clip import (
    clip_coefficient,
    clip_grad_global_norm_,
    clip_grad_per_param_norm_,
    clip_grad_value_,
    global_grad_norm,
    scale_grads_,
)
from steadytrain.errors import UserError
from tests.dist_utils import load_all, save, spawn_all


def make_model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def data(n: int, seed: int = 1, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen).to(dtype), torch.randn(n, 2, generator=gen).to(dtype)


def item_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean(dim=1)


def chunks(x, y, sizes):
    out, start = [], 0
    for s in sizes:
        out.append((x[start : start + s], y[start : start + s]))
        start += s
    return out


def big_batch_step(model, x, y, lr=0.1, weights=None):
    """One plain-PyTorch SGD step on the whole batch (the oracle); ``weights`` sum to 1."""
    losses = item_loss(model, x, y)
    loss = losses.mean() if weights is None else (losses * weights).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def assert_same(a: nn.Module, b: nn.Module, atol=1e-6):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=0)


def accumulate(acc, model, batches, counts):
    """Run micro-batches with the given ``num_items`` (any type); returns each micro-batch's result."""
    results = []
    for (xb, yb), n in zip(batches, counts, strict=True):
        with acc.micro_batch(num_items=n) as mb:
            mb.backward(item_loss(model, xb, yb).mean())
        results.append(mb.result)
    return results


# --- item counts on the device: negative, NaN, inf, zero -------------------------------------------


@pytest.mark.parametrize("bad", [-3.0, -1e-3, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("policy", ["skip", "ignore"])
def test_invalid_tensor_item_count_refuses_the_step(bad, policy):
    x, y = data(16)
    batches = chunks(x, y, [4, 4, 4, 4])
    model, ref = make_model(), make_model()
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=1e6, on_nonfinite=policy)
    # Cycle 0: the second micro-batch's count is invalid; its total is positive for -1e-3 and -3 (5 - 3 > 0).
    results = accumulate(acc, model, batches[:2], [torch.tensor(5.0), torch.tensor(bad)])
    assert not results[1].stepped
    assert_same(model, before, atol=0)  # no gradient-ascent (or NaN) update, even under "ignore"
    assert acc.items_seen == 0  # not poisoned
    (event,) = acc.nonfinite_events
    assert event.reason == INVALID_ITEMS and event.action == "skip" and event.micro_steps == (0, 1)
    assert all(p.grad is None for p in model.parameters())  # cleared: the next cycle starts clean
    # Cycle 1 is a normal big-batch step over its 8 items, exactly as if cycle 0 never happened.
    accumulate(acc, model, batches[2:], [torch.tensor(4), torch.tensor(4)])
    big_batch_step(ref, torch.cat([b[0] for b in batches[2:]]), torch.cat([b[1] for b in batches[2:]]))
    assert_same(model, ref)
    assert acc.items_seen == 8 and acc.optimizer_steps == 1 and acc.skipped_steps == 1


def test_negative_count_hidden_by_a_positive_total_is_still_refused():
    # -3 + 10 = 7 > 0: a check of the total alone would miss the ascent step on micro-batch 0.
    x, y = data(8)
    model = make_model()
    before = copy.deepcopy(model)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    results = accumulate(acc, model, chunks(x, y, [4, 4]), [torch.tensor(-3), torch.tensor(10)])
    assert not results[-1].stepped and results[-1].num_items == 7
    assert acc.nonfinite_events[0].reason == INVALID_ITEMS
    assert_same(model, before, atol=0)


def test_invalid_count_under_raise_names_the_reason():
    x, y = data(8)
    model = make_model()
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, on_nonfinite="raise"
    )
    with pytest.raises(NonFiniteGradientError, match=r"num_items.*optimizer step 0"):
        accumulate(acc, model, chunks(x, y, [4, 4]), [torch.tensor(4.0), torch.tensor(math.nan)])
    assert acc.nonfinite_events[0].action == "raise"


@pytest.mark.parametrize("as_tensor", [True, False])
def test_zero_item_cycle_does_not_step(as_tensor):
    x, y = data(8)
    model = make_model()
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)  # would move even at g=0
    acc = GradientAccumulator(model, opt, accumulation_steps=2)
    zero = torch.tensor(0) if as_tensor else 0
    results = accumulate(acc, model, chunks(x, y, [4, 4]), [zero, zero])
    assert not results[-1].stepped and acc.optimizer_steps == 0 and acc.skipped_steps == 1
    assert acc.nonfinite_events[0].reason == NO_ITEMS and acc.items_seen == 0
    assert_same(model, before, atol=0)
    assert len(opt.state) == 0


def test_fractional_weights_below_one_give_the_exact_weighted_mean():
    # Item counts may be weights; a total below 1 must not be rounded up to 1.
    x, y = data(8)
    model, ref = make_model(), make_model()
    w = [0.1, 0.3]
    weights = torch.cat([torch.full((4,), w[0] / 4), torch.full((4,), w[1] / 4)]) / sum(w)
    big_batch_step(ref, x, y, weights=weights)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    accumulate(acc, model, chunks(x, y, [4, 4]), w)
    assert_same(model, ref)
    assert math.isclose(acc.items_seen, 0.4)


@pytest.mark.parametrize(
    ("value", "word"),
    [(-1, ">= 0"), (math.nan, "finite"), (math.inf, "finite"), (True, "bool"), ("4", "number"), (10**400, "finite")],
)
def test_bad_python_item_count_is_refused_at_once(value, word):
    model = make_model()
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(UserError, match=f"num_items.*{word}"), acc.micro_batch(num_items=value):
        pytest.fail("the block must not run")
    assert acc.micro_steps == 0 and acc._cycle.micro == 0


@pytest.mark.parametrize(
    ("value", "word"), [(torch.tensor([3, 4]), "shape"), (torch.tensor(True), "dtype"), (torch.tensor(1j), "dtype")]
)
def test_bad_tensor_item_count_shape_or_dtype_is_refused_at_once(value, word):
    model = make_model()
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(UserError, match=word), acc.micro_batch(num_items=value):
        pass


class CountHostSyncs(TorchFunctionMode):
    """Counts the tensor -> Python conversions that block on the device."""

    SYNCS = frozenset({"tolist", "item", "__float__", "__int__", "__bool__", "nonzero", "__index__"})

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bad", [False, True])
def test_item_checks_add_no_host_sync(bad):
    # One host read per optimizer step (norm and item counts together), none per micro-batch, also
    # when the counts are invalid (the refusal itself reads the bad losses: that is the rare path).
    x, y = data(12)
    model = make_model()
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    counts = [torch.tensor(4), torch.tensor(-4 if bad else 4), torch.tensor(4)]
    syncs_per_micro = []
    for (xb, yb), n in zip(chunks(x, y, [4, 4, 4]), counts, strict=True):
        loss = item_loss(model, xb, yb).mean()
        with CountHostSyncs() as mode, acc.micro_batch(num_items=n) as mb:
            mb.backward(loss)
        syncs_per_micro.append(mode.calls)
    assert syncs_per_micro[0] == [] and syncs_per_micro[1] == []
    expected = ["tolist", "nonzero", "tolist"] if bad else ["tolist"]
    assert syncs_per_micro[2] == expected
    assert acc.skipped_steps == int(bad)


# --- arguments checked at construction, not after K backward passes ---------------------------------


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"eps": math.nan}, "eps"),
        ({"eps": -1e-6}, "eps"),
        ({"eps": math.inf}, "eps"),
        ({"eps": "small"}, "eps"),
        ({"norm_type": 0.0}, "norm_type"),
        ({"norm_type": -2.0}, "norm_type"),
        ({"norm_type": math.nan}, "norm_type"),
        ({"norm_type": True}, "norm_type"),
        ({"norm_type": "l2"}, "norm_type"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": math.nan}, "max_grad_norm"),
        ({"max_grad_norm": math.inf}, "max_grad_norm"),
        ({"clip_value": 0.0}, "clip_value"),
        ({"clip_value": math.nan}, "clip_value"),
        ({"clip_value": -math.inf}, "clip_value"),
        ({"on_nonfinite": "retry"}, "on_nonfinite"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"accumulation_steps": 2.0}, "accumulation_steps"),
    ],
)
def test_bad_constructor_argument_is_a_user_error_naming_it(kwargs, word):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError, match=word):
        GradientAccumulator(model, opt, **{"accumulation_steps": 2, **kwargs})


def test_eps_zero_is_allowed_and_safe_on_zero_gradients():
    model = nn.Linear(3, 1)
    before = copy.deepcopy(model)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=1, max_grad_norm=1.0, eps=0.0
    )
    with acc.micro_batch() as mb:
        mb.backward(model(torch.zeros(2, 3)).sum() * 0.0)  # an all-zero gradient: max_norm / 0 = inf -> 1
    assert mb.result.stepped and mb.result.grad_norm == 0.0
    assert_same(model, before, atol=0)


@pytest.mark.parametrize(
    ("fn", "kwargs", "word"),
    [
        (clip_grad_global_norm_, {"max_norm": 1.0, "eps": math.nan}, "eps"),
        (clip_grad_global_norm_, {"max_norm": 1.0, "eps": -1.0}, "eps"),
        (clip_grad_global_norm_, {"max_norm": math.nan}, "max_norm"),
        (clip_grad_global_norm_, {"max_norm": 0.0, "eps": 0.0}, "eps > 0"),
        (clip_grad_global_norm_, {"max_norm": 1.0, "norm_type": math.nan}, "norm_type"),
        (clip_grad_per_param_norm_, {"max_norm": 1.0, "eps": math.nan}, "eps"),
        (clip_grad_per_param_norm_, {"max_norm": math.inf}, "max_norm"),
        (clip_grad_value_, {"clip_value": math.nan}, "clip_value"),
        (global_grad_norm, {"norm_type": -math.inf}, "norm_type"),
    ],
)
def test_clip_functions_refuse_nan_and_negative_arguments(fn, kwargs, word):
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    with pytest.raises(UserError, match=word):
        fn([p], **kwargs)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))  # refused before touching anything


def test_clip_coefficient_is_the_closed_form():
    norms = torch.tensor([0.0, 0.5, 1.0, 13.0, math.inf])
    got = clip_coefficient(norms, 1.0, eps=1e-6)
    want = torch.tensor([min(1.0, 1.0 / (n + 1e-6)) for n in norms.tolist()])
    torch.testing.assert_close(got, want, rtol=1e-7, atol=0)
    assert got.dtype == torch.float32 and clip_coefficient(norms.double(), 1.0).dtype == torch.float64


# --- fp16: the item-weighted sum must not overflow ------------------------------------------------------


@pytest.mark.parametrize("items_per_micro", [60_000, 100_000])
def test_fp16_model_with_large_item_counts_steps(items_per_micro):
    # An fp16 gradient of (items x mean gradient) overflows at 65504, and 100k items is inf in fp16
    # itself: before, every step was skipped. Now each matches the fp32 big-batch step (fp16 resolution).
    x, y = data(24)
    batches = chunks(x, y, [4, 4, 4, 4, 4, 4])
    model, ref = make_model(dtype=torch.float16), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=1e6)
    for c in range(3):
        pair = batches[2 * c : 2 * c + 2]
        for xb, yb in pair:
            with acc.micro_batch(num_items=items_per_micro) as mb:
                # Every row stands for items_per_micro / 4 items with the same loss: the mean is the row mean.
                mb.backward(item_loss(model, xb.half(), yb.half()).mean() + 20.0)  # loss * N overflows fp16 too
        assert mb.result.stepped, f"cycle {c} skipped: {acc.nonfinite_events}"
        big_batch_step(ref, torch.cat([b[0] for b in pair]), torch.cat([b[1] for b in pair]))
    assert acc.skipped_steps == 0 and acc.items_seen == 6 * items_per_micro
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q, atol=2e-3, rtol=0)


def test_fp16_loss_is_weighted_in_float32():
    model = nn.Linear(3, 1)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=1)
    scaled = acc._scaled(torch.tensor(30.0, dtype=torch.float16), 4096)
    assert scaled.dtype == torch.float32 and math.isfinite(float(scaled))


def test_grad_scaler_with_items_does_not_overflow_on_the_first_step():
    x, y = data(8)
    model, ref = make_model(), make_model()
    big_batch_step(ref, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, grad_scaler=scaler
    )
    results = accumulate(acc, model, chunks(x, y, [4, 4]), [200_000, 200_000])
    assert results[-1].stepped and scaler.get_scale() == 2.0**16
    assert_same(model, ref, atol=1e-6)


# --- a backward that raised is not a micro-batch ---------------------------------------------------


def test_failed_backward_is_not_counted_and_a_retry_is_exact():
    x, y = data(8)
    batches = chunks(x, y, [4, 4])
    model, ref = make_model(), make_model()
    big_batch_step(ref, x, y)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    accumulate(acc, model, batches[:1], [4])
    grads = [p.grad.clone() for p in model.parameters()]
    xb, yb = batches[1]
    # A new block: the backward raises (a loss without a graph), the block propagates it.
    with pytest.raises(RuntimeError, match="does not require grad"), acc.micro_batch(num_items=4) as mb:
        mb.backward(torch.tensor(1.0))
    assert acc.micro_steps == 1 and acc._cycle.micro == 1 and acc.optimizer_steps == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    # Same block: a hook raising in backward, caught, then the retry.
    with acc.micro_batch(num_items=4) as mb:
        out = model(xb)
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
        with pytest.raises(RuntimeError, match="hook failed"):
            mb.backward((out - yb).pow(2).mean(dim=1).mean())
        assert acc.micro_steps == 1 and mb.loss is None
        mb.backward(item_loss(model, xb, yb).mean())
    assert mb.result is not None and mb.result.stepped
    assert acc.micro_steps == 2 and acc.items_seen == 8
    assert_same(model, ref)


# --- float64: the factor stays in the gradients' precision -------------------------------------------


@pytest.mark.parametrize("sizes", [[3], [1, 2], [2, 1]])
@pytest.mark.parametrize("max_grad_norm", [None, 100.0])
def test_float64_item_mean_is_exact(sizes, max_grad_norm):
    # Each item's gradient is exactly 1, so the mean is exactly 1 and the SGD step (lr 1) gives -1.0;
    # a factor rounded to float32 gave -1.0000000298023224.
    w = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    model = nn.Module()
    model.w = w
    acc = GradientAccumulator(
        model, torch.optim.SGD([w], lr=1.0), accumulation_steps=len(sizes), max_grad_norm=max_grad_norm
    )
    for n in sizes:
        with acc.micro_batch(num_items=torch.tensor(n)) as mb:
            mb.backward((w * torch.ones(n, dtype=torch.float64)).sum() / n)
    assert mb.result.stepped
    assert w.item() == -1.0


@pytest.mark.parametrize("factor", [1 / 3, torch.tensor(1 / 3, dtype=torch.float64)])
def test_scale_grads_keeps_float64_factor(factor):
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 6.0], dtype=torch.float64)
    scale_grads_([p], factor)
    assert p.grad.tolist() == [1.0, 2.0]


def test_fused_optimizer_with_float64_params_scales_at_float64():
    model = make_model(dtype=torch.float64)
    acc = GradientAccumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), accumulation_steps=2)
    assert not acc._fused  # grad_scale is float32: the float64 path scales the gradients itself


# --- distributed: an invalid count on one rank stops every rank ---------------------------------------


def _one_rank_negative_worker(rank, world_size, out):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    x, y = data(16, seed=1 + rank)
    batches = chunks(x, y, [4, 4, 4, 4])
    counts = [torch.tensor(4), torch.tensor(-4 if rank == 1 else 4), torch.tensor(4), torch.tensor(4)]
    results = accumulate(acc, model, batches, counts)
    save(
        out,
        rank,
        {
            "stepped": [r.stepped for r in results if r is not None],
            "events": [e.as_dict() for e in acc.nonfinite_events],
            "items_seen": acc.items_seen,
            "params": [p.detach().clone() for p in model.module.parameters()],
        },
    )


@pytest.mark.distributed
def test_invalid_count_on_one_rank_refuses_on_every_rank(ranks):
    a, b = load_all(ranks["one-rank-negative"], 2)
    for r in (a, b):
        assert r["stepped"] == [False, True]
        (event,) = [NonFiniteEvent.from_dict(e) for e in r["events"]]
        assert event.reason == INVALID_ITEMS and event.num_items == 8  # 4 + 4 + 4 - 4
        assert r["items_seen"] == 16  # only the valid cycle
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)


def test_event_from_an_older_record_reads_as_a_norm_event():
    old = {
        "cycle": 1,
        "rank": 0,
        "grad_norm": math.nan,
        "micro_steps": [4, 7],
        "nonfinite_micro_batches": [2],
        "tags": [],
        "action": "skip",
    }
    event = NonFiniteEvent.from_dict(old)
    assert event.reason == NONFINITE_NORM and event.micro_steps == (4, 7) and event.num_items is None


# --- distributed: the fp16 item scale is the same on every rank ---------------------------------------

SCALER_COUNTS = [[[3, 5], [6, 2]], [[2, 7], [1, 9]]]  # [cycle][rank][micro]: unequal everywhere


def _scaler_rows(cycle: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data(64, seed=7)
    out, start = [], 0
    for c, per_rank in enumerate(SCALER_COUNTS):
        for r, sizes in enumerate(per_rank):
            for n in sizes:
                if (c, r) == (cycle, rank):
                    out.append((x[start : start + n], y[start : start + n]))
                start += n
    return out


def _scaler_worker(rank, world_size, out):
    # A GradScaler turns the rank-uniform item scale on (estimated by one all-reduce, then from each cycle).
    model = nn.parallel.DistributedDataParallel(make_model())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, grad_scaler=scaler
    )
    for c in range(len(SCALER_COUNTS)):
        rows = _scaler_rows(c, rank)
        accumulate(acc, model, rows, [torch.tensor(len(xb)) for xb, _ in rows])
    save(out, rank, {"steps": acc.optimizer_steps, "params": [p.detach().clone() for p in model.module.parameters()]})


@pytest.mark.distributed
def test_ddp_item_scale_keeps_the_exact_global_mean(ranks):
    ref = make_model()
    for c in range(len(SCALER_COUNTS)):
        rows = [row for r in range(2) for row in _scaler_rows(c, r)]
        big_batch_step(ref, torch.cat([b[0] for b in rows]), torch.cat([b[1] for b in rows]))
    for r in load_all(ranks["scaler"], 2):
        assert r["steps"] == 2
        for got, want in zip(r["params"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """The module's 2-rank workers, run by one spawn (one start-up of the ranks for both tests)."""
    jobs = {"one-rank-negative": (_one_rank_negative_worker,), "scaler": (_scaler_worker,)}
    return spawn_all(tmp_path_factory.mktemp("bad-input-ranks"), jobs)


def test_invalid_count_survives_a_mid_cycle_checkpoint():
    x, y = data(8)
    batches = chunks(x, y, [4, 4])
    model = make_model()
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    accumulate(acc, model, batches[:1], [torch.tensor(-4)])
    state = copy.deepcopy(acc.state_dict())
    assert state["cycle"]["invalid_items"] == 1
    resumed = make_model()
    before = copy.deepcopy(resumed)
    acc2 = GradientAccumulator(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), accumulation_steps=2)
    acc2.load_state_dict(state)
    (result,) = accumulate(acc2, resumed, batches[1:], [torch.tensor(4)])
    assert not result.stepped and acc2.nonfinite_events[0].reason == INVALID_ITEMS
    assert_same(resumed, before, atol=0)
    assert acc2.items_seen == 0


def test_invalid_first_count_in_an_fp16_run_does_not_stick():
    # With a GradScaler the item scale is estimated from the first count: a NaN there must not last.
    x, y = data(16)
    batches = chunks(x, y, [4, 4, 4, 4])
    model, ref = make_model(), make_model()
    big_batch_step(ref, torch.cat([b[0] for b in batches[2:]]), torch.cat([b[1] for b in batches[2:]]))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, grad_scaler=scaler
    )
    counts = [torch.tensor(math.nan), torch.tensor(4.0), torch.tensor(4.0), torch.tensor(4.0)]
    results = accumulate(acc, model, batches, counts)
    assert [r.stepped for r in results if r is not None] == [False, True]
    assert acc.nonfinite_events[0].reason == INVALID_ITEMS
    assert_same(model, ref)


def _mid_cycle(model: nn.Module) -> GradientAccumulator:
    """An accumulator of ``model`` one micro-batch into a cycle of 2 (its state holds the pending gradients)."""
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    x = torch.ones(3, model[0].in_features)
    with acc.micro_batch() as mb:
        mb.backward(model(x).pow(2).mean())
    return acc


def _without(state: dict, *path: str) -> dict:
    out = copy.deepcopy(state)
    node = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda s: _without(s, "cycle"), ["no cycle"]),
        (lambda s: _without(s, "pending_grads"), ["no pending_grads"]),
        (lambda s: _without(s, "cycle", "micro"), ["no cycle.micro"]),
        (lambda s: {k: s[k] for k in ("micro_steps", "optimizer_steps")}, ["no accumulation_steps"]),
        (lambda s: s | {"pending_grads": {7: torch.zeros(2)}}, ["pending_grads[7]", "4 trainable parameters"]),
        (lambda s: s | {"pending_grads": {0: [0.0]}}, ["pending_grads[0]", "'0.weight'", "not a tensor"]),
        (lambda s: s | {"micro_steps": "3"}, ["micro_steps='3'"]),
        (lambda s: [s], ["not a dict"]),
    ],
)
def test_a_partial_or_damaged_accumulator_state_is_one_error_naming_the_key(damage, words):
    acc = _mid_cycle(make_model())
    other = _mid_cycle(make_model(seed=1))
    before = ([p.grad.clone() for p in other.model.parameters()], other.micro_steps, other.optimizer_steps)
    with pytest.raises(UserError) as err:
        other.load_state_dict(damage(acc.state_dict()))
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    # nothing was changed: the same pending gradients and counters as before the failed load
    assert all(torch.equal(p.grad, g) for p, g in zip(other.model.parameters(), before[0], strict=True))
    assert (other.micro_steps, other.optimizer_steps) == before[1:]


def test_another_models_state_mid_cycle_names_the_parameter_and_both_shapes():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    state = _mid_cycle(wide).state_dict()
    acc = _mid_cycle(make_model())  # Linear(5, 8): its first weight is (8, 5), the state's (8, 6)
    with pytest.raises(UserError, match=r"pending_grads\[0\] \(parameter '0\.weight'\): saved shape \(8, 6\) "
                                        r"torch\.float32, this model's \(8, 5\) torch\.float32"):  # fmt: skip
        acc.load_state_dict(state)
    # the same architecture's state loads (the oracle that the check is not simply refusing everything)
    acc.load_state_dict(_mid_cycle(make_model(seed=2)).state_dict())
    assert acc.micro_steps == 1
