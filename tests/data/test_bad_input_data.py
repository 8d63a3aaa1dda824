"""Bad input to ``steadytrain.data`` and ``steadytrain data``, by class: concurrent writers, writes that
cannot be stored, index entries that leave the dataset, malformed indexes, silent training-data errors
(reserved columns, duplicate shards, foreign resume states), hostile schemas and vocabularies, and data
values printed to a terminal. Every case: the right error type naming file/entry/field, nothing lost,
nothing partial written; on the command line one line on stderr and exit 2."""

from __future__ import annotations

import datetime
import hashlib
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steadytrain.data import (
    DatasetError,
    DatasetWriter,
    FieldSpec,
    Schema,
    SchemaError,
    ShardedDataset,
    healthy_shards,
    open_dataset,
    validate,
)
from steadytrain.data.index import INDEX
from steadytrain.errors import UserError
from tests.cli_utils import assert_user_error, in_process


def run(*args: str) -> subprocess.CompletedProcess:
    """``steadytrain data ARGS`` in this process (tests/data/test_data_cli.py launches the command itself)."""
    return in_process("data", *args)


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (the lock file aside: it holds nothing)."""
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "index.json.lock"
    }


def small_dataset(path: Path, shards: int = 3, rows: int = 4) -> Path:
    with DatasetWriter(path, provenance={"pipeline_version": "1.0"}) as w:
        for s in range(shards):
            w.write_shard([{"x": float(s * 100 + i), "lang": "en"} for i in range(rows)])
    return path


def edit_index(path: Path, change) -> None:
    """Apply ``change(index_dict)`` to the dataset's index.json in place, as a careless hand edit would."""
    index = json.loads((path / INDEX).read_text())
    change(index)
    (path / INDEX).write_text(json.dumps(index))


def add_raw_shard(path: Path, table: pa.Table, shard_id: int) -> None:
    """A shard written by another tool: the Parquet file plus a correct index entry."""
    name = f"shard-{shard_id:05d}.parquet"
    pq.write_table(table, path / name)
    data = (path / name).read_bytes()
    entry = {
        "id": shard_id,
        "file": name,
        "records": table.num_rows,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "provenance": {},
    }
    edit_index(path, lambda ix: ix["shards"].append(entry))


# --- 1. concurrent writers --------------------------------------------------------------------------------


def _write_ten(path: str, writer: int, start) -> None:
    """Worker (module level for spawn): 10 shards whose rows say which writer and which shard wrote them."""
    start.wait(60)
    w = DatasetWriter(path, provenance={"writer": writer})
    for k in range(10):
        w.write_shard([{"writer": writer, "k": k, "row": i} for i in range(50)])


def contents(path: Path) -> list[tuple[int, int]]:
    ds = open_dataset(path)
    ds.verify()
    out = []
    for sid in ds.shard_ids:
        rows = ds.read_shard(sid).to_pylist()
        assert [r["row"] for r in rows] == list(range(50))
        out.append((rows[0]["writer"], rows[0]["k"]))
    return sorted(out)


def test_two_processes_ten_shards_each_keep_all_twenty(tmp_path):
    path = tmp_path / "ds"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_write_ten, args=(str(path), w, start)) for w in (0, 1)]
    for p in procs:
        p.start()
    start.set()  # both construct their writers and write at the same time
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ds = open_dataset(path)
    assert ds.shard_ids == list(range(20))
    assert contents(path) == [(w, k) for w in (0, 1) for k in range(10)]
    assert ds.orphans == []
    for s in ds.shards:  # each shard's provenance is its own writer's
        assert s.provenance["writer"] == ds.read_shard(s.id)["writer"][0].as_py()


def test_two_writers_in_one_process_interleaved(tmp_path):
    path = tmp_path / "ds"
    a, b = DatasetWriter(path), DatasetWriter(path)  # both see an empty directory
    for k in range(10):
        a.write_shard([{"writer": 0, "k": k, "row": i} for i in range(50)])
        b.write_shard([{"writer": 1, "k": k, "row": i} for i in range(50)])
    assert open_dataset(path).shard_ids == list(range(20))
    assert contents(path) == [(w, k) for w in (0, 1) for k in range(10)]


