"""Issue 33's files and commands used carelessly and with hostile input: ``RUN/ranks.jsonl`` and ``RUN/parity.jsonl``
(``steadytrain ranks``), the rank-selective verdict's hosts (``nan report``), ``steadytrain triage``, and the writers
of the rank times and the parity check.

Each test is a finding: a damaged file read as a verdict, a traceback, a value that moved the terminal's cursor, a
host blamed for another's trouble, or a replay of other examples than the step's presented as a verdict. The
oracles are the inputs each test builds: which rank is slow where, which host each ledger line names, which examples
the user's model makes non-finite (a byte 0 first: :data:`POISONED`), whatever the weights.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from steadytrain.accumulate import NonFiniteEvent
from steadytrain.diagnose import read_ledger
from steadytrain.diagnose.ledger import append_event
from steadytrain.runs.ranks import stragglers
from tests.cli_utils import assert_user_error, in_process
from tests.train_utils import bigram_module, train, user_package, write_text_dataset

# --- ranks.jsonl and parity.jsonl written by hand ------------------------------------------------------------------


def _row(step: int, rank: int, own_ms: float = 10.0, host: str | None = None, steps: int = 2) -> dict:
    own = own_ms / 1e3 * steps
    return {"step": step, "rank": rank, "host": host or f"h{rank}", "steps": steps, "data_s": own / 2,
            "forward_s": own / 2, "backward_s": 0.01, "all_reduce_s": 0.02}  # fmt: skip


def _run(tmp_path: Path, rows: list[dict], parity: list[dict] | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    (run / "ranks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if parity is not None:
        (run / "parity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in parity))
    return run


def _refused(run: Path, *words: str) -> None:
    """``ranks RUN`` and ``ranks RUN --json``: exit 2, one line naming ``words``; under --json an {"error"} object."""
    assert_user_error(in_process("ranks", str(run)), *words)
    got = in_process("ranks", str(run), "--json")
    assert_user_error(got, *words)
    assert set(json.loads(got.stdout)) == {"error"}


BAD_ROWS = {
    "negative time": ("data_s", -5.0),  # was read: rank 0 named a straggler against rank 1's "negative" time
    "huge time": ("forward_s", 1e308),  # was read: "inf ms" in the text, a traceback under --json
    "huge steps": ("steps", 10**400),  # was a traceback (OverflowError)
    "more steps than the step": ("steps", 9),
    "true as a rank": ("rank", True),  # was read as rank 1
    "fractional rank": ("rank", 0.5),  # was read as rank 0
    "negative rank": ("rank", -1),
    "true as steps": ("steps", True),  # was read as 1 step
    "a step 0": ("step", 0),
    "a nested host": ("host", {"a": 1}),
    "a number as host": ("host", 5),
}


@pytest.mark.parametrize("name", BAD_ROWS)
def test_a_rank_times_row_out_of_range_is_one_error_naming_its_line_and_key(tmp_path, name):
    key, value = BAD_ROWS[name]
    rows = [_row(s, r) for s in (4, 8, 12) for r in (0, 1)]
    rows[3][key] = value  # step 8, rank 1: line 4
    _refused(_run(tmp_path, rows), "ranks.jsonl:4", f"{key} = ", "correct or remove that line")


def test_a_row_given_twice_is_one_error_naming_both_lines(tmp_path):
    rows = [_row(s, r) for s in (4, 8, 12) for r in (0, 1)]
    _refused(_run(tmp_path, [*rows, _row(8, 1, own_ms=900.0)]), "ranks.jsonl:7", "rank 1 at step 8", "line 4")


@pytest.mark.parametrize("ranks", [0, 1])
def test_an_empty_file_or_one_ranks_rows_is_no_test_rather_than_no_straggler(tmp_path, ranks):
    run = _run(tmp_path, [_row(s, r, own_ms=500.0) for s in (4, 8, 12) for r in range(ranks)])
    got = json.loads(in_process("ranks", str(run), "--json").stdout)
    assert got["stragglers"] == [] and got["sentence"].startswith("no straggler test: no interval holds two ranks")


def test_a_straggler_that_moved_is_named_on_the_host_it_was_slow_on(tmp_path):
    # rank 1 is 40 ms a step slower on "old" in 4 of 5 intervals, then runs on "new" (a resume elsewhere) at par
    rows = [_row(4 * i, r, own_ms=50.0 if r == 1 and i < 5 else 10.0, host="old" if i < 5 else "new")
            for i in range(1, 6) for r in (0, 1, 2)]  # fmt: skip
    (s,) = stragglers(_run(tmp_path, rows)).stragglers
    assert (s.rank, s.host, s.slow_intervals) == (1, "old", 4)


def _brute_force(rows: list[dict]) -> tuple[dict[int, int], dict[int, float]]:
    """The straggler test's slow intervals and excess seconds per rank, each median over a fresh list."""
    slow, cost = {}, {}
    for step in sorted({r["step"] for r in rows}):
        per = {r["rank"]: (r["data_s"] + r["forward_s"]) / r["steps"] for r in rows if r["step"] == step}
        for rank, own in per.items():
            base = statistics.median([v for q, v in per.items() if q != rank])
            if own - base > max(0.25 * base, 0.010):
                slow[rank] = slow.get(rank, 0) + 1
                cost[rank] = cost.get(rank, 0.0) + (own - base) * 2
    return slow, cost


