"""A hostile pass over checkpoint directories: every value of ``state.json`` is checked before a resume changes
anything, the tensor files must cover each tensor exactly once, and ``export --out`` never replaces a file that
is not an earlier export. Each finding is a test; each refusal is one line, exit 2, the run directory unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.cli_utils import assert_user_error
from tests.train_utils import CHECKPOINTED, copy_run, sets

CKPT = "step-00000004"


@pytest.fixture(scope="module")
def base(tiny_run) -> Path:
    return tiny_run(*CHECKPOINTED)


def _copy(base: Path, tmp_path: Path) -> Path:
    return copy_run(base, tmp_path / "run")


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file under ``run`` (the lock files included), by relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _edit(state: dict, key: str, value) -> None:
    node = state
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value


def _damaged(base: Path, tmp_path: Path, key: str, value) -> Path:
    """A copy of ``base`` whose latest ``state.json`` has ``key`` set to ``value`` (``KeyError``: removed)."""
    run = _copy(base, tmp_path)
    path = run / "checkpoints" / CKPT / "state.json"
    state = json.loads(path.read_text())
    _edit(state, key, value)
    path.write_text(json.dumps(state))
    return run


DAMAGE = [
    ("step", -5, "step"),
    ("step", 10**30, "step"),
    ("world_size", 0, "world_size"),
    ("train.step", -5, "train.step"),
    ("train.scheduler", KeyError, "train.scheduler"),
    ("train.scheduler", "abc", "train.scheduler"),
    ("train.scheduler.last_epoch", -1, "train.scheduler.last_epoch"),
    ("train.accumulator", "abc", "train.accumulator"),
    ("train.accumulator.micro_steps", -3, "train.accumulator.micro_steps"),
    ("train.data", [1, 2], "train.data"),
    ("train.data.epoch", -1, "train.data.epoch"),
    ("train.exposure", {"1000000000000000000": 5}, "train.exposure"),
    ("train.exposure", {"-3": 5}, "train.exposure"),
    ("train.exposure", {"1": -5}, "train.exposure.1"),
    ("train.exposure", "abc", "train.exposure"),
    ("train.exposure", {"999999": 5}, "train.exposure"),
    ("train.validation", {"best_loss": 1.0, "best_step": 2}, "train.validation.bad"),
    ("train.spikes.rollbacks", -1, "train.spikes.rollbacks"),
    ("train.spikes.detector.loss", "abc", "train.spikes.detector.loss"),
    ("train.elapsed_s", -1.0, "train.elapsed_s"),
]


@pytest.mark.parametrize(("key", "value", "word"), DAMAGE, ids=[f"{k}={v!r}"[:40] for k, v, _ in DAMAGE])
def test_a_damaged_state_json_value_is_one_line_naming_the_file_and_key(base, tmp_path, cli, key, value, word):
    run = _damaged(base, tmp_path, key, value)
    before = _snapshot(run)
    r = cli("train", "--resume", run, *sets("run.max_steps=6"))
    assert_user_error(r, "state.json", word)
    assert _snapshot(run) == before
    assert not any(p.name.startswith("step--") for p in (run / "checkpoints").iterdir())


def test_state_json_nested_100000_deep_is_one_line(base, tmp_path, cli):
    run = _copy(base, tmp_path)
    path = run / "checkpoints" / CKPT / "state.json"
    text = path.read_text()
    path.write_text(text.replace('"scaler":null', '"scaler":' + _deep(100_000), 1))
    before = _snapshot(run)
    r = cli("train", "--resume", run, *sets("run.max_steps=6"))
    assert_user_error(r, "state.json", "deep")
    assert _snapshot(run) == before
    assert_user_error(cli("export", run, "--out", tmp_path / "m.safetensors"), "state.json", "deep")


def test_state_json_nested_40_deep_names_the_depth(base, tmp_path, cli):
    run = _copy(base, tmp_path)
    path = run / "checkpoints" / CKPT / "state.json"
    path.write_text(path.read_text().replace('"scaler":null', '"scaler":' + _deep(40), 1))
    assert_user_error(cli("train", "--resume", run, *sets("run.max_steps=6")), "state.json", "deeper than")


def test_a_stray_safetensors_file_from_another_step_is_refused_naming_the_tensor(base, tmp_path, cli):
    run = _copy(base, tmp_path)
    older, latest = run / "checkpoints" / "step-00000002", run / "checkpoints" / CKPT
    stray = sorted(older.glob("*.safetensors"))[0]
    shutil.copy(stray, latest / "copy-of-step-2.safetensors")
    key = sorted(load_file(stray))[0]
    before = _snapshot(run)
    r = cli("train", "--resume", run, *sets("run.max_steps=6"))
    assert_user_error(r, CKPT, key, "held twice")
    assert _snapshot(run) == before
    assert_user_error(cli("export", run, "--out", tmp_path / "m.safetensors"), CKPT, key, "held twice")
    assert not (tmp_path / "m.safetensors").exists()


def test_a_missing_safetensors_part_is_refused(base, tmp_path, cli):
    run = _copy(base, tmp_path)
    files = sorted((run / "checkpoints" / CKPT).glob("*.safetensors"))
    held = load_file(files[0])
    files[0].unlink()
    r = cli("train", "--resume", run, *sets("run.max_steps=6"))
    assert r.returncode == 2 and CKPT in r.stderr and any(k in r.stderr for k in held), r.stderr


def test_export_out_onto_a_checkpoint_file_is_refused_and_the_file_kept(base, tmp_path, cli):
    run = _copy(base, tmp_path)
    target = sorted((run / "checkpoints" / "step-00000002").glob("*.safetensors"))[0]
    before = _snapshot(run)
    assert_user_error(cli("export", run, "--out", target), "--out", "checkpoints")
    assert _snapshot(run) == before
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert_user_error(cli("export", run, "--out", link), "--out", "checkpoints")
    assert _snapshot(run) == before
    r = cli("train", "--resume", run, *sets("run.max_steps=6"))
    assert r.returncode == 0, r.stderr


def test_export_out_onto_a_foreign_file_is_refused_an_earlier_export_replaced(base, tmp_path, cli):
    foreign = tmp_path / "notes.safetensors"
    foreign.write_bytes(b"my own notes, not a model")
    assert_user_error(cli("export", base, "--out", foreign), "--out", "not an earlier export")
    assert foreign.read_bytes() == b"my own notes, not a model"
    out = tmp_path / "model.safetensors"
    assert cli("export", base, "--out", out, "--step", "2").returncode == 0
    first = load_file(out)
    r = cli("export", base, "--out", out)
    assert r.returncode == 0, r.stderr
    again = load_file(out)
    assert first.keys() == again.keys() and any((first[k] != again[k]).any() for k in first)


INCONSISTENT = [
    ("train.scheduler.last_epoch", 10**9, "train.scheduler.last_epoch=1000000000"),
    ("train.scheduler.last_epoch", 0, "train.accumulator.optimizer_steps=4"),
    ("train.accumulator.optimizer_steps", 9, "train.accumulator.optimizer_steps=9"),
    ("train.data.epoch", 10**9, "train.data.epoch=1000000000"),
    ("train.validation.best_step", 10**9, "train.validation.best_step=1000000000"),
    ("train.accumulator.cycle.micro", 5, "train.accumulator.cycle.micro=5"),
]


@pytest.mark.parametrize(("key", "value", "word"), INCONSISTENT, ids=[f"{k}={v}" for k, v, _ in INCONSISTENT])
def test_state_json_values_of_the_right_type_that_disagree_are_refused(base, tmp_path, cli, key, value, word):
    """Each of these resumed silently: a scheduler at position 10**9 trained on at the schedule's floor, one at 0
    re-ran the warmup, epoch 10**9 reshuffled the data, a best step in the future stopped early at once."""
    run = _damaged(base, tmp_path, key, value)
    before = _snapshot(run)
    assert_user_error(cli("train", "--resume", run, *sets("run.max_steps=6")), "state.json", word)
    assert _snapshot(run) == before
    assert_user_error(cli("export", run, "--out", tmp_path / "m.safetensors"), "state.json", word)
    assert not (tmp_path / "m.safetensors").exists()


def test_a_checkpoint_directory_named_for_another_step_is_refused(base, tmp_path, cli):
    """step-00000004 renamed step-00000009: --resume said the run was at step 9, export --step 9 and eval answered
    with step 4's model."""
    run = _copy(base, tmp_path)
    (run / "checkpoints" / CKPT).rename(run / "checkpoints" / "step-00000009")
    before = _snapshot(run)
    assert_user_error(cli("train", "--resume", run, *sets("run.max_steps=12")), "step-00000009", "step=4")
    assert _snapshot(run) == before
    out = tmp_path / "m.safetensors"
    assert_user_error(cli("export", run, "--step", "9", "--out", out), "step-00000009", "step=4")
    assert not out.exists()
    r = cli("eval", run, "--json")
    assert r.returncode == 2 and "step-00000009" in json.loads(r.stdout)["error"], r.stdout


