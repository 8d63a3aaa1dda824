"""A faulty device on 2 gloo ranks: rank 1's model returns NaN at chosen steps whatever the data, so
``nan report`` must say ``rank-selective`` and name rank 1 and its host; the clean run of the same config has no
verdict to give.

The oracle is the planted cause: the test's model decides the NaN from the rank and the step, never the data
(:mod:`tests.planted`: the runs are shared with other modules' planted-cause tests).
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.cli_utils import in_process


@pytest.mark.distributed
def test_a_faulty_device_is_rank_selective_and_a_clean_run_has_no_verdict(planted):
    faulty, clean, pkg = planted.runs["faulty"], planted.runs["clean"], str(planted.pkg)
    for name in ("faulty", "clean"):
        assert all(p.returncode == 0 for p in planted.results[name]), planted.results[name][0].stderr[-3000:]

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
    tri = in_process("triage", str(faulty), "--step", "3", "--json", PYTHONPATH=pkg)
    assert tri.returncode == 0, tri.stderr
    found = json.loads(tri.stdout)
    assert found["verdict"] == "not-reproducible" and found["rank"] == [1], found
    assert found["host"] == [socket.gethostname()] and "older" not in found["note"]
    replays = {r["variant"]: r for r in found["replays"]}
    assert replays["recorded"]["finite"] and replays["repeat"]["bitwise_equal"] is True
    assert replays["recorded"]["loss"] == replays["repeat"]["loss"]
    calm = json.loads(in_process("triage", str(clean), "--step", "3", "--json", PYTHONPATH=pkg).stdout)
    assert calm["verdict"] == "none" and calm["replays"] == []  # nothing refused there: no false verdict
    bad = in_process("triage", str(faulty), "--step", "0", PYTHONPATH=pkg)
    assert bad.returncode == 2 and "--step 0" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
