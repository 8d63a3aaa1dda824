"""Sharded, asynchronous checkpoints: resharded resumes, every rank's RNG, no pickle, `steadytrain export`.

Oracles: a straight run of the same config (bit-identical losses on the same world size, 1e-5 on
another), the validation loss the live model recorded at the last step (for the exported file,
evaluated by hand with PyArrow and `load_state_dict(strict=True)`), a payload that would create a file.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from steadytrain.errors import UserError
from steadytrain.train.checkpoint.catalog import latest_checkpoint, list_checkpoints, load_checkpoint
from steadytrain.train.checkpoint.files import full_tensors, join_state, read_state
from steadytrain.train.setup.models import TinyLM
from tests.cli_utils import assert_user_error
from tests.dist_utils import cli_on_ranks
from tests.train_utils import TINY, evals, metrics, run_cli, sets, write_text_dataset

BATCH = [x for x in TINY if not x.startswith("model.")]
STEPS = ["run.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=5"]

_DROPOUT = '''
import os
import torch
import torch.nn.functional as F


class Dropping(torch.nn.Module):
    """A bigram LM with dropout; rank r draws r extra numbers per forward (as data-dependent random
    augmentation would), so the ranks' streams differ and each rank's own shows in the losses."""

    def __init__(self, dim=16):
        super().__init__()
        self.emb, self.drop, self.head = torch.nn.Embedding(256, dim), torch.nn.Dropout(0.5), torch.nn.Linear(dim, 256)

    def forward(self, batch):
        tokens = batch["tokens"].long()
        torch.rand(int(os.environ.get("RANK", "0")))
        logits = self.head(self.drop(self.emb(tokens[:, :-1])))
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def factory(**kw):
    return Dropping(**kw)
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("ckpt") / "data", [40, 40, 40, 40, 40, 40])


def train(*args: str, **env: str) -> subprocess.CompletedProcess:
    proc = run_cli("train", *args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run)]


def _drop_last(run: Path, step: int = 8) -> None:
    """Make ``run`` one that stopped at its previous checkpoint: its last checkpoint removed."""
    shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")


def _keep_and_drop_last(run: Path, copy: Path) -> None:
    """A step between two commands on the ranks: ``run`` kept as it stands in ``copy``, then :func:`_drop_last`."""
    shutil.copytree(run, copy)
    _drop_last(run)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data) -> dict[str, tuple[Path, list]]:
    """Every 2-rank command sequence of this module, in one spawn of 2 ranks (each rank runs ``main(argv)`` as
    under ``steadytrain train --nproc 2``): per test, the directory holding its runs and each command's exit on
    each rank (None for a step taken between commands)."""
    root = tmp_path_factory.mktemp("ranks")
    (root / "pkg").mkdir()
    (root / "pkg" / "dropmodel.py").write_text(_DROPOUT)
    fsdp, ddp, drop, export = (root / name for name in ("fsdp", "ddp", "dropout", "export"))
    sharded = [*TINY, f"data.path={data}", *STEPS, "distributed.strategy=fsdp"]
    dropping = [*BATCH, f"data.path={data}", *STEPS, "model.name=dropmodel:factory"]
    exported = [*TINY, f"data.path={data}", "run.max_steps=4", "eval.holdout_shards=2", "distributed.strategy=fsdp"]
    sequences = {
        fsdp: [
            ["train", "--run-dir", fsdp / "run", *sets(*sharded)],
            partial(_keep_and_drop_last, fsdp / "run", fsdp / "straight"),
            ["train", "--resume", fsdp / "run"],
        ],
        ddp: [
            ["train", "--run-dir", ddp / "run", *sets(*TINY, f"data.path={data}", *STEPS)],
            partial(_keep_and_drop_last, ddp / "run", ddp / "straight"),
            ["train", "--resume", ddp / "run", *sets("distributed.strategy=fsdp")],
            partial(_keep_and_drop_last, ddp / "run", ddp / "fsdp"),
            ["train", "--resume", ddp / "run", *sets("distributed.strategy=ddp")],
        ],
        drop: [
            ["train", "--run-dir", drop / "run", *sets(*dropping)],
            partial(_keep_and_drop_last, drop / "run", drop / "straight"),
            ["train", "--resume", drop / "run"],
        ],
        export: [["train", "--run-dir", export / "run", *sets(*exported)]],
    }
    commands = [c for sequence in sequences.values() for c in sequence]
    results = iter(cli_on_ranks(root, commands, PYTHONPATH=str(root / "pkg")))  # the dropout model's module
    return {d.name: (d, [next(results) for _ in sequence]) for d, sequence in sequences.items()}


def _ranks_ok(results: list) -> None:
    """Every command of a sequence exited 0 on every rank (what a ``--nproc 2`` launch's 0 says)."""
    for procs in results:
        for proc in procs or []:
            assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.distributed
def test_fsdp_on_two_ranks_resumes_on_two_bit_for_bit_and_on_one_within_1e_5(tmp_path, two_ranks):
    root, results = two_ranks["fsdp"]
    _ranks_ok(results)
    straight = _losses(root / "straight")  # the 2-rank run as it ended, before its last checkpoint was dropped
    step4 = root / "straight" / "checkpoints" / "step-00000004"
    assert len(list(step4.glob("shard-0000[12]-*.safetensors"))) >= 2  # each rank wrote its own shards
    assert sorted(p.name for p in (step4 / "rng").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    assert _losses(root / "run") == straight  # resumed on the same world size: bit for bit
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)  # the module's run stays as the ranks left it
    _drop_last(run)
    proc = train("--resume", str(run))  # one rank, accumulation 4 instead of 2
    assert "derived anew" in proc.stderr  # the saved per-rank streams do not fit one rank: said once
    again = _losses(run)
    assert [s for s, _ in again] == [s for s, _ in straight]
    np.testing.assert_allclose([v for _, v in again], [v for _, v in straight], rtol=1e-5)


@pytest.mark.distributed
def test_ddp_resumes_under_fsdp_and_back(two_ranks):
    root, results = two_ranks["ddp"]
    _ranks_ok(results)
    straight = _losses(root / "straight")
    step4 = root / "straight" / "checkpoints" / "step-00000004"
    keys: list[str] = []
    for f in step4.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as opened:
            keys += list(opened.keys())
    assert len(keys) == len(set(keys)) > 0  # DDP's replicas: each tensor written once, not once per rank
    shard_ranks = {f.name.split("-")[1] for f in step4.glob("*.safetensors")}
    assert shard_ranks == {"00001", "00002"}  # and the writing is spread over both ranks
    for resumed in (root / "fsdp", root / "run"):  # resumed under fsdp, then (from that run) under ddp
        again = _losses(resumed)
        np.testing.assert_allclose([v for _, v in again], [v for _, v in straight], rtol=1e-5)
        assert [s for s, _ in again] == list(range(1, 9))


@pytest.mark.distributed
def test_each_ranks_dropout_stream_resumes_exactly_on_two_ranks(two_ranks):
    root, results = two_ranks["dropout"]
    _ranks_ok(results)
    straight = _losses(root / "straight")
    assert _losses(root / "run") == straight  # rank 1's dropout masks continue its own stream, not rank 0's


_WRITER = """
import sys, torch
from pathlib import Path
from steadytrain.train.checkpoint.writer import CheckpointWriter
from steadytrain.train.setup.distributed import DistInfo
model = torch.nn.Linear(3000, 3000)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.ones(1, 3000)).sum().backward()
opt.step()
info = DistInfo(0, 1, 0, torch.device("cpu"), None)
writer = CheckpointWriter(Path(sys.argv[1]), info, use_async=sys.argv[2] == "async", keep_last=2)
writer.save(1, model, opt, {"step": 1}, frozenset())
writer.wait()
print("first", flush=True)
for step in range(2, 1000):
    writer.save(step, model, opt, {"step": step}, frozenset())
"""


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, mode):
    ckpt = tmp_path / "checkpoints"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _WRITER, str(ckpt), mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "first"
    deadline = time.monotonic() + 120
    while not list(ckpt.glob(".step-*.partial/*.safetensors")):  # a write is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = latest_checkpoint(ckpt)
    state = load_checkpoint(latest)
    assert state["step"] == int(latest.name.split("-")[1]) >= 1 and state["train"] == {"step": state["step"]}
    assert state["model"]["weight"].shape == (3000, 3000)
    assert all(p.is_dir() and (p / "state.json").is_file() for _, p in list_checkpoints(ckpt))