def test_a_thousand_ranks_agree_with_a_brute_force_median_and_cost_linear_time(tmp_path):
    rng = random.Random(7)
    many = [_row(2 * i, r, own_ms=rng.choice([10.0, 10.0, 30.0]) + (40.0 if r == 7 else 0.0))
            for i in range(1, 11) for r in range(1000)]  # fmt: skip
    slow, cost = _brute_force(many)
    rep = stragglers(_run(tmp_path, many))
    assert [s.rank for s in rep.stragglers] == [r for r, n in sorted(slow.items()) if n >= 8]
    assert {s.rank: s.cost_s for s in rep.stragglers} == {r: round(c, 3) for r, c in cost.items() if slow[r] >= 8}
    assert 7 in {s.rank for s in rep.stragglers}
    # the same rows as 100 ranks of 100 intervals: a median per rank over the others (quadratic in the ranks) made
    # the 1000 ranks about 4 times slower; sorting each interval once takes about the same time for both
    (tmp_path / "few").mkdir()
    fewer = _run(tmp_path / "few", [_row(2 * i, r) for i in range(1, 101) for r in range(100)])

    def best(run: Path) -> float:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            stragglers(run)
            times.append(time.perf_counter() - t0)
        return min(times)

    assert best(tmp_path / "run") < 2 * best(fewer)


BAD_PARITY = {
    "true and false": {"step": True, "rank": False, "tensors": []},
    "negative": {"step": -3, "rank": -1, "tensors": []},
    "not names": {"step": 4, "rank": 1, "tensors": ["w", {"x": 1}, 5]},
    "a number as host": {"step": 4, "rank": 1, "host": 7, "tensors": ["w"]},
}


@pytest.mark.parametrize("name", BAD_PARITY)
def test_a_parity_record_out_of_range_is_one_error(tmp_path, name):
    rows = [_row(s, r) for s in (4, 8) for r in (0, 1)]
    _refused(_run(tmp_path, rows, [BAD_PARITY[name]]), "parity.jsonl:1", "not a parity record")


def test_a_parity_record_without_host_and_with_10000_tensors_is_listed_honestly(tmp_path):
    names = [f"layers.{i}.weight" for i in range(10_000)]
    run = _run(tmp_path, [_row(4, r) for r in (0, 1)], [{"step": 4, "rank": 1, "host": None, "tensors": names}])
    line = in_process("ranks", str(run)).stdout.strip().splitlines()[-1]
    assert line == "replicas disagreed at step 4: rank 1: " + ", ".join(names[:5]) + " and 9995 more (--json lists all)"
    assert json.loads(in_process("ranks", str(run), "--json").stdout)["parity"][0]["tensors"] == names


# --- the writers: rank times across a rollback and a resume, parity of replicas that are NaN alike ------------------


def _fake_job(tmp_path: Path, log_every: int = 2, **over) -> SimpleNamespace:
    """What the writers read of a job: two ranks of which this is rank 0."""
    from steadytrain.train.observe.watchdog import Beat

    info = SimpleNamespace(
        backend="gloo", world_size=2, device=torch.device("cpu"), is_main=True, rank=0, kind="ddp", shape=None
    )
    cfg = SimpleNamespace(run=SimpleNamespace(log_every=log_every), distributed=SimpleNamespace(on_parity="warn"))
    base = {"info": info, "cfg": cfg, "beat": Beat(0), "state": SimpleNamespace(step=0),
            "run": SimpleNamespace(path=tmp_path), "hosts": ["h0", "h1"], "clock": None}  # fmt: skip
    return SimpleNamespace(**(base | over))


