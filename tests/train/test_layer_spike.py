"""Where a spike starts, and a layer that never learns: planted in a user model, found from ``layers.jsonl``.

The planted cause: a ``gain`` field that is 1 on every row but those of one shard (400 there), which scales an
input that reaches block 1 alone (detached from the layers before it, without block 1's bias: exactly nothing
for the other rows). At the step that reads that shard the loss spikes and the gradient enters through
``blocks.1``: ``spikes report`` must name it first. The same model has a layer that is built but never used: the
run's summary must say that it received no gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from steadytrain.data import DatasetWriter
from steadytrain.diagnose.spikedemo import bad_shard_at
from tests.cli_utils import in_process
from tests.train_utils import metrics, train

_MODEL = '''
import torch
import torch.nn.functional as F


class Gained(torch.nn.Module):
    """A byte LM of three blocks; a row's ``gain`` above 1 adds a term that reaches block 1 alone."""

    def __init__(self, dim=16):
        super().__init__()
        self.emb = torch.nn.Embedding(256, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(3))
        self.head = torch.nn.Linear(dim, 256)
        self.spare = torch.nn.Linear(dim, dim)  # built, never used: a layer disconnected by mistake

    def forward(self, batch):
        tokens = batch["tokens"].long()
        h0 = self.blocks[0](self.emb(tokens[:, :-1]))
        h = self.blocks[2](torch.tanh(self.blocks[1](torch.tanh(h0))))
        losses = F.cross_entropy(self.head(h).transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)
        extra = batch["gain"].float().view(-1, 1, 1) - 1.0  # 0 on every healthy row
        planted = F.linear(h0.detach() * extra, self.blocks[1].weight).square().mean((1, 2))
        return losses + planted


def factory(**kw):
    return Gained(**kw)
'''

SHARDS, ROWS = 24, 8
POSITION = 11
"""The shard read 12th: with shuffle window 1 and shards of half a global batch, in the batch of step 6."""


def _dataset(path, bad: int):
    src = b"".join(p.read_bytes() for p in sorted(Path(__file__).parents[2].glob("src/**/*.py")))
    seqs = np.frombuffer(src, dtype=np.uint8)[: 33 * SHARDS * ROWS].reshape(-1, 33)
    with DatasetWriter(path, provenance={"source": "steadytrain-src"}) as w:
        for s in range(SHARDS):
            part = seqs[s * ROWS : (s + 1) * ROWS]
            gain = np.full(ROWS, 400.0 if s == bad else 1.0)
            tokens = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), 33)
            w.write_shard(pa.table({"tokens": tokens, "gain": pa.array(gain)}))
    return path


def test_a_spike_entering_through_block_1_is_named_there_and_a_disconnected_layer_in_the_summary(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "gained.py").write_text(_MODEL)
    bad = bad_shard_at(POSITION, SHARDS)
    data = _dataset(tmp_path / "data", bad)
    run = tmp_path / "run"
    items = [
        "model.name=gained:factory", f"data.path={data}", "data.seq_len=32", "data.shuffle_window=1",
        "batch.micro_batch_size=8", "batch.global_batch_size=16", "batch.base_batch_size=16", "batch.base_lr=0.01",
        "batch.warmup_steps=0", "run.max_steps=10", "run.log_every=1", "spike.policy=skip", "spike.window=4",
        "eval.holdout_fraction=null", "checkpoint.every_steps=100",
    ]  # fmt: skip
    train(run, *items, PYTHONPATH=str(pkg))
    spikes = [r["step"] for r in metrics(run) if r.get("spike")]
    assert spikes == [POSITION // 2 + 1], metrics(run)

    got = in_process("spikes", "report", str(run), "--json")
    assert got.returncode == 0, got.stderr
    rep = json.loads(got.stdout)
    (found,) = rep["layers"]
    assert found["step"] == spikes[0] and found["first_layer"] == "blocks.1", found
    assert "blocks.1" in rep["sentence"]
    assert "spare" in (run / "summary.md").read_text()  # no gradient, ever: said in the summary
    layers = json.loads(in_process("layers", str(run), "--step", str(spikes[0]), "--json").stdout)
    assert [r["layer"] for r in layers["layers"]] == ["emb", "blocks.0", "blocks.1", "blocks.2", "head", "spare"]
    assert all(r["update_norm"] is None for r in layers["layers"])  # the spike was skipped: no update
