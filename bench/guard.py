"""Benchmark: what NaN diagnosis costs. Target: recording <= 1% per-step overhead; hunt <= 2x a forward pass.

1. Recording on vs off: ``steadytrain train`` (one process, the tabular model on the NaN demo's
   data without a bad shard, so every step is a normal one) as shipped, against the same loop with
   the recording taken out (no per-example non-finite flags in the micro-batch tags, no per-shard
   exposure counts, no exposure file at the logging interval). Per-step time from ``--skip`` on;
   rounds alternate the two sides; the ratio is the median of paired ratios.
2. Hunt vs a plain forward pass over the same shard: the hunt's sweep (hooks on every module, one
   flag read per chunk, bisection of the bad chunks) against ``model(chunk)`` under ``no_grad`` over
   the same chunks, on the demo's bad shard (a quarter of its rows produce NaN); also the whole
   ``hunt()`` call (model build from the run, checkpoint load, schema inference for the fields).

3. The spike detector (issue 19): step time of ``steadytrain train`` on tiny-lm (the tests' small config on
   a byte dataset of this project's sources) with ``spike.policy: warn`` against ``off`` (target <= 1.02x;
   rounds alternate the two sides; the median of paired ratios), and the device-to-host reads per optimizer
   step (``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()``, ``float(tensor)``: counted with a
   ``TorchFunctionMode``) that ``warn`` and ``skip`` add to ``off`` (target: 0).

Usage::

    python bench/guard.py [--steps N] [--repeats R] [--rows ROWS_PER_SHARD] [--only spikes]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from steadytrain.diagnose import hunt
from steadytrain.diagnose.demo import make_dataset, train_config
from steadytrain.diagnose.hunt import MIN_CHUNK, _shard_batch, _sweep
from steadytrain.runs.replay import run_model
from steadytrain.train.job import files as runfiles
from steadytrain.train.job import loop
from steadytrain.train.job.loop import train
from steadytrain.train.setup.config import TrainConfig, load_config
from steadytrain.train.setup.models import check_losses


def _micro_batch_unrecorded(job, mb):
    """``loop._micro_batch`` without the recording: no flags in the tag, no exposure counts."""
    dev = job.info.device
    batch = {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
    job.step.lr = job.optimizer.param_groups[0]["lr"]
    with job.acc.micro_batch(tag={"shard": mb["shard"], "index": mb["index"]}) as m:
        out = job.model(batch)
        loss = check_losses(out, len(mb["index"])).float().mean()
        m.backward(loss)
        job.step.loss = loss.detach() if m.position == 0 else job.step.loss + loss.detach()
        job.step.micros = m.position + 1
    return m.result, job.step.loss / job.step.micros


def per_step(run_dir: Path, skip: int) -> float:
    t = [json.loads(line)["elapsed_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (t[-1] - t[skip - 1]) / (len(t) - skip)


def one_run(cfg: TrainConfig, run_dir: Path, skip: int, recording: bool) -> float:
    off = (
        [
            mock.patch.object(loop, "_micro_batch", _micro_batch_unrecorded),
            mock.patch.object(runfiles, "write_exposure", lambda job: {}),
        ]
        if not recording
        else []
    )
    with contextlib.ExitStack() as stack:
        for patch in off:
            stack.enter_context(patch)
        train(cfg, run_dir=run_dir)
    return per_step(run_dir, skip)


def bench_recording(work: Path, steps: int, repeats: int, skip: int) -> None:
    data = make_dataset(work / "clean", shards=64, rows=1024, bad_shard=None)
    raw = train_config(data, epochs=1)
    raw["batch"].update(micro_batch_size=256, global_batch_size=1024, base_batch_size=1024)
    raw["run"].update(max_steps=steps)
    raw["checkpoint"]["every_steps"] = steps + 1
    raw["spike"] = {"policy": "off"}  # the non-finite recording alone (the spike detector has its own part)
    cfg = TrainConfig.model_validate(raw)
    on, off, ratios = [], [], []
    for r in range(repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        times = {rec: one_run(cfg, work / f"run-{r}-{rec}", skip, rec) for rec in order}
        on.append(times[True])
        off.append(times[False])
        ratios.append(times[True] / times[False])
        print(f"  round {r}: recording on {on[-1] * 1e3:.2f} ms/step, off {off[-1] * 1e3:.2f} ms/step, "
              f"ratio {ratios[-1]:.4f}")  # fmt: skip
    print(f"recording: on {statistics.median(on) * 1e3:.2f} ms/step, off {statistics.median(off) * 1e3:.2f} ms/step, "
          f"overhead {100 * (statistics.median(ratios) - 1):+.2f}% (target <= 1%)")  # fmt: skip


def bench_hunt(work: Path, rows: int, repeats: int) -> None:
    data = make_dataset(work / "scenario", shards=16, rows=rows, bad_shard=5)
    raw = train_config(data, epochs=1)
    raw["run"].update(max_steps=8)
    raw["checkpoint"]["every_steps"] = 2
    run = work / "hunt-run"
    train(TrainConfig.model_validate(raw), run_dir=run)
    model, settings = run_model(run)
    model.eval()
    batch = _shard_batch(settings, 5)
    chunk, n = max(settings["micro_batch_size"], MIN_CHUNK), rows  # as hunt() chooses
    plain, swept, whole = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            for s in range(0, n, chunk):
                model({k: v[s : s + chunk] for k, v in batch.items()})
        t1 = time.perf_counter()
        bad, _, _ = _sweep(model, batch, chunk)
        t2 = time.perf_counter()
        hunt(run, 5, loader=run_model)
        t3 = time.perf_counter()
        plain.append(t1 - t0)
        swept.append(t2 - t1)
        whole.append(t3 - t2)
    p, s, w = (statistics.median(x) for x in (plain, swept, whole))
    print(f"hunt over a {n}-row shard ({len(bad)} bad rows, chunks of {chunk}): plain forward {p * 1e3:.1f} ms, "
          f"hunt sweep + bisection {s * 1e3:.1f} ms = {s / p:.2f}x (target <= 2x); "
          f"whole hunt() call incl. model build and schema {w:.2f} s")  # fmt: skip


_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.cpu, torch.Tensor.__float__,
          torch.Tensor.__int__, torch.Tensor.numpy}  # fmt: skip


class ReadCounter(TorchFunctionMode):
    """Counts the calls that read a tensor's values to the host (on a GPU: a device-to-host sync each)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _lm_config(work: Path, steps: int, policy: str) -> TrainConfig:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.train_utils import TINY, write_text_dataset

    data = work / "text"
    if not data.exists():
        write_text_dataset(data, [400] * 16)
    overrides = [*TINY, f"data.path={data}", f"run.max_steps={steps}", f"spike.policy={policy}"]
    overrides += [f"checkpoint.every_steps={steps + 1}", "eval.holdout_shards=null"]
    return load_config(overrides=overrides)


