"""Reading ``layers.jsonl`` (issue 34): every damaged row is one error naming ``layers.jsonl:LINE``; the layers that
never received a gradient; the largest update ratios; which layer a loss spike entered through.

The files are written by hand (no training): the oracles are numbers chosen here and their medians computed with
NumPy in the test, never with the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from steadytrain.diagnose.layers import (
    by_step,
    largest_update_ratios,
    read_layers,
    spike_layers,
    tries,
    zero_grad_layers,
)
from steadytrain.errors import UserError
from tests.cli_utils import assert_user_error

ORDER = ["tok", "pos", "blocks.0", "blocks.1", "norm", "head"]


def row(step: int, layer: str, grad: float | None, param: float | None = 1.0, update: float | None = 0.01, **extra):
    ratio = None if update is None or not param else update / param
    return {"step": step, "layer": layer, "grad_norm": grad, "param_norm": param, "update_norm": update,
            "update_ratio": ratio, **extra}  # fmt: skip


def write(run: Path, rows: list, tail: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return run


# --- the reader: one error naming file:line and what is wrong ----------------------------------------------------

GOOD = row(1, "tok", 1.0)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({k: v for k, v in GOOD.items() if k != "update_ratio"}, ["update_ratio (missing)"]),
        ({k: v for k, v in GOOD.items() if k not in ("step", "layer")}, ["step, layer (missing)"]),
        ({**GOOD, "grad_norm": "big"}, ["grad_norm='big'", "a number or null"]),
        ({**GOOD, "grad_norm": True}, ["grad_norm=True", "a number or null"]),
        ({**GOOD, "param_norm": -1.5}, ["param_norm=-1.5", "negative"]),
        ({**GOOD, "update_norm": 10**400}, ["update_norm=", "out of range"]),
        ({**GOOD, "update_ratio": -0.001}, ["update_ratio=-0.001", "negative"]),
        ({**GOOD, "step": 0}, ["step=0", "integer >= 1"]),
        ({**GOOD, "step": 2.0}, ["step=2.0", "integer >= 1"]),
        ({**GOOD, "layer": 7}, ["layer=7", "a layer's name"]),
        ({**GOOD, "layer": ""}, ["layer=''"]),
        ({**GOOD, "rollback": "x"}, ["rollback='x'"]),
        ([1, 2], ["[1, 2] is not a layer row"]),
    ],
)
def test_a_damaged_row_is_one_error_naming_the_file_line_and_what_is_wrong(tmp_path, bad, words):
    run = write(tmp_path / "run", [row(1, "head", 2.0), bad, row(2, "head", 1.0)])
    with pytest.raises(UserError) as err:
        read_layers(run)
    message = str(err.value)
    assert "layers.jsonl:2: " in message and "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_not_json_and_a_layer_twice_in_one_step_name_the_line(tmp_path):
    run = write(tmp_path / "run", [row(1, "tok", 1.0)], tail="garbage\n")
    with pytest.raises(UserError, match=r"layers\.jsonl:2: .*not valid JSON"):
        read_layers(run)
    run = write(tmp_path / "twice", [row(1, "tok", 1.0), row(1, "head", 1.0), row(1, "tok", 2.0)])
    with pytest.raises(UserError, match=r"layers\.jsonl:3: layer 'tok' of step 1 is on line 1 too"):
        read_layers(run)
    # the same layer in the next step, or in a step's second try (a rolled-back spike, then the step again): fine
    rows = [row(1, "tok", 1.0), row(2, "tok", 1.0, rollback=1), row(2, "tok", 3.0)]
    assert read_layers(write(tmp_path / "ok", rows)) == rows


def test_a_torn_last_line_is_skipped_and_a_missing_file_is_no_rows(tmp_path, caplog):
    rows = [row(1, "tok", 1.0), row(1, "head", 0.5)]
    run = write(tmp_path / "run", rows, tail='{"step": 2, "layer": "to')
    assert read_layers(run) == rows
    assert "cut short" in caplog.text
    assert read_layers(tmp_path / "empty") == []


def test_the_command_says_a_damaged_row_in_one_line(tmp_path, cli):
    run = write(tmp_path / "run", [row(1, "tok", 1.0), {**GOOD, "param_norm": -2}])
    (run / "config.yaml").write_text("run: {name: x}\n")
    assert_user_error(cli("layers", run), "layers.jsonl:2", "param_norm=-2", "negative")


# --- the simple summaries --------------------------------------------------------------------------------------


def test_zero_grad_layers_are_those_zero_at_every_step_where_recorded():
    rows = [
        row(1, "tok", 0.0), row(1, "frozen", 0.0), row(1, "late", 0.0), row(1, "unknown", None),
        row(2, "tok", 0.3), row(2, "frozen", 0.0), row(2, "late", 0.0), row(2, "unknown", None),
        row(3, "tok", 0.2), row(3, "frozen", None), row(3, "late", 1e-9), row(3, "unknown", None),
    ]  # fmt: skip
    # frozen: 0, 0, (not finite): no gradient wherever recorded; late: a tiny one at step 3; unknown: never recorded
    assert zero_grad_layers(rows) == ["frozen"]


def test_largest_update_ratios_are_medians_over_the_stepped_rows():
    ratios = {
        "tok": [0.10, 0.30, 0.20, None],  # None: a refused step (no update applied)
        "blocks.0": [0.50, 0.10, None, 0.60],
        "head": [0.05, 0.07, None, 0.06],
        "norm": [None, None, None, None],  # never stepped: no median
    }
    rows = [
        {**row(s, layer, 1.0), "update_ratio": values[s - 1]} for s in range(1, 5) for layer, values in ratios.items()
    ]
    expected = sorted(
        ((layer, float(np.median([v for v in values if v is not None]))) for layer, values in ratios.items()
         if any(v is not None for v in values)),
        key=lambda lm: -lm[1],
    )  # fmt: skip
    assert [layer for layer, _ in expected] == ["blocks.0", "tok", "head"]  # 0.5, 0.2, 0.06
    got = largest_update_ratios(rows)
    assert [layer for layer, _ in got] == [layer for layer, _ in expected]
    assert [m for _, m in got] == pytest.approx([m for _, m in expected])
    assert largest_update_ratios(rows, n=1) == [("blocks.0", pytest.approx(0.5))]
    tied = [row(1, "b", 1.0, update=0.2), row(1, "a", 1.0, update=0.2)]
    assert [layer for layer, _ in largest_update_ratios(tied)] == ["b", "a"]  # equals: model order


def test_by_step_and_tries_keep_both_tries_of_a_step_trained_twice():
    rows = [row(1, "a", 1.0), row(1, "b", 1.0), row(2, "a", 9.0, rollback=1), row(2, "b", 9.0, rollback=1),
            row(2, "a", 1.0), row(2, "b", 1.0)]  # fmt: skip
    assert [len(g) for g in tries(rows)] == [2, 2, 2]
    steps = by_step(rows)
    assert list(steps) == [1, 2] and steps[2] == rows[2:]


# --- spike attribution -----------------------------------------------------------------------------------------

HISTORY = {  # grad norms at steps 1..4, then at the spike (step 5); None: not finite
    "tok": [1.0, 1.0, 1.0, 1.0, 2.0],
    "pos": [1.0, 1.0, 1.0, 1.0, None],  # no finite grad norm at the spike: not ranked
    "blocks.0": [2.0, 4.0, 6.0, 8.0, 15.0],
    "blocks.1": [0.5, 0.5, 1.0, 0.5, 50.0],  # small in absolute terms, 100x its own median
    "norm": [None, None, 1.0, 1.0, 5.0],  # 2 finite values before the spike: fewer than 3, not ranked
    "head": [100.0, 110.0, 90.0, 100.0, 250.0],  # the largest grad norm, but only 2.5x its median
}


def spike_rows(spike_step: int = 5) -> list[dict]:
    out = [row(s, layer, HISTORY[layer][s - 1]) for s in range(1, 5) for layer in ORDER]
    out += [row(spike_step, layer, HISTORY[layer][4], update=None) for layer in ORDER]
    out += [row(spike_step + 1, layer, 1e6) for layer in ORDER]  # after the spike: never part of its median
    return out


def expected_ranking(history: dict[str, list]) -> list[dict]:
    """The rule, written out independently: ratio to the NumPy median of >= 3 earlier finite values."""
    ranked, unranked = [], []
    for layer in ORDER:
        before = [v for v in history[layer][:-1] if v is not None]
        median = float(np.median(before)) if len(before) >= 3 else None
        at = history[layer][-1]
        ratio = at / median if at is not None and median else None
        (ranked if ratio is not None else unranked).append(
            {"layer": layer, "grad_norm": at, "median": median, "ratio": ratio}
        )
    return sorted(ranked, key=lambda r: -r["ratio"]) + unranked


def assert_ranking(got: list[dict], expected: list[dict]) -> None:
    assert [r["layer"] for r in got] == [r["layer"] for r in expected]
    for g, e in zip(got, expected, strict=True):
        assert g["grad_norm"] == e["grad_norm"], g
        for key in ("median", "ratio"):
            assert (g[key] is None) == (e[key] is None), (key, g, e)
            assert g[key] is None or g[key] == pytest.approx(e[key], rel=1e-12), (key, g, e)


def test_each_layer_is_ranked_against_its_own_median_before_the_spike():
    found = spike_layers(spike_rows(), [5, 9])  # step 9 has no rows: left out
    expected = expected_ranking(HISTORY)
    assert [r["layer"] for r in expected] == ["blocks.1", "blocks.0", "head", "tok", "pos", "norm"]
    assert len(found) == 1 and found[0]["step"] == 5 and found[0]["first_layer"] == "blocks.1"
    assert_ranking(found[0]["layers"], expected)
    assert found[0]["layers"][0]["ratio"] == pytest.approx(100.0)  # 50 / median(0.5, 0.5, 1.0, 0.5) = 50 / 0.5


def test_a_spike_too_early_to_judge_has_no_first_layer():
    rows = [row(1, layer, 1.0) for layer in ORDER] + [row(2, layer, 9.0, update=None) for layer in ORDER]
    (found,) = spike_layers(rows, [2])
    assert found["first_layer"] is None
    assert [r["layer"] for r in found["layers"]] == ORDER and all(r["ratio"] is None for r in found["layers"])
    # a layer that never had a gradient (median 0) has nothing to compare with: not ranked, and no infinity
    zeros = [row(s, "frozen", 0.0) for s in (1, 2, 3)] + [row(4, "frozen", 3.0, update=None)]
    assert spike_layers(zeros, [4])[0]["layers"] == [{"layer": "frozen", "grad_norm": 3.0, "median": 0.0,
                                                      "ratio": None}]  # fmt: skip


def test_after_a_rollback_the_history_is_what_the_run_went_on_from():
    """Checkpoint at 3; the spike at 5 is rolled back (its rows keep ``rollback: 1``), steps 4, 5, 6 train again and
    5 spikes a second time (warned): each spike is measured against the rows before it in the file."""
    first = {layer: [*values[:3], values[4]] for layer, values in HISTORY.items()}  # steps 1-3, then the spike
    rows = [row(s, layer, first[layer][s - 1]) for s in range(1, 4) for layer in ORDER]
    rows += [row(5, layer, first[layer][3], update=None, rollback=1) for layer in ORDER]
    again = {"tok": 30.0, "pos": 1.0, "blocks.0": 4.0, "blocks.1": 0.5, "norm": 1.0, "head": 100.0}
    rows += [row(4, layer, 1.0) for layer in ORDER]
    rows += [row(5, layer, again[layer], update=None) for layer in ORDER]
    found = spike_layers(rows, [5, 5])
    assert [f["step"] for f in found] == [5, 5]
    # the rolled-back try: steps 1-3 only (3 values; norm has 1 finite one)
    assert_ranking(found[0]["layers"], expected_ranking(first))
    assert found[0]["first_layer"] == "blocks.1"
    # the second try: steps 1-3 and the retrained 4 (the rolled-back step 5 is not before step 5)
    second = {layer: [*first[layer][:3], 1.0, again[layer]] for layer in ORDER}
    assert_ranking(found[1]["layers"], expected_ranking(second))
    assert found[1]["first_layer"] == "tok" and found[1]["layers"][0]["ratio"] == 30.0  # 30 / median(1, 1, 1, 1)
    # a spike the ledger names once, rolled back: only its keyed try counts
    assert [f["layers"][0]["grad_norm"] for f in spike_layers(rows, [5])] == [50.0]


# --- spikes report: the layers in the JSON and in the sentence ---------------------------------------------------


def spike_ledger(run: Path, step: int = 5) -> None:
    from steadytrain.accumulate import NonFiniteEvent
    from steadytrain.accumulate.events import SPIKE
    from steadytrain.diagnose.ledger import SPIKES, event_record

    tag = {"shard": [3], "index": [0], "losses": None}
    record = event_record(NonFiniteEvent(step - 1, 0, 1.0, (step - 1, step - 1), (), (tag,), "warn", SPIKE), step)
    (run / SPIKES).write_text(json.dumps({**record, "kind": "spike"}) + "\n")


def test_spikes_report_names_the_layer_the_spike_entered_through(tmp_path, cli):
    run = write(tmp_path / "run", spike_rows())
    spike_ledger(run)
    proc = cli("spikes", "report", run, "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert [f["step"] for f in got["layers"]] == [5] and got["layers"][0]["first_layer"] == "blocks.1"
    assert_ranking(got["layers"][0]["layers"], expected_ranking(HISTORY))
    tail = "; the spike at step 5 entered through blocks.1 (grad norm 100x its median)"
    assert got["sentence"].endswith(tail), got["sentence"]
    text = cli("spikes", "report", run)
    assert text.returncode == 0 and tail in text.stdout
    line = "step 5: grad norm against the layer's median before it: blocks.1 100x, blocks.0 3x, head 2.5x"
    assert line in text.stdout, text.stdout


def test_without_layer_rows_the_spikes_report_has_an_empty_list_and_nan_report_none(tmp_path, cli):
    run = tmp_path / "run"
    run.mkdir()
    spike_ledger(run)
    got = json.loads(cli("spikes", "report", run, "--json").stdout)
    assert got["layers"] == [] and "entered through" not in got["sentence"]
    (run / "nonfinite.jsonl").write_text("")
    assert "layers" not in json.loads(cli("nan", "report", run, "--json").stdout)
