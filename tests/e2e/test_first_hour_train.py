"""A newcomer's first hour, in training: a user's dataset holds out validation data by default (never trained on),
the step times leave evaluation and checkpoints out, and the loss plot marks a resume read from the run.

Oracles: a model that records the (shard, index) of every example it sees, in training and in evaluation; the
dataset's own Parquet rows; a clock moved by a known amount inside each evaluation and checkpoint.
"""

from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest

from tests.cli_utils import assert_user_error
from tests.train_utils import TINY, evals, metrics, sets, write_text_dataset

BATCH = [x for x in TINY if not x.startswith("model.")]

_RECORDER = '''
import torch
import torch.nn.functional as F

SEEN = {"train": [], "eval": []}


class Recorder(torch.nn.Module):
    """Appends the (shard, index) of every example it sees to SEEN, by mode."""

    flops_per_example = 1.0  # no FLOP count: it would call forward on meta tensors

    def __init__(self, dim=16):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256)

    def forward(self, batch):
        SEEN["train" if self.training else "eval"].extend(zip(batch["shard"].tolist(), batch["index"].tolist()))
        tokens = batch["tokens"].long()
        logits = self.head(self.emb(tokens[:, :-1]))
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def recorder(**kw):
    return Recorder(**kw)
'''


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """The recording model's module directory on sys.path; returns a function giving what it saw."""
    where = tmp_path / "models"
    where.mkdir()
    (where / "holdoutrec.py").write_text(_RECORDER)
    monkeypatch.syspath_prepend(str(where))
    return lambda: sys.modules["holdoutrec"].SEEN


def _rows(data, shard: int, index: int) -> list[int]:
    """Row ``index`` of shard ``shard``'s file, read with PyArrow."""
    index_file = json.loads((data / "index.json").read_text())
    file = next(s["file"] for s in index_file["shards"] if s["id"] == shard)
    return pq.read_table(data / file)["tokens"][index].as_py()


