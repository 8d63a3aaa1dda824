"""Tests for steadytrain.optim: LARS/LAMB against NumPy oracles, trust-ratio edge cases, param groups."""

from __future__ import annotations

import copy
import doctest
import math

import numpy as np
import pytest
import torch
from torch import nn

from steadytrain import optim as st_optim
from steadytrain.optim import LAMB, LARS, exclude_bias_and_norm

RNG = np.random.default_rng(1234)


def _param(a: np.ndarray) -> nn.Parameter:
    return nn.Parameter(torch.tensor(a, dtype=torch.float64))


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: list[list[np.ndarray]]) -> None:
    """Apply one optimizer step per entry of ``grads`` (a list, per step, of one gradient per param)."""
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()


# ----------------------------------------------------------------------------------------------- NumPy oracles
def lars_ref(w, grads, *, lr, momentum, wd, tc, eps, nesterov=False, adapt=True):
    """Independent NumPy LARS: returns final weights and the last trust ratio."""
    w, v, trust = w.copy(), None, 1.0
    for g in grads:
        if adapt:
            d = g + wd * w
            wn, dn = np.linalg.norm(w), np.linalg.norm(d)
            trust = tc * wn / (dn + eps) if wn > 0 and dn > 0 else 1.0
            d = trust * d
        else:
            d, trust = g, 1.0
        v = d.copy() if v is None else momentum * v + d
        w = w - lr * (d + momentum * v if nesterov else v)
    return w, trust


def lamb_ref(w, grads, *, lr, betas, eps, wd, clamp=None, bias_correction=True, adapt=True):
    """Independent NumPy LAMB: returns final weights and the last trust ratio."""
    b1, b2 = betas
    w, m, v, trust = w.copy(), np.zeros_like(w), np.zeros_like(w), 1.0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = (m / (1 - b1**t), v / (1 - b2**t)) if bias_correction else (m, v)
        r = m_hat / (np.sqrt(v_hat) + eps)
        if adapt:
            r = r + wd * w
            wn, rn = np.linalg.norm(w), np.linalg.norm(r)
            trust = wn / rn if wn > 0 and rn > 0 else 1.0
            if clamp is not None and wn > 0 and rn > 0:
                trust = min(trust, clamp)
        else:
            trust = 1.0
        w = w - lr * trust * r
    return w, trust


# ------------------------------------------------------------------------------------------------------- LARS
LARS_KW = dict(lr=0.7, momentum=0.9, weight_decay=0.05, trust_coefficient=0.02, eps=1e-8)


def test_lars_one_step_closed_form_weight_and_bias():
    w0, b0 = RNG.normal(size=(3, 4)), RNG.normal(size=3)
    gw, gb = RNG.normal(size=(3, 4)), RNG.normal(size=3)
    w, b = _param(w0), _param(b0)
    opt = LARS([w, b], **LARS_KW)
    _run(opt, [w, b], [[gw, gb]])

    lr, wd, tc, eps = 0.7, 0.05, 0.02, 1e-8
    d = gw + wd * w0
    trust = tc * np.linalg.norm(w0) / (np.linalg.norm(d) + eps)
    # First step: momentum buffer == d, so the update is lr * trust * d.
    np.testing.assert_allclose(w.detach().numpy(), w0 - lr * trust * d, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.state[w]["trust_ratio"].item(), trust, rtol=1e-12)
    # The 1-D bias is not adapted: no weight decay, trust ratio 1.
    np.testing.assert_allclose(b.detach().numpy(), b0 - lr * gb, rtol=1e-12, atol=1e-14)
    assert opt.state[b]["trust_ratio"].item() == 1.0
    assert opt.state[w]["trust_ratio"].ndim == 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_two_steps_with_momentum(nesterov):
    w0, b0 = RNG.normal(size=(4, 5)), RNG.normal(size=4)
    grads = [[RNG.normal(size=(4, 5)), RNG.normal(size=4)] for _ in range(2)]
    w, b = _param(w0), _param(b0)
    opt = LARS([w, b], nesterov=nesterov, **LARS_KW)
    _run(opt, [w, b], grads)

    kw = dict(lr=0.7, momentum=0.9, wd=0.05, tc=0.02, eps=1e-8, nesterov=nesterov)
    w_ref, trust_ref = lars_ref(w0, [g[0] for g in grads], **kw)
    b_ref, _ = lars_ref(b0, [g[1] for g in grads], adapt=False, **kw)
    np.testing.assert_allclose(w.detach().numpy(), w_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b.detach().numpy(), b_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.state[w]["trust_ratio"].item(), trust_ref, rtol=1e-12)


