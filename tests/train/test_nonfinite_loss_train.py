"""``steadytrain train`` refuses a step whose loss is non-finite even when its gradients are finite.

The cause is planted in the data, as users meet it: byte 0 pads, the model's per-example loss is the mean over its
non-padding targets, and three examples of shard 2 are all padding. Their loss is 0/0 = NaN with zero gradients
(what ``F.cross_entropy`` over only ``ignore_index`` targets gives), so the global gradient norm stays finite. The
oracle for which steps must be refused is the data layer's own replay of each step's examples (``global_batch``).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from steadytrain.data import global_batch
from steadytrain.diagnose.ledger import read_ledger
from tests.cli_utils import in_process
from tests.train_utils import bigram_module, metrics, train, user_package, write_text_dataset

PADDED = bigram_module(
    doc="A bigram LM whose per-example loss is the mean over its non-padding targets (byte 0 pads).",
    after="""
    targets = tokens[:, 1:]
    per = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=0)
    losses = per.sum(1) / (targets != 0).sum(1)  # an all-padding example: 0 / 0
    """,
)
PADS = {(2, 0), (2, 1), (2, 2)}
STEPS, GLOBAL = 20, 16
COMMON = (
    "model.name=padded:factory", "data.seq_len=32", "batch.micro_batch_size=4", f"batch.global_batch_size={GLOBAL}",
    "batch.base_batch_size=16", "eval.holdout_fraction=null", f"run.max_steps={STEPS}", "run.log_every=1",
    "checkpoint.every_steps=1", f"checkpoint.keep_last={STEPS}",
)  # fmt: skip


def _pad(shard: int, rows: np.ndarray) -> None:
    """Shard 2's first 3 examples all padding; no byte 0 anywhere else (the padding must be theirs alone)."""
    rows[rows == 0] = 32
    if shard == 2:
        rows[:3] = 0


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("padded")
    pkg = user_package(root, padded=PADDED)
    data = write_text_dataset(root / "data", [20] * 4, plant=_pad)  # 4 shards of 20
    run = root / "run"
    train(run, *COMMON, f"data.path={data}", PYTHONPATH=str(pkg))
    # Which steps held a padding example, from the data layer alone (metrics' step s is global step s - 1).
    held = {
        s for s in range(1, STEPS + 1)
        if PADS & set(zip(*(global_batch(data, s - 1, global_batch_size=GLOBAL, seed=0)[k].tolist()
                            for k in ("shard", "index")), strict=True))
    }  # fmt: skip
    assert held and len(held) < STEPS, held  # some steps hold one, some do not: the test can tell them apart
    return SimpleNamespace(run=run, pkg=str(pkg), data=data, held=held)


def test_every_step_holding_an_all_padding_example_is_refused_and_no_other(padded):
    rows = metrics(padded.run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["step"] for r in rows if r["skipped"]} == padded.held
    # the refused steps left the weights as they were: every later step's loss and norm stay finite
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows if not r["skipped"])


def test_the_ledger_records_the_loss_as_the_reason_and_the_examples_in_play(padded):
    ledger = read_ledger(padded.run)
    assert {s for s, _ in ledger} == padded.held
    for step, event in ledger:
        assert event.reason == "nonfinite_loss" and math.isfinite(event.grad_norm)
        assert event.nonfinite_micro_batches, (step, event)
        in_play = {(s, i) for tag in event.tags for s, i in zip(tag["shard"], tag["index"], strict=True)}
        assert in_play & PADS, (step, in_play)


def test_nan_report_names_the_padded_shard(padded):
    got = in_process("nan", "report", str(padded.run))
    assert got.returncode == 0, got.stderr
    assert "shard-selective" in got.stdout and "shard 2" in got.stdout, got.stdout
    summary = (padded.run / "summary.md").read_text()
    assert f"| skipped (non-finite) steps | {len(padded.held)} |" in summary, summary


def test_raise_policy_stops_at_the_first_such_step(padded, tmp_path):
    run = tmp_path / "run"
    got = train(run, *COMMON, f"data.path={padded.data}", "nonfinite.policy=raise", code=1, PYTHONPATH=padded.pkg)
    first = min(padded.held)
    assert f"non-finite step {first}" in got.stderr, got.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == first and rows[-1]["skipped"]


def test_triage_replays_the_step_and_says_data(padded):
    """The replay of a refused step from the checkpoint before it: NaN with the padded examples, finite without."""
    step = min(s for s in padded.held if s > 1)  # a checkpoint before it
    got = in_process("triage", str(padded.run), "--step", str(step), "--json", PYTHONPATH=padded.pkg)
    assert got.returncode == 0, got.stderr
    found = json.loads(got.stdout)
    assert found["verdict"] == "data", found
