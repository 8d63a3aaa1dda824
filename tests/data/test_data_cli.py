"""``steadytrain data`` as a user runs it, on the seed's story: one shard from a newer pipeline.

The commands run in this process (:func:`tests.cli_utils.in_process`); one test launches the installed command,
its exit code and output as a process (tests/cli/test_cli.py launches no ``data`` command).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from steadytrain.data import DatasetWriter, open_dataset
from steadytrain.data.provenance import majority_provenance, provenance_differences, provenance_outliers
from tests.cli_utils import in_process, launched

VOCAB = ["en", "de", "fr"]


def run(*args: str) -> subprocess.CompletedProcess:
    """``steadytrain data ARGS`` in this process."""
    return in_process("data", *args)


@pytest.fixture(scope="module")
def drifted(tmp_path_factory) -> Path:
    """8 shards; shard 5 came from pipeline 2.1 / schema 4 and has an out-of-vocabulary category."""
    path = tmp_path_factory.mktemp("data") / "ds"
    with DatasetWriter(path, provenance={"pipeline_version": "2.0", "schema_version": 3, "source": "s3://logs"}) as w:
        for s in range(8):
            rows = [{"category": VOCAB[i % 3], "value": float(i % 7)} for i in range(30)]
            prov = {}
            if s == 5:
                rows[12]["category"] = "pt-BR"
                rows[20]["category"] = "pt-BR"
                prov = {"pipeline_version": "2.1", "schema_version": 4}
            w.write_shard(rows, provenance=prov)
    return path


def test_provenance_functions_name_the_odd_shard(drifted):
    ds = open_dataset(drifted)
    assert majority_provenance(ds) == {"pipeline_version": "2.0", "schema_version": 3, "source": "s3://logs"}
    assert provenance_differences(ds, 5) == {"pipeline_version": ("2.1", "2.0"), "schema_version": (4, 3)}
    assert provenance_differences(ds, 4) == {}
    assert list(provenance_outliers(ds)) == [5]


def test_provenance_cli(drifted):
    result = run("provenance", str(drifted), "--shard", "5")
    assert result.returncode == 0, result.stderr
    assert "pipeline_version" in result.stdout and "2.1" in result.stdout and "schema_version" in result.stdout
    table = run("provenance", str(drifted))
    assert table.returncode == 0 and "unlike the majority: 5" in table.stdout
    assert run("provenance", str(drifted), "--shard", "99").returncode == 2


def test_validate_without_schema_infers_from_the_majority(drifted):
    result = launched("data", "validate", str(drifted), timeout=120)  # the installed command, as its own process
    assert result.returncode == 1, result.stdout + result.stderr
    assert "violations in 1 shard(s): 5" in result.stdout
    assert "unexpected_category" in result.stdout and "12, 20" in result.stdout


def test_infer_schema_then_validate(drifted, tmp_path):
    schema = tmp_path / "schema.yaml"
    result = run("infer-schema", str(drifted), "--shards", "0-4", "-o", str(schema))
    assert result.returncode == 0, result.stderr
    assert run("validate", str(drifted), "--schema", str(schema), "--shards", "0-4,6").returncode == 0
    assert run("validate", str(drifted), "--schema", str(schema)).returncode == 1
    assert run("infer-schema", str(drifted), "--shards", "zero", "-o", str(schema)).returncode == 2


def test_verify_cli(drifted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(drifted, copy)
    assert run("verify", str(copy)).returncode == 0
    shard = copy / open_dataset(copy).shard(3).file
    shard.write_bytes(shard.read_bytes()[:-10])
    result = run("verify", str(copy))
    assert result.returncode == 1 and "shard 3" in result.stdout
    assert run("verify", str(tmp_path)).returncode == 2  # not a dataset: one line, exit 2


def test_verify_reads_every_shard_even_when_the_checksums_were_recomputed(drifted, tmp_path, cli):
    import hashlib
    import json

    import pyarrow.parquet as pq

    from steadytrain.data import CorruptShardError

    copy = tmp_path / "copy"
    shutil.copytree(drifted, copy)
    files = {s.id: copy / s.file for s in open_dataset(copy).shards}
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # truncated: no footer
    garbled = bytearray(files[4].read_bytes())
    garbled[4:200] = b"\xab" * 196  # the first column chunk garbled, the footer intact
    files[4].write_bytes(bytes(garbled))
    pq.write_table(pq.read_table(files[6]).slice(1), files[6])  # good Parquet, one record short of the index's 30
    index = json.loads((copy / "index.json").read_text())
    for entry in index["shards"]:  # the index made to agree with the damaged files, as a careless "repair" would
        data = files[entry["id"]].read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (copy / "index.json").write_text(json.dumps(index))
    open_dataset(copy).verify()  # the checksums alone agree
    r = cli("data", "verify", copy)
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [line for line in r.stdout.splitlines() if line.startswith("corrupt: ")]
    assert [line.split()[2] for line in bad] == ["1:", "4:", "6:"], r.stdout
    assert "not readable Parquet" in bad[0] and "not readable Parquet" in bad[1]
    assert "holds 29 records, the index says 30" in bad[2]
    assert "5/8 shards verified" in r.stdout
    for sid in (0, 2, 3, 5, 7):  # the others read whole, as pyarrow reads them
        assert pq.read_table(files[sid]).num_rows == open_dataset(copy).shard(sid).records == 30
    with pytest.raises(CorruptShardError, match="shard 1: "):
        open_dataset(copy).verify(decode=True)
