"""The trackers :mod:`steadytrain.train.observe.trackers` drives: TensorBoard, Weights & Biases and MLflow, each behind
:class:`Tracker`'s four calls (``start``, ``log``, ``finish``, ``abort``). They raise freely: the caller turns an
error into one warning and turns that tracker off."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

__all__ = ["Mlflow", "TensorBoard", "Tracker", "Wandb", "mark_of", "numeric", "tracking_uri"]

log = logging.getLogger("steadytrain.train")

_PARAMS_PER_CALL = 100  # MLflow's log_batch limits
_METRICS_PER_CALL = 1000
_MAX_PARAM_CHARS = 6000
_HTTP_LIMITS = {  # a dead tracking server costs seconds once, not minutes per call (MLflow's defaults retry ~7x)
    # each must parse as mlflow.environment_variables' own type (int but the jitter), or every request fails
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # waits 0 s, then 2 s (+ jitter) between the 3 tries
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",  # seconds per try: a server that accepts but never answers
}
_WANDB_LIMITS = {  # W&B's own defaults: init waits 90 s for a dead server, finish waits for it forever
    "init_timeout": ("WANDB_INIT_TIMEOUT", 20.0),
    "finish_timeout": ("WANDB_FINISH_TIMEOUT", 60.0),  # what is not uploaded stays on disk for `wandb sync`
    "finish_timeout_raises": ("WANDB_FINISH_TIMEOUT_RAISES", True),  # a timed-out finish is our one warning
}
"""W&B setting -> (the variable with which a user sets it, which then wins; steadytrain's value)."""


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """What a tracker charts of a ``metrics.jsonl`` row: every number and flag (as 0/1) but ``step``.

    Example:
        >>> numeric({"step": 3, "loss": 2.5, "grad_norm": None, "skipped": False, "note": "x"})
        {'loss': 2.5, 'skipped': 0.0}
    """
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and math.isfinite(v)  # None: not finite, left out
    }


def mark_of(row: dict[str, Any]) -> tuple[int, int]:
    """A row's place in the run: a step's validation row comes after its training row."""
    return (row["step"], 1 if "val_loss" in row else 0)


