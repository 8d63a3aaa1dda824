"""Per-layer health read back: ``RUN/layers.jsonl``, and which layer a loss spike entered through.

The training run writes one row per layer per monitored step (every ``monitor.every_steps``, and every refused
step), the rows of one step in model order::

    {"step": 41, "layer": "blocks.1", "grad_norm": 37.5, "param_norm": 8.1, "update_norm": null, "update_ratio": null}

Gradient norms are taken before clipping; the update is the parameters after the optimizer step minus before, and
``update_ratio`` is ``update_norm / param_norm``. A refused step (non-finite, or a spike the policy skips) has
``update_norm`` and ``update_ratio`` null (no update was applied); a value that was not finite is null too. The
rows of a spike that was rolled back carry ``"rollback": n`` and stay in the file; the steps trained again after
it follow them, so a step number can come twice (once per try). Other rows come in increasing steps. A resume with
another ``monitor.group`` changes the layers from its first monitored step on: a step is compared with the steps
that have the same layers (:func:`spike_layers`), and :func:`latest_layers` keeps the rows since the last change.

Spike attribution (:func:`spike_layers`). For a spike at step ``S``, each layer's grad norm at ``S`` is divided by
the median of that layer's finite grad norms over the monitored steps before it (the rows earlier in the file
with a step below ``S``, of steps with the same layers as ``S``: after a rollback, those the run went on from). A
layer with fewer than :data:`MIN_HISTORY` such values, a median of 0 (it had no gradient before) or no finite grad
norm at ``S`` is listed but not ranked (``ratio`` null). The ranked layers come first, the largest ratio first
(model order between equals); ``first_layer`` is the top one, the layer whose gradient left its own usual size the
most, or null when none could be ranked. Each layer is measured against itself: a layer whose gradients are always
large is not blamed for being large.

Everything here is pure Python over the rows (no torch): the reading side of a run, as the ledgers are.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from steadytrain._io import brief, one_line, read_jsonl
from steadytrain.errors import UserError

__all__ = [
    "LAYERS",
    "MIN_HISTORY",
    "NORMS",
    "attribution_sentence",
    "by_step",
    "largest_update_ratios",
    "latest_layers",
    "layer_order",
    "read_layers",
    "spike_layers",
    "tries",
    "zero_grad_layers",
]

LAYERS = "layers.jsonl"
"""The file, in the run directory."""
NORMS = ("grad_norm", "param_norm", "update_norm", "update_ratio")
"""The numbers of a row: each a norm (>= 0), or null."""
MIN_HISTORY = 3
"""A layer's grad norm at a spike is ranked only against at least this many earlier finite values."""
LAYERS_FIX = "the file is damaged (edited by hand?): correct or remove that line"
_MAX_STEP = 2**63 - 1
_MAX_FLOAT = sys.float_info.max


def _row(value: Any, where: str) -> dict[str, Any]:
    """One row, every field checked: a :class:`UserError` naming ``where`` (``file:line``), the key and the value."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: {brief(value)} is not a layer row (a JSON object); {LAYERS_FIX}")
    missing = [k for k in ("step", "layer", *NORMS) if k not in value]
    if missing:
        raise UserError(f"{where}: a layer row needs {', '.join(missing)} (missing); {LAYERS_FIX}")
    for key in ("step", "rollback"):
        v = value.get(key)
        if key in value and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_STEP):
            raise UserError(f"{where}: {key}={brief(v)} must be an integer >= 1; {LAYERS_FIX}")
    if not isinstance(value["layer"], str) or not value["layer"]:
        raise UserError(f"{where}: layer={brief(value['layer'])} must be a layer's name (text); {LAYERS_FIX}")
    for key in NORMS:
        v = value[key]
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise UserError(f"{where}: {key}={brief(v)} must be a number or null; {LAYERS_FIX}")
        if v < 0:
            raise UserError(f"{where}: {key}={brief(v)} is negative: a norm is >= 0; {LAYERS_FIX}")
        if v > _MAX_FLOAT:  # an integer beyond any float: the medians and the plot could not use it
            raise UserError(f"{where}: {key}={brief(v)} is out of range (not a float); {LAYERS_FIX}")
    return value


def read_layers(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of ``RUN/layers.jsonl`` in file order (none when the run has no such file), each checked.

    A last line cut short (the writer was killed in the middle of its write) is skipped with a warning
    (:func:`~steadytrain._io.read_jsonl`, the project's one rule for a torn record).

    Raises:
        UserError: a line that is not JSON, not an object, lacks a key, has a value of the wrong type, a negative
            norm, names a layer twice in one step's rows, or has a step not above the previous rows' (but for a
            rolled-back try's rows) (the message names ``layers.jsonl:LINE``).

    Example:
        >>> import tempfile
        >>> read_layers(tempfile.mkdtemp())
        []
    """
    path = Path(run_dir) / LAYERS
    rows: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    trained: tuple[int, int] | None = None  # (step, line) of the last row of a try that was not rolled back
    for n, value in read_jsonl(path, what="layer log"):
        row = _row(value, f"{path}:{n}")
        if rows and _try(rows[-1]) != _try(row):
            seen = {}
            if "rollback" not in row and trained is not None and row["step"] <= trained[0]:
                raise UserError(
                    f"{path}:{n}: step {row['step']} comes after step {trained[0]} (line {trained[1]}): a run's rows "
                    f"go up in steps (a rolled-back try's excepted); {LAYERS_FIX}"
                )
        first = seen.setdefault(row["layer"], n)
        if first != n:
            raise UserError(
                f"{path}:{n}: layer {brief(row['layer'])} of step {row['step']} is on line {first} too; {LAYERS_FIX}"
            )
        if "rollback" not in row:
            trained = (row["step"], n)
        rows.append(row)
    return rows


