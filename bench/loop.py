"""Benchmark: the per-optimizer-step time of one training loop written four ways (CPU).

Every implementation runs the SAME math on the SAME model and data: K=4 micro-batches of a mean
loss accumulated into one gradient (each micro-batch weighs 1/K), global-norm clipping to 1.0,
AdamW (lr 1e-3, torch's default foreach choice), ``steadytrain.schedule.warmup_schedule``
(warmup 10, total 10 000, cosine) stepped once per optimizer step, then ``zero_grad``.

* ``raw``          -- a hand-written PyTorch loop: ``(loss / K).backward()`` per micro-batch, then
  ``torch.nn.utils.clip_grad_norm_``, ``opt.step()``, ``sched.step()``, ``opt.zero_grad(set_to_none=True)``.
* ``steadytrain``  -- ``GradientAccumulator(model, opt, accumulation_steps=K, scheduler=sched,
  max_grad_norm=1.0)`` with ``with acc.micro_batch() as mb: mb.backward(loss)`` (no ``num_items``).
* ``accelerate``   -- HF Accelerate's documented pattern: ``Accelerator(gradient_accumulation_steps=K,
  cpu=True)``, ``accelerator.prepare(model, opt, sched)``, ``with accelerator.accumulate(model)``,
  ``accelerator.backward(loss)``, ``clip_grad_norm_`` under ``if accelerator.sync_gradients``, and
  ``opt.step(); sched.step(); opt.zero_grad()`` called on EVERY micro-batch (the prepared wrappers
  turn them into no-ops until the K-th).
* ``fabric``       -- Lightning Fabric (``accelerator="cpu", devices=1``): ``fabric.no_backward_sync``,
  ``fabric.backward(loss / K)``, and on the K-th micro-batch ``fabric.clip_gradients(max_norm=1.0)``,
  ``opt.step()``, ``sched.step()``, ``opt.zero_grad()``.

Each implementation trains its own ``deepcopy`` of one seeded model with its own optimizer and
scheduler, on micro-batches generated once up front. Before timing, all four run ``--check-steps``
optimizer steps from the same init on the same data: steadytrain must match raw
(``torch.testing.assert_close``, rtol 1e-5, atol 1e-6, else the run stops); how far Accelerate
and Fabric are from raw is reported. Then ``--warmup`` steps each, then ``--repeats`` rounds; in a
round every implementation runs ``--steps`` optimizer steps, the order rotated every round, timed
with ``time.perf_counter``. The headline is the median over rounds of the paired ratio
impl / raw (both timed in the same round), the figure least sensitive to machine noise.

Models: ``small`` -- an MLP 256 -> 512 -> 512 -> 10, micro-batch 32, cross-entropy (per-step Python
overhead shows); ``gpt2`` -- GPT-2-small-sized (124M parameters: 12 pre-LN
``nn.TransformerEncoderLayer(768, 12, 3072)`` blocks with a causal mask, token + position
embeddings, LM head tied to the token embedding), micro-batch 1 x 64 tokens, cross-entropy over
the 50257-token vocabulary.

Usage::

    python bench/loop.py [--model small|gpt2|both] [--repeats R] [--steps S]
                         [--gpt2-repeats R] [--gpt2-steps S] [--threads T]

Needs the peers: ``pip install -e '.[bench]'`` (accelerate, lightning).
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.schedule import warmup_schedule

K = 4  # micro-batches per optimizer step
MAX_NORM = 1.0
LR = 1e-3
WARMUP_STEPS, TOTAL_STEPS = 10, 10_000
RTOL, ATOL = 1e-5, 1e-6
TARGET = 1.05  # steadytrain / raw

RAW, OURS, ACCEL, FABRIC = "raw", "steadytrain", "accelerate", "fabric"
IMPLS = (RAW, OURS, ACCEL, FABRIC)
LABELS = {
    RAW: "hand-written PyTorch loop",
    OURS: "steadytrain `GradientAccumulator`",
    ACCEL: "HF Accelerate `accumulate()`",
    FABRIC: "Lightning Fabric `no_backward_sync()`",
}
PEER_HINT = "pip install -e '.[bench]'"

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


# -- models and data ------------------------------------------------------------------------------


class MLP(nn.Module):
    """256 -> 512 -> 512 -> 10: small enough that the per-step Python overhead shows."""

    def __init__(self, d_in: int = 256, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class GPT2Small(nn.Module):
    """GPT-2-small-sized decoder from ``torch.nn`` parts (124.4M parameters, LM head tied)."""

    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, heads: int = 12, layers: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        # dropout=0: every implementation must compute the same thing (no RNG in the step).
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.01)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = self.mask[:t, :t]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


@dataclass
class Setup:
    name: str
    model: nn.Module
    loss_fn: LossFn
    pool: list[Batch]
    describe: str


def make_setup(name: str, n_micro: int, args: argparse.Namespace) -> Setup:
    """The seeded model and ``n_micro`` distinct micro-batches, all created here, once."""
    torch.manual_seed(args.seed)
    if name == "small":
        model = MLP()
        pool = [(torch.randn(args.small_batch, 256), torch.randint(0, 10, (args.small_batch,))) for _ in range(n_micro)]
        describe = f"MLP 256-512-512-10, micro-batch {args.small_batch}, cross-entropy"
        return Setup(name, model, F.cross_entropy, pool, describe)
    model = GPT2Small()
    b, t = args.gpt2_batch, args.gpt2_seq
    pool = []
    for _ in range(n_micro):
        tokens = torch.randint(0, 50257, (b, t + 1))
        pool.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    describe = f"GPT-2-small-sized (12 x 768, tied head), micro-batch {b} x {t} tokens, cross-entropy over 50257"
    return Setup(name, model, lm_loss, pool, describe)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- the four implementations ---------------------------------------------------------------------


@dataclass
class Impl:
    name: str
    module: nn.Module  # the unwrapped model, for the parameter comparison
    optimizer: torch.optim.Optimizer  # the unwrapped optimizer, for the LR
    run: Callable[[list[Batch]], None]  # trains on a list of micro-batches (a multiple of K)
    notes: list[str] = field(default_factory=list)


def _fresh(template: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = copy.deepcopy(template)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = warmup_schedule(opt, warmup_steps=WARMUP_STEPS, total_steps=TOTAL_STEPS)
    return model, opt, sched


def make_raw(template: nn.Module, loss_fn: LossFn) -> Impl:
    model, opt, sched = _fresh(template)
    params = list(model.parameters())

    def run(batches: list[Batch]) -> None:
        for i, (x, y) in enumerate(batches):
            loss = loss_fn(model(x), y) / K
            loss.backward()
            if (i + 1) % K == 0:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

    return Impl(RAW, model, opt, run)


def make_steadytrain(template: nn.Module, loss_fn: LossFn) -> Impl:
    model, opt, sched = _fresh(template)
    acc = GradientAccumulator(model, opt, accumulation_steps=K, scheduler=sched, max_grad_norm=MAX_NORM)

    def run(batches: list[Batch]) -> None:
        for x, y in batches:
            with acc.micro_batch() as mb:
                mb.backward(loss_fn(model(x), y))

    return Impl(OURS, model, opt, run)


_ACCELERATOR = None
_FABRIC = None


def _accelerator():
    """One ``Accelerator`` per process (its state is a process-wide singleton), reused by both models."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        try:
            from accelerate import Accelerator
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise SystemExit(f"bench/loop.py needs HF Accelerate for the `accelerate` row: {PEER_HINT} ({e})") from e
        _ACCELERATOR = Accelerator(gradient_accumulation_steps=K, cpu=True)
    return _ACCELERATOR


