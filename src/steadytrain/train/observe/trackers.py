"""Experiment trackers: TensorBoard, Weights & Biases and MLflow behind one small interface.

``run.trackers`` names them; rank 0 alone talks to them. Each gets the resolved config (flat keys such as
``batch.micro_batch_size``), the environment manifest's summary (``env.*``: ``env.json`` without its package
list), every row :mod:`~steadytrain.train.observe.metrics` writes to ``metrics.jsonl`` (training and validation rows:
their numbers, flags as 0/1, at the row's step) and, when the run ends, ``summary.md`` and ``plots/*.png``.

A tracker is never fatal. One whose package is missing, or that fails to start, log or finish, is one warning
naming it and the error, and is off for the rest of the run. It is called only after a row is on disk, and
its exceptions never propagate, so the run directory's records never depend on it.

Resume continues the same tracker run: ``RUN/trackers.json`` keeps each tracker's run id and the last row it
was sent (``[step, 0]`` a training row, ``[step, 1]`` a validation row). A row at or before that mark is not
sent again: after a resume that rewinds to its checkpoint, W&B and MLflow keep the values first logged for the
re-run steps (W&B's steps must increase; MLflow would keep both). TensorBoard is told to hide the rewound
steps (``purge_step``) and shows the re-run's values, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadytrain._io import load_json, write_text_atomic
from steadytrain._mapping import flatten
from steadytrain._text import error_text
from steadytrain.train.observe.backends import Mlflow, TensorBoard, Tracker, Wandb, mark_of

if TYPE_CHECKING:
    from steadytrain.rundir.layout import RunDir
    from steadytrain.train.setup.config import TrainConfig
    from steadytrain.train.setup.distributed import DistInfo

__all__ = ["TRACKERS", "TRACKERS_FILE", "Trackers", "end_run", "open_trackers", "start_trackers"]

log = logging.getLogger("steadytrain.train")

TRACKERS_FILE = "trackers.json"
DEFAULT = ["tensorboard"]
"""``run.trackers``' default: when TensorBoard is not installed it is skipped without a warning."""
_FAILED = object()