def bench_spikes(work: Path, steps: int, repeats: int, skip: int) -> None:
    cfg = {p: _lm_config(work, steps, p) for p in ("off", "warn", "skip")}
    warn, off, ratios = [], [], []
    for r in range(repeats):
        order = ("warn", "off") if r % 2 == 0 else ("off", "warn")
        times = {p: one_run(cfg[p], work / f"lm-{r}-{p}", skip, True) for p in order}
        warn.append(times["warn"])
        off.append(times["off"])
        ratios.append(times["warn"] / times["off"])
        print(
            f"  round {r}: warn {warn[-1] * 1e3:.2f} ms/step, off {off[-1] * 1e3:.2f} ms/step, ratio {ratios[-1]:.4f}"
        )
    print(f"spike detector: warn {statistics.median(warn) * 1e3:.2f} ms/step, off {statistics.median(off) * 1e3:.2f} "
          f"ms/step, ratio {statistics.median(ratios):.4f} (target <= 1.02)")  # fmt: skip
    reads = {}
    for p, c in cfg.items():
        with ReadCounter() as counter:
            train(c, run_dir=work / f"reads-{p}")
        reads[p] = counter.reads / steps
    print("host reads per optimizer step (log_every 10, all of the loop): " + ", ".join(
        f"{p} {n:.2f}" for p, n in reads.items()) + f"; added by warn {reads['warn'] - reads['off']:+.2f}, "
        f"by skip {reads['skip'] - reads['off']:+.2f} (target 0)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per training run")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each side once per round)")
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out of the per-step time")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the hunted shard")
    parser.add_argument("--only", choices=["nan", "spikes"], default=None, help="one part of the benchmark")
    args = parser.parse_args()
    logging.getLogger("steadytrain").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "spikes":
            bench_recording(Path(tmp), args.steps, args.repeats, args.skip)
            bench_hunt(Path(tmp), args.rows, args.repeats)
        if args.only != "nan":
            bench_spikes(Path(tmp), args.steps, args.repeats, args.skip)


if __name__ == "__main__":
    main()
