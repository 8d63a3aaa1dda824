"""The seed's NaN scenario at small size, end to end through `steadytrain train` and the diagnosis.

40 shards; the bad one (from a later pipeline, a quarter of its rows with a category the vocabulary
never saw) is chosen at random by the test. Oracles: the rows the test wrote with the new value (the
bad examples, exactly), the provenance the test gave each shard, the global order's step batches
(`global_batch`) and its documented split of a step between ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from steadytrain.data import global_batch, open_dataset
from steadytrain.diagnose import hunt, read_ledger, report
from steadytrain.diagnose.demo import LATER, NEW_VALUE, PROVENANCE, make_dataset, train_config

EXE = str(Path(sys.executable).with_name("steadytrain"))
SHARDS = 40
BAD = random.Random().randrange(1, SHARDS)  # the test's secret; printed on failure via the assertions


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def bad_rows(data: Path, shard: int) -> list[int]:
    table = pq.read_table(data / f"shard-{shard:05d}.parquet")
    return [i for i, v in enumerate(table["region"].to_pylist()) if v == NEW_VALUE]


def train(tmp: Path, data: Path, name: str, *overrides: str, code: int = 0, **cfg_kw) -> Path:
    cfg = train_config(data, **cfg_kw)
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    sets = [x for o in overrides for x in ("--set", o)]
    run_dir = tmp / name
    proc = subprocess.run([EXE, "train", str(tmp / f"{name}.yaml"), "--run-dir", str(run_dir), *sets],
                          capture_output=True, text=True, timeout=300, env=env())  # fmt: skip
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
    assert rep.verdict == "shard-selective", (BAD, rep.sentence)
    assert rep.suspect_shards == [BAD]
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
    assert found.checkpoint_step <= first_event - 1 and found.note is None
    assert found.first_module == "target.region" and found.stage == "forward"
    assert found.examples == bad_rows(data, BAD) and found.examples_checked == 64
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
    proc = subprocess.run([EXE, "nan", "hunt", str(run), "--shard", str(BAD), "--json"],
                          capture_output=True, text=True, timeout=120, env=env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["first_module"] == "target.region"
    proc = subprocess.run([EXE, "nan", "hunt", str(run), "--shard", "999"], capture_output=True, text=True, env=env())
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "999" in proc.stderr


def test_step_replay_reproduces_the_failing_step_on_one_process(scenario):
    data, run = scenario
    step = min(s for s, _ in read_ledger(run))
    found = hunt(run, step=step)
    batch = global_batch(data, step - 1, global_batch_size=128, seed=0)
    bad = set(bad_rows(data, BAD))
    want = sorted([BAD, i] for s, i in zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True)
                  if s == BAD and i in bad)  # fmt: skip
    assert found.reproduced and found.bad == want and found.shard == BAD
    assert found.first_module == "target.region"
    clean = next(s for s in range(1, step))  # a step before the first failure
    assert hunt(run, step=clean).reproduced is False


def test_a_far_too_high_learning_rate_is_spread(tmp_path):
    data = make_dataset(tmp_path / "clean", shards=16, bad_shard=None, seed=4)
    run = train(tmp_path, data, "lr", code=1, lr_too_high=True)  # stops after 10 consecutive skips
    rep = report(run)
    assert rep.verdict == "spread" and rep.suspect_shards == [], rep.sentence
    assert "learning rate" in rep.sentence


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
        assert (run / "checkpoints" / f"step-{min(steps):08d}.pt").exists()
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
    assert rep.suspect_shards == [BAD] and len(rep.steps) >= 3
    assert all(BAD in e.tags[0]["shard"] or any(BAD in t["shard"] for t in e.tags) for _, e in read_ledger(run))


# --- two ranks --------------------------------------------------------------------------------------


def torchrun(config: Path, run_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "steadytrain", "train", str(config), "--run-dir", str(run_dir)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())


@pytest.mark.distributed
def test_two_ranks_only_one_reads_the_bad_examples_attributes_them_to_it(tmp_path):
    # The global order depends on shard sizes and the seed alone: find where the bad shard's rows land.
    probe = make_dataset(tmp_path / "probe", shards=16, bad_shard=None, seed=5)
    rank = random.Random().randrange(2)
    b, k, g = 16, 2, 64  # micro batch, accumulation, global batch on 2 ranks
    mine = []
    for step in range(open_dataset(probe).num_records // g):
        batch = global_batch(probe, step, global_batch_size=g, seed=0)
        for pos, (s, i) in enumerate(zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True)):
            if s == BAD % 16 and pos // (b * k) == rank:
                mine.append(i)
    chosen = sorted(mine[:10])
    data = make_dataset(tmp_path / "data", shards=16, bad_shard=BAD % 16, bad_rows=chosen, seed=5)  # same sizes
    cfg = train_config(data, epochs=1)
    cfg["batch"].update(micro_batch_size=b, global_batch_size=g)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = torchrun(tmp_path / "c.yaml", tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = report(tmp_path / "run")
    steps = sorted({s for s, _ in read_ledger(tmp_path / "run")})
    assert rep.ranks == {rank: len(steps), 1 - rank: 0} and rep.suspect_shards == [BAD % 16], rep.sentence
    for _, e in read_ledger(tmp_path / "run"):
        flagged = {(t["shard"][j], t["index"][j]) for t in e.tags for j in (t["nonfinite"] or [])}
        assert flagged <= {(BAD % 16, i) for i in chosen} and (bool(flagged) == (e.rank == rank))


@pytest.mark.distributed
def test_the_demo_runs_end_to_end_on_two_ranks(tmp_path):
    proc = subprocess.run([EXE, "demo", "nan", "--dir", str(tmp_path), "--shards", "40", "--variant", "shard"],
                          capture_output=True, text=True, timeout=300, env=env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard-selective" in proc.stdout and "involve shard 9 (2.5% of examples seen)" in proc.stdout
    assert "first module: target.region" in proc.stdout and "pipeline_version: '2.4.0'" in proc.stdout