class Trackers:
    """The run's trackers as one: every call is guarded, so an error is one warning and that tracker is off."""

    def __init__(self, run: Path | None, trackers: list[Tracker]) -> None:
        self.path = run / TRACKERS_FILE if run is not None else None
        self.trackers = list(trackers)
        self.state: dict[str, dict[str, Any]] = {}
        """Per tracker: its ids and ``mark`` (the last row it was sent), as ``trackers.json`` keeps them."""

    def start(self, config: dict[str, Any], *, step: int = 0) -> None:
        """Open every tracker with the flat ``config`` (the environment's ``env.*`` keys included); ``step``: the
        step a resume starts after (0: a new run)."""
        self.state = {k: v for k, v in self._load().items() if isinstance(v, dict)}  # a tracker left out keeps its ids
        for t in list(self.trackers):
            kept = self.state.get(t.name, {})
            ids = self._call(t, "start", t.start, config, kept, step)
            if ids is not _FAILED and ids:  # the mark belongs to the tracker run it was sent to
                same = all(kept.get(k) == v for k, v in ids.items())
                self.state[t.name] = {**ids, "mark": kept.get("mark") if same else None}
        self._save()

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        """Send ``metrics.jsonl`` rows (already on disk) to every tracker; rows a tracker was sent before a resume
        rewound are not sent again."""
        moved = False
        for t in list(self.trackers):
            mark = self.state.get(t.name, {}).get("mark") if t.keeps_first else None
            new = [r for r in rows if mark is None or mark_of(r) > tuple(mark)]
            if new and self._call(t, "logging", t.log, new) is not _FAILED and t.name in self.state:
                self.state[t.name]["mark"] = list(mark_of(new[-1]))
                moved = True
        if moved:
            self._save()

    def log_final(self, row: dict[str, Any]) -> None:
        """Send one row of the run's end (its time account, at its last step) to every tracker: not a
        ``metrics.jsonl`` row, so no mark is kept for it."""
        for t in list(self.trackers):
            self._call(t, "logging", t.log, [row])

    def finish(self, artifacts: list[tuple[Path, str]], status: str) -> None:
        """Upload ``(file, name)`` pairs and close every tracker."""
        for t in list(self.trackers):
            self._call(t, "finishing", t.finish, artifacts, status)
        self.trackers.clear()

    def _call(self, t: Tracker, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as err:  # never fatal: the run's own records are written already
            hint = f" ({t.hint})" if what == "start" and t.hint else ""
            log.warning(
                "tracker %s: %s failed (%s: %s)%s; it is off for the rest of this run (metrics.jsonl is complete)",
                t.name, what, type(err).__name__, error_text(err), hint,
            )  # fmt: skip
            self.trackers.remove(t)  # its ids and mark stay: a resume continues the same tracker run
            with contextlib.suppress(Exception):
                t.abort()
            return _FAILED

    def _load(self) -> dict[str, Any]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            saved = load_json(self.path, what="trackers file")
        except Exception as err:
            log.warning("%s: %s: the trackers start new runs", self.path, error_text(err))
            return {}
        return saved if isinstance(saved, dict) else {}

    def _save(self) -> None:
        """``trackers.json``: ids and marks of the trackers that resume (TensorBoard needs none)."""
        if self.path is None or not self.state:
            return
        try:
            write_text_atomic(self.path, json.dumps(self.state, indent=2) + "\n")
        except Exception as err:
            log.warning("%s: not written (%s): a resume starts new tracker runs", self.path, error_text(err))
            self.path = None


_KINDS: dict[str, tuple[str, Callable[[Path, str | None], Tracker]]] = {
    "tensorboard": ("tensorboard", lambda run, uri: TensorBoard(run)),
    "wandb": ("wandb", lambda run, uri: Wandb(run)),
    "mlflow": ("mlflow", lambda run, uri: Mlflow(run, uri)),
}
"""Tracker -> (the module it needs, which is also its ``pip install steadytrain[...]`` extra; its builder)."""
TRACKERS = tuple(_KINDS)
"""The trackers a run may name."""


def start_trackers(run: RunDir, cfg: TrainConfig, info: DistInfo, *, step: int = 0) -> Trackers:
    """Rank 0: the trackers ``run.trackers`` names, started (``step``: where a resume starts); other ranks: none."""
    from steadytrain.train.setup.config import resolved_config

    return open_trackers(
        run, cfg.run.trackers, info, config=flatten(resolved_config(cfg)), step=step, mlflow_uri=cfg.run.mlflow_uri,
        quiet=cfg.run.trackers == DEFAULT,
    )  # fmt: skip


def open_trackers(
    run: RunDir, names: list[str], info: DistInfo, *, config: dict[str, Any], step: int = 0,
    mlflow_uri: str | None = None, quiet: bool = False,
) -> Trackers:  # fmt: skip
    """Rank 0: the trackers ``names``, started with ``config`` (flat keys) and the run's environment summary;
    other ranks: none. ``quiet``: a tracker not installed is said at debug level only (the default list)."""
    if not info.is_main:
        return Trackers(None, [])
    chosen = []
    for name in dict.fromkeys(names):
        module, build = _KINDS[name]
        if importlib.util.find_spec(module) is not None:
            chosen.append(build(run.path, mlflow_uri))
        elif quiet:  # the default (also as a resumed run's config.yaml lists it): no noise
            log.debug("%s is not installed: no %s logs (pip install steadytrain[%s])", name, name, name)
        else:
            log.warning("run.trackers: %s is not installed: pip install steadytrain[%s]; training goes on", name, name)
    trackers = Trackers(run.path, chosen)
    if chosen:
        trackers.start(config | _environment(run), step=step)
    return trackers


def _environment(run: RunDir) -> dict[str, Any]:
    """The environment manifest's summary as ``env.*`` flat keys (no package list)."""
    try:
        manifest = load_json(run.env, what="environment manifest") if run.env.exists() else {}
    except Exception:  # a manifest that cannot be read is the report's concern, not the trackers'
        manifest = {}
    out: dict[str, Any] = {}
    if isinstance(manifest, dict):
        image = manifest.get("image")
        if isinstance(image, dict):
            manifest = {**manifest, "image": {k: v for k, v in image.items() if k != "packages"}}
        out |= flatten(manifest, "env")
    return out


def artifacts(run: RunDir) -> list[tuple[Path, str]]:
    """``summary.md`` and ``plots/*.png`` as they are now, with the names they get in a tracker."""
    found = [(run.summary, "summary.md")] if run.summary.is_file() else []
    return found + [(p, f"plots/{p.name}") for p in sorted((run.path / "plots").glob("*.png")) if p.is_file()]


def end_run(
    trackers: Trackers, run: RunDir, ending: tuple[str | None, str] | None, report: Callable[..., Any] | None
) -> None:
    """Rank 0, after the job: ``report(run_dir, stopped)`` (the command's plots and ``summary.md``), then the trackers
    get them and close. ``ending``: why the run stopped (None: it finished) and its status; None: it crashed."""
    if ending is not None and report is not None:
        try:
            report(str(run.path), ending[0])
        except Exception as err:  # a picture is never worth losing a run over
            log.warning("%s: the report was not written (%s: %s)", run.path, type(err).__name__, error_text(err))
    if ending is not None and (row := goodput_row(run)) is not None:
        trackers.log_final(row)
    trackers.finish(artifacts(run) if ending is not None else [], ending[1] if ending is not None else "FAILED")


def goodput_row(run: RunDir) -> dict[str, Any] | None:
    """``goodput/*`` of the account the report wrote (``goodput.json``) at the run's last step: ``goodput/goodput``,
    ``goodput/wall_s``, ``goodput/productive_s`` and ``goodput/<cause>_s``; None when there is none to read."""
    path = run.path / "goodput.json"
    if not path.is_file():
        return None
    try:
        account = load_json(path, what="time account")
        row = {"step": int(account["attempts"][-1]["steps"][1]), "goodput/goodput": account["goodput"]}
        row |= {f"goodput/{k}": account[k] for k in ("wall_s", "productive_s")}
        return row | {f"goodput/{cause}_s": s for cause, s in account["badput"].items()}
    except Exception as err:  # the trackers go on without it; goodput.json is named
        log.warning("%s: not sent to the trackers (%s)", path, error_text(err))
        return None
