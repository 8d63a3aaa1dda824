"""A faulty device on 2 gloo ranks: rank 1's model returns NaN at chosen steps whatever the data, so
``nan report`` must say ``rank-selective`` and name rank 1 and its host; the clean run of the same config has no
verdict to give.

The oracle is the planted cause: the test's model decides the NaN from the rank and the step, never the data.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.cli_utils import in_process
from tests.dist_utils import cli_on_ranks
from tests.train_utils import bigram_module, sets, write_text_dataset

_FAULTY = bigram_module(
    doc="A bigram LM whose forward on rank 1 returns NaN per-example losses at the forward numbers ``faulty_at``.",
    after="""
    at = {int(x) for x in str(self.kw.get("faulty_at", "")).split(",") if x}
    if os.environ.get("RANK") == "1" and self.calls in at:
        return losses * float("nan")  # the device's fault, whatever the examples
    """,
)

ITEMS = [
    "model.name=faulty:factory",
    "data.seq_len=32",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "run.max_steps=10",
    "run.log_every=1",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=20",
]


@pytest.mark.distributed
def test_a_faulty_device_is_rank_selective_and_a_clean_run_has_no_verdict(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "faulty.py").write_text(_FAULTY)
    data = write_text_dataset(tmp_path / "data", [10] * 16)  # small shards: a micro-batch spans several
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    # rank 1's first forward of steps 3, 5, 7 and 9 (2 micro-batches per rank per step)
    commands = [
        ["train", "--run-dir", faulty, *sets(*ITEMS, f"data.path={data}", "model.faulty_at=5,9,13,17")],
        ["train", "--run-dir", clean, *sets(*ITEMS, f"data.path={data}")],
    ]
    done = cli_on_ranks(tmp_path, commands, PYTHONPATH=str(pkg))
    for command in done:
        assert all(p.returncode == 0 for p in command), command[0].stderr[-3000:]

    got = in_process("nan", "report", str(faulty), "--json")
    assert got.returncode == 0, got.stderr
    rep = json.loads(got.stdout)
    assert rep["verdict"] == "rank-selective", rep["sentence"]
    assert rep["suspect_ranks"] == [1] and rep["suspect_hosts"] == [socket.gethostname()]
    assert rep["steps"] == [3, 5, 7, 9] and rep["suspect_shards"] == []
    text = in_process("nan", "report", str(faulty)).stdout
    assert "rank-selective" in text and "rank(s) 1" in text

    calm = json.loads(in_process("nan", "report", str(clean), "--json").stdout)
    assert calm["verdict"] == "none" and calm["suspect_ranks"] == [] and calm["suspect_hosts"] == []

    # triage: the faulty step replays finite from the same weights (every step is checkpointed): the machine
    tri = in_process("triage", str(faulty), "--step", "3", "--json", PYTHONPATH=str(pkg))
    assert tri.returncode == 0, tri.stderr
    found = json.loads(tri.stdout)
    assert found["verdict"] == "not-reproducible" and found["rank"] == [1], found
    assert found["host"] == [socket.gethostname()] and "older" not in found["note"]
    replays = {r["variant"]: r for r in found["replays"]}
    assert replays["recorded"]["finite"] and replays["repeat"]["bitwise_equal"] is True
    assert replays["recorded"]["loss"] == replays["repeat"]["loss"]
    calm = json.loads(in_process("triage", str(clean), "--step", "3", "--json", PYTHONPATH=str(pkg)).stdout)
    assert calm["verdict"] == "none" and calm["replays"] == []  # nothing refused there: no false verdict
    bad = in_process("triage", str(faulty), "--step", "0", PYTHONPATH=str(pkg))
    assert bad.returncode == 2 and "--step 0" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