_PAYLOAD = """
import os
class Boom:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
"""


def _payload(marker: Path) -> bytes:
    scope: dict = {}
    exec(_PAYLOAD.format(marker=marker), scope)  # a pickle that would run `touch` if ever unpickled
    return pickle.dumps({"step": 9, "model": scope["Boom"](), "optimizer": {}})


def test_a_planted_pickle_payload_is_refused_and_never_runs(tmp_path, data):
    run = tmp_path / "run"
    train("--run-dir", str(run), *sets(*TINY, f"data.path={data}", "run.max_steps=2"))
    marker, ckpts = tmp_path / "ran", run / "checkpoints"
    legacy = ckpts / "step-00000009.pt"  # the single-file format: read with weights_only=True
    legacy.write_bytes(_payload(marker))
    assert_user_error(run_cli("train", "--resume", str(run), *sets("run.max_steps=12")), "step-00000009.pt")
    legacy.unlink()
    planted = ckpts / "step-00000009"  # the directory format: a pickle where data goes
    shutil.copytree(ckpts / "step-00000002", planted)
    for f in planted.glob("*.safetensors"):
        f.write_bytes(_payload(marker))
    (planted / ".metadata").write_bytes(_payload(marker))  # DCP's own (pickled) metadata: never read
    assert_user_error(run_cli("train", "--resume", str(run), *sets("run.max_steps=12")), "step-00000009")
    assert_user_error(run_cli("export", str(run), "--out", str(tmp_path / "m.safetensors")), "step-00000009")
    (planted / "state.json").write_bytes(_payload(marker))
    with pytest.raises(UserError, match="not JSON"):
        load_checkpoint(planted)
    assert not marker.exists()