def test_an_explicit_id_another_writer_took_is_refused(tmp_path):
    a, b = DatasetWriter(tmp_path), DatasetWriter(tmp_path)
    a.write_shard([{"v": 1}], shard_id=5)
    before = snapshot(tmp_path)
    with pytest.raises(DatasetError, match="shard 5 exists already"):
        b.write_shard([{"v": 2}], shard_id=5)
    assert snapshot(tmp_path) == before
    assert open_dataset(tmp_path).read_shard(5).to_pylist() == [{"v": 1}]


def test_an_existing_shard_file_is_never_replaced(tmp_path):
    small_dataset(tmp_path, shards=1)
    orphan = tmp_path / "shard-00001.parquet"  # left by an interrupted write: not in the index
    orphan.write_bytes(b"not yet indexed")
    w = DatasetWriter(tmp_path)
    with pytest.raises(DatasetError, match=r"shard-00001\.parquet exists but is not in the index"):
        w.write_shard([{"x": 1.0, "lang": "de"}], shard_id=1)
    assert w.write_shard([{"x": 1.0, "lang": "de"}]).id == 2  # the next free id, past the orphan
    assert orphan.read_bytes() == b"not yet indexed"
    assert open_dataset(tmp_path).shard_ids == [0, 2]


SELF_CONTAINING: dict = {"pipeline_version": "1.0"}
SELF_CONTAINING["self"] = SELF_CONTAINING


@pytest.mark.parametrize(
    ("provenance", "words"),
    [
        ({"when": datetime.datetime(2024, 1, 1)}, ["provenance.when", "datetime", "JSON"]),
        ({"loss": float("nan")}, ["provenance.loss", "nan"]),
        ({"scale": float("inf")}, ["provenance.scale", "inf"]),
        ({"tags": {"a", "b"}}, ["provenance.tags", "set"]),
        ({"nested": {"deep": [1, datetime.date(2024, 1, 1)]}}, ["provenance.nested.deep[1]", "date"]),
        ({7: "seven"}, ["key 7", "not a string"]),
        (SELF_CONTAINING, ["provenance.self", "contains itself"]),
        ("v1.0", ["provenance", "mapping"]),
    ],
)
def test_a_write_that_cannot_be_stored_is_refused_before_any_file_changes(tmp_path, provenance, words):
    small_dataset(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(DatasetError) as err:
        DatasetWriter(tmp_path).write_shard([{"x": 1.0, "lang": "en"}], provenance=provenance)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(DatasetError):  # the same as the writer's defaults: refused at construction
        DatasetWriter(tmp_path, provenance=provenance)
    assert snapshot(tmp_path) == before  # no shard, no temporary file, the index byte-identical


@pytest.mark.parametrize(
    ("records", "words"),
    [
        ([{"x": 1, "index": 3}], ["'index' is reserved"]),
        (pa.table({"shard": [1, 2], "x": [1, 2]}), ["'shard' is reserved"]),
        (pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["x", "x"]), ["'x' appears twice"]),
        ([{"x": 1}, {"x": "one"}], ["not tabular"]),
        ([1, 2, 3], ["not tabular"]),
        ([], ["non-empty"]),
        ("x,y\n1,2", ["non-empty list"]),
    ],
)
def test_records_that_would_be_clobbered_or_are_not_tabular_are_refused(tmp_path, records, words):
    small_dataset(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(DatasetError) as err:
        DatasetWriter(tmp_path).write_shard(records)
    for word in words:
        assert word in str(err.value)
    assert snapshot(tmp_path) == before


def test_writer_on_a_file_or_a_malformed_index_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DatasetError, match="not a directory"):
        DatasetWriter(tmp_path / "file")
    small_dataset(tmp_path / "ds")
    edit_index(tmp_path / "ds", lambda ix: ix["shards"][1].update(records="many"))
    before = snapshot(tmp_path / "ds")
    with pytest.raises(DatasetError, match=r"shards\[1\].*'records'"):
        DatasetWriter(tmp_path / "ds")
    assert snapshot(tmp_path / "ds") == before


