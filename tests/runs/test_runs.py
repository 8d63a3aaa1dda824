"""Looking at runs: `report`, `compare`, `repro` and `sweep` on tiny runs of a small generated dataset.

Oracles: the PNG format itself (signature, IHDR width and height); the metrics files read directly
(planted alterations, the first step whose losses differ); a known config change and a planted
driver difference in `env.json`; the linear-scaling closed form for the sweep's LRs.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import struct
from pathlib import Path

import pytest

from tests import train_utils
from tests.train_utils import copy_run, metrics, run_cli, sets, train

TINY = [*train_utils.TINY, "run.max_steps=6"]
PLOTS = ("loss", "lr", "grad_norm", "throughput")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the PNG signature (the format, not matplotlib)."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, path
    assert head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def write_metrics(run: Path, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def set_driver(run: Path, driver: str | None) -> None:
    path = run / "env.json"
    manifest = json.loads(path.read_text())
    manifest["host"]["nvidia_driver"] = driver
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def data(tiny_data) -> Path:
    """400 byte sequences of this project's source in 4 shards (a few KB: not the default corpus)."""
    return tiny_data


@pytest.fixture(scope="module")
def run(tiny_run) -> Path:
    """One 6-step run with a clip threshold low enough that some steps are clipped."""
    return tiny_run("run.max_steps=6", "clip.max_grad_norm=0.5")


# --- report ---------------------------------------------------------------------------------------


def test_train_ends_with_the_report_every_plot_a_png_of_the_expected_size(run):
    for name in PLOTS:
        assert png_size(run / "plots" / f"{name}.png") == (800, 450), name
    summary = (run / "summary.md").read_text()
    assert "effective batch 16 = micro 4 × accumulation 4 × world 1" in summary
    for name in PLOTS:
        assert f"](plots/{name}.png)" in summary
    last = metrics(run)[-1]
    assert f"final loss | {last['loss']:.4g}" in summary
    assert "optimizer steps | 6 of 6" in summary
    clipped = sum(r["clipped"] for r in metrics(run))
    assert clipped > 0 and f"clipped steps | {clipped} " in summary


def test_report_command_redraws_the_plots_and_summary(run, tmp_path):
    copy = copy_run(run, tmp_path / "copy")
    shutil.rmtree(copy / "plots")
    (copy / "summary.md").unlink()
    proc = run_cli("report", str(copy))
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in (copy / "plots").iterdir()} == {f"{n}.png" for n in (*PLOTS, "goodput")}
    assert all(png_size(copy / "plots" / f"{n}.png") == (800, 450) for n in PLOTS)
    assert "effective batch 16" in (copy / "summary.md").read_text()


def test_report_marks_skipped_steps_and_names_a_plot_that_failed(run, tmp_path, monkeypatch):
    report_module = importlib.import_module("steadytrain.runs.report")  # the module (the package exports the function)
    copy = copy_run(run, tmp_path / "copy")
    rows = metrics(copy)
    rows[2].update(loss=None, grad_norm=None, skipped=True, clipped=False)
    write_metrics(copy, rows)

    def broken(rec, path):
        raise RuntimeError("no fonts")

    monkeypatch.setitem(report_module.PLOTS, "throughput", broken)
    rep = report_module.report(copy)
    assert set(rep.plots) == {"loss", "lr", "grad_norm", "goodput"} and set(rep.failed) == {"throughput"}
    summary = (copy / "summary.md").read_text()
    assert "skipped (non-finite) steps | 1" in summary
    assert "the throughput plot could not be drawn: RuntimeError: no fonts" in summary


def test_a_report_that_fails_never_loses_the_run(data, tmp_path, monkeypatch):
    from steadytrain.train.job.loop import train as run_training
    from steadytrain.train.setup.config import load_config

    def broken(*args, **kwargs):
        raise RuntimeError("plotting exploded")

    report_module = importlib.import_module("steadytrain.runs.report")
    monkeypatch.setattr(report_module, "report", broken)
    cfg = load_config(None, [*TINY, f"data.path={data}", "run.max_steps=2"])
    summary = run_training(cfg, run_dir=tmp_path / "run")
    assert summary["steps"] == 2
    assert report_module.report_after_training(summary["run_dir"]) is None  # what `train` calls: it only warns
    assert "effective batch 16" in (tmp_path / "run" / "summary.md").read_text()  # the short summary stands
    assert len(metrics(tmp_path / "run")) == 2


# --- compare --------------------------------------------------------------------------------------


