"""Training on a mixture (``data.sources``): exact shares, any world size, kill and resume, schedules, figures.

Oracles: the closed form of the shares (3:1 of a global batch of 8 is 6 and 2 every step), the one-rank run for
the two-rank one, the uninterrupted run for a resumed one, and for ``loss/<name>`` a hand computation from the
per-example losses of each step's batch replayed on the weights it was trained from (its checkpoint)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from steadytrain.data import DatasetWriter
from steadytrain.diagnose.batches import step_batch
from steadytrain.runs.replay import run_model
from tests.cli_utils import assert_user_error
from tests.train_utils import TINY, copy_run, evals, metrics, run_cli, sets, train

STEPS = 6


def _source(path: Path, sizes: list[int], start: int, extra: str | None = None) -> str:
    """Byte sequences (33 bytes) of this project's source from byte ``start`` on, one shard per size."""
    src = b"".join(p.read_bytes() for p in sorted(Path(__file__).parents[2].glob("src/steadytrain/**/*.py")))
    seqs = np.frombuffer(src[start:], dtype=np.uint8)[: 33 * sum(sizes)].reshape(-1, 33)
    with DatasetWriter(path, provenance={"source": path.name}) as w:
        for i, n in enumerate(sizes):
            part = seqs[sum(sizes[:i]) : sum(sizes[:i]) + n]
            cols = {"tokens": pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), 33)}
            if extra:
                cols[extra] = pa.array(np.zeros(n))
            w.write_shard(pa.table(cols))
    return str(path)


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """``web``: 4 shards of 30 (one held out: 90 to train on, 6 a step); ``code``: 3 of 5 (10 to train on, 2 a
    step: it runs out every 5 steps)."""
    root = tmp_path_factory.mktemp("mixture")
    web, code = _source(root / "web", [30] * 4, 0), _source(root / "code", [5] * 3, 400_000)
    sources = f"data.sources=[{{name: web, path: {web}, weight: 3}}, {{name: code, path: {code}, weight: 1}}]"
    items = [
        *TINY, sources, "batch.global_batch_size=8", "batch.micro_batch_size=2", f"run.max_steps={STEPS}",
        "run.log_every=2", "checkpoint.every_steps=1", "checkpoint.keep_last=10", "eval.holdout_shards=1",
        "eval.every_steps=3", "run.trackers=[]",
    ]  # fmt: skip
    straight = root / "straight"
    train(straight, *items)
    return {"root": root, "items": items, "straight": straight, "web": web, "code": code}


def _state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step:08d}" / "state.json").read_text())["train"]


def test_every_step_holds_exactly_its_share_and_the_small_source_restarts(mix):
    run = mix["straight"]
    sources = json.loads((run / "sources.json").read_text())
    offsets = {s["name"]: (s["offset"], s["ids"]) for s in sources["sources"]}
    for step in range(1, STEPS + 1):  # the examples seen after each step: 6 and 2 more per step
        exposure = {int(k): v for k, v in _state(run, step)["exposure"].items()}
        seen = {n: sum(v for k, v in exposure.items() if o <= k < o + ids) for n, (o, ids) in offsets.items()}
        assert seen == {"web": 6 * step, "code": 2 * step}
    _, settings = run_model(run, before_step=0)
    for step in range(1, STEPS + 1):  # and the examples themselves
        batch = step_batch(settings, step)
        assert torch.bincount(batch["source"], minlength=2).tolist() == [6, 2]
    seen = sources["exposure"]
    assert (seen["web"]["examples"], seen["code"]["examples"]) == (36, 12)
    assert (seen["code"]["epoch"], seen["code"]["epochs"], seen["web"]["epoch"]) == (1, 1.2, 0)  # 12 of 10
    assert sources["largest"] == "web"