@pytest.mark.distributed
def test_export_loads_strictly_and_gives_the_live_models_last_validation_loss(tmp_path, data, two_ranks):
    root, results = two_ranks["export"]  # trained on 2 ranks with fsdp, 4 steps, 2 held-out shards
    _ranks_ok(results)
    run, out = root / "run", tmp_path / "model.safetensors"
    proc = run_cli("export", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    model = TinyLM(dim=32, layers=1, heads=2, seq_len=32)
    model.load_state_dict(load_file(out), strict=True)  # the model's own keys: no wrapper prefix
    model.eval()
    held = json.loads((run / "plan.json").read_text())["eval_shards"]
    index = json.loads((data / "index.json").read_text())
    files = {s["id"]: data / s["file"] for s in index["shards"]}
    rows = [np.stack(pq.read_table(files[s])["tokens"].to_numpy(zero_copy_only=False)) for s in sorted(held)]
    tokens = torch.from_numpy(np.concatenate(rows).astype(np.int64))
    with torch.no_grad():
        losses = torch.cat([model({"tokens": t}) for t in tokens.split(7)]).double()
    last = evals(run)[-1]  # the live (sharded) model evaluated at step 4
    assert last["step"] == 4 and last["val_items"] == len(tokens)
    assert math.isclose(last["val_loss"], losses.mean().item(), rel_tol=1e-6)


def test_export_errors_are_one_line(tmp_path, data):
    run = tmp_path / "run"
    train("--run-dir", str(run), *sets(*TINY, f"data.path={data}", "run.max_steps=2"))
    assert_user_error(run_cli("export", str(run), "--out", str(tmp_path / "m.pt")), ".safetensors")
    assert_user_error(run_cli("export", str(run), "--out", str(tmp_path / "no" / "m.safetensors")), "does not exist")
    assert_user_error(run_cli("export", str(run), "--step", "7", "--out", str(tmp_path / "m.safetensors")), "--step 7")
    not_a_run = run_cli("export", str(tmp_path), "--out", str(tmp_path / "m.safetensors"))
    assert_user_error(not_a_run, "not a steadytrain run")
    assert not list(tmp_path.glob("*.safetensors*"))


def _to_legacy(ckpt: Path) -> None:
    """Rewrite a checkpoint directory as the single-file format of earlier versions (a full state dict)."""
    state = read_state(ckpt)
    tensors = {f"{p}/{k}": v for p in ("model", "optimizer") for k, v in full_tensors(ckpt, p)}
    rng = json.loads((ckpt / "rng" / "rank-00000.json").read_text())["torch"]
    train = state["train"]
    payload = {
        "step": state["step"],
        "model": join_state(state["model"], tensors),
        "optimizer": join_state(state["optimizer"], tensors),
        **{k: train[k] for k in ("scheduler", "scaler", "accumulator", "data", "elapsed_s", "exposure", "validation")},
        "rng": torch.tensor(rng, dtype=torch.uint8),
        "world_size": state["world_size"],
    }
    torch.save(payload, ckpt.parent / f"{ckpt.name}.pt")
    shutil.rmtree(ckpt)


def test_a_run_of_single_file_checkpoints_still_resumes_and_exports(tmp_path, data):
    run = tmp_path / "run"
    train("--run-dir", str(run), *sets(*TINY, f"data.path={data}", *STEPS))
    straight = _losses(run)
    _drop_last(run)
    _to_legacy(run / "checkpoints" / "step-00000004")
    assert [p.name for _, p in list_checkpoints(run / "checkpoints")] == ["step-00000004.pt"]
    train("--resume", str(run))
    assert _losses(run) == straight
    assert [p.name for _, p in list_checkpoints(run / "checkpoints")] == ["step-00000004.pt", "step-00000008"]
    out = tmp_path / "m.safetensors"
    assert run_cli("export", str(run), "--step", "4", "--out", str(out)).returncode == 0
    legacy = torch.load(run / "checkpoints" / "step-00000004.pt", weights_only=True)["model"]
    exported = load_file(out)
    assert exported.keys() == legacy.keys() and all(torch.equal(exported[k], legacy[k]) for k in legacy)


def test_retention_keeps_the_latest_and_the_best_and_a_resume_finds_them(tmp_path, data):
    run = tmp_path / "run"
    items = [*TINY, f"data.path={data}", "run.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=1"]
    items += ["eval.holdout_shards=1", "eval.every_steps=1", "checkpoint.keep_best=true"]
    train("--run-dir", str(run), *sets(*items))
    best = min(evals(run), key=lambda r: r["val_loss"])["step"]
    kept = [s for s, _ in list_checkpoints(run / "checkpoints")]
    assert kept == sorted({best, 6})
    assert not list((run / "checkpoints").glob(".*"))  # no partial save left behind
    train("--resume", str(run), *sets("run.max_steps=7"))
    assert [r["step"] for r in metrics(run)] == list(range(1, 8))


def test_the_train_state_round_trips_through_json_with_its_tensors():
    from steadytrain.train.checkpoint.files import from_json, to_json

    state = {
        "events": [{"shard": torch.tensor([3, 9], dtype=torch.int64), "loss": torch.tensor([float("nan"), 1.5])}],
        "flags": torch.tensor([[True, False]]),
        "n": np.int64(7),
        "inf": float("inf"),
        "pair": (1, "a"),
    }
    back = from_json(json.loads(json.dumps(to_json(state, "state"))), "state")
    assert torch.equal(back["events"][0]["shard"], state["events"][0]["shard"])
    assert back["events"][0]["loss"].dtype == torch.float32 and back["events"][0]["loss"][1] == 1.5
    assert torch.isnan(back["events"][0]["loss"][0])
    assert torch.equal(back["flags"], state["flags"]) and back["n"] == 7 and back["inf"] == float("inf")
    assert back["pair"] == [1, "a"]
    with pytest.raises(TypeError, match=r"state\.obj: a object"):
        to_json({"obj": object()}, "state")
    with pytest.raises(UserError, match="damaged array"):
        from_json({"$array": {"dtype": "os", "shape": [1], "data": [1]}}, "state.json")


def test_a_failed_background_write_is_reported_and_never_taken_for_a_checkpoint(tmp_path, monkeypatch):
    from steadytrain.train.checkpoint import writer as ckptsave
    from steadytrain.train.checkpoint.writer import CheckpointFailed, CheckpointWriter
    from steadytrain.train.setup.distributed import DistInfo

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = tmp_path / "checkpoints"
    writer = CheckpointWriter(ckpt, DistInfo(0, 1, 0, torch.device("cpu"), None), use_async=True, keep_last=5)
    writer.save(1, model, opt, {"step": 1}, frozenset())
    writer.wait()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckptsave, "write_safetensors", full_disk)
    writer.save(2, model, opt, {"step": 2}, frozenset())
    with pytest.raises(CheckpointFailed, match=r"checkpoint of step 2 failed.*No space left"):
        writer.wait()
    assert [s for s, _ in list_checkpoints(ckpt)] == [1] and not list(ckpt.glob(".*"))  # nothing half-written
    monkeypatch.undo()
    writer.save(3, model, opt, {"step": 3}, frozenset())
    writer.wait()  # the failure was reported once; the next save is whole
    writer.close()
    assert [s for s, _ in list_checkpoints(ckpt)] == [1, 3]
    assert torch.equal(load_checkpoint(ckpt / "step-00000003")["model"]["weight"], model.weight.detach())


def test_state_a_checkpoint_cannot_hold_is_one_error_and_no_directory(tmp_path):
    from steadytrain.train.checkpoint.writer import CheckpointWriter
    from steadytrain.train.setup.distributed import DistInfo

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["rule"] = lambda p: p  # a custom optimizer's setting that is not data
    writer = CheckpointWriter(
        tmp_path / "ck", DistInfo(0, 1, 0, torch.device("cpu"), None), use_async=True, keep_last=2
    )
    with pytest.raises(UserError, match=r"checkpoint of step 1 cannot hold the run's state: .*rule: a function"):
        writer.save(1, model, opt, {"step": 1}, frozenset())
    writer.close()
    assert list((tmp_path / "ck").iterdir()) == []
