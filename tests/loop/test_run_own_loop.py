"""``steadytrain.Run`` around a user's own loop (:mod:`tests.loop.own_loop`), on one process.

The oracle is :func:`tests.loop.own_loop.reference`, the same training written in plain torch, and the data's own
order (:meth:`GlobalSampler.indices`): which steps hold a planted example is computed from it, never from the Run.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch

from steadytrain.data import GlobalSampler
from tests.loop import own_loop
from tests.loop.own_loop import ACCUM, MICRO, SHARD, Examples, N

STEPS = 24
NAN = range(130, 140)  # shard 2 (of 60-example shards)


def _rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> tuple[Path, dict]:
    """A run whose examples 130-139 have NaN features, with layer norms every step; and the plain-torch reference."""
    run = tmp_path_factory.mktemp("own") / "run"
    own_loop.train(
        run,
        STEPS,
        data=Examples(nan=NAN),
        layers=True,
        layers_every=1,
        log_every=5,
        model_factory="tests.loop.own_loop:build_model",
        dataset="tests.loop.own_loop:planted_examples",
        keep_last=10,  # the checkpoints before the refused steps stay, for the replays
    )
    return run, own_loop.reference(STEPS, data=Examples(nan=NAN))


def test_the_run_adds_at_most_15_lines_to_the_loop():
    added = [line for line in inspect.getsource(own_loop.train).splitlines() if line.rstrip().endswith("# +run")]
    assert 0 < len(added) <= 15


def test_refused_steps_are_those_holding_a_planted_example(nan_run):
    run, ref = nan_run
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM, seed=3)
    expected = [s + 1 for s in range(STEPS) if set(sampler.indices(s)) & set(NAN)]
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once
    assert expected and [r["step"] for r in rows if r["skipped"]] == expected
    ledger = {r["step"] for r in _rows(run, "nonfinite.jsonl")}
    assert sorted(ledger) == expected
    for row, loss in zip(rows, ref["loss"], strict=True):  # the Run changes nothing in the training
        assert (row["loss"] is None) == (not math.isfinite(loss))
        if row["loss"] is not None:
            assert row["loss"] == pytest.approx(loss, rel=1e-5)


def test_nan_report_names_the_planted_shard(nan_run, cli):
    run, _ = nan_run
    res = cli("nan", "report", str(run), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["verdict"] == "shard-selective"
    assert rep["suspect_shards"] == [NAN[0] // SHARD]


def test_exposure_counts_every_example_trained_on(nan_run):
    run, _ = nan_run
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM, seed=3)
    seen = torch.tensor([i for s in range(STEPS) for i in sampler.indices(s)])
    expected = {str(k): int(v) for k, v in enumerate(torch.bincount(seen // SHARD).tolist()) if v}
    assert json.loads((run / "exposure.json").read_text()) == expected


def test_layer_norms_equal_a_hand_computation(nan_run, cli):
    run, ref = nan_run
    rows = _rows(run, "layers.jsonl")
    for step in (2, 7, STEPS):
        if ref["grad"][step - 1]["0"] != ref["grad"][step - 1]["0"]:  # a refused step: nothing to compare
            continue
        got = {r["layer"]: r for r in rows if r["step"] == step}
        assert set(got) == {"0", "3"}
        for layer in ("0", "3"):
            assert got[layer]["grad_norm"] == pytest.approx(ref["grad"][step - 1][layer], rel=1e-5)
            assert got[layer]["param_norm"] == pytest.approx(ref["param"][step - 1][layer], rel=1e-5)
    res = cli("layers", str(run))
    assert res.returncode == 0, res.stderr


def test_the_report_draws_its_plots_and_summary(nan_run):
    run, _ = nan_run
    for name in ("loss", "lr", "grad_norm", "layers"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 1000, name
    summary = (run / "summary.md").read_text()
    assert f"optimizer steps | {STEPS}" in summary or f"{STEPS} of" in summary
    assert "shard-selective" in summary


def test_run_log_keys_join_their_step_row(nan_run):
    run, _ = nan_run
    rows = _rows(run)
    assert [r["examples"] for r in rows] == [s * MICRO * ACCUM for s in range(1, STEPS + 1)]


def test_records_say_what_wrote_the_run(nan_run):
    run, _ = nan_run
    assert json.loads((run / "loop.json").read_text())["shard_size"] == SHARD
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["accumulation_steps"], plan["world_size"]) == (MICRO, ACCUM, 1)
    assert plan["global_batch_size"] == MICRO * ACCUM
    assert "lr: 0.01" in (run / "config.yaml").read_text()
    assert json.loads((run / "env.json").read_text())["image"]["python"]


def test_a_planted_spike_is_named_by_spikes_report(tmp_path, cli):
    spiky = range(300, 360)  # shard 5; in order (no shuffle) its examples are the global batches of steps 19-23
    run = tmp_path / "spiky"
    own_loop.train(run, 28, data=Examples(spike=spiky), shuffle=False, spike={"policy": "warn", "window": 8})
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM, seed=3, shuffle=False)
    planted = {s + 1 for s in range(28) if set(sampler.indices(s)) & set(spiky)}
    flagged = {r["step"] for r in _rows(run) if r.get("spike")}
    assert flagged and flagged <= planted
    res = cli("spikes", "report", str(run), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["verdict"] == "shard-selective"
    assert rep["suspect_shards"] == [spiky[0] // SHARD]


class _Weights:
    """The model's parameters at each step end."""

    def __init__(self) -> None:
        self.at: dict[int, list[torch.Tensor]] = {}

    def on_step_end(self, run) -> None:
        self.at[run.step] = [p.detach().clone() for p in run.model.parameters()]


