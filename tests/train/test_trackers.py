"""Experiment trackers (`run.trackers`): TensorBoard, W&B and MLflow, read back from their own stores.

Offline stand-ins, never mocks: W&B in offline mode (its `.wandb` record log read back with W&B's own protobuf
records), MLflow on a SQLite store (`MlflowClient`), TensorBoard's event files (`EventAccumulator`). The oracle is
the run directory itself: every number of every `metrics.jsonl` row (training and validation) reaches every
tracker at the row's step, exactly once, also across a resume that rewinds; the config and the environment arrive
as flat keys; `summary.md` and the plots arrive as artifacts. A tracker that fails is one warning, never the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import PIL.Image
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2 as pb

from steadytrain._mapping import flatten
from steadytrain.rundir.layout import RunDir
from steadytrain.train.observe.trackers import start_trackers
from steadytrain.train.setup.config import load_config
from steadytrain.train.setup.distributed import DistInfo
from tests.cli_utils import launched
from tests.dist_utils import free_port
from tests.train_utils import TINY, run_cli, sets, write_text_dataset

ALL = "run.trackers=[tensorboard,wandb,mlflow]"

_MODELS = '''
import os
from steadytrain.train.setup.models import TinyLM


class Crashy(TinyLM):
    """TinyLM that raises at its CRASH_AT-th training forward (a crash at a step the test chooses)."""

    def forward(self, batch):
        if self.training:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == int(os.environ.get("CRASH_AT", "0")):
                raise RuntimeError("planted crash")
        return super().forward(batch)


def crashy(**kw):
    return Crashy(**kw)
'''


def _items(data: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.path={data}", "eval.holdout_shards=1", "run.log_every=2", *extra]


def _train(
    run: Path, items: list[str], *args: str, code: int = 0, with_wandb: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """A run; in its own process for a crash (``code`` 1: it keeps its traceback, as a user's crashed run does);
    with W&B (``with_wandb``: a resume whose config names it) in this process, as :func:`_fresh_wandb` isolates it."""
    argv = ("train", *args, *(("--run-dir", str(run)) if not args else ()), *sets(*items))
    if code == 1:
        proc = launched(*argv, **env)
    elif with_wandb or any("wandb" in item for item in items):
        with _fresh_wandb():
            proc = run_cli(*argv, **env)
    else:
        proc = run_cli(*argv, **env)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


@contextlib.contextmanager
def _fresh_wandb():
    """W&B's process-wide state as a new process holds it, before and after: its service process and settings (read
    from the environment once, at its first run) torn down, and ``sys.exit`` and ``sys.excepthook``, which a W&B run
    wraps and leaves wrapped, put back."""
    import wandb

    hooks = sys.exit, sys.excepthook
    wandb.teardown()
    try:
        yield
    finally:
        wandb.teardown()
        sys.exit, sys.excepthook = hooks


def _offline(tmp: Path, wandb_dir: str | None) -> dict[str, str]:
    """W&B offline with every one of its directories in ``tmp`` (``wandb_dir`` "": unset, the run directory's)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": wandb_dir or "",
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "MLFLOW_TRACKING_URI": "",  # the default store (RUN/mlflow.db) whatever the machine sets
    }


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float)}


