"""What the end-to-end training tests share: the installed command, a tiny model, a small text dataset."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa

from steadytrain.data import DatasetWriter
from tests.cli_utils import EXE, in_process, launched

__all__ = [
    "CHECKPOINTED",
    "EXE",
    "TINY",
    "copy_run",
    "evals",
    "metrics",
    "run_cli",
    "sets",
    "train",
    "write_text_dataset",
]
TINY = [
    "model.dim=32",
    "model.layers=1",
    "model.heads=2",
    "data.seq_len=32",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "batch.base_lr=0.01",
]
"""A model and batch small enough for a few optimizer steps per second on 2 CPU cores."""


def sets(*items: str) -> list[str]:
    """``--set`` flags for each ``key=value``."""
    return [x for item in items for x in ("--set", item)]


CHECKPOINTED = ("run.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "run.log_every=1")
"""A 4-step run with checkpoints at 2 and 4, a row per step (``tiny_run(*CHECKPOINTED)``: tests damage a copy)."""


def run_cli(*args: str, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """``steadytrain ARGS``: in this process (:func:`~tests.cli_utils.in_process`), or launched where the process is
    the point of the command (``--nproc`` hands off to torchrun)."""
    if "--nproc" in args:
        return launched(*args, timeout=timeout, **extra_env)
    return in_process(*args, **extra_env)


def train(
    run_dir: Path, *items: str, code: int = 0, args: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess:
    """``steadytrain train [ARGS] --run-dir RUN_DIR --set ITEM...`` through :func:`run_cli`; fails the test unless it
    exits ``code``."""
    proc = run_cli("train", *args, "--run-dir", str(run_dir), *sets(*items), **env)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def copy_run(run: Path, where: Path) -> Path:
    """A copy of a shared run that a test may change (the shared one stays as it was trained)."""
    return Path(shutil.copytree(run, where))


def metrics(run_dir: Path) -> list[dict]:
    """The training rows of ``metrics.jsonl`` (one per optimizer step)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" not in r and "rollback_to" not in r]


def evals(run_dir: Path) -> list[dict]:
    """The evaluation rows of ``metrics.jsonl`` (``step``, ``val_loss``, ``val_items``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r]


def write_text_dataset(path: Path, sizes: list[int]) -> Path:
    """Byte sequences (33 bytes: seq_len 32 + 1) of this project's own source, one shard per size."""
    src = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.parent.glob("src/steadytrain/**/*.py")))
    seqs = np.frombuffer(src, dtype=np.uint8)[: 33 * sum(sizes)].reshape(-1, 33)
    with DatasetWriter(path, provenance={"source": "steadytrain-src"}) as w:
        start = 0
        for n in sizes:
            part = seqs[start : start + n]
            w.write_shard(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), 33)}))
            start += n
    return path