# --- 3. escaping the dataset directory ---------------------------------------------------------------------


SECRET_VALUE = 987_654.321
"""The outside file's content: a number no pytest temporary path holds (``pytest-42`` once matched ``42``)."""


def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.parquet"
    pq.write_table(pa.table({"x": [SECRET_VALUE], "lang": ["xx"]}), secret)
    return secret


@pytest.mark.parametrize("kind", ["dotdot", "nested-dotdot", "absolute", "symlink", "empty", "dot", "nul"])
def test_an_index_entry_outside_the_dataset_is_refused(tmp_path, kind):
    ds_path = small_dataset(tmp_path / "ds")
    secret = _outside(tmp_path)
    data = secret.read_bytes()
    file = {
        "dotdot": "../secret.parquet",
        "nested-dotdot": "sub/../../secret.parquet",
        "absolute": str(secret),
        "symlink": "link.parquet",
        "empty": "",
        "dot": ".",
        "nul": "shard\x00.parquet",
    }[kind]
    if kind == "symlink":
        (ds_path / "link.parquet").symlink_to(secret)
    sha = hashlib.sha256(data).hexdigest()
    edit_index(ds_path, lambda ix: ix["shards"][1].update(file=file, sha256=sha, bytes=len(data), records=1))
    with pytest.raises(DatasetError, match=r"shards\[1\] \(id 1\): field 'file'") as err:
        open_dataset(ds_path)
    assert "987654" not in str(err.value)  # nothing of the file outside is read into the message
    with pytest.raises(DatasetError, match=r"shards\[1\]"):
        ShardedDataset(ds_path)
    if kind in ("dotdot", "symlink"):
        assert_user_error(run("verify", str(ds_path)), "shards[1]", "file", "outside")


def test_a_shard_replaced_by_a_symlink_after_open_is_not_read(tmp_path):
    ds_path = small_dataset(tmp_path / "ds")
    secret = _outside(tmp_path)
    ds = open_dataset(ds_path)
    shard = ds_path / ds.shard(2).file
    shard.unlink()
    shard.symlink_to(secret)
    for read in (lambda: ds.verify_shard(2), lambda: ds.read_shard(2, verify=False), lambda: list(ShardedDataset(ds))):
        with pytest.raises(DatasetError, match="outside the dataset directory"):
            read()


def test_a_symlink_inside_the_dataset_is_followed(tmp_path):
    ds_path = small_dataset(tmp_path / "ds", shards=2)
    (ds_path / "sub").mkdir()
    os.replace(ds_path / "shard-00001.parquet", ds_path / "sub" / "real.parquet")
    (ds_path / "shard-00001.parquet").symlink_to(Path("sub") / "real.parquet")
    ds = open_dataset(ds_path)
    ds.verify()
    assert ds.read_shard(1)["x"].to_pylist() == [100.0, 101.0, 102.0, 103.0]


# --- 4. duplicate shards, foreign resume states, reserved columns ------------------------------------------


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda ix: ix["shards"][2].update(id=0), ["shards[2]", "id 0 is listed twice"]),
        (lambda ix: ix["shards"][2].update(file=ix["shards"][0]["file"]), ["shards[2] (id 2)", "one file per shard"]),
        (lambda ix: ix["shards"][2].update(file="./" + ix["shards"][0]["file"]), ["shards[2]", "one file per shard"]),
    ],
)
def test_duplicate_ids_or_one_file_for_two_ids_are_refused(tmp_path, change, words):
    small_dataset(tmp_path)
    edit_index(tmp_path, change)
    with pytest.raises(DatasetError) as err:
        open_dataset(tmp_path)
    for word in words:
        assert word in str(err.value)


def test_a_symlinked_second_name_for_one_shard_is_refused(tmp_path):
    small_dataset(tmp_path)
    (tmp_path / "alias.parquet").symlink_to("shard-00000.parquet")
    edit_index(tmp_path, lambda ix: ix["shards"][2].update({**ix["shards"][0], "id": 2, "file": "alias.parquet"}))
    with pytest.raises(DatasetError, match="one file per shard"):
        open_dataset(tmp_path)