def _wandb_records(path: Path) -> list[pb.Record]:
    """The records of a `.wandb` file: W&B's header, then LevelDB-log framing (32 KiB blocks, 7-byte chunk headers)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def _wandb_runs(where: Path) -> list[list[pb.Record]]:
    """Every offline W&B run under ``where``, oldest first."""
    return [_wandb_records(p) for p in sorted(where.glob("wandb/offline-run-*/run-*.wandb"))]


def _wandb_history(runs: list[list[pb.Record]]) -> list[tuple[int, dict[str, float]]]:
    out = []
    for records in runs:
        for r in (r for r in records if r.WhichOneof("record_type") == "history"):
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out.append((r.history.step.num, {k: float(v) for k, v in values.items() if not k.startswith("_")}))
    return out


def _wandb_config(records: list[pb.Record]) -> dict:
    out = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        out |= {u.key: json.loads(u.value_json) for u in updates}
    return out


def _mlflow_metrics(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as the trackers must hold it: key -> [(step, value)], training and validation rows."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in _numbers(row).items():
            out.setdefault(key, []).append((row["step"], value))
    return out


def _layer_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """layers.jsonl as the trackers must hold it: ``layers/<layer>/<key>`` -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (run / "layers.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in ("grad_norm", "param_norm", "update_norm", "update_ratio"):
            if row[key] is not None:
                out.setdefault(f"layers/{row['layer']}/{key}", []).append((row["step"], row[key]))
    return out


def _goodput_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """goodput.json as the trackers must hold it: ``goodput/*`` once, at the run's last step."""
    account = json.loads((run / "goodput.json").read_text())
    step = account["attempts"][-1]["steps"][1]
    values = {"goodput/goodput": account["goodput"], "goodput/wall_s": account["wall_s"]}
    values |= {"goodput/productive_s": account["productive_s"]}
    values |= {f"goodput/{cause}_s": s for cause, s in account["badput"].items()}
    return {k: [(step, v)] for k, v in values.items()}


def _close(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float, what: str = "") -> None:
    """The same steps in the same order, the same values (``rel``: float32 for TensorBoard, float64 elsewhere)."""
    assert [s for s, _ in got] == [s for s, _ in want], what
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel), what


def _tensorboard(run: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("trk") / "data", [32] * 10)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, data) -> Path:
    """Six steps, validation every 3, to all three trackers; W&B offline with WANDB_DIR unset, MLflow's default
    store: both land in the run directory."""
    tmp = tmp_path_factory.mktemp("tracked")
    run = tmp / "run"
    _train(run, _items(data, "run.max_steps=6", "eval.every_steps=3", ALL), **_offline(tmp, None))
    return run


def test_every_metrics_row_reaches_every_tracker_at_its_step(tracked):
    rows = _rows(tracked)
    assert {r["step"] for r in rows if "val_loss" in r} == {3, 6} and len(rows) == 8
    expected = _expected(rows) | _layer_series(tracked)  # each step's layer norms ride on its row
    expected |= _goodput_series(tracked)  # and the time account at the end
    assert {"loss", "lr", "grad_norm", "items_per_s", "val_loss", "val_items", "skipped"} <= expected.keys()
    assert {"layers/blocks.0/grad_norm", "layers/head/update_ratio"} <= expected.keys()

    state = json.loads((tracked / "trackers.json").read_text())
    client = MlflowClient(f"sqlite:///{tracked / 'mlflow.db'}")
    got = _mlflow_metrics(client, state["mlflow"]["run_id"])
    assert got.keys() == expected.keys()
    for key, pairs in expected.items():
        _close(got[key], pairs, 1e-12, what=key)

    runs = _wandb_runs(tracked)  # WANDB_DIR unset: under the run directory
    assert len(runs) == 1
    history = _wandb_history(runs)
    assert [s for s, _ in history] == [1, 2, 3, 4, 5, 6]  # a step's validation row merges into its training row
    for key, pairs in expected.items():
        _close([(s, v[key]) for s, v in history if key in v], pairs, 1e-12, what=key)

    acc = _tensorboard(tracked)
    for key, pairs in expected.items():
        tag = f"eval/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"
        _close([(e.step, e.value) for e in acc.Scalars(tag)], pairs, 1e-6, what=tag)


def test_the_config_and_environment_arrive_as_flat_keys(tracked):
    config = flatten(yaml.safe_load((tracked / "config.yaml").read_text()))
    env = json.loads((tracked / "env.json").read_text())
    assert config["batch.micro_batch_size"] == 4 and config["run.trackers"] == ["tensorboard", "wandb", "mlflow"]

    state = json.loads((tracked / "trackers.json").read_text())
    params = MlflowClient(f"sqlite:///{tracked / 'mlflow.db'}").get_run(state["mlflow"]["run_id"]).data.params
    assert params["batch.micro_batch_size"] == "4"
    assert json.loads(params["run.trackers"]) == config["run.trackers"]
    assert params["env.image.torch"] == env["image"]["torch"]
    assert params["env.image.python"] == env["image"]["python"]
    assert not any(k.startswith("env.image.packages") for k in params)  # the summary, not the package list

    logged = _wandb_config(_wandb_runs(tracked)[0])
    assert {k: logged[k] for k in config} == config
    assert logged["env.image.python"] == env["image"]["python"]
    assert logged["env.host.kernel"] == env["host"]["kernel"]


