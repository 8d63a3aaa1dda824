"""How far healthy per-step losses stray from their running median: the evidence for the spike defaults.

Trains clean runs (no bad data) with spike detection off and measures, at every step past the first
``window`` (and past warmup), the step loss against the median and the median absolute deviation
(MAD) of the previous ``window`` losses: the ratio ``loss / median`` and the deviation
``(loss - median) / MAD``, and counts the steps the shipped detector flags with the default
``spike.threshold`` (MADs) and ``spike.min_ratio`` (x median): a step is a spike only when it exceeds
both. Runs: the embedded default (`steadytrain train`, tiny-lm on the
standard library's sources, 200 steps), tiny-lm on the same corpus for 300 steps with 30 warmup
steps, the spike demo's regression data without the bad shard (300 steps, warmup 30; and with a
global batch of 8, a noisy curve), and the NaN
demo's classification data without the bad shard (300 steps).

Usage::

    python bench/spike_stats.py [--window 50] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

EXE = str(Path(sys.executable).with_name("steadytrain"))


def deviations(losses: list[float], window: int, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step past ``window`` and ``warmup``: ``loss / median`` and ``(loss - median) / MAD`` of the previous
    ``window`` losses."""
    x = np.asarray(losses, dtype=np.float64)
    ratios, devs = [], []
    for t in range(max(window, warmup), len(x)):
        prev = x[t - window : t]
        med = np.median(prev)
        mad = np.median(np.abs(prev - med))
        ratios.append(x[t] / med)
        devs.append((x[t] - med) / mad if mad > 0 else np.inf)
    return np.array(ratios), np.array(devs)


def flagged(losses: list[float], warmup: int) -> int:
    """Steps the shipped detector flags with the default settings (``SpikeConfig()``) on these losses."""
    import torch

    from steadytrain.guard import SpikeDetector
    from steadytrain.train.setup.config import SpikeConfig

    c = SpikeConfig()
    d = SpikeDetector(window=c.window, threshold=c.threshold, min_ratio=c.min_ratio, warmup_steps=warmup)
    return sum(bool(d.update(step, torch.tensor(v))[0]) for step, v in enumerate(losses, 1))


def _train(run: Path, config: dict | None, extra: list[str]) -> list[float]:
    cmd = [EXE, "train", "--run-dir", str(run), "--set", "spike.policy=off", *extra]
    if config is not None:
        cfg_path = run.with_suffix(".yaml")
        cfg_path.write_text(yaml.safe_dump(config))
        cmd.insert(2, str(cfg_path))
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "val_loss" not in r and "rollback_to" not in r]


def runs(root: Path) -> dict[str, tuple[list[float], int]]:
    from steadytrain.diagnose import demo, spikedemo

    out = {}
    out["embedded default (tiny-lm, 200 steps)"] = (_train(root / "default", None, []), 20)
    lm = ["--set", "run.max_steps=300", "--set", "batch.warmup_steps=30"]
    out["tiny-lm, 300 steps, warmup 30"] = (_train(root / "lm300", None, lm), 30)
    reg = spikedemo.make_dataset(root / "reg-data", shards=640)
    cfg = spikedemo.train_config(reg, steps=300, policy="off")
    cfg["batch"]["warmup_steps"] = 30
    out["regression (spike demo data, clean), 300 steps, warmup 30"] = (_train(root / "reg", cfg, []), 30)
    cfg = spikedemo.train_config(reg, steps=300, policy="off")
    cfg["batch"].update(micro_batch_size=8, global_batch_size=8, base_batch_size=8, warmup_steps=30)
    out["regression, batch 8 (noisy), 300 steps, warmup 30"] = (_train(root / "reg8", cfg, []), 30)
    cls = demo.make_dataset(root / "cls-data", shards=160, bad_shard=None)
    cfg = demo.train_config(cls, epochs=1)
    cfg["run"] = {"max_steps": 300, "log_every": 10}
    out["classification (NaN demo data, clean), 300 steps"] = (_train(root / "cls", cfg, []), 5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="spike-stats-"))
    root.mkdir(parents=True, exist_ok=True)
    print("| run | steps judged | loss/median p50 / p99 / max | MADs above median p50 / p99 / max | flagged |")
    print("|---|---|---|---|---|")
    worst_r = worst_d = 0.0
    for name, (losses, warmup) in runs(root).items():
        r, d = deviations(losses, args.window, warmup)
        worst_r, worst_d = max(worst_r, r.max()), max(worst_d, d[np.isfinite(d)].max())
        q = lambda a: " / ".join(f"{v:.2f}" for v in np.percentile(a[np.isfinite(a)], [50, 99, 100]))  # noqa: E731
        print(f"| {name} | {len(r)} | {q(r)} | {q(d)} | {flagged(losses, warmup)} |")
    print(f"\nlargest over all runs: {worst_r:.2f} x median, {worst_d:.1f} MADs (window {args.window})")


if __name__ == "__main__":
    main()
