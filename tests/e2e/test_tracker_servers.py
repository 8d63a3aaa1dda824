"""Trackers against servers: a real MLflow tracking server over HTTP, and a W&B server that is not there.

The MLflow server is `mlflow server` itself (SQLite store and artifacts in the test's directory), started on a free
port on 127.0.0.1 and killed at the end whatever happens; the oracle is the run's own `metrics.jsonl`, read back
through `MlflowClient`. A dead server is a port on 127.0.0.1 nobody serves: the connection is refused, the tracker
is one warning and off, and the run goes on without waiting out the tracker's own (minutes-long) defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow.environment_variables
import pytest
from mlflow.tracking import MlflowClient

from steadytrain.train.observe.backends import _HTTP_LIMITS, Wandb
from tests.dist_utils import free_port
from tests.train.test_trackers import (
    _close,
    _expected,
    _fresh_wandb,
    _goodput_series,
    _items,
    _layer_series,
    _mlflow_metrics,
    _offline,
    _rows,
)
from tests.train_utils import run_cli, sets, write_text_dataset

_WANDB_LIMITS_ENV = ("WANDB_INIT_TIMEOUT", "WANDB_FINISH_TIMEOUT", "WANDB_FINISH_TIMEOUT_RAISES")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("trksrv") / "data", [32] * 10)


def _stop(proc: subprocess.Popen) -> None:
    """End the server's process group (``mlflow server`` runs uvicorn as its child): TERM, then KILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    proc.wait(timeout=15)


@pytest.fixture
def mlflow_server(tmp_path) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a running MLflow tracking server (its store and artifacts in ``tmp_path``)."""
    port, where = free_port(), tmp_path / "server"
    where.mkdir()
    store = ["--backend-store-uri", f"sqlite:///{where / 'mlflow.db'}", "--artifacts-destination", str(where / "art")]
    serve = ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd = [sys.executable, "-m", "mlflow", "server", *serve, *store]
    log = where / "server.log"
    # MLflow's job runner (GenAI scorer jobs: a process of its own beside the server's) is no part of tracking
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=where, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while not _answers(f"{uri}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer on {uri}:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        _stop(proc)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_each_mlflow_http_limit_parses_as_mlflow_reads_it(monkeypatch):
    """MLflow converts each variable with its own type (retries, backoff factor, timeout: int): a value it cannot
    convert fails every request before it is sent."""
    for key, value in _HTTP_LIMITS.items():
        variable = getattr(mlflow.environment_variables, key)
        monkeypatch.setenv(key, value)
        assert variable.get() == variable.type(value), key


@pytest.mark.timeout(240)
def test_an_mlflow_tracking_server_receives_every_row(tmp_path, data, mlflow_server, cli, monkeypatch):
    for key in _HTTP_LIMITS:  # unset during the run, and again afterwards (the run sets them in this process)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run = tmp_path / "run"
    items = _items(data, "run.max_steps=6", "eval.every_steps=3", "run.trackers=[mlflow]")
    r = cli("train", "--run-dir", str(run), *sets(*items, f"run.mlflow_uri={mlflow_server}"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tracker mlflow" not in r.stderr, r.stderr

    rows = _rows(run)
    assert [r["step"] for r in rows if "val_loss" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    state = json.loads((run / "trackers.json").read_text())
    assert state["mlflow"]["uri"] == mlflow_server
    client = MlflowClient(mlflow_server)
    run_id = state["mlflow"]["run_id"]
    got, expected = _mlflow_metrics(client, run_id), _expected(rows) | _layer_series(run) | _goodput_series(run)
    assert got.keys() == expected.keys() and {"loss", "lr", "grad_norm", "val_loss", "skipped"} <= got.keys()
    assert "layers/blocks.0/update_ratio" in got  # through the server too
    for key, pairs in expected.items():  # every row's every number, at its step
        _close(got[key], pairs, 1e-12, what=key)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.params["run.max_steps"] == "6"
    assert {a.path for a in client.list_artifacts(run_id)} == {"plots", "summary.md"}  # uploaded through the server


def test_wandb_gets_bounded_waits_and_a_users_own_setting_wins(tmp_path, monkeypatch):
    """The bounds reach W&B's own resolved settings (a misspelt or unknown setting would be dropped silently);
    ``finish_timeout`` bounds ``run.finish()``, which otherwise waits for a dead server forever. Without the user's
    ``WANDB_INIT_TIMEOUT``, steadytrain's 20 s bound is W&B's (the unreachable-server test below sets its own)."""
    for key in _WANDB_LIMITS_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in _offline(tmp_path, str(tmp_path / "wandb-dir")).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "wandb-dir").mkdir()
    for users, init_timeout in (("33", 33), (None, 20)):
        if users is None:
            monkeypatch.delenv("WANDB_INIT_TIMEOUT")
        else:
            monkeypatch.setenv("WANDB_INIT_TIMEOUT", users)  # the user's own
        tracker = Wandb(tmp_path / f"run-{users}")
        with _fresh_wandb():  # W&B reads the environment once per process: start from it
            try:
                tracker.start({"a": 1}, {}, 0)
                settings = tracker.handle.settings
                assert settings.init_timeout == init_timeout, users
                assert settings.finish_timeout == 60 and settings.finish_timeout_raises
            finally:
                with contextlib.suppress(Exception):
                    tracker.finish([], "FINISHED")


@pytest.mark.timeout(120)  # W&B's own default waits 90 s for the server, plus its login check
def test_an_unreachable_wandb_server_is_one_warning_and_the_run_goes_on(tmp_path, data, monkeypatch):
    """W&B's wait for the server is set as a user sets it (``WANDB_INIT_TIMEOUT``, which wins over steadytrain's 20 s:
    the test above) to 3 s: the same refusal after the same retries, 17 s sooner."""
    for key in _WANDB_LIMITS_ENV:  # steadytrain's bounds at the end of the run, not a user's
        monkeypatch.delenv(key, raising=False)
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {
        **_offline(tmp_path, str(wandb_dir)),
        "WANDB_MODE": "online",
        "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",  # nobody serves it: connection refused
        "WANDB_API_KEY": "x" * 40,  # a well-formed key, so that W&B goes to the server rather than asking for one
        "WANDB_INIT_TIMEOUT": "3",
        # W&B's look-up of the key's account before wandb.init (wandb.Settings.x_disable_viewer): twice 5 s of silent
        # retries against the dead server, never an error; the refusal asserted below is wandb.init's own request's
        "WANDB__DISABLE_VIEWER": "true",
    }
    run = tmp_path / "run"
    items = _items(data, "run.max_steps=4", "eval.every_steps=2", "run.trackers=[wandb]")
    with _fresh_wandb():
        proc = run_cli("train", "--run-dir", str(run), *sets(*items), timeout=95, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "tracker wandb" in line]
    assert len(warnings) == 1 and "start failed" in warnings[0], proc.stderr[-3000:]
    assert "connection refused" in warnings[0].lower() and "127.0.0.1" in warnings[0], warnings[0]
    rows = _rows(run)
    assert [r["step"] for r in rows if "val_loss" not in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert (run / "summary.md").is_file() and (run / "plots" / "loss.png").is_file()