def test_a_shard_with_its_own_index_or_shard_column_is_refused_when_read(tmp_path):
    small_dataset(tmp_path, shards=2)
    add_raw_shard(tmp_path, pa.table({"x": [1.0], "lang": ["en"], "index": [99]}), 2)
    with pytest.raises(DatasetError, match="shard 2 has its own column 'index'"):
        list(ShardedDataset(tmp_path, shuffle=False))


@pytest.mark.parametrize(
    ("shards", "words"),
    [([0, 0], ["0 is listed twice"]), ([], ["selects no shard"]), (["0"], ["'0' is not a shard id"]), (3, ["list"])],
)
def test_a_shard_selection_that_reads_a_shard_twice_or_nothing_is_refused(tmp_path, shards, words):
    small_dataset(tmp_path)
    with pytest.raises(DatasetError) as err:
        ShardedDataset(tmp_path, shards=shards)
    for word in words:
        assert word in str(err.value)


def test_more_ranks_than_shards_is_refused_on_every_rank_naming_the_counts_and_the_fix(tmp_path):
    # issue 47: 8 ranks over 4 shards gave ranks 4-7 no examples (a warning on those ranks only; ranks 0-3 went on
    # into a collective the empty ranks' DDP would never join)
    small_dataset(tmp_path, shards=4)
    for rank in (0, 3, 4, 7):  # a rank with shards refuses too: it would wait for the empty ones
        with pytest.raises(UserError) as err:
            ShardedDataset(tmp_path, rank=rank, world_size=8)
        text = str(err.value)
        assert "\n" not in text
        for words in ("world_size=8", "4 shard(s)", "ranks 4-7 would get no examples", "at most 4 ranks", "batch_size"):
            assert words in text, (words, text)
    with pytest.raises(UserError, match="so rank 4 would get no examples"):
        ShardedDataset(tmp_path, rank=0, world_size=5)
    with pytest.raises(UserError, match="the 1 shard"):
        ShardedDataset(tmp_path, rank=0, world_size=2, shards=[2])
    full = ShardedDataset(tmp_path, rank=3, world_size=4)  # one shard each: every rank has examples
    assert len(list(full)) > 0
    ShardedDataset(tmp_path, rank=5, world_size=8, batch_size=1)  # the batched mode splits examples, not shards


def _state_after(path: Path, n: int, **kw) -> dict:
    ds = ShardedDataset(path, **kw)
    it = iter(ds)
    for _ in range(n):
        next(it)
    return ds.state_dict()


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"world_size": 4, "rank": 1}, "world_size 2 != 4"),
        ({"world_size": 2, "rank": 0}, "rank 1 != 0"),
        ({"world_size": 2, "rank": 1, "seed": 8}, "seed 7 != 8"),
        ({"world_size": 2, "rank": 1, "shuffle": False}, "shuffle True != False"),
        ({"world_size": 2, "rank": 1, "shards": [0, 1, 2, 3]}, "shards"),
    ],
)
def test_a_state_of_other_ranks_or_order_is_refused(tmp_path, kw, word):
    small_dataset(tmp_path, shards=5)
    state = _state_after(tmp_path, 3, world_size=2, rank=1, seed=7)
    other = ShardedDataset(tmp_path, **{"seed": 7, **kw})
    with pytest.raises(UserError, match="belongs to another run") as err:
        other.load_state_dict(state)
    assert word in str(err.value)
    assert other.state_dict()["shard_pos"] == 0 and other.state_dict()["row"] == 0  # nothing was loaded


def test_a_state_of_another_dataset_is_refused(tmp_path):
    a, b = small_dataset(tmp_path / "a"), small_dataset(tmp_path / "b", rows=5)  # same ids, other data
    state = _state_after(a, 2)
    with pytest.raises(UserError, match="dataset"):
        ShardedDataset(b).load_state_dict(state)
    DatasetWriter(a).write_shard([{"x": 0.5, "lang": "en"}])  # shards appended: the order changes too
    with pytest.raises(UserError, match="dataset"):
        ShardedDataset(a).load_state_dict(state)
    same = ShardedDataset(a, shards=[0, 1, 2])  # the state's selection of the grown dataset: allowed
    same.load_state_dict(state)
    assert len(list(same)) == 3 * 4 - 2


