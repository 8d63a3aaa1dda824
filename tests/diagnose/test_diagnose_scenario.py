"""The seed's NaN scenario at small size, end to end through `steadytrain train` and the diagnosis.

40 shards; the bad one (from a later pipeline, a quarter of its rows with a category the vocabulary
never saw) is drawn by the test from a printed seed (``STEADYTRAIN_TEST_SEED`` overrides it; every
assertion message names it, and a failing seed becomes its own test, as the step-1 case below did).
Oracles: the rows the test wrote with the new value (the bad examples, exactly), the provenance the
test gave each shard, the global order's step batches (`global_batch`) and its documented split of a
step between ranks, the checkpoint schedule, and the weights saved after a skipped step 1."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from steadytrain.data import global_batch, open_dataset
from steadytrain.diagnose import hunt as diagnose_hunt
from steadytrain.diagnose import read_ledger, report
from steadytrain.diagnose.demo import LATER, NEW_VALUE, PROVENANCE, make_dataset, train_config
from steadytrain.runs.replay import run_model
from steadytrain.train.checkpoint.catalog import load_checkpoint
from tests.cli_utils import EXE, in_process
from tests.dist_utils import cli_on_ranks

SHARDS = 40
SEED = int(os.environ.get("STEADYTRAIN_TEST_SEED", "1"))
_rng = random.Random(SEED)
BAD = _rng.randrange(1, SHARDS)  # the test's secret, from SEED
RANK = _rng.randrange(2)  # the rank that reads the bad rows in the two-rank test
WHO = f"seed={SEED} (STEADYTRAIN_TEST_SEED) bad shard={BAD}"


def hunt(*args, **kwargs):
    """The library's hunt with the run's own model builder (what `steadytrain nan hunt` passes in)."""
    return diagnose_hunt(*args, loader=run_model, **kwargs)


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def bad_rows(data: Path, shard: int) -> list[int]:
    table = pq.read_table(data / f"shard-{shard:05d}.parquet")
    return [i for i, v in enumerate(table["region"].to_pylist()) if v == NEW_VALUE]


def train(tmp: Path, data: Path, name: str, *overrides: str, code: int = 0, **cfg_kw) -> Path:
    """``steadytrain train`` of the demo's config (``cfg_kw``) with ``overrides`` set, in this process."""
    cfg = train_config(data, **cfg_kw)
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    sets = [x for o in overrides for x in ("--set", o)]
    run_dir = tmp / name
    proc = in_process("train", tmp / f"{name}.yaml", "--run-dir", run_dir, *sets)
    assert proc.returncode == code, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("scenario")
    data = make_dataset(tmp / "data", shards=SHARDS, bad_shard=BAD, seed=3)
    return data, train(tmp, data, "run", "run.epochs=1", "checkpoint.every_steps=4")


def test_report_names_the_bad_shard_shard_selective(scenario):
    data, run = scenario
    rep = report(run)
    assert rep.verdict == "shard-selective", (WHO, rep.sentence)
    assert rep.suspect_shards == [BAD], WHO
    steps = sorted({s for s, _ in read_ledger(run)})
    assert rep.steps == steps and len(steps) >= 2
    row = next(s for s in rep.shards if s.shard == BAD)
    assert row.nonfinite == len(bad_rows(data, BAD)) and row.events == len(steps)
    exposure = json.loads((run / "exposure.json").read_text())
    assert row.exposures == exposure[str(BAD)] == 64
    pct = f"{64 / sum(exposure.values()):.1%}"
    assert f"{len(steps)} of {len(steps)} non-finite steps involve shard {BAD} ({pct} of examples seen)" in rep.sentence
    assert json.loads((run / "nonfinite_report.json").read_text())["suspect_shards"] == [BAD]


