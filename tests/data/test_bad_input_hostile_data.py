"""More hostile and careless input to the data layer, the accumulator and clipping (issue 8).

Shards whose Parquet schemas disagree (per-example and batched mode), empty shards, transforms that
misbehave, tampered ``state_dict()`` states, options that would be silently ignored, and API misuse
of ``GradientAccumulator`` and the clip functions. Every case: a :class:`UserError` (a
``DatasetError`` for the data) naming what is wrong, nothing written, no traceback from the CLI.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from torch import nn

from steadytrain.accumulate import GradientAccumulator
from steadytrain.clip import clip_grad_global_norm_, clip_grad_value_, global_grad_norm, scale_grads_
from steadytrain.data import DatasetError, DatasetWriter, ShardedDataset, global_batch, open_dataset
from steadytrain.errors import UserError
from tests.cli_utils import EXE, assert_user_error

BASE = pa.table({"x": [1.0, 2.0, 3.0, 4.0], "y": [1, 2, 3, 4]})


def write(path: Path, *tables: pa.Table) -> Path:
    with DatasetWriter(path, provenance={"pipeline_version": "1"}) as w:
        for t in tables:
            w.write_shard(t)
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "data", *args], capture_output=True, text=True, timeout=120)


# --- shards whose Parquet schemas disagree ---------------------------------------------------------------

MISMATCHES = {
    "missing column": (pa.table({"x": [5.0, 6.0, 7.0, 8.0]}), ["'y'", "missing"]),
    "int instead of double": (pa.table({"x": [5, 6, 7, 8], "y": [5, 6, 7, 8]}), ["'x'", "int64", "double"]),
    "string instead of double": (pa.table({"x": list("abcd"), "y": [5, 6, 7, 8]}), ["'x'", "string"]),
    "extra column": (BASE.append_column("z", pa.array([0, 0, 0, 0])), ["'z'"]),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"batch_size": 2},  # micro-batches inside one shard: the window concat
        {"batch_size": 3},  # micro-batches across shards
        {"batch_size": 2, "shuffle_window": 1},  # one shard per window: the pending concat across windows
    ],
)
def test_a_shard_with_another_schema_is_a_dataset_error_naming_both(tmp_path, case, mode):
    other, words = MISMATCHES[case]
    write(tmp_path, BASE, other)
    ds = ShardedDataset(tmp_path, shuffle=False, **mode)
    with pytest.raises(DatasetError) as err:
        list(ds)
    msg = str(err.value)
    assert "shard 1" in msg and "shard 0" in msg, msg
    for word in words:
        assert word in msg, (word, msg)
    assert "\n" not in msg


def test_global_batch_over_mismatched_shards_is_a_dataset_error(tmp_path):
    write(tmp_path, BASE, MISMATCHES["missing column"][0])
    with pytest.raises(DatasetError, match="shard 1"):
        global_batch(tmp_path, 0, global_batch_size=8, seed=0)


def test_columns_in_another_order_are_the_same_schema(tmp_path):
    write(tmp_path, BASE, BASE.select(["y", "x"]))
    mbs = list(ShardedDataset(tmp_path, shuffle=False, batch_size=3))
    assert [list(mb) for mb in mbs] == [["x", "y", "shard", "index"]] * 2
    assert torch.equal(torch.cat([mb["x"] for mb in mbs]), torch.tensor([1.0, 2, 3, 4, 1, 2]).double())
    assert [sorted(e) for e in ShardedDataset(tmp_path, shuffle=False)] == [["index", "shard", "x", "y"]] * 8


def test_a_zero_row_shard_in_an_existing_dataset_is_read_as_empty(tmp_path):
    # Written by another tool (the writer refuses it): readers skip it, in both modes.
    import hashlib

    import pyarrow.parquet as pq

    write(tmp_path, BASE, BASE)
    pq.write_table(BASE.slice(0, 0), tmp_path / "shard-00002.parquet")
    data = (tmp_path / "shard-00002.parquet").read_bytes()
    import json

    index = json.loads((tmp_path / "index.json").read_text())
    index["shards"].append(
        {"id": 2, "file": "shard-00002.parquet", "records": 0, "sha256": hashlib.sha256(data).hexdigest(),
         "bytes": len(data), "provenance": {}}
    )  # fmt: skip
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert len(list(ShardedDataset(tmp_path))) == 8
    assert sum(len(mb["x"]) for mb in ShardedDataset(tmp_path, batch_size=2, shuffle_window=1)) == 8


# --- the writer: empty shards -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "word"),
    [(BASE.slice(0, 0), "no rows"), (pa.table({}), "no columns"), (BASE.drop(["x", "y"]), "no columns")],
)
def test_the_writer_refuses_a_shard_without_rows_or_columns(tmp_path, table, word):
    write(tmp_path, BASE)
    before = sorted(p.name for p in tmp_path.iterdir())
    with DatasetWriter(tmp_path) as w, pytest.raises(DatasetError, match=word):
        w.write_shard(table)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert open_dataset(tmp_path).shard_ids == [0]


def test_a_shard_deleted_from_disk_is_named_missing_without_verify(tmp_path):
    write(tmp_path, BASE, BASE)
    (tmp_path / "shard-00001.parquet").unlink()
    with pytest.raises(DatasetError, match=r"shard 1.*missing"):
        list(ShardedDataset(tmp_path, verify=False, shuffle=False))


# --- options that would be silently ignored, flags that are not bools -------------------------------------


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"transform": lambda mb: mb}, "transform"),
        ({"accumulation_steps": 4}, "accumulation_steps"),
        ({"shuffle_window": 2}, "shuffle_window"),
    ],
)
def test_batched_options_without_batch_size_are_refused(tmp_path, kw, word):
    write(tmp_path, BASE)
    with pytest.raises(UserError, match=f"{word}.*batch_size"):
        ShardedDataset(tmp_path, **kw)


@pytest.mark.parametrize("flag", ["shuffle", "verify", "skip_corrupt"])
@pytest.mark.parametrize("value", ["false", 0.0, None, [True]])
def test_flags_must_be_bools(tmp_path, flag, value):
    write(tmp_path, BASE)
    with pytest.raises(UserError, match=flag):
        ShardedDataset(tmp_path, **{flag: value})


def test_global_batch_shuffle_must_be_a_bool(tmp_path):
    write(tmp_path, BASE)
    with pytest.raises(UserError, match="shuffle"):
        global_batch(tmp_path, 0, global_batch_size=2, seed=0, shuffle="no")


# --- transforms -------------------------------------------------------------------------------------------


def _boom(mb):
    raise KeyError("no such column")


@pytest.mark.parametrize(
    ("transform", "words"),
    [
        (lambda mb: {**mb, "z": 5}, ["'z'", "int", "rows"]),
        (lambda mb: {**mb, "z": torch.tensor(5.0)}, ["'z'", "0-dim"]),
        (lambda mb: {**mb, "z": torch.zeros(3)}, ["'z'", "3 rows, not 2"]),
        (lambda mb: {"x": mb["x"]}, ["dropped", "'shard'", "source"]),
        (lambda mb: {**mb, 3: mb["x"]}, ["3", "not a string"]),
        (lambda mb: None, ["NoneType"]),
    ],
)
def test_a_misbehaving_transform_is_a_user_error(tmp_path, transform, words):
    write(tmp_path, BASE)
    ds = ShardedDataset(tmp_path, batch_size=2, shuffle=False, transform=transform)
    with pytest.raises(UserError) as err:
        list(ds)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert ds.state_dict()["micro"] == 0  # the failed micro-batch is not consumed


def test_a_transform_that_raises_keeps_its_error_type_and_says_where(tmp_path):
    write(tmp_path, BASE)
    ds = ShardedDataset(tmp_path, batch_size=2, shuffle=False, transform=_boom)
    with pytest.raises(KeyError, match="no such column") as err:  # the user's own error (an OOM stays an OOM)
        list(ds)
    notes = " ".join(getattr(err.value, "__notes__", []))
    assert "transform" in notes and "micro-batch 0" in notes and "shards" in notes
    assert ds.state_dict()["micro"] == 0  # the failed micro-batch is not consumed


# --- tampered states --------------------------------------------------------------------------------------


def _batched_state(path: Path) -> dict:
    ds = ShardedDataset(path, batch_size=2, accumulation_steps=2)
    it = iter(ds)
    next(it), next(it)
    return ds.state_dict()


@pytest.mark.parametrize(
    ("key", "value", "word"),
    [
        ("micro", -1, "micro"),
        ("micro", 10**9, "past the end"),
        ("micro", "3", "micro"),
        ("micro", 1.5, "micro"),
        ("micro", None, "micro"),
        ("micro", True, "micro"),
        ("micro", float("nan"), "micro"),
        ("epoch", -1, "epoch"),
        ("epoch", "3", "epoch"),
        ("epoch", 1.5, "epoch"),
        ("epoch", None, "epoch"),
        ("step", 7, "step"),
        ("batch_size", "2", "batch_size"),
        ("accumulation_steps", 0, "accumulation_steps"),
        ("world_size", 3, "global_batch_size"),
        ("counts", None, "counts"),
        ("counts", {"zzz": 1}, "counts"),
        ("counts", {"dropped": -1, "clamped": 0, "by_field": {}}, "counts"),
        ("counts", [1], "counts"),
    ],
)
def test_a_tampered_batched_state_is_refused(tmp_path, key, value, word):
    write(tmp_path, BASE, BASE, BASE)
    state = _batched_state(tmp_path)
    state[key] = value
    ds = ShardedDataset(tmp_path, batch_size=2, accumulation_steps=2)
    with pytest.raises(UserError, match=word):
        ds.load_state_dict(state)
    assert len(list(ds)) == len(ds)  # unchanged: still at the start


@pytest.mark.parametrize("key", ["epoch", "micro", "batch_size", "accumulation_steps", "world_size", "counts", "step"])
def test_a_batched_state_lacking_a_field_is_refused(tmp_path, key):
    write(tmp_path, BASE, BASE)
    state = _batched_state(tmp_path)
    del state[key]
    with pytest.raises(UserError, match=key):
        ShardedDataset(tmp_path, batch_size=2, accumulation_steps=2).load_state_dict(state)


def test_a_batched_state_at_the_end_of_the_epoch_loads(tmp_path):
    write(tmp_path, BASE, BASE)
    ds = ShardedDataset(tmp_path, batch_size=2)
    list(ds)
    again = ShardedDataset(tmp_path, batch_size=2)
    again.load_state_dict(copy.deepcopy(ds.state_dict()))
    assert list(again) == []


@pytest.mark.parametrize(
    ("key", "value", "word"),
    [
        ("shard_pos", 4, "past the end"),
        ("row", 5, "row"),
        ("counts", {"dropped": -1, "clamped": 0, "by_field": {}}, "counts"),
        ("counts", {"dropped": 0, "clamped": 0, "by_field": {"x": {"nan": "2"}}}, "counts"),
    ],
)
def test_a_tampered_per_example_state_is_refused(tmp_path, key, value, word):
    write(tmp_path, BASE, BASE, BASE)
    ds = ShardedDataset(tmp_path)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    state[key] = value
    fresh = ShardedDataset(tmp_path)
    with pytest.raises(UserError, match=word):
        fresh.load_state_dict(state)
    assert len(list(fresh)) == 12


# --- the CLI on mismatched schemas ------------------------------------------------------------------------


def test_cli_infer_schema_on_mismatched_shards_is_one_line(tmp_path):
    write(tmp_path / "ds", BASE, MISMATCHES["string instead of double"][0])
    out = tmp_path / "s.yaml"
    assert_user_error(run("infer-schema", str(tmp_path / "ds"), "-o", str(out)), "shard 1", "'x'")
    assert not out.exists()


# --- GradientAccumulator ----------------------------------------------------------------------------------


def _acc(model: nn.Module | None = None, **kw) -> tuple[nn.Module, GradientAccumulator]:
    model = model if model is not None else nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, GradientAccumulator(model, opt, accumulation_steps=kw.pop("k", 2), **kw)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 3)).pow(2).mean()


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"model": "model"}, "model"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"scheduler": 3}, "scheduler"),
        ({"grad_scaler": 3}, "grad_scaler"),
        ({"norm_type": b"2"}, "norm_type"),  # the string "2" is taken, as torch takes it
        ({"norm_type": torch.tensor(2.0)}, "norm_type"),
    ],
)
def test_accumulator_arguments_of_the_wrong_kind_are_refused(kw, word):
    model = nn.Linear(3, 1)
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "accumulation_steps": 2}
    args.update(kw)
    with pytest.raises(UserError, match=word):
        GradientAccumulator(args.pop("model"), args.pop("optimizer"), **args)


def test_a_model_with_nothing_to_train_is_refused():
    frozen = nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(UserError, match="no parameters"):
        GradientAccumulator(frozen, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), accumulation_steps=2)
    with pytest.raises(UserError, match="no parameters"):
        GradientAccumulator(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), accumulation_steps=2)


@pytest.mark.parametrize(
    ("loss", "word"),
    [
        (lambda m: 1.0, "float"),
        (lambda m: torch.tensor(1.0), "does not require grad"),
        (lambda m: torch.tensor(1), "does not require grad"),
        (lambda m: _loss(m).detach(), "does not require grad"),
    ],
)
def test_a_loss_that_cannot_be_backwarded_is_refused_and_not_counted(loss, word):
    model, acc = _acc()
    with acc.micro_batch() as mb:
        with pytest.raises(UserError, match=word):
            mb.backward(loss(model))
        mb.backward(_loss(model))  # a retry in the same block works
    assert acc.micro_steps == 1


def test_misuse_of_micro_batch_is_a_user_error_and_a_runtime_error():
    model, acc = _acc()
    with acc.micro_batch() as mb:
        loss = _loss(model)
        mb.backward(loss)
        with pytest.raises(UserError, match="twice") as err:
            mb.backward(loss)
        assert isinstance(err.value, RuntimeError)
    with pytest.raises(UserError, match="outside"):
        mb.backward(_loss(model))
    with pytest.raises(UserError, match="already open"), acc.micro_batch(), acc.micro_batch():
        pass
    with pytest.raises(UserError, match=r"without mb\.backward"), acc.micro_batch():
        pass
    with acc.micro_batch() as mb:
        mb.backward(_loss(model))
    assert (acc.micro_steps, acc.optimizer_steps) == (2, 1)


@pytest.mark.parametrize("k", [1, 3])
def test_an_exception_after_the_last_backward_of_a_cycle_does_not_grow_the_next_cycle(k):
    ref, _ = _acc(k=k)
    model, acc = _acc(copy.deepcopy(ref), k=k)
    with pytest.raises(KeyError):
        for i in range(k):
            with acc.micro_batch() as mb:
                mb.backward(_loss(model))
                if i == k - 1:
                    raise KeyError("logging failed")
    assert (acc.micro_steps, acc.optimizer_steps) == (k, 0)  # counted, step pending
    for _ in range(k):
        with acc.micro_batch() as mb:
            mb.backward(_loss(model))
    assert (acc.micro_steps, acc.optimizer_steps) == (2 * k, 2)  # the pending cycle stepped first, K each
    # The same as two clean cycles.
    clean_model, clean = _acc(copy.deepcopy(ref), k=k)
    for _ in range(2 * k):
        with clean.micro_batch() as mb:
            mb.backward(_loss(clean_model))
    for a, b in zip(model.parameters(), clean_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_finish_steps_a_cycle_left_pending_by_an_exception():
    model, acc = _acc()
    with pytest.raises(KeyError):
        for i in range(2):
            with acc.micro_batch() as mb:
                mb.backward(_loss(model))
                if i == 1:
                    raise KeyError
    assert acc.finish() is not None
    assert acc.optimizer_steps == 1


# --- clipping ---------------------------------------------------------------------------------------------


def _with_grads() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    return model


@pytest.mark.parametrize(
    "call",
    [
        lambda m: clip_grad_global_norm_(m, 1.0),
        lambda m: clip_grad_global_norm_(m[0], 1.0),
        lambda m: global_grad_norm(m),
        lambda m: clip_grad_value_(m, 1.0),
        lambda m: scale_grads_(m, 0.5),
    ],
)
def test_clip_given_a_module_says_pass_its_parameters(call):
    with pytest.raises(UserError, match=r"parameters\(\)"):
        call(_with_grads())


@pytest.mark.parametrize("params", [None, [1, 2], ["w"]])
def test_clip_given_no_tensors_is_a_user_error(params):
    with pytest.raises(UserError, match="parameters"):
        clip_grad_global_norm_(params, 1.0)


@pytest.mark.parametrize("norm_type", ["two", b"inf", torch.tensor(2.0), None, [2]])  # "2" and "inf" are taken
def test_norm_type_must_be_a_number(norm_type):
    with pytest.raises(UserError, match="norm_type"):
        global_grad_norm(_with_grads().parameters(), norm_type)


@pytest.mark.parametrize(
    ("factor", "word"), [("0.5", "number"), (float("nan"), "finite"), (True, "number"), (torch.ones(2), "0-dim")]
)
def test_scale_grads_factor_is_checked(factor, word):
    model = _with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(UserError, match=word):
        scale_grads_(model.parameters(), factor)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))
