"""``optim.no_decay``: biases and norm parameters exempt from weight decay, one rule for every optimizer.

Oracles: a hand-built ``torch.optim.AdamW`` with two parameter groups (parameters of 2 or more dimensions
decayed, the rest not), the same optimizer with one group for ``[]``, and the closed form of one SGD step
with a zero gradient (``p * (1 - lr * wd)`` for decayed parameters, unchanged for exempt ones)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from steadytrain.errors import UserError
from steadytrain.optim import decay_groups
from steadytrain.train.job.files import decay_listing
from steadytrain.train.setup.config import load_config
from steadytrain.train.setup.models import TinyLM
from steadytrain.train.setup.pieces import build_optimizer

CPU = torch.device("cpu")


def tiny() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(dim=16, layers=2, heads=2, seq_len=8)


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_adamw_equals_a_hand_built_two_group_adamw():
    cfg = load_config(None, ["optim.weight_decay=0.1"])
    ours, hand = tiny(), tiny()
    opt = build_optimizer(cfg, ours, 1e-2, CPU)
    params = list(hand.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    assert groups[1]["params"]  # TinyLM has biases and LayerNorm weights: the test can tell the groups apart
    ref = torch.optim.AdamW(groups, lr=1e-2, betas=cfg.optim.betas, eps=cfg.optim.eps, fused=True)
    run(ours, opt)
    run(hand, ref)
    for (name, a), b in zip(ours.named_parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_an_empty_list_decays_everything_as_one_group():
    cfg = load_config(None, ["optim.weight_decay=0.1", "optim.no_decay=[]"])
    ours, hand = tiny(), tiny()
    opt = build_optimizer(cfg, ours, 1e-2, CPU)
    ref = torch.optim.AdamW(hand.parameters(), lr=1e-2, betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=0.1)
    run(ours, opt)
    run(hand, ref)
    for a, b in zip(ours.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fused against foreach: rounding only


@pytest.mark.parametrize("name", ["adamw", "sgd", "lars", "lamb"])
def test_every_optimizer_exempts_the_same_parameters(name):
    """With a zero gradient only weight decay moves a parameter: exactly the decayed ones move."""
    cfg = load_config(None, [f"optim.name={name}", "optim.weight_decay=0.1", "optim.momentum=0"])
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(cfg, model, 0.5, CPU)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n, p in model.named_parameters() if p.ndim >= 2}
    if name == "sgd":
        for n, p in model.named_parameters():
            if n in moved:
                torch.testing.assert_close(p, before[n] * (1 - 0.5 * 0.1), rtol=1e-6, atol=0)


def test_the_kinds_separately():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    names = {tuple(g["names"]) for g in decay_groups(model, 0.1, ["bias"])}
    assert names == {("0.weight", "1.weight", "2.weight"), ("0.bias", "1.bias")}
    names = {tuple(g["names"]) for g in decay_groups(model, 0.1, ["norm"])}
    assert names == {("0.weight", "2.weight"), ("0.bias", "1.weight", "1.bias")}
    frozen = copy.deepcopy(model).requires_grad_(False)
    assert decay_groups(frozen, 0.1) == []
    with pytest.raises(ValueError, match="no_decay"):
        decay_groups(model, 0.1, ["weights"])


def test_a_user_norm_class_is_recognised_by_name():
    class RMSNormish(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1, 8))  # 2-D, but a norm's gain

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(8, 8), RMSNormish()

    RMSNormish.__name__ = "MyRMSNorm"
    groups = decay_groups(Net(), 0.1)
    assert groups[0]["names"] == ["lin.weight"] and groups[1]["names"] == ["lin.bias", "norm.scale"]


def test_groups_are_listed_and_bad_values_refused():
    cfg = load_config(None, [])
    assert cfg.optim.no_decay == ["bias", "norm"]
    opt = build_optimizer(cfg, tiny(), 1e-3, CPU)
    line = decay_listing(opt, cfg.optim.no_decay)
    decayed = sum(p.numel() for p in tiny().parameters() if p.ndim >= 2)
    assert "0.01 on " in line and f"({decayed:,} parameters)" in line and "exempt: bias, norm" in line
    with pytest.raises(UserError, match=r"optim\.no_decay"):
        load_config(None, ["optim.no_decay=[weights]"])
    with pytest.raises(UserError, match="no trainable parameters"):
        build_optimizer(cfg, tiny().requires_grad_(False), 1e-3, CPU)
