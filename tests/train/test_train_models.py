"""The model contract of `steadytrain train`: the built-in tabular model and a user factory from PYTHONPATH.

Oracles: a learnable synthetic task whose loss must fall far below chance; the user model's own
closed-form loss on the first step (its weights start at zero)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from steadytrain.data import DatasetWriter, global_batch
from tests.cli_utils import in_process
from tests.train_utils import sets


def train(run_dir: Path, *items: str, env: dict | None = None) -> list[dict]:
    """``steadytrain train`` in this process (:func:`~tests.cli_utils.in_process`): its training rows."""
    proc = in_process("train", "--run-dir", str(run_dir), *sets(*items), **(env or {}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" not in r]  # the training rows (a user's dataset is validated too)


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> Path:
    """label = argmax of a category's offset + a numeric feature: learnable, 4 classes."""
    path = tmp_path_factory.mktemp("tab")
    rng = np.random.default_rng(0)
    cats = np.array(["a", "b", "c", "d"])
    with DatasetWriter(path, provenance={"pipeline_version": "1"}) as w:
        for _ in range(4):
            n = 256
            c = rng.integers(0, 4, n)
            x = rng.standard_normal(n) * 50 + 1000  # far from standardized: the model must standardize
            label = (c + (x > 1000)) % 4
            w.write_shard(pa.table({"cat": cats[c], "x": x, "label": label.astype(np.int64)}))
    return path


def test_builtin_tabular_model_learns_a_categorical_and_numeric_task(tmp_path, tabular):
    rows = train(
        tmp_path / "run",
        "model.name=tabular",
        f"data.path={tabular}",
        "batch.micro_batch_size=32",
        "batch.global_batch_size=64",
        "batch.base_batch_size=64",
        "batch.base_lr=0.03",
        "run.max_steps=40",
        "run.log_every=10",
    )
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] > 1.0  # about ln 4 = 1.39 at the start
    assert np.mean([r["loss"] for r in rows[-5:]]) < 0.5


USER_MODEL = """
import torch

class Mean(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.scale = scale

    def forward(self, batch):
        y = batch["x"].float() * self.scale
        return (self.w - y) ** 2   # per-example losses

def factory(scale=1.0):
    return Mean(scale)
"""


def test_user_factory_from_pythonpath_gets_its_keyword_arguments(tmp_path, tabular):
    (tmp_path / "mymodels.py").write_text(USER_MODEL)
    rows = train(
        tmp_path / "run",
        "model.name=mymodels:factory",
        "model.scale=0.001",
        f"data.path={tabular}",
        "batch.micro_batch_size=16",
        "batch.global_batch_size=32",
        "batch.base_batch_size=32",
        "run.max_steps=3",
        "run.log_every=1",
        "eval.holdout_fraction=null",  # every record trained on: the oracle below reads the whole dataset's step 0
        env={"PYTHONPATH": str(tmp_path)},
    )
    # Step 1 starts at w = 0: its loss is the mean of (0.001 x)^2 over exactly the examples of step 0.
    x = global_batch(tabular, 0, global_batch_size=32, seed=0)["x"].double()
    assert rows[0]["loss"] == pytest.approx(float(((0.001 * x) ** 2).mean()), rel=1e-5)


@pytest.mark.parametrize("on_violation", ["fail", "warn"])
def test_the_contract_is_checked_before_anything_is_written(tmp_path, tabular, on_violation):
    contract = tmp_path / "contract.yaml"
    contract.write_text('python: "2.7"\n')  # this machine runs Python 3: a violation
    run_dir = tmp_path / "run"
    args = [*sets("model.name=tabular", f"data.path={tabular}", "run.max_steps=2", f"env.contract={contract}")]
    args += sets(f"env.on_violation={on_violation}", "batch.micro_batch_size=32", "batch.global_batch_size=64")
    proc = in_process("train", "--run-dir", str(run_dir), *args)
    if on_violation == "fail":
        assert proc.returncode == 2 and "Python" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert not run_dir.exists()
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "contract" in proc.stderr and (run_dir / "metrics.jsonl").exists()
