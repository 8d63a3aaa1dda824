"""train.replay: the weights a replay starts from, and what it says when a checkpoint does not fit.

Oracles: the weights a user model recorded itself when the training process built it (drawn from
torch's, NumPy's and Python's global generators, so the order of seeding matters), the checkpoints
the run wrote, and torch's own ``load_state_dict`` message for a checkpoint of another shape."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from steadytrain.errors import UserError
from steadytrain.runs.replay import initial_model, run_model
from steadytrain.train.checkpoint.catalog import load_checkpoint
from tests.train_utils import run_cli, sets, write_text_dataset

USER_MODEL = '''
import os, random
import numpy as np
import torch
import torch.nn.functional as F


class Drawn(torch.nn.Module):
    """A bigram LM whose initial values come from torch's, NumPy's and Python's global generators."""

    def __init__(self, dim=8):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)
        self.shift = torch.nn.Parameter(torch.from_numpy(np.random.standard_normal(256)).float() * 0.01)
        self.scale = torch.nn.Parameter(torch.tensor(1.0 + random.random() * 0.01))
        out = os.environ.get("INIT_OUT")
        if out and not os.path.exists(out):  # the training process records the weights it built
            torch.save({k: v.clone() for k, v in self.state_dict().items()}, out)

    def forward(self, batch):
        tokens = batch["tokens"].long()
        logits = self.head(self.emb(tokens[:, :-1])) * self.scale + self.shift
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def factory(**kw):
    return Drawn(**kw)
'''


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("replay")
    (tmp / "drawn.py").write_text(USER_MODEL)
    data = write_text_dataset(tmp / "data", [64, 64])
    items = ["model.name=drawn:factory", "model.dim=8", f"data.path={data}", "data.seq_len=32", "run.seed=1234",
             "batch.micro_batch_size=4", "batch.global_batch_size=16", "batch.base_batch_size=16",
             "run.max_steps=2", "checkpoint.every_steps=1"]  # fmt: skip
    proc = run_cli(
        "train", "--run-dir", str(tmp / "run"), *sets(*items), PYTHONPATH=str(tmp), INIT_OUT=str(tmp / "init.pt")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, tmp / "run"


@pytest.fixture
def importable(user_run, monkeypatch) -> tuple[Path, Path]:
    tmp, run = user_run
    monkeypatch.syspath_prepend(str(tmp))
    monkeypatch.delenv("INIT_OUT", raising=False)
    return tmp, run


def assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def test_the_rebuilt_initial_weights_are_the_ones_the_training_process_built(importable):
    tmp, run = importable
    recorded = torch.load(tmp / "init.pt", weights_only=True)
    assert_same_weights(initial_model(run).state_dict(), recorded)
    # Step 1 started from them: with no checkpoint at or before step 0, run_model gives them, exactly (no note).
    model, settings = run_model(run, before_step=0)
    assert (settings.checkpoint, settings.checkpoint_step, settings.note) == (None, 0, None)
    assert_same_weights(model.state_dict(), recorded)
    # The checkpoint of step 1 holds the weights after it: a real step changed them (the comparison can fail).
    model, settings = run_model(run, before_step=1)
    assert settings.checkpoint_step == 1 and settings.note is None
    assert any(not torch.equal(v, recorded[k]) for k, v in model.state_dict().items())


def test_rebuilding_leaves_the_callers_random_streams_alone(importable):
    _, run = importable

    def draws() -> tuple:
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        return random.random(), float(np.random.rand()), torch.rand(2)

    def draws_around_a_rebuild() -> tuple:
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        initial_model(run)
        return random.random(), float(np.random.rand()), torch.rand(2)

    a, b = draws(), draws_around_a_rebuild()
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_a_checkpoint_that_does_not_fit_names_the_parameter_and_both_shapes(importable, tmp_path):
    tmp, run = importable
    state = load_checkpoint(run / "checkpoints" / "step-00000001") | {"optimizer": {}}
    state["model"]["head.weight"] = torch.zeros(256, 5)  # the run's model has dim 8
    bad = tmp_path / "step-00000001.pt"  # a single-file checkpoint (the format of earlier versions)
    torch.save(state, bad)
    import drawn

    with pytest.raises(RuntimeError) as torch_err:  # torch's own words for this mismatch: the oracle
        drawn.factory(dim=8).load_state_dict(state["model"])
    lines = [line.strip() for line in str(torch_err.value).splitlines()]
    named = next(line for line in lines if "head.weight" in line)
    assert lines[0].startswith("Error(s) in loading state_dict") and named != lines[0]
    with pytest.raises(UserError) as err:
        run_model(run, checkpoint=bad)
    message = str(err.value)
    assert named in message and "\n" not in message, message
    proc = run_cli("nan", "hunt", str(run), "--shard", "0", "--checkpoint", str(bad), PYTHONPATH=str(tmp))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr
