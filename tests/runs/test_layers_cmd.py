"""``steadytrain layers RUN`` (issue 34), ``plots/layers.png`` and the summary's Layers part, on runs written by
hand: 6 steps of metrics (step 3 a refused spike) and ``layers.jsonl`` for the monitored steps 2, 3, 4 and 6.

Oracles: the values written here (the table shows them, the JSON returns them as written), medians computed with
NumPy in the test, the PNG's own bytes (signature, size, the ``Software`` mark), the figure's arrays and lines.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.cli_utils import assert_user_error
from tests.runs.test_hardening_runs import fake_run, rows

STEPS = [2, 3, 4, 6]
"""The monitored steps: every 2 (``monitor.every_steps``), and step 3, refused."""
ORDER = ["tok", "blocks.0", "blocks.1", "frozen", "head"]
GRAD = {
    "tok": [0.5, 0.6, 0.4, 0.5],
    "blocks.0": [1.0, 2.0, 1.5, 1.2],
    "blocks.1": [0.8, 40.0, 0.7, 0.9],
    "frozen": [0.0, 0.0, 0.0, 0.0],
    "head": [2.0, 3.0, 2.5, 2.2],
}
PARAM = {"tok": 10.0, "blocks.0": 10.0, "blocks.1": 10.0, "frozen": 10.0, "head": 20.0}
UPDATE = {  # None at step 3: refused, no update applied
    "tok": [0.01, None, 0.02, 0.03],
    "blocks.0": [0.1, None, 0.2, 0.3],
    "blocks.1": [0.05, None, 0.05, 0.05],
    "frozen": [0.0, None, 0.0, 0.0],
    "head": [0.4, None, 0.2, 0.2],
}


def layer_rows(step: int, i: int, **extra) -> list[dict]:
    out = []
    for layer in ORDER:
        update = UPDATE[layer][i]
        ratio = None if update is None else update / PARAM[layer]
        out.append({"step": step, "layer": layer, "grad_norm": GRAD[layer][i], "param_norm": PARAM[layer],
                    "update_norm": update, "update_ratio": ratio, **extra})  # fmt: skip
    return out


def layered_run(path: Path, *, with_layers: bool = True) -> Path:
    metrics = rows()
    metrics[2].update(skipped=True, spike=True)  # step 3
    run = fake_run(path, metrics=metrics)
    if with_layers:
        lines = [r for i, step in enumerate(STEPS) for r in layer_rows(step, i)]
        (run / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --- the command -----------------------------------------------------------------------------------------------


def test_the_table_of_the_last_step_holds_each_layers_norms(tmp_path, cli):
    run = layered_run(tmp_path / "run")
    proc = cli("layers", run)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "step 6: 5 layer(s)"
    assert lines[1].split() == ["layer", "grad", "norm", "param", "norm", "update", "norm", "update", "ratio"]
    # step 6 is the 4th monitored step: the values written for it, to 4 significant digits
    assert [line.split() for line in lines[2:7]] == [
        ["tok", "0.5", "10", "0.03", "0.003"],
        ["blocks.0", "1.2", "10", "0.3", "0.03"],
        ["blocks.1", "0.9", "10", "0.05", "0.005"],
        ["frozen", "0", "10", "0", "0"],
        ["head", "2.2", "20", "0.2", "0.01"],
    ]
    assert len(lines) == 7  # no n/a, so no footnote


def test_a_refused_step_shows_no_update_and_json_returns_the_rows_as_written(tmp_path, cli):
    run = layered_run(tmp_path / "run")
    text = cli("layers", run, "--step", "3").stdout.splitlines()
    assert text[0] == "step 3: 5 layer(s)"
    assert text[4].split() == ["blocks.1", "40", "10", "n/a", "n/a"]
    assert text[-1] == "n/a: not finite, or no update applied (a refused step)"
    got = json.loads(cli("layers", run, "--step", "3", "--json").stdout)
    assert got == {"step": 3, "layers": layer_rows(3, 1)}


@pytest.mark.parametrize(("step", "nearest"), [(5, ": 4 and 6"), (1, ": 2"), (100, ": 6")])
def test_a_step_without_rows_is_one_line_naming_the_nearest_steps_with_rows(tmp_path, cli, step, nearest):
    run = layered_run(tmp_path / "run")
    proc = cli("layers", run, "--step", str(step))
    assert_user_error(proc, f"--step {step}", "no rows for step", f"nearest steps with rows{nearest}")
    assert json.loads(cli("layers", run, "--step", str(step), "--json").stdout).keys() == {"error"}


def test_a_run_without_layer_norms_says_so_and_exits_0(tmp_path, cli):
    run = layered_run(tmp_path / "run", with_layers=False)
    proc = cli("layers", run)
    said = "no layer norms recorded (monitor.layers: off, or monitor.every_steps more than the steps run?)\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, said, "")
    assert json.loads(cli("layers", run, "--json").stdout) == {"step": None, "layers": []}
    (run / "layers.jsonl").write_text("")  # created, nothing written yet: the same
    assert json.loads(cli("layers", run, "--step", "2", "--json").stdout) == {"step": None, "layers": []}


def test_a_directory_that_is_not_a_run_is_one_line(tmp_path, cli):
    (tmp_path / "layers.jsonl").write_text("")
    assert_user_error(cli("layers", tmp_path), "not a steadytrain run directory")
    assert_user_error(cli("layers", tmp_path / "absent"), "no such run directory")


def test_a_step_trained_twice_shows_both_tries(tmp_path, cli):
    run = layered_run(tmp_path / "run", with_layers=False)
    lines = [*layer_rows(2, 0), *layer_rows(4, 1, rollback=1), *layer_rows(4, 2)]
    (run / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = cli("layers", run, "--step", "4").stdout.splitlines()
    assert text[0] == "step 4 (the try rolled back: rollback 1): 5 layer(s)"
    assert text[7] == "step 4 (trained again): 5 layer(s)"
    assert len(json.loads(cli("layers", run, "--step", "4", "--json").stdout)["layers"]) == 10


# --- the report: plots/layers.png and the summary ----------------------------------------------------------------


def test_report_draws_the_layers_plot_and_the_summary_names_updates_and_a_frozen_layer(tmp_path, cli):
    run = layered_run(tmp_path / "run")
    proc = cli("report", run)
    assert proc.returncode == 0, proc.stderr
    path = run / "plots" / "layers.png"
    assert f"layers: {path}" in proc.stdout
    data = path.read_bytes()
    assert png_size(data) == (800, 700)
    assert b"tEXtSoftware\x00steadytrain" in data
    summary = (run / "summary.md").read_text()
    medians = {
        layer: float(np.median([u / PARAM[layer] for u in UPDATE[layer] if u is not None])) for layer in ORDER
    }  # tok 0.002, blocks.0 0.02, blocks.1 0.005, frozen 0, head 0.01
    top = sorted(medians, key=lambda layer: -medians[layer])[:3]
    assert top == ["blocks.0", "head", "blocks.1"]
    listed = ", ".join(f"{layer} {medians[layer]:.3g}" for layer in top)
    assert listed == "blocks.0 0.02, head 0.01, blocks.1 0.005"
    assert f"(median over the monitored steps that applied an update): {listed} (`layers.jsonl`" in summary
    frozen = "- layer frozen received no gradient in any monitored step: frozen or disconnected by mistake?"
    assert summary.splitlines().count(frozen) == 1
    assert "![layers](plots/layers.png)" in summary
    assert "layer tok received" not in summary


def test_report_without_layer_norms_draws_no_layers_plot(tmp_path, cli):
    run = layered_run(tmp_path / "run", with_layers=False)
    assert cli("report", run).returncode == 0
    assert not (run / "plots" / "layers.png").exists()
    assert "**Layers.**" not in (run / "summary.md").read_text()


def _figure_of(run: Path, monkeypatch) -> object:
    from steadytrain.runs import layerplot
    from steadytrain.runs.record import load_run

    drawn = []
    monkeypatch.setattr(layerplot, "_save", lambda fig, path: drawn.append(fig) or path)
    assert layerplot.layers_plot(load_run(run), run / "x.png") == run / "x.png"
    return drawn[0]


def test_the_heatmaps_hold_the_values_on_log_scales_with_the_spike_marked(tmp_path, monkeypatch):
    from matplotlib.colors import LogNorm

    fig = _figure_of(layered_run(tmp_path / "run"), monkeypatch)
    grad_ax, ratio_ax = fig.axes[:2]
    grad = grad_ax.images[0].get_array()
    expected = np.array([GRAD[layer] for layer in ORDER])
    assert grad.shape == (5, 4)
    assert grad.mask.tolist() == (expected == 0).tolist()  # zero: no colour on a log scale (frozen's row)
    assert np.array_equal(grad.compressed(), expected[expected > 0])
    ratio = ratio_ax.images[0].get_array()
    assert ratio.mask[:, 1].all()  # step 3: refused, no update
    assert ratio[ORDER.index("head"), 0] == pytest.approx(0.4 / 20.0)
    assert all(isinstance(ax.images[0].norm, LogNorm) for ax in (grad_ax, ratio_ax))
    assert [t.get_text() for t in grad_ax.get_yticklabels()] == ORDER
    assert [t.get_text() for t in ratio_ax.get_xticklabels()] == ["2", "3", "4", "6"]
    bars = [ax.get_ylabel() for ax in fig.axes[2:]]
    assert any("grad norm" in b for b in bars) and any("update ratio" in b for b in bars)
    for ax in (grad_ax, ratio_ax):
        assert [line.get_xdata()[0] for line in ax.lines] == [1]  # the spike at step 3: the 2nd column
    assert grad_ax.get_title().startswith("run: ")


def test_a_rollback_is_a_dashed_line_after_the_rolled_back_try(tmp_path, monkeypatch):
    """Checkpoint at 2, spike at 4 rolled back: metrics 1, 2, the rollback's row, then 3 to 6 again; the layer rows
    of step 2, the spike's (``rollback: 1``), then 4 and 6 trained again."""
    metrics = rows()
    metrics = [*metrics[:2], {"step": 4, "rollback_to": 2, "skipped_batches": [3], "rollback": 1}, *metrics[2:]]
    run = fake_run(tmp_path / "run", metrics=metrics)
    lines = [*layer_rows(2, 0), *layer_rows(4, 1, rollback=1), *layer_rows(4, 2), *layer_rows(6, 3)]
    (run / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig = _figure_of(run, monkeypatch)
    ax = fig.axes[0]
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["2", "4", "4", "6"]
    marks = sorted((line.get_xdata()[0], line.get_linestyle()) for line in ax.lines)
    assert marks == [(1, "-"), (1.5, "--")]  # the spike's column, and the line after it


def test_at_most_8_step_labels_from_the_first_column_to_the_last():
    from steadytrain.runs.layerplot import _ticks

    groups = [[{"step": 10 * (i + 1)}] for i in range(100)]
    at, labels = _ticks(groups)
    assert len(at) == 8 and (at[0], at[-1]) == (0, 99) and (labels[0], labels[-1]) == ("10", "1000")
    assert _ticks(groups[:1]) == ([0], ["10"])


def test_many_layers_and_no_update_at_all_still_draw(tmp_path, monkeypatch):
    """40 layers (every 2nd named on the axis) and only refused steps (no update ratio anywhere: that panel says so)."""
    run = layered_run(tmp_path / "run", with_layers=False)
    names = [f"blocks.{i}" for i in range(40)]
    lines = [{"step": s, "layer": n, "grad_norm": 1.0 + i, "param_norm": 1.0, "update_norm": None,
              "update_ratio": None} for s in (2, 4) for i, n in enumerate(names)]  # fmt: skip
    (run / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig = _figure_of(run, monkeypatch)
    grad_ax, ratio_ax = fig.axes[:2]
    assert [t.get_text() for t in grad_ax.get_yticklabels()] == names[::2]
    assert not ratio_ax.images and "nothing recorded" in ratio_ax.texts[0].get_text()
