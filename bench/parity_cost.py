"""Benchmark: what one replica-parity check costs (the checksum of every parameter tensor), against one AdamW
update of the same parameters (a lower bound of a training step): GPT-2-small-shaped tensors on this CPU.

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