def test_lars_without_momentum_is_scaled_sgd():
    w0, g = RNG.normal(size=(2, 3)), RNG.normal(size=(2, 3))
    w = _param(w0)
    opt = LARS([w], lr=0.5, momentum=0.0, trust_coefficient=0.1)
    _run(opt, [w], [[g], [g]])
    w_ref, _ = lars_ref(w0, [g, g], lr=0.5, momentum=0.0, wd=0.0, tc=0.1, eps=1e-8)
    np.testing.assert_allclose(w.detach().numpy(), w_ref, rtol=1e-12)
    assert "momentum_buffer" not in opt.state[w]


# ------------------------------------------------------------------------------------------------------- LAMB
LAMB_KW = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_numpy(steps, bias_correction):
    w0, b0 = RNG.normal(size=(3, 4)), RNG.normal(size=3)
    grads = [[RNG.normal(size=(3, 4)), RNG.normal(size=3)] for _ in range(steps)]
    w, b = _param(w0), _param(b0)
    opt = LAMB([w, b], bias_correction=bias_correction, **LAMB_KW)
    _run(opt, [w, b], grads)

    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, wd=0.1, bias_correction=bias_correction)
    w_ref, trust_ref = lamb_ref(w0, [g[0] for g in grads], **kw)
    b_ref, _ = lamb_ref(b0, [g[1] for g in grads], adapt=False, **kw)
    np.testing.assert_allclose(w.detach().numpy(), w_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b.detach().numpy(), b_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.state[w]["trust_ratio"].item(), trust_ref, rtol=1e-12)
    assert opt.state[b]["trust_ratio"].item() == 1.0
    assert opt.state[w]["step"] == steps


def test_lamb_one_step_closed_form():
    # With bias correction, step 1 gives m_hat = g, v_hat = g^2, so r = g / (|g| + eps) + wd * w.
    w0, g = RNG.normal(size=(5, 2)), RNG.normal(size=(5, 2))
    w = _param(w0)
    opt = LAMB([w], **LAMB_KW)
    _run(opt, [w], [[g]])
    r = g / (np.abs(g) + 1e-6) + 0.1 * w0
    trust = np.linalg.norm(w0) / np.linalg.norm(r)
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.01 * trust * r, rtol=1e-12)
    np.testing.assert_allclose(opt.state[w]["trust_ratio"].item(), trust, rtol=1e-12)


def test_lamb_clamp_trust():
    w0, g = 100 * RNG.normal(size=(3, 3)), RNG.normal(size=(3, 3))  # large weights -> trust ratio >> 1
    w = _param(w0)
    opt = LAMB([w], clamp_trust=2.0, **LAMB_KW)
    _run(opt, [w], [[g]])
    w_ref, trust_ref = lamb_ref(w0, [g], lr=0.01, betas=(0.9, 0.99), eps=1e-6, wd=0.1, clamp=2.0)
    assert trust_ref == 2.0
    assert opt.state[w]["trust_ratio"].item() == 2.0
    np.testing.assert_allclose(w.detach().numpy(), w_ref, rtol=1e-12)


# -------------------------------------------------------------------------------------- trust-ratio edge cases
def test_lars_trust_is_one_for_zero_weight():
    g = RNG.normal(size=(3, 4))
    w = _param(np.zeros((3, 4)))
    opt = LARS([w], lr=0.5, weight_decay=0.1, trust_coefficient=0.001)
    _run(opt, [w], [[g]])
    assert opt.state[w]["trust_ratio"].item() == 1.0
    np.testing.assert_allclose(w.detach().numpy(), -0.5 * g, rtol=1e-12)  # d = g + wd*0 = g, trust 1