def test_loss_per_source_is_the_mean_of_its_examples_losses(mix):
    run = mix["straight"]
    per_step = {}
    for step in range(1, STEPS + 1):
        model, settings = run_model(run, before_step=step - 1)  # the weights step `step` was trained from
        batch = step_batch(settings, step)
        with torch.no_grad():
            per_step[step] = (model(batch).double(), batch["source"])
    rows = {r["step"]: r for r in metrics(run)}
    # the rows written together carry them on their last (here every step: a checkpoint writes the rows)
    ends = [s for s, r in rows.items() if "loss/web" in r]
    assert ends[-1] == STEPS
    for first, end in zip([1] + [e + 1 for e in ends[:-1]], ends, strict=True):
        losses = torch.cat([per_step[s][0] for s in range(first, end + 1)])
        source = torch.cat([per_step[s][1] for s in range(first, end + 1)])
        for j, name in enumerate(("web", "code")):
            assert rows[end][f"loss/{name}"] == pytest.approx(losses[source == j].mean().item(), rel=1e-5)
            assert rows[end][f"mix/{name}"] == (0.75, 0.25)[j]
    for row in evals(run):  # the whole validation loss is the examples' mean over both sources
        n = row["val_items/web"] + row["val_items/code"]
        assert n == row["val_items"] == 30 + 5
        whole = (row["val_loss/web"] * row["val_items/web"] + row["val_loss/code"] * row["val_items/code"]) / n
        assert whole == pytest.approx(row["val_loss"], rel=1e-9)


@pytest.mark.distributed  # starts ranks of its own: the ranks group
@pytest.mark.parametrize("ranks", [2, 4])
def test_two_and_four_ranks_train_on_the_same_examples_with_the_same_losses(mix, ranks):
    run = mix["root"] / f"ranks-{ranks}"
    train(run, *mix["items"], args=("--nproc", str(ranks)))  # accumulation 2 on 2 ranks, 1 on 4
    one, two = metrics(mix["straight"]), metrics(run)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "loss/web", "loss/code", "mix/web", "mix/code"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    assert _state(run, 3)["exposure"] == _state(mix["straight"], 3)["exposure"]


def _trained(run: Path) -> list[dict]:
    """What a step trained and measured, without its timings."""
    keep = ("step", "loss", "lr", "grad_norm", "skipped", "loss/web", "loss/code", "mix/web", "mix/code")
    return [{k: r.get(k) for k in keep} for r in metrics(run)]


def _killed_at(mix, name: str, step: int) -> Path:
    run = copy_run(mix["straight"], mix["root"] / name)
    for ckpt in (run / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)  # as if killed after step `step`'s checkpoint
    return run


def test_a_killed_run_resumes_bit_for_bit(mix):
    run = _killed_at(mix, "killed", 2)
    train(run, *mix["items"], args=("--auto-resume",))
    assert _trained(run) == _trained(mix["straight"])
    assert (
        json.loads((run / "sources.json").read_text())["exposure"]
        == json.loads((mix["straight"] / "sources.json").read_text())["exposure"]
    )


def test_a_schedule_switches_at_its_step_also_across_a_resume(mix):
    schedule = "data.mix_schedule=[{step: 4, weights: {web: 1, code: 1}}]"
    straight = mix["root"] / "scheduled"
    train(straight, *mix["items"], schedule)
    resumed = _killed_at(mix, "rescheduled", 2)  # trained 2 steps without a schedule: step 4 is still ahead
    train(resumed, *mix["items"], schedule, args=("--auto-resume",))
    rows = {r["step"]: r for r in metrics(straight)}
    assert [rows[s]["mix/web"] for s in range(1, STEPS + 1)] == [0.75] * 3 + [0.5] * 3  # 1:1 from step 4 on
    keep = ("step", "loss", "grad_norm", "loss/web", "loss/code", "mix/web", "mix/code")
    assert [{k: r.get(k) for k in keep} for r in metrics(resumed)] == [
        {k: r.get(k) for k in keep} for r in rows.values()
    ]
    (record,) = [json.loads(x) for x in (resumed / "resumes.jsonl").read_text().splitlines()]
    assert record["changes"] == {"data.mix_schedule": [None, [{"step": 4, "weights": {"web": 1.0, "code": 1.0}}]]}
    late = copy_run(mix["straight"], mix["root"] / "late")  # trained to step 6: a change at step 4 is in the past
    proc = run_cli("train", "--resume", str(late), *sets(*mix["items"], schedule, "run.max_steps=8"))
    assert_user_error(proc, "data.mix_schedule", "step 4", "already trained", "from step 7")


