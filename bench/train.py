"""Benchmark: per-step time of ``steadytrain train`` against a hand-written loop doing the same work.

Both sides use the same model (built the same way, same seed), the same data (the batched
``ShardedDataset``, same micro-batch, accumulation and order), the same math (loss / K per
micro-batch, global-norm clip at 1.0, fused AdamW, the warmup+cosine LR schedule stepped once per
optimizer step) and the same logging interval (the losses of the interval read once). The
hand-written loop has no run directory, no checkpoints and no non-finite guard; steadytrain's run
writes its metrics, its final checkpoint and its environment manifest (start-up and the final
checkpoint are outside the timed steps).

Per-step time is measured from the first ``--skip`` steps on (warm caches) to the last step;
rounds alternate the two sides and the ratio is the median of paired ratios.

``--speed`` measures the speed settings instead (issue 21): tiny-lm's per-step time with
``model.compile=true`` against eager (the compile time apart), and the bytes autograd saves for the
backward with ``model.activation_checkpointing`` ``full`` and ``selective`` against ``none``.

Usage::

    python bench/train.py [--model tiny-lm|tabular|both] [--steps N] [--repeats R]
    python bench/train.py --speed [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from steadytrain.data import DatasetWriter, ShardedDataset
from steadytrain.schedule import lr_multiplier
from steadytrain.train.job.loop import train
from steadytrain.train.setup.config import load_config
from steadytrain.train.setup.models import build_model
from steadytrain.train.setup.pieces import data_path, model_context, resolve_plan

LOG_EVERY = 10


def tabular_data(path: Path) -> Path:
    """20 shards x 4,000 rows: four numeric features, a 20-value category, a 10-class label."""
    if (path / "index.json").exists():
        return path
    rng = np.random.default_rng(0)
    cats = np.array([f"c{i:02d}" for i in range(20)])
    with DatasetWriter(path, provenance={"pipeline_version": "1", "source": "bench"}) as w:
        for _ in range(20):
            n = 4000
            cols = {f"f{j}": rng.standard_normal(n) for j in range(4)}
            cols["cat"] = cats[rng.integers(0, 20, n)]
            cols["label"] = rng.integers(0, 10, n)
            w.write_shard(pa.table(cols))
    return path


def configs(model: str, steps: int, data_dir: Path) -> list[str]:
    common = [f"run.max_steps={steps}", f"run.log_every={LOG_EVERY}", f"checkpoint.every_steps={steps + 1}"]
    if model == "tiny-lm":  # the embedded default: tiny-lm on the standard library's source, with held-out
        return [*common, f"eval.every_steps={steps + 1}"]  # shards evaluated once, after the timed steps
    path = tabular_data(data_dir / "tabular")  # no validation hold-out: every shard, as the hand-written loop
    return [*common, "model.name=tabular", f"data.path={path}", "batch.micro_batch_size=256",
            "batch.global_batch_size=1024", "batch.base_batch_size=1024", "eval.holdout_fraction=null"]  # fmt: skip


def per_step(times: list[float], skip: int) -> float:
    return (times[-1] - times[skip - 1]) / (len(times) - skip)


def ours(cfg, run_dir: Path, skip: int) -> float:
    train(cfg, run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in rows if "val_loss" not in r]  # training rows (an evaluation's has no time)
    return per_step(elapsed, skip)


def hand_written(cfg, skip: int) -> float:
    """The same job as a plain PyTorch loop."""
    plan0 = resolve_plan(cfg, 1, None)
    path = data_path(cfg)
    ds = ShardedDataset(path, batch_size=cfg.batch.micro_batch_size, accumulation_steps=plan0.accumulation_steps,
                        seed=cfg.run.seed, shuffle_window=cfg.data.shuffle_window)  # fmt: skip
    plan = resolve_plan(cfg, 1, ds.steps_per_epoch)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.name, cfg.model.kwargs(), context=model_context(cfg, path))
    o = cfg.optim
    params = list(model.parameters())  # nanoGPT's groups: matrices decayed, biases and norm gains not
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=plan.lr, betas=o.betas, eps=o.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_multiplier(s, warmup_steps=plan.warmup_steps, total_steps=plan.total_steps, decay="cosine",
                                min_lr_ratio=cfg.batch.min_lr_ratio),
    )  # fmt: skip
    k, step, losses, times = plan.accumulation_steps, 0, [], []
    for i, mb in enumerate(ds):
        loss = model(mb).mean()
        (loss / k).backward()
        losses.append(loss.detach())
        if (i + 1) % k:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        times.append(time.perf_counter())
        if step % LOG_EVERY == 0:
            torch.stack(losses).tolist()  # the interval's losses, read once
            losses.clear()
        if step >= plan.total_steps:
            break
    return per_step(times, skip)


def bench(model: str, steps: int, repeats: int, skip: int, work: Path) -> tuple[float, float, float]:
    cfg = load_config(None, configs(model, steps, work))
    data_path(cfg)  # build the corpus once, untimed
    ratios, a, b = [], [], []
    for r in range(repeats):
        run_dir = work / f"{model}-{r}"
        if r % 2:
            t_raw, t_ours = hand_written(cfg, skip), ours(cfg, run_dir, skip)
        else:
            t_ours, t_raw = ours(cfg, run_dir, skip), hand_written(cfg, skip)
        a.append(t_ours)
        b.append(t_raw)
        ratios.append(t_ours / t_raw)
        print(f"  round {r}: steadytrain {t_ours * 1e3:.1f} ms/step, hand-written {t_raw * 1e3:.1f} ms/step", end="")
        print(f", ratio {ratios[-1]:.3f}")
    return statistics.median(a), statistics.median(b), statistics.median(ratios)


def saved_bytes(model: torch.nn.Module, mb: dict) -> int:
    """Bytes of the activations autograd keeps for one micro-batch's backward (each storage once, no parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(mb).mean()
    loss.backward()
    return sum(seen.values())


