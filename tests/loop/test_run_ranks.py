"""``steadytrain.Run`` on 2 gloo ranks (DDP): the same run as one process, and its records name the planted shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import spawn
from tests.loop import own_loop
from tests.loop.own_loop import SHARD, Examples

pytestmark = pytest.mark.distributed

STEPS = 16
NAN = range(130, 140)  # shard 2


def _two_ranks(rank: int, world_size: int, tmp: Path) -> None:
    own_loop.train(tmp / "run2", STEPS, data=Examples(nan=NAN), dropout=0.0, layers=True, log_every=4)
    # FSDP2: half the steps, then the same loop resumed from its sharded checkpoint (step 8) to the end
    own_loop.train(tmp / "fsdp", STEPS // 2, data=Examples(nan=NAN), dropout=0.0, fsdp=True, log_every=4)
    own_loop.train(tmp / "fsdp", STEPS, data=Examples(nan=NAN), dropout=0.0, fsdp=True, log_every=4, resume=True)
    # last: rank 1 stops after step 2, the watchdog ends every rank (exit 75) and writes what it found
    own_loop.train(tmp / "hung", 6, data=Examples(), watchdog_s=2.0, callbacks=[_Stall()], report=False)


def _rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


class _Stall:
    """Rank 1 stops making progress after step 2 (between steps: in its ``data`` phase)."""

    def on_step_end(self, run):
        if run.rank == 1 and run.step == 2:
            import time

            time.sleep(120)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path, Path, int]:
    """The runs of :func:`_two_ranks` on one spawned pair, the exit code the watchdog's hang ended it with, and the
    same loop on one process."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("ranks")
    with pytest.raises(mp.ProcessExitedException) as exited:  # the hang, last: every rank exits with its code
        spawn(_two_ranks, 2, tmp)
    own_loop.train(tmp / "run1", STEPS, data=Examples(nan=NAN), dropout=0.0, layers=True, log_every=4)
    return tmp / "run1", tmp / "run2", tmp / "fsdp", tmp / "hung", exited.value.exit_code


@pytest.mark.parametrize("which", [1, 2])
def test_two_ranks_train_as_one(runs, which):
    one, two = runs[0], runs[which]  # DDP; FSDP2 stopped and resumed halfway
    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["skipped"] for r in a] == [r["skipped"] for r in b]
    for x, y in zip(a, b, strict=True):  # the same examples per step; only the summation order differs
        if x["loss"] is None:
            assert y["loss"] is None
        else:
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    assert json.loads((two / "exposure.json").read_text()) == json.loads((one / "exposure.json").read_text())
    assert json.loads((two / "plan.json").read_text())["world_size"] == 2
    if which == 2:
        assert [json.loads(line)["step"] for line in (two / "resumes.jsonl").read_text().splitlines()] == [8]


def test_each_rank_records_its_own_refusals(runs):
    one, two, *_ = runs
    steps = sorted({r["step"] for r in _rows(one, "nonfinite.jsonl")})
    lines = _rows(two, "nonfinite.jsonl")
    assert steps and sorted({r["step"] for r in lines}) == steps
    assert {r["rank"] for r in lines} == {0, 1}  # every rank refused every such step, and says so


def test_nan_report_on_two_ranks_names_the_shard(runs, cli):
    _, two, *_ = runs
    res = cli("nan", "report", str(two), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["verdict"] == "shard-selective" and rep["suspect_shards"] == [NAN[0] // SHARD]


def test_the_watchdog_names_the_rank_that_stopped(runs, cli):
    *_, hung, code = runs
    assert code == 75  # every rank exited with the watchdog's code
    res = cli("hangs", str(hung), "--json")
    assert res.returncode == 0, res.stderr
    (hang,) = json.loads(res.stdout)
    assert hang["stuck_ranks"] == [1] and hang["phase"] == "data" and hang["step"] == 3