def compare_json(a: Path, b: Path, tmp_path: Path) -> dict:
    proc = run_cli("compare", str(a), str(b), "--json", "--plot", str(tmp_path / "overlay.png"))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_compare_of_a_run_with_itself_says_identical(run, tmp_path):
    out = compare_json(run, run, tmp_path)
    assert {"sentence", "config", "data", "env", "first_divergent_step", "max_rel_diff"} <= set(out)
    assert out["sentence"].startswith("identical")
    assert out["config"] == {} and out["data"]["same"] is True
    assert out["env"] == {"image": [], "host": [], "code": [], "settings": []}
    assert out["first_divergent_step"] is None and out["max_rel_diff"] == 0.0
    assert png_size(tmp_path / "overlay.png") == (800, 600)


def test_compare_names_the_one_config_key_and_the_first_divergent_step(run, data, tmp_path):
    other = tmp_path / "wd"
    train(other, *TINY, f"data.path={data}", "clip.max_grad_norm=0.5", "optim.weight_decay=0.3")
    out = compare_json(run, other, tmp_path)
    assert out["config"] == {"optim.weight_decay": [0.01, 0.3]}
    a, b = metrics(run), metrics(other)
    want = next(ra["step"] for ra, rb in zip(a, b, strict=True) if ra["loss"] != rb["loss"])
    assert want == 2  # step 1's loss is computed before any update: weight decay cannot change it
    assert out["first_divergent_step"] == want
    assert "optim.weight_decay 0.01 vs 0.3" in out["sentence"]
    assert f"until step {want}" in out["sentence"]
    rel = max(abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), abs(y["loss"])) for x, y in zip(a, b, strict=True))
    assert out["max_rel_diff"] == pytest.approx(rel, rel=1e-12)


def test_compare_of_runs_differing_only_in_the_host_driver_says_so(run, tmp_path):
    a, b = copy_run(run, tmp_path / "host-a"), copy_run(run, tmp_path / "host-b")
    set_driver(a, "535.104.05")
    set_driver(b, "550.90.07")
    out = compare_json(a, b, tmp_path)
    assert out["env"]["host"] == [{"path": "host.nvidia_driver", "a": "535.104.05", "b": "550.90.07"}]
    assert out["env"]["image"] == out["env"]["code"] == out["env"]["settings"] == []
    sentence = out["sentence"]
    assert "host differs (nvidia_driver 535.104.05 vs 550.90.07)" in sentence
    assert sentence.startswith("same image, code, settings, config and data;")
    assert "losses identical" in sentence
    plain = run_cli("compare", str(a), str(b), "--plot", str(tmp_path / "p.png"))
    assert plain.stdout.splitlines()[0] == sentence


def test_compare_finds_a_planted_loss_change(run, tmp_path):
    altered = copy_run(run, tmp_path / "altered")
    rows = metrics(altered)
    rows[3]["loss"] = rows[3]["loss"] * (1 + 3e-7)
    write_metrics(altered, rows)
    out = compare_json(run, altered, tmp_path)
    assert out["first_divergent_step"] == 4
    assert out["max_rel_diff"] == pytest.approx(3e-7, rel=1e-6)
    assert "until step 4" in out["sentence"] and "3e-07 relative" in out["sentence"]


