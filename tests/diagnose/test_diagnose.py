"""The diagnose layer on its own: the binomial tail, the verdict on ledgers whose answer is known by
construction, the ledger's format, the module hooks and the bisection.

Oracles: exact binomial sums (fractions), ledgers built so that the bad shard (or none) is known,
toy models whose first non-finite module and bad rows are fixed by construction."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from steadytrain.accumulate import NonFiniteEvent
from steadytrain.diagnose import read_ledger, report
from steadytrain.diagnose._hooks import ROOT, Probe
from steadytrain.diagnose.hunt import _bisect
from steadytrain.diagnose.ledger import append_event, event_record
from steadytrain.diagnose.stats import binomial_sf
from steadytrain.errors import UserError


def exact_sf(k: int, n: int, p: Fraction) -> float:
    return float(sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


@pytest.mark.parametrize(
    ("k", "n", "p"), [(0, 5, "1/3"), (3, 10, "1/2"), (10, 10, "1/8"), (7, 40, "1/200"), (1, 1, "1/7")]
)
def test_binomial_tail_matches_the_exact_sum(k, n, p):
    assert binomial_sf(k, n, float(Fraction(p))) == pytest.approx(exact_sf(k, n, Fraction(p)), rel=1e-9)


def test_binomial_tail_far_in_the_tail_and_edges():
    assert binomial_sf(32, 32, 1 / 8) == pytest.approx(8.0**-32, rel=1e-9)  # below what 1 - cdf could show
    assert binomial_sf(3, 3, 0.0) == 0.0 and binomial_sf(3, 3, 1.0) == 1.0
    with pytest.raises(ValueError):
        binomial_sf(4, 3, 0.5)


# --- report on ledgers built by hand -------------------------------------------------------------


def write_run(tmp_path, steps: list[list[list[tuple[int, bool]]]], exposure: dict[int, int]):
    """``steps[s][rank]`` = the rank's examples ``(shard, bad)`` in one micro-batch; one event per rank."""
    for s, ranks in enumerate(steps, 1):
        for rank, examples in enumerate(ranks):
            flags = torch.tensor([bad for _, bad in examples])
            tag = {"shard": torch.tensor([sh for sh, _ in examples]), "index": torch.arange(len(examples)),
                   "nonfinite": flags}  # fmt: skip
            event = NonFiniteEvent(
                cycle=s - 1, rank=rank, grad_norm=math.nan, micro_steps=(s - 1, s - 1),
                nonfinite_micro_batches=(0,) if flags.any() else (), tags=(tag,),
            )  # fmt: skip
            append_event(tmp_path / "nonfinite.jsonl", event, s)
    (tmp_path / "exposure.json").write_text(json.dumps({str(k): v for k, v in exposure.items()}))


def test_a_shard_far_beyond_its_exposure_is_shard_selective(tmp_path):
    rng = random.Random(7)
    bad = rng.randrange(40)
    steps = []
    for _ in range(6):  # each step: 2 ranks x 16 examples from 8 shards; bad shard's 3 examples all NaN
        shards = [bad, *rng.sample([s for s in range(40) if s != bad], 7)]
        ex = [(shards[i % 8], shards[i % 8] == bad and i < 24) for i in range(32)]
        steps.append([ex[:16], ex[16:]])
    write_run(tmp_path, steps, {s: 100 for s in range(40)})
    rep = report(tmp_path)
    assert rep.verdict == "shard-selective" and rep.suspect_shards == [bad]
    row = next(s for s in rep.shards if s.shard == bad)
    assert (row.events, row.exposures) == (6, 100) and row.rate == pytest.approx(0.06)
    n = sum(1 for st in steps for r in st for _, b in r if b)
    assert row.nonfinite == n and row.p_value == pytest.approx(exact_sf(n, n, Fraction(1, 8)), rel=1e-6)
    assert f"6 of 6 non-finite steps involve shard {bad} (2.5% of examples seen)" in rep.sentence
    assert rep.ranks == {0: 6, 1: sum(any(b for _, b in st[1]) for st in steps)}
    assert set(rep.to_dict()) >= {"verdict", "suspect_shards", "shards", "ranks", "sentence"}
    assert set(rep.to_dict()["shards"][0]) >= {"shard", "events", "exposures", "rate"}


def test_every_example_non_finite_is_spread_even_with_unequal_exposure(tmp_path):
    # A blow-up: every example of the late steps is NaN; the shards read then have more exposure late.
    steps = [[[(s, True) for s in (4, 4, 5, 6)], [(s, True) for s in (5, 6, 7, 7)]] for _ in range(5)]
    write_run(tmp_path, steps, {**{s: 10 for s in range(4)}, **{s: 40 for s in range(4, 8)}})
    rep = report(tmp_path)
    assert rep.verdict == "spread" and rep.suspect_shards == []
    assert rep.sentence.startswith("spread: 5 non-finite step(s)") and "learning rate" in rep.sentence


def test_trouble_that_follows_one_rank_across_shards_is_rank_selective(tmp_path):
    import socket

    rng = random.Random(3)
    steps = []
    for _ in range(6):  # rank 1's device returns NaN whatever it reads: all its 8 examples, from 8 random shards
        ex = [(s, False) for s in rng.sample(range(40), 8)], [(s, True) for s in rng.sample(range(40), 8)]
        steps.append(list(ex))
    write_run(tmp_path, steps, {s: 100 for s in range(40)})
    rep = report(tmp_path)
    assert rep.verdict == "rank-selective" and rep.suspect_ranks == [1] and rep.suspect_shards == []
    assert rep.suspect_hosts == [socket.gethostname()]  # each rank's ledger lines carry its host
    assert rep.sentence.startswith("rank-selective: 6 of 6 non-finite steps were flagged on rank(s) 1")
    assert "look at that rank's device and host" in rep.sentence
    from steadytrain.diagnose.ranks import rank_stats

    stats, localized = rank_stats(read_ledger(tmp_path))
    one = next(s for s in stats if s.rank == 1)
    assert localized == 6 and one.flagged == 48 and one.expected == pytest.approx(24.0)
    assert one.p_value == pytest.approx(exact_sf(48, 48, Fraction(1, 2)), rel=1e-6)  # half of what is in play
    assert one.shards == len({sh for st in steps for sh, _ in st[1]})
    assert set(rep.to_dict()) >= {"verdict", "suspect_shards", "suspect_ranks", "suspect_hosts", "sentence"}