@pytest.mark.parametrize(
    ("mutate", "word"),
    [
        (lambda s: s.pop("dataset"), "lacks dataset"),
        (lambda s: s.update(row=-1), "row"),
        (lambda s: s.update(epoch="1"), "epoch"),
        (lambda s: s.update(counts={"bogus": 1}), "counts"),
        (lambda s: s.update(mode="batched"), "batched"),
    ],
)
def test_a_malformed_state_is_refused(tmp_path, mutate, word):
    small_dataset(tmp_path)
    state = _state_after(tmp_path, 1)
    mutate(state)
    with pytest.raises(UserError, match=word):
        ShardedDataset(tmp_path).load_state_dict(state)
    with pytest.raises(UserError, match="mapping"):
        ShardedDataset(tmp_path).load_state_dict([1, 2])


def test_validate_reports_a_column_the_schema_does_not_know(tmp_path):
    small_dataset(tmp_path, shards=2)
    DatasetWriter(tmp_path).write_shard([{"x": 1.0, "lang": "en", "extra": i} for i in range(12)])
    schema = Schema({"x": FieldSpec("float64"), "lang": FieldSpec("string")})
    report = validate(open_dataset(tmp_path), schema)
    assert not report.ok
    assert [(v.shard, v.field, v.kind, v.count) for v in report.violations] == [(2, "extra", "unexpected_column", 12)]
    assert report.violations[0].examples == list(range(10))
    schema.save(tmp_path.parent / "schema.yaml")
    proc = run("validate", str(tmp_path), "--schema", str(tmp_path.parent / "schema.yaml"))
    assert proc.returncode == 1 and "unexpected_column" in proc.stdout and "violations in 1 shard(s): 2" in proc.stdout


def test_healthy_shards_are_those_like_the_majority(tmp_path):
    with DatasetWriter(tmp_path, provenance={"pipeline_version": "2.0", "source": "s3://logs"}) as w:
        for s in range(5):
            w.write_shard([{"x": 1.0}], provenance={"pipeline_version": "2.1"} if s in (1, 3) else {})
    assert healthy_shards(open_dataset(tmp_path)) == [0, 2, 4]
    # 'pipeline_version' majority: shards 0, 2, 4; 'source' majority ("b"): shards 1, 3 -> none matches both
    sources = ["a", "b", "c", "b", "d"]
    edit_index(tmp_path, lambda ix: [s["provenance"].update(source=sources[s["id"]]) for s in ix["shards"]])
    assert healthy_shards(open_dataset(tmp_path)) == [0, 1, 2, 3, 4]  # no shard like the majority: all


