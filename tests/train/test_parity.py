"""Replicas that disagree, on 2 gloo ranks under DDP: one element of one parameter flipped on rank 1 after step 10
(the test's model does it: a hook of the test, not product code) is found at the next parity check, which names
rank 1 and the tensor; with ``on_parity: stop`` the run stops with a checkpoint whose replicas agree again. The same
run without the flip never fires. The runs are :mod:`tests.planted`'s (shared with the other planted-cause tests).
"""

from __future__ import annotations

import json

import pytest
import torch

from steadytrain.train.checkpoint.catalog import latest_checkpoint, load_checkpoint
from tests.cli_utils import in_process
from tests.train_utils import metrics


@pytest.mark.distributed
def test_a_flipped_element_on_rank_1_is_named_and_a_clean_run_never_fires(planted):
    flipped, clean, warned = (planted.runs[n] for n in ("flipped", "clean", "warned"))
    stopped, calm, goes_on = (planted.results[n] for n in ("flipped", "clean", "warned"))

    assert [p.returncode for p in stopped] == [1, 1], stopped[0].stderr[-3000:]
    assert "replicas disagree at step 15: rank(s) 1" in stopped[0].stderr
    (record,) = [json.loads(x) for x in (flipped / "parity.jsonl").read_text().splitlines()]
    assert (record["step"], record["rank"], record["tie"]) == (15, 1, True)  # two replicas: rank 0 is the reference
    assert record["tensors"] == ["head.weight"] and isinstance(record["host"], str)
    assert [r["step"] for r in metrics(flipped)][-1] == 15
    state = load_checkpoint(latest_checkpoint(flipped / "checkpoints"))["model"]
    assert latest_checkpoint(flipped / "checkpoints").name == "step-00000015"
    assert torch.isfinite(state["head.weight"]).all()

    assert [p.returncode for p in calm] == [0, 0], calm[0].stderr[-3000:]
    assert not (clean / "parity.jsonl").exists() and [r["step"] for r in metrics(clean)][-1] == 12  # checked at 5, 10

    assert [p.returncode for p in goes_on] == [0, 0], goes_on[0].stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (warned / "parity.jsonl").read_text().splitlines()]
    assert steps == [15, 20]  # warned at every check, and the run went on

    listed = json.loads(in_process("ranks", str(flipped), "--json").stdout)["parity"]
    assert listed == [record]  # `steadytrain ranks` lists what parity.jsonl holds
    assert "replicas disagreed at step 15: rank 1" in in_process("ranks", str(flipped)).stdout


@pytest.mark.distributed
def test_a_damaged_parity_record_is_one_error(planted, tmp_path):
    from tests.train_utils import copy_run

    run = copy_run(planted.runs["flipped"], tmp_path / "run")
    (run / "parity.jsonl").write_text('{"step": 15, "rank": "one"}\n')
    bad = in_process("ranks", str(run))
    assert bad.returncode == 2 and "parity.jsonl:1" in bad.stderr and "Traceback" not in bad.stderr