def test_lars_trust_is_one_for_zero_update():
    w0 = RNG.normal(size=(3, 4))
    w = _param(w0)
    opt = LARS([w], lr=0.5, weight_decay=0.0)
    _run(opt, [w], [[np.zeros((3, 4))]])
    assert opt.state[w]["trust_ratio"].item() == 1.0
    assert torch.isfinite(w).all()
    np.testing.assert_array_equal(w.detach().numpy(), w0)


def test_lamb_trust_is_one_for_zero_weight():
    g = RNG.normal(size=(3, 4))
    w = _param(np.zeros((3, 4)))
    opt = LAMB([w], **LAMB_KW)
    _run(opt, [w], [[g]])
    assert opt.state[w]["trust_ratio"].item() == 1.0
    np.testing.assert_allclose(w.detach().numpy(), -0.01 * g / (np.abs(g) + 1e-6), rtol=1e-12)


def test_lamb_trust_is_one_for_zero_update():
    w0 = RNG.normal(size=(3, 4))
    w = _param(w0)
    opt = LAMB([w], lr=0.01, weight_decay=0.0)
    _run(opt, [w], [[np.zeros((3, 4))]])
    assert opt.state[w]["trust_ratio"].item() == 1.0
    np.testing.assert_array_equal(w.detach().numpy(), w0)


# ------------------------------------------------------------------------------------------- groups and API
def test_exclude_bias_and_norm_groups():
    lin1, ln, bn, lin2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.BatchNorm1d(8), nn.Linear(8, 2)
    model = nn.Sequential(lin1, ln, bn, nn.ReLU(), lin2)
    adapted, excluded = exclude_bias_and_norm(model, weight_decay=0.05)
    assert {id(p) for p in adapted["params"]} == {id(lin1.weight), id(lin2.weight)}
    expected = {id(p) for p in (lin1.bias, lin2.bias, ln.weight, ln.bias, bn.weight, bn.bias)}
    assert {id(p) for p in excluded["params"]} == expected
    assert len(excluded["params"]) == len(expected)
    assert (adapted["weight_decay"], adapted["adapt"]) == (0.05, True)
    assert (excluded["weight_decay"], excluded["adapt"]) == (0.0, False)


def test_exclude_bias_and_norm_dedupes_tied_weights_and_handles_2d_norm_params():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    gn = nn.GroupNorm(2, 4)
    gn.weight = nn.Parameter(torch.ones(2, 2))  # a >1-D param inside a norm layer is still excluded
    adapted, excluded = exclude_bias_and_norm(nn.ModuleList([emb, head, gn]), weight_decay=0.0)
    assert [id(p) for p in adapted["params"]] == [id(emb.weight)]
    assert {id(p) for p in excluded["params"]} == {id(gn.weight), id(gn.bias)}