def test_sources_with_other_columns_are_refused_before_the_run_directory(mix):
    other = _source(mix["root"] / "labelled", [20, 20], 0, extra="label")
    items = [*mix["items"][:-1]]
    items[len(TINY)] = (
        f"data.sources=[{{name: web, path: {mix['web']}, weight: 3}}, {{name: odd, path: {other}, weight: 1}}]"
    )
    run = mix["root"] / "refused"
    proc = run_cli("train", "--run-dir", str(run), *sets(*items))
    assert_user_error(proc, "source 'odd'", "columns", "label")
    assert not run.exists()


def test_an_interval_of_several_micro_batches_and_ranks_averages_per_example():
    from steadytrain.train.observe.sources import SourceLosses
    from steadytrain.train.setup.distributed import DistInfo

    acc = SourceLosses(["a", "b", "c"], DistInfo(0, 1, 0, torch.device("cpu"), None))
    batches = [([1.0, 2.0, 4.0], [0, 1, 0]), ([8.0, 16.0], [0, 0]), ([3.0, 5.0], [1, 1])]
    for losses, source in batches:
        acc.add(torch.tensor(losses), torch.tensor(source))
    acc.add(torch.tensor(7.0), torch.tensor([1, 0]))  # a scalar loss: counted in the mixture, not in the loss
    got = acc.take()
    assert got["loss/a"] == (1 + 4 + 8 + 16) / 4 and got["loss/b"] == (2 + 3 + 5) / 3 and got["loss/c"] is None
    assert (got["mix/a"], got["mix/b"], got["mix/c"]) == (round(5 / 9, 6), round(4 / 9, 6), 0.0)
    assert acc.take()["mix/a"] is None  # a fresh interval


def test_eval_of_a_mixture_run_is_its_last_evaluation_per_source(mix):
    from steadytrain.runs.evaluate import evaluate_run

    got = evaluate_run(mix["straight"])
    last = evals(mix["straight"])[-1]
    assert got["step"] == last["step"] == STEPS
    for key in ("val_loss", "val_loss/web", "val_loss/code"):
        assert got[key] == pytest.approx(last[key], rel=1e-6), key
    assert (got["val_items/web"], got["val_items/code"]) == (30, 5)


def test_a_mixture_shard_is_hunted_in_its_own_source_and_a_step_is_refused(mix):
    from steadytrain.diagnose.hunt import hunt
    from steadytrain.errors import UserError

    sources = json.loads((mix["straight"] / "sources.json").read_text())["sources"]
    code = next(s for s in sources if s["name"] == "code")
    trained = int(
        next(k for k in json.loads((mix["straight"] / "sources.json").read_text())["exposure"]["code"]["shards"])
    )
    found = hunt(mix["straight"], code["offset"] + trained, loader=run_model)
    assert found.shard == code["offset"] + trained and found.examples_checked == 5  # the shard's 5 rows, in `code`
    assert f"source 'code''s shard {trained}" in found.note and found.examples == [] and found.bad == []
    with pytest.raises(UserError, match="hunted by shard, not by step"):
        hunt(mix["straight"], None, loader=run_model, step=2)


def test_repro_finds_a_mixtures_data_unchanged(mix):
    from steadytrain.runs.record import load_run
    from steadytrain.runs.repro import _check_data
    from steadytrain.train.setup.config import load_config

    rec, notes = load_run(mix["straight"]), []
    _check_data(rec, load_config(mix["straight"] / "config.yaml"), notes)
    assert notes == [] and rec.data["fingerprint"].startswith("mix(web=")
