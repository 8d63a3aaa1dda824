"""``steadytrain demo spike``: a loss spike from a unit change in one shard, rolled back and traced to it.

A regression dataset: the label ``amount`` (an order amount in units, between 1 and 12) from four
numeric features. One shard was written by pipeline 3.1, which writes ``amount`` in cents: its
values are 100 times larger, and a model trained on units sees a loss thousands of times its usual
one on those examples. Shards are half a global batch (``data.shuffle_window: 1``: each batch holds
two whole shards), so the bad shard is in one step's batch, beside a healthy one: the spike's outlying
examples all come from one of the two shards in play. The job runs on 2 ranks with
``spike.policy: rollback``: at the spike it restores the checkpoint before it and continues past
that batch; ``steadytrain spikes report`` names the shard and ``spikes hunt`` its examples, the
field out of the healthy shards' range and the provenance difference. The same data without the
bad shard gives the clean run to compare the final loss with.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

from steadytrain._io import read_jsonl, write_text_atomic
from steadytrain.data import DatasetWriter
from steadytrain.data.order import epoch_windows
from steadytrain.diagnose.demo import launch
from steadytrain.diagnose.hunt import HuntReport, Loader, hunt
from steadytrain.diagnose.ledger import SPIKES
from steadytrain.diagnose.report import NonFiniteReport, report
from steadytrain.errors import UserError

__all__ = ["SpikeDemo", "bad_shard_at", "make_dataset", "run_demo", "train_config"]

PROVENANCE = {"pipeline_version": "3.0", "source": "orders-export", "amount_unit": "units"}
CENTS = {"pipeline_version": "3.1", "source": "orders-export", "amount_unit": "units"}
"""Pipeline 3.1 says units (the bug); the provenance still differs by its version."""
ROWS = 32
"""Rows per shard: half a global batch of the demo."""
BATCH = 2 * ROWS


def bad_shard_at(position: int, shards: int, seed: int = 0) -> int:
    """The shard id that epoch 0 reads ``position``-th (0-based) with shuffle window 1 and ``seed``: with shards of
    :data:`ROWS` rows, it is in the batch of optimizer step ``position // 2 + 1``."""
    order = [w[0] for w in epoch_windows(list(range(shards)), seed=seed, epoch=0, shuffle=True, window=1)]
    return order[position]


def make_dataset(
    path: str | Path,
    *,
    shards: int = 240,
    rows: int = ROWS,
    bad_shard: int | list[int] | None = None,
    bad_rows: list[int] | None = None,
    drop_bad: bool = False,
    fault: str = "cents",
    seed: int = 0,
) -> Path:
    """Write the demo's dataset; ``bad_shard`` (a shard id, a list of them, or None) from pipeline 3.1 with
    ``amount`` in cents on ``bad_rows`` (default: all; ``fault="nan"``: NaN there instead). ``drop_bad``: leave
    those shards out (the clean run's data). Values depend on ``seed`` alone, so the datasets differ only where
    the bad shards are."""
    rng = np.random.default_rng(seed)
    bad = set([bad_shard] if isinstance(bad_shard, int) else bad_shard or [])
    with DatasetWriter(Path(path), provenance=PROVENANCE) as w:
        for sid in range(shards):
            x = np.clip(rng.standard_normal((4, rows)), -3, 3)
            amount = np.clip(6.0 + 2.0 * x[0] + 1.0 * x[1] - 0.5 * x[2] + 0.3 * rng.standard_normal(rows), 1, 12)
            if sid in bad and drop_bad:
                continue
            prov = None
            if sid in bad:
                rows_bad = np.arange(rows) if bad_rows is None else np.asarray(bad_rows)
                amount = amount.copy()
                amount[rows_bad] = np.nan if fault == "nan" else amount[rows_bad] * 100.0  # cents
                prov = CENTS
            cols: dict[str, Any] = {f"f{j}": x[j] for j in range(4)} | {"amount": amount}
            w.write_shard(pa.table(cols), shard_id=sid, provenance=prov)
    return Path(path)


def train_config(data: Path, *, steps: int, policy: str = "rollback", window: int = 20) -> dict[str, Any]:
    """The demo's training config (YAML-ready): one shard per global batch, a checkpoint every 10 steps."""
    return {
        "model": {"name": "tabular", "label": "amount", "hidden": 32},
        "data": {"path": str(data), "shuffle_window": 1},
        "batch": {
            "micro_batch_size": BATCH // 4,
            "global_batch_size": BATCH,
            "base_lr": 0.01,
            "base_batch_size": BATCH,
            "warmup_steps": 5,
        },
        "spike": {"policy": policy, "window": window},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "eval": {"holdout_fraction": None},  # every shard trained on: one shard per global batch, as placed
        "run": {"max_steps": steps, "log_every": 10},
    }


@dataclass
class SpikeDemo:
    """The demo's outcome: the spike run, its report and hunt, and the clean run's final loss."""

    run_dir: Path
    returncode: int
    report: NonFiniteReport
    hunt: HuntReport | None
    final_loss: float | None
    """Mean training loss of the last 10 steps (None when the run wrote no summary)."""
    clean_loss: float | None
    bad_shard: int
    rollbacks: list[dict[str, Any]]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for _, r in read_jsonl(run_dir / "metrics.jsonl", what="metrics log") if isinstance(r, dict)]


def _final_loss(run_dir: Path, last: int = 10) -> float | None:
    """Mean training loss of the last ``last`` steps (one step's loss is noisy), None without a summary."""
    train = [r for r in _rows(run_dir) if "loss" in r and "val_loss" not in r and "rollback_to" not in r]
    losses = [r["loss"] for r in train[-last:] if isinstance(r["loss"], float)]
    return sum(losses) / len(losses) if losses and (run_dir / "summary.md").exists() else None


def run_demo(root: Path | None, *, loader: Loader, position: int = 80, steps: int = 100, nproc: int = 2) -> SpikeDemo:
    """Write the data, train with rollback on ``nproc`` ranks, report and hunt; train the clean data too."""
    root = Path(root or tempfile.mkdtemp(prefix="steadytrain-demo-spike-"))
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UserError(f"--dir {root}: not an empty directory (a previous demo?): give a new or empty one")
    shards = 2 * steps + 40
    bad = bad_shard_at(position, shards)
    runs: dict[str, Path] = {}
    for name, drop in (("spike", False), ("clean", True)):
        data = make_dataset(root / f"data-{name}", shards=shards, bad_shard=bad, drop_bad=drop)
        config = root / f"{name}.yaml"
        write_text_atomic(config, yaml.safe_dump(train_config(data, steps=steps)))
        runs[name] = root / f"run-{name}"
        proc = launch(config, runs[name], nproc=nproc)
        if name == "spike":
            code = proc.returncode
            (root / "spike.log").write_text(proc.stdout + proc.stderr)
    rep = report(runs["spike"], SPIKES)
    found = hunt(runs["spike"], rep.suspect_shards[0], loader=loader, kind="spike") if rep.suspect_shards else None
    rollbacks = [r for r in _rows(runs["spike"]) if "rollback_to" in r]
    final, clean = _final_loss(runs["spike"]), _final_loss(runs["clean"])
    return SpikeDemo(runs["spike"], code, rep, found, final, clean, bad, rollbacks)