def test_default_adapt_follows_ndim_and_group_override():
    w, b = _param(RNG.normal(size=(2, 2))), _param(RNG.normal(size=2))
    w_off = _param(RNG.normal(size=(2, 2)))
    opt = LARS([{"params": [w, b]}, {"params": [w_off], "adapt": False, "weight_decay": 0.3}], lr=0.1)
    g = [np.ones((2, 2)), np.ones(2), np.ones((2, 2))]
    w_off0 = w_off.detach().numpy().copy()
    _run(opt, [w, b, w_off], [g])
    assert opt.state[w]["trust_ratio"].item() != 1.0
    assert opt.state[b]["trust_ratio"].item() == 1.0
    assert opt.state[w_off]["trust_ratio"].item() == 1.0
    np.testing.assert_allclose(w_off.detach().numpy(), w_off0 - 0.1 * g[2], rtol=1e-12)  # no weight decay


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_none_grads_skipped_sparse_raises_and_closure(cls):
    a, b = _param(RNG.normal(size=(2, 2))), _param(RNG.normal(size=(2, 2)))
    opt = cls([a, b], lr=0.1)
    b0 = b.detach().clone()

    def closure():
        opt.zero_grad()
        loss = a.pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    assert len(opt.state[a]) > 0 and len(opt.state[b]) == 0
    assert torch.equal(b, b0)

    emb = nn.Embedding(5, 3, sparse=True)
    opt = cls(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
        (LARS, dict(lr=-0.1), "lr"),
        (LARS, dict(lr=0.1, momentum=1.0), "momentum"),
        (LARS, dict(lr=0.1, momentum=-0.5), "momentum"),
        (LARS, dict(lr=0.1, weight_decay=-1e-4), "weight_decay"),
        (LARS, dict(lr=0.1, trust_coefficient=0.0), "trust_coefficient"),
        (LARS, dict(lr=0.1, eps=-1.0), "eps"),
        (LARS, dict(lr=0.1, momentum=0.0, nesterov=True), "nesterov"),
        (LAMB, dict(lr=-1.0), "lr"),
        (LAMB, dict(betas=(1.0, 0.999)), r"betas\[0\]"),
        (LAMB, dict(betas=(0.9, 1.2)), r"betas\[1\]=1\.2 must be in \[0, 1\)"),
        (LAMB, dict(betas=(0.9,)), "betas"),
        (LAMB, dict(eps=-1e-6), "eps"),
        (LAMB, dict(weight_decay=-0.1), "weight_decay"),
        (LAMB, dict(clamp_trust=0.0), "clamp_trust"),
    ],
)
def test_bad_hyperparameters_raise(cls, kwargs, arg):
    with pytest.raises(ValueError, match=f"{cls.__name__}: {arg}"):
        cls([nn.Parameter(torch.ones(2, 2))], **kwargs)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_bad_group_override_raises(cls):
    with pytest.raises(ValueError, match="weight_decay=-1"):
        cls([{"params": [nn.Parameter(torch.ones(2, 2))], "weight_decay": -1}], lr=0.1)
    with pytest.raises(ValueError, match="adapt"):
        cls([{"params": [nn.Parameter(torch.ones(2, 2))], "adapt": "yes"}], lr=0.1)


def test_exclude_bias_and_norm_rejects_negative_weight_decay():
    with pytest.raises(ValueError, match="weight_decay"):
        exclude_bias_and_norm(nn.Linear(2, 2), weight_decay=-0.1)


# ------------------------------------------------------------------------------------------------ convergence
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda groups: LARS(groups, lr=1.0, momentum=0.9, trust_coefficient=0.05), id="lars"),
        pytest.param(lambda groups: LAMB(groups, lr=0.05), id="lamb"),
    ],
)
def test_least_squares_converges(make):
    # Layer-wise normalized steps have a size proportional to ||w|| that does not shrink near the optimum, so a
    # constant LR stalls around 1e-3 of the initial loss; a cosine decay (as used in practice) drives it down.
    torch.manual_seed(0)
    x = torch.randn(256, 10)
    y = x @ torch.randn(10, 1) + 0.5
    model = nn.Linear(10, 1)
    opt = make(exclude_bias_and_norm(model, weight_decay=0.0))
    steps = 300
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))

    def loss_fn():
        return (model(x) - y).pow(2).mean()

    initial = loss_fn().item()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        sched.step()
    assert loss_fn().item() < 1e-4 * initial


def test_state_dict_roundtrip_continues_identically():
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    for cls, kw in ((LARS, dict(lr=0.5, trust_coefficient=0.05)), (LAMB, dict(lr=0.01, weight_decay=0.01))):
        m1 = nn.Linear(4, 3)
        o1 = cls(exclude_bias_and_norm(m1, 0.01), **kw)
        m1(x).pow(2).mean().backward()
        o1.step()
        m2 = nn.Linear(4, 3)
        m2.load_state_dict(m1.state_dict())
        o2 = cls(exclude_bias_and_norm(m2, 0.01), **kw)
        o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # state_dict() shares tensors
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
            torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def test_docstring_examples_run():
    result = doctest.testmod(st_optim, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