def activation_bytes(work: Path) -> None:
    """Saved-activation bytes of the default tiny-lm's micro-batch under each checkpointing mode."""
    from steadytrain.train.setup.speed import apply_activation_checkpointing

    cfg = load_config(None, configs("tiny-lm", 10, work))
    path = data_path(cfg)
    mb = next(iter(ShardedDataset(path, batch_size=cfg.batch.micro_batch_size, accumulation_steps=1)))
    sizes = {}
    for mode, every in (("none", 1), ("full", 1), ("selective", 2)):
        torch.manual_seed(0)
        model = build_model(cfg.model.name, cfg.model.kwargs(), context=model_context(cfg, path))
        if mode != "none":
            apply_activation_checkpointing(model, mode, every=every)
        sizes[mode] = saved_bytes(model, mb)
    print("| activation_checkpointing | saved for backward (MiB) | of none |")
    print("|---|---:|---:|")
    for mode, n in sizes.items():
        print(f"| {mode} | {n / 2**20:.2f} | {n / sizes['none']:.3f} |")


def compile_ratio(steps: int, repeats: int, skip: int, work: Path) -> None:
    """tiny-lm per-step time with model.compile=true against eager, and the compile time."""
    base = configs("tiny-lm", steps, work)
    ratios, comp = [], []
    for r in range(repeats):
        times = {}
        for flag in ("false", "true") if r % 2 == 0 else ("true", "false"):
            cfg = load_config(None, [*base, f"model.compile={flag}"])
            summary = train(cfg, run_dir=work / f"compile-{flag}-{r}")
            rows = (work / f"compile-{flag}-{r}" / "metrics.jsonl").read_text().splitlines()
            times[flag] = per_step([json.loads(x)["elapsed_s"] for x in rows if "val_loss" not in x], skip)
            if flag == "true":
                comp.append(summary.get("compile_s"))
        ratios.append(times["true"] / times["false"])
        print(f"  round {r}: compiled {times['true'] * 1e3:.1f} ms/step, eager {times['false'] * 1e3:.1f} ms/step, "
              f"ratio {ratios[-1]:.3f}, compile {comp[-1]} s")  # fmt: skip
    print(f"compiled / eager per step (median of {repeats}): {statistics.median(ratios):.3f}; compile time {comp} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny-lm", "tabular", "both"], default="both")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--speed", action="store_true", help="compile on/off and activation-checkpointing bytes")
    args = parser.parse_args()
    logging.getLogger("steadytrain").setLevel(logging.WARNING)
    if args.speed:
        with tempfile.TemporaryDirectory() as tmp:
            activation_bytes(Path(tmp))
            compile_ratio(args.steps, args.repeats, args.skip, Path(tmp))
        return
    models = ["tiny-lm", "tabular"] if args.model == "both" else [args.model]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            print(f"{m}: {args.steps} steps x {args.repeats} rounds")
            rows.append((m, *bench(m, args.steps, args.repeats, args.skip, Path(tmp))))
    print("| model | steadytrain ms/step | hand-written ms/step | ratio (median of paired) |")
    print("|---|---:|---:|---:|")
    for m, a, b, r in rows:
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {r:.3f} |")
    print("target: <= 1.05")


if __name__ == "__main__":
    main()
