"""Validation during a run, `steadytrain eval`, early stopping, and val loss wherever runs are judged.

Oracles: a hand-written evaluation (PyArrow reads the held-out shards, the checkpoint's weights, a
`no_grad` loop); one rank for two; the same run without evaluation; a plateau planted in a model.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from steadytrain.data import DatasetWriter
from steadytrain.runs.sweep import verdict
from steadytrain.train.checkpoint.catalog import load_checkpoint
from steadytrain.train.setup.models import TinyLM
from tests.cli_utils import assert_user_error
from tests.dist_utils import cli_on_ranks
from tests.train_utils import TINY, evals, metrics, run_cli, sets, write_text_dataset

BATCH = [x for x in TINY if not x.startswith("model.")]

_MODELS = '''
import os
from pathlib import Path
import torch
import torch.nn.functional as F


class Noisy(torch.nn.Module):
    """Dropout and a random draw in every forward: any RNG use or mode change by evaluation shows."""

    def __init__(self, dim=16):
        super().__init__()
        self.emb, self.drop, self.head = torch.nn.Embedding(256, dim), torch.nn.Dropout(0.3), torch.nn.Linear(dim, 256)

    def forward(self, batch):
        tokens = batch["tokens"].long()
        noise = torch.rand(()) * 1e-3
        logits = self.head(self.drop(self.emb(tokens[:, :-1])))
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1) + noise


class Plateau(Noisy):
    """In evaluation, loss PLATEAU[i] at its i-th evaluation forward (a counter file survives a resume)."""

    def forward(self, batch):
        if self.training:
            return super().forward(batch)
        counter = Path(os.environ["PLATEAU_DIR"]) / "evals"
        i = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(i + 1))
        values = [float(v) for v in os.environ["PLATEAU"].split(",")]
        value = values[min(i, len(values) - 1)]
        return torch.full((len(batch["index"]),), value) + 0 * self.head.bias.sum()


class NanEval(Noisy):
    """A finite training loss; in evaluation every second example is NaN."""

    def forward(self, batch):
        out = super().forward(batch)
        if not self.training:
            out = out.clone()
            out[::2] = float("nan")
        return out


def noisy(**kw):
    return Noisy(**kw)


def plateau(**kw):
    return Plateau(**kw)


def nan_eval(**kw):
    return NanEval(**kw)
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("val") / "data", [24, 24, 24, 24, 24, 24, 21, 23])


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A validation set of its own (the same columns), 37 examples: no world size divides it."""
    return write_text_dataset(tmp_path_factory.mktemp("val") / "other", [20, 17])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("models")
    (where / "valmodels.py").write_text(_MODELS)
    return where


def train(run_dir: Path, *items: str, code: int = 0, **env: str) -> subprocess.CompletedProcess:
    proc = run_cli("train", "--run-dir", str(run_dir), *sets(*items), **env)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def _tokens(data: Path, shards: list[int]) -> torch.Tensor:
    index = json.loads((data / "index.json").read_text())
    files = {s["id"]: data / s["file"] for s in index["shards"]}
    rows = [np.stack(pq.read_table(files[s])["tokens"].to_numpy(zero_copy_only=False)) for s in sorted(shards)]
    return torch.from_numpy(np.concatenate(rows).astype(np.int64))


