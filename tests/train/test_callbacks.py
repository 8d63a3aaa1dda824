"""``run.callbacks``: your code at each step end, evaluation and checkpoint of ``steadytrain train``, and of a
``steadytrain.Run``, through the same loader and the same ``run`` names."""

from __future__ import annotations

import json

import pytest
import torch

from steadytrain.train.observe.callbacks import load_callbacks
from tests.train_utils import TINY, evals, metrics, train, user_package

SAMPLER = '''
import json


class Sampler:
    """Logs a key on every step's row and writes what it saw of the run to a file (one line per call)."""

    def __init__(self):
        self.out = None

    def _note(self, run, event, *args):
        if run.is_main:
            with open(run.path / "callbacks.jsonl", "a") as f:
                f.write(json.dumps({"event": event, "step": run.step, "args": list(args)}) + "\\n")

    def on_step_end(self, run):
        run.log(run.step, sample=f"step {run.step} of {run.config['run']['max_steps']}")
        self._note(run, "step_end")

    def on_evaluate(self, run, row):
        self._note(run, "evaluate", row["val_loss"])

    def on_checkpoint(self, run, step):
        self._note(run, "checkpoint", step)


def factory():
    return Sampler()


class Broken:
    def on_step_end(self, run):
        raise RuntimeError("a bug in the callback")


def broken():
    return Broken()
'''


@pytest.fixture(scope="module")
def called(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("callbacks")
    pkg = user_package(root, sampler=SAMPLER)
    run = root / "run"
    train(run, *TINY, f"data.path={tiny_data}", "run.max_steps=6", "checkpoint.every_steps=2", "run.log_every=3",
          "eval.holdout_shards=1", "eval.every_steps=3", "run.callbacks=[sampler:factory,sampler:broken]",
          PYTHONPATH=str(pkg))  # fmt: skip
    return run


def test_every_step_end_evaluation_and_checkpoint_reaches_the_callback(called):
    seen = [json.loads(line) for line in (called / "callbacks.jsonl").read_text().splitlines()]
    assert [s["step"] for s in seen if s["event"] == "step_end"] == list(range(1, 7))
    saved = sorted(int(p.name[5:]) for p in (called / "checkpoints").glob("step-*"))
    assert [s["args"][0] for s in seen if s["event"] == "checkpoint"] == [2, 4, 6] and saved[-1] == 6
    assert [s["args"][0] for s in seen if s["event"] == "evaluate"] == [e["val_loss"] for e in evals(called)]


def test_run_log_keys_join_the_step_rows(called):
    assert [r["sample"] for r in metrics(called)] == [f"step {s} of 6" for s in range(1, 7)]


def test_a_callback_that_raises_is_switched_off_and_the_run_goes_on(called):
    assert (called / "summary.md").is_file()
    assert len(metrics(called)) == 6


def test_a_bad_callback_spec_is_refused_before_the_run(tmp_path, tiny_data):
    proc = train(tmp_path / "r", *TINY, f"data.path={tiny_data}", "run.callbacks=[nosuch.module:f]", code=2)
    assert "run.callbacks[0]" in proc.stderr and "nosuch" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_objects_without_an_event_are_refused():
    with pytest.raises(Exception, match="none of on_step_end"):
        load_callbacks([object()])


def test_the_same_callback_runs_in_an_own_loop(tmp_path):
    from steadytrain import Run

    calls = []

    class Counter:
        def on_step_end(self, run):
            calls.append(("step", run.step))
            run.log(run.step, twice=2 * run.step)

        def on_checkpoint(self, run, step):
            calls.append(("checkpoint", step))

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Run(tmp_path / "own", model=model, optimizer=opt, callbacks=[Counter()], report=False) as run:
        for _ in range(3):
            with run.micro_batch(torch.arange(4)) as mb:
                mb.backward(model(torch.ones(4, 2)).pow(2).mean())
        run.checkpoint()
    rows = [json.loads(line) for line in (tmp_path / "own" / "metrics.jsonl").read_text().splitlines()]
    assert calls == [("step", 1), ("step", 2), ("step", 3), ("checkpoint", 3)]
    assert [r["twice"] for r in rows] == [2, 4, 6]
