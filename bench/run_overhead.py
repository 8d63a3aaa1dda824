"""Benchmark: what an open ``steadytrain.Run`` adds to the per-optimizer-step time of a plain loop (CPU).

The issue's acceptance: the Run adds nothing measurable to a step of a plain loop. Every implementation runs the
SAME math on the SAME model and data as ``bench/loop.py``'s ``small`` setup (imported from it): an MLP
256 -> 512 -> 512 -> 10, micro-batch 32, cross-entropy, K=4 micro-batches accumulated into one gradient,
global-norm clipping to 1.0, AdamW (lr 1e-3), ``warmup_schedule(10, 10 000)`` stepped per optimizer step.

* ``raw``          -- ``bench/loop.py``'s hand-written PyTorch loop (``(loss / K).backward()``, ``clip_grad_norm_``,
  ``opt.step()``, ``sched.step()``, ``opt.zero_grad(set_to_none=True)``).
* ``accumulator``  -- ``bench/loop.py``'s ``GradientAccumulator(model, opt, accumulation_steps=K,
  scheduler=sched, max_grad_norm=1.0)`` with ``with acc.micro_batch() as mb: mb.backward(loss)``; no Run.
* ``run``          -- the same accumulator given to an open ``steadytrain.Run(run_dir, model=, optimizer=,
  accumulator=acc, report=False, log_every=10)`` (a temp dir), each micro-batch in ``with run.micro_batch(ids) as
  mb: mb.backward(loss)`` with the micro-batch's 32 example ids (so the exposure is counted): what a user adds.
  At each step end the Run adds a ``metrics.jsonl`` row (written every ``log_every`` steps: one host read of the
  interval's losses) and the heartbeat; no checkpoint is taken in the timed steps.
* ``run+layers``   -- the same with ``layers=True, layers_every=10``: the per-layer norms every 10th step, to show
  that option's cost on its own.
* ``run, no clock`` -- the same Run with its time account (``timeline.jsonl``, the attempt's clock told each step's
  end) switched off after it opened: ``run / run, no clock`` is what the account costs a step.
* ``accumulator again`` -- a second ``accumulator`` on its own copy: ``accumulator again / accumulator`` is what the
  machine's noise alone makes of a paired ratio (a difference within it is not measurable here).

Each implementation trains its own ``deepcopy`` of one seeded model with its own optimizer, scheduler (and Run, in
its own directory, opened once before the check and closed after the last round), on micro-batches generated once
up front; the example ids of micro-batch ``i`` of the pool are ``32 i .. 32 i + 31``, made up front too (a loader
hands them over with the batch). Before timing, all four run ``--check-steps`` optimizer steps from the same init
on the same data: ``run`` and ``run+layers`` must leave parameters bit-identical to ``accumulator``
(``torch.equal``, else the run stops); how ``accumulator`` compares with ``raw`` is reported (as in
``bench/loop.py``). Then ``--warmup`` steps each, then ``--repeats`` rounds; in a round every implementation runs
``--steps`` optimizer steps (a multiple of 10: the same number of metrics writes and layer steps in every round),
the order rotated every round, timed with ``time.perf_counter``. The figures are medians over rounds of paired
ratios (both timed in the same round): ``run / accumulator`` (the headline), ``accumulator / raw``,
``run / raw`` and ``run+layers / accumulator``, each with the median paired difference in microseconds per
step (what the Run adds, in absolute terms). After the rounds the Runs are closed and what they wrote is
counted (metrics rows, examples in ``exposure.json``, ``layers.jsonl`` rows), to show that the Run's work was done.

Usage::

    python bench/run_overhead.py [--repeats R] [--steps S] [--threads T] [--warmup W] [--check-steps C]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from loop import (  # bench/loop.py: the small setup and its raw and accumulator loops
    ATOL,
    MAX_NORM,
    RTOL,
    Impl,
    K,
    LossFn,
    _fresh,
    _n_cpus,
    _version,
    cpu_model,
    make_raw,
    make_setup,
    make_steadytrain,
    n_params,
)
from torch import nn

from steadytrain import Run
from steadytrain.accumulate import GradientAccumulator

RAW, ACC, RUN, LAYERS, AGAIN = "raw", "accumulator", "run", "run+layers", "accumulator again"
NOCLOCK = "run, no clock"
LABELS = {
    RAW: "hand-written PyTorch loop",
    ACC: "`GradientAccumulator` alone",
    RUN: "`GradientAccumulator` in an open `steadytrain.Run`",
    LAYERS: "same, `layers=True` (every 10 steps)",
    AGAIN: "`GradientAccumulator` alone, a second copy (the noise floor)",
    NOCLOCK: "same Run, its time account (`timeline.jsonl`) switched off",
}
RATIOS = ((RUN, ACC), (ACC, RAW), (RUN, RAW), (LAYERS, ACC), (AGAIN, ACC), (RUN, NOCLOCK))
HEADLINE = (RUN, ACC)
LOG_EVERY = 10  # the Run's default, given explicitly
MICRO = 32  # bench/loop.py's small micro-batch

Feed = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (x, y, example ids) per micro-batch


# -- the implementations --------------------------------------------------------------------------


def make_run(
    name: str, template: nn.Module, loss_fn: LossFn, run_dir: Path, stack: contextlib.ExitStack, **settings
) -> tuple[Impl, Run]:
    """The accumulator ``bench/loop.py`` builds, given to a Run opened here (and closed when ``stack`` closes)."""
    model, opt, sched = _fresh(template)
    acc = GradientAccumulator(model, opt, accumulation_steps=K, scheduler=sched, max_grad_norm=MAX_NORM)
    run = stack.enter_context(
        Run(run_dir, model=model, optimizer=opt, accumulator=acc, report=False, log_every=LOG_EVERY, **settings)
    )

    def train(feed: Feed) -> None:
        for x, y, ids in feed:
            with run.micro_batch(ids) as mb:
                mb.backward(loss_fn(model(x), y))

    return Impl(name, model, opt, train), run


def feed_for(name: str, pool: Feed, steps: int) -> list:
    """The micro-batches of ``steps`` optimizer steps as this implementation takes them (the Runs: with ids)."""
    feed = [pool[i % len(pool)] for i in range(steps * K)]
    return feed if name in (RUN, LAYERS, NOCLOCK) else [(x, y) for x, y, _ in feed]


# -- equivalence check ----------------------------------------------------------------------------


def _bit_identical(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def check(impls: dict[str, Impl], runs: dict[str, Run], pool: Feed, steps: int) -> list[str]:
    """Train every implementation ``steps`` steps from the same init on the same data; stop unless the Runs'
    parameters are bit-identical to the accumulator's."""
    for name, impl in impls.items():
        impl.run(feed_for(name, pool, steps))
    ref = impls[ACC]
    lines = []
    for name in (RUN, LAYERS, NOCLOCK):
        same = _bit_identical(impls[name].module, ref.module)
        lr_same = impls[name].optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]
        if not (same and lr_same and runs[name].step == steps):
            raise SystemExit(
                f"check FAILED: {name} after {steps} steps: parameters bit-identical to accumulator: {same}, "
                f"same LR: {lr_same}, Run.step {runs[name].step} (expected {steps})"
            )
        lines.append(f"{name}: parameters after {steps} optimizer steps bit-identical to accumulator (torch.equal)")
    raw_params = [p.detach() for p in impls[RAW].module.parameters()]
    acc_params = [p.detach() for p in ref.module.parameters()]
    if _bit_identical(ref.module, impls[RAW].module):
        lines.append(f"accumulator: parameters after {steps} optimizer steps bit-identical to raw")
    else:
        torch.testing.assert_close(acc_params, raw_params, rtol=RTOL, atol=ATOL)
        worst = max(float((a - b).abs().max()) for a, b in zip(acc_params, raw_params, strict=True))
        lines.append(f"accumulator: matches raw within rtol={RTOL}, atol={ATOL} (max |diff| {worst:.3g})")
    return lines


