"""Load-time policies through ShardedDataset: raise names the example, drop and clamp count."""

from __future__ import annotations

import math

import pytest

from steadytrain.data import DatasetWriter, SchemaViolationError, ShardedDataset, infer_schema, open_dataset


@pytest.fixture
def path(tmp_path):
    with DatasetWriter(tmp_path / "ds") as w:
        for s in range(3):
            rows = [{"value": float(i), "lang": ["en", "de"][i % 2]} for i in range(10)]
            if s == 2:
                rows[3]["value"] = 100.0  # out of range: clampable
                rows[6]["value"] = math.nan  # non-finite: not clampable
                rows[7]["lang"] = "fr-CA"  # unexpected category: not clampable
            w.write_shard(rows)
    return tmp_path / "ds"


@pytest.fixture
def schema(path):
    return infer_schema(open_dataset(path), shards=[0, 1])


def test_raise_names_shard_example_field_value(path, schema):
    ds = ShardedDataset(path, shards=[2], schema=schema, policy="raise", shuffle=False)
    with pytest.raises(SchemaViolationError, match=r"shard 2, example \d+: field '(value|lang)'") as err:
        list(ds)
    assert err.value.shard == 2 and err.value.example in (3, 6, 7)


def test_drop_skips_and_counts(path, schema):
    ds = ShardedDataset(path, schema=schema, policy="drop", shuffle=False)
    seen = {(e["shard"], e["index"]) for e in ds}
    assert seen == {(s, i) for s in range(3) for i in range(10)} - {(2, 3), (2, 6), (2, 7)}
    assert ds.counts.dropped == 3 and ds.counts.clamped == 0


def test_clamp_clamps_what_it_can_and_drops_the_rest(path, schema):
    ds = ShardedDataset(path, shards=[2], schema=schema, policy="clamp", shuffle=False)
    examples = {e["index"]: e for e in ds}
    assert set(examples) == set(range(10)) - {6, 7}
    assert examples[3]["value"] == 9.0  # clamped to the inferred max
    assert ds.counts.clamped == 1 and ds.counts.dropped == 2


def test_counts_survive_a_checkpoint(path, schema):
    ds = ShardedDataset(path, schema=schema, policy="drop", shuffle=False)
    list(ds)
    again = ShardedDataset(path, schema=schema, policy="drop", shuffle=False)
    again.load_state_dict(ds.state_dict())
    assert again.counts.dropped == 3