def test_the_validation_loss_is_a_hand_written_evaluation_of_the_checkpoint(tmp_path, data):
    run = tmp_path / "run"
    items = [*TINY, f"data.path={data}", "run.max_steps=4", "eval.holdout_shards=2", "eval.every_steps=2"]
    train(run, *items, "checkpoint.every_steps=2", "checkpoint.keep_last=10")
    plan = json.loads((run / "plan.json").read_text())
    held = plan["eval_shards"]
    assert len(held) == 2 and set(json.loads((run / "data.json").read_text())["holdout"]) == {str(s) for s in held}
    exposure = {int(k) for k in json.loads((run / "exposure.json").read_text())}
    assert exposure and not exposure & set(held)  # never trained on
    tokens = _tokens(data, held)
    rows = {r["step"]: r for r in evals(run)}
    assert sorted(rows) == [2, 4]
    for step in (2, 4):
        model = TinyLM(dim=32, layers=1, heads=2, seq_len=32)
        model.load_state_dict(load_checkpoint(run / "checkpoints" / f"step-{step:08d}")["model"])
        model.eval()
        with torch.no_grad():
            losses = torch.cat([model({"tokens": t}) for t in tokens.split(7)]).double()
        assert rows[step]["val_items"] == len(tokens)
        assert math.isclose(rows[step]["val_loss"], losses.mean().item(), rel_tol=1e-6), (step, rows[step])
    proc = run_cli("eval", str(run), "--step", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {k: rows[2][k] for k in ("step", "val_loss", "val_items")}
    # plan.json without the held-out list (or without plan.json): the same draw from run.seed, never every shard
    for damaged in ({k: v for k, v in plan.items() if k != "eval_shards"}, plan | {"eval_shards": None}, None):
        if damaged is None:
            (run / "plan.json").unlink()
        else:
            (run / "plan.json").write_text(json.dumps(damaged))
        again = run_cli("eval", str(run), "--step", "2", "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == {k: rows[2][k] for k in ("step", "val_loss", "val_items")}
    (run / "plan.json").write_text(json.dumps(plan | {"eval_shards": "0,1"}))
    assert_user_error(run_cli("eval", str(run)), "plan.json", "eval_shards")
    summary = (run / "summary.md").read_text()
    best = min(rows.values(), key=lambda r: r["val_loss"])
    assert f"best validation loss | {best['val_loss']:.4g} at step {best['step']}" in summary


def test_evaluation_does_not_perturb_training(tmp_path, data, other, models):
    # Dropout and a random draw in every forward: evaluation must restore the mode and every RNG stream.
    items = [*BATCH, f"data.path={data}", "run.max_steps=6", "model.name=valmodels:noisy"]
    train(tmp_path / "off", *items, "eval.holdout_fraction=null", PYTHONPATH=str(models))  # no validation set
    train(tmp_path / "on", *items, f"eval.data={other}", "eval.every_steps=1", PYTHONPATH=str(models))
    off, on = metrics(tmp_path / "off"), metrics(tmp_path / "on")
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["step"] for r in evals(tmp_path / "on")] == [1, 2, 3, 4, 5, 6]
    assert all(r["val_items"] == 37 for r in evals(tmp_path / "on"))


STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory, data, other) -> tuple[Path, dict[str, tuple[Path, list]]]:
    """The same evaluated run on one rank (this process) and, per strategy, on 2 ranks: one spawn of ranks runs
    both (each rank runs ``main(argv)`` as under torchrun). The 1-rank run directory; per strategy, the 2-rank run
    directory and each rank's exit."""
    root = tmp_path_factory.mktemp("ranks")
    items = [*TINY, f"data.path={data}", "run.max_steps=4", f"eval.data={other}", "eval.every_steps=2"]
    items += ["eval.micro_batch_size=5"]  # 37 examples: slices of 19 and 18, 4 forwards on each rank
    train(root / "one", *items)
    runs = {s: root / s / "two" for s in STRATEGIES}
    commands = [["train", "--run-dir", run, *sets(*items, f"distributed.strategy={s}")] for s, run in runs.items()]
    results = cli_on_ranks(root, commands)
    return root / "one", {s: (runs[s], procs) for s, procs in zip(runs, results, strict=True)}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_give_the_validation_loss_of_one(one_and_two_ranks, strategy):
    one_dir, two_ranks = one_and_two_ranks
    two_dir, procs = two_ranks[strategy]
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = evals(one_dir), evals(two_dir)
    assert (
        [(r["step"], r["val_items"]) for r in two] == [(r["step"], r["val_items"]) for r in one] == [(2, 37), (4, 37)]
    )
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["val_loss"], b["val_loss"], rel_tol=1e-6), (a, b)


def _plateau_env(tmp_path: Path, models: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(models), "PLATEAU_DIR": str(tmp_path), "PLATEAU": "5,4,3,3.5,3.2,3.1,3.0,2.0"}


def _plateau_items(data: Path, steps: int) -> list[str]:
    # one forward per evaluation: 37 examples in one micro-batch of 64
    return [*BATCH, f"data.path={data}", f"run.max_steps={steps}", "model.name=valmodels:plateau",
            "eval.every_steps=2", "eval.patience=3", "eval.micro_batch_size=64"]  # fmt: skip


