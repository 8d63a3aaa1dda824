"""What a hostile pass over `train --resume`, `nan hunt` and `config show` found: each finding, kept as a test.

Every case is one line on stderr, exit 2, and nothing appended to the run it refused.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tests.cli_utils import assert_user_error
from tests.train_utils import CHECKPOINTED, TINY, copy_run, evals, run_cli, sets


@pytest.fixture(scope="module")
def data(tiny_data) -> Path:
    return tiny_data


@pytest.fixture(scope="module")
def base(tiny_run) -> Path:
    """A 4-step run with checkpoints at 2 and 4 (copied by each test before it is damaged)."""
    return tiny_run(*CHECKPOINTED)


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.startswith(".")}


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("state.json", b"hello world"),
        ("state.json", b"a"),
        ("state.json", b"}q"),
        ("state.json", b"root:x:0:0:root:/root:/bin/bash\n"),
        ("state.json", pickle.dumps({"step": 4, "model": 1})),
        ("state.json", b'{"format": "steadytrain-checkpoint", "version": 1, "step": "4"}'),
        ("*.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
        ("*.safetensors", pickle.dumps({"step": 4, "model": 1})),
    ],
    ids=["text", "a", "brace-q", "passwd", "stock-pickle", "wrong-type", "empty-header", "pickle-shards"],
)
def test_a_damaged_latest_checkpoint_is_one_line_naming_the_previous_one(base, tmp_path, name, content):
    run = copy_run(base, tmp_path / "run")
    for f in (run / "checkpoints" / "step-00000004").glob(name):
        f.write_bytes(content)
    before = _files(run)
    proc = run_cli("train", "--resume", str(run), *sets("run.max_steps=6"))
    assert_user_error(proc, "step-00000004", "move it away to resume from step-00000002")
    assert _files(run) == before
    hunt = run_cli("nan", "hunt", str(run), "--shard", "1", "--checkpoint", str(run / "checkpoints" / "step-00000004"))
    assert_user_error(hunt, "step-00000004")


def test_a_checkpoint_that_is_not_a_file_says_so(base):
    assert_user_error(
        run_cli("nan", "hunt", str(base), "--shard", "1", "--checkpoint", "/dev/zero"), "not a regular file"
    )


@pytest.mark.parametrize(
    ("name", "damage", "word"),
    [
        ("metrics.jsonl", lambda t: t.replace('"step": 2,', '"step": "2",', 1), "metrics.jsonl: line 2"),
        ("resumes.jsonl", lambda t: t + '{"step": "x", "world_size": 1, "changes": {}}\n', "resumes.jsonl: line 1"),
        ("plan.json", lambda t: t.replace('"global_batch_size": 16', '"global_batch_size": "16"'), "global_batch_size"),
        ("nonfinite.jsonl", lambda t: t + '{"step": -1}\n', "nonfinite.jsonl"),
        ("exposure.json", lambda t: '{"0": -5}', "exposure.json"),
    ],
)
def test_resume_refuses_a_damaged_run_file_before_training(base, tmp_path, name, damage, word):
    run = copy_run(base, tmp_path / "run")
    path = run / name
    path.write_text(damage(path.read_text() if path.exists() else ""))
    before = _files(run)
    assert_user_error(run_cli("train", "--resume", str(run), *sets("run.max_steps=6")), word)
    assert _files(run) == before  # nothing appended after the damaged line, nothing rewritten


@pytest.mark.parametrize("betas", ["[2,3]", "[-0.5,0.9]", "[0.9,1.0]"])
def test_adam_betas_outside_zero_one_are_a_config_error(tmp_path, data, betas):
    for cmd in (["config", "show"], ["train", "--run-dir", str(tmp_path / "r")]):
        proc = run_cli(*cmd, *sets(*TINY, f"data.path={data}", f"optim.betas={betas}", "run.max_steps=1"))
        assert_user_error(proc, "optim.betas")
    assert not (tmp_path / "r").exists()


def test_a_resume_with_another_micro_batch_keeps_the_validation_set(tmp_path, data):
    run = tmp_path / "run"
    items = [*TINY, f"data.path={data}", "run.max_steps=2", "eval.holdout_shards=1", "eval.max_batches=3"]
    assert run_cli("train", "--run-dir", str(run), *sets(*items)).returncode == 0
    proc = run_cli("train", "--resume", str(run), *sets("run.max_steps=4", "batch.micro_batch_size=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["val_items"] for r in evals(run)] == [12, 12]  # 3 batches of the first run's micro batch, 4


def test_nan_hunt_of_a_step_the_run_never_took_is_refused(base):
    assert_user_error(run_cli("nan", "hunt", str(base), "--step", "100000"), "the run has 4 optimizer steps")


def test_config_show_checks_built_in_model_arguments_and_never_runs_a_factory(tmp_path):
    assert_user_error(run_cli("config", "show", *sets("model.dim=abc")), "model.dim")
    (tmp_path / "sideeffect.py").write_text(
        "from pathlib import Path\ndef factory(**kw):\n    Path(__file__).with_name('ran').touch()\n"
    )
    proc = run_cli("config", "show", *sets("model.name=sideeffect:factory"), PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "ran").exists()


def test_a_huge_batch_number_names_its_section(tmp_path):
    proc = run_cli("config", "show", *sets("batch.micro_batch_size=99999999999999999999999999"))
    assert_user_error(proc, "default config", "batch.micro_batch_size")


def test_the_resume_record_is_json(base, tmp_path):
    run = copy_run(base, tmp_path / "run")
    assert run_cli("train", "--resume", str(run), *sets("run.max_steps=5")).returncode == 0
    (record,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["world_size"] == 1 and record["changes"] == {"run.max_steps": [4, 5]}
