"""A run written by ``steadytrain.Run`` from the user's own loop (``loop.json``) is refused by every command that would
rebuild its model and data from ``config.yaml``, which holds the user's own mapping, not a training config.

The runs are written by hand as an own-loop run lays them out: ``config.yaml`` (the user's mapping), ``loop.json``
(:func:`write_origin`), two rows of ``metrics.jsonl``, a ledger line of a refused step 1 (``append_event``, as the
accumulator writes it) and an empty ``checkpoints/``. Oracles: the exit code, the one line on stderr (the run, what
is missing, the command), the record as written by hand, and ``nan report``'s step list from the ledger as written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from steadytrain.accumulate import NonFiniteEvent
from steadytrain.diagnose.ledger import append_event
from steadytrain.errors import UserError
from steadytrain.rundir.origin import ORIGIN_FILE, read_origin, require_replayable, write_origin
from steadytrain.runs.replay import initial_model, run_model
from tests.cli_utils import assert_user_error, in_process

USER_CONFIG = {"lr": 0.001, "batch_size": 12}
ROW = {"step": 1, "loss": 1.0, "lr": 0.001, "grad_norm": 1.0, "clipped": False, "skipped": False, "items": 4,
       "items_per_s": 1.0, "elapsed_s": 0.1}  # fmt: skip


def own_loop_run(where: Path, config: dict | None = None, *, factory: str | None = None, dataset: str | None = None):
    """An own-loop run directory as ``steadytrain.Run`` leaves it after two steps, step 1 refused on rank 0."""
    where.mkdir(parents=True)
    (where / "config.yaml").write_text(yaml.safe_dump(USER_CONFIG if config is None else config))
    write_origin(where, model_factory=factory, dataset=dataset, shard_size=4, version="0.0.0")
    (where / "metrics.jsonl").write_text("".join(json.dumps({**ROW, "step": s}) + "\n" for s in (1, 2)))
    tag = {"shard": torch.tensor([3, 3]), "index": torch.tensor([0, 1]), "nonfinite": torch.tensor([False, True])}
    event = NonFiniteEvent(cycle=0, rank=0, grad_norm=math.nan, micro_steps=(0, 0), nonfinite_micro_batches=(0,),
                           tags=(tag,))  # fmt: skip
    append_event(where / "nonfinite.jsonl", event, 1)
    (where / "checkpoints").mkdir()
    return where


REPLAYING = [
    ("nan hunt RUN", "steadytrain nan hunt"),
    ("nan hunt RUN --step 1", "steadytrain nan hunt"),
    ("nan hunt RUN --shard 3", "steadytrain nan hunt"),
    ("spikes hunt RUN", "steadytrain spikes hunt"),
    ("spikes hunt RUN --step 1", "steadytrain spikes hunt"),
    ("triage RUN --step 1", "steadytrain triage"),
    ("eval RUN", "steadytrain eval"),
    ("repro RUN --steps 1", "steadytrain repro"),
]


@pytest.mark.parametrize(("line", "command"), REPLAYING, ids=[line for line, _ in REPLAYING])
def test_each_replaying_command_refuses_an_own_loop_run_without_a_model_factory(tmp_path, line, command):
    run = own_loop_run(tmp_path / "own")
    proc = in_process(*[str(run) if word == "RUN" else word for word in line.split()])
    assert_user_error(proc, str(run), "model factory", f"`{command}`", "steadytrain.Run")
    assert proc.stdout == ""


def test_an_own_loop_run_with_factory_and_dataset_is_still_refused_naming_both(tmp_path):
    run = own_loop_run(tmp_path / "own", factory="mypkg.models:build", dataset="/data/tokens")
    proc = in_process("eval", str(run))
    assert_user_error(proc, str(run), "`steadytrain eval`", "`steadytrain train` only", "mypkg.models:build",
                      "/data/tokens")  # fmt: skip


def test_the_refusal_names_only_what_is_missing(tmp_path):
    run = own_loop_run(tmp_path / "own", factory="mypkg.models:build")  # a factory, no dataset
    with pytest.raises(UserError) as err:
        require_replayable(run, "nan hunt")
    text = str(err.value)
    assert "without a dataset:" in text and "without a model factory" not in text and "rebuild the data" in text
    assert "\n" not in text


def test_a_user_config_that_reads_as_a_training_config_is_not_replayed_as_the_default_model(tmp_path):
    """The reported bug: a user's mapping that load_config accepts (every key a training config's too) filled in the
    default model, and the replay rebuilt that model's weights. Empty and ``run:`` only are such mappings."""
    for i, config in enumerate(({}, {"run": {"seed": 3}})):
        run = own_loop_run(tmp_path / f"own{i}", config)
        for build in (initial_model, lambda r: run_model(r, before_step=0)):
            with pytest.raises(UserError, match="model factory"):
                build(run)