def test_spike_skip_refuses_the_update_on_the_spiking_steps(tmp_path):
    spiky = range(300, 360)
    run, seen = tmp_path / "skip", _Weights()
    own_loop.train(run, 28, data=Examples(spike=spiky), shuffle=False, spike={"policy": "skip", "window": 8},
                   callbacks=[seen])  # fmt: skip
    rows = _rows(run)
    flagged = [r["step"] for r in rows if r.get("spike")]
    assert flagged and all(r["skipped"] for r in rows if r.get("spike"))
    records = _rows(run, "spikes.jsonl")
    assert sorted({r["step"] for r in records}) == flagged and {r["action"] for r in records} == {"skip"}
    for step in range(2, 29):  # a refused step leaves every weight as it was; any other step changes them
        same = all(torch.equal(a, b) for a, b in zip(seen.at[step - 1], seen.at[step], strict=True))
        assert same == (step in flagged), step


def test_nan_hunt_replays_a_refused_step_with_the_recorded_model_and_dataset(nan_run, cli):
    run, _ = nan_run
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM, seed=3)
    refused = [s + 1 for s in range(STEPS) if set(sampler.indices(s)) & set(NAN)]
    step = next(s for s in refused if s > 4)  # a checkpoint (every 4 steps) precedes it
    res = cli("nan", "hunt", str(run), "--step", str(step), "--json")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    planted = sorted(set(sampler.indices(step - 1)) & set(NAN))
    assert found["bad"] == [[i // SHARD, i % SHARD] for i in planted]
    assert found["first_module"] == "0" and found["stage"] == "forward" and found["reproduced"] is True
    assert found["checkpoint_step"] == (step - 1) // 4 * 4


def test_nan_hunt_replays_a_whole_shard(nan_run, cli):
    run, _ = nan_run
    res = cli("nan", "hunt", str(run), "--shard", "2", "--json")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    assert found["examples"] == [i - 2 * SHARD for i in NAN] and found["examples_checked"] == SHARD
    res = cli("nan", "hunt", str(run), "--shard", "1", "--json")  # a clean shard: nothing found
    assert res.returncode == 0 and json.loads(res.stdout)["bad"] == []


def test_on_nonfinite_raise_records_the_step_it_stops_at(tmp_path, cli):
    from steadytrain import Run
    from steadytrain.accumulate import NonFiniteGradientError

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 2)
    opened = Run(tmp_path / "r", model=model, optimizer=opt, on_nonfinite="raise", shard_size=4, report=False)
    with pytest.raises(NonFiniteGradientError), opened as run:
        for step in range(5):
            with run.micro_batch(torch.arange(4) + 4 * step) as mb:
                mb.backward(model(x * (float("nan") if step == 2 else 1.0)).pow(2).mean())
    rows = _rows(tmp_path / "r")
    assert [(r["step"], r["skipped"]) for r in rows] == [(1, False), (2, False), (3, True)]
    assert [r["step"] for r in _rows(tmp_path / "r", "nonfinite.jsonl")] == [3]
    res = cli("nan", "report", str(tmp_path / "r"), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["steps"] == [3]


def test_nan_hunt_refuses_what_it_cannot_replay_in_one_line(nan_run, cli):
    run, _ = nan_run
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM, seed=3)
    refused = [s + 1 for s in range(STEPS) if set(sampler.indices(s)) & set(NAN)]
    clean = next(s for s in range(1, STEPS + 1) if s not in refused)
    res = cli("nan", "hunt", str(run), "--step", str(clean))
    assert res.returncode == 2 and "not a refused step" in res.stderr and res.stderr.count("\n") == 1
    early = [s for s in refused if s <= 4]  # before the first checkpoint (step 4): no weights of the run to use
    assert early, refused
    res = cli("nan", "hunt", str(run), "--step", str(early[0]))
    assert res.returncode == 2 and "initial weights are not recorded" in res.stderr and res.stderr.count("\n") == 1
