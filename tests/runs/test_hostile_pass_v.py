"""The refreshed hostile pass over restarts, triage, layers, the report and mixtures (issue 47, Hardening IV).

Findings, each a test that failed before its fix:

- a run file that is a symlink to nothing or a symlink loop was read as no file: ``report`` rewrote ``summary.md``
  as "0 of 4 planned optimizer steps ran", ``layers`` said no norms were recorded, and ``--auto-resume`` resumed,
  recorded a restart, cut the logs and died on its first row with a traceback (``_io.present``, the readers);
- a damaged or unreadable ``layers.jsonl`` (or ``ranks.jsonl``) was found by a resume only as it cut it, after
  ``metrics.jsonl`` had been cut and the restart recorded (``files.check_run_files`` checks them first);
- ``sources.json`` was read with ``str()``, ``float()`` and ``int()``: a null name became the source ``None``, a
  weight ``"1e3"`` or ``true`` a number, an offset ``1.5`` the offset 1, two sources could share a name, and an
  ``epochs`` of 1e308 was a 300-digit cell of the summary's table (``data.sourcemap.read_sources``);
- ``triage`` replayed with ``plan.json``'s values unchecked: a global batch of text was a ``TypeError`` deep in
  the replay (``rundir.schema.read_plan``);
- ``--help`` of every integer option without bounds read ``[x<=None]`` (``cli._common``).

Oracles: the one line on stderr (exit 2, no traceback) naming the file and key, and the run directory's bytes
before and after.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from steadytrain.data.sourcemap import read_sources
from steadytrain.errors import UserError
from tests.cli_utils import assert_user_error, in_process
from tests.runs.test_hardening_runs import fake_run
from tests.train.test_auto_resume_hostile import snapshot
from tests.train_utils import CHECKPOINTED, TINY, copy_run, run_cli, sets

BROKEN = {"loop": lambda p: os.symlink(p.name, p), "dangling": lambda p: os.symlink("/no/such/dir/file", p)}


def _break(path: Path, how: str) -> None:
    path.unlink(missing_ok=True)
    BROKEN[how](path)


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_metrics_log_that_is_a_broken_link_is_an_error_and_the_summary_stays(tmp_path, tiny_run, how):
    run = copy_run(tiny_run(), tmp_path / "run")
    _break(run / "metrics.jsonl", how)
    summary = (run / "summary.md").read_bytes()
    # was: exit 0 and a summary.md saying "0 of N planned optimizer steps ran"
    assert_user_error(in_process("report", str(run)), "metrics.jsonl")
    assert (run / "summary.md").read_bytes() == summary


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_layer_log_that_is_a_broken_link_is_an_error_not_no_norms(tmp_path, tiny_run, how):
    run = copy_run(tiny_run(), tmp_path / "run")
    _break(run / "layers.jsonl", how)
    assert_user_error(in_process("layers", str(run)), "layers.jsonl")  # was: "no layer norms recorded", exit 0
    if how == "dangling":
        assert_user_error(in_process("layers", str(run)), "symbolic link", "does not exist")


def _torn_layer_line(path: Path) -> None:
    lines = path.read_text().splitlines()
    lines[2] = '{"step": 1, "layer": '
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("metrics.jsonl", lambda p: _break(p, "loop")),  # was: a traceback after a step, restart recorded
        ("metrics.jsonl", lambda p: _break(p, "dangling")),
        ("layers.jsonl", lambda p: _break(p, "loop")),  # was: refused after the metrics log was cut
        ("layers.jsonl", _torn_layer_line),
        ("plan.json", lambda p: _break(p, "loop")),
    ],
    ids=["metrics-loop", "metrics-dangling", "layers-loop", "layers-bad-line", "plan-loop"],
)
def test_a_resume_refuses_a_broken_run_file_before_it_changes_anything(tmp_path, tiny_run, tiny_data, name, damage):
    run = copy_run(tiny_run(*CHECKPOINTED), tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # interrupted after its checkpoint at step 2
    damage(run / name)
    before = snapshot(run)
    proc = run_cli(
        "train", "--auto-resume", "--run-dir", str(run), *sets(*TINY, f"data.path={tiny_data}", *CHECKPOINTED)
    )
    assert_user_error(proc, name)
    assert snapshot(run) == before
    assert not (run / "restarts.jsonl").exists()


SPAN = {"name": "web", "path": "/d/web", "weight": 3.0, "offset": 0, "ids": 4, "records": 90, "fingerprint": "ab"}
CODE = {"name": "code", "path": "/d/code", "weight": 1.0, "offset": 4, "ids": 3, "records": 10, "fingerprint": "cd"}


def _sources(where: Path, first: dict | None = None, **top) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    body = {"sources": [SPAN | (first or {}), CODE], "schedule": [], "largest": "web", "exposure": {}} | top
    (where / "sources.json").write_text(json.dumps(body))
    return where


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"name": None}, ["sources[0].name=None", "a string"]),  # was: a source named "None"
        ({"name": ["web"]}, ["sources[0].name="]),
        ({"name": "code"}, ["'code'", "two sources"]),
        ({"path": 7}, ["sources[0].path=7"]),
        ({"weight": "1e3"}, ["sources[0].weight='1e3'", "must be a number"]),  # was: the weight 1000
        ({"weight": True}, ["sources[0].weight=True"]),
        ({"offset": 1.5}, ["sources[0].offset=1.5"]),  # was: the offset 1
        ({"offset": 2}, ["sources[0].offset=2", "must be 0"]),
        ({"ids": 10**30}, ["sources[0].ids=", "too large"]),
        ({"records": -1}, ["sources[0].records=-1"]),
        ({"fingerprint": {"a": 1}}, ["sources[0].fingerprint="]),
    ],
)
def test_every_value_of_a_source_is_of_its_own_type(tmp_path, change, words):
    with pytest.raises(UserError) as err:
        read_sources(_sources(tmp_path / "run", change))
    line = str(err.value)
    assert "\n" not in line and "sources.json" in line and "restore it" in line, line
    for word in words:
        assert word in line, (word, line)


@pytest.mark.parametrize(
    ("top", "words"),
    [
        ({"sources": []}, ["sources=[]"]),
        ({"sources": "web"}, ["sources='web'"]),
        ({"exposure": 0}, ["exposure=0"]),  # was: no exposure, read as absent
        ({"schedule": "x"}, ["schedule='x'"]),
        ({"largest": 5}, ["largest=5"]),
    ],
)
def test_the_file_s_own_keys_are_of_their_types(tmp_path, top, words):
    with pytest.raises(UserError) as err:
        read_sources(_sources(tmp_path / "run", **top))
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_well_formed_sources_file_reads_back(tmp_path):
    found = read_sources(_sources(tmp_path / "run"))
    assert found.names == ["web", "code"] and found.source_of(5) == ("code", 1)


def test_a_sources_file_that_is_a_directory_is_not_a_single_source_run(tmp_path):
    (tmp_path / "run" / "sources.json").mkdir(parents=True)
    with pytest.raises(UserError, match=r"sources\.json: is a directory"):  # was: None (not a mixture run)
        read_sources(tmp_path / "run")


def test_an_absurd_epoch_count_is_refused_not_a_300_digit_cell(tmp_path):
    run = fake_run(tmp_path / "run")
    _sources(run, exposure={"web": {"examples": 24, "epochs": 1e308}})
    assert_user_error(in_process("report", str(run)), "sources.json", "epochs=1e+308", "too large")
    assert not (run / "summary.md").exists()


def test_triage_checks_the_plan_it_replays_with(tmp_path, tiny_run):
    from steadytrain.runs.replay import run_model

    run = copy_run(tiny_run(), tmp_path / "run")
    plan = json.loads((run / "plan.json").read_text())
    (run / "plan.json").write_text(json.dumps(plan | {"global_batch_size": str(plan["global_batch_size"])}))
    with pytest.raises(UserError, match=r"plan.json: global_batch_size='16' must be an integer"):  # was: TypeError
        run_model(run, before_step=1)


@pytest.mark.parametrize(("command", "option"), [("triage", "--step"), ("plan", "--micro-batch-size")])
def test_the_help_of_an_unbounded_integer_option_names_no_none_bound(command, option):
    got = in_process(command, "--help")
    assert got.returncode == 0 and option in got.stdout
    assert "None" not in got.stdout, got.stdout  # was: [x<=None; required]
