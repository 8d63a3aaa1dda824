"""Every rank captures; rank 0 gathers and names the rank whose host differs."""

from __future__ import annotations

import pytest

from steadytrain.env import capture, compare_ranks, gather_manifests
from tests.dist_utils import load_all, save, spawn

pytestmark = pytest.mark.distributed


def gather_worker(rank, world_size, out):
    manifest = capture()
    if rank == 1:  # this "node" got a driver upgrade the image knows nothing about
        manifest.host["nvidia_driver"] = "550.90.07"
    gathered = gather_manifests(manifest)
    report = compare_ranks(gathered) if gathered is not None else None
    save(out, rank, {"n": None if gathered is None else len(gathered), "report": report})


def test_gathered_per_rank_diff(tmp_path):
    spawn(gather_worker, 2, tmp_path)
    r0, r1 = load_all(tmp_path, 2)
    assert r1["n"] is None and r0["n"] == 2
    assert list(r0["report"]) == [1]
    (d,) = r0["report"][1]
    assert (d.path, d.scope, d.b) == ("host.nvidia_driver", "host", "550.90.07")
