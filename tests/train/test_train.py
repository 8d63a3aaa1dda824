"""`steadytrain train` end to end: config errors, the run directory, the schedule, resume, crash safety,
and torchrun (DDP, FSDP2, two "nodes") against a single-process run of the same global batch.

Oracles: the same job on 1 rank (per-step losses), an uninterrupted run (resume), the warmup
schedule's closed form (LR), the previous checkpoint (SIGKILL mid-write)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from steadytrain.train.checkpoint.catalog import load_checkpoint
from tests.dist_utils import cli_on_ranks, free_port
from tests.train_utils import TINY, metrics, run_cli, sets, write_text_dataset

SMALL = [*TINY, "run.log_every=2"]


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    """Byte sequences of this project's own source, in 6 shards of unequal sizes."""
    return write_text_dataset(tmp_path_factory.mktemp("text"), [90, 130, 70, 110, 120, 80])


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def train_cli(run_dir: Path, data: Path, *extra: str, steps: int = 8) -> subprocess.CompletedProcess:
    proc = run_cli(
        "train", "--run-dir", str(run_dir), *sets(*SMALL, f"data.path={data}", f"run.max_steps={steps}"), *extra
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def torchrun(*launcher: str, args: list[str], timeout: int = 300) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "steadytrain", "train", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())


def wait(proc: subprocess.Popen, timeout: int = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def assert_same_losses(a: Path, b: Path, rtol: float = 1e-5) -> None:
    la, lb = [m["loss"] for m in metrics(a)], [m["loss"] for m in metrics(b)]
    assert len(la) == len(lb) > 0
    np.testing.assert_allclose(la, lb, rtol=rtol)


# --- config errors: one line, exit 2, nothing written -----------------------------------------


@pytest.mark.parametrize(
    ("items", "words"),
    [
        (["batch.micro_batch_sise=4"], ["unknown key", "batch.micro_batch_sise"]),
        (["batch.micro_batch_size=four"], ["batch.micro_batch_size", "'four'", "integer"]),
        (["batch.accumulation_steps=3", "batch.global_batch_size=16"], ["global batch 16", "micro 4", "accum 3"]),
        (["precision=fp8"], ["precision", "fp8"]),
        (["clip.max_grad_norm=1", "clip.clip_value=1"], ["clip.max_grad_norm or clip.clip_value"]),
        (["model.name=no_such_module:factory"], ["model.name", "no_such_module"]),
        (["run.name=../escape"], ["run.name"]),
    ],
)
def test_config_errors_are_one_line_and_write_nothing(tmp_path, text_data, items, words):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--run-dir", str(run_dir), *sets(*SMALL, f"data.path={text_data}", *items))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not run_dir.exists()


def test_config_file_errors(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("batch:\n  micro_batch_size: [1, 2\n")
    proc = run_cli("train", str(bad))
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr and "Traceback" not in proc.stderr
    bad.write_text("- just\n- a list\n")
    proc = run_cli("config", "show", str(bad))
    assert proc.returncode == 2 and "mapping of sections" in proc.stderr


def test_existing_run_dir_is_never_overwritten(tmp_path, text_data):
    run_dir = tmp_path / "run"
    train_cli(run_dir, text_data, steps=2)
    before = (run_dir / "metrics.jsonl").read_bytes()
    proc = run_cli("train", "--run-dir", str(run_dir), *sets(*SMALL, f"data.path={text_data}"))
    assert proc.returncode == 2 and "exists" in proc.stderr and "--resume" in proc.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before


# --- the run directory, the loss, the schedule ----------------------------------------------------


def test_run_writes_every_file_with_a_falling_loss_and_the_warmup_schedule(tmp_path, text_data):
    run_dir = tmp_path / "run"
    extra = ["batch.warmup_steps=4", "batch.decay=linear", "batch.min_lr_ratio=0", "checkpoint.every_steps=5"]
    proc = train_cli(run_dir, text_data, *sets(*extra), steps=16)
    for name in ("config.yaml", "env.json", "plan.json", "metrics.jsonl", "exposure.json", "summary.md"):
        assert (run_dir / name).is_file(), name
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step-00000015", "step-00000016"]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert set(rows[0]) == {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "clipped",
        "skipped",
        "items",
        "items_per_s",
        "step_s",  # the step's own time (evaluation and checkpoints timed apart)
        "elapsed_s",
        "tokens_per_s",
        "flops_per_s",
        "peak_mem_mb",  # no mfu: a CPU without run.peak_flops
    }
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5  # clearly falling (from ~ln 256 = 5.5)
    # LR in optimizer steps: linear warmup to the peak over 4 steps, then linear decay to 0 at step 16.
    peak, w, t = 1e-2, 4, 16
    want = [peak * s / (w + 1) if s <= w else peak * (1 - (s - 1 - w) / (t - w)) for s in range(1, t + 1)]
    np.testing.assert_allclose([r["lr"] for r in rows], want, rtol=1e-12)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["global_batch_size"], plan["accumulation_steps"], plan["world_size"]) == (16, 4, 1)
    exposure = json.loads((run_dir / "exposure.json").read_text())
    assert sum(exposure.values()) == 16 * 16
    assert "effective batch 16 = micro 4 x accumulation 4 x world 1" in proc.stderr


