"""``steadytrain compare RUN_A RUN_B``: why two runs differ, in the order a person should look.

Config (the keys that differ) -> data (fingerprint, shard provenance) -> environment by scope
(image, host, code, settings: :func:`steadytrain.env.diff`) -> metrics (the first optimizer step
whose losses differ, and by how much), summed up in one sentence, e.g. "same image, code, config
and data; host differs (nvidia_driver 535.104.05 vs 550.90.07); losses identical until step 812,
then differ by up to 3e-07 relative".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain._io import one_line
from steadytrain.env import SCOPES, diff
from steadytrain.env.compare import IDENTITY
from steadytrain.runs.record import RunRecord, flatten, load_run, shown

__all__ = [
    "Comparison",
    "compare",
    "config_diff",
    "data_diff",
    "data_record",
    "env_diff",
    "goodput_side_by_side",
    "loss_divergence",
    "validation_losses",
]

log = logging.getLogger("steadytrain.runs")

CONFIG_IDENTITY = frozenset({"run.name", "run.dir"})
"""Config keys that name a run rather than change it: not compared."""


@dataclass
class Comparison:
    """The answer to "why do these two runs differ"; :meth:`to_dict` is ``compare --json``."""

    sentence: str
    config: dict[str, list[Any]]
    data: dict[str, Any]
    env: dict[str, list[dict[str, Any]] | None]
    first_divergent_step: int | None
    max_rel_diff: float | None
    steps: list[int]
    plot: str | None = None
    validation: dict[str, list[float | None]] | None = None
    """``{step: [A's val_loss, B's]}`` at the evaluation steps both runs have (None when either has none)."""
    goodput: dict[str, list[float | None]] | None = None
    """The two time accounts side by side: ``{"goodput": [a, b], "wall_s": ..., "productive_s": ..., cause: ...}``
    (a run without ``timeline.jsonl`` has None; None when neither has one)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    """Every config key whose value differs: ``{"batch.base_lr": [a, b]}`` (run name and dir aside).

    Example:
        >>> config_diff({"batch": {"base_lr": 0.01}, "run": {"name": "x"}}, {"batch": {"base_lr": 0.02}})
        {'batch.base_lr': [0.01, 0.02]}
    """
    fa, fb = flatten(a), flatten(b)
    keys = sorted((fa.keys() | fb.keys()) - CONFIG_IDENTITY)
    return {k: [fa.get(k), fb.get(k)] for k in keys if fa.get(k) != fb.get(k)}


def data_record(rec: RunRecord) -> dict[str, Any] | None:
    """The run's ``data.json``; for an older run, the dataset its plan names as it is now (if it exists)."""
    if rec.data is not None:
        return rec.data
    path = rec.plan.get("data")
    if not path or not Path(path, "index.json").exists():
        return None
    from steadytrain.train.job.files import describe_data

    return {**describe_data(Path(path)), "read_now": True}


def data_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    """Fingerprints, shard counts, majority provenance and odd shards of two data records."""
    if a is None or b is None:
        return {"same": None, "note": "no data record for " + " and ".join(n for n, r in (("A", a), ("B", b)) if not r)}
    pa, pb = a.get("provenance") or {}, b.get("provenance") or {}
    out: dict[str, Any] = {
        "same": a.get("fingerprint") == b.get("fingerprint"),
        "fingerprint": [a.get("fingerprint"), b.get("fingerprint")],
        "shards": [a.get("shards"), b.get("shards")],
        "provenance": {k: [pa.get(k), pb.get(k)] for k in sorted(pa.keys() | pb.keys()) if pa.get(k) != pb.get(k)},
    }
    oa, ob = sorted(a.get("outliers") or {}), sorted(b.get("outliers") or {})
    if oa != ob:
        out["odd_shards"] = [oa, ob]
    return out


def env_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, list[dict[str, Any]] | None]:
    """Per scope, the differing fields ``{"path", "a", "b"}`` (``None`` for a scope when a manifest is missing)."""
    if a is None or b is None:
        return dict.fromkeys(SCOPES)
    out: dict[str, list[dict[str, Any]] | None] = {s: [] for s in SCOPES}
    for d in diff(a, b, ignore=IDENTITY):
        out[d.scope].append({"path": d.path, "a": d.a, "b": d.b})
    return out


def _differ(x: Any, y: Any) -> bool:
    return (x is None) != (y is None) or (x is not None and x != y)


def loss_divergence(a: RunRecord, b: RunRecord) -> tuple[int | None, float | None, list[int]]:
    """The first common step whose losses differ (bit for bit), the largest relative difference over
    the common steps (finite losses only), and the common steps."""
    la, lb = dict(zip(a.steps, a.column("loss"), strict=True)), dict(zip(b.steps, b.column("loss"), strict=True))
    common = sorted(la.keys() & lb.keys())
    first = next((s for s in common if _differ(la[s], lb[s])), None)
    rel = [
        abs(la[s] - lb[s]) / max(abs(la[s]), abs(lb[s]), 1e-30)
        for s in common
        if la[s] is not None and lb[s] is not None and math.isfinite(la[s]) and math.isfinite(lb[s])
    ]
    return first, (max(rel) if rel else None), common


