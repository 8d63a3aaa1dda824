"""Benchmark: clip + fused AdamW step, with the clip folded into the optimizer's ``grad_scale``.

On GPT-2-small-shaped parameters (148 tensors, 124M), compares the end of an optimizer step:

* ``steadytrain`` -- ``GradientAccumulator``'s end of cycle with a fused AdamW: one pass over the
  gradients for the global norm, then the fused step divides each gradient by ``grad_scale``
  (= 1 / clip coefficient) as it reads it. No separate scaling pass.
* ``torch``       -- ``torch.nn.utils.clip_grad_norm_`` (norm pass + scaling pass) then the same
  fused AdamW step.

Both start every timed call from the same unclipped gradients (restored untimed) and the same
optimizer state; rounds alternate the order. The headline is the median paired ratio
steadytrain / torch (target <= 0.9).

Usage::

    python bench/clip_step.py [--repeats N] [--threads T]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from clip import gpt2_small_shapes  # bench/clip.py: the GPT-2 small parameter shapes

from steadytrain.accumulate import GradientAccumulator


def build(seed: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    masters = []
    for i, (_, shape) in enumerate(gpt2_small_shapes()):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        module.register_parameter(f"p{i}", p)
        masters.append(torch.randn(shape, generator=gen) * 1e-2)
    return module, masters


def restore(module: torch.nn.Module, masters: list[torch.Tensor]) -> None:
    for p, g in zip(module.parameters(), masters, strict=True):
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    ours_model, masters = build(0)
    ref_model, _ = build(0)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-4, fused=True)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-4, fused=True)
    acc = GradientAccumulator(ours_model, ours_opt, accumulation_steps=1, max_grad_norm=1.0)
    assert acc._fused, "the fused path must be active"

    def ours() -> None:
        acc._cycle.micro = 1  # the end of a one-micro-batch cycle whose gradients are in .grad
        acc._end_cycle()

    def ref() -> None:
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0, foreach=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    # Check: two steps of each give the same parameters.
    for _ in range(2):
        restore(ours_model, masters)
        ours()
        restore(ref_model, masters)
        ref()
    # Compare the parameter CHANGE (2 steps of lr 1e-4 each), not the parameters themselves.
    init, _ = build(0)
    worst = max(
        float((a.detach() - b.detach()).abs().max() / (b.detach() - p0.detach()).abs().max())
        for a, b, p0 in zip(ours_model.parameters(), ref_model.parameters(), init.parameters(), strict=True)
    )
    print(f"check: max |difference| / max |update| after 2 steps = {worst:.2e}")
    assert worst < 1e-3, "the fused path diverged from clip_grad_norm_ + step"

    times: dict[str, list[float]] = {"steadytrain": [], "torch": []}
    ratios = []
    for r in range(args.repeats):
        order = [("steadytrain", ours_model, ours), ("torch", ref_model, ref)]
        if r % 2:
            order.reverse()
        for name, model, fn in order:
            restore(model, masters)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        ratios.append(times["steadytrain"][-1] / times["torch"][-1])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{sum(p.numel() for p in ours_model.parameters()) / 1e6:.1f}M parameters in 148 tensors, fused AdamW")
    print("| method | median ms | ratio to torch (median of paired) |")
    print("|---|---|---|")
    for name in times:
        med = statistics.median(times[name]) * 1e3
        ratio = statistics.median(ratios) if name == "steadytrain" else 1.0
        print(f"| {name} | {med:.1f} | {ratio:.3f} |")
    print(f"headline: steadytrain / torch = {statistics.median(ratios):.3f} (target <= 0.9)")


if __name__ == "__main__":
    main()
