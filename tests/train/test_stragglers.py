"""Stragglers: each rank's time per phase in ``RUN/ranks.jsonl``, and ``steadytrain ranks`` naming a rank that is
consistently slower. Oracles: a planted delay (the test's model sleeps 50 ms per step on rank 1) on 2 gloo ranks,
a clean run of the same model and data (both :mod:`tests.planted`'s), and rows built by hand whose excess and cost
follow by arithmetic."""

from __future__ import annotations

import json

import pytest

from steadytrain.runs.goodput import goodput
from steadytrain.runs.ranks import stragglers
from tests.cli_utils import in_process


@pytest.mark.distributed
def test_a_rank_sleeping_50_ms_a_step_is_named_and_a_clean_run_names_nobody(planted):
    slow, clean = planted.runs["slow"], planted.runs["clean"]  # 12 steps, a row per rank every 2: 6 intervals
    for name in ("slow", "clean"):
        assert [p.returncode for p in planted.results[name]] == [0, 0], planted.results[name][0].stderr[-3000:]

    rows = [json.loads(x) for x in (slow / "ranks.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rank"]) for r in rows] == [(s, r) for s in range(2, 13, 2) for r in (0, 1)]
    assert all(r["steps"] == 2 for r in rows)
    for r in rows:  # the planted 50 ms a step are in rank 1's forward, and rank 0 waits for them later in the step
        if r["rank"] == 1:
            assert r["forward_s"] >= 2 * 0.050 * 0.95
    rep = json.loads(in_process("ranks", str(slow), "--json").stdout)
    (found,) = rep["stragglers"]
    assert found["rank"] == 1 and found["slow_intervals"] >= 5 and found["intervals"] == 6
    assert 40 <= found["excess_ms_per_step"] <= 80  # the 50 ms planted, give or take this machine's noise
    assert found["cost_s"] == pytest.approx(found["excess_ms_per_step"] / 1e3 * 12, rel=0.02)
    assert "straggler: rank 1" in in_process("ranks", str(slow)).stdout

    calm = json.loads(in_process("ranks", str(clean), "--json").stdout)
    assert calm["stragglers"] == [] and calm["intervals"] == 6

    # the time account: what the job waited for rank 1 is its straggler time, the planted 50 ms a step as above
    waited = goodput(slow).badput["straggler"]
    assert 12 * 0.040 <= waited <= 12 * 0.080, waited
    assert goodput(clean).badput["straggler"] < waited / 2


@pytest.mark.distributed
def test_a_rank_sleeping_0_8_s_a_step_costs_its_sleep_in_straggler_time(planted):
    run = planted.runs["moving"]  # rank 1 sleeps 0.4 s in each of its 2 forwards a step, for 8 steps
    account = goodput(run)
    assert 8 * 0.8 * 0.9 <= account.badput["straggler"] <= 8 * 0.8 * 1.25, account.badput
    assert account.productive_s + sum(account.badput.values()) == pytest.approx(account.wall_s, abs=5e-3)


def _write(run, per_step_ms: dict[int, list[float]], steps: int = 4) -> None:
    (run / "config.yaml").write_text("run: {}\n")
    lines = []
    for i in range(len(next(iter(per_step_ms.values())))):
        for rank, series in per_step_ms.items():
            own = series[i] / 1e3 * steps
            row = {"step": (i + 1) * steps, "rank": rank, "host": f"h{rank}", "steps": steps, "data_s": own / 2,
                   "forward_s": own / 2, "backward_s": 0.01, "all_reduce_s": 0.02}  # fmt: skip
            lines.append(json.dumps(row))
    (run / "ranks.jsonl").write_text("\n".join(lines) + "\n")


def test_the_straggler_test_by_arithmetic(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # 3 ranks, 5 intervals of 4 steps: rank 2 is 30 ms a step slower in 4 of them (80%), rank 1 once only
    _write(run, {0: [10, 10, 10, 10, 10], 1: [10, 40, 10, 10, 10], 2: [40, 40, 40, 40, 10]})
    rep = stragglers(run)
    (s,) = rep.stragglers
    assert (s.rank, s.host, s.slow_intervals, s.intervals) == (2, "h2", 4, 5)
    # its excess over the others' median: 30 ms in intervals 1, 3, 4; 15 ms in interval 2 (median of 10 and 40)
    assert s.cost_s == pytest.approx((0.030 * 3 + 0.015) * 4, abs=1e-6)
    assert s.excess_ms_per_step == pytest.approx(1e3 * s.cost_s / 20, abs=1e-3)
    assert rep.ranks == {0: 10.0, 1: 10.0, 2: 40.0}
    # 3 of 5 intervals is not consistent; and 5 ms a step is below the absolute floor
    _write(run, {0: [10] * 5, 1: [40, 40, 40, 10, 10], 2: [15] * 5})
    assert stragglers(run).stragglers == []


def test_a_damaged_row_is_one_error_and_a_run_without_rows_says_so(tmp_path, cli):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    assert "no rank times recorded" in stragglers(run).sentence
    (run / "ranks.jsonl").write_text('{"step": 2, "rank": "one"}\n{"step": 4}\n')
    proc = cli("ranks", str(run))
    assert proc.returncode == 2 and "ranks.jsonl:1" in proc.stderr and "Traceback" not in proc.stderr