def test_hunt_finds_module_every_bad_example_and_no_good_one_field_and_provenance(scenario):
    data, run = scenario
    found = hunt(run, BAD)
    first_event = min(s for s, _ in read_ledger(run))
    # Checkpoints every 4 steps: the newest state at or before the step the failure started from, never a
    # later one; exactly that step's weights (no note) when the run saved them (or it is step 1: initial).
    saved = [0] + [s for s in range(4, first_event, 4)]
    assert found.checkpoint_step == saved[-1] <= first_event - 1, (WHO, first_event, found.checkpoint)
    assert (found.note is None) == (found.checkpoint_step == first_event - 1), (WHO, first_event, found.note)
    assert found.first_module == "target.region" and found.stage == "forward", WHO
    assert found.examples == bad_rows(data, BAD) and found.examples_checked == 64, WHO
    assert found.fields == [
        {"example": i, "field": "region", "value": NEW_VALUE, "kind": "unexpected_category"} for i in found.examples
    ]
    want = {k: [LATER[k], PROVENANCE[k]] for k in LATER if LATER[k] != PROVENANCE[k]}
    assert found.provenance_diff == want
    assert set(found.to_dict()) >= {"first_module", "examples", "fields", "provenance_diff"}
    by_halving = hunt(run, BAD, bisect_only=True)  # bisection alone, no per-row flags: the same answer
    assert (by_halving.examples, by_halving.first_module) == (found.examples, found.first_module)


def test_a_healthy_shard_hunts_clean_and_the_cli_prints_json(scenario):
    _, run = scenario
    good = (BAD + 1) % SHARDS
    assert hunt(run, good).examples == []
    # `nan hunt` launched as a user runs it, once in the suite (tests/cli/test_cli.py does not launch it).
    proc = subprocess.run([EXE, "nan", "hunt", str(run), "--shard", str(BAD), "--json"],
                          capture_output=True, text=True, timeout=120, env=env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["first_module"] == "target.region"
    proc = in_process("nan", "hunt", run, "--shard", "999")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "999" in proc.stderr


def test_step_replay_reproduces_the_failing_step_on_one_process(scenario):
    data, run = scenario
    step = min(s for s, _ in read_ledger(run))
    found = hunt(run, step=step)
    batch = global_batch(data, step - 1, global_batch_size=128, seed=0)
    bad = set(bad_rows(data, BAD))
    want = sorted([BAD, i] for s, i in zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True)
                  if s == BAD and i in bad)  # fmt: skip
    assert found.reproduced and found.bad == want and found.shard == BAD, WHO
    assert found.first_module == "target.region", WHO
    failed = {s for s, _ in read_ledger(run)}
    clean = next(s for s in range(1, 21) if s not in failed)  # a step that trained (20 steps in the epoch)
    assert hunt(run, step=clean).reproduced is False, (WHO, clean)


# --- a failure before any checkpoint: the case a random draw hit (the bad rows all in step 1) -----------


@pytest.fixture(scope="module")
def step_one(tmp_path_factory) -> tuple[Path, Path, int, list[int]]:
    """A run whose only non-finite step is step 1 (skipped), with a checkpoint after every step."""
    tmp = tmp_path_factory.mktemp("step1")
    # The global order depends on shard sizes and the seed alone: put the bad rows where step 1 reads.
    probe = make_dataset(tmp / "probe", shards=16, bad_shard=None, seed=6)
    batch = global_batch(probe, 0, global_batch_size=128, seed=0)
    pairs = list(zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True))
    shard = pairs[0][0]
    rows = sorted(i for s, i in pairs if s == shard)[:8]
    data = make_dataset(tmp / "data", shards=16, bad_shard=shard, bad_rows=rows, seed=6)  # same sizes
    run = train(tmp, data, "run", "run.max_steps=6", "checkpoint.every_steps=1")
    assert sorted({s for s, _ in read_ledger(run)}) == [1]
    return data, run, shard, rows


def test_a_failure_at_step_1_replays_from_the_initial_weights_never_a_later_checkpoint(step_one):
    _, run, shard, rows = step_one
    found = hunt(run, shard)
    # Every checkpoint holds weights from after step 1; the initial weights are exactly those step 1 started from.
    assert (found.checkpoint, found.checkpoint_step, found.note) == (None, 0, None)
    assert found.examples == rows and found.first_module == "target.region" and found.stage == "forward"
    by_step = hunt(run, step=1)
    assert by_step.reproduced and by_step.bad == [[shard, i] for i in rows]
    assert (by_step.checkpoint, by_step.checkpoint_step, by_step.note) == (None, 0, None)
    # A later checkpoint given on purpose is used, and the note says its weights are from after the failure.
    later = hunt(run, shard, checkpoint=run / "checkpoints" / "step-00000002")
    assert later.checkpoint_step == 2 and "after step 1" in later.note
    proc = in_process("nan", "hunt", run, "--shard", shard)
    assert proc.returncode == 0, proc.stderr
    assert "initial weights" in proc.stdout and "checkpoint:" not in proc.stdout


