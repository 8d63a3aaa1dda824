"""Loss spikes end to end: a planted unit change (amounts in cents) in one shard, trained on 2 gloo ranks.

Oracles: the rows the test wrote in cents (the bad examples, exactly), the step whose batch holds the
bad shard (the global order with shuffle window 1: :func:`spikedemo.bad_shard_at`), a run of the same
data with those rows NaN (a non-finite step, skipped by the established non-finite path: the
parameters a step whose update is zero leaves), and a run of the data without the bad shard.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from steadytrain.diagnose import hunt, report
from steadytrain.diagnose.ledger import SPIKES
from steadytrain.diagnose.spikedemo import BATCH, bad_shard_at, make_dataset, train_config
from steadytrain.runs.goodput import goodput
from steadytrain.runs.replay import run_model
from steadytrain.train.checkpoint.catalog import latest_checkpoint, load_checkpoint
from steadytrain.train.job.loop import train
from steadytrain.train.setup.config import load_config
from tests.dist_utils import train_on_ranks
from tests.train_utils import TINY, metrics, run_cli, sets, write_text_dataset

STEPS, POSITION, SHARDS = 60, 80, 160
SPIKE_STEP = POSITION // 2 + 1  # two shards per global batch
BAD = bad_shard_at(POSITION, SHARDS)
ROWS = sorted(random.Random(7).sample(range(32), 20))  # the planted rows, in cents


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("spike-data")
    return {
        "cents": make_dataset(root / "cents", shards=SHARDS, bad_shard=BAD, bad_rows=ROWS),
        "clean": make_dataset(root / "clean", shards=SHARDS, bad_shard=BAD, drop_bad=True),
        "nan": make_dataset(root / "nan", shards=SHARDS, bad_shard=BAD, bad_rows=ROWS, fault="nan"),
    }


def _config(tmp: Path, name: str, data: Path, steps: int = STEPS, **spike) -> Path:
    cfg = train_config(data, steps=steps, policy=spike.pop("policy", "warn"))
    cfg["spike"].update(spike)
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / f"{name}.yaml"


# The runs trained on 2 ranks: name -> (data set, spike.policy, steps). The skipped step and its NaN reference end
# 4 steps after the spike: the parameters and optimizer state of the step whose update is zero shape all 4.
TWO_RANKS = {
    "warn": ("cents", "warn", STEPS),
    "skip": ("cents", "skip", SPIKE_STEP + 4),
    "nan": ("nan", "off", SPIKE_STEP + 4),
    "rollback": ("cents", "rollback", STEPS),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data) -> dict[str, tuple[Path, list[str | None]]]:
    """Per name in :data:`TWO_RANKS`: the run directory and each rank's error (None: the run finished), all trained
    on one spawn of 2 ranks (each rank runs the job ``steadytrain train`` runs under torchrun; the command's plots
    are no part of these tests)."""
    root = tmp_path_factory.mktemp("spike-runs")
    runs = {name: root / name for name in TWO_RANKS}
    jobs = [(_config(root, name, data[d], steps, policy=p), runs[name]) for name, (d, p, steps) in TWO_RANKS.items()]
    results = train_on_ranks(root, jobs)
    return {name: (runs[name], errors) for name, errors in zip(runs, results, strict=True)}


def _trained(two_ranks: dict, name: str) -> Path:
    run, errors = two_ranks[name]
    for error in errors:
        assert error is None, error[-3000:]
    return run


def _spikes(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / SPIKES).read_text().splitlines()]


@pytest.mark.distributed  # reads runs trained on 2 gloo ranks
def test_warn_detects_the_spike_on_both_ranks_and_traces_it_to_the_planted_rows(two_ranks):
    run = _trained(two_ranks, "warn")
    records = _spikes(run)
    assert sorted((r["step"], r["rank"], r["action"]) for r in records) == [
        (SPIKE_STEP, 0, "warn"),
        (SPIKE_STEP, 1, "warn"),
    ]
    assert records[0]["value"] == records[1]["value"] > records[0]["threshold"]  # one global loss, one decision
    assert [r["step"] for r in metrics(run) if r.get("spike")] == [SPIKE_STEP]
    outlying = sorted(i for r in records for mb in r["tags"] for j, i in enumerate(mb["index"]) if j in mb["nonfinite"])
    assert outlying == ROWS  # every planted example, and no other, from the per-example losses alone
    rep = report(run, SPIKES)
    assert rep.verdict == "shard-selective" and rep.suspect_shards == [BAD], rep.sentence
    assert rep.suspect_ranks == [] and rep.suspect_hosts == []  # one rank read the shard: the data, not that rank
    found = hunt(run, BAD, loader=run_model, kind="spike")
    assert found.examples == ROWS, found.sentence
    assert {(f["example"], f["field"]) for f in found.fields} == {(i, "amount") for i in ROWS}
    assert found.provenance_diff == {"pipeline_version": ["3.1", "3.0"]}
    proc = run_cli("spikes", "report", str(run), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["suspect_shards"] == [BAD]


@pytest.mark.distributed  # reads runs trained on 2 gloo ranks
def test_skip_leaves_the_parameters_of_a_step_whose_update_is_zero(two_ranks):
    skipped = _trained(two_ranks, "skip")
    reference = _trained(two_ranks, "nan")  # NaN rows (spike.policy=off): the non-finite skip
    rows = {r["step"]: r for r in metrics(skipped)}
    assert rows[SPIKE_STEP]["skipped"] and rows[SPIKE_STEP]["spike"]
    assert {r["rank"]: r["action"] for r in _spikes(skipped)} == {0: "skip", 1: "skip"}
    assert [r["step"] for r in metrics(reference) if r["skipped"]] == [SPIKE_STEP]
    last = [latest_checkpoint(run / "checkpoints") for run in (skipped, reference)]
    assert [p.name for p in last] == [f"step-{SPIKE_STEP + 4:08d}"] * 2  # the runs' ends, 4 steps after the skip
    a, b = (load_checkpoint(p)["model"] for p in last)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed  # reads runs trained on 2 gloo ranks
def test_rollback_goes_back_skips_the_recorded_batch_and_ends_like_a_run_without_the_shard(tmp_path, data, two_ranks):
    run = _trained(two_ranks, "rollback")
    clean = tmp_path / "clean"  # one rank, in this process (a run that fails raises)
    train(load_config(_config(tmp_path, "clean", data["clean"], policy="off")), run_dir=clean)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    back = [r for r in lines if "rollback_to" in r]
    (record,) = [r for r in _spikes(run) if r["rank"] == 0]
    assert back == [{"step": SPIKE_STEP, "rollback_to": 40, "skipped_batches": [SPIKE_STEP - 1], "rollback": 1}]
    assert record["action"] == "rollback" and record["batch"] == SPIKE_STEP - 1 and record["rollback_to"] == 40
    assert (run / "checkpoints" / "step-00000040").is_dir()  # kept by retention (keep_last 2)
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, STEPS + 1))  # the rolled-back rows are gone, each step once
    exposure = {int(k): v for k, v in json.loads((run / "exposure.json").read_text()).items()}
    assert BAD not in exposure and sum(exposure.values()) == STEPS * BATCH  # the bad batch never trained on
    layers = [json.loads(x) for x in (run / "layers.jsonl").read_text().splitlines()]
    kept = [r for r in layers if "rollback" in r]  # what the spike's layers saw stays, marked as its metrics row
    assert kept and {(r["step"], r["rollback"], r["update_norm"]) for r in kept} == {(SPIKE_STEP, 1, None)}
    plain = [(r["step"], r["layer"]) for r in layers if "rollback" not in r]
    assert len(plain) == len(set(plain)) and {s for s, _ in plain} == set(range(10, STEPS + 1, 10))  # each once
    tail = [sum(r["loss"] for r in metrics(x)[-10:]) / 10 for x in (run, clean)]
    assert abs(tail[0] / tail[1] - 1) < 0.05, tail

    # the time account: the refused step is skipped time and the rollback's restore its own; the spike came in the
    # step right after checkpoint 40, so no trained step was thrown away (less than one step's time)
    (a,) = goodput(run).to_dict()["attempts"]
    step_s = sorted(r["step_s"] for r in metrics(run))[len(metrics(run)) // 2]
    assert a["badput"]["skipped_steps"] > 0 and a["badput"]["checkpoint_restore"] > 0, a
    assert a["badput"]["lost_progress"] < step_s, (a, step_s)
    assert a["productive_s"] + sum(a["badput"].values()) == pytest.approx(a["wall_s"], abs=5e-3)


def test_the_window_survives_a_resume(tmp_path, data):
    cfg = train_config(data["cents"], steps=STEPS, policy="warn")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(tmp_path / "c.yaml")
    train(config, run_dir=tmp_path / "straight")
    train(config, run_dir=tmp_path / "split", stop_after=30)
    assert not (tmp_path / "split" / SPIKES).exists()
    train(config, resume=tmp_path / "split")
    keys = ("step", "value", "median", "mad", "threshold", "batch")
    straight, split = (_spikes(tmp_path / name) for name in ("straight", "split"))
    assert [{k: r[k] for k in keys} for r in split] == [{k: r[k] for k in keys} for r in straight]
    assert [r["step"] for r in straight] == [SPIKE_STEP]


def test_max_rollbacks_stops_the_run_with_its_report(tmp_path):
    second = bad_shard_at(POSITION + 20, SHARDS)  # in global batch SPIKE_STEP + 9 (0-based)
    data = make_dataset(tmp_path / "data", shards=SHARDS, bad_shard=[BAD, second])
    cfg = train_config(data, steps=STEPS, policy="rollback")
    cfg["spike"].update(max_rollbacks=1)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1 and "spike.max_rollbacks=1" in proc.stderr, proc.stderr[-2000:]
    records = _spikes(tmp_path / "run")
    # one batch passed over: global batch b is trained at step b from then on (not b + 1)
    got = [(r["step"], r["batch"], r["action"]) for r in records]
    assert got == [(SPIKE_STEP, SPIKE_STEP - 1, "rollback"), (SPIKE_STEP + 9, SPIKE_STEP + 9, "stop")]
    rows = metrics(tmp_path / "run")
    assert rows[-1]["step"] == SPIKE_STEP + 9 and rows[-1]["skipped"] and rows[-1]["spike"]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "loss spikes" in summary and "spike.max_rollbacks=1" in summary.replace("\\", "")
    # step 50 trained on batch 50 (batch 40 passed over): a replay of step 50 finds the second shard's rows
    found = hunt(tmp_path / "run", step=SPIKE_STEP + 9, loader=run_model, kind="spike")
    assert found.bad and {s for s, _ in found.bad} == {second}, found.sentence
    # the stopped run resumes with more rollbacks allowed, from its last checkpoint, and finishes
    proc = run_cli("train", "--resume", str(tmp_path / "run"), *sets("spike.max_rollbacks=3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, STEPS + 1))


def _straight(tmp: Path, name: str, data: Path, **spike) -> tuple[Path, object]:
    cfg = train_config(data, steps=STEPS, policy=spike.pop("policy", "rollback"))
    cfg["spike"].update(spike)
    cfg["checkpoint"]["keep_last"] = 20
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(tmp / f"{name}.yaml")
    return tmp / name, config


def test_a_crash_right_after_a_rollback_resumes_on_the_rolled_back_timeline(tmp_path, data, monkeypatch):
    """The checkpoints newer than the rollback's target belong to the abandoned timeline: a resume after a crash
    must not pick them (nor lose steps); the result equals a run that did not crash."""
    from steadytrain.train.job import loop

    straight, config = _straight(tmp_path, "straight", data["cents"], skip_batches=5)
    train(config, run_dir=straight)
    run = tmp_path / "crashed"
    real = loop.rollback

    def crash(job, event):
        real(job, event)
        raise RuntimeError("killed right after the rollback")

    monkeypatch.setattr(loop, "rollback", crash)
    with pytest.raises(RuntimeError, match="killed"):
        train(config, run_dir=run)
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == [f"step-{s:08d}" for s in (0, 10, 20, 30)]  # 40 was the abandoned timeline's
    monkeypatch.undo()
    train(config, resume=run)
    resumed = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [30]
    for r in (straight, run):
        lines = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in metrics(r)] == list(range(1, STEPS + 1))
        assert [x for x in lines if "rollback_to" in x] == [
            {"step": SPIKE_STEP, "rollback_to": 30, "skipped_batches": [36, 37, 38, 39, 40], "rollback": 1}
        ]
        assert [x["action"] for x in _spikes(r)] == ["rollback"]
    a = load_checkpoint(latest_checkpoint(straight / "checkpoints"))["model"]
    b = load_checkpoint(latest_checkpoint(run / "checkpoints"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_policies_do_not_change_a_run_without_spikes_and_retention_keeps_old_targets(tmp_path, data):
    losses = {}
    for policy in ("off", "warn", "skip", "rollback"):
        run, config = _straight(tmp_path, policy, data["clean"], policy=policy)
        train(config, run_dir=run, stop_after=12)
        losses[policy] = [r["loss"] for r in metrics(run)]
    assert losses["off"] == losses["warn"] == losses["skip"] == losses["rollback"]  # exactly: no step of its own
    # skip_batches beyond checkpoint.every_steps x keep_last: the target a spike needs is kept all along
    cfg = train_config(data["cents"], steps=STEPS, policy="rollback")
    cfg["spike"]["skip_batches"] = 25
    (tmp_path / "far.yaml").write_text(yaml.safe_dump(cfg))
    train(load_config(tmp_path / "far.yaml"), run_dir=tmp_path / "far")
    (back,) = [
        json.loads(x) for x in (tmp_path / "far" / "metrics.jsonl").read_text().splitlines() if "rollback_to" in x
    ]
    assert back["rollback_to"] == 10 and back["skipped_batches"] == list(range(SPIKE_STEP - 25, SPIKE_STEP))


def test_two_spikes_at_one_step_number_count_twice(tmp_path):
    second = bad_shard_at(POSITION + 2, SHARDS)  # the next global batch: step 41 spikes again after the rollback
    data = make_dataset(tmp_path / "data", shards=SHARDS, bad_shard=[BAD, second])
    run, config = _straight(tmp_path, "run", data)
    train(config, run_dir=run)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["skipped_batches"]) for x in lines if "rollback_to" in x] == [(41, [40]), (41, [41])]
    rep = report(run, SPIKES)
    assert rep.verdict == "shard-selective" and sorted(rep.suspect_shards) == sorted([BAD, second]), rep.sentence
    assert "2 of 2 loss spikes" in rep.sentence
    proc = run_cli("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "| loss spikes | 2 (spike.policy=rollback); 2 rollback(s)" in (run / "summary.md").read_text()


def test_no_spike_on_clean_runs_with_warmup(tmp_path, data):
    """The default thresholds on clean 300-step runs with LR warmup: a regression and a small byte-level LM (each in
    this process: a run that fails raises)."""
    # one global batch per shard (the demo's batch of 64 rows, as two shards of 32 make it): 20 batches to spare
    cfg = train_config(make_dataset(tmp_path / "reg", shards=320, rows=BATCH), steps=300, policy="warn")
    cfg["spike"] = {"policy": "warn"}  # the defaults
    cfg["batch"]["warmup_steps"] = 30
    (tmp_path / "reg.yaml").write_text(yaml.safe_dump(cfg))
    train(load_config(tmp_path / "reg.yaml"), run_dir=tmp_path / "reg-run")
    text = write_text_dataset(tmp_path / "text", [400] * 16)
    lm = ["data.path=" + str(text), "run.max_steps=300", "batch.warmup_steps=30", "run.log_every=50", *TINY]
    train(load_config(None, lm), run_dir=tmp_path / "lm-run")
    for run in ("reg-run", "lm-run"):
        assert len(metrics(tmp_path / run)) == 300
        assert not (tmp_path / run / SPIKES).exists() and not any(r.get("spike") for r in metrics(tmp_path / run))


def test_a_rollback_past_a_resume_keeps_the_resumed_configs_learning_rate(tmp_path, data):
    """A resume at step 40 halves the LR; the spike at step 41 rolls back to the checkpoint the first run saved at
    step 40 (with the old LR in its optimizer and scheduler state): every step after it trains at the new LR, as a
    run started with the new LR does at those steps."""
    old, new = (train_config(data["cents"], steps=STEPS, policy="rollback") for _ in range(2))
    new["batch"]["base_lr"] = old["batch"]["base_lr"] / 2
    for name, cfg in (("old", old), ("new", new)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    train(load_config(tmp_path / "old.yaml"), run_dir=tmp_path / "run", stop_after=SPIKE_STEP - 1)
    train(load_config(tmp_path / "new.yaml"), resume=tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollback_to"] for r in lines if "rollback_to" in r] == [SPIKE_STEP - 1]  # to the first run's state
    reference = tmp_path / "reference"
    train(load_config(tmp_path / "new.yaml", [f"data.path={data['clean']}", "spike.policy=off"]), run_dir=reference)
    expected = {r["step"]: r["lr"] for r in metrics(reference)}
    after = [(r["step"], r["lr"]) for r in metrics(tmp_path / "run") if r["step"] >= SPIKE_STEP]
    assert len(after) == STEPS - SPIKE_STEP + 1
    assert after == [(s, expected[s]) for s, _ in after]