def _gather_from(*others: torch.Tensor):
    """``dist.all_gather`` of two ranks: this rank's tensor, then ``others`` (its own again when none)."""

    def gather(out: list[torch.Tensor], mine: torch.Tensor) -> None:
        for slot, value in zip(out, [mine, *(others or (mine,))], strict=True):
            slot.copy_(value)

    return gather


def test_rank_times_count_the_steps_run_across_a_rollback_and_after_a_resume(tmp_path, monkeypatch):
    from steadytrain.train.job import ranks as writer
    from steadytrain.train.observe.watchdog import Beat

    monkeypatch.setattr(writer.dist, "all_gather", _gather_from())
    (tmp_path / "config.yaml").write_text("run: {}\n")
    job = _fake_job(tmp_path)

    def step(n: int) -> None:  # what the loop does at the end of each optimizer step
        job.state.step = n
        job.beat.stepped(n)
        if n % job.cfg.run.log_every == 0:
            writer.record_rank_times(job)

    for n in range(1, 11):
        step(n)
    step(11)  # a spike at step 11: rolled back to the checkpoint of step 8, then steps 9 and 10 again
    job.state.step = 8
    step(9)
    step(10)
    rows = [json.loads(x) for x in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    mine = [(r["step"], r["steps"]) for r in rows if r["rank"] == 0]
    assert mine == [(2, 2), (4, 2), (6, 2), (8, 2), (10, 2), (10, 3)]  # 11, 9 and 10 since the take at 10
    kept = [r for r in rows[:-2] if r["step"] <= 8] + rows[-2:]  # the rollback cut the rows past step 8
    (tmp_path / "ranks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert stragglers(tmp_path).intervals == 5  # the run's own file reads (a row of 0 steps was refused)

    (tmp_path / "ranks.jsonl").unlink()
    job = _fake_job(tmp_path, log_every=5, beat=Beat(7), state=SimpleNamespace(step=7))  # a resume at step 7
    for n in (8, 9, 10):
        step(n)
    (row, _) = [json.loads(x) for x in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert row["steps"] == 3  # steps 8 to 10, not log_every's 5 (the seconds cover these 3 only)


def test_replicas_that_are_nan_alike_agree_and_one_that_differs_is_named(tmp_path, monkeypatch):
    from steadytrain.train.job import parity

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")  # the same non-finite weights on both replicas: nothing to tell apart
    job = _fake_job(tmp_path, model=model, state=SimpleNamespace(step=5))
    monkeypatch.setattr(parity.dist, "all_gather", _gather_from())
    assert parity.check_parity(job) is None and not (tmp_path / "parity.jsonl").exists()

    other = parity._checksums(list(model.named_parameters())).clone()
    other[1] += 1.0  # rank 1's bias differs
    monkeypatch.setattr(parity.dist, "all_gather", _gather_from(other))
    assert parity.check_parity(job) is None  # on_parity: warn
    (record,) = [json.loads(x) for x in (tmp_path / "parity.jsonl").read_text().splitlines()]
    assert (record["rank"], record["tensors"], record["host"], record["tie"]) == (1, ["bias"], "h1", True)


# --- nan report: the hosts of the rank-selective verdict -----------------------------------------------------------


def _ledger(run: Path, host, steps: int = 6) -> Path:
    """Three ranks; rank 1's device makes all 8 of its examples non-finite, from 8 random shards of 40, at every
    step; ``host(step, rank)`` is the host its ledger line names (None: no host, as lines before hosts were kept)."""
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    rng = random.Random(3)
    for s in range(1, steps + 1):
        for rank in range(3):
            bad = rank == 1
            tag = {"shard": torch.tensor(rng.sample(range(40), 8)), "index": torch.arange(8),
                   "nonfinite": torch.tensor([bad] * 8)}  # fmt: skip
            event = NonFiniteEvent(cycle=s - 1, rank=rank, grad_norm=math.nan, micro_steps=(s - 1, s - 1),
                                   nonfinite_micro_batches=(0,) if bad else (), tags=(tag,))  # fmt: skip
            append_event(run / "nonfinite.jsonl", event, s)
    lines = []
    for line in (run / "nonfinite.jsonl").read_text().splitlines():
        record = json.loads(line)
        name = host(record["step"], record["rank"])
        record.pop("host")
        lines.append(json.dumps(record | ({"host": name} if name is not None else {})))
    (run / "nonfinite.jsonl").write_text("\n".join(lines) + "\n")
    (run / "exposure.json").write_text(json.dumps({str(k): 100 for k in range(40)}))
    return run


def test_a_host_with_a_newline_and_an_escape_stays_on_the_verdicts_line(tmp_path):
    run = _ledger(tmp_path / "run", lambda s, r: f"node{r}\x1b[31m\nFORGED LINE")
    text = in_process("nan", "report", str(run)).stdout
    assert not any(line.startswith("FORGED") for line in text.splitlines())
    assert "rank(s) 1 on node1\\x1b[31m\\nFORGED LINE, across" in text.splitlines()[0]
    assert json.loads(in_process("nan", "report", str(run), "--json").stdout)["suspect_hosts"] == [
        "node1\x1b[31m\nFORGED LINE"
    ]


def test_a_suspect_rank_without_a_host_names_no_made_up_host(tmp_path):
    run = _ledger(tmp_path / "run", lambda s, r: None if r == 1 else f"node{r}")
    rep = json.loads(in_process("nan", "report", str(run), "--json").stdout)
    assert rep["verdict"] == "rank-selective" and rep["suspect_ranks"] == [1]
    assert rep["suspect_hosts"] == []  # was ["rank 1"]: the pooled test's stand-in for a line without a host
    assert "flagged on rank(s) 1, across" in rep["sentence"]


def test_a_rank_that_moved_to_another_host_names_every_host_it_failed_on(tmp_path):
    run = _ledger(tmp_path / "run", lambda s, r: f"node{r}" if s <= 2 else f"new{r}")  # resumed elsewhere at 3
    rep = json.loads(in_process("nan", "report", str(run), "--json").stdout)
    assert rep["suspect_ranks"] == [1] and rep["suspect_hosts"] == ["new1", "node1"]  # was ["node1"] alone


# --- triage on a real run whose model makes examples starting with byte 0 non-finite, whatever the weights ---------

POISONED = bigram_module(
    doc="A bigram LM whose loss is NaN for an example whose first byte is 0, whatever its weights.",
    after="""
    bad = batch["tokens"][:, 0] == 0
    if bool(bad.any()):
        losses = torch.where(bad, losses * float("nan"), losses)
    """,
)


def _dataset(path: Path, poisoned: bool) -> Path:
    """4 shards of 20 byte sequences of this project's source; shard 2's first 3 begin with byte 0 (``poisoned``)."""

    def poison(shard: int, rows: np.ndarray) -> None:
        if poisoned and shard == 2:
            rows[:3, 0] = 0

    return write_text_dataset(path, [20] * 4, plant=poison)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> SimpleNamespace:
    """A 5-step run (a checkpoint after every step) whose refused steps are the poisoned examples' doing."""
    root = tmp_path_factory.mktemp("poisoned")
    pkg = user_package(root, poisoned=POISONED)
    data = _dataset(root / "data", poisoned=True)
    run = root / "run"
    train(run, "model.name=poisoned:factory", "data.seq_len=32", "batch.micro_batch_size=4",
          "batch.global_batch_size=16", "batch.base_batch_size=16", f"data.path={data}", "run.max_steps=5",
          "checkpoint.every_steps=1", "checkpoint.keep_last=10", "run.log_every=1", PYTHONPATH=str(pkg))  # fmt: skip
    steps = sorted({s for s, _ in read_ledger(run)})
    assert len(steps) >= 1 and steps[-1] >= 3, steps  # a refused step with two checkpoints before it
    return SimpleNamespace(run=run, pkg=str(pkg), data=data, step=steps[-1], root=root)


def _copy(poisoned: SimpleNamespace, tmp_path: Path) -> Path:
    return Path(shutil.copytree(poisoned.run, tmp_path / "run"))


def _triage(run: Path, step: int | str, pkg: str, *extra: str):
    return in_process("triage", str(run), "--step", str(step), *extra, PYTHONPATH=pkg)


def test_triage_of_a_poisoned_step_is_data_repeats_bit_for_bit_and_names_the_steps_own_host(poisoned, tmp_path):
    run = _copy(poisoned, tmp_path)
    lines = [json.loads(x) for x in (run / "nonfinite.jsonl").read_text().splitlines()]
    for record in lines:  # the run was resumed on another machine before the step triaged
        record["host"] = "new-node" if record["step"] == poisoned.step else "old-node"
    (run / "nonfinite.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = _triage(run, poisoned.step, poisoned.pkg, "--json")
    assert got.returncode == 0, got.stderr
    found = json.loads(got.stdout)
    assert found["verdict"] == "data", found
    assert found["host"] == ["new-node"]  # was the first host rank 0's lines named
    replays = {r["variant"]: r for r in found["replays"]}
    assert replays["repeat"]["bitwise_equal"] is True  # was False: NaN example losses compared with ==
    assert replays["recorded"]["loss"] is None and not replays["recorded"]["finite"]


def test_triage_of_a_step_past_the_run_is_an_error_not_a_verdict(poisoned):
    calm = next(s for s in range(1, 6) if s not in {s for s, _ in read_ledger(poisoned.run)})
    assert json.loads(_triage(poisoned.run, calm, poisoned.pkg, "--json").stdout)["verdict"] == "none"
    for step in (6, 10**30):
        assert_user_error(_triage(poisoned.run, step, poisoned.pkg), f"--step {step}", "give 1 to 5")
    got = _triage(poisoned.run, 99, poisoned.pkg, "--json")
    assert_user_error(got, "give 1 to 5")
    assert set(json.loads(got.stdout)) == {"error"}


def test_triage_of_a_step_refused_for_its_item_count_is_an_error(poisoned, tmp_path):
    run = _copy(poisoned, tmp_path)
    step = next(s for s in range(1, 6) if s not in {s for s, _ in read_ledger(run)})
    tag = {"shard": torch.tensor([0, 1]), "index": torch.tensor([0, 1])}
    event = NonFiniteEvent(cycle=step - 1, rank=0, grad_norm=0.5, micro_steps=(step - 1, step - 1),
                           nonfinite_micro_batches=(), tags=(tag,), reason="no_items", num_items=0.0)  # fmt: skip
    append_event(run / "nonfinite.jsonl", event, step)
    # was "not-reproducible ... suspect that machine": a finite replay of a step refused for another reason
    assert_user_error(_triage(run, step, poisoned.pkg), f"--step {step}", "item count (no_items)")


def test_triage_against_data_changed_since_the_run_is_an_error(poisoned, tmp_path):
    run = _copy(poisoned, tmp_path)
    clean = _dataset(tmp_path / "clean", poisoned=False)  # the data "fixed" since: the poisoned bytes gone
    for name in ("config.yaml", "data.json"):
        (run / name).write_text((run / name).read_text().replace(str(poisoned.data), str(clean)))
    # was "not-reproducible ... suspect that machine": the replay read the fixed data
    assert_user_error(_triage(run, poisoned.step, poisoned.pkg), "the data changed since the run", "fingerprint")


def test_triage_with_a_batch_size_changed_since_the_step_is_an_error(poisoned, tmp_path):
    run = _copy(poisoned, tmp_path)
    plan = json.loads((run / "plan.json").read_text())
    plan["global_batch_size"], plan["accumulation_steps"] = 8, plan["accumulation_steps"] // 2  # as a resume records
    (run / "plan.json").write_text(json.dumps(plan))
    assert_user_error(_triage(run, poisoned.step, poisoned.pkg), "the rebuilt batch lacks", "batch size")


def test_triage_when_every_example_is_a_suspect_is_undecided_not_state(poisoned, tmp_path):
    run = _copy(poisoned, tmp_path)
    lines = [json.loads(x) for x in (run / "nonfinite.jsonl").read_text().splitlines()]
    for record in lines:  # every example flagged (as a blow-up of the whole batch would)
        for tag in record["tags"]:
            tag["nonfinite"], tag["finite"] = list(range(len(tag["shard"]))), False
        record["nonfinite_micro_batches"] = list(range(len(record["tags"])))
    (run / "nonfinite.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    found = json.loads(_triage(run, poisoned.step, poisoned.pkg, "--json").stdout)
    replays = {r["variant"]: r for r in found["replays"]}
    # the poisoned examples make any weights non-finite: the earlier state too, so the replay cannot tell
    assert not replays["earlier_state"]["finite"]
    assert replays["without_suspects"] == {"variant": "without_suspects", "loss": None, "finite": None}
    assert found["verdict"] == "undecided", found  # was "state", from a replay without them that never ran
    text = _triage(run, poisoned.step, poisoned.pkg).stdout
    assert "without_suspects: loss n/a, finite n/a (not replayed)" in text