def test_the_rebuilt_initial_weights_are_the_ones_the_run_started_from(step_one):
    from steadytrain.runs.replay import initial_model

    _, run, _, _ = step_one
    # Step 1 was skipped (no update): the weights saved after it are the run's initial weights.
    load = lambda step: load_checkpoint(run / "checkpoints" / f"step-{step:08d}")["model"]  # noqa: E731
    start, trained = load(1), load(2)
    rebuilt = initial_model(run).state_dict()
    assert rebuilt.keys() == start.keys()
    for key, value in rebuilt.items():
        torch.testing.assert_close(value, start[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(value, trained[key]) for key, value in rebuilt.items())  # a real step differs


def test_no_checkpoint_at_or_before_the_step_uses_the_initial_weights_and_says_how_old(step_one, tmp_path):
    _, run, shard, _ = step_one
    run = Path(shutil.copytree(run, tmp_path / "run"))
    for step in (1, 2, 3):  # as if the run saved every 4 steps
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    found = hunt(run, step=3)
    assert (found.checkpoint, found.checkpoint_step, found.reproduced) == (None, 0, False)
    assert "initial weights" in found.note and "2 step(s) before step 3" in found.note
    found = hunt(run, step=5)
    assert found.checkpoint_step == 4 and found.note is None
    assert hunt(run, shard).checkpoint_step == 0  # the failure at step 1: not the checkpoint of step 4


def test_a_far_too_high_learning_rate_is_spread_and_triage_says_state(tmp_path):
    data = make_dataset(tmp_path / "clean", shards=16, bad_shard=None, seed=4)
    # stops after 10 consecutive skips; a checkpoint after every step, so triage has the state of each step
    run = train(tmp_path, data, "lr", "checkpoint.every_steps=1", code=1, lr_too_high=True)
    rep = report(run)
    assert rep.verdict == "spread" and rep.suspect_shards == [], rep.sentence
    assert "learning rate" in rep.sentence
    first = rep.steps[0]
    found = json.loads(in_process("triage", str(run), "--step", str(first), "--json").stdout)
    assert found["verdict"] == "state", found
    replays = {r["variant"]: r for r in found["replays"]}
    assert not replays["recorded"]["finite"] and not replays["without_suspects"]["finite"]
    assert replays["repeat"]["bitwise_equal"] is True


def test_max_consecutive_skips_stops_cleanly_with_the_report_written(scenario, tmp_path):
    data, _ = scenario
    for policy, limit in (("skip", 1), ("raise", 10)):
        run = train(tmp_path, data, policy, f"nonfinite.policy={policy}",
                    f"nonfinite.max_consecutive_skips={limit}", code=1)  # fmt: skip
        steps = {s for s, _ in read_ledger(run)}
        assert len(steps) == 1, policy
        summary = (run / "summary.md").read_text()
        assert "stopped early" in summary and "non-finite steps" in summary
        assert json.loads((run / "nonfinite_report.json").read_text())["steps"] == sorted(steps)
        assert (run / "checkpoints" / f"step-{min(steps):08d}" / "state.json").exists()
        assert (run / "exposure.json").exists()


def test_the_ledger_survives_a_kill(scenario, tmp_path):
    data, _ = scenario
    cfg = train_config(data, epochs=50)
    cfg["nonfinite"]["max_consecutive_skips"] = 1000
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    proc = subprocess.Popen([EXE, "train", str(tmp_path / "c.yaml"), "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())  # fmt: skip
    deadline = time.monotonic() + 120
    ledger = run / "nonfinite.jsonl"
    while not (ledger.exists() and ledger.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rep = report(run)
    assert rep.suspect_shards == [BAD] and len(rep.steps) >= 3, WHO
    assert all(BAD in e.tags[0]["shard"] or any(BAD in t["shard"] for t in e.tags) for _, e in read_ledger(run))


# --- two ranks --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[int], list[subprocess.CompletedProcess]]:
    """An epoch on 2 ranks whose bad rows all land on rank ``RANK`` (one spawn of ranks, each running ``main(argv)``
    as under torchrun): the run directory, the bad rows, each rank's exit."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    # The global order depends on shard sizes and the seed alone: find where the bad shard's rows land.
    probe = make_dataset(tmp / "probe", shards=16, bad_shard=None, seed=5)
    rank = RANK
    b, k, g = 16, 2, 64  # micro batch, accumulation, global batch on 2 ranks
    mine = []
    for step in range(open_dataset(probe).num_records // g):
        batch = global_batch(probe, step, global_batch_size=g, seed=0)
        for pos, (s, i) in enumerate(zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True)):
            if s == BAD % 16 and pos // (b * k) == rank:
                mine.append(i)
    chosen = sorted(mine[:10])
    data = make_dataset(tmp / "data", shards=16, bad_shard=BAD % 16, bad_rows=chosen, seed=5)  # same sizes
    cfg = train_config(data, epochs=1)
    cfg["batch"].update(micro_batch_size=b, global_batch_size=g)
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    # on the same spawn: a learning rate far too high on clean data (a checkpoint every step, for triage)
    lr_cfg = train_config(make_dataset(tmp / "clean", shards=16, bad_shard=None, seed=4), lr_too_high=True)
    lr_cfg["checkpoint"] = {**lr_cfg.get("checkpoint", {}), "every_steps": 1, "keep_last": 1000}
    (tmp / "lr.yaml").write_text(yaml.safe_dump(lr_cfg))
    procs, LR_RUN["procs"] = cli_on_ranks(
        tmp, [["train", tmp / "c.yaml", "--run-dir", tmp / "run"], ["train", tmp / "lr.yaml", "--run-dir", tmp / "lr"]]
    )
    LR_RUN["run"] = tmp / "lr"
    return tmp / "run", chosen, procs


LR_RUN: dict = {}
"""The 2-rank run of a learning rate far too high, trained by ``two_ranks`` on its spawn: ``run``, ``procs``."""


@pytest.mark.distributed
def test_two_ranks_only_one_reads_the_bad_examples_attributes_them_to_it(two_ranks):
    run, chosen, procs = two_ranks
    rank = RANK
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = report(run)
    steps = sorted({s for s, _ in read_ledger(run)})
    assert rep.ranks == {rank: len(steps), 1 - rank: 0} and rep.suspect_shards == [BAD % 16], (WHO, rep.sentence)
    for _, e in read_ledger(run):
        flagged = {(t["shard"][j], t["index"][j]) for t in e.tags for j in (t["nonfinite"] or [])}
        assert flagged <= {(BAD % 16, i) for i in chosen} and (bool(flagged) == (e.rank == rank))


@pytest.mark.distributed
def test_triage_of_a_learning_rate_far_too_high_on_two_ranks_says_state(two_ranks):
    lr, procs = LR_RUN["run"], LR_RUN["procs"]
    assert [p.returncode for p in procs] == [1, 1], procs[0].stderr[-3000:]  # 10 consecutive skips stop it
    rep = report(lr)
    assert rep.verdict == "spread", rep.sentence
    found = json.loads(in_process("triage", str(lr), "--step", str(rep.steps[0]), "--json").stdout)
    assert found["verdict"] == "state", found
    replays = {r["variant"]: r for r in found["replays"]}
    assert not replays["recorded"]["finite"] and not replays["without_suspects"]["finite"]
    assert sorted(found["rank"]) == [0, 1]  # every rank saw it: the state, not one machine


@pytest.mark.distributed
def test_triage_of_a_poisoned_shard_on_two_ranks_says_data(two_ranks):
    run, _, _ = two_ranks
    first = min(s for s, _ in read_ledger(run))
    found = json.loads(in_process("triage", str(run), "--step", str(first), "--json").stdout)
    assert found["verdict"] == "data", found
    replays = {r["variant"]: r for r in found["replays"]}
    assert not replays["recorded"]["finite"] and replays["without_suspects"]["finite"]
    assert found["rank"] == [RANK]  # the rank that read the bad rows flagged them
    text = in_process("triage", str(run), "--step", str(first)).stdout
    assert text.startswith(f"data: step {first}") and "without_suspects" in text


@pytest.mark.distributed
def test_the_demo_runs_end_to_end_on_two_ranks(tmp_path):
    proc = subprocess.run([EXE, "demo", "nan", "--dir", str(tmp_path), "--shards", "40", "--variant", "shard"],
                          capture_output=True, text=True, timeout=300, env=env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard-selective" in proc.stdout and "involve shard 9 (2.5% of examples seen)" in proc.stdout
    assert "first module: target.region" in proc.stdout and "pipeline_version: '2.4.0'" in proc.stdout
