"""``steadytrain demo nan``: the seed's scenario end to end, on this machine.

A tabular dataset of 200 shards in which shard 47 was written by a later pipeline version (its
provenance says so) that split the category ``fr`` into a new value, ``fr-CA``, absent from the
vocabulary built from the earlier shards. The feature pipeline puts unknown categories into an
out-of-vocabulary bucket and target-encodes each category as the label's mean among its examples
(fitted on the vocabulary's shards): the bucket's count is zero, so its encoding is 0/0 = NaN, and the
loss of every ``fr-CA`` example is NaN. Nothing is planted in the model; the NaN comes from the data
through the pipeline's arithmetic. The job trains on 2 ranks (gloo, launched by ``torch.distributed.run``),
skips the bad steps, and the report and the hunt name the shard, the examples, the module, the
field and value, and the provenance difference. The ``lr`` variant trains on shards all from one
pipeline with a learning rate far too high: the verdict is ``spread``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml
from filelock import FileLock, Timeout

from steadytrain._io import ensure_dir, write_text_atomic
from steadytrain.data import DatasetWriter, open_dataset
from steadytrain.diagnose.hunt import HuntReport, Loader, hunt
from steadytrain.diagnose.report import NonFiniteReport, report
from steadytrain.errors import UserError

__all__ = ["DemoResult", "make_dataset", "run_demo", "train_config"]

log = logging.getLogger("steadytrain.diagnose")

VOCAB = ["de", "en", "es", "fr", "it", "nl"]
NEW_VALUE = "fr-CA"
PROVENANCE = {"pipeline_version": "2.3.0", "schema_version": 3, "source": "events-export"}
LATER = {"pipeline_version": "2.4.0", "schema_version": 4, "source": "events-export"}


def make_dataset(
    path: str | Path,
    *,
    shards: int = 200,
    rows: int = 64,
    bad_shard: int | None = 47,
    bad_rows: list[int] | None = None,
    seed: int = 0,
) -> Path:
    """Write the scenario's dataset: ``shards`` shards of ``rows`` rows; ``bad_shard`` (None: none) from
    the later pipeline, with the new category value in ``bad_rows`` (default: a random quarter of its rows).
    The other columns depend on ``seed`` alone, so two datasets that differ in ``bad_rows`` differ only there.

    Columns: ``f0..f3`` (standard normal, clipped to [-3, 3]), ``region`` (a category), ``label``
    (4 classes, from the region and ``f0``).
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    with DatasetWriter(path, provenance=PROVENANCE) as w:
        for sid in range(shards):
            cols: dict[str, Any] = {f"f{j}": np.clip(rng.standard_normal(rows), -3, 3) for j in range(4)}
            region = np.array(VOCAB)[rng.integers(0, len(VOCAB), rows)]
            label = (np.searchsorted(VOCAB, region) + (cols["f0"] > 0)) % 4
            prov = None
            if sid == bad_shard:
                region = region.astype(object)
                chosen = rng.permutation(rows)[: rows // 4] if bad_rows is None else bad_rows
                region[chosen] = NEW_VALUE  # the later pipeline's split of "fr"
                prov = LATER
            cols["region"] = region.astype(str)
            cols["label"] = label.astype(np.int64)
            w.write_shard(pa.table(cols), shard_id=sid, provenance=prov)
    return path


def train_config(data: Path, *, lr_too_high: bool = False, epochs: int = 2) -> dict[str, Any]:
    """The demo's training config (YAML-ready)."""
    cfg: dict[str, Any] = {
        "model": {"name": "tabular", "oov": "bucket", "target_encoding": True, "hidden": 32},
        "data": {"path": str(data)},
        "batch": {
            "micro_batch_size": 32,
            "global_batch_size": 128,
            "base_lr": 0.01,
            "base_batch_size": 128,
            "warmup_steps": 5,
        },
        "nonfinite": {"policy": "skip", "max_consecutive_skips": 10},
        "checkpoint": {"every_steps": 10, "keep_last": 1000},
        "eval": {"holdout_fraction": None},  # every shard trained on: the scenario places its shards itself
        "run": {"max_steps": None, "epochs": epochs, "log_every": 10},
    }
    if lr_too_high:  # plain SGD, no clipping, an LR that makes the weights explode within a few steps
        cfg["optim"] = {"name": "sgd", "momentum": 0.0, "weight_decay": 0.0}
        cfg["clip"] = {"max_grad_norm": None}
        cfg["batch"].update(base_lr=1e4, warmup_steps=0)
    return cfg


def launch(config: Path, run_dir: Path, *, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """Train ``config`` on ``nproc`` local ranks through ``torch.distributed.run`` (gloo on CPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "steadytrain", "train", str(config), "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@dataclass
class DemoResult:
    """One variant of the demo: its run directory, how training ended, the report and (if any) the hunt."""

    variant: str
    run_dir: Path
    returncode: int
    report: NonFiniteReport
    hunt: HuntReport | None


def _variant(root: Path, variant: str, shards: int, nproc: int, loader: Loader) -> DemoResult:
    lr = variant == "lr"
    data = root / ("data-clean" if lr else "data")
    if not (data / "index.json").exists():
        log.info("writing %d shards to %s", shards, data)
        make_dataset(data, shards=shards, bad_shard=None if lr else 47 * shards // 200)
    elif (found := len(open_dataset(data).shard_ids)) != shards:  # an earlier demo's: its bad shard is another
        raise UserError(
            f"{data} holds {found} shards from an earlier demo, not {shards}: use --shards {found} or another --dir"
        )
    config, run_dir = root / f"{variant}.yaml", root / "runs" / variant
    if run_dir.exists():
        raise UserError(f"{run_dir} exists: choose another --dir (the demo never overwrites a run)")
    write_text_atomic(config, yaml.safe_dump(train_config(data, lr_too_high=lr)))
    log.info("training %s on %d ranks (gloo): %s", variant, nproc, run_dir)
    proc = launch(config, run_dir, nproc=nproc)
    write_text_atomic(root / f"{variant}.log", proc.stdout + proc.stderr)
    if proc.returncode not in (0, 1) or not run_dir.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"demo training failed (exit {proc.returncode}): {tail[0]} (log: {root / variant}.log)")
    rep = report(run_dir)
    found = hunt(run_dir, rep.suspect_shards[0], loader=loader) if rep.suspect_shards else None
    return DemoResult(variant, run_dir, proc.returncode, rep, found)


def run_demo(
    root: str | Path,
    *,
    loader: Loader,
    variants: tuple[str, ...] = ("shard", "lr"),
    shards: int = 200,
    nproc: int = 2,
):
    """Build the data, train each variant on ``nproc`` ranks, and diagnose it; yields a :class:`DemoResult` each.

    ``loader`` builds a run's model for :func:`~steadytrain.diagnose.hunt.hunt` (the command passes
    ``steadytrain.runs.replay.run_model``).

    Raises:
        UserError: ``root`` (or a parent) is a file or cannot be created, another demo is writing there,
            a variant's run directory exists, or its training failed.
    """
    root = _root(root)
    lock = FileLock(root / ".demo.lock", timeout=0)  # two demos in one directory would write one dataset twice
    try:
        lock.acquire()
    except Timeout:
        busy = "another `steadytrain demo nan` is writing there"
        raise UserError(f"{root}: {busy}: wait for it to finish or choose another --dir") from None
    except OSError as err:
        raise UserError(f"{root}: cannot lock the demo directory ({err.strerror or err})") from None
    try:
        for variant in variants:
            yield _variant(root, variant, shards, nproc, loader)
    finally:
        lock.release()


def _root(path: str | Path) -> Path:
    return ensure_dir(path, "--dir")