class Tracker:
    """One tracker. Its methods may raise: :class:`Trackers` turns an error into one warning and drops it."""

    name = ""
    hint = ""
    """What to check when it fails to start."""
    keeps_first = True
    """Rows at or before the saved mark are not sent again (False: the tracker can hide rewound steps itself)."""

    def __init__(self, run: Path) -> None:
        self.run = run

    def start(self, config: dict[str, Any], saved: dict[str, Any], step: int) -> dict[str, Any]:
        """Open (``saved``: the ids ``trackers.json`` kept; ``step``: the step a resume starts after); returns the
        ids to keep."""
        raise NotImplementedError

    def log(self, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def finish(self, artifacts: list[tuple[Path, str]], status: str) -> None:
        """Upload ``(file, name)`` pairs and close; ``status``: ``FINISHED``, ``FAILED`` or ``KILLED``."""
        raise NotImplementedError

    def abort(self) -> None:
        """Release what it holds after an error (best effort)."""


class TensorBoard(Tracker):
    """``RUN/tensorboard``: ``train/<key>`` and ``eval/<key>`` scalars, the config and summary as text, plots."""

    name = "tensorboard"
    keeps_first = False

    def start(self, config: dict[str, Any], saved: dict[str, Any], step: int) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        # a resume re-runs the steps after its checkpoint: TensorBoard hides what an earlier process logged there
        self.writer = SummaryWriter(str(self.run / "tensorboard"), purge_step=step + 1 if step else None)
        if not step:
            self.writer.add_text("config", "\n".join(f"    {k}: {json.dumps(v)}" for k, v in config.items()))
        return {}

    def log(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            group = "eval" if "val_loss" in row else "train"
            for key, value in numeric(row).items():
                self.writer.add_scalar(f"{group}/{key.removeprefix('val_')}", value, row["step"])
        self.writer.flush()

    def finish(self, artifacts: list[tuple[Path, str]], status: str) -> None:
        for path, name in artifacts:
            if path.suffix == ".png":
                self.writer.file_writer.add_summary(_png_summary(name.removesuffix(".png"), path.read_bytes()))
            else:
                self.writer.add_text(name, path.read_text(encoding="utf-8"))
        self.writer.close()

    def abort(self) -> None:
        self.writer.close()


_PNG_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}
"""A PNG's colour type (its header's) -> channels, for TensorBoard's image record."""


def _png_summary(tag: str, png: bytes) -> Any:
    """TensorBoard's image record of a PNG file as written (``add_image`` would decode it and encode it again)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
    channels = _PNG_CHANNELS.get(png[25], 4)
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=png)
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def _wandb_settings(wandb: Any) -> Any:
    """``wandb.Settings`` with :data:`_WANDB_LIMITS` that this W&B version knows and the user has not set."""
    known = getattr(wandb.Settings, "model_fields", {})
    return wandb.Settings(**{k: v for k, (env, v) in _WANDB_LIMITS.items() if k in known and env not in os.environ})


class Wandb(Tracker):
    """A W&B run: ``WANDB_MODE`` as the user set it; its files under the run directory unless ``WANDB_DIR`` is set."""

    name = "wandb"
    hint = "WANDB_MODE=offline logs without an account"

    def start(self, config: dict[str, Any], saved: dict[str, Any], step: int) -> dict[str, Any]:
        import wandb

        self.wandb = wandb
        self.handle = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "steadytrain",
            name=self.run.name,
            id=saved.get("id"),
            resume="allow",  # the same run again on --resume (a new one if the id is unknown)
            dir=None if os.environ.get("WANDB_DIR") else str(self.run),
            reinit="create_new",  # never finishes a run the user's own code holds
            settings=_wandb_settings(wandb),
        )
        self.handle.config.update(config, allow_val_change=True)  # a resume may change settings
        return {"id": self.handle.id}

    def log(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:  # a step's validation row merges into its training row's history entry
            self.handle.log(numeric(row), step=row["step"])

    def finish(self, artifacts: list[tuple[Path, str]], status: str) -> None:
        if artifacts:
            report = self.wandb.Artifact(f"report-{self.handle.id}", type="run-report")
            for path, name in artifacts:
                report.add_file(str(path), name=name)
            self.handle.log_artifact(report)
        self.handle.finish(exit_code=0 if status == "FINISHED" else 1)

    def abort(self) -> None:
        self.handle.finish(exit_code=1)


def tracking_uri(given: str | None, run: Path) -> str:
    """The MLflow store ``run.mlflow_uri`` names: a URI as given; a path as ``sqlite:`` (``*.db``) or ``file:``; absent:
    ``MLFLOW_TRACKING_URI``, else ``RUN/mlflow.db``.

    Example:
        >>> tracking_uri("/data/mlflow.db", Path("/runs/a")), tracking_uri("/data/mlruns", Path("/runs/a"))
        ('sqlite:////data/mlflow.db', 'file:///data/mlruns')
        >>> tracking_uri("http://127.0.0.1:5000", Path("/runs/a"))
        'http://127.0.0.1:5000'
    """
    if given is None:
        given = os.environ.get("MLFLOW_TRACKING_URI") or str(run / "mlflow.db")
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", given):
        return given
    path = Path(given).expanduser().resolve()
    return f"sqlite:///{path}" if path.suffix in (".db", ".sqlite", ".sqlite3") else path.as_uri()


class Mlflow(Tracker):
    """An MLflow run in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``steadytrain``), through ``MlflowClient``."""

    name = "mlflow"
    hint = "check run.mlflow_uri"

    def __init__(self, run: Path, uri: str | None) -> None:
        super().__init__(run)
        self.uri = tracking_uri(uri, run)
        self.run_id: str | None = None

    def start(self, config: dict[str, Any], saved: dict[str, Any], step: int) -> dict[str, Any]:
        if self.uri.startswith(("http:", "https:")):
            for key, value in _HTTP_LIMITS.items():
                os.environ.setdefault(key, value)  # a user's own settings win
        if self.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store otherwise
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.uri)
        self.run_id = saved.get("run_id") if saved.get("uri") == self.uri else None
        if self.run_id is not None and not self._reopen():
            self.run_id = None
        if self.run_id is None:
            tags = {"steadytrain.run_dir": str(self.run)}
            self.run_id = self.client.create_run(self._experiment(), run_name=self.run.name, tags=tags).info.run_id
        self._params(config, step)
        return {"run_id": self.run_id, "uri": self.uri}

    def _reopen(self) -> bool:
        """Whether the saved run is in the store (and is running again)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(self.run_id, status="RUNNING")
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("tracker mlflow: run %s is not in %s: resuming into a new MLflow run", self.run_id, self.uri)
            return False
        return True

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "steadytrain"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        where = None  # a SQLite store keeps its artifacts beside it (MLflow's default is ./mlruns in any directory)
        if self.uri.startswith("sqlite:///"):
            where = (Path(self.uri.removeprefix("sqlite:///").split("?")[0]).parent / "mlartifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=where)
        except Exception:  # another run created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _params(self, config: dict[str, Any], step: int) -> None:
        """Every key as a param; on a resume a changed value (MLflow refuses to change a param) becomes a tag."""
        from mlflow.entities import Param, RunTag

        have = self.client.get_run(self.run_id).data.params if step else {}
        params, tags = [], []
        for key, value in config.items():
            text = (value if isinstance(value, str) else json.dumps(value, default=str))[:_MAX_PARAM_CHARS]
            key = re.sub(r"[^\w\-. /]", "_", key)  # MLflow's characters for a name
            if key not in have:
                params.append(Param(key, text))
            elif have[key] != text:
                tags.append(RunTag(f"changed.{key}", f"{have[key]} -> {text} from step {step + 1}"[:_MAX_PARAM_CHARS]))
        for i in range(0, max(len(params), len(tags)), _PARAMS_PER_CALL):
            part = slice(i, i + _PARAMS_PER_CALL)
            self.client.log_batch(self.run_id, params=params[part], tags=tags[part])

    def log(self, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, row["step"]) for row in rows for k, v in numeric(row).items()]
        for i in range(0, len(metrics), _METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_PER_CALL])

    def finish(self, artifacts: list[tuple[Path, str]], status: str) -> None:
        for path, name in artifacts:
            folder = str(Path(name).parent)
            self.client.log_artifact(self.run_id, str(path), artifact_path=None if folder == "." else folder)
        self.client.set_terminated(self.run_id, status)

    def abort(self) -> None:
        if self.run_id is not None and not self.uri.startswith(("http:", "https:")):  # a dead server: no more waits
            self.client.set_terminated(self.run_id, "FAILED")