def test_early_stopping_ends_the_run_at_the_planted_plateau(tmp_path, data, other, models):
    run = tmp_path / "run"
    items = [*_plateau_items(data, 20), f"eval.data={other}", "checkpoint.keep_best=true", "checkpoint.keep_last=1"]
    proc = train(run, *items, **_plateau_env(tmp_path, models))
    # evaluations at steps 2, 4, 6 (best: 3.0), 8, 10, 12: three without improvement -> stop at 12
    assert [r["val_loss"] for r in evals(run)] == pytest.approx([5, 4, 3, 3.5, 3.2, 3.1], rel=1e-6)
    assert [r["step"] for r in metrics(run)] == list(range(1, 13))
    assert "early stopping at step 12" in proc.stderr
    summary = (run / "summary.md").read_text()
    assert "early stopping at step 12" in summary and "best validation loss | 3 at step 6" in summary
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000006", "step-00000012"]
    assert run_cli("report", str(run)).returncode == 0  # a later report keeps the reason (the evaluation's row)
    assert "early stopping at step 12" in (run / "summary.md").read_text()


def test_an_early_stopped_run_resumes_only_with_more_patience(tmp_path, data, other, models):
    run, env = tmp_path / "run", _plateau_env(tmp_path, models)
    train(run, *_plateau_items(data, 20), f"eval.data={other}", **env)  # stops at 12 (see the test above)

    def files() -> dict[str, bytes]:  # but the lock's owner note
        return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.startswith(".lock")}

    before = files()
    refused = run_cli("train", "--resume", str(run), *sets("run.max_steps=30"), **env)
    assert_user_error(refused, "ended by early stopping at step 12", "eval.patience=4")
    assert files() == before  # nothing written
    more = run_cli("train", "--resume", str(run), *sets("eval.patience=5"), **env)
    assert more.returncode == 0, more.stderr[-3000:]
    # evaluations 7.. of the plateau: 3.0 at 14 (a fourth miss), 2.0 at 16 (the best), then 2.0 to the end
    assert [(r["step"], r["val_loss"]) for r in evals(run)][6:] == [(14, 3.0), (16, 2.0), (18, 2.0), (20, 2.0)]
    assert "best validation loss | 2 at step 16" in (run / "summary.md").read_text()