# -- timing ---------------------------------------------------------------------------------------


def rounds(impls: dict[str, Impl], pool: Feed, repeats: int, steps: int) -> dict[str, list[float]]:
    """Seconds per optimizer step of each implementation in each round (order rotated every round)."""
    feeds = {name: feed_for(name, pool, steps) for name in impls}
    order = list(impls)
    times: dict[str, list[float]] = {n: [] for n in order}
    for r in range(repeats):
        k = r % len(order)
        for n in order[k:] + order[:k]:
            gc.collect()
            start = time.perf_counter()
            impls[n].run(feeds[n])
            times[n].append((time.perf_counter() - start) / steps)
        row = "  ".join(f"{n} {times[n][-1] * 1e3:.2f}" for n in order)
        print(f"round {r + 1}/{repeats} (ms/step): {row}", flush=True)
    return times


def written(run_dirs: dict[str, Path], steps: int) -> list[str]:
    """What each closed Run wrote (metrics rows, examples in ``exposure.json``, ``layers.jsonl`` rows) against what
    ``steps`` optimizer steps give."""
    lines = []
    for name, path in run_dirs.items():
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        examples = sum(json.loads((path / "exposure.json").read_text()).values())  # {shard: examples seen}
        layers = path / "layers.jsonl"
        n_layers = len(layers.read_text().splitlines()) if layers.is_file() else 0
        lines.append(
            f"{name}: {sum('loss' in row for row in rows)} metrics rows (steps: {steps}), exposure.json "
            f"{examples} examples (expected {steps * K * MICRO}), {n_layers} layers.jsonl rows"
        )
    return lines


