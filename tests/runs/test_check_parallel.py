"""``steadytrain check-parallel``: a planted tensor-parallel bug is named by step, metric and layer (two real
layouts, each trained in its own processes), and bad input is refused in one line before any training."""

from __future__ import annotations

import json

import pytest

from steadytrain.runs.parallel import relative_difference
from tests.cli_utils import assert_user_error
from tests.mesh import PLANTED_TP
from tests.train_utils import run_cli, sets, write_text_dataset

SMALL = (
    "model.dim=32", "model.layers=2", "model.heads=4", "data.seq_len=32", "batch.micro_batch_size=2",
    "batch.global_batch_size=8", "batch.base_batch_size=8", "eval.holdout_shards=1",
)  # fmt: skip


@pytest.mark.distributed
def test_a_plan_that_forgets_one_layers_all_reduce_is_named(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "planted_tp.py").write_text(PLANTED_TP)
    data = write_text_dataset(tmp_path / "data", [12] * 4)
    planted = ("model.name=planted_tp:factory", "model.forget=true", f"data.path={data}", *SMALL)
    out = tmp_path / "check"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkg"))  # for the trainings the command launches
    proc = run_cli(  # in this process, which checks the model first: the same directory on its path
        "check-parallel", "--mesh", "tp=2", "--steps", "1", "--json", "--out", str(out), *sets(*planted),
        PYTHONPATH=str(tmp_path / "pkg"),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]  # they differ
    got = json.loads(proc.stdout)
    assert {k: got["first_difference"][k] for k in ("step", "metric", "layer")} == {
        "step": 1, "metric": "grad_norm", "layer": "blocks.0.norm2",
    }  # fmt: skip
    assert got["agree"] is False and got["steps"] == 1 and got["max_rel_diff"] > 0.1
    a, b = got["first_difference"]["values"]
    assert 0 < a < b  # one rank's half of the sequence: part of the true gradient
    # everything the forward computes agrees at step 1: the loss, and the layers after it in the backward
    rows = {}
    for side in ("mesh", "against"):
        lines = (out / got["runs"][side].split("/")[-1] / "layers.jsonl").read_text().splitlines()
        rows[side] = {(r["step"], r["layer"]): r["grad_norm"] for r in map(json.loads, lines)}
    assert relative_difference(rows["mesh"][1, "blocks.0.mlp.0"], rows["against"][1, "blocks.0.mlp.0"]) < 1e-5
    assert relative_difference(rows["mesh"][1, "head"], rows["against"][1, "head"]) < 1e-5


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--mesh", "tp=two"], ["--mesh", "tp='two' is not a whole number"]),
        (["--mesh", "pipeline=2"], ["--mesh", "'pipeline=2' is not one of replicate=R, shard=S, tp=T"]),
        (["--mesh", "tp=0"], ["--mesh", "each dimension from 1"]),
        (["--mesh", "tp=1"], ["--mesh and --against are both replicate=1,shard=1,tp=1"]),
        (["--mesh", "tp=2", "--set", "run.max_stepz=3"], ["run.max_stepz"]),
    ],
)
def test_bad_input_is_refused_in_one_line_before_training(tmp_path, args, words):
    proc = run_cli("check-parallel", *args, "--out", str(tmp_path / "out"))
    assert_user_error(proc, *words)
    assert not (tmp_path / "out").exists()


def test_a_used_out_directory_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("earlier")
    assert_user_error(run_cli("check-parallel", "--mesh", "tp=2", "--out", str(tmp_path / "out")), "is not empty")


def test_train_refuses_a_mesh_that_is_not_the_world_size_before_the_run_directory(tmp_path):
    proc = run_cli("train", "--run-dir", str(tmp_path / "r"), *sets("distributed.mesh=shard=2,tp=2"))
    assert_user_error(proc, "distributed.mesh replicate=1,shard=2,tp=2 needs 1 x 2 x 2 = 4 ranks, this job has 1")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("strategy=hsdp", ["strategy=hsdp needs mesh"]),
        ("mesh=tp=2", None),  # fine alone; with ddp below it is not
    ],
)
def test_strategy_and_mesh_are_checked_together(tmp_path, value, words):
    proc = run_cli("config", "show", *sets(f"distributed.{value}"))
    if words is None:
        assert proc.returncode == 0, proc.stderr
        proc = run_cli("config", "show", *sets(f"distributed.{value}", "distributed.strategy=ddp"))
        words = ["strategy=ddp does not fit mesh replicate=1,shard=1,tp=2"]
    assert_user_error(proc, *words)
