"""Benchmark: what one replica-parity check costs (the checksum of every parameter tensor), against one AdamW
update of the same parameters (a lower bound of a training step): GPT-2-small-shaped tensors on this CPU; then
against a whole training step (forward, backward, AdamW) of a GPT-2-small-shaped tiny-lm on one sequence.

Usage::

    python bench/parity_cost.py
"""

import statistics
import time

import torch

from steadytrain.train.job.parity import _checksums

torch.manual_seed(0)
shapes = [(50257, 768)] + [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12
params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = torch.optim.AdamW(params, lr=1e-4, fused=False, foreach=True)
opt.step()
named = [(f"p{i}", p) for i, p in enumerate(params)]
check, step = [], []
for _ in range(5):
    t = time.perf_counter()
    _checksums(named).tolist()
    check.append(time.perf_counter() - t)
    t = time.perf_counter()
    opt.step()
    step.append(time.perf_counter() - t)
n = sum(p.numel() for p in params)
c, s = statistics.median(check), statistics.median(step)
print(
    f"{n / 1e6:.1f}M parameters: checksum {c * 1e3:.0f} ms, one AdamW update alone {s * 1e3:.0f} ms; "
    f"ratio {c / s:.2f}; every 100 steps: {c / s / 100:.2%} of the optimizer update alone"
)

# A whole training step of a GPT-2-small-shaped tiny-lm (12 blocks of width 768, a 50257-token vocabulary, the
# head tied to nothing: 163M parameters) on the smallest batch (one sequence of 128 tokens), and one check of it.
from steadytrain.train.setup.models import TinyLM  # noqa: E402

model = TinyLM(dim=768, layers=12, heads=12, seq_len=128, vocab_size=50257)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
batch = {"tokens": torch.randint(0, 50257, (1, 129))}
named = list(model.named_parameters())
whole, check = [], []
for _ in range(3):
    t = time.perf_counter()
    model(batch).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    whole.append(time.perf_counter() - t)
    t = time.perf_counter()
    _checksums(named).tolist()
    check.append(time.perf_counter() - t)
w, c = statistics.median(whole), statistics.median(check)
m = sum(p.numel() for p in model.parameters())
print(
    f"{m / 1e6:.1f}M-parameter tiny-lm, one 128-token sequence: step {w * 1e3:.0f} ms, check {c * 1e3:.0f} ms; "
    f"a check every 100 steps: {c / w / 100:.2%} of the step time (every 10: {c / w / 10:.2%})"
)