# --- 6. malformed indexes: one DatasetError naming file, entry and field ----------------------------------


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda ix: ix.update(shards=[1, 2]), ["shards[0]", "must be a mapping"]),
        (lambda ix: ix["shards"][1].update(records="many"), ["shards[1] (id 1)", "'records'", "'many'"]),
        (lambda ix: ix["shards"][1].update(provenance=None), ["shards[1] (id 1)", "'provenance'", "mapping"]),
        (lambda ix: ix["shards"][0].update(id=-1), ["shards[0]", "'id'", "-1"]),
        (lambda ix: ix["shards"][0].update(id=True), ["shards[0]", "'id'"]),
        (lambda ix: ix["shards"][0].update(bytes=1.5), ["shards[0] (id 0)", "'bytes'"]),
        (lambda ix: ix["shards"][0].update(sha256="abc"), ["shards[0] (id 0)", "'sha256'", "64"]),
        (lambda ix: ix["shards"][0].update(file=7), ["shards[0] (id 0)", "'file'"]),
        (lambda ix: ix["shards"][0].update(provenence={}), ["shards[0]", "unknown field 'provenence'"]),
        (lambda ix: ix["shards"][0].pop("sha256"), ["shards[0]", "lacks field(s) sha256"]),
        (lambda ix: ix.update(shards={"0": {}}), ["'shards' must be a list"]),
        (lambda ix: ix.update(format="parquet"), ["'format'"]),
        (lambda ix: ix.update(version=99), ["'version'", "99"]),
        (lambda ix: ix.update(provenance=[1]), ["'provenance'", "mapping"]),
    ],
)
def test_malformed_index_entries(tmp_path, change, words):
    small_dataset(tmp_path)
    edit_index(tmp_path, change)
    with pytest.raises(DatasetError) as err:
        open_dataset(tmp_path)
    msg = str(err.value)
    assert msg.startswith(str(tmp_path / INDEX)), msg
    for word in words:
        assert word in msg


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b'{"format": "steadytrain-shards", "shards": [], "x": "caf\xe9"}', ["not UTF-8"]),
        (b"", ["not valid JSON"]),
        (b'{"format": "steadytrain-shards", "shards": [{"id": NaN}]}', ["not valid JSON"]),
        (b"[1, 2]", ["'format'"]),
        (None, ["is a directory"]),
    ],
)
def test_an_unreadable_index_is_one_dataset_error(tmp_path, content, words):
    if content is None:
        (tmp_path / INDEX).mkdir()
    else:
        (tmp_path / INDEX).write_bytes(content)
    with pytest.raises(DatasetError) as err:
        open_dataset(tmp_path)
    assert str(tmp_path / INDEX) in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.fixture(scope="module")
def cli_ds(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("cli") / "ds", shards=4)


def test_cli_malformed_index_is_one_line(tmp_path):
    small_dataset(tmp_path)
    edit_index(tmp_path, lambda ix: ix["shards"][1].update(records="many"))
    for cmd in ("verify", "provenance", "validate"):
        assert_user_error(run(cmd, str(tmp_path)), "shards[1] (id 1)", "'records'")
    (tmp_path / INDEX).unlink()
    (tmp_path / INDEX).mkdir()
    assert_user_error(run("verify", str(tmp_path)), INDEX, "is a directory")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("99", ["no shard 99", "0..3"]),
        ("2-1", ["empty range"]),
        ("0-99999999999999", ["more shards than the dataset has"]),
        ("1,1", ["twice"]),
        ("x", ["'x' is not an id"]),
    ],
)
def test_cli_validate_bad_shard_selection(cli_ds, spec, words):
    assert_user_error(run("validate", str(cli_ds), "--shards", spec), *words)


def test_cli_infer_schema_refusals_write_nothing(tmp_path, cli_ds):
    drift = small_dataset(tmp_path / "drift", shards=2)
    add_raw_shard(drift, pa.table({"x": ["1.0"], "lang": ["en"]}), 2)  # x is a string in shard 2
    out = tmp_path / "out" / "schema.yaml"
    out.parent.mkdir()
    assert_user_error(run("infer-schema", str(drift), "-o", str(out)), "shard 2", "column 'x'", "'string'")
    assert_user_error(run("infer-schema", str(cli_ds), "--categorical", "x", "-o", str(out)), "'x'", "float64")
    assert_user_error(run("infer-schema", str(cli_ds), "--categorical", "nope", "-o", str(out)), "'nope'")
    assert_user_error(run("infer-schema", str(cli_ds), "--shards", "7", "-o", str(out)), "no shard 7")
    missing = tmp_path / "missing" / "schema.yaml"
    assert_user_error(run("infer-schema", str(cli_ds), "-o", str(missing)), "does not exist")
    assert list(out.parent.iterdir()) == [] and not missing.parent.exists()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('schema: "abc"\n', ["'fields'"]),
        ("- a\n- b\n", ["expected a mapping"]),
        ("fields: 3\n", ["'fields'"]),
        ("", ["expected a mapping"]),
        ("fields: {1: {dtype: int64}}\n", ["field name 1", "quote it"]),
        (b"fields: {caf\xe9: {dtype: int64}}\n", ["not UTF-8"]),
    ],
)
def test_cli_validate_with_a_bad_schema_file(tmp_path, cli_ds, text, words):
    path = tmp_path / "schema.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_user_error(run("validate", str(cli_ds), "--schema", str(path)), str(path), *words)