def test_the_embedded_default_trains_on_the_standard_library_source(tmp_path):
    run_dir = tmp_path / "default"
    proc = run_cli(
        "train", "--run-dir", str(run_dir), *sets("run.max_steps=12", "run.log_every=4"),
        STEADYTRAIN_CACHE=str(tmp_path / "cache"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    corpus = next((tmp_path / "cache").glob("corpus-stdlib-*"))
    index = json.loads((corpus / "index.json").read_text())
    assert index["shards"][0]["provenance"]["source"] == "python-stdlib"
    rows = metrics(run_dir)
    assert len(rows) == 12 and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # bytes: from ~ln(256) = 5.5 down
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["accumulation_steps"] > 1 and plan["warmup_steps"] >= 1
    assert "max_grad_norm: 1.0" in (run_dir / "config.yaml").read_text()  # global-norm clipping on


# --- resume ------------------------------------------------------------------------------------


def test_ten_plus_resume_plus_ten_equals_twenty(tmp_path, text_data):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_cli(straight, text_data, *sets("checkpoint.every_steps=10"), steps=20)
    train_cli(split, text_data, *sets("checkpoint.every_steps=10"), steps=20)
    for extra in (straight, split):
        assert (extra / "checkpoints" / "step-00000020" / "state.json").exists()
    # Make `split` a run that stopped after 10: drop the final checkpoint and the later log lines.
    shutil.rmtree(split / "checkpoints" / "step-00000020")
    with (split / "layers.jsonl").open("a") as f:
        f.write('{"step": 21, "layer": "tok", "grad_no')  # a kill in the middle of a line
    proc = run_cli("train", "--resume", str(split))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed" in proc.stderr
    assert [m["loss"] for m in metrics(split)] == [m["loss"] for m in metrics(straight)]  # bit for bit
    a = load_checkpoint(straight / "checkpoints" / "step-00000020")["model"]
    b = load_checkpoint(split / "checkpoints" / "step-00000020")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the layers' file continues too: every (step, layer) once, the values of the straight run
    layers = [(split / "layers.jsonl").read_text(), (straight / "layers.jsonl").read_text()]
    assert layers[0] == layers[1] and len(layers[0].splitlines()) == 10 * 5  # every 2 of 20 steps, 5 layers


def test_resume_of_a_directory_without_checkpoints_is_a_clean_error(tmp_path):
    (tmp_path / "run").mkdir()
    proc = run_cli("train", "--resume", str(tmp_path / "run"))
    assert proc.returncode == 2 and "not a steadytrain run directory" in proc.stderr


# --- torchrun: DDP, FSDP2, two nodes, unequal shards -------------------------------------------


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, text_data) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train_cli(run_dir, text_data, steps=6)
    return run_dir


STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, text_data) -> dict[str, tuple[Path, list[subprocess.CompletedProcess]]]:
    """Per strategy: the 2-rank run directory and each rank's exit, all trained on one spawn of 2 ranks (each rank
    runs ``main(argv)`` as under torchrun; the launcher itself is tested by the two-node and ``--nproc`` tests)."""
    root = tmp_path_factory.mktemp("two-ranks")
    runs = {strategy: root / strategy for strategy in STRATEGIES}
    items = [*SMALL, f"data.path={text_data}", "run.max_steps=6"]
    commands = [["train", "--run-dir", run, *sets(*items, f"distributed.strategy={s}")] for s, run in runs.items()]
    results = cli_on_ranks(root, commands)
    return {s: (runs[s], procs) for s, procs in zip(runs, results, strict=True)}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_equal_one_rank_at_the_same_global_batch(two_ranks, one_rank, strategy):
    run_dir, procs = two_ranks[strategy]
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = "".join(proc.stdout + proc.stderr for proc in procs)  # what torchrun prints of its ranks
    assert "micro 4 x accumulation 2 x world 2" in out
    assert_same_losses(run_dir, one_rank)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_give_the_layer_norms_of_one_rank(two_ranks, one_rank, strategy):
    """Per layer, per monitored step: gradient, weight and update norms from the local shards (FSDP2) or the
    replicas (DDP) equal the 1-rank run's within 1e-5: no shard's norm, no replica counted twice."""
    run_dir, _ = two_ranks[strategy]
    got, want = ([json.loads(x) for x in (r / "layers.jsonl").read_text().splitlines()] for r in (run_dir, one_rank))
    assert [(r["step"], r["layer"]) for r in got] == [(r["step"], r["layer"]) for r in want]
    assert {r["step"] for r in want} == {2, 4, 6} and len(want) == 3 * 5  # log_every 2; tok, pos, blocks.0, norm, head
    for g, w in zip(got, want, strict=True):
        for key in ("grad_norm", "param_norm", "update_norm", "update_ratio"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), (strategy, g["step"], g["layer"], key)


@pytest.mark.distributed
def test_two_nodes_on_one_machine_complete(tmp_path, text_data, one_rank):
    port, run_dir = free_port(), tmp_path / "nodes"
    args = ["--run-dir", str(run_dir), *sets(*SMALL, f"data.path={text_data}", "run.max_steps=6")]
    launch = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-id",
        "t",
    ]
    nodes = [torchrun(*launch, f"--node-rank={r}", args=args) for r in range(2)]
    for p in nodes:
        wait(p)
    assert_same_losses(run_dir, one_rank)


@pytest.mark.distributed
def test_nproc_hands_off_to_torchrun_and_resumes_on_another_world_size(tmp_path, text_data, one_rank):
    run_dir = tmp_path / "nproc"
    proc = run_cli(
        "train", "--nproc", "2", "--run-dir", str(run_dir),
        *sets(*SMALL, f"data.path={text_data}", "run.max_steps=6", "checkpoint.every_steps=3"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    proc = run_cli("train", "--resume", str(run_dir))  # 1 rank now: accumulation 4 instead of 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(run_dir, one_rank)
