"""Per-layer health (``monitor`` section, ``layers.jsonl``): what a layer is, and every value against an oracle.

Oracles: a plain PyTorch loop on a copy of the model (the gradients' per-layer norms before clipping, the
parameters after the update, the update itself); the step's global ``grad_norm`` in ``metrics.jsonl`` (the
layers' gradient norms combine to it); the checkpoints of a run (per-layer weight norms, and the update between
two consecutive steps).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.train.checkpoint.catalog import list_checkpoints, load_checkpoint
from steadytrain.train.observe.layers import LayerMonitor, layer_of
from tests.train_utils import metrics

TINY_LAYERS = ["tok", "pos", "blocks.0", "norm", "head"]
"""tiny-lm with one block, as ``monitor.group: auto`` names its layers."""


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "layers.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("name", "group", "main", "want"),
    [
        ("blocks.3.attn.qkv.weight", "auto", "blocks", "blocks.3"),
        ("tok.weight", "auto", "blocks", "tok"),
        ("head.weight", "auto", "blocks", "head"),
        ("model.layers.0.mlp.up_proj.weight", "auto", "model.layers", "model.layers.0"),
        ("model.embed_tokens.weight", "auto", "model.layers", "model.embed_tokens"),
        ("model.norm.weight", "auto", "model.layers", "model.norm"),
        ("lm_head.weight", "auto", "model.layers", "lm_head"),
        ("emb.weight", "auto", None, "emb"),
        ("scale", "auto", None, "scale"),
        ("blocks.3.attn.qkv.weight", "module", None, "blocks.3.attn.qkv"),
        ("scale", "module", None, "scale"),
        ("blocks.3.attn.qkv.weight", "parameter", None, "blocks.3.attn.qkv.weight"),
    ],
)
def test_what_a_layer_is(name, group, main, want):
    assert layer_of(name, group, main) == want


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 8)  # never in the forward: no gradient, ever

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h).squeeze(-1)


def _groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    named = dict(model.named_parameters())
    return {
        "emb": [named["emb.weight"], named["emb.bias"]],
        "blocks.0": [named["blocks.0.weight"], named["blocks.0.bias"]],
        "blocks.1": [named["blocks.1.weight"], named["blocks.1.bias"]],
        "head": [named["head.weight"], named["head.bias"]],
        "unused": [named["unused.weight"], named["unused.bias"]],
    }


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))


def test_grad_norms_before_clipping_weights_after_the_update_and_the_update_against_a_plain_loop():
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    acc = GradientAccumulator(model, opt, accumulation_steps=2, max_grad_norm=0.01)  # every step clipped
    step = {"n": 0}
    mon = LayerMonitor(model, "auto", every=1, next_step=lambda: step["n"] + 1)
    acc.observer = mon
    batches = [torch.randn(4, 6) for _ in range(6)]
    for i in range(0, 6, 2):
        for x in batches[i : i + 2]:
            with acc.micro_batch() as m:
                m.backward(model(x).square().mean())
        step["n"] += 1
        # the plain loop: the mean of the two micro-batches' losses, its gradients before clipping, the update
        ref_opt.zero_grad()
        sum(ref(x).square().mean() for x in batches[i : i + 2]).div(2).backward()
        grads = {k: _norm([p.grad for p in ps if p.grad is not None]) for k, ps in _groups(ref).items()}
        before = {k: [p.detach().clone() for p in ps] for k, ps in _groups(ref).items()}
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
        rows = {r["layer"]: r for r in mon.take()}
        assert list(rows) == ["emb", "blocks.0", "blocks.1", "head", "unused"]  # model order
        for k, ps in _groups(ref).items():
            r = rows[k]
            assert r["step"] == step["n"]
            assert r["grad_norm"] == pytest.approx(grads[k], rel=1e-5, abs=1e-12)
            assert r["param_norm"] == pytest.approx(_norm(ps), rel=1e-5)
            assert r["update_norm"] == pytest.approx(
                _norm([a - b for a, b in zip(ps, before[k], strict=True)]), rel=1e-4
            )
            assert r["update_ratio"] == pytest.approx(r["update_norm"] / r["param_norm"], rel=1e-12)
        assert rows["unused"]["grad_norm"] == 0 and rows["unused"]["update_norm"] == 0
        global_norm = math.sqrt(sum(r["grad_norm"] ** 2 for r in rows.values()))
        assert global_norm == pytest.approx(acc.last_grad_norm, rel=1e-5)


def test_a_refused_step_has_grad_and_weight_norms_and_no_update_and_other_steps_are_not_watched():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=1)
    step = {"n": 0}
    mon = LayerMonitor(model, "auto", every=3, next_step=lambda: step["n"] + 1)
    acc.observer = mon
    for i in range(6):
        x = torch.randn(4, 6)
        if i == 1:
            x[0, 0] = float("nan")  # step 2: non-finite, refused
        with acc.micro_batch() as m:
            m.backward(model(x).square().mean())
        step["n"] += 1
    rows = mon.take()
    assert sorted({r["step"] for r in rows}) == [2, 3, 6]  # the refused step, and every third
    refused = [r for r in rows if r["step"] == 2]
    assert all(r["update_norm"] is None and r["update_ratio"] is None for r in refused)
    assert all(r["param_norm"] is not None and r["param_norm"] > 0 for r in refused)
    assert {r["layer"] for r in refused if r["grad_norm"] is None} >= {"emb"}  # the NaN reached its gradient
    assert mon.take() == []


def test_a_run_writes_its_layers_and_they_agree_with_its_metrics_and_checkpoints(tiny_run):
    run = tiny_run("run.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=5", "run.log_every=1")
    rows = _rows(run)
    assert [(r["step"], r["layer"]) for r in rows] == [(s, k) for s in range(1, 5) for k in TINY_LAYERS]
    for row in metrics(run):  # the layers' gradient norms combine to the step's global norm
        norms = [r["grad_norm"] for r in rows if r["step"] == row["step"]]
        assert math.sqrt(sum(n * n for n in norms)) == pytest.approx(row["grad_norm"], rel=1e-5)
    states = {s: load_checkpoint(path)["model"] for s, path in list_checkpoints(run / "checkpoints")}
    assert sorted(states) == [1, 2, 3, 4]
    for r in rows:
        names = [n for n in states[r["step"]] if layer_of(n, "auto", "blocks") == r["layer"]]
        assert r["param_norm"] == pytest.approx(_norm(states[r["step"]][n] for n in names), rel=1e-5)
        if r["step"] > 1:
            after, before = states[r["step"]], states[r["step"] - 1]
            assert r["update_norm"] == pytest.approx(_norm(after[n] - before[n] for n in names), rel=1e-4)


def test_every_steps_and_off(tiny_run):
    rows = _rows(tiny_run("run.max_steps=6", "run.log_every=2", "monitor.every_steps=3"))
    assert sorted({r["step"] for r in rows}) == [3, 6]
    assert not (tiny_run("run.max_steps=2", "monitor.layers=off") / "layers.jsonl").exists()
