"""Background loading (``data.num_workers``, ``data.prefetch``, ``data.transform``): the same micro-batches in
the same order and the same saved position for any number of workers, and a worker that raises or dies
is one error naming the micro-batch and its shards.

Oracles: the in-process reader (0 workers) for the micro-batches and positions; a run with 0 workers for
the losses of runs with 1 and 3 workers, on 1 rank and on 2."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from steadytrain.data import BatchedDataset
from steadytrain.data.loader import DataWorkerError, MicroBatchLoader
from steadytrain.errors import UserError
from tests import loader_utils
from tests.dist_utils import cli_on_ranks
from tests.train_utils import TINY, metrics, run_cli, sets, write_text_dataset

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("text"), [90, 130, 70, 110, 120, 80])


def dataset(path: Path, **kw) -> BatchedDataset:
    return BatchedDataset(path, batch_size=4, accumulation_steps=2, world_size=2, rank=1, seed=5, **kw)


def read(loader: MicroBatchLoader, n: int | None = None) -> list[dict]:
    out = []
    for mb in loader:
        out.append({k: v.clone() for k, v in mb.items()})
        if n is not None and len(out) == n:
            break
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("workers", [1, 3])
def test_workers_yield_the_in_process_micro_batches_in_order(text_data, workers):
    expected = read(MicroBatchLoader(dataset(text_data, transform=loader_utils.reverse)))
    ds = dataset(text_data, transform=loader_utils.reverse)
    got = read(MicroBatchLoader(ds, num_workers=workers, prefetch=3))
    assert_same(got, expected)
    assert ds.micro == len(expected) == len(ds)


@pytest.mark.parametrize("workers", [1, 3])
def test_position_saved_mid_epoch_resumes_exactly_with_workers(text_data, workers):
    whole = read(MicroBatchLoader(dataset(text_data)))
    ds = dataset(text_data)
    first = read(MicroBatchLoader(ds, num_workers=workers), n=7)  # stops mid-way: workers read ahead
    state = ds.state_dict()
    assert state["micro"] == 7  # the position is what was handed over, not what was read ahead
    again = dataset(text_data)
    again.load_state_dict(state)
    rest = read(MicroBatchLoader(again, num_workers=workers))
    assert_same(first + rest, whole)


def test_training_rng_untouched_by_starting_workers(text_data):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    read(MicroBatchLoader(dataset(text_data), num_workers=2), n=2)
    assert torch.equal(torch.rand(4), expected)


def test_every_kind_of_column_arrives_as_the_in_process_reader_gives_it(text_data):
    expected = list(MicroBatchLoader(dataset(text_data, transform=loader_utils.many_kinds)))
    got = list(MicroBatchLoader(dataset(text_data, transform=loader_utils.many_kinds), num_workers=2))
    assert len(got) == len(expected) > 0
    assert expected[0]["big"].numel() * 8 > 1 << 20  # one column travels in shared memory
    for x, y in zip(got, expected, strict=True):
        assert x.keys() == y.keys()
        for k, v in y.items():
            assert type(x[k]) is type(v), k
            if isinstance(v, torch.Tensor):
                assert x[k].dtype == v.dtype and torch.equal(x[k], v), k
            else:
                assert (x[k] == v).all() if k == "np" else x[k] == v, k


def test_transform_that_raises_in_a_worker_names_the_micro_batch_and_shard(text_data):
    ds = dataset(text_data, transform=loader_utils.raise_on_bad_shard)
    with pytest.raises(DataWorkerError) as err:
        read(MicroBatchLoader(ds, num_workers=2))
    msg = str(err.value)
    assert "ValueError: cannot transform a row of shard 3" in msg
    m = int(msg.split("micro-batch ")[1].split()[0])
    assert loader_utils.BAD_SHARD in ds.micro_batch_shards(m)
    assert f"shards {ds.micro_batch_shards(m)}" in msg
    assert ds.micro == m  # every micro-batch before the failing one was handed over, none after
    assert "\n" not in msg


def test_worker_killed_is_an_error_not_a_hang(text_data):
    ds = dataset(text_data, transform=loader_utils.die_on_bad_shard)
    start = time.monotonic()
    with pytest.raises(DataWorkerError, match=r"data worker died reading micro-batch \d+ of epoch 0 \(rank 1, shards"):
        read(MicroBatchLoader(ds, num_workers=2))
    assert time.monotonic() - start < 120  # the liveness check notices within seconds; the test's own guard


def test_bad_settings_are_refused(text_data):
    with pytest.raises(UserError, match=r"data\.num_workers"):
        MicroBatchLoader(dataset(text_data), num_workers=-1)
    with pytest.raises(UserError, match=r"data\.prefetch"):
        MicroBatchLoader(dataset(text_data), prefetch=0)


def train_args(data: Path, *extra: str, steps: int = 6) -> list[str]:
    return sets(*TINY, f"data.path={data}", f"run.max_steps={steps}", "run.log_every=1", *extra)


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def train(run_dir: Path, data: Path, *extra: str) -> list[float]:
    """One rank, in this process (its workers are this process's children, as a run's are its own)."""
    proc = run_cli("train", "--run-dir", str(run_dir), *train_args(data, *extra), PYTHONPATH=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(run_dir)


def test_losses_identical_for_0_1_3_workers_with_a_transform(tmp_path, text_data):
    t = "data.transform=tests.loader_utils:reverse"
    base = train(tmp_path / "w0", text_data, t, "data.num_workers=0")
    assert len(base) == 6
    assert train(tmp_path / "w1", text_data, t, "data.num_workers=1") == base
    assert train(tmp_path / "w3", text_data, t, "data.num_workers=3", "data.prefetch=5") == base
    assert train(tmp_path / "plain", text_data, "data.num_workers=0") != base  # the transform is applied


@pytest.mark.distributed
def test_losses_identical_for_workers_on_two_ranks(tmp_path, text_data):
    t = "data.transform=tests.loader_utils:reverse"
    runs = {n: tmp_path / f"w{n}" for n in (0, 3)}
    commands = [["train", "--run-dir", runs[n], *train_args(text_data, t, f"data.num_workers={n}")] for n in runs]
    for ranks in cli_on_ranks(tmp_path, commands, PYTHONPATH=str(REPO)):
        assert all(p.returncode == 0 for p in ranks), ranks[0].stderr[-3000:]
    base = losses(runs[0])
    assert len(base) == 6
    assert losses(runs[3]) == base


def test_transform_spec_that_does_not_import_is_one_line(tmp_path, text_data):
    args = sets(*TINY, f"data.path={text_data}", "run.max_steps=2", "data.transform=tests.nowhere:fn")
    proc = run_cli("train", "--run-dir", str(tmp_path / "r"), *args, PYTHONPATH=str(REPO))
    assert proc.returncode == 2
    assert "data.transform='tests.nowhere:fn': cannot import 'tests.nowhere'" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_training_stops_with_one_line_when_a_worker_raises(tmp_path, text_data):
    args = sets(*TINY, f"data.path={text_data}", "run.max_steps=40", "data.num_workers=2")
    args += sets("data.transform=tests.loader_utils:raise_on_bad_shard")
    proc = run_cli("train", "--run-dir", str(tmp_path / "r"), *args, PYTHONPATH=str(REPO))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data worker") and "shards [" in last and "ValueError" in last