def test_summary_and_plots_are_artifacts_in_every_store(tracked):
    plots = sorted(p.name for p in (tracked / "plots").glob("*.png"))
    assert "loss.png" in plots and (tracked / "summary.md").is_file()

    state = json.loads((tracked / "trackers.json").read_text())
    client = MlflowClient(f"sqlite:///{tracked / 'mlflow.db'}")
    run_id = state["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run_id)} == {"plots", "summary.md"}
    assert sorted(Path(a.path).name for a in client.list_artifacts(run_id, "plots")) == plots
    stored = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    assert stored.is_relative_to(tracked)  # beside the SQLite store, not in the working directory
    assert (stored / "summary.md").read_text() == (tracked / "summary.md").read_text()

    records = _wandb_runs(tracked)[0]
    [artifact] = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert sorted(c.path for c in artifact.manifest.contents) == sorted(["summary.md", *(f"plots/{p}" for p in plots)])

    acc = _tensorboard(tracked)
    assert sorted(acc.Tags()["images"]) == sorted(f"plots/{p.removesuffix('.png')}" for p in plots)
    for p in plots:  # each image is the plot as written, at its size (PIL reads the file independently)
        (image,) = acc.Images(f"plots/{p.removesuffix('.png')}")
        assert image.encoded_image_string == (tracked / "plots" / p).read_bytes()
        assert (image.width, image.height) == PIL.Image.open(tracked / "plots" / p).size
    assert "summary.md/text_summary" in acc.Tags()["tensors"]


def test_an_mlflow_file_store_receives_every_row(tmp_path, data, monkeypatch):
    """``run.mlflow_uri: file:...`` (MLflow 3 refuses file stores unless allowed: steadytrain allows it for the run)."""
    store = tmp_path / "mlruns"
    items = _items(
        data, "run.max_steps=4", "eval.every_steps=2", "run.trackers=[mlflow]", f"run.mlflow_uri=file://{store}"
    )
    _train(tmp_path / "run", items)
    rows = _rows(tmp_path / "run")
    state = json.loads((tmp_path / "run" / "trackers.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store back
    got = _mlflow_metrics(MlflowClient(f"file://{store}"), state["mlflow"]["run_id"])
    expected = _expected(rows) | _layer_series(tmp_path / "run") | _goodput_series(tmp_path / "run")
    assert got.keys() == expected.keys() and "val_loss" in got and "layers/head/grad_norm" in got
    for key, pairs in expected.items():
        _close(got[key], pairs, 1e-12, what=key)


@pytest.mark.timeout(120)  # MLflow's own retries would take minutes per request
def test_a_tracker_that_fails_is_one_warning_and_the_run_completes(tmp_path, data, monkeypatch):
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)  # steadytrain's bounds, not a user's
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)  # a long name would cut the warning's cause off
    port = free_port()
    items = _items(data, "run.max_steps=6", "eval.every_steps=3", "run.trackers=[mlflow]")
    proc = _train(tmp_path / "run", [*items, f"run.mlflow_uri=http://127.0.0.1:{port}"])
    warnings = [line for line in proc.stderr.splitlines() if "mlflow" in line.lower() and "tracker" in line]
    assert len(warnings) == 1 and "start failed" in warnings[0], proc.stderr
    assert "Connection refused" in warnings[0] and f"127.0.0.1:{port}" in warnings[0], warnings[0]  # the server
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows if "val_loss" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert (tmp_path / "run" / "summary.md").is_file() and (tmp_path / "run" / "plots" / "loss.png").is_file()


def test_resume_after_a_crash_continues_the_same_runs_and_logs_each_step_once(tmp_path, data):
    """Crash in step 7 (rows 1-6 written and tracked, checkpoint at 4), resume to 16: the resume re-runs 5 and 6."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "trkmodels.py").write_text(_MODELS)
    env = {**_offline(tmp_path, str(tmp_path / "wandb-dir")), "PYTHONPATH": str(tmp_path / "models")}
    (tmp_path / "wandb-dir").mkdir()
    run = tmp_path / "run"
    items = _items(data, "model.name=trkmodels:crashy", "run.log_every=1", "checkpoint.every_steps=4", ALL)
    # 4 micro-batches per step: the 25th training forward is step 7's first
    _train(run, [*items, "run.max_steps=8", "eval.every_steps=2"], code=1, CRASH_AT="25", **env)
    first = _rows(run)
    assert [r["step"] for r in first if "val_loss" not in r] == [1, 2, 3, 4, 5, 6]
    ids = json.loads((run / "trackers.json").read_text())

    _train(run, ["run.max_steps=16"], "--resume", str(run), with_wandb=True, **env)
    rows = _rows(run)
    assert [r["step"] for r in rows if "val_loss" not in r] == list(range(1, 17))
    state = json.loads((run / "trackers.json").read_text())
    assert (state["wandb"]["id"], state["mlflow"]["run_id"]) == (ids["wandb"]["id"], ids["mlflow"]["run_id"])

    # W&B and MLflow keep the values first sent for the re-run steps 5 and 6; TensorBoard shows the re-run's
    kept = [r for r in first if r["step"] in (5, 6)] + [r for r in rows if r["step"] not in (5, 6)]
    kept.sort(key=lambda r: (r["step"], "val_loss" in r))
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    got = _mlflow_metrics(client, ids["mlflow"]["run_id"])
    for key in ("loss", "lr", "grad_norm", "val_loss"):
        _close(got[key], _expected(kept)[key], 1e-12, what=key)
    assert client.get_run(ids["mlflow"]["run_id"]).info.status == "FINISHED"
    tags = client.get_run(ids["mlflow"]["run_id"]).data.tags
    assert tags["changed.run.max_steps"] == "8 -> 16 from step 5"  # MLflow params cannot change: a tag says so

    runs = _wandb_runs(tmp_path / "wandb-dir")  # WANDB_DIR set: W&B's files go there
    assert len(runs) == 2 and not list(run.glob("wandb"))
    assert {r.run.run_id for records in runs for r in records if r.WhichOneof("record_type") == "run"} == {
        ids["wandb"]["id"]
    }
    history = _wandb_history(runs)
    assert [s for s, _ in history] == list(range(1, 17))  # increasing: nothing sent twice
    for key in ("loss", "val_loss"):
        _close([(s, v[key]) for s, v in history if key in v], _expected(kept)[key], 1e-12)

    scalars = _tensorboard(run).Scalars("train/loss")
    assert Counter(e.step for e in scalars) == Counter(range(1, 17))
    _close([(e.step, e.value) for e in scalars], _expected(rows)["loss"], 1e-6)


def test_a_missing_package_is_one_warning_naming_the_extra(tmp_path, monkeypatch, caplog):
    """``None`` in ``sys.modules`` is how Python marks a module as absent (``import`` raises, ``find_spec`` is None)."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = RunDir(tmp_path)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    with caplog.at_level(logging.DEBUG, logger="steadytrain"):
        quiet = start_trackers(run, load_config(None, []), info)  # the default [tensorboard]
    assert quiet.trackers == [] and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="steadytrain"):
        start_trackers(run, load_config(None, ["run.trackers=[tensorboard,wandb]"]), info)
    assert [r.getMessage() for r in caplog.records] == [
        "run.trackers: tensorboard is not installed: pip install steadytrain[tensorboard]; training goes on",
        "run.trackers: wandb is not installed: pip install steadytrain[wandb]; training goes on",
    ]
    assert not (tmp_path / "trackers.json").exists()
