"""Replicas that disagree, on 2 gloo ranks under DDP: one element of one parameter flipped on rank 1 after step 10
(the test's model does it: a hook of the test, not product code) is found at the next parity check, which names
rank 1 and the tensor; with ``on_parity: stop`` the run stops with a checkpoint whose replicas agree again. The same
run without the flip never fires.
"""

from __future__ import annotations

import json

import pytest
import torch

from steadytrain.train.checkpoint.catalog import latest_checkpoint, load_checkpoint
from tests.cli_utils import in_process
from tests.dist_utils import cli_on_ranks
from tests.train_utils import bigram_module, metrics, sets, write_text_dataset

_FLIPPING = bigram_module(
    doc="A bigram LM; on rank 1 its forward number ``flip_at`` negates one element of the head's weight.",
    hook="""
    if os.environ.get("RANK") == "1" and self.calls == int(self.kw.get("flip_at", 0)):
        with torch.no_grad():
            self.head.weight[3, 5] = -self.head.weight[3, 5] + 1.0  # a silent corruption of this replica
    """,
)

ITEMS = [
    "model.name=flipping:factory",
    "data.seq_len=32",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "run.max_steps=20",
    "run.log_every=5",
    "checkpoint.every_steps=100",
    "distributed.parity_every_steps=5",
]


@pytest.mark.distributed
def test_a_flipped_element_on_rank_1_is_named_and_a_clean_run_never_fires(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "flipping.py").write_text(_FLIPPING)
    data = write_text_dataset(tmp_path / "data", [40] * 8)
    flipped, clean, warned = tmp_path / "flipped", tmp_path / "clean", tmp_path / "warned"
    flip = "model.flip_at=21"  # rank 1's first forward of step 11 (2 micro-batches per rank per step)
    commands = [
        ["train", "--run-dir", flipped, *sets(*ITEMS, f"data.path={data}", flip)],
        ["train", "--run-dir", clean, *sets(*ITEMS, f"data.path={data}")],
        ["train", "--run-dir", warned, *sets(*ITEMS, f"data.path={data}", flip, "distributed.on_parity=warn")],
    ]
    stopped, calm, goes_on = cli_on_ranks(tmp_path, commands, PYTHONPATH=str(pkg))

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
    assert not (clean / "parity.jsonl").exists() and [r["step"] for r in metrics(clean)][-1] == 20

    assert [p.returncode for p in goes_on] == [0, 0], goes_on[0].stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (warned / "parity.jsonl").read_text().splitlines()]
    assert steps == [15, 20]  # warned at every check, and the run went on

    listed = json.loads(in_process("ranks", str(flipped), "--json").stdout)["parity"]
    assert listed == [record]  # `steadytrain ranks` lists what parity.jsonl holds
    assert "replicas disagreed at step 15: rank 1" in in_process("ranks", str(flipped)).stdout
    (flipped / "parity.jsonl").write_text('{"step": 15, "rank": "one"}\n')
    bad = in_process("ranks", str(flipped))
    assert bad.returncode == 2 and "parity.jsonl:1" in bad.stderr and "Traceback" not in bad.stderr
