"""What the end-to-end training tests share: the installed command, a tiny model, a small text dataset."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from steadytrain.data import DatasetWriter
from tests.cli_utils import EXE, in_process, launched

__all__ = [
    "CHECKPOINTED",
    "EXE",
    "TINY",
    "bigram_module",
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


def user_package(root: Path, **modules: str) -> Path:
    """``root/pkg`` holding each ``name=source`` as ``name.py``: the directory a test puts on ``PYTHONPATH`` for
    ``model.name=name:factory``."""
    pkg = root / "pkg"
    pkg.mkdir()
    for name, source in modules.items():
        (pkg / f"{name}.py").write_text(source)
    return pkg


def write_text_dataset(path: Path, sizes: list[int], plant: Callable[[int, np.ndarray], None] | None = None) -> Path:
    """Byte sequences (33 bytes: seq_len 32 + 1) of this project's own source, one shard per size; ``plant(shard,
    rows)`` may change a shard's rows (a ``(n, 33)`` uint8 copy) before it is written: a cause planted in the data."""
    src = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.parent.glob("src/steadytrain/**/*.py")))
    seqs = np.frombuffer(src, dtype=np.uint8)[: 33 * sum(sizes)].reshape(-1, 33)
    with DatasetWriter(path, provenance={"source": "steadytrain-src"}) as w:
        start = 0
        for shard, n in enumerate(sizes):
            part = seqs[start : start + n]
            if plant is not None:
                part = part.copy()
                plant(shard, part)
            w.write_shard(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), 33)}))
            start += n
    return path


_BIGRAM = '''
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class Bigram(torch.nn.Module):
    """{doc}"""

    def __init__(self, dim=16, **kw):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)
        self.calls, self.kw = 0, kw

    def forward(self, batch):
        self.calls += 1
{hook}        tokens = batch["tokens"].long()
        logits = self.head(self.emb(tokens[:, :-1]))
        losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)
{after}        return losses


def factory(**kw):
    return Bigram(**kw)
'''


def bigram_module(hook: str = "", after: str = "", doc: str = "A bigram LM.") -> str:
    """The source of a user model module (``factory(**kw)`` builds ``Bigram``: an embedding and a linear head over
    bytes, per-example cross-entropy losses) for tests that plant a fault in a real run.

    ``hook`` runs at the start of ``forward`` after ``self.calls += 1`` (the forward number, from 1); ``after`` runs
    once ``losses`` is computed, before it is returned (it may return something else). Both are code lines at any
    common indentation; they may use ``os``, ``time``, ``Path``, ``torch``, ``F``, ``batch`` and ``self.kw`` (the
    factory's keyword arguments other than ``dim``: the config's ``model.*`` keys). ``doc`` is the class docstring.
    """

    def body(code: str) -> str:
        return textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", " " * 8) if code.strip() else ""

    return _BIGRAM.format(doc=doc, hook=body(hook), after=body(after))