def test_compare_of_a_directory_that_is_not_a_run_is_one_line(run, tmp_path):
    proc = run_cli("compare", str(run), str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not a steadytrain run directory" in proc.stderr


# --- repro ----------------------------------------------------------------------------------------


def test_repro_of_a_fresh_run_reproduces_exactly(run):
    proc = run_cli("repro", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith("reproduced exactly")
    assert "steps 1-6" in proc.stdout


@pytest.mark.parametrize(("field", "step"), [("loss", 3), ("grad_norm", 2)])
def test_repro_names_the_step_of_a_one_ulp_alteration_and_the_driver(run, tmp_path, field, step):
    altered = copy_run(run, tmp_path / "altered")
    rows = metrics(altered)
    rows[step - 1][field] = math.nextafter(rows[step - 1][field], math.inf)
    write_metrics(altered, rows)
    set_driver(altered, "550.90.07")
    proc = run_cli("repro", str(altered), "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["reproduced"] is False and out["first_differing_step"] == step
    assert list(out["differing"]) == [field]
    assert f"not reproduced: step {step} differs ({field}" in out["sentence"]
    assert "host.nvidia_driver 550.90.07 recorded, none here" in out["sentence"]


def test_repro_compares_only_the_steps_asked_for(run, tmp_path):
    altered = copy_run(run, tmp_path / "altered")
    rows = metrics(altered)
    rows[4]["loss"] += 1.0
    write_metrics(altered, rows)
    assert run_cli("repro", str(altered), "--steps", "3").returncode == 0
    proc = run_cli("repro", str(altered), "--steps", "5")
    assert proc.returncode == 1 and "step 5 differs" in proc.stdout


def test_repro_of_a_directory_that_is_not_a_run_is_one_line(tmp_path):
    proc = run_cli("repro", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_repro_onto_an_existing_out_names_out_not_resume(run, tmp_path, cli):
    from tests.cli_utils import assert_user_error

    taken = tmp_path / "taken"
    taken.mkdir()
    proc = cli("repro", str(run), "--steps", "1", "--out", str(taken))
    assert_user_error(proc, "--out", str(taken), "exists", "new directory")
    assert "--resume" not in proc.stderr  # repro has no --resume: the flag to change is --out
    assert list(taken.iterdir()) == []


# --- sweep ----------------------------------------------------------------------------------------


def test_sweep_writes_a_run_per_factor_the_table_the_plot_and_names_a_best_factor(data, tmp_path):
    where = tmp_path / "sweep"
    args = ["--factors", "0.5,1,2", "--steps", "4", "--sweep-dir", str(where)]
    proc = run_cli("sweep", *args, *sets(*TINY, f"data.path={data}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    factors = [0.5, 1.0, 2.0]
    runs = sorted(p.name for p in where.iterdir() if p.is_dir())
    assert runs == ["lr-x0.5", "lr-x1", "lr-x2"]
    for f in factors:
        run = where / f"lr-x{f:g}"
        plan = json.loads((run / "plan.json").read_text())
        assert plan["lr"] == pytest.approx(f * 0.01 * 16 / 16, rel=1e-12)  # factor x the linear estimate
        assert len(metrics(run)) == 4
    table = (where / "sweep.md").read_text()
    assert sum(line.startswith(f"| {f:g} |") for line in table.splitlines() for f in factors) == 3
    assert png_size(where / "loss_vs_lr.png") == (800, 450)
    result = json.loads((where / "sweep.json").read_text())
    assert result["best_factor"] in factors
    assert f"best factor {result['best_factor']:g}" in proc.stdout
    said = "did not hold up" if result["held_up"] is False else "held up"
    assert said in proc.stdout and said in result["sentence"]


def trial(factor: float, smoothed: float | None, diverged: bool = False) -> dict:
    return {"factor": factor, "lr": factor * 1e-3, "smoothed_loss": smoothed, "final_loss": smoothed,
            "diverged": diverged}  # fmt: skip


@pytest.mark.parametrize(
    ("trials", "best", "held", "words"),
    [
        ([trial(0.5, 3.0), trial(1, 2.5), trial(2, 2.8)], 1, True, "held up"),
        ([trial(0.5, 3.0), trial(1, 2.51), trial(2, 2.5)], 2, True, "within 0.4%"),
        ([trial(0.5, 3.0), trial(1, 2.8), trial(2, 2.5)], 2, False, "did not hold up"),
        ([trial(0.5, 3.0), trial(1, None, True), trial(2, None, True)], 0.5, False, "diverged"),
        ([trial(1, None, True), trial(2, None, True)], None, False, "every trial diverged"),
        ([trial(0.5, 3.0), trial(2, 2.5)], 2, None, "was not tried"),
    ],
)
def test_sweep_verdict(trials, best, held, words):
    from steadytrain.runs.sweep import verdict

    got_best, got_held, sentence = verdict(trials, scale_up=8.0)
    assert (got_best, got_held) == (best, held)
    assert words in sentence


@pytest.mark.parametrize("factors", ["0,1", "1,1", "a,b", "-1", ""])
def test_sweep_refuses_bad_factors_before_training(tmp_path, factors):
    proc = run_cli("sweep", "--factors", factors, "--sweep-dir", str(tmp_path / "s"))
    assert proc.returncode == 2 and "--factors" in proc.stderr
    assert not (tmp_path / "s").exists()


def test_a_second_sweep_into_the_same_sweep_dir_is_refused_before_training(data, tmp_path, cli):
    from tests.cli_utils import assert_user_error

    where = tmp_path / "sweep"
    first = cli("sweep", "--factors", "0.5,1", "--steps", "2", "--sweep-dir", where, *sets(*TINY, f"data.path={data}"))
    assert first.returncode == 0, first.stderr[-3000:]
    # 2-step trials with spike.window 50: a fact of every short run, not a warning on the terminal each trial
    assert "spike.window" not in first.stderr
    before = {p.name: p.stat().st_mtime_ns for p in where.iterdir()}
    table = (where / "sweep.json").read_bytes()
    second = cli("sweep", "--factors", "2,4", "--steps", "2", "--sweep-dir", where, *sets(*TINY, f"data.path={data}"))
    assert_user_error(second, "--sweep-dir", "another --sweep-dir", "exist")
    assert {p.name: p.stat().st_mtime_ns for p in where.iterdir()} == before  # lr-x2, lr-x4 never trained
    assert (where / "sweep.json").read_bytes() == table


# --- helpers --------------------------------------------------------------------------------------


def test_smoothing_keeps_a_constant_series_and_gaps():
    from steadytrain.runs.record import smooth

    assert smooth([2.5] * 40) == pytest.approx([2.5] * 40, rel=1e-12)  # debiased: no pull towards 0
    assert smooth([1.0, None, 1.0])[1] is None