# -- report ---------------------------------------------------------------------------------------


def report(times: dict[str, list[float]], args: argparse.Namespace, params: int) -> None:
    print("\n### Run overhead (bench/run_overhead.py)\n")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"(interop {torch.get_num_interop_threads()}), CPU: {cpu_model()} ({_n_cpus()} logical CPUs), "
        f"Python {platform.python_version()}, steadytrain {_version('steadytrain')}.\n"
    )
    print(
        f"MLP 256-512-512-10 ({params / 1e6:.2f}M parameters), micro-batch {MICRO}, K={K}, clip {MAX_NORM}, AdamW. "
        f"{args.check_steps}-step check, warm-up {args.warmup} steps, R={args.repeats} rounds of S={args.steps} "
        "steps, order rotated; ratios = median over rounds of the paired per-round ratio.\n"
    )
    print("| implementation | ms / optimizer step (median) |")
    print("|---|---:|")
    for n, ts in times.items():
        print(f"| {LABELS[n]} | {statistics.median(ts) * 1e3:.3f} |")
    print("\n| ratio | median (paired) | range | difference, us / step (median, paired) |")
    print("|---|---:|---:|---:|")
    for a, b in RATIOS:
        r = [x / y for x, y in zip(times[a], times[b], strict=True)]
        d = statistics.median(x - y for x, y in zip(times[a], times[b], strict=True)) * 1e6
        bold = "**" if (a, b) == HEADLINE else ""
        print(f"| {a} / {b} | {bold}{statistics.median(r):.3f}{bold} | {min(r):.3f}-{max(r):.3f} | {d:+.0f} |")
    a, b = HEADLINE
    headline = statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
    print(f"\nheadline: {a} / {b} = {headline:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=61, help="rounds (default 61)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per implementation per round, a multiple "
                   f"of {LOG_EVERY} (default 20)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--warmup", type=int, default=10, help="untimed optimizer steps per implementation (default 10)")
    p.add_argument("--check-steps", type=int, default=5, help="steps of the equivalence check (default 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.steps % LOG_EVERY:
        p.error(f"--repeats must be >= 1 and --steps a positive multiple of {LOG_EVERY}")
    if args.warmup < 0 or args.check_steps < 1:
        p.error("--warmup must be >= 0 and --check-steps >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"bench/run_overhead.py: torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_model()}")

    n_micro = K * max(args.steps, args.check_steps, args.warmup)
    setup = make_setup("small", n_micro, argparse.Namespace(seed=args.seed, small_batch=MICRO))
    pool: Feed = [(x, y, torch.arange(MICRO) + MICRO * i) for i, (x, y) in enumerate(setup.pool)]
    with tempfile.TemporaryDirectory(prefix="run_overhead_") as tmp, contextlib.ExitStack() as stack:
        run_dirs = {RUN: Path(tmp) / "run", LAYERS: Path(tmp) / "run_layers", NOCLOCK: Path(tmp) / "run_noclock"}
        impls = {RAW: make_raw(setup.model, setup.loss_fn), ACC: make_steadytrain(setup.model, setup.loss_fn)}
        impls[ACC].name = ACC
        impls[AGAIN] = make_steadytrain(setup.model, setup.loss_fn)  # the same code again: what a ratio of 1 reads
        impls[AGAIN].name = AGAIN
        impls[RUN], run = make_run(RUN, setup.model, setup.loss_fn, run_dirs[RUN], stack)
        impls[LAYERS], run_l = make_run(
            LAYERS, setup.model, setup.loss_fn, run_dirs[LAYERS], stack, layers=True, layers_every=LOG_EVERY
        )
        impls[NOCLOCK], run_n = make_run(NOCLOCK, setup.model, setup.loss_fn, run_dirs[NOCLOCK], stack)
        run_n.parts.clock = run_n.parts.metrics.clock = None  # the time account off: what it costs a step
        for line in check(impls, {RUN: run, LAYERS: run_l, NOCLOCK: run_n}, pool, args.check_steps):
            print("check:", line, flush=True)
        for name, impl in impls.items():
            impl.run(feed_for(name, pool, args.warmup))
        times = rounds(impls, pool, args.repeats, args.steps)
        stack.close()  # the Runs' last metrics rows and exposure.json
        for line in written(run_dirs, args.check_steps + args.warmup + args.repeats * args.steps):
            print("written:", line)
    report(times, args, n_params(impls[RAW].module))
    return 0


if __name__ == "__main__":
    sys.exit(main())