def test_cli_prints_data_values_verbatim(tmp_path):
    hostile = {"source": "s3://bucket/[/data]", "owner": "[bold red]x[/]", "note": "a\x1b[31mred\nRUN"}
    with DatasetWriter(tmp_path, provenance={"pipeline_version": "1"}) as w:
        for s in range(3):
            w.write_shard([{"x": 1.0}], provenance=hostile if s == 2 else {})
    table = run("provenance", str(tmp_path))
    assert table.returncode == 0, table.stderr
    one = run("provenance", str(tmp_path), "--shard", "2")
    assert one.returncode == 0, one.stderr
    for out in (table.stdout, one.stdout):
        assert "s3://bucket/[/data]" in out and "[bold red]x[/]" in out
        assert "\x1b" not in out and "a\\x1b[31mred\\nRUN" in out  # shown escaped, never sent to the terminal
    assert_user_error(run("provenance", str(tmp_path), "--shard", "99"), "no shard 99")


# --- 7. schema files and vocabulary sidecars ---------------------------------------------------------------


def test_sidecar_names_are_unique_and_stay_in_the_directory(tmp_path):
    names = ["a/b", "a?b", "a_b", "A_B", "..", "../up", "é", "x" * 300, "tok"]
    vocab = [f"v{i}" for i in range(60)]
    schema = Schema({n: FieldSpec("string", vocabulary=[f"{n}-{v}" for v in vocab]) for n in names})
    out = tmp_path / "dir"
    out.mkdir()
    schema.save(out / "s.yaml")
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == len(names) + 1  # one sidecar per field, none shared, nothing written elsewhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert len({f.casefold() for f in files}) == len(files)
    assert all(len(f.encode()) < 255 for f in files)
    assert "s.tok.vocab.txt" in files and "s.a_b.vocab.txt" in files  # plain names keep their plain sidecar
    assert Schema.load(out / "s.yaml") == schema


def test_a_file_that_is_no_vocabulary_is_not_echoed(tmp_path):
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    (tmp_path / "bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp_path / "dir").mkdir()
    for vocab, dtype, word in [
        ("passwd", "int64", "line 1"),
        ("key", "bool", "line 1"),
        ("bin", "string", "not UTF-8"),
        ("dir", "string", "is a directory"),
    ]:
        path = tmp_path / "s.yaml"
        path.write_text(f"fields: {{a: {{dtype: {dtype}, vocabulary: {vocab}}}}}\n")
        with pytest.raises(SchemaError) as err:
            Schema.load(path)
        msg = str(err.value)
        assert word in msg and "field 'a'" in msg
        assert "root:x" not in msg and "BEGIN" not in msg and "PNG" not in msg


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("fields: {a: {dtype: '" + "list<" * 400 + "int64" + ">" * 400 + "'}}\n", "is not a type name"),
        ("fields: {on: {dtype: int64}}\n", "field name True"),
        ("fields: {a: {dtype: int64, vocabulary: [1, 99999999999999999999999]}}\n", "64-bit"),
        ("fields: {a: {dtype: int64, min: [" + ", ".join(["1"] * 500) + "]}}\n", "not a finite number"),
    ],
)
def test_hostile_schema_values_are_bounded_errors(tmp_path, text, word):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SchemaError, match=word) as err:
        Schema.load(path)
    assert len(str(err.value)) < 600