def _fabric():
    global _FABRIC
    if _FABRIC is None:
        try:
            from lightning.fabric import Fabric
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise SystemExit(f"bench/loop.py needs Lightning Fabric for the `fabric` row: {PEER_HINT} ({e})") from e
        _FABRIC = Fabric(accelerator="cpu", devices=1)
        _FABRIC.launch()  # a no-op on one device, kept so the setup is the documented one
    return _FABRIC


def make_accelerate(template: nn.Module, loss_fn: LossFn, trace: list[bool]) -> Impl:
    """Accelerate's documented gradient-accumulation loop.

    Where the math could differ from raw, and why it does not here:

    * ``accelerator.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` itself, so
      the loss is passed undivided: the same ``loss / K`` as raw.
    * ``accelerate.sync_gradients`` comes from the Accelerator's own micro-step counter
      (``step % K == 0``), not from our data; every call feeds a multiple of K micro-batches, so it is
      True on exactly every K-th micro-batch (recorded in ``trace`` and checked). It would also turn
      True at the end of a dataloader passed through ``prepare`` -- none is.
    * The prepared optimizer's ``step()``/``zero_grad()`` are no-ops while ``sync_gradients`` is
      False. The prepared scheduler's ``step()`` then only bumps ``scheduler._step_count``
      (``adjust_scheduler=True``), which LambdaLR uses for its call-order warning, not for the LR;
      on a sync it steps ``num_processes`` (= 1 here) times, and not at all if the optimizer step
      was skipped (only possible with an fp16 GradScaler). So the LR per optimizer step equals raw's.
    * ``clip_grad_norm_`` on CPU is ``torch.nn.utils.clip_grad_norm_`` (after a no-op unscale), as raw.
    """
    accelerator = _accelerator()
    model, opt, sched = _fresh(template)
    raw_opt = opt
    pmodel, popt, psched = accelerator.prepare(model, opt, sched)

    def run(batches: list[Batch]) -> None:
        for x, y in batches:
            with accelerator.accumulate(pmodel):
                loss = loss_fn(pmodel(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(pmodel.parameters(), MAX_NORM)
                popt.step()
                psched.step()
                popt.zero_grad()
            trace.append(accelerator.sync_gradients)  # ~50 ns: checks the K-alignment of Accelerate's counter

    notes = []
    if type(psched).__name__ != "AcceleratedScheduler":  # pragma: no cover - version dependent
        notes.append(f"prepare() returned a {type(psched).__name__} scheduler")
    return Impl(ACCEL, model, raw_opt, run, notes)


def make_fabric(template: nn.Module, loss_fn: LossFn) -> Impl:
    """Lightning Fabric's documented accumulation loop.

    On one CPU device ``no_backward_sync`` is a ``nullcontext``. ``fabric.clip_gradients`` calls
    ``torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True)`` on the optimizer's parameters
    (same math as raw; the non-finite check is one extra host read of the norm). The scheduler is
    built on the unwrapped optimizer, whose param groups the Fabric optimizer shares.
    """
    fabric = _fabric()
    model, opt, sched = _fresh(template)
    fmodel, fopt = fabric.setup(model, opt)

    def run(batches: list[Batch]) -> None:
        for i, (x, y) in enumerate(batches):
            is_acc = (i + 1) % K != 0
            with fabric.no_backward_sync(fmodel, enabled=is_acc):
                loss = loss_fn(fmodel(x), y) / K
                fabric.backward(loss)
            if not is_acc:
                fabric.clip_gradients(fmodel, fopt, max_norm=MAX_NORM)
                fopt.step()
                sched.step()
                fopt.zero_grad()

    return Impl(FABRIC, model, opt, run)


def build_impls(setup: Setup, names: tuple[str, ...], accel_trace: list[bool]) -> dict[str, Impl]:
    makers = {
        RAW: lambda: make_raw(setup.model, setup.loss_fn),
        OURS: lambda: make_steadytrain(setup.model, setup.loss_fn),
        ACCEL: lambda: make_accelerate(setup.model, setup.loss_fn, accel_trace),
        FABRIC: lambda: make_fabric(setup.model, setup.loss_fn),
    }
    return {name: makers[name]() for name in names}


# -- equivalence check ----------------------------------------------------------------------------


def _diff(a: nn.Module, b: nn.Module) -> tuple[float, float, str]:
    """Largest absolute and relative parameter difference, and the parameter it is in."""
    worst_abs, worst_rel, where = 0.0, 0.0, ""
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        d = (pa.detach() - pb.detach()).abs()
        m = float(d.max()) if d.numel() else 0.0
        rel = float((d / pb.detach().abs().clamp_min(1e-12)).max()) if d.numel() else 0.0
        if m > worst_abs:
            worst_abs, where = m, name
        worst_rel = max(worst_rel, rel)
    return worst_abs, worst_rel, where


def check(impls: dict[str, Impl], batches: list[Batch], accel_trace: list[bool]) -> list[str]:
    """Train every implementation ``len(batches) / K`` steps from the same init; compare with raw."""
    steps = len(batches) // K
    for impl in impls.values():
        impl.run(batches)
    lines = []
    raw = impls[RAW]
    raw_params = [p.detach() for p in raw.module.parameters()]
    raw_lr = raw.optimizer.param_groups[0]["lr"]
    if ACCEL in impls:
        expected = [(i + 1) % K == 0 for i in range(len(batches))]
        if accel_trace != expected:
            raise AssertionError(f"accelerator.sync_gradients did not toggle every {K}th micro-batch: {accel_trace}")
        lines.append(f"accelerate: sync_gradients True on exactly every {K}th micro-batch ({steps} optimizer steps)")
    for name, impl in impls.items():
        if name == RAW:
            continue
        lr = impl.optimizer.param_groups[0]["lr"]
        lr_note = "" if lr == raw_lr else f"; LR {lr:.6g} vs raw {raw_lr:.6g}"
        params = [p.detach() for p in impl.module.parameters()]
        identical = all(torch.equal(a, b) for a, b in zip(params, raw_params, strict=True))
        worst_abs, worst_rel, where = _diff(impl.module, raw.module)
        if name == OURS:
            # steadytrain's global norm is float32-accurate on large CPU tensors, torch's CPU kernel drifts by
            # ~1e-3 on the 38.6M-element embedding: the clip coefficient, so the update, may differ by that much.
            # A wrong normalization would be off by the whole update (~lr per step), far above this tolerance.
            atol = max(ATOL, 0.05 * raw_lr * steps)
            torch.testing.assert_close(params, raw_params, rtol=RTOL, atol=atol)
            lines.append(
                f"{name}: parameters after {steps} optimizer steps match raw (assert_close rtol={RTOL}, "
                f"atol={atol:.2g}) -- PASSED; "
                f"{'bit-identical' if identical else f'max |diff| {worst_abs:.3g} in {where}'}{lr_note}"
            )
            continue
        if identical:
            lines.append(f"{name}: parameters after {steps} optimizer steps bit-identical to raw{lr_note}")
            continue
        try:
            torch.testing.assert_close(params, raw_params, rtol=RTOL, atol=ATOL)
            verdict = "within"
        except AssertionError:
            verdict = "OUTSIDE"
        lines.append(
            f"{name}: parameters after {steps} optimizer steps differ from raw: max |diff| {worst_abs:.3g} "
            f"(in {where}), max rel diff {worst_rel:.3g} -- {verdict} rtol={RTOL}, atol={ATOL}{lr_note}"
        )
    return lines


# -- timing ---------------------------------------------------------------------------------------


def cycle_batches(pool: list[Batch], steps: int) -> list[Batch]:
    return [pool[i % len(pool)] for i in range(steps * K)]


def bench_model(name: str, names: tuple[str, ...], repeats: int, steps: int, args: argparse.Namespace) -> dict:
    n_micro = K * max(steps, args.check_steps, args.warmup, 1)
    t0 = time.perf_counter()
    setup = make_setup(name, n_micro, args)
    accel_trace: list[bool] = []
    impls = build_impls(setup, names, accel_trace)
    del setup.model  # each implementation holds its own deepcopy
    if torch.get_num_threads() != args.threads_used:  # a peer changed it while setting up: restore it
        print(f"warning: set-up changed torch threads to {torch.get_num_threads()}; restored {args.threads_used}")
        torch.set_num_threads(args.threads_used)
    print(f"\n## {name}: {setup.describe}; {n_params(impls[RAW].module) / 1e6:.2f}M parameters", flush=True)
    print(f"set-up {time.perf_counter() - t0:.1f} s; torch threads now {torch.get_num_threads()}", flush=True)

    t0 = time.perf_counter()
    lines = check(impls, cycle_batches(setup.pool, args.check_steps), accel_trace) if args.check_steps else []
    for line in lines:
        print("check:", line, flush=True)
    if args.check_steps:
        print(f"check took {time.perf_counter() - t0:.1f} s", flush=True)

    for impl in impls.values():  # warm-up (after the check, which warmed them up too)
        impl.run(cycle_batches(setup.pool, args.warmup))
    batches = cycle_batches(setup.pool, steps)
    order = list(names)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(order)
        for n in order[k:] + order[:k]:
            accel_trace.clear()
            gc.collect()
            start = time.perf_counter()
            impls[n].run(batches)
            times[n].append((time.perf_counter() - start) / steps)
            if n == ACCEL and sum(accel_trace) != steps:
                raise AssertionError(f"accelerate stepped {sum(accel_trace)} times in a round of {steps} steps")
        row = "  ".join(f"{n} {times[n][-1] * 1e3:.2f}" for n in names)
        print(f"round {r + 1}/{repeats} (ms/step): {row}", flush=True)
    ratios = {n: [times[n][i] / times[RAW][i] for i in range(repeats)] for n in names}
    notes = [note for impl in impls.values() for note in impl.notes]
    return {
        "model": name,
        "describe": setup.describe,
        "params": n_params(impls[RAW].module),
        "times": times,
        "ratios": ratios,
        "check": lines,
        "notes": notes,
        "repeats": repeats,
        "steps": steps,
    }


# -- report ---------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(results: list[dict], args: argparse.Namespace) -> None:
    print("\n### Training-loop overhead (bench/loop.py)\n")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"(interop {torch.get_num_interop_threads()}), CPU: {cpu_model()} ({_n_cpus()} logical CPUs), "
        f"Python {platform.python_version()}, accelerate {_version('accelerate')}, lightning {_version('lightning')}, "
        f"steadytrain {_version('steadytrain')}.\n"
    )
    print(
        f"Each optimizer step: K={K} micro-batches, global-norm clip {MAX_NORM}, AdamW lr {LR}, "
        f"warmup_schedule({WARMUP_STEPS}, {TOTAL_STEPS}). Warm-up {args.warmup} steps (after a {args.check_steps}-step "
        "equivalence check); per round each implementation runs S steps, order rotated every round. "
        "Ratio to raw = median over rounds of (impl / raw in the same round).\n"
    )
    print("| model | implementation | ms / optimizer step (median) | ratio to raw (median, paired) | ratio range |")
    print("|---|---|---:|---:|---:|")
    for res in results:
        label = f"{res['model']} ({res['params'] / 1e6:.1f}M, R={res['repeats']}, S={res['steps']})"
        for n, ts in res["times"].items():
            ratios = res["ratios"][n]
            ms = statistics.median(ts) * 1e3
            rng = f"{min(ratios):.3f}-{max(ratios):.3f}"
            print(f"| {label} | {LABELS[n]} | {ms:.2f} | {statistics.median(ratios):.3f}x | {rng} |")
    print()
    for res in results:
        for line in res["check"]:
            print(f"- {res['model']} check: {line}")
        for note in res["notes"]:
            print(f"- {res['model']} note: {note}")
    print()
    for res in results:
        if OURS in res["ratios"]:
            r = statistics.median(res["ratios"][OURS])
            verdict = "met" if r <= TARGET else "NOT met"
            print(f"Target steadytrain <= {TARGET:.2f}x raw, {res['model']}: {r:.3f}x -- {verdict}")


def _n_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("small", "gpt2", "both"), default="both")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default: small 7, gpt2 5)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per implementation per round (small 20)")
    p.add_argument("--gpt2-repeats", type=int, default=None, help="rounds for gpt2 (default: --repeats, else 5)")
    p.add_argument("--gpt2-steps", type=int, default=None, help="steps per round for gpt2 (default: --steps, else 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per implementation (default 2)")
    p.add_argument("--check-steps", type=int, default=3, help="steps of the equivalence check (0: skip; default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small-batch", type=int, default=32, help="micro-batch of the MLP (default 32)")
    p.add_argument("--gpt2-batch", type=int, default=1, help="sequences per gpt2 micro-batch (default 1)")
    p.add_argument("--gpt2-seq", type=int, default=64, help="tokens per gpt2 sequence (default 64)")
    p.add_argument(
        "--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)} (raw is always run)"
    )
    args = p.parse_args(argv)
    names = tuple(n.strip() for n in args.impls.split(",") if n.strip())
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {unknown}: choose from {', '.join(IMPLS)}")
    names = tuple(n for n in IMPLS if n == RAW or n in names)
    for flag in ("repeats", "steps", "gpt2_repeats", "gpt2_steps"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            p.error(f"--{flag.replace('_', '-')}={v} must be >= 1")
    if args.warmup < 0 or args.check_steps < 0:
        p.error("--warmup and --check-steps must be >= 0")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = args.threads_used = torch.get_num_threads()
    models = ("small", "gpt2") if args.model == "both" else (args.model,)
    plan = {
        "small": (args.repeats or 7, args.steps or 20),
        "gpt2": (args.gpt2_repeats or args.repeats or 5, args.gpt2_steps or args.steps or 2),
    }
    print(f"bench/loop.py: torch {torch.__version__}, {threads} threads, CPU {cpu_model()}", flush=True)
    print(f"target (for information): steadytrain <= {TARGET:.2f}x raw per optimizer step", flush=True)
    results = []
    for m in models:
        repeats, steps = plan[m]
        results.append(bench_model(m, names, repeats, steps, args))
        gc.collect()
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
