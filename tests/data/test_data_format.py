"""Sharded datasets: round trip, atomic writes, corruption, rank assignment, resume."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest
import torch

from steadytrain.data import (
    CorruptShardError,
    DatasetError,
    DatasetWriter,
    ShardedDataset,
    assign_shards,
    collate_examples,
    open_dataset,
)
from steadytrain.data import format as fmt


def records(shard: int, n: int) -> list[dict]:
    return [{"x": float(shard * 1000 + i), "label": f"c{i % 3}", "vec": [float(i), float(-i)]} for i in range(n)]


@pytest.fixture
def dataset(tmp_path):
    """7 shards of unequal sizes; shard 5 from a newer pipeline."""
    path = tmp_path / "ds"
    with DatasetWriter(path, provenance={"pipeline_version": "1.0", "schema_version": 3, "source": "crawl"}) as w:
        for s in range(7):
            extra = {"pipeline_version": "1.1", "schema_version": 4} if s == 5 else {}
            w.write_shard(records(s, 5 + s), provenance=extra)
    return path


def test_round_trip_and_provenance(dataset):
    ds = open_dataset(dataset)
    assert ds.shard_ids == list(range(7))
    assert ds.num_records == sum(5 + s for s in range(7))
    assert ds.read_shard(3).to_pylist() == records(3, 8)
    assert ds.shards[5].provenance["pipeline_version"] == "1.1"
    assert ds.shards[4].provenance == {**ds.shards[4].provenance, "pipeline_version": "1.0", "source": "crawl"}
    assert "created_at" in ds.shards[0].provenance
    ds.verify()
    assert ds.orphans == []


def test_table_input_and_explicit_ids(tmp_path):
    with DatasetWriter(tmp_path) as w:
        w.write_shard(pa.table({"a": [1, 2, 3]}), shard_id=47)
        with pytest.raises(DatasetError, match="exists already"):
            w.write_shard(pa.table({"a": [4]}), shard_id=47)
        assert w.write_shard(pa.table({"a": [5]})).id == 48
    with pytest.raises(DatasetError, match="non-empty"):
        DatasetWriter(tmp_path).write_shard([])


def test_crash_between_shard_and_index_keeps_previous_state(dataset, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("simulated crash before the index was replaced")

    monkeypatch.setattr(fmt, "write_text_atomic", crash)
    with pytest.raises(OSError, match="simulated"), DatasetWriter(dataset) as w:
        w.write_shard(records(7, 4))
    ds = open_dataset(dataset)  # the previous index still opens
    assert ds.shard_ids == list(range(7))
    ds.verify()
    assert ds.orphans == ["shard-00007.parquet"]  # the partial state is detectable


def _writer_child(path: str) -> None:
    with DatasetWriter(path) as w:
        for s in itertools.count():
            w.write_shard(pa.table({"x": list(range(20_000))}), shard_id=s)


def test_sigkill_mid_write_leaves_a_loadable_dataset(tmp_path):
    code = f"from tests.data.test_data_format import _writer_child; _writer_child({str(tmp_path / 'ds')!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd())
    index = tmp_path / "ds" / fmt.INDEX
    deadline = time.time() + 60
    while time.time() < deadline and not (index.exists() and len(open_dataset(tmp_path / "ds").shards) >= 3):
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    ds = open_dataset(tmp_path / "ds")
    assert len(ds.shards) >= 3
    ds.verify()  # every shard the index lists is whole
    for name in ds.orphans:  # only what was in flight: a temporary shard or index, or the next shard
        assert name.startswith((".shard-", ".index.json.")) or name == fmt.shard_file(len(ds.shards))


def test_corruption_detected_and_named(dataset):
    ds = open_dataset(dataset)
    path = dataset / ds.shard(2).file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="shard 2") as err:
        ds.verify()
    assert err.value.shard == 2
    truncated = dataset / ds.shard(4).file
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(CorruptShardError, match=r"shard 4.*truncated"):
        open_dataset(dataset).verify_shard(4)
    with pytest.raises(CorruptShardError, match="shard 2"):
        list(ShardedDataset(dataset, shuffle=False))
    sd = ShardedDataset(dataset, shuffle=False, skip_corrupt=True)
    with pytest.warns(UserWarning, match="skipping corrupt shard"):
        seen = {(e["shard"], e["index"]) for e in sd}
    assert sorted(sd.skipped_shards) == [2, 4]
    assert {s for s, _ in seen} == {0, 1, 3, 5, 6}


def test_not_a_dataset(tmp_path):
    with pytest.raises(DatasetError, match=r"no index\.json"):
        open_dataset(tmp_path)
    (tmp_path / "index.json").write_text('{"format": "steadytrain-shards", "shards": [{"id": 0}]}')
    with pytest.raises(DatasetError, match=r"shards\[0\] lacks"):
        open_dataset(tmp_path)


@pytest.mark.parametrize("world_size", [2, 3])
def test_assignment_deterministic_disjoint_complete(dataset, world_size):
    ids = open_dataset(dataset).shard_ids
    orders = []
    for epoch in range(4):
        per_rank = [
            assign_shards(ids, rank=r, world_size=world_size, epoch=epoch, seed=5, shuffle=True)
            for r in range(world_size)
        ]
        again = [
            assign_shards(ids, rank=r, world_size=world_size, epoch=epoch, seed=5, shuffle=True)
            for r in range(world_size)
        ]
        assert per_rank == again  # deterministic
        flat = [s for r in per_rank for s in r]
        assert sorted(flat) == ids and len(set(flat)) == len(flat)  # complete and disjoint
        orders.append(per_rank)
    assert len({str(o) for o in orders}) > 1  # the order changes between epochs


@pytest.mark.parametrize("world_size", [2, 3])
def test_examples_disjoint_and_complete_across_ranks(dataset, world_size):
    seen = []
    for r in range(world_size):
        seen += [(e["shard"], e["index"]) for e in ShardedDataset(dataset, rank=r, world_size=world_size, seed=1)]
    expected = [(s, i) for s in range(7) for i in range(5 + s)]
    assert sorted(seen) == expected


def test_examples_carry_their_shard_and_index(dataset):
    for e in ShardedDataset(dataset, seed=3):
        assert e["x"] == e["shard"] * 1000 + e["index"]


def test_epoch_changes_order_and_is_reproducible(dataset):
    a = ShardedDataset(dataset, seed=1)
    first = [(e["shard"], e["index"]) for e in a]
    a.set_epoch(1)
    second = [(e["shard"], e["index"]) for e in a]
    assert sorted(first) == sorted(second) and first != second
    b = ShardedDataset(dataset, seed=1, epoch=1)
    assert [(e["shard"], e["index"]) for e in b] == second


@pytest.mark.parametrize("stop", [0, 3, 7, 20, 48])
def test_resume_mid_epoch_yields_exactly_the_rest(dataset, stop):
    full = [(e["shard"], e["index"]) for e in ShardedDataset(dataset, rank=1, world_size=2, seed=9)]
    ds = ShardedDataset(dataset, rank=1, world_size=2, seed=9)
    it = iter(ds)
    head = [(e["shard"], e["index"]) for e in itertools.islice(it, stop)]
    state = ds.state_dict()
    resumed = ShardedDataset(dataset, rank=1, world_size=2, seed=9)
    resumed.load_state_dict(state)
    tail = [(e["shard"], e["index"]) for e in resumed]
    assert head + tail == full


def test_restrict_to_one_shard(dataset):
    ds = ShardedDataset(dataset, shards=[5], shuffle=False)
    assert [e["index"] for e in ds] == list(range(10))
    with pytest.raises(DatasetError, match="47"):
        ShardedDataset(dataset, shards=[47])


def test_dataloader_workers_split_the_ranks_shards(dataset):
    ds = ShardedDataset(dataset, rank=0, world_size=2, seed=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_examples)
    seen = []
    for batch in loader:
        assert batch["x"].is_floating_point() and batch["vec"].shape[1] == 2
        seen += list(zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True))
    expected = sorted((s, i) for s in ds.rank_shards() for i in range(5 + s))
    assert sorted(seen) == expected and len(seen) == len(ds)


@pytest.mark.parametrize(("kwargs", "word"), [({"rank": 2, "world_size": 2}, "rank"), ({"policy": "fix"}, "policy")])
def test_bad_arguments(dataset, kwargs, word):
    with pytest.raises(ValueError, match=word):
        ShardedDataset(dataset, **kwargs)