def test_schema_alias_bomb_is_an_error_not_a_hang(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nfields: {}\n")
    with pytest.raises(SchemaError, match="expands to more than"):
        Schema.load(path)


# --- 8. schema limits the column's type cannot hold ---------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            "{dtype: int64, min: 1000000000000000000000000000000}",
            ["'min'", "10000000000000", "int64", "9223372036854775807"],
        ),
        ("{dtype: int64, max: -9223372036854775809}", ["'max'", "-9223372036854775809", "[-9223372036854775808, "]),
        ("{dtype: int64, min: 1.0e+19}", ["'min'", "1e+19", "int64"]),
        ("{dtype: uint8, min: -1}", ["'min'", "-1", "uint8", "[0, 255]"]),
        ("{dtype: int8, max: 1000}", ["'max'", "1000", "int8", "[-128, 127]"]),
        ("{dtype: 'list<int16>', max: 40000}", ["'max'", "40000", "int16", "[-32768, 32767]"]),
        ("{dtype: float16, max: 100000}", ["'max'", "100000", "float16", "65504.0"]),
        ("{dtype: float32, min: -1.0e+39}", ["'min'", "-1e+39", "float32", "3.4028234663852886e+38"]),
        ("{dtype: uint8, vocabulary: [1, 300]}", ["'vocabulary'", "300", "uint8", "[0, 255]"]),
        ("{dtype: 'list<uint32>', vocabulary: [-1]}", ["'vocabulary'", "-1", "uint32", "4294967295"]),
        ("{dtype: int8, vocabulary: ['1']}", ["'vocabulary'", "'1'", "not an integer"]),
        ("{dtype: string, vocabulary: [1]}", ["'vocabulary'", "1", "not a string"]),
    ],
)
def test_schema_limits_the_column_type_cannot_hold_are_refused_at_load(tmp_path, cli, cli_ds, spec, words):
    path = tmp_path / "s.yaml"
    path.write_text(f"fields: {{n: {spec}}}\n")
    with pytest.raises(SchemaError) as err:
        Schema.load(path)
    assert str(err.value).startswith(f"{path}: field 'n': "), str(err.value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert_user_error(cli("data", "validate", cli_ds, "--schema", path), str(path), "field 'n'", *words)


def test_limits_at_the_edges_of_a_type_check_every_value(tmp_path, cli):
    import numpy as np

    from steadytrain.data import apply_policy

    columns = {
        "u": ([0, 2**64 - 1, 5], pa.uint64(), "{dtype: uint64, max: 18446744073709551614}"),
        "f": ([1.0, 2e30, -3.0], pa.float64(), "{dtype: float64, max: 1000000000000000000000000000000}"),
        "h": ([0.5, 70.0, -2.0], pa.float16(), "{dtype: float16, min: -1, max: 65.5}"),
        "i": ([-128, 0, 127], pa.int8(), "{dtype: int8, min: -127, max: 127}"),
    }
    arrays = {k: pa.array(np.array(v, dtype=t.to_pandas_dtype()), t) for k, (v, t, _) in columns.items()}
    with DatasetWriter(tmp_path / "ds") as w:
        w.write_shard(pa.table(arrays))
    path = tmp_path / "s.yaml"
    path.write_text("fields:\n" + "".join(f"  {k}: {spec}\n" for k, (_, _, spec) in columns.items()))
    schema = Schema.load(path)
    bounds = {k: (s.min, s.max) for k, s in schema.fields.items()}
    expected = {  # compared in Python on the values themselves
        k: [i for i, x in enumerate(v) if (lo is not None and x < lo) or (hi is not None and x > hi)]
        for k, (v, _, _) in columns.items()
        for lo, hi in [bounds[k]]
    }
    assert expected == {"u": [1], "f": [1], "h": [1, 2], "i": [0]}
    report = validate(open_dataset(tmp_path / "ds"), schema)
    assert {v.field: v.examples for v in report.violations if v.kind == "out_of_range"} == expected
    assert len(report.violations) == 4
    r = cli("data", "validate", tmp_path / "ds", "--schema", path)
    assert r.returncode == 1 and "out_of_range" in r.stdout, r.stdout + r.stderr
    table, kept, counts = apply_policy(pa.table(arrays), schema, "clamp", shard=0)
    assert counts.clamped == 3 and kept.tolist() == [0, 1, 2]
    for k, (v, _, _) in columns.items():
        lo, hi = bounds[k]
        want = [min(max(x, lo if lo is not None else x), hi if hi is not None else x) for x in v]
        got = table.column(k).to_pylist()
        assert got == want if k in "ui" else got == pytest.approx(want, rel=1e-12), k  # integers exactly
        assert all((lo is None or x >= lo) and (hi is None or x <= hi) for x in got), k  # never outside