def test_auto_resume_of_an_early_stopped_run_is_success_and_writes_nothing(tmp_path, data, other, models):
    run, env = tmp_path / "run", _plateau_env(tmp_path, models)
    items = [*_plateau_items(data, 20), f"eval.data={other}"]
    train(run, *items, **env)  # stops at 12 (see above): a requeue or a retry finds it ended
    before = {p: p.read_bytes() if p.is_file() else None for p in run.rglob("*")}
    proc = run_cli("train", "--auto-resume", "--run-dir", str(run), *sets(*items), **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to train" in proc.stderr and "early stopping at step 12" in proc.stderr
    assert {p: p.read_bytes() if p.is_file() else None for p in run.rglob("*")} == before


def test_a_resume_cannot_change_which_examples_are_evaluated(tmp_path, data, other, models):
    run, env = tmp_path / "run", _plateau_env(tmp_path, models)
    train(run, *_plateau_items(data, 4), f"eval.data={other}", **env)
    for item in ("eval.max_batches=1", f"eval.data={data}", "eval.micro_batch_size=8"):
        refused = run_cli("train", "--resume", str(run), *sets("run.max_steps=6", item), **env)
        assert_user_error(refused, item.partition("=")[0], "cannot change", "best validation loss")
    kept = run_cli("train", "--resume", str(run), *sets("run.max_steps=6", "batch.micro_batch_size=2"), **env)
    assert kept.returncode == 0, kept.stderr[-3000:]  # the training micro batch may change: eval's is pinned
    assert [r["val_items"] for r in evals(run)] == [37, 37, 37]


def test_resume_keeps_the_evaluation_schedule_and_the_best_value(tmp_path, data, other, models):
    run = tmp_path / "run"
    env = _plateau_env(tmp_path, models)
    train(run, *_plateau_items(data, 8), f"eval.data={other}", **env)  # evaluations 2..8: best at 6, one miss
    proc = run_cli("train", "--resume", str(run), *sets("run.max_steps=20"), **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in evals(run)] == [2, 4, 6, 8, 10, 12]  # stops at 12, as without the resume
    assert "early stopping at step 12" in (run / "summary.md").read_text()


def test_a_non_finite_validation_loss_is_reported_and_training_goes_on(tmp_path, data, other, models):
    run = tmp_path / "run"
    items = [*BATCH, f"data.path={data}", "run.max_steps=3", "model.name=valmodels:nan_eval", f"eval.data={other}"]
    proc = train(run, *items, PYTHONPATH=str(models))
    (row,) = evals(run)
    assert row["val_loss"] is None and row["val_nonfinite"] == 19 and row["val_items"] == 37
    assert "not finite" in proc.stderr
    assert len(metrics(run)) == 3


def test_a_validation_set_the_run_cannot_use_is_refused_before_anything_is_written(tmp_path, data):
    wrong = tmp_path / "wrong"
    with DatasetWriter(wrong, provenance={"source": "other"}) as w:
        w.write_shard(pa.table({"x": np.arange(10, dtype=np.float32)}))
    empty = write_text_dataset(tmp_path / "empty", [3])
    index = json.loads((empty / "index.json").read_text())
    (empty / "index.json").write_text(json.dumps(index | {"shards": []}))  # a dataset with no shard
    base = [*TINY, f"data.path={data}", "run.max_steps=2"]
    cases = [
        (["eval.data=" + str(wrong)], "does not fit the training data"),
        (["eval.data=" + str(empty)], "no examples"),
        (["eval.data=" + str(tmp_path / "missing")], "eval.data: "),
        (["eval.holdout_shards=true"], "eval.holdout_shards", "not a number"),
        (["eval.holdout_shards=8"], "leaves none to train on"),
        ([f"eval.data={wrong}", "eval.holdout_shards=1"], "not both"),
        (["eval.holdout_fraction=null", "eval.patience=2"], "no validation set"),
    ]
    for extra, *words in cases:
        proc = run_cli("train", "--run-dir", str(tmp_path / "run"), *sets(*base, *extra))
        assert_user_error(proc, *words)
        assert not (tmp_path / "run").exists(), extra


def test_eval_command_on_another_dataset_and_its_errors(tmp_path, data, other):
    run = tmp_path / "run"
    train(run, *TINY, f"data.path={data}", "run.max_steps=2", "eval.holdout_fraction=null")  # no validation set
    assert_user_error(run_cli("eval", str(run)), "no validation set", "--data")
    proc = run_cli("eval", str(run), "--data", str(other), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["val_items"] == 37
    wrong = tmp_path / "wrong"
    with DatasetWriter(wrong, provenance={"source": "other"}) as w:
        w.write_shard(pa.table({"x": np.arange(10, dtype=np.float32)}))
    assert_user_error(run_cli("eval", str(run), "--data", str(wrong)), "does not fit the training data")
    assert_user_error(run_cli("eval", str(run), "--step", "7"), "no checkpoint of that step")


def test_sweep_ranks_trials_by_validation_loss_when_every_trial_has_one():
    def trial(factor: float, smoothed: float, val: float | None) -> dict:
        return {"factor": factor, "lr": factor * 1e-3, "smoothed_loss": smoothed, "final_loss": smoothed,
                "val_loss": val, "diverged": False}  # fmt: skip

    # factor 2 trains lowest (overfits); factor 1 generalises best
    best, held, text = verdict([trial(0.5, 2.0, 2.1), trial(1, 1.5, 1.6), trial(2, 1.0, 1.9)], 1.0)
    assert best == 1 and held is True and "final validation loss 1.6" in text
    best, _, text = verdict([trial(0.5, 2.0, 2.1), trial(1, 1.5, None), trial(2, 1.0, 1.9)], 1.0)
    assert best == 2 and "smoothed final loss 1" in text  # one trial without: training loss, as before


def test_compare_gives_both_validation_losses_at_the_common_evaluation_steps(tmp_path, data, other):
    base = [*TINY, f"data.path={data}", f"eval.data={other}", "eval.every_steps=2"]
    train(tmp_path / "a", *base, "run.max_steps=4")
    train(tmp_path / "b", *base, "run.max_steps=6", "batch.base_lr=0.02")
    proc = run_cli("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    va, vb = ({r["step"]: r["val_loss"] for r in evals(tmp_path / n)} for n in ("a", "b"))
    assert out["validation"] == {str(s): [va[s], vb[s]] for s in (2, 4)}
    assert f"validation loss at step 4 (last common of 2): A {va[4]:.6g} vs B {vb[4]:.6g}" in out["sentence"]