def test_a_users_dataset_holds_out_records_by_default_and_never_trains_on_them(cli, tmp_path, recorder):
    data = write_text_dataset(tmp_path / "data", [24, 24, 24, 24, 24, 24, 21, 23])  # 188 records, 8 shards
    run = tmp_path / "run"
    items = [*BATCH, f"data.path={data}", "model.name=holdoutrec:recorder", "data.num_workers=0"]
    first = cli("train", "--run-dir", run, *sets(*items, "run.max_steps=6", "eval.every_steps=3",
                                                 "checkpoint.every_steps=3"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert "validation: held out 5% of records (9 of 188)" in first.stderr  # round(0.05 x 188)
    resumed = cli("train", "--resume", run, *sets("run.max_steps=11"))  # a whole epoch: 179 // 16 = 11 steps
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "validation: held out 5% of records (9 of 188)" in resumed.stderr  # the same draw
    seen = recorder()
    held = set(seen["eval"])
    assert len(held) == 9 and all(0 <= i < 24 for _, i in held)
    trained = seen["train"]
    assert len(trained) == 11 * 16 and len(set(trained)) == len(trained)  # an epoch: each example once
    assert not held & set(trained)  # never trained on, before or after the resume
    everything = {(s, i) for s, n in enumerate([24, 24, 24, 24, 24, 24, 21, 23]) for i in range(n)}
    assert len(everything - held - set(trained)) == 179 - 176  # only the remainder of the last global batch
    plan = json.loads((run / "plan.json").read_text())
    assert plan["eval_records"] == 9 and plan["eval_shards"] is None
    rows = evals(run)
    assert [r["step"] for r in rows] == [3, 6, 9, 11] and all(r["val_items"] == 9 for r in rows)
    # what `eval` evaluates is the same held-out set: the value the run recorded at its last step
    again = cli("eval", run, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["val_loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-9)
    assert set(seen["eval"][-9:]) == held
    # the held-out (shard, index) pairs name the dataset's rows: the model saw exactly those tokens
    shard, index = sorted(held)[0]
    assert len(_rows(data, shard, index)) == 33


def test_the_loss_plot_of_a_resumed_run_marks_the_resume(cli, tmp_path):
    from steadytrain.runs.plots import loss_figure
    from steadytrain.runs.record import load_run

    data = write_text_dataset(tmp_path / "data", [16] * 6)
    run = tmp_path / "run"
    first = cli("train", "--run-dir", run, *sets(*TINY, f"data.path={data}", "run.max_steps=3"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert cli("train", "--resume", run, *sets("run.max_steps=5")).returncode == 0
    fig = loss_figure(load_run(run))
    (ax,) = fig.axes
    (resumes,) = [c for c in ax.collections if c.get_gid() == "resumes"]
    assert [seg[0][0] for seg in resumes.get_segments()] == [3]  # resumes.jsonl: resumed after step 3


def test_enough_shards_hold_out_a_whole_shard(cli, tmp_path):
    data = write_text_dataset(tmp_path / "data", [10] * 20)  # floor(0.05 x 20) = 1 shard
    run = tmp_path / "run"
    r = cli("train", "--run-dir", run, *sets(*TINY, f"data.path={data}", "run.max_steps=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    (shard,) = json.loads((run / "plan.json").read_text())["eval_shards"]
    assert f"validation: held out shard {shard} (10 records)" in r.stderr
    exposure = {int(k) for k in json.loads((run / "exposure.json").read_text())}
    assert exposure and shard not in exposure
    assert [r["val_items"] for r in evals(run)] == [10]


def test_too_few_records_train_on_everything_and_say_so(cli, tmp_path):
    data = write_text_dataset(tmp_path / "data", [16])  # one global batch: none can be spared
    run = tmp_path / "run"
    r = cli("train", "--run-dir", run, *sets(*TINY, f"data.path={data}", "run.max_steps=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation: none" in r.stderr and "eval.data" in r.stderr
    assert evals(run) == [] and len(metrics(run)) == 2
    assert_user_error(cli("eval", run), "no validation set", "--data")


def test_explicit_validation_settings_are_kept(cli, tmp_path):
    data = write_text_dataset(tmp_path / "data", [24, 24, 24, 24, 24, 24, 21, 23])
    other = write_text_dataset(tmp_path / "other", [20, 17])
    r = cli("train", "--run-dir", tmp_path / "a", *sets(*TINY, f"data.path={data}", "run.max_steps=2",
                                                         "eval.holdout_shards=2"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert len(plan["eval_shards"]) == 2 and "eval_records" not in plan
    a, b = plan["eval_shards"]
    sizes = [24, 24, 24, 24, 24, 24, 21, 23]
    assert f"validation: held out shards {a}, {b} ({sizes[a] + sizes[b]} records)" in r.stderr
    r = cli("train", "--run-dir", tmp_path / "b", *sets(*TINY, f"data.path={data}", "run.max_steps=2",
                                                         f"eval.data={other}"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation: held out" not in r.stderr
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["eval_shards"] is None
    assert [e["val_items"] for e in evals(tmp_path / "b")] == [37]
    r = cli("train", "--run-dir", tmp_path / "c", *sets(*TINY, f"data.path={data}", "run.max_steps=2",
                                                         "eval.holdout_fraction=null"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert evals(tmp_path / "c") == [] and "validation:" not in r.stderr


def test_step_times_leave_evaluation_and_checkpoints_out(cli, tmp_path, monkeypatch):
    import steadytrain.train.job.validate as validate
    import steadytrain.train.observe.metrics as metrics_module
    from steadytrain.train.checkpoint.writer import CheckpointWriter

    # Each evaluation and each checkpoint takes 1000 s on the clock the timings read (nothing sleeps).
    offset, real_now = [0.0], metrics_module._now
    monkeypatch.setattr(metrics_module, "_now", lambda: real_now() + offset[0])

    def slow(real):
        def run(*args, **kwargs):
            out = real(*args, **kwargs)
            offset[0] += 1000.0
            return out

        return run

    monkeypatch.setattr(validate, "evaluate", slow(validate.evaluate))
    monkeypatch.setattr(CheckpointWriter, "save", slow(CheckpointWriter.save))
    data = write_text_dataset(tmp_path / "data", [24, 24, 24, 24, 24, 24, 21, 23])
    run = tmp_path / "run"
    items = [*TINY, f"data.path={data}", "run.max_steps=7", "eval.holdout_shards=1", "eval.every_steps=2",
             "checkpoint.every_steps=3", "run.log_every=1"]  # fmt: skip
    r = cli("train", "--run-dir", run, *sets(*items))
    assert r.returncode == 0, r.stderr[-3000:]
    rows, ev = {m["step"]: m for m in metrics(run)}, evals(run)
    assert [e["step"] for e in ev] == [2, 4, 6, 7] and all(e["val_time_s"] >= 1000 for e in ev)  # its own time
    checkpointed = [s for s, m in rows.items() if "checkpoint_s" in m]  # after the checkpoints of steps 3 and 6
    assert checkpointed == [4, 7] and all(rows[s]["checkpoint_s"] >= 1000 for s in checkpointed)
    for step, m in rows.items():
        assert m["step_s"] < 1000, (step, m)  # no step is charged an evaluation or a checkpoint
        assert m["items_per_s"] == pytest.approx(m["items"] / m["step_s"], rel=1e-3)  # the rate is of the step
    for after in (3, 5, 7):  # the wall clock did pass: elapsed_s holds the evaluation
        assert rows[after]["elapsed_s"] - rows[after - 1]["elapsed_s"] >= 1000
