"""A careless and hostile user's pass over ``steadytrain.Run``: each test failed before its fix.

Findings:

- ``Run(trackers=None)``, ``Run(state=None)``, ``Run(state=[1])`` were a ``TypeError``; ``shard_size=10**30`` was
  accepted and the first ``run.micro_batch(ids)`` an ``OverflowError`` (``settings.py``);
- a NaN in ``config`` was "a value does not read back" without its key; ``config={"clip": 1.0}`` said the run's
  config.yaml was damaged (``checks.check_config_mapping``);
- ``run.checkpoint(2.0)`` was a ``ValueError`` from the writer; ``run.checkpoint()`` before the first step saved
  ``step-00000000``, whose resume wrote a ``resumes.jsonl`` line every reader refuses; inside a ``micro_batch`` block
  it saved a half-accumulated step (``checks.checkpoint_step``);
- ``run.log(step, val_loss="x")`` wrote the row, then raised a ``ValueError``; two evaluations at one step, or one at
  step 0, made ``metrics.jsonl`` unreadable by ``report`` (``checks.eval_row``);
- a refused resume (a checkpoint of another model) had already rewritten ``config.yaml`` and ``loop.json`` with the
  new call's values; a resume with another ``shard_size`` mixed two shardings in one ``exposure.json``
  (``opening.py``);
- a resume without a complete checkpoint (a kill -9 in the first save) trained from step 1 again and appended the
  same steps to ``metrics.jsonl`` a second time (``opening._start_over``);
- 2-D ids (a batch of token ids) were flattened into one "example" per token; empty ids said "float64 values"
  (``checks.check_ids``);
- an exception the loop caught after a micro-batch's backward left the step's logged loss without that micro-batch
  (half the mean), or, after the cycle's last backward, an optimizer step the Run never wrote (``Run._settle``);
- ``nan report`` of a run whose loop gave no ids said "spread ... over 0 shard(s)" as if shards had been tested.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from steadytrain import Run
from steadytrain.errors import UserError
from steadytrain.rundir.schema import read_metrics
from tests.loop import forked
from tests.train.test_auto_resume_hostile import snapshot


def _model(dim: int = 3, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(dim, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _steps(run: Run, model: torch.nn.Module, n: int, dim: int = 3) -> None:
    for _ in range(n * run.accumulator.accumulation_steps):
        ids = torch.arange(4) + 4 * run.step
        with run.micro_batch(ids) as mb:
            mb.backward(model(torch.ones(4, dim)).pow(2).mean())


def _steps_of(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")[0]]


def _one_line_error(err: pytest.ExceptionInfo, *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text
    for word in words:
        assert word in text, (word, text)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("trackers", None), ("state", None), ("state", [1]), ("shard_size", 10**30), ("seed", 2**70)],
)
def test_a_setting_of_the_wrong_type_or_size_is_one_line(tmp_path, setting, value):
    model, opt = _model()
    with pytest.raises(UserError) as err:
        Run(tmp_path / "run", model=model, optimizer=opt, **{setting: value})
    _one_line_error(err, setting)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"a": {"b": float("nan")}}, ("a.b=nan", "string")),
        ({"clip": 1.0}, ("clip", "rename")),
        ({"note": object()}, ("note", "plain values")),
        ({"when": (1, 2)}, ("when",)),
    ],
)
def test_a_config_value_config_yaml_cannot_hold_is_named(tmp_path, config, words):
    model, opt = _model()
    with pytest.raises(UserError) as err:
        Run(tmp_path / "run", model=model, optimizer=opt, config=config)
    _one_line_error(err, *words)
    assert "damaged" not in str(err.value)  # the user's own mapping: no run file to restore


def test_checkpoint_refuses_a_step_that_is_not_an_ended_one(tmp_path):
    model, opt = _model()
    with Run(tmp_path / "run", model=model, optimizer=opt, report=False) as run:
        with pytest.raises(UserError) as err:
            run.checkpoint()  # before any step
        _one_line_error(err, "no step has ended")
        _steps(run, model, 2)
        with pytest.raises(UserError) as err:
            run.checkpoint(2.0)
        _one_line_error(err, "2.0", "integer")
        with run.micro_batch([0, 1, 2, 3]) as mb:
            mb.backward(model(torch.ones(4, 3)).pow(2).mean())
            with pytest.raises(UserError) as err:
                run.checkpoint()  # a step's gradient is half in
            _one_line_error(err, "micro_batch")
    assert not list((tmp_path / "run" / "checkpoints").iterdir())


def test_evaluations_keep_the_metrics_log_readable(tmp_path, cli):
    model, opt = _model()
    run_dir = tmp_path / "run"
    with Run(run_dir, model=model, optimizer=opt, report=False, log_every=1) as run:
        _steps(run, model, 2)
        for step, kw, word in [(1, {"val_loss": "low"}, "val_loss"), (0, {"val_loss": 1.0}, "step=0"),
                               (1, {"val_loss": 1.0, "loss": 2.0}, "loss")]:  # fmt: skip
            with pytest.raises(UserError) as err:
                run.log(step, **kw)
            _one_line_error(err, word)
        run.log(1, val_loss=0.5, val_items=8)
        with pytest.raises(UserError) as err:
            run.log(1, val_loss=0.25)  # a second evaluation of step 1
        _one_line_error(err, "step 1")
        run.log(2, val_loss=0.25)
    train, evals = read_metrics(run_dir / "metrics.jsonl")  # the reader every command uses
    assert [r["step"] for r in train] == [1, 2]
    assert [(r["step"], r["val_loss"]) for r in evals] == [(1, 0.5), (2, 0.25)]
    assert cli("report", str(run_dir)).returncode == 0


def _checkpointed(run_dir: Path, **settings) -> None:
    model, opt = _model()
    with Run(run_dir, model=model, optimizer=opt, config={"lr": 0.1, "note": "mine"}, report=False, log_every=1,
             model_factory="mine.models:build", dataset="mine.data:examples", shard_size=7,
             **settings) as run:  # fmt: skip
        _steps(run, model, 2)
        run.checkpoint()


def test_a_resume_refused_by_the_checkpoint_changes_no_byte(tmp_path):
    run_dir = tmp_path / "run"
    _checkpointed(run_dir)
    before = snapshot(run_dir)
    model, opt = _model(dim=5)  # another model: other shapes
    resumed = Run(run_dir, model=model, optimizer=opt, config={"lr": 1.0}, resume=True, shard_size=7, report=False)
    with pytest.raises(UserError) as err:
        resumed.__enter__()
    _one_line_error(err, "does not fit")
    assert snapshot(run_dir) == before
    model, opt = _model()  # and the right model still resumes it
    with Run(run_dir, model=model, optimizer=opt, resume=True, shard_size=7, report=False) as run:
        assert run.start_step == 2
    origin = json.loads((run_dir / "loop.json").read_text())  # not given again: kept
    assert (origin["model_factory"], origin["dataset"]) == ("mine.models:build", "mine.data:examples")


def test_a_resume_with_another_shard_size_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    _checkpointed(run_dir)
    before = snapshot(run_dir)
    model, opt = _model()
    with pytest.raises(UserError) as err:
        Run(run_dir, model=model, optimizer=opt, resume=True, shard_size=1000, report=False).__enter__()
    _one_line_error(err, "shard_size=1000", "shard_size=7")
    assert snapshot(run_dir) == before


def test_resuming_a_folder_that_is_no_run_says_so_and_changes_nothing(tmp_path):
    mine = tmp_path / "experiment"
    mine.mkdir()
    (mine / "config.yaml").write_text("lr: 1\n")
    (mine / "train.py").write_text("print('mine')\n")
    before = snapshot(mine)
    model, opt = _model()
    with pytest.raises(UserError) as err:
        Run(mine, model=model, optimizer=opt, resume=True).__enter__()
    _one_line_error(err, "loop.json")
    assert "steadytrain train" not in str(err.value)  # it is not a trainer's run either
    assert snapshot(mine) == before


def test_a_resume_without_a_checkpoint_writes_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    for resume in (False, True):  # no checkpoint: the resume starts over from step 1
        model, opt = _model()
        with Run(run_dir, model=model, optimizer=opt, resume=resume, log_every=1, report=False) as run:
            _steps(run, model, 3)
    assert _steps_of(run_dir) == [1, 2, 3]
    assert json.loads((run_dir / "exposure.json").read_text()) == {"0": 12}  # ids 0-11 in shards of 1000, once


def _killed(run_dir: Path, kill_at: int, checkpoints: tuple[int, ...] = (3, 5)) -> None:
    """Six steps, checkpoints at 3 and 5; ``kill_at``: SIGKILL inside that step's save, its tensors written, its
    ``state.json`` and rename not (0: no kill)."""
    import steadytrain.train.checkpoint.writer as writer

    save = writer.write_json

    def killing(path, data):
        if kill_at and path.name == "state.json" and f"{kill_at:08d}" in str(path.parent):
            os.kill(os.getpid(), signal.SIGKILL)
        save(path, data)

    writer.write_json = killing
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
        with Run(run_dir, model=model, optimizer=opt, resume=True, log_every=1, async_checkpoint=False,
                 report=False) as run:  # fmt: skip
            for step in range(run.start_step + 1, 7):
                ids = torch.arange(4) + 4 * step
                with run.micro_batch(ids) as mb:
                    mb.backward(model(x[ids]).pow(2).mean())
                if step in checkpoints:
                    run.checkpoint(step)
    finally:
        writer.write_json = save


@pytest.mark.parametrize(("kill_at", "resumed"), [(3, None), (5, 3)])
def test_kill_9_in_a_checkpoint_then_resume_writes_each_step_once(tmp_path, kill_at, resumed):
    run_dir = tmp_path / "run"
    assert forked.exit_code(_killed, run_dir, kill_at) == -9  # a process of its own, killed in the save
    assert _steps_of(run_dir) == list(range(1, kill_at + 1))  # the rows are flushed before the save
    _killed(run_dir, 0)  # the same loop again, in this process
    assert _steps_of(run_dir) == list(range(1, 7))
    resumes = run_dir / "resumes.jsonl"
    if resumed is None:  # no complete checkpoint: a fresh start, which is no resume
        assert not resumes.exists()
    else:
        assert [json.loads(line)["step"] for line in resumes.read_text().splitlines()] == [resumed]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000003", "step-00000005"]


@pytest.mark.parametrize(("ids", "word"), [(torch.zeros(2, 3, dtype=torch.long), "(2, 3)"), ([], "no ids")])
def test_ids_are_one_per_example(tmp_path, ids, word):
    model, opt = _model()
    with Run(tmp_path / "run", model=model, optimizer=opt, report=False) as run:
        with pytest.raises(UserError) as err, run.micro_batch(ids) as mb:
            mb.backward(model(torch.ones(2, 3)).pow(2).mean())
        _one_line_error(err, "run.micro_batch(ids)", word)
        with run.micro_batch(torch.tensor([[5], [1500]])) as mb:  # a column of ids is one per example
            mb.backward(model(torch.ones(2, 3)).pow(2).mean())
    assert json.loads((tmp_path / "run" / "exposure.json").read_text()) == {"0": 1, "1": 1}


def test_tag_losses_must_be_one_per_example(tmp_path):
    model, opt = _model()
    with Run(tmp_path / "run", model=model, optimizer=opt, report=False) as run:
        with pytest.raises(UserError) as err:
            run.micro_batch(tag={"shard": [0, 0], "index": [0, 1], "losses": "low"}).__enter__()
        _one_line_error(err, "losses")


class Caught(Exception):
    pass


def test_a_caught_exception_after_backward_keeps_the_step_loss(tmp_path):
    model, opt = _model()
    first = copy.deepcopy(model)
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    with torch.no_grad():  # both micro-batches of step 1 see the initial weights
        expected = (first(x1).pow(2).mean() + first(x2).pow(2).mean()).item() / 2
    with Run(tmp_path / "run", model=model, optimizer=opt, accumulation_steps=2, log_every=1, report=False) as run:
        with pytest.raises(Caught), run.micro_batch([0, 1, 2, 3]) as mb:
            mb.backward(model(x1).pow(2).mean())
            raise Caught  # e.g. a logging call of the loop's own, caught by it: the gradient is in
        with run.micro_batch([4, 5, 6, 7]) as mb:
            mb.backward(model(x2).pow(2).mean())
    (row,), _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["step"] == 1 and row["loss"] == pytest.approx(expected, rel=1e-6)
    assert json.loads((tmp_path / "run" / "exposure.json").read_text()) == {"0": 8}


def test_a_caught_exception_after_the_last_backward_still_writes_its_step(tmp_path):
    model, opt = _model()
    with Run(tmp_path / "run", model=model, optimizer=opt, log_every=1, report=False) as run:
        _steps(run, model, 1)
        with pytest.raises(Caught), run.micro_batch([4, 5, 6, 7]) as mb:
            mb.backward(model(torch.ones(4, 3)).pow(2).mean())
            raise Caught
        _steps(run, model, 1)  # the accumulator steps the complete cycle first: two steps end here
        assert run.step == run.accumulator.optimizer_steps == 3
    assert _steps_of(tmp_path / "run") == [1, 2, 3]


def test_nan_report_of_a_run_without_ids_says_nothing_is_attributable(tmp_path, cli):
    model, opt = _model()
    with Run(tmp_path / "run", model=model, optimizer=opt, report=False) as run:
        for x in (torch.ones(4, 3), torch.full((4, 3), float("nan")), torch.ones(4, 3)):
            with run.micro_batch() as mb:  # no ids: nothing to attribute a refused step to
                mb.backward(model(x).pow(2).mean())
    res = cli("nan", "report", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["steps"] == [2] and rep["shards"] == [] and rep["suspect_shards"] == []
    assert "run.micro_batch(ids)" in rep["sentence"] and "0 shard(s)" not in rep["sentence"]