def test_nan_report_still_reads_an_own_loop_run(tmp_path):
    run = own_loop_run(tmp_path / "own")
    proc = in_process("nan", "report", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == [1]  # the one refused step the ledger holds


def test_export_reads_checkpoints_only_and_is_not_refused_as_a_replay(tmp_path):
    """``export`` copies a checkpoint's tensors and rebuilds no model from config.yaml: an own-loop run gets its
    ordinary answer (here: no checkpoint yet), not the replay refusal."""
    run = own_loop_run(tmp_path / "own")
    proc = in_process("export", str(run), "--out", str(tmp_path / "m.safetensors"))
    assert_user_error(proc, "the run has no checkpoint")
    assert "model factory" not in proc.stderr


def test_a_trainer_run_without_loop_json_passes(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    assert read_origin(tmp_path) is None
    assert require_replayable(tmp_path, "nan hunt") is None


# --- loop.json written and read back ----------------------------------------------------------------------------


def test_write_origin_writes_the_record_read_origin_reads(tmp_path):
    write_origin(tmp_path, model_factory="pkg.mod:fn", dataset=None, shard_size=64, version="1.2.3")
    expected = {"writer": "steadytrain.Run", "version": "1.2.3", "model_factory": "pkg.mod:fn", "dataset": None,
                "shard_size": 64}  # fmt: skip
    assert json.loads((tmp_path / ORIGIN_FILE).read_text()) == expected
    assert read_origin(tmp_path) == expected
    assert [p.name for p in tmp_path.iterdir()] == [ORIGIN_FILE]  # atomic: no temporary file left


def test_write_origin_refuses_a_shard_size_below_one_and_writes_nothing(tmp_path):
    with pytest.raises(UserError, match="shard_size=0"):
        write_origin(tmp_path, model_factory=None, dataset=None, shard_size=0, version="1")
    assert not (tmp_path / ORIGIN_FILE).exists()


GOOD = {"writer": "steadytrain.Run", "version": "1", "model_factory": None, "dataset": None, "shard_size": 4}
DAMAGED = [
    ("not JSON", "{writer: steadytrain", "not valid JSON"),
    ("a list", json.dumps([GOOD]), "not list"),
    ("no writer", json.dumps({k: v for k, v in GOOD.items() if k != "writer"}), "'writer' is missing"),
    ("writer a number", json.dumps({**GOOD, "writer": 3}), "writer=3"),
    ("version null", json.dumps({**GOOD, "version": None}), "version=None"),
    ("factory a number", json.dumps({**GOOD, "model_factory": 5}), "model_factory=5"),
    ("dataset a list", json.dumps({**GOOD, "dataset": ["a"]}), "dataset=['a']"),
    ("shard_size zero", json.dumps({**GOOD, "shard_size": 0}), "shard_size=0"),
    ("shard_size true", json.dumps({**GOOD, "shard_size": True}), "shard_size=True"),
    ("shard_size text", json.dumps({**GOOD, "shard_size": "4"}), "shard_size='4'"),
    ("shard_size float", json.dumps({**GOOD, "shard_size": 4.0}), "shard_size=4.0"),
]


@pytest.mark.parametrize(("text", "says"), [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_damaged_loop_json_is_one_error_naming_the_file_the_key_and_the_fix(tmp_path, text, says):
    (tmp_path / ORIGIN_FILE).write_text(text)
    for read in (read_origin, lambda p: require_replayable(p, "eval")):
        with pytest.raises(UserError) as err:
            read(tmp_path)
        message = str(err.value)
        assert str(tmp_path / ORIGIN_FILE) in message and says in message and "restore loop.json" in message
        assert "\n" not in message


def test_a_dangling_loop_json_link_is_an_error_not_a_trainer_run(tmp_path):
    os.symlink(tmp_path / "gone.json", tmp_path / ORIGIN_FILE)
    with pytest.raises(UserError, match="does not exist"):
        read_origin(tmp_path)
