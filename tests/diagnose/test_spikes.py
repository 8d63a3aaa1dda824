"""Loss-spike detection, outliers and the accumulator's veto, against NumPy references and closed forms."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
import torch
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.accumulate.events import SPIKE
from steadytrain.diagnose.ledger import outliers
from steadytrain.diagnose.outliers import loss_outliers
from steadytrain.errors import UserError
from steadytrain.guard import SpikeDetector
from steadytrain.train.setup.config import load_config


def reference_flags(values, *, window, threshold, min_ratio, warmup=0):
    """The rule as the docs write it, in NumPy: the previous ``window`` accepted values, median and MAD."""
    kept, flags = deque(maxlen=window), []
    for step, v in enumerate(values, 1):
        flag = False
        if len(kept) == window and step > warmup and math.isfinite(v):
            prev = np.array(kept)
            med = np.median(prev)
            mad = np.median(np.abs(prev - med))
            flag = v > med + threshold * mad and v >= min_ratio * med
        flags.append(flag)
        if not flag and math.isfinite(v):
            kept.append(v)
    return flags


def detector_flags(values, **kw):
    d = SpikeDetector(**kw)
    return [bool(d.update(step, torch.tensor(v))[0]) for step, v in enumerate(values, 1)], d


@pytest.mark.parametrize("window", [5, 8, 50])
def test_detector_matches_the_numpy_rule_on_a_heavy_tailed_curve(window):
    rng = np.random.default_rng(window)
    values = list(np.exp(rng.standard_normal(400) * 0.6) * np.linspace(5, 1, 400))  # lognormal noise, falling
    planted = [120, 121, 250, 399]
    for i in planted:
        values[i] = values[i - 1] * 40  # far out of line
    values[300] = math.nan  # judged, never added
    kw = dict(window=window, threshold=6.0, min_ratio=3.0, warmup_steps=10)
    got, _ = detector_flags(values, **kw)
    want = reference_flags(values, window=window, threshold=6.0, min_ratio=3.0, warmup=10)
    assert got == want
    assert all(got[i] for i in planted)  # consecutive spikes too: a spike does not join the window


def test_nothing_before_the_window_is_full_or_during_warmup():
    values = [1.0] * 3 + [100.0] + [1.0, 1.1, 0.9, 1.0] * 5 + [100.0]
    got, _ = detector_flags(values, window=4, threshold=3.0, min_ratio=2.0, warmup_steps=0)
    assert got[3] is False and got[-1] is True  # step 4: three values seen, not four
    got, _ = detector_flags(values, window=4, threshold=3.0, min_ratio=2.0, warmup_steps=len(values))
    assert not any(got)


def test_min_ratio_keeps_a_flat_curve_quiet():
    """A flat curve has a tiny MAD: 1.5x the median is thousands of MADs, still not a spike below min_ratio."""
    values = [1.0 + 1e-6 * (i % 3) for i in range(20)] + [1.5, 4.0]
    got, _ = detector_flags(values, window=10, threshold=30.0, min_ratio=3.0)
    assert got[-2:] == [False, True]


def test_grad_norm_and_both_metrics():
    d = SpikeDetector(window=4, threshold=5.0, min_ratio=2.0, metric="grad_norm")
    flags = [bool(d.update(s, 1.0, n)[0]) for s, n in enumerate([1.0, 1.1, 0.9, 1.0, 50.0], 1)]
    assert flags[-1] is True
    d = SpikeDetector(window=4, threshold=5.0, min_ratio=2.0, metric="loss")
    assert not bool(d.update(9, 1.0, 50.0)[0])  # the norm is watched only when asked
    d = SpikeDetector(window=2, threshold=5.0, min_ratio=2.0, metric="both")
    for s in (1, 2):
        d.update(s, 1.0 + s / 10, 1.0 + s / 10)
    assert bool(d.update(3, 1.1, 9.0)[0]) and bool(d.update(4, 9.0, 1.1)[0])


def test_state_round_trip_gives_the_same_flags_as_straight():
    rng = np.random.default_rng(3)
    values = list(np.abs(rng.standard_normal(120)) + 1)
    values[90] = 60.0
    straight, _ = detector_flags(values, window=16, threshold=8.0, min_ratio=2.0)
    first, d = detector_flags(values[:50], window=16, threshold=8.0, min_ratio=2.0)
    state = d.state_dict()
    e = SpikeDetector(window=16, threshold=8.0, min_ratio=2.0)
    e.load_state_dict(state)
    rest = [bool(e.update(step, torch.tensor(v))[0]) for step, v in enumerate(values[50:], 51)]
    assert first + rest == straight and straight[90]


def test_limits_are_the_rules_numbers():
    d = SpikeDetector(window=3, threshold=2.0, min_ratio=1.5)
    for s, v in enumerate([1.0, 2.0, 4.0], 1):
        d.update(s, v)
    flag, limits = d.update(4, 9.0)
    stats = limits.read()
    # previous: 1, 2, 4: median 2, MAD median(|-1|, 0, 2) = 1; limit max(2 + 2 x 1, 1.5 x 2) = 4
    assert stats["median"][0] == 2.0 and stats["mad"][0] == 1.0 and stats["limit"][0] == 4.0 and bool(flag)


def test_bad_settings_are_refused():
    with pytest.raises(UserError, match=r"spike\.metric"):
        SpikeDetector(window=4, threshold=1.0, min_ratio=1.0, metric="lr")
    with pytest.raises(UserError, match=r"spike\.window"):
        SpikeDetector(window=1, threshold=1.0, min_ratio=1.0)
    with pytest.raises(UserError, match=r"spike\.policy"):
        load_config(overrides=["spike.policy=restart"])
    with pytest.raises(UserError, match=r"spike\.threshold"):
        load_config(overrides=["spike.threshold=-1"])
    with pytest.raises(UserError, match="flag, not a number"):
        load_config(overrides=["spike.window=true"])


def test_outliers_are_the_fewest_examples_that_explain_the_excess():
    # limit 5: mean 30.6 -> drop 100 -> (1 + 1 + 1 + 50) / 4 = 13.25 -> drop 50 -> 1: two examples
    flagged, whole = outliers([[1.0, 100.0, 1.0], [1.0, 50.0]], [34.0, 25.5], 5.0)
    assert flagged == [[1], [1]] and whole == []
    # a rank whose own examples are in line flags nothing; a scalar micro-batch above the limit is flagged whole
    assert outliers([[1.0, 2.0, 3.0]], [2.0], 5.0) == ([[]], [])
    assert outliers([None, [1.0]], [9.0, 1.0], 5.0) == ([None, []], [0])


def test_loss_outliers_against_a_reference():
    ref = np.array([1.0, 2.0, 3.0, 2.0, 2.5])  # median 2, MAD 0.5
    rows, limit = loss_outliers(np.array([2.0, 9.0, 5.9, math.inf]), ref, threshold=6.0, min_ratio=3.0)
    assert limit == 6.0 and rows.tolist() == [1, 3]


def _accumulator(veto_at: set[int], on_nonfinite="skip"):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = GradientAccumulator(model, opt, accumulation_steps=2, scheduler=sched, max_grad_norm=1.0,
                              on_nonfinite=on_nonfinite)  # fmt: skip
    seen = []

    def veto(norm):
        seen.append(norm.clone())
        return torch.tensor(len(seen) in veto_at)

    acc.veto = veto
    return model, opt, sched, acc, seen


def _cycle(model, acc, x):
    for _ in range(2):
        with acc.micro_batch() as mb:
            mb.backward(model(x).pow(2).mean())
    return mb.result


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_a_vetoed_cycle_is_refused_like_a_non_finite_one(on_nonfinite):
    model, opt, _sched, acc, seen = _accumulator({2}, on_nonfinite)
    x = torch.ones(4, 3)
    _cycle(model, acc, x)
    before = [p.detach().clone() for p in model.parameters()]
    lr = opt.param_groups[0]["lr"]
    result = _cycle(model, acc, x)  # vetoed: never raised, whatever on_nonfinite says
    assert not result.stepped and acc.nonfinite_events[-1].reason == SPIKE and acc.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.param_groups[0]["lr"] == lr and all(p.grad is None for p in model.parameters())
    # the veto saw the normalized global norm: the one torch.nn.utils computes on the same gradient
    model2 = nn.Linear(3, 1)
    model2.load_state_dict(model.state_dict())
    model2.zero_grad()
    model2(x).pow(2).mean().backward()
    assert torch.allclose(seen[-1], torch.nn.utils.get_total_norm([p.grad for p in model2.parameters()]))
    assert _cycle(model, acc, x).stepped and acc.optimizer_steps == 2


def test_policy_off_unquoted_in_yaml_is_the_policy_off(tmp_path):
    """YAML 1.1 reads `off` as false: `spike.policy: off` (a file or --set) must mean the policy, not an error."""
    assert load_config(overrides=["spike.policy=off"]).spike.policy == "off"
    path = tmp_path / "c.yaml"
    path.write_text("spike:\n  policy: off\n")
    assert load_config(path).spike.policy == "off"
    with pytest.raises(UserError, match=r"spike\.policy"):
        load_config(overrides=["spike.policy=on"])  # true is no policy


@pytest.mark.parametrize("interval", [1, 7, 10])
def test_a_logging_interval_judged_at_once_flags_as_step_by_step(tmp_path, interval):
    """``warn`` judges a logging interval in one go and corrects it after the read: the same flags as the rule
    applied step by step, with spikes, refused (skipped) steps and non-finite losses inside intervals."""
    from steadytrain.train.job.spikes import SpikeGuard
    from steadytrain.train.setup.config import SpikeConfig
    from steadytrain.train.setup.distributed import DistInfo

    rng = np.random.default_rng(interval)
    values = list(np.exp(rng.standard_normal(300) * 0.5) + 1)
    for i in (60, 61, 65, 130, 199, 200, 201, 299):
        values[i] = values[i - 2] * 50
    skipped = [i in (63, 64, 140) for i in range(300)]
    values[150] = math.inf
    cfg = SpikeConfig(policy="warn", window=12, threshold=8.0, min_ratio=2.0)
    guard = SpikeGuard(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None), tmp_path / "spikes.jsonl", warmup_steps=5)
    got = []
    for start in range(0, 300, interval):
        steps = list(range(start + 1, min(start + interval, 300) + 1))
        losses = torch.tensor(values[start : start + len(steps)], dtype=torch.float32)
        flags = guard.judge(steps, losses, [1.0] * len(steps)).tolist()
        got += guard.settle(steps, flags, losses.double().tolist(), skipped[start : start + len(steps)])
    # the reference: a skipped step is judged but never joins the window (as a non-finite value)
    ref_values = [math.nan if k else float(np.float32(v)) for v, k in zip(values, skipped, strict=True)]
    want = reference_flags(ref_values, window=12, threshold=8.0, min_ratio=2.0, warmup=5)
    for i in range(300):  # a skipped step is still judged on its own value
        if skipped[i]:
            want[i] = got[i]
    assert got == want and sum(want) >= 6


def test_yaml_flags_for_the_spike_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("spike: off\n")
    assert load_config(path).spike.policy == "off"  # the whole section off
    path.write_text("spike:\n  policy: on\n")
    with pytest.raises(UserError, match=r"spike\.policy: true \(YAML reads on/yes/true as a flag\)"):
        load_config(path)


def test_a_damaged_spike_ledger_is_one_line_naming_the_key(tmp_path):
    import json

    from steadytrain.accumulate import NonFiniteEvent
    from steadytrain.diagnose import report
    from steadytrain.diagnose.ledger import SPIKES, event_record

    tag = {"shard": [3], "index": [0], "losses": None}
    record = event_record(NonFiniteEvent(0, 0, 1.0, (0, 0), (), (tag,), "warn", SPIKE), 5)
    for key, bad in (("batch", [1]), ("rollback_to", "x"), ("value", [])):
        (tmp_path / SPIKES).write_text(json.dumps({**record, "kind": "spike", key: bad}) + "\n")
        with pytest.raises(UserError, match=rf"spikes\.jsonl: line 1: {key}="):
            report(tmp_path, SPIKES)


def test_the_batch_a_step_trained_on_after_rollbacks():
    from steadytrain.diagnose.batches import batch_of

    # batches 3 and 4 passed over: steps 1..3 train 0..2, then 5, 6, ...
    assert [batch_of(s, [4, 3]) for s in range(1, 7)] == [0, 1, 2, 5, 6, 7]


def test_a_complete_last_line_that_is_not_json_is_damage_not_a_torn_write(tmp_path):
    """A kill mid-write leaves a line without its newline; a line with one was written whole: damage, an error."""
    from steadytrain._io import read_jsonl

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(path) == [(1, {"step": 1})]
    path.write_text('{"step": 1}\ngarbage\n')
    with pytest.raises(UserError, match=r"m\.jsonl:2"):
        read_jsonl(path)


# --- a ledger's records checked against the run's data; one reader for every JSON-lines file ----------------


def _ledger_run(tmp_path, name="spikes.jsonl", **changes):
    """A directory with ``data.json`` naming a 4-shard dataset of 16 records each, and a ledger ``name`` of one
    record (``event_record`` of an example of shard 3, index 0) with ``changes`` applied."""
    import json

    from steadytrain.accumulate import NonFiniteEvent
    from steadytrain.data import open_dataset
    from steadytrain.diagnose.ledger import event_record
    from tests.train_utils import write_text_dataset

    data = write_text_dataset(tmp_path / "data", [16] * 4)
    run = tmp_path / "run"
    run.mkdir()
    info = {"path": str(data), "fingerprint": open_dataset(data).fingerprint()}
    (run / "data.json").write_text(json.dumps(info))
    tag = {"shard": [3], "index": [0]}
    reason = SPIKE if name == "spikes.jsonl" else "nonfinite_grad_norm"
    record = event_record(NonFiniteEvent(0, 0, 1.0, (0, 0), (), (tag,), "warn", reason), 5)
    for key, value in changes.items():
        if key.startswith("tag_"):
            record["tags"][0][key.removeprefix("tag_")] = value
        else:
            record[key] = value
    (run / name).write_text(json.dumps(record) + "\n")
    return run


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"shards": "abc"}, ["shards='abc'"]),
        ({"shards": [-1]}, ["shards holds -1"]),
        ({"shards": [9]}, ["shards holds 9", "no shard 9", "0-3"]),
        ({"tag_index": [10**18]}, ["tags[0].index holds 1000000000000000000", "shard 3", "16 records"]),
        ({"tag_index": [16]}, ["tags[0].index holds 16", "indices 0 to 15"]),
        ({"tag_shard": [4], "shards": [3]}, ["tags[0].shard holds 4", "no shard 4"]),
        ({"step": 0}, ["step=0"]),
    ],
)
def test_every_spike_record_is_checked_against_the_runs_dataset(tmp_path, cli, changes, words):
    from tests.cli_utils import assert_user_error

    run = _ledger_run(tmp_path, **changes)
    assert_user_error(cli("spikes", "report", run), "spikes.jsonl: line 1", *words)


def test_a_ledger_inside_the_dataset_reads_and_the_nan_ledger_is_checked_alike(tmp_path, cli):
    from steadytrain.diagnose import report
    from steadytrain.diagnose.ledger import LEDGER, SPIKES
    from tests.cli_utils import assert_user_error

    ok = _ledger_run(tmp_path / "ok", tag_index=[15])  # the last record of shard 3: in range
    assert report(ok, SPIKES).steps == [5]
    bad = _ledger_run(tmp_path / "bad", name=LEDGER, tag_index=[16])
    assert_user_error(cli("nan", "report", bad), "nonfinite.jsonl: line 1", "tags[0].index holds 16")


def test_binary_garbage_in_a_json_lines_file_is_an_error_naming_file_and_line(tmp_path, cli):
    """A last line without a newline used to be skipped as a torn record whatever it held: garbage read as no
    records. A torn record is the start of a JSON object; anything else is damage, named file:line."""
    from steadytrain._io import read_jsonl
    from tests.cli_utils import assert_user_error

    g = tmp_path / "g.jsonl"
    g.write_bytes(bytes(range(1, 9)) + b"\x00\xfe garbage")
    with pytest.raises(UserError, match=r"g\.jsonl:1: "):
        read_jsonl(g)
    g.write_bytes(b'{"step": 1}\n\xff\xfe\x00\x01\n{"step": 3}\n')  # not UTF-8 on line 2: named, not "byte 12"
    with pytest.raises(UserError, match=r"g\.jsonl:2: .*not UTF-8"):
        read_jsonl(g)
    g.write_bytes(b'{"step": 1}\n{"name": "caf\xc3')  # a kill inside a multi-byte character: still a torn record
    assert read_jsonl(g) == [(1, {"step": 1})]
    run = tmp_path / "run"
    run.mkdir()
    (run / "spikes.jsonl").write_bytes(b"\x7fELF\x02\x01\x01\x00garbage")
    assert_user_error(cli("spikes", "report", run), "spikes.jsonl:1")
    (run / "nonfinite.jsonl").write_bytes(b"[1, 2]\n")  # JSON, but no event: the ledger says so (file and line)
    assert_user_error(cli("nan", "report", run), "nonfinite.jsonl: line 1", "not a non-finite event")


def test_spikes_hunt_of_a_shard_the_run_never_read_says_so(tmp_path, cli):
    import json

    from tests.cli_utils import assert_user_error
    from tests.train_utils import TINY, sets, write_text_dataset

    data = write_text_dataset(tmp_path / "data", [16] * 12)
    run = tmp_path / "run"
    assert cli("train", "--run-dir", run, *sets(*TINY, f"data.path={data}", "run.max_steps=2")).returncode == 0
    exposure = {int(k): v for k, v in json.loads((run / "exposure.json").read_text()).items()}
    assert sum(exposure.values()) == 2 * 16  # 2 steps of 16 examples: at most 16 of the 12 shards were read
    never = sorted(set(range(12)) - set(exposure))
    assert never, exposure
    for command in ("spikes", "nan"):
        proc = cli(command, "hunt", run, "--shard", never[0])
        assert_user_error(proc, f"never read shard {never[0]}", f"{command} report")
        read = proc.stderr.split("the shards it read: ")[1].split(")")[0]
        spans = [[int(x) for x in part.split("-")] for part in read.split(", ")]
        assert {x for span in spans for x in range(span[0], span[-1] + 1)} == set(exposure)
    assert_user_error(cli("spikes", "hunt", run, "--shard", 40), "no shard 40", "0-11")


def test_a_spike_window_longer_than_the_run_is_said_once_at_info_not_as_a_warning(tmp_path, cli):
    import logging

    from tests.train_utils import TINY, sets, write_text_dataset

    records: list[logging.LogRecord] = []
    keep = logging.Handler()
    keep.emit = records.append
    logger = logging.getLogger("steadytrain.train")
    logger.addHandler(keep)
    try:
        data = write_text_dataset(tmp_path / "data", [16] * 4)
        proc = cli("train", "--run-dir", tmp_path / "run", *sets(*TINY, f"data.path={data}", "run.max_steps=3"))
    finally:
        logger.removeHandler(keep)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [r for r in records if "spike.window=50" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and "covers the run's 3 steps" in said[0].getMessage()
    assert not [r for r in records if r.levelno >= logging.WARNING and "spike" in r.getMessage()]


@pytest.mark.parametrize(
    ("items", "words"),
    [
        (["spike.min_ratio=0.5"], ["spike.min_ratio", "0.5 is below 1", "give 1"]),
        (["spike.min_ratio=0"], ["spike.min_ratio", "0 is below 1"]),
        (["spike.skip_batches=3"], ["spike.skip_batches=3", "spike.policy=rollback (here warn)"]),
        (["spike.policy=skip", "spike.skip_batches=2"], ["spike.skip_batches=2", "(here skip)"]),
        (
            ["spike.policy=rollback", "spike.skip_batches=31", "run.max_steps=30"],
            ["spike.skip_batches=31", "at most 30"],
        ),
    ],
)
def test_spike_settings_that_can_never_act_are_refused(cli, items, words):
    from tests.cli_utils import assert_user_error
    from tests.train_utils import sets

    assert_user_error(cli("config", "show", *sets(*items)), *words)
    with pytest.raises(UserError, match=words[0].replace(".", r"\.")):
        load_config(overrides=items)


def test_spike_settings_at_their_limits_are_accepted():
    assert load_config(overrides=["spike.min_ratio=1"]).spike.min_ratio == 1.0
    cfg = load_config(overrides=["spike.policy=rollback", "spike.skip_batches=30", "run.max_steps=30"])
    assert cfg.spike.skip_batches == 30  # a spike at the last step rolls back to the start: possible
    assert load_config(overrides=["spike.policy=rollback", "spike.skip_batches=500", "run.max_steps=null"])
    # a resolved config (every key written, skip_batches at its default) loads with any policy
    for policy in ("off", "warn", "skip"):
        resolved = load_config(overrides=[f"spike.policy={policy}"]).to_dict()
        assert load_config(overrides=[f"spike.{k}={v}" for k, v in resolved["spike"].items()]).spike.policy == policy