def test_a_bad_shard_read_by_one_rank_is_the_shards_not_the_ranks(tmp_path):
    rng = random.Random(5)
    bad = 17
    steps = []
    for _ in range(6):  # the bad shard's examples land on rank 1 only: one shard, so not the rank's doing
        others = rng.sample([s for s in range(40) if s != bad], 12)
        steps.append([[(s, False) for s in others[:8]], [(bad, True), (bad, True), *((s, False) for s in others[8:])]])
    write_run(tmp_path, steps, {s: 100 for s in range(40)})
    rep = report(tmp_path)
    assert rep.verdict == "shard-selective" and rep.suspect_shards == [bad] and rep.suspect_ranks == []


def test_no_ledger_is_none_and_a_bad_line_is_one_user_error(tmp_path):
    assert report(tmp_path).verdict == "none"
    (tmp_path / "nonfinite.jsonl").write_text('{"step": 1}\n{"step": 2, "rank": 0}\n')
    with pytest.raises(UserError, match="line 1"):
        report(tmp_path)
    with pytest.raises(UserError, match="no such run directory"):
        report(tmp_path / "absent")


def test_ledger_line_round_trips_and_a_cut_last_line_is_skipped(tmp_path):
    tag = {"shard": torch.tensor([3, 47]), "index": torch.tensor([9, 12]), "nonfinite": torch.tensor([False, True])}
    first = {"shard": [1], "index": [0], "nonfinite": None}  # a model returning a scalar: no per-example flags
    event = NonFiniteEvent(cycle=4, rank=1, grad_norm=math.inf, micro_steps=(8, 9),
                           nonfinite_micro_batches=(1,), tags=(first, tag))  # fmt: skip
    record = event_record(event, 5)
    assert record["tags"][1] == {"shard": [3, 47], "index": [9, 12], "finite": False, "nonfinite": [1]}
    assert record["tags"][0]["finite"] and record["grad_norm"] == "inf" and record["shards"] == [1, 3, 47]
    path = tmp_path / "nonfinite.jsonl"
    append_event(path, event, 5)
    with open(path, "a") as f:
        f.write('{"step": 6, "rank": 0, "cyc')  # a write cut short by a kill
    ((step, back),) = read_ledger(tmp_path)
    assert step == 5 and back.rank == 1 and math.isinf(back.grad_norm) and back.nonfinite_micro_batches == (1,)


# --- hooks and bisection -----------------------------------------------------------------------


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_probe_names_the_first_module_in_execution_order():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), Log()), nn.Linear(3, 1))
    with torch.no_grad():
        model[0].weight.copy_(-torch.eye(3))
        model[0].bias.zero_()
    with Probe(model) as probe:
        model(torch.tensor([[1.0, 2.0, 3.0]]))  # relu(-x) = 0 -> log 0 = -inf (in "1.1"), then NaN/inf after
        assert probe.first() == "1.1"
        probe.reset()
        model(torch.tensor([[-1.0, -2.0, -3.0]]))  # relu(x) > 0: every output finite
        assert probe.first() is None and len(probe.calls) == 6  # 5 modules + the root
    assert not model[0]._forward_hooks  # removed on exit
    assert ROOT == "(model)"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bisection_finds_every_bad_row_and_no_good_one(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    bad = set(rng.choice(n, size=int(rng.integers(0, min(n, 12) + 1)), replace=False).tolist())
    calls = []

    def is_bad(rows):
        calls.append(len(rows))
        return bool(set(rows.tolist()) & bad)

    assert sorted(_bisect(is_bad, np.arange(n))) == sorted(bad)
    assert len(calls) <= 1 + 2 * max(len(bad), 1) * math.ceil(math.log2(n) + 1)


def test_spike_outliers_that_follow_one_rank_across_shards_are_rank_selective_too(tmp_path):
    from steadytrain.accumulate.events import SPIKE
    from steadytrain.diagnose.ledger import SPIKES

    rng = random.Random(11)
    lines = []
    for step in range(1, 7):  # rank 1's examples are the outliers of every spike, whatever shard they come from
        for rank in (0, 1):
            shards = rng.sample(range(40), 8)
            tag = {"shard": torch.tensor(shards), "index": torch.arange(8), "nonfinite": None}
            record = event_record(
                NonFiniteEvent(step - 1, rank, 1.0, (step - 1, step - 1), (), (tag,), "warn", SPIKE), step
            )
            record["tags"][0]["nonfinite"] = list(range(8)) if rank == 1 else []
            lines.append(json.dumps({**record, "kind": "spike"}))
    (tmp_path / SPIKES).write_text("\n".join(lines) + "\n")
    rep = report(tmp_path, SPIKES)
    assert rep.verdict == "rank-selective" and rep.suspect_ranks == [1], rep.sentence
    assert rep.sentence.startswith("rank-selective: 6 of 6 loss spikes were flagged on rank(s) 1")
    assert "outlying example losses" in rep.sentence