def _try(row: dict[str, Any]) -> tuple[int, int | None]:
    return row["step"], row.get("rollback")


def tries(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rows grouped by monitored step as written: consecutive rows of one step (and one ``rollback``), in file
    order. A step trained twice (a spike rolled back, then the step again) is two groups.

    Example:
        >>> [len(g) for g in tries([{"step": 1, "layer": "a"}, {"step": 1, "layer": "b"}, {"step": 2, "layer": "a"}])]
        [2, 1]
    """
    out: list[list[dict[str, Any]]] = []
    for row in rows:
        if out and _try(out[-1][-1]) == _try(row):
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _names(group: list[dict[str, Any]]) -> list[str]:
    return [row["layer"] for row in group]


def latest_layers(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None]:
    """The rows since the layers last changed (a resume with another ``monitor.group``), and the step of the first
    of them (None: the layers never changed, all the rows).

    Example:
        >>> rows = [{"step": 1, "layer": "a"}, {"step": 2, "layer": "a.w"}, {"step": 2, "layer": "a.b"}]
        >>> latest_layers(rows)
        ([{'step': 2, 'layer': 'a.w'}, {'step': 2, 'layer': 'a.b'}], 2)
    """
    groups = tries(rows)
    start = len(groups) - 1
    while start > 0 and _names(groups[start - 1]) == _names(groups[-1]):
        start -= 1
    if start <= 0:
        return rows, None
    return [row for group in groups[start:] for row in group], groups[start][0]["step"]


def by_step(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each monitored step's rows in file order (a step trained twice has both tries' rows, the rolled-back one
    with its ``rollback`` key), the steps in the order first written.

    Example:
        >>> sorted(by_step([{"step": 2, "layer": "a"}, {"step": 1, "layer": "a"}]))
        [1, 2]
    """
    out: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["step"], []).append(row)
    return out


def layer_order(rows: list[dict[str, Any]]) -> list[str]:
    """The layers in model order (as first written).

    Example:
        >>> layer_order([{"layer": "tok"}, {"layer": "head"}, {"layer": "tok"}])
        ['tok', 'head']
    """
    return list(dict.fromkeys(row["layer"] for row in rows))


def zero_grad_layers(rows: list[dict[str, Any]]) -> list[str]:
    """The layers whose grad norm was 0 at every step where it was recorded (at least once), in model order: they
    never received a gradient (frozen, or cut off from the loss).

    Example:
        >>> zero_grad_layers([{"layer": "a", "grad_norm": 0.0}, {"layer": "b", "grad_norm": 0.0},
        ...                   {"layer": "b", "grad_norm": 2.0}, {"layer": "c", "grad_norm": None}])
        ['a']
    """
    recorded: dict[str, bool] = {}
    for row in rows:
        if row["grad_norm"] is not None:
            recorded[row["layer"]] = recorded.get(row["layer"], True) and row["grad_norm"] == 0
    return [layer for layer in layer_order(rows) if recorded.get(layer)]