def _values(items: list[tuple[str, Any, Any]], limit: int = 3) -> str:
    text = ", ".join(f"{one_line(k)} {shown(x)} vs {shown(y)}" for k, x, y in items[:limit])
    return text + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def _metrics_phrase(first: int | None, rel: float | None, common: list[int], a: RunRecord, b: RunRecord) -> str:
    if not common:
        return "no common optimizer steps to compare losses"
    lengths = f" (A ran {len(a.steps)} steps, B {len(b.steps)})" if len(a.steps) != len(b.steps) else ""
    if first is None:
        return f"losses identical over all {len(common)} common steps{lengths}"
    size = f"by up to {rel:.2g} relative" if rel else "(a non-finite loss in one run only)"
    if first == common[0]:
        return f"losses differ from the first step, {size}{lengths}"
    return f"losses identical until step {first}, then differ {size}{lengths}"


def validation_losses(a: RunRecord, b: RunRecord) -> dict[str, list[float | None]] | None:
    """Both runs' validation losses at their common evaluation steps (keys are steps as strings, for JSON)."""
    if not a.evals or not b.evals:
        return None
    va, vb = ({r["step"]: r.get("val_loss") for r in rec.evals} for rec in (a, b))
    return {str(s): [va[s], vb[s]] for s in sorted(va.keys() & vb.keys())}


def _validation_phrase(val: dict[str, list[float | None]] | None) -> str:
    if val is None:
        return ""
    if not val:
        return "no common evaluation steps"
    step, (x, y) = max(val.items(), key=lambda kv: int(kv[0]))
    fmt = lambda v: "not finite" if v is None else f"{v:.6g}"  # noqa: E731
    return f"validation loss at step {step} (last common of {len(val)}): A {fmt(x)} vs B {fmt(y)}"


def sentence(config: dict, data: dict, env: dict, metrics: str, env_missing: str = "A or B") -> str:
    """The one-line verdict: what is the same, what differs (with values), then the losses."""
    same, differs = [], []
    if all(env[scope] is None for scope in SCOPES):
        differs.append(f"environment unknown (env.json missing in {env_missing})")
    for scope in SCOPES:
        if env[scope] is None:
            continue
        if not env[scope]:
            same.append(scope)
        else:
            items = [(d["path"].split(".", 1)[1], d["a"], d["b"]) for d in env[scope]]
            differs.append(f"{scope} differs ({_values(items)})")
    if config:
        differs.insert(0, f"config differs ({_values([(k, x, y) for k, (x, y) in config.items()])})")
    else:
        same.append("config")
    if data.get("same"):
        same.append("data")
    elif data.get("same") is None:
        differs.append(f"data unknown ({data['note']})")
    else:
        items = [("fingerprint", *data["fingerprint"])] + [(k, x, y) for k, (x, y) in data["provenance"].items()]
        differs.append(f"data differs ({_values(items)})")
    head = ("same " + ", ".join(same[:-1]) + (" and " if len(same) > 1 else "") + same[-1]) if same else ""
    parts = [p for p in (head, *differs, metrics) if p]
    prefix = "identical: " if not differs and "identical over" in metrics else ""
    return prefix + "; ".join(parts)


def compare(run_a: str | Path, run_b: str | Path, *, plot: str | Path | None = None) -> Comparison:
    """Compare two run directories; with ``plot``, also write both losses overlaid there.

    Raises:
        UserError: either is not a run directory, or a file in it is malformed.
    """
    a, b = load_run(run_a), load_run(run_b)
    config = config_diff(a.config, b.config)
    data = data_diff(data_record(a), data_record(b))
    env = env_diff(a.env, b.env)
    first, rel, common = loss_divergence(a, b)
    missing = " and ".join(n for n, r in (("A", a), ("B", b)) if r.env is None)
    val = validation_losses(a, b)
    metrics = "; ".join(p for p in (_metrics_phrase(first, rel, common, a, b), _validation_phrase(val)) if p)
    text = sentence(config, data, env, metrics, missing)
    out = Comparison(text, config, data, env, first, rel, [len(a.steps), len(b.steps)], validation=val)
    out.goodput = goodput_side_by_side(a.run.path, b.run.path)
    if plot is not None:
        from steadytrain.runs.plots import compare_plot

        out.plot = str(compare_plot(a, b, first, Path(plot)))
    return out


def goodput_side_by_side(a: Path, b: Path) -> dict[str, list[float | None]] | None:
    """Both runs' time accounts by key (:func:`steadytrain.runs.goodput.goodput`); a run without one has None."""
    from steadytrain.errors import UserError
    from steadytrain.rundir.timeline import CAUSES
    from steadytrain.runs.goodput import goodput

    accounts = []
    for path in (a, b):
        try:
            accounts.append(goodput(path).to_dict())
        except UserError as err:  # no timeline (an older run) or none readable: that side is empty, said why
            if (path / "timeline.jsonl").exists():
                log.warning("%s: no time account: %s", path, one_line(str(err)))
            accounts.append(None)
    if accounts == [None, None]:
        return None
    keys = ("goodput", "wall_s", "productive_s")
    return {k: [x and x[k] for x in accounts] for k in keys} | {
        c: [x and x["badput"][c] for x in accounts] for c in CAUSES
    }
