"""``steadytrain repro RUN``: re-run a recorded run's first steps here and compare them bit for bit.

The seed's "re-run the validation suite whenever the fleet's host driver is upgraded": the same
config, seed and data, deterministic algorithms on, the LR schedule of the full run, stopped after
N optimizer steps; every loss and global gradient norm must equal the record exactly. When one does
not, the verdict names the first differing step and the environment differences (image, host, code,
settings) between the record and this machine that may explain it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._check import check_int
from steadytrain._text import error_text, one_line, short
from steadytrain.env import SCOPES, diff
from steadytrain.env.compare import IDENTITY, numerics_first
from steadytrain.errors import UserError
from steadytrain.rundir.origin import require_replayable
from steadytrain.runs.record import RunRecord, load_run, shown

__all__ = ["DEFAULT_STEPS", "Repro", "repro"]

DEFAULT_STEPS = 20

# What the re-run itself switches on (deterministic algorithms): not a difference of this machine.
REPRO_SETTINGS = frozenset(
    {
        "settings.deterministic_algorithms",
        "settings.deterministic_warn_only",
        "settings.cudnn_deterministic",
        "settings.cudnn_benchmark",
        "settings.env.CUBLAS_WORKSPACE_CONFIG",
    }
)
COMPARED = ("loss", "grad_norm", "skipped")


@dataclass
class Repro:
    """The verdict of :func:`repro`. ``reproduced`` is about the numbers; ``env_compared`` says whether the
    record had an environment to compare this machine with (``env.json``): the validation needs both."""

    reproduced: bool
    sentence: str
    steps: int
    first_differing_step: int | None = None
    differing: dict[str, list[Any]] = field(default_factory=dict)
    """At the first differing step: ``{"loss": [recorded, now], ...}``."""
    env: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rerun_dir: str | None = None
    env_compared: bool = True

    @property
    def validated(self) -> bool:
        """The numbers reproduced and the environment was compared: what ``steadytrain repro`` exits 0 on."""
        return self.reproduced and self.env_compared

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "validated": self.validated}


def _config(rec: RunRecord, notes: list[str]) -> Any:
    """The recorded config with deterministic algorithms on and the data the run read."""
    from steadytrain.train.setup.config import load_config

    overrides = ["run.deterministic=true"]
    data = rec.plan.get("data")
    if (rec.config.get("data") or {}).get("path") is not None and data:
        if not Path(data).is_dir():
            raise UserError(f"{rec.run.path}: the run's data {one_line(data)} is gone: restore it to re-run the run")
        overrides.append(f"data.path={data}")
    cfg = load_config(rec.run.config, overrides)
    if not (rec.config.get("run") or {}).get("deterministic"):
        notes.append("the record ran without deterministic algorithms; the re-run has them on")
    return cfg


def _check_data(rec: RunRecord, cfg: Any, notes: list[str]) -> None:
    from steadytrain.data.sourcemap import mixture_fingerprint
    from steadytrain.train.job.files import describe_data
    from steadytrain.train.setup.pieces import data_path

    recorded = (rec.data or {}).get("fingerprint")
    if cfg.data.sources is not None:  # a mixture: its sources' fingerprints, as data.json records them
        now = mixture_fingerprint([(s.name, describe_data(Path(s.path))["fingerprint"]) for s in cfg.data.sources])
    else:
        now = describe_data(data_path(cfg))["fingerprint"]
    if recorded is not None and recorded != now:
        notes.append(f"the data changed since the run: fingerprint {recorded} recorded, {now} now")


def _world_size(rec: RunRecord, notes: list[str]) -> None:
    here, there = int(os.environ.get("WORLD_SIZE", "1")), rec.plan.get("world_size", 1)
    if here != there:
        notes.append(
            f"the record ran on {there} rank(s), this re-run on {here}: the same examples per step, but sums in "
            "another order, so bit-exact equality is not expected (re-run under torchrun with the same world size)"
        )


def first_difference(recorded: list[dict[str, Any]], now: list[dict[str, Any]]) -> tuple[int | None, dict]:
    """The first step where the loss, the grad norm or the skip decision differ (bit for bit)."""
    for old, new in zip(recorded, now, strict=False):
        fields = {k: [old.get(k), new.get(k)] for k in COMPARED if old.get(k) != new.get(k)}
        if fields or old["step"] != new["step"]:
            return int(old["step"]), fields
    if len(now) < len(recorded):
        return int(recorded[len(now)]["step"]), {"step": [recorded[len(now)]["step"], None]}
    return None, {}


def env_differences(recorded: dict[str, Any] | None, now: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """Per scope, the fields of this machine's manifest that differ from the record's."""
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SCOPES}
    if recorded is None or now is None:
        return out
    for d in diff(recorded, now, ignore=IDENTITY | REPRO_SETTINGS):
        out[d.scope].append({"path": d.path, "a": d.a, "b": d.b})
    return out


def _env_phrase(env: dict[str, list[dict[str, Any]]] | None) -> str:
    if env is None:
        return "no environment record to compare this machine with (env.json is missing): the environment is unknown"
    found = numerics_first([d for s in SCOPES for d in env[s]], lambda d: d["path"])  # torch before 30 packages
    items = [f"{short(d['path'])} {shown(d['a'])} recorded, {shown(d['b'])} here" for d in found]
    if not items:
        return "the environment is the same as recorded (image, host, code, settings)"
    more = f" (+{len(items) - 4} more)" if len(items) > 4 else ""
    return "environment differences: " + "; ".join(items[:4]) + more


def _sentence(steps: int, first: int | None, fields: dict, env: dict | None, notes: list[str]) -> str:
    if first is None:
        text = f"reproduced exactly: losses and grad norms of steps 1-{steps} are bit-identical to the record"
        return f"{text}; {_env_phrase(env)}"
    values = ", ".join(f"{k} {shown(a)} recorded vs {shown(b)} now" for k, (a, b) in fields.items())
    text = f"not reproduced: step {first} differs ({values}); {_env_phrase(env)}"
    if env is not None and not any(env.values()):
        text += " - suspect non-determinism or a change this manifest does not capture"
    return text + "".join(f"; note: {one_line(n)}" for n in notes)


def repro(run: str | Path, steps: int | None = None, *, out: str | Path | None = None) -> Repro:
    """Re-run the first ``steps`` optimizer steps of ``run`` here and compare them with the record.

    Args:
        run: a run directory (its config, seed and data are reused).
        steps: how many optimizer steps (default :data:`DEFAULT_STEPS`, at most as many as recorded).
        out: a new directory for the re-run, kept; default a temporary one, removed afterwards.

    Raises:
        UserError: not a run directory, a run of the user's own loop (``loop.json``), no recorded metrics, the data
            is gone, ``out`` exists.
        Interrupted: SIGINT/SIGTERM during the re-run (``exit_code`` 130/75): nothing is compared.
    """
    from steadytrain.train.job.loop import Interrupted, TrainingStopped, train

    if steps is not None:
        check_int("steps", steps)
    require_replayable(Path(run), "repro")  # before the config is read: an own-loop run's is the user's own mapping
    rec = load_run(run)
    if out is not None and os.path.lexists(out):  # train's own refusal would speak of --resume, a flag repro lacks
        raise UserError(f"--out {one_line(os.fspath(out))} exists: give a new directory for the re-run (never reused)")
    if out is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("under torchrun give --out DIR: a new directory every rank can reach (no shared temp dir)")
    if not rec.metrics:
        raise UserError(f"{rec.run.path}: no recorded steps (metrics.jsonl is empty or missing): nothing to reproduce")
    n = min(steps or DEFAULT_STEPS, len(rec.metrics))
    notes: list[str] = []
    cfg = _config(rec, notes)
    _check_data(rec, cfg, notes)
    _world_size(rec, notes)
    tmp = None if out is not None else Path(tempfile.mkdtemp(prefix="steadytrain-repro-"))
    where = Path(out) if out is not None else tmp / rec.name
    try:
        try:
            train(cfg, run_dir=where, stop_after=n)
        except Interrupted as err:  # Ctrl-C: the user wants out, not a verdict on a cut-short re-run
            kept = f"the re-run is kept in {where}" if out is not None else "the re-run was removed"
            raise Interrupted(f"repro stopped by a signal: nothing was compared ({kept})", err.exit_code) from None
        except TrainingStopped as err:  # the record may have stopped too: compare what was written
            notes.append(f"the re-run stopped early: {error_text(err)}")
        now = load_run(where)
        first, fields = first_difference(rec.metrics[:n], now.metrics[:n])
        env = env_differences(rec.env, now.env) if rec.env is not None else None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    text = _sentence(n, first, fields, env, notes)
    kept = str(where) if out is not None else None
    return Repro(first is None, text, n, first, fields, env or {}, notes, kept, env_compared=env is not None)