def _link_files(src: Path, dst: Path) -> None:
    for f in sorted(dst.glob("*.safetensors")):
        f.unlink()
        f.symlink_to(src / f.name)


@pytest.mark.parametrize("what", ["files", "directory", "state", "rng"])
def test_a_symbolic_link_inside_the_checkpoints_is_refused_and_the_other_run_untouched(base, tmp_path, cli, what):
    """A checkpoint whose files (or itself) link into another run was resumed from, and the resume's retention and
    writes went on through it; state.json linked to a device was taken for a missing one."""
    run, other = _copy(base, tmp_path), copy_run(base, tmp_path / "other")
    mine, theirs = run / "checkpoints" / CKPT, other / "checkpoints" / CKPT
    if what == "files":
        _link_files(theirs, mine)
    elif what == "directory":
        shutil.rmtree(mine)
        mine.symlink_to(theirs)
    else:
        target = mine / ("state.json" if what == "state" else "rng/rank-00000.json")
        target.unlink()
        target.symlink_to(theirs / target.relative_to(mine))
    before, theirs_before = _snapshot(run), _snapshot(other)
    assert_user_error(cli("train", "--resume", run, *sets("run.max_steps=6")), "symbolic link", CKPT)
    assert _snapshot(run) == before and _snapshot(other) == theirs_before
    assert_user_error(cli("export", run, "--out", tmp_path / "m.safetensors"), "symbolic link")
    assert not (tmp_path / "m.safetensors").exists()
    r = cli("eval", run, "--json")
    assert r.returncode == 2 and "symbolic link" in json.loads(r.stdout)["error"], r.stdout


def test_a_damaged_rng_file_is_named(base, tmp_path, cli):
    run = _copy(base, tmp_path)
    (run / "checkpoints" / CKPT / "rng" / "rank-00000.json").write_text('{"python": "x"}')
    before = _snapshot(run)
    assert_user_error(cli("train", "--resume", run, *sets("run.max_steps=6")), "rank-00000.json", "generator state")
    assert _snapshot(run) == before


def test_export_hf_out_inside_the_checkpoints_is_refused(base, tmp_path, cli):
    """``--out FILE`` inside checkpoints/ was refused, ``--format hf --out DIR`` there was not (a new
    ``checkpoints/step-00000009`` would have made the save of step 9 fail)."""
    run = _copy(base, tmp_path)
    before = _snapshot(run)
    r = cli("export", run, "--format", "hf", "--out", run / "checkpoints" / "step-00000009")
    assert_user_error(r, "--out", "inside the run's checkpoints")
    assert _snapshot(run) == before and not (run / "checkpoints" / "step-00000009").exists()