def largest_update_ratios(rows: list[dict[str, Any]], n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` layers with the largest median update ratio over the steps that applied an update (rows whose
    ``update_ratio`` is not null), with that median; model order between equals.

    Example:
        >>> largest_update_ratios([{"layer": "a", "update_ratio": 0.1}, {"layer": "b", "update_ratio": 0.3},
        ...                        {"layer": "a", "update_ratio": 0.2}, {"layer": "b", "update_ratio": None}], n=1)
        [('b', 0.3)]
    """
    ratios: dict[str, list[float]] = {}
    for row in rows:
        if row["update_ratio"] is not None:
            ratios.setdefault(row["layer"], []).append(row["update_ratio"])
    order = {layer: i for i, layer in enumerate(layer_order(rows))}
    medians = [(layer, _median(v)) for layer, v in ratios.items()]
    medians.sort(key=lambda lm: (-lm[1], order[lm[0]]))
    return medians[:n]


def _median(values: list[float]) -> float:
    """The median; two middle values near the largest float give their mean, not infinity."""
    median = float(statistics.median(values))
    if math.isinf(median):
        ordered = sorted(values)
        median = ordered[len(ordered) // 2 - 1] / 2 + ordered[len(ordered) // 2] / 2
    return median


def _spike_tries(groups: list[list[dict[str, Any]]], spike_steps: list[int]) -> list[int]:
    """Indices into ``groups`` of the spikes' rows: for a step the ledger names ``k`` times, its rolled-back tries
    (a ``rollback`` key) first, then, when they are fewer than ``k``, its last try without one (a spike that was
    warned about or skipped, or the one that stopped the run)."""
    found: list[int] = []
    for step, k in sorted(Counter(spike_steps).items()):
        mine = [i for i, g in enumerate(groups) if g[0]["step"] == step]
        keyed = [i for i in mine if "rollback" in groups[i][0]][:k]
        plain = [i for i in mine if "rollback" not in groups[i][0]]
        found += keyed + (plain[-1:] if len(keyed) < k else [])
    return sorted(found)


def _ranked(spike: list[dict[str, Any]], history: dict[str, list[float]]) -> list[dict[str, Any]]:
    out = []
    for row in spike:
        before = history.get(row["layer"], [])
        median = _median(before) if len(before) >= MIN_HISTORY else None
        norm = row["grad_norm"]
        ratio = norm / median if norm is not None and median else None
        ratio = ratio if ratio is None or math.isfinite(ratio) else None  # 1e300 / 1e-300: no number to rank by
        out.append({"layer": row["layer"], "grad_norm": norm, "median": median, "ratio": ratio})
    ranked = sorted((r for r in out if r["ratio"] is not None), key=lambda r: -r["ratio"])  # stable: model order
    return ranked + [r for r in out if r["ratio"] is None]


def spike_layers(rows: list[dict[str, Any]], spike_steps: list[int]) -> list[dict[str, Any]]:
    """For each spike (``spike_steps``: the ledger's steps, a step once per spike) whose step has rows, every layer
    ranked by its grad norm against its own median before the spike (the rule is in the module docstring).

    Returns:
        In file order, ``{"step", "first_layer", "layers": [{"layer", "grad_norm", "median", "ratio"}]}``;
        ``first_layer`` is the top-ranked layer, or None when no layer could be ranked.

    Example:
        >>> rows = [{"step": s, "layer": "a", "grad_norm": g} for s, g in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 20.0))]
        >>> spike_layers(rows, [4])
        [{'step': 4, 'first_layer': 'a', 'layers': [{'layer': 'a', 'grad_norm': 20.0, 'median': 2.0, 'ratio': 10.0}]}]
    """
    groups = tries(rows)
    out = []
    for i in _spike_tries(groups, spike_steps):
        step = groups[i][0]["step"]
        history: dict[str, list[float]] = {}
        for group in (g for g in groups[:i] if _names(g) == _names(groups[i])):  # the same layers only
            for row in group:
                if row["step"] < step and row["grad_norm"] is not None:
                    history.setdefault(row["layer"], []).append(row["grad_norm"])
        layers = _ranked(groups[i], history)
        first = layers[0]["layer"] if layers and layers[0]["ratio"] is not None else None
        out.append({"step": step, "first_layer": first, "layers": layers})
    return out


def attribution_sentence(found: list[dict[str, Any]], limit: int = 3) -> str | None:
    """``the spike at step 41 entered through blocks.1 (grad norm 12.3x its median)``, for the first ``limit``
    spikes that have a ``first_layer`` (:func:`spike_layers`); None when none has.

    Example:
        >>> attribution_sentence([{"step": 41, "first_layer": "blocks.1",
        ...                        "layers": [{"layer": "blocks.1", "ratio": 12.3}]}])
        'the spike at step 41 entered through blocks.1 (grad norm 12.3x its median)'
    """
    named = [f for f in found if f["first_layer"] is not None]
    parts = [
        f"the spike at step {f['step']} entered through {one_line(f['first_layer'])} "
        f"(grad norm {f['layers'][0]['ratio']:.3g}x its median)"
        for f in named[:limit]
    ]
    if len(named) > limit:
        parts.append(f"{len(named) - limit} more in `steadytrain spikes report --json`")
    return "; ".join(parts) or None
