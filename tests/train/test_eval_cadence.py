"""``eval.every_steps: auto``: the default cadence keeps evaluation under 5% of a run's wall time.

Time by construction: the clock is injected (a run of known step and evaluation seconds), never read from a real
run; the sums that must close are the closed forms of the module docstring.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from steadytrain.train.job import cadence
from steadytrain.train.job.cadence import BUDGET, AutoCadence, round_up
from tests.train_utils import evals, metrics, train, write_text_dataset

ONE = SimpleNamespace(backend=None, device=None)
SMALL = (
    "data.seq_len=32", "batch.micro_batch_size=2", "batch.global_batch_size=4", "batch.base_batch_size=4",
    "model.dim=16", "model.layers=1", "model.heads=2",
)  # fmt: skip


def _round_numbers() -> list[int]:
    """25, 50, 100, 200, 250, 500, 1000, ... written out by hand (the oracle of ``round_up``)."""
    out = [25, 50]
    for e in range(2, 10):
        out += [10**e, 2 * 10**e, 25 * 10 ** (e - 1), 5 * 10**e]
    return sorted(out)


@pytest.mark.parametrize("x", [-3, 0, 1, 24.9, 25, 25.1, 50, 99, 100.5, 213.3, 250, 251, 999, 1000, 1001, 4.2e6])
def test_round_up_is_the_smallest_round_number_at_least_x(x):
    assert round_up(x) == min(v for v in _round_numbers() if v >= x)


def test_the_estimate_is_a_third_of_a_step_per_example_over_the_budget():
    # 512 examples against a global batch of 16: 512 / 48 = 10.7 steps' time; / 5% = 213 -> 250
    auto = AutoCadence(512, 16, total_steps=10_000)
    assert auto.cost_steps == pytest.approx(512 / 48)
    assert auto.every_steps == 250
    assert "every 250 steps" in auto.note() and "eval.every_steps" in auto.note()
    # a cheap evaluation is never more often than every 25 steps; a run shorter than the cadence: the last step only
    assert AutoCadence(16, 1024, total_steps=10_000).every_steps == 25
    assert "at the last step only" in AutoCadence(512, 16, total_steps=200).note()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(("step_s", "eval_s", "every", "want"), [(1.0, 10.0, 250, 250), (1.0, 30.0, 250, 1000)])
def test_the_first_evaluation_s_time_chooses_a_longer_cadence_only_when_needed(
    monkeypatch, step_s, eval_s, every, want
):
    clock = Clock()
    monkeypatch.setattr(cadence.time, "perf_counter", clock)
    auto = AutoCadence(512, 16, total_steps=100_000)
    assert auto.every_steps == every
    auto.start(0)
    clock.t = every * step_s + eval_s  # the steps up to the first evaluation, then the evaluation
    said = auto.measured(every, eval_s, ONE)
    assert auto.every_steps == want and auto.timed
    assert (said is None) == (want == every)
    assert eval_s / (auto.every_steps * step_s) <= BUDGET  # the share the cadence keeps (the final one aside)
    clock.t += 10 * want
    assert auto.measured(2 * want, 10 * eval_s, ONE) is None and auto.every_steps == want  # once per run


def test_a_resumed_run_keeps_the_measured_cadence(monkeypatch):
    from steadytrain.train.job.evaluate import Validation

    clock = Clock()
    monkeypatch.setattr(cadence.time, "perf_counter", clock)
    first = Validation(None, None, None, AutoCadence(512, 16, total_steps=100_000))
    first.auto.start(0)
    clock.t = 250 + 30.0
    first.auto.measured(250, 30.0, ONE)
    again = Validation(None, None, None, AutoCadence(512, 16, total_steps=100_000))
    again.load_state_dict(first.state_dict())
    assert again.auto.every_steps == 1000 and again.auto.timed
    assert [s for s in range(1, 3001) if again.due(s, 100_000)] == [1000, 2000, 3000]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_dataset(tmp_path_factory.mktemp("cadence") / "data", [40] * 6)


def test_a_users_dataset_evaluates_at_the_auto_cadence_said_at_start(data, tmp_path):
    run = tmp_path / "run"
    got = train(run, f"data.path={data}", *SMALL, "run.max_steps=60")
    assert "every_steps: auto" in (run / "config.yaml").read_text()
    # said at start: 12 held-out examples against a global batch of 4 cost ~1 step's time: every 25 steps
    start = re.search(r"validation every (\d+) steps \(eval.every_steps: auto", got.stderr)
    assert start and start.group(1) == "25", got.stderr[-3000:]
    # the first evaluation's measured time may lengthen it, once, and says so; the final step is always evaluated
    later = re.search(r"every (\d+) steps from here \(was 25\)", got.stderr)
    every = int(later.group(1)) if later else 25
    want = sorted({25, *range(every, 60, every), 60})
    assert [r["step"] for r in evals(run)] == want
    assert len(metrics(run)) == 60


def test_an_explicit_cadence_always_wins(data, tmp_path):
    run = tmp_path / "run"
    train(run, f"data.path={data}", *SMALL, "run.max_steps=12", "eval.every_steps=5")
    assert [r["step"] for r in evals(run)] == [5, 10, 12]


def test_every_other_value_of_every_steps_is_refused_in_one_line(data, tmp_path):
    from tests.cli_utils import in_process

    for bad in ("automatic", "'25'", "0", "true"):
        got = in_process("train", "--run-dir", str(tmp_path / "r"), "--set", f"data.path={data}",
                         "--set", f"eval.every_steps={bad}")  # fmt: skip
        assert got.returncode == 2 and "eval.every_steps" in got.stderr, (bad, got.stderr)
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert not (tmp_path / "r").exists()
