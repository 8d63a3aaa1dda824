"""Every reader of a run directory, and `report`, `compare`, `repro`, `sweep`, `nan report`, `demo nan`,
under careless and hostile use (issue 16).

Most runs here are written by hand (config.yaml, plan.json, env.json, metrics.jsonl, the ledger): a
fake run is enough to feed a reader a torn line, a wrong type or a hostile name, and costs no training.
Oracles: the files as written (6 steps, so the report must say 6), the exit code and the one line on
stderr, the bytes of a file that must be left alone, the lines of the Markdown as a renderer splits them.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from filelock import FileLock

from steadytrain.accumulate import NonFiniteEvent
from steadytrain.diagnose import read_exposure, read_ledger
from steadytrain.diagnose.ledger import event_record
from steadytrain.errors import UserError
from steadytrain.runs import load_run
from tests import train_utils
from tests.cli_utils import assert_user_error, in_process
from tests.train_utils import sets, write_text_dataset

PLOTS = ("grad_norm", "loss", "lr", "throughput")
HOSTILE = "ok\n## INJECTED <img src=x onerror=alert(1)>"
PLAN = {
    "micro_batch_size": 4,
    "accumulation_steps": 4,
    "world_size": 1,
    "global_batch_size": 16,
    "base_lr": 0.01,
    "base_batch_size": 16,
    "scaling_rule": "linear",
    "lr": 0.01,
    "steps_per_epoch": 25,
    "total_steps": 6,
    "warmup_steps": 1,
    "dropped_per_epoch": 0,
}
CONFIG = {
    "batch": {"decay": "cosine", "min_lr_ratio": 0.1},
    "clip": {"max_grad_norm": 0.5},
    "run": {"name": "fake", "seed": 0, "deterministic": False},
}
ENV = {
    "schema": 1,
    "captured_at": "2026-01-01T00:00:00+00:00",
    "image": {"os": {"pretty_name": "Debian"}, "python": "3.11.7", "packages": {}, "torch": "2.3.0"},
    "host": {"kernel": "6.1.0", "nvidia_driver": None, "gpus": None, "cpu": {"model": "x86", "count": 2}},
    "code": {"git_commit": None, "git_dirty": None, "git_branch": None},
    "settings": {"env": {}},
}


def rows(n: int = 6) -> list[dict]:
    row = {"lr": 0.01, "grad_norm": 0.7, "clipped": True, "skipped": False, "items": 16, "items_per_s": 1000.0}
    return [{"step": s, "loss": 5.0 - 0.1 * s, **row, "elapsed_s": 0.01 * s} for s in range(1, n + 1)]


def jsonl(items: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in items)


def fake_run(path: Path, *, metrics: list | None = None, plan=PLAN, config=CONFIG, env=ENV) -> Path:
    """A run directory written by hand: config, plan, environment, 6 steps of metrics."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    if plan is not None:
        (path / "plan.json").write_text(json.dumps(plan))
    if env is not None:
        (path / "env.json").write_text(json.dumps(env))
    (path / "metrics.jsonl").write_text(jsonl(rows() if metrics is None else metrics))
    return path


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``steadytrain ARGS`` in this process (:func:`tests.cli_utils.in_process`), from ``cwd`` when given: these
    tests are about what the commands write and say, not about their process (the launched ones use Popen)."""
    if cwd is None:
        return in_process(*args)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return in_process(*args)
    finally:
        os.chdir(here)


def markdown_lines(text: str) -> list[str]:
    """The lines a Markdown renderer sees (it splits on every line ending, not only on a newline)."""
    return text.splitlines()


# --- 1. a torn last line: tolerated exactly there, an error anywhere else ---------------------------


def test_report_tolerates_a_torn_last_metrics_line(tmp_path):
    run = fake_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 4.')  # the writer was killed in the middle of its line
    proc = cli("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "cut short" in proc.stderr
    summary = (run / "summary.md").read_text()
    assert "| optimizer steps | 6 of 6 planned |" in summary
    assert f"| final loss | {rows()[-1]['loss']:.4g} " in summary


def test_a_bad_line_that_is_not_the_last_is_one_error_naming_the_line(tmp_path):
    run = fake_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2][:20] + "\n"
    (run / "metrics.jsonl").write_text("".join(lines))
    assert_user_error(cli("report", str(run)), "metrics.jsonl:3")


def test_compare_tolerates_a_torn_last_line(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    proc = cli("compare", str(a), str(b), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["steps"] == [6, 6] and out["first_divergent_step"] is None


def ledger_record(step: int = 1, rank: int = 0) -> dict:
    tag = {"shard": torch.tensor([3, 47]), "index": torch.tensor([9, 12]), "nonfinite": torch.tensor([False, True])}
    event = NonFiniteEvent(cycle=step - 1, rank=rank, grad_norm=math.nan, micro_steps=(step - 1, step - 1),
                           nonfinite_micro_batches=(0,), tags=(tag,))  # fmt: skip
    return event_record(event, step)


def test_nan_report_tolerates_a_torn_last_ledger_line(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "nonfinite.jsonl").write_text(jsonl([ledger_record(1), ledger_record(2)]) + '{"step": 3, "ra')
    proc = cli("nan", "report", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == [1, 2]


# --- 2. wrong types in every run file: one UserError naming the file and key ------------------------


def mutate(base: dict, path: str, value) -> dict:
    out = copy.deepcopy(base)
    node = out
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return out


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"loss": "high"}, ["metrics.jsonl: line 3", "loss='high'"]),
        ({"step": True}, ["line 3", "step=True"]),
        ({"step": -3}, ["line 3", "step=-3"]),
        ({"step": "3"}, ["line 3", "step='3'"]),
        ({"step": 2}, ["line 3", "step 2 follows step 2"]),
        ({"skipped": "yes"}, ["line 3", "skipped='yes'"]),
        ({"clipped": 1}, ["line 3", "clipped=1"]),
        ({"items": -1}, ["line 3", "items=-1"]),
        ({"items": 2.5}, ["line 3", "items=2.5"]),
        ({"grad_norm": -0.5}, ["line 3", "grad_norm=-0.5"]),
        ({"lr": [0.1]}, ["line 3", "lr=[0.1]"]),
        ({"loss": 10**400}, ["line 3", "loss="]),
    ],
)
def test_a_metrics_value_of_the_wrong_type_is_one_error(tmp_path, row, words):
    metrics = rows()
    metrics[2].update(row)
    run = fake_run(tmp_path / "run", metrics=metrics)
    with pytest.raises(UserError) as err:
        load_run(run)
    for word in words:
        assert word in str(err.value)


def test_a_metrics_row_that_is_not_an_object_is_one_error(tmp_path):
    run = fake_run(tmp_path / "run", metrics=[*rows(2), [3, 4.5], *rows(6)[3:]])
    with pytest.raises(UserError, match=r"line 3: .* is not a metrics row"):
        load_run(run)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("lr", "fast", ["plan.json", "lr='fast'"]),
        ("world_size", True, ["plan.json", "world_size=True"]),
        ("micro_batch_size", 0, ["plan.json", "micro_batch_size=0"]),
        ("global_batch_size", 32, ["plan.json", "global_batch_size=32 != micro 4 x accumulation 4 x world 1"]),
        ("total_steps", -1, ["plan.json", "total_steps=-1"]),
        ("warmup_steps", 7, ["plan.json", "warmup_steps=7 exceeds total_steps=6"]),
        ("base_lr", None, None),  # null is allowed where the plan allows it
        ("data", 5, ["plan.json", "data=5"]),
        ("notes", nested(60), ["plan.json", "nests deeper than 32"]),
    ],
)
def test_a_plan_value_of_the_wrong_type_is_one_error(tmp_path, key, value, words):
    run = fake_run(tmp_path / "run", plan={**PLAN, key: value})
    if words is None:
        assert load_run(run).plan[key] is value
        return
    with pytest.raises(UserError) as err:
        load_run(run)
    for word in words:
        assert word in str(err.value)


def test_json_nested_past_what_the_parser_can_read_is_one_error(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "plan.json").write_text('{"notes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UserError, match=r"plan\.json.*nests too deeply"):
        load_run(run)


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("host", ["vm", "6.1"], ["env.json", "'host'"]),
        ("host.gpus", {"name": "H100"}, ["env.json", "host.gpus"]),
        ("host.cpu", "x86", ["env.json", "host.cpu"]),
        ("code.git_commit", 12345, ["env.json", "code.git_commit"]),
        ("image.os", "Debian", ["env.json", "image.os"]),
        ("settings.deep", nested(60), ["env.json", "nests deeper than 32"]),
    ],
)
def test_an_env_value_of_the_wrong_type_is_one_error(tmp_path, path, value, words):
    run = fake_run(tmp_path / "run", env=mutate(ENV, path, value))
    with pytest.raises(UserError) as err:
        load_run(run)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("clip: {max_grad_norm: big}\n", ["config.yaml", "clip.max_grad_norm='big'"]),
        ("clip: {max_grad_norm: .inf}\n", ["config.yaml", "clip.max_grad_norm=inf"]),
        ("batch: [1, 2]\n", ["config.yaml", "section 'batch'"]),
        ("batch: {min_lr_ratio: .nan}\n", ["config.yaml", "batch.min_lr_ratio=nan"]),
        ("batch: {decay: zigzag}\n", ["config.yaml", "batch.decay='zigzag'"]),
        ("run: {seed: true}\n", ["config.yaml", "run.seed=True"]),
        ("run: {name: [a]}\n", ["config.yaml", "run.name=['a']"]),
        ("data: {path: 7}\n", ["config.yaml", "data.path=7"]),
        ("model: {1: x}\n", ["config.yaml", "key 1 under model"]),
    ],
)
def test_a_config_value_of_the_wrong_type_is_one_error(tmp_path, text, words):
    run = fake_run(tmp_path / "run")
    (run / "config.yaml").write_text(text)
    with pytest.raises(UserError) as err:
        load_run(run)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"fingerprint": "ab", "shards": "4"}, ["data.json", "shards='4'"]),
        ({"fingerprint": "ab", "provenance": ["v1"]}, ["data.json", "provenance=['v1']"]),
        ({"fingerprint": 17}, ["data.json", "fingerprint=17"]),
        ({"fingerprint": "ab", "outliers": {"3": nested(40)}}, ["data.json", "nests deeper"]),
    ],
)
def test_a_data_record_of_the_wrong_type_is_one_error(tmp_path, data, words):
    run = fake_run(tmp_path / "run")
    (run / "data.json").write_text(json.dumps(data))
    with pytest.raises(UserError) as err:
        load_run(run)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("command", [["report"], ["compare", "{run}"], ["repro"]])
def test_the_commands_turn_a_wrong_type_into_one_line_and_exit_2(tmp_path, command):
    metrics = rows()
    metrics[1]["loss"] = "high"
    run = fake_run(tmp_path / "run", metrics=metrics)
    args = [a.format(run=run) for a in command]
    assert_user_error(cli(*args, str(run)), "metrics.jsonl: line 2", "loss='high'")
    assert not (run / "summary.md").exists() and not (run / "plots").exists()


def test_a_wrong_type_in_the_non_finite_report_is_one_error(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "nonfinite_report.json").write_text(json.dumps({"sentence": ["spread"]}))
    assert_user_error(cli("report", str(run)), "nonfinite_report.json", "not a non-finite report")


def ledger_with(tmp_path: Path, record: dict) -> Path:
    run = fake_run(tmp_path / "run")
    (run / "nonfinite.jsonl").write_text(jsonl([ledger_record(1), record]))
    return run


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("tags.0.nonfinite", [5], ["tags[0].nonfinite holds 5", "from 0 to 1"]),
        ("tags.0.nonfinite", [-1], ["tags[0].nonfinite holds -1"]),
        ("tags.0.nonfinite", [1, 1], ["names a position twice"]),
        ("tags.0.shard", ["3", "47"], ["tags[0].shard holds '3'"]),
        ("tags.0.shard", [3, True], ["tags[0].shard holds True"]),
        ("tags.0.index", [9], ["1 example indices"]),
        ("tags.0", "shard 3", ["tags[0]='shard 3'"]),
        ("nonfinite_micro_batches", [4], ["nonfinite_micro_batches holds 4"]),
        ("step", 0, ["step=0"]),
        ("step", True, ["step=True"]),
        ("rank", -1, ["rank=-1"]),
        ("rank", "0", ["rank='0'"]),
        ("cycle", 1.5, ["cycle=1.5"]),
        ("micro_steps", [4, 2], ["micro_steps=[4, 2]"]),
        ("grad_norm", "big", ["grad_norm='big'"]),
        ("reason", "cosmic rays", ["reason='cosmic rays'"]),
        ("tags", {"0": {}}, ["tags="]),
    ],
)
def test_a_ledger_field_of_the_wrong_type_or_out_of_range_is_one_error(tmp_path, path, value, words):
    record = ledger_record(2)
    if path.startswith("tags.0"):
        rest = path.removeprefix("tags.0").lstrip(".")
        record["tags"][0] = value if not rest else {**record["tags"][0], rest: value}
    else:
        record[path] = value
    run = ledger_with(tmp_path, record)
    with pytest.raises(UserError) as err:
        read_ledger(run)
    for word in ["nonfinite.jsonl: line 2", *words]:
        assert word in str(err.value)


def test_a_step_of_one_rank_recorded_twice_is_one_error(tmp_path):
    run = ledger_with(tmp_path, ledger_record(1))
    with pytest.raises(UserError, match="line 2: step 1 of rank 0 is on line 1 too"):
        read_ledger(run)
    assert len(read_ledger(ledger_with(tmp_path / "b", ledger_record(1, rank=1)))) == 2


def test_nan_report_turns_a_position_out_of_range_into_one_line(tmp_path):
    record = ledger_record(2)
    record["tags"][0]["nonfinite"] = [7]
    run = ledger_with(tmp_path, record)
    assert_user_error(cli("nan", "report", str(run)), "nonfinite.jsonl: line 2", "tags[0].nonfinite holds 7")


@pytest.mark.parametrize(
    ("exposure", "words"),
    [
        ({"3": -5}, ["shard 3: -5"]),
        ({"3": True}, ["shard 3: True"]),
        ({"3": 2.5}, ["shard 3: 2.5"]),
        ({"3": "12"}, ["shard 3: '12'"]),
        ({"x": 1}, ["key 'x'"]),
        ({"03": 1}, ["key '03'"]),
        ({" 3": 1}, ["key ' 3'"]),
        ({"-3": 1}, ["key '-3'"]),
        ([1, 2], ["is not a mapping"]),
    ],
)
def test_exposure_counts_of_the_wrong_type_are_one_error(tmp_path, exposure, words):
    (tmp_path / "exposure.json").write_text(json.dumps(exposure))
    with pytest.raises(UserError) as err:
        read_exposure(tmp_path)
    for word in ["exposure.json", *words]:
        assert word in str(err.value)
    assert read_exposure(tmp_path / "absent") is None


# --- 3. repro with nothing to compare the environment with ------------------------------------------


@pytest.fixture(scope="module")
def real_run(tiny_run) -> Path:
    """A real 3-step run (repro and sweep need a config that trains)."""
    return tiny_run("run.max_steps=3")


def test_repro_without_an_env_record_says_so_and_exits_non_zero(real_run, tmp_path):
    import shutil

    run = Path(shutil.copytree(real_run, tmp_path / "run"))
    (run / "env.json").unlink()
    proc = cli("repro", str(run), "--steps", "2")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the environment is the same" not in proc.stdout
    assert "no environment record to compare this machine with (env.json is missing)" in proc.stdout
    assert proc.stdout.startswith("reproduced exactly")  # the numbers still speak for themselves
    out = json.loads(cli("repro", str(run), "--steps", "1", "--json").stdout)
    assert (out["reproduced"], out["env_compared"], out["validated"]) == (True, False, False)


def test_repro_refuses_a_step_count_below_one(real_run):
    from steadytrain.runs import repro

    with pytest.raises(UserError, match="steps=-2"):
        repro(real_run, -2)


# --- 4. sweep factors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factors", "words"),
    [
        ("1", ["at least 2 distinct factors"]),
        (",".join(str(2**i) for i in range(13)), ["13 factors", "at most 12"]),
        ("1,1e308", ["1e+308 is outside"]),
        ("1,nan", ["nan is not a positive finite number"]),
        ("1,-0.5", ["-0.5 is not a positive"]),
        ("0,1", ["0.0 is not a positive"]),
        ("1,1.0000001", ["distinct", "1, 1"]),
    ],
)
def test_sweep_refuses_factors_it_cannot_compare_before_anything_trains(tmp_path, factors, words):
    proc = cli("sweep", "--factors", factors, "--sweep-dir", str(tmp_path / "s"))
    assert_user_error(proc, "--factors", *words)
    assert not (tmp_path / "s").exists()


def test_sweep_library_checks_factors_too(tmp_path):
    from steadytrain.runs import sweep
    from steadytrain.train.setup.config import load_config

    with pytest.raises(UserError, match="at least 2"):
        sweep(load_config(None, []), [1.0], 2, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_sweep_dir_that_is_a_file_or_holds_a_trial_is_one_line_before_training(real_run, tmp_path):
    (tmp_path / "file").write_text("x")
    config = str(real_run / "config.yaml")
    proc = cli("sweep", config, "--factors", "0.5,1", "--steps", "1", "--sweep-dir", str(tmp_path / "file" / "s"))
    assert_user_error(proc, "--sweep-dir", "a file")
    (tmp_path / "old" / "lr-x1").mkdir(parents=True)
    proc = cli("sweep", config, "--factors", "0.5,1", "--steps", "1", "--sweep-dir", str(tmp_path / "old"))
    assert_user_error(proc, "lr-x1 exists")
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["lr-x1"]  # lr-x0.5 never trained


def test_sweep_trial_names_stay_valid_run_names_for_every_factor(real_run, tmp_path):
    from steadytrain.runs.sweep import _trial_config, factor_tag
    from steadytrain.train.setup.config import load_config

    cfg = load_config(real_run / "config.yaml", ["run.name=" + "n" * 100])
    for factor in (1e-6, 1e6, 2.5e-5, 0.125):
        trial = _trial_config(cfg, factor, 3)
        assert trial.run.name.endswith(f"-lr-x{factor_tag(factor)}") and len(trial.run.name) <= 100
        assert trial.batch.base_lr == pytest.approx(cfg.batch.base_lr * factor, rel=1e-15)


def test_sweep_md_keeps_a_hostile_directory_name_inert(real_run, tmp_path):
    where = tmp_path / HOSTILE
    proc = cli("sweep", str(real_run / "config.yaml"), "--factors", "0.5,1", "--steps", "2", "--sweep-dir", str(where))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = markdown_lines((where / "sweep.md").read_text())
    assert lines[0].startswith("# LR sweep ok") and "INJECTED" in lines[0]
    assert [line for line in lines if line.lstrip().startswith("#")] == [lines[0]]
    assert "<img" not in (where / "sweep.md").read_text()
    assert sum(line.startswith(("| 0.5 |", "| 1 |")) for line in lines) == 2


# --- 5. nan report of a directory that is not a run ------------------------------------------------


def test_nan_report_of_a_directory_that_is_not_a_run_is_one_line(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    assert_user_error(cli("nan", "report", str(tmp_path / "runs")), "not a steadytrain run directory")
    assert_user_error(cli("nan", "report", str(tmp_path / "absent")), "no such run directory")
    run = fake_run(tmp_path / "run")
    proc = cli("nan", "report", str(run))
    assert proc.returncode == 0 and proc.stdout.startswith("none: the ledger records no non-finite step")


# --- 6. compare writes a plot only where asked, and never over a file of the user's -----------------


def test_compare_writes_no_plot_unasked(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    here = tmp_path / "cwd"
    here.mkdir()
    for extra in (["--json"], []):
        proc = cli("compare", str(a), str(b), *extra, cwd=here)
        assert proc.returncode == 0, proc.stderr
        assert list(here.iterdir()) == []
    assert json.loads(cli("compare", str(a), str(b), "--json", cwd=here).stdout)["plot"] is None


def test_compare_plot_goes_where_asked_and_says_where(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    where = tmp_path / "overlay.png"
    proc = cli("compare", str(a), str(b), "--plot", str(where))
    assert proc.returncode == 0, proc.stderr
    assert f"plot: {where}" in proc.stdout and where.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = cli("compare", str(a), str(b), "--plot", str(where), "--json")  # its own plot: replaced
    assert again.returncode == 0 and json.loads(again.stdout)["plot"] == str(where)


@pytest.mark.parametrize("victim", ["config.yaml", "photo.png"])
def test_compare_plot_never_replaces_a_file_it_did_not_write(tmp_path, victim):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    target = a / victim if victim == "config.yaml" else tmp_path / victim
    if victim == "photo.png":  # a real PNG, from another program: no steadytrain mark
        from matplotlib.figure import Figure

        Figure().savefig(target, format="png")
    before = target.read_bytes()
    words = ["name a .png file"] if victim == "config.yaml" else ["not a steadytrain plot"]
    assert_user_error(cli("compare", str(a), str(b), "--plot", str(target)), *words)
    assert target.read_bytes() == before


def test_compare_plot_into_a_missing_directory_creates_nothing(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    assert_user_error(cli("compare", str(a), str(b), "--plot", str(tmp_path / "new" / "p.png")), "does not exist")
    assert not (tmp_path / "new").exists()


def test_report_plots_carry_the_mark(tmp_path):
    from steadytrain.runs.plots import is_ours

    run = fake_run(tmp_path / "run")
    assert cli("report", str(run)).returncode == 0
    assert all(is_ours(p) for p in (run / "plots").iterdir()) and len(list((run / "plots").iterdir())) == 4
    assert not is_ours(run / "config.yaml") and not is_ours(run / "absent.png") and not is_ours(run)


# --- 7. demo nan --dir -----------------------------------------------------------------------------


def test_demo_dir_under_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "somefile").write_text("x")
    assert_user_error(cli("demo", "nan", "--dir", str(tmp_path / "somefile" / "x")), "--dir", "a file")
    assert (tmp_path / "somefile").read_text() == "x"


def test_two_demos_in_one_directory_the_second_is_one_line(tmp_path):
    lock = FileLock(tmp_path / ".demo.lock", timeout=0)
    with lock:  # the first demo, still writing
        proc = cli("demo", "nan", "--dir", str(tmp_path), "--variant", "shard", "--shards", "16")
    assert_user_error(proc, "another `steadytrain demo nan` is writing there")
    assert not (tmp_path / "data").exists()


# --- 8. hostile names in Markdown ------------------------------------------------------------------


def test_summary_md_keeps_a_hostile_run_name_inert(tmp_path):
    run = fake_run(tmp_path / HOSTILE)
    (run / "nonfinite_report.json").write_text(json.dumps({"sentence": "spread\n# HEAD <script>x</script>"}))
    proc = cli("report", str(run))
    assert proc.returncode == 0, proc.stderr
    text = (run / "summary.md").read_text()
    lines = markdown_lines(text)
    assert lines[0].startswith("# Run ok") and "INJECTED" in lines[0]
    assert [line for line in lines if line.lstrip().startswith("#")] == [lines[0]]
    assert "<img" not in text and "<script" not in text


def test_hostile_environment_strings_stay_inside_their_paragraph(tmp_path):
    env = mutate(ENV, "host.kernel", "6.1\n\n# PWNED | x | <b>bold</b>")
    run = fake_run(tmp_path / "run", env=env)
    assert cli("report", str(run)).returncode == 0
    text = (run / "summary.md").read_text()
    assert not any(line.startswith("# PWNED") for line in markdown_lines(text)) and "<b>" not in text
    (paragraph,) = [line for line in markdown_lines(text) if line.startswith("**Environment.**")]
    assert "PWNED" in paragraph


# --- 9. the careless and hostile pass ---------------------------------------------------------------


def test_report_of_dot_names_the_run(tmp_path):
    run = fake_run(tmp_path / "myrun")
    assert cli("report", ".", cwd=run).returncode == 0
    assert (run / "summary.md").read_text().startswith("# Run myrun\n")


def test_a_run_name_that_looks_like_mathtext_still_gets_every_plot(tmp_path):
    run = fake_run(tmp_path / r"cost$\frac{$x")
    proc = cli("report", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list((run / "plots").iterdir())) == 4


def test_report_where_plots_is_a_file_is_one_line(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "plots").write_text("mine")
    assert_user_error(cli("report", str(run)), "plots", "not a directory")
    assert (run / "plots").read_text() == "mine" and not (run / "summary.md").exists()


def test_compare_prints_hostile_environment_keys_on_one_line(tmp_path):
    a = fake_run(tmp_path / "a")
    b = fake_run(tmp_path / "b", env=mutate(ENV, "settings.env", {"X\n  image FAKE": "1"}))
    proc = cli("compare", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert not any(line.startswith("  image FAKE") for line in lines)
    assert any("X\\n  image FAKE" in line for line in lines)


def test_plan_with_missing_numbers_still_reports(tmp_path):
    plan = {k: v for k, v in PLAN.items() if k not in ("base_lr", "lr")}
    run = fake_run(tmp_path / "run", plan=plan)
    assert cli("report", str(run)).returncode == 0
    assert "peak LR ? (linear rule: base LR ? at batch 16" in (run / "summary.md").read_text()


def test_a_plan_of_a_trillion_steps_draws_its_schedule_at_bounded_points(tmp_path):
    run = fake_run(tmp_path / "run", plan={**PLAN, "total_steps": 10**12, "steps_per_epoch": 10**12})
    proc = cli("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "lr: " in proc.stdout and (run / "plots" / "lr.png").exists()
    assert "stopped early: 6 of 1000000000000 planned optimizer steps ran" in (run / "summary.md").read_text()


def test_the_schedule_points_keep_the_warmup_ramp_and_both_ends():
    from steadytrain.runs.plots import PLANNED_POINTS, schedule_steps

    assert schedule_steps(6, 1) == [1, 2, 3, 4, 5, 6]
    steps = schedule_steps(10**12, 5)
    assert steps[:6] == [1, 2, 3, 4, 5, 6] and steps[-1] == 10**12
    assert len(steps) <= PLANNED_POINTS + 6 and steps == sorted(set(steps))
    assert schedule_steps(0, 0) == []


def test_an_exposure_key_of_thousands_of_digits_is_one_error(tmp_path):
    (tmp_path / "exposure.json").write_text('{"' + "9" * 5000 + '": 1}')
    with pytest.raises(UserError, match="is not a shard id"):
        read_exposure(tmp_path)


def test_report_prints_a_hostile_run_path_on_one_line(tmp_path):
    run = fake_run(tmp_path / HOSTILE)
    proc = cli("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 5 and not any("INJECTED" in line[:12] for line in proc.stdout.splitlines())


@pytest.mark.parametrize("n", [10**9, 10**6 + 1])
def test_binomial_tail_of_a_huge_ledger_is_symmetric_and_bounded(n):
    """P(X >= k) + P(X >= n - k + 1) = 1 at p = 1/2, one side from the upper sum, the other from 1 - lower."""
    from steadytrain.diagnose.stats import binomial_sf

    sd = math.sqrt(n) / 2
    for z in (0.5, 2.0, 6.0):
        k = n // 2 + int(z * sd)
        upper, lower_side = binomial_sf(k, n, 0.5), binomial_sf(n - k + 1, n, 0.5)
        assert upper + lower_side == pytest.approx(1.0, abs=1e-12)
        assert 0.0 < upper < math.erfc(0.9 * z / math.sqrt(2)) / 2 + 1e-3  # a normal tail, roughly


def test_compare_says_which_run_has_no_environment_record(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", env=None)
    sentence = json.loads(cli("compare", str(a), str(b), "--json").stdout)["sentence"]
    assert "environment unknown (env.json missing in B)" in sentence and "image unknown" not in sentence


def test_two_reports_of_one_run_at_once_both_finish_and_leave_whole_files(tmp_path):
    run = fake_run(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([train_utils.EXE, "report", str(run)], env=env, stderr=subprocess.DEVNULL) for _ in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert (run / "summary.md").read_text().count("| optimizer steps | 6 of 6 planned |") == 1
    assert sorted(p.name for p in (run / "plots").iterdir()) == [f"{n}.png" for n in sorted(PLOTS)]
    assert not [p for p in run.rglob("*.tmp")]  # no temporary file of either writer left behind


def test_a_demo_dir_holding_other_demo_data_is_one_line_before_training(tmp_path):
    from steadytrain.diagnose.demo import make_dataset

    make_dataset(tmp_path / "data", shards=16, rows=8)
    proc = cli("demo", "nan", "--dir", str(tmp_path), "--variant", "shard", "--shards", "20")
    assert_user_error(proc, "holds 16 shards from an earlier demo, not 20", "--shards 16")
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_during_a_sweep_stops_the_sweep_not_only_its_trial(tmp_path):
    """The model pauses in the first trial's second forward; SIGINT there must end the sweep (exit 130),
    not mark the trial diverged and start the next one."""
    import signal
    import time

    from tests.train.test_hardening_train import _MODEL, BATCH

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "pausemodel.py").write_text(_MODEL)
    data = write_text_dataset(tmp_path / "data", [40] * 4)
    where = tmp_path / "sweep"
    items = sets(*BATCH, f"data.path={data}", "model.name=pausemodel:factory")
    path = os.pathsep.join(filter(None, [str(tmp_path / "pkg"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PAUSE_AT": "2", "PAUSE_DIR": str(tmp_path)}
    cmd = [train_utils.EXE, "sweep", "--factors", "0.5,1", "--steps", "2", "--sweep-dir", str(where), *items]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "reached-0").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the model never paused"
        time.sleep(0.02)
    time.sleep(0.05)
    os.kill(int((tmp_path / "reached-0").read_text()), signal.SIGINT)
    (tmp_path / "go").write_text("")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, out + err
    assert "stopped: sweep stopped by a signal during the trial at factor 0.5" in err.splitlines()[-1]
    assert sorted(p.name for p in where.iterdir()) == ["lr-x0.5", "sweep-state.json"]  # no sweep.json: unfinished
    # the same sweep again resumes it: the stopped trial from its checkpoint (issue 47), then the next one
    env = {k: v for k, v in env.items() if k != "PAUSE_AT"}
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming: 0 of 2 trials done" in again.stderr and "trial 2/2: factor 1" in again.stderr
    assert (where / "lr-x0.5" / "resumes.jsonl").exists() or (where / "lr-x0.5" / "restarts.jsonl").exists()
    assert [t["factor"] for t in json.loads((where / "sweep.json").read_text())["trials"]] == [0.5, 1.0]


def test_a_warning_about_a_hostile_run_path_stays_on_one_line(tmp_path):
    run = fake_run(tmp_path / HOSTILE)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    for args, reads in ((["report", str(run)], 1), (["compare", str(run), str(run)], 2)):
        proc = cli(*args)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == reads and all("cut short" in x and "\\n## INJECTED" in x for x in lines)
