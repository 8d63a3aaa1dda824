"""The non-finite ledger of a run: ``nonfinite.jsonl`` (one line per rank per refused step) and ``exposure.json``.

A line is a :class:`~steadytrain.accumulate.NonFiniteEvent` (the one event type) with the optimizer
step it refused, written by the rank that saw it with one ``write`` and ``fsync`` (readable after a
kill). Its ``tags`` are the cycle's micro-batches as this rank saw them *before* any all-reduce::

    {"shard": [47, 3, ...], "index": [12, 5, ...], "finite": false, "nonfinite": [0, 7]}

``finite`` is the micro-batch's local mean loss; ``nonfinite`` the positions (in the micro-batch)
of the examples whose own loss was not finite, or ``null`` when the model returns a scalar mean.
``exposure.json`` maps each shard id to the examples seen from it (all ranks), written with every
refused step (so it covers the ledger even after a kill), at every checkpoint and at the end.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from steadytrain._check import check_int, check_type
from steadytrain._io import append_jsonl, brief, load_json, present, read_jsonl
from steadytrain.accumulate import NonFiniteEvent
from steadytrain.accumulate.events import REASONS
from steadytrain.data.sourcemap import read_sources
from steadytrain.diagnose.mixture import mixture_bounds
from steadytrain.errors import UserError

__all__ = [
    "EXPOSURE",
    "LEDGER",
    "SPIKES",
    "append_event",
    "append_spike",
    "check_shard_read",
    "dataset_bounds",
    "event_record",
    "outliers",
    "read_exposure",
    "read_ledger",
]

log = logging.getLogger("steadytrain.diagnose")

LEDGER = "nonfinite.jsonl"
SPIKES = "spikes.jsonl"
"""The spike ledger: the same records (one event type, ``reason: spike``), plus the statistics the step was
judged by and each micro-batch's per-example losses; ``nonfinite`` in a spike's micro-batch names its
*outlying* examples (see :func:`outliers`)."""
EXPOSURE = "exposure.json"
_EVENT_KEYS = ("cycle", "rank", "grad_norm", "micro_steps", "nonfinite_micro_batches", "tags", "action", "reason")


def _flags(tag: Any) -> Any:
    """A micro-batch's non-finite flags: given, or derived from its per-example losses (kept lazily)."""
    import torch  # the writing side's (a training process has it): reading a ledger does not import it

    if not isinstance(tag, dict):
        return None
    losses = tag.get("losses")
    return ~torch.isfinite(losses) if isinstance(losses, torch.Tensor) else tag.get("nonfinite")


def _positions(tags: tuple[Any, ...]) -> list[list[int] | None]:
    """Per micro-batch, the positions of non-finite example losses: one host read for the whole cycle."""
    import torch

    flags = [_flags(t) for t in tags]
    present = [f for f in flags if isinstance(f, torch.Tensor)]
    if not present:
        return [None if not isinstance(f, list) else f for f in flags]
    # host sync: only for a refused step
    joined = torch.cat([f.reshape(-1).to(present[0].device) for f in present]).cpu()
    out, start = [], 0
    for f in flags:
        if isinstance(f, torch.Tensor):
            part = joined[start : start + f.numel()]
            out.append(part.nonzero().flatten().tolist())
            start += f.numel()
        else:
            out.append(f if isinstance(f, list) else None)
    return out


def _plain(values: Any) -> list[int]:
    import torch

    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def event_record(event: NonFiniteEvent, step: int) -> dict[str, Any]:
    """The JSON line of ``event``, refused at optimizer ``step`` (1-based, as ``metrics.jsonl`` counts)."""
    bad = set(event.nonfinite_micro_batches)
    micro = []
    for i, (tag, positions) in enumerate(zip(event.tags, _positions(event.tags), strict=True)):
        tag = tag if isinstance(tag, dict) else {}
        micro.append(
            {
                "shard": _plain(tag.get("shard", [])),
                "index": _plain(tag.get("index", [])),
                "finite": i not in bad,
                "nonfinite": positions,
            }
        )
    norm = event.grad_norm
    return {
        "step": step,
        "rank": event.rank,
        "host": socket.gethostname(),  # the machine that computed it: the rank test pools a host's ranks
        "cycle": event.cycle,
        "reason": event.reason,
        "action": event.action,
        "grad_norm": norm if math.isfinite(norm) else str(norm),
        "micro_steps": list(event.micro_steps),
        "nonfinite_micro_batches": sorted(bad),
        "shards": sorted({s for mb in micro for s in mb["shard"]}),
        "tags": micro,
    }


def append_event(path: str | Path, event: NonFiniteEvent, step: int) -> dict[str, Any]:
    """Append ``event``'s line to the ledger (one write, fsync) and return it."""
    record = event_record(event, step)
    append_jsonl(path, record)
    return record


def outliers(
    losses: list[list[float] | None], means: list[float], limit: float
) -> tuple[list[list[int] | None], list[int]]:
    """The examples (per micro-batch positions) and micro-batches that make a step a spike on this rank.

    The largest per-example losses are taken, one by one, while the mean of those left is above ``limit``
    (the loss the step would have had to stay under) and the next one is above it too: the fewest examples
    without which this rank's share of the step is not out of line. A micro-batch without per-example losses
    (the model returns a scalar) is flagged as a whole when its mean is above ``limit``.
    """
    flat = sorted(
        ((v, i, j) for i, mb in enumerate(losses) if mb is not None for j, v in enumerate(mb)),
        key=lambda t: -t[0] if math.isfinite(t[0]) else -math.inf,
    )
    left, total = len(flat), math.fsum(v for v, _, _ in flat if math.isfinite(v))
    out: list[list[int] | None] = [None if mb is None else [] for mb in losses]
    for v, i, j in flat:
        if not left or not (math.isfinite(v) and v > limit and total / left > limit):
            break
        out[i].append(j)  # type: ignore[union-attr]
        left, total = left - 1, total - v
    whole = [i for i, (mb, m) in enumerate(zip(losses, means, strict=True)) if mb is None and m > limit]
    return [sorted(o) if o is not None else None for o in out], whole


def append_spike(path: str | Path, event: NonFiniteEvent, step: int, judged: dict[str, Any]) -> dict[str, Any]:
    """Append a spike's line (``event_record`` plus ``judged``: metric, value, threshold, median, mad, loss,
    batch, rollback_to, and per micro-batch ``losses``/``mean``) with its outlying examples; return it."""
    import torch

    record = event_record(event, step)
    tags = [t if isinstance(t, dict) else {} for t in event.tags]
    losses = [_plain(t["losses"]) if isinstance(t.get("losses"), torch.Tensor) else None for t in tags]
    means = [float(t["loss"]) if isinstance(t.get("loss"), torch.Tensor) else math.nan for t in tags]
    flagged, whole = outliers(losses, means, judged["loss_limit"])
    for mb, ex, m, bad in zip(record["tags"], losses, means, flagged, strict=True):
        ex = None if ex is None else [v if math.isfinite(v) else str(v) for v in ex]  # JSON has no NaN
        mb.update(losses=ex, mean=m if math.isfinite(m) else None, nonfinite=bad)
    record.update(kind="spike", nonfinite_micro_batches=whole, **judged)
    append_jsonl(path, record)
    return record


LEDGER_FIX = "the ledger is damaged (edited by hand?): correct or remove that line"
EXPOSURE_FIX = "the exposure file is damaged: delete it (the report then weighs shards by the batches in play)"
MAX_ID = 2**63 - 1
"""Largest shard id, example index, rank or step a ledger may name (an int64, as the data layer writes them)."""
_NORMS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _ints(value: Any, key: str, *, below: int | None = None) -> list[int]:
    """A list of integers in ``[0, below)`` (``[0, MAX_ID]`` without ``below``), none twice when ``below`` is given."""
    top = MAX_ID if below is None else below - 1
    if not isinstance(value, list):
        raise UserError(f"{key}={brief(value)} must be a list of integers")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= top:
            raise UserError(f"{key} holds {brief(item)}: each must be an integer from 0 to {top}")
    if below is not None and len(set(value)) != len(value):
        raise UserError(f"{key}={brief(value)} names a position twice")
    return value


def _id_list(ids: list[int]) -> str:
    """``0-3, 7, 9-12``: at most 8 runs of consecutive ids, then how many in all."""
    runs: list[list[int]] = []
    for x in sorted(ids):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:8])
    return text + (f", ... ({len(ids)} in all)" if len(runs) > 8 else "") if ids else "none"


def _in_dataset(key: str, shards: list[int], index: list[int] | None, bounds: Mapping[int, int]) -> None:
    """Each shard id one of the run's dataset, each example index (paired with its shard) inside that shard."""
    for j, s in enumerate(shards):
        if s not in bounds:
            raise UserError(f"{key} holds {s}: the run's dataset has no shard {s} (shards: {_id_list(list(bounds))})")
        if index is not None and index[j] >= bounds[s]:
            raise UserError(
                f"{key.removesuffix('shard')}index holds {index[j]}: shard {s} of the run's dataset has {bounds[s]} "
                f"records (indices 0 to {bounds[s] - 1})"
            )


def _tag(tag: Any, i: int, bounds: Mapping[int, int] | None = None) -> dict[str, Any]:
    """One micro-batch of an event: shard and index lists of one length, ``nonfinite`` positions inside them;
    with ``bounds`` (records per shard of the run's dataset) each shard id and example index inside the dataset."""
    if not isinstance(tag, dict):
        raise UserError(f"tags[{i}]={brief(tag)} must be an object with shard, index and nonfinite")
    shard = _ints(tag.get("shard"), f"tags[{i}].shard")
    index = _ints(tag.get("index"), f"tags[{i}].index")
    if len(shard) != len(index):
        raise UserError(f"tags[{i}]: {len(shard)} shard ids but {len(index)} example indices (one per example)")
    if bounds is not None:
        _in_dataset(f"tags[{i}].shard", shard, index, bounds)
    flagged = tag.get("nonfinite")
    if flagged is not None:
        _ints(flagged, f"tags[{i}].nonfinite", below=len(shard))
    return {"shard": shard, "index": index, "nonfinite": flagged}


def _grad_norm(value: Any, key: str = "grad_norm") -> float:
    if isinstance(value, str) and value in _NORMS:
        return _NORMS[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{key}={brief(value)} must be a number, or 'nan', 'inf' or '-inf'")
    return float(value)


def _fields(record: dict[str, Any], bounds: Mapping[int, int] | None = None) -> dict[str, Any]:
    """The event's fields, each checked (a UserError naming the key, without the file)."""
    tags = record["tags"]
    if not isinstance(tags, list):
        raise UserError(f"tags={brief(tags)} must be a list of micro-batches")
    if "shards" in record:  # the shards in play, as written: the same checks as each micro-batch's
        shards = _ints(record["shards"], "shards")
        if bounds is not None:
            _in_dataset("shards", shards, None, bounds)
    micro_steps = _ints(record["micro_steps"], "micro_steps")
    if len(micro_steps) != 2 or micro_steps[0] > micro_steps[1]:
        raise UserError(f"micro_steps={brief(micro_steps)} must be [first, last] micro-step of the cycle")
    for key in ("action", "reason"):
        check_type(key, record[key], str)
    if record["reason"] not in REASONS:
        raise UserError(f"reason={brief(record['reason'])} is not one of {', '.join(REASONS)}")
    n = len(tags)
    batch = record.get("batch")
    for key in ("batch", "rollback_to", "rollback"):  # a spike's: integers when present
        if record.get(key) is not None:
            check_int(key, record[key], 0, maximum=MAX_ID)
    for key in ("value", "threshold", "median", "mad", "loss", "loss_limit"):
        if key in record:
            _grad_norm(record[key], key)  # a number, or 'nan'/'inf'/'-inf' as written
    return {
        "batch": batch,
        "cycle": check_int("cycle", record["cycle"], 0, maximum=MAX_ID),
        "rank": check_int("rank", record["rank"], 0, maximum=MAX_ID),
        "grad_norm": _grad_norm(record["grad_norm"]),
        "micro_steps": tuple(micro_steps),
        "nonfinite_micro_batches": tuple(_ints(record["nonfinite_micro_batches"], "nonfinite_micro_batches", below=n)),
        "tags": tuple(_tag(t, i, bounds) for i, t in enumerate(tags)),
        "action": record["action"],
        "reason": record["reason"],
    }


def _event(record: Any, where: str, bounds: Mapping[int, int] | None = None) -> tuple[int, NonFiniteEvent]:
    """``(step, event)`` of one ledger line, every field checked; a UserError names the file, line and key."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: {brief(record)} is not a non-finite event (a JSON object); {LEDGER_FIX}")
    missing = [k for k in ("step", *_EVENT_KEYS) if k not in record]
    if missing:
        raise UserError(f"{where}: not a non-finite event of this version (no {', '.join(missing)}); {LEDGER_FIX}")
    try:
        step = check_int("step", record["step"], 1, maximum=MAX_ID)
        return step, NonFiniteEvent(**_fields(record, bounds))
    except UserError as err:
        raise UserError(f"{where}: {err}; {LEDGER_FIX}") from None


def read_ledger(
    run_dir: str | Path, name: str = LEDGER, *, bounds: Mapping[int, int] | None = None
) -> list[tuple[int, NonFiniteEvent]]:
    """Every ``(step, event)`` of the run's ledger ``name`` (:data:`LEDGER` or :data:`SPIKES`), in file order;
    none if it has no such ledger. With ``bounds`` (records per shard of the run's dataset:
    :func:`dataset_bounds`) every shard id must be one of the dataset's and every example index inside its shard.

    A last line cut short (the process was killed in the middle of its write) is skipped with a warning
    (:func:`~steadytrain._io.read_jsonl`, the project's one rule for a torn record).

    Raises:
        UserError: a line that is not an event, or one with a field of the wrong type or out of range (the
            message names the file, the line and the key).
    """
    path = Path(run_dir) / name
    out, seen = [], {}
    for n, record in read_jsonl(path, what="spike ledger" if name == SPIKES else "non-finite ledger"):
        step, event = _event(record, f"{path}: line {n}", bounds)
        # A spike rolled back and its step number trained again on the next batch: the batch tells them apart.
        key = (step, event.rank, event.batch)
        first = seen.setdefault(key, n)
        if first != n:  # one line per rank per refused step: a copy would count its examples twice
            raise UserError(f"{path}: line {n}: step {step} of rank {event.rank} is on line {first} too; {LEDGER_FIX}")
        out.append((step, event))
    return out


def dataset_bounds(run_dir: str | Path) -> dict[int, int] | None:
    """Records per shard of the dataset the run trained on (``data.json``): what its ledgers' shard ids and example
    indices are checked against. A mixture run's (``sources.json``): every source's, keyed by mixture id
    (:func:`.mixture.mixture_bounds`). None when the run has no ``data.json``, or its data is gone or has changed
    since (another fingerprint): the ledger's positions then cannot be judged.

    Raises:
        UserError: ``data.json`` or ``sources.json`` is not JSON (or not of its shape).
    """
    if (sources := read_sources(run_dir)) is not None:
        return mixture_bounds(sources)
    path = Path(run_dir) / "data.json"
    if not path.is_file():
        return None
    info = load_json(path, what="data description")
    where = info.get("path") if isinstance(info, dict) else None
    if not isinstance(where, str) or not Path(where).is_dir():
        return None
    from steadytrain.data import open_dataset

    try:
        ds = open_dataset(where)
        if info.get("fingerprint") not in (None, ds.fingerprint()):
            return None
    except UserError:  # a damaged index is the data's problem, told where the data is read: not the ledger's
        return None
    return {s.id: s.records for s in ds.shards}


def read_exposure(run_dir: str | Path) -> dict[int, int] | None:
    """Examples seen per shard (all ranks) as last written; None when the run wrote none yet.

    Raises:
        UserError: not a JSON object of shard id (a decimal string) to a count (an integer >= 0).
    """
    path = Path(run_dir) / EXPOSURE
    if not present(path):
        return None
    data = load_json(path, what="exposure file")
    if not isinstance(data, dict):
        raise UserError(f"{path}: {brief(data)} is not a mapping of shard id to examples seen; {EXPOSURE_FIX}")
    out = {}
    for key, count in data.items():
        # len first: int() of a 5000-digit string raises; str(int(k)) == k refuses "03" (a second key for 3)
        if not (len(key) <= 19 and key.isascii() and key.isdigit() and str(int(key)) == key and int(key) <= MAX_ID):
            raise UserError(f"{path}: key {brief(key)} is not a shard id (a decimal integer >= 0); {EXPOSURE_FIX}")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_ID:
            raise UserError(f"{path}: shard {key}: {brief(count)} is not a count of examples (>= 0); {EXPOSURE_FIX}")
        out[int(key)] = count
    return out


def check_shard_read(run_dir: str | Path, shard: int | None, command: str) -> None:
    """A :class:`UserError` when the run never read ``shard``: ``exposure.json`` counts no example of it and no
    ledger names it (or its dataset has no such shard). Nothing is said when the run wrote no exposure yet, or
    without a shard."""
    if shard is None:
        return
    bounds = dataset_bounds(run_dir)
    if bounds is not None and shard not in bounds:
        raise UserError(f"--shard {shard}: the run's dataset has no shard {shard} (shards: {_id_list(list(bounds))})")
    exposure = read_exposure(run_dir)
    if exposure is None or exposure.get(shard):
        return
    for name in (LEDGER, SPIKES):  # written before the exposure at each refused step: it covers them, but be sure
        if any(shard in t["shard"] for _, e in read_ledger(run_dir, name) for t in e.tags):
            return
    read = sorted(s for s, n in exposure.items() if n)
    raise UserError(
        f"--shard {shard}: this run never read shard {shard} ({EXPOSURE} counts no example of it; the shards it read: "
        f"{_id_list(read)}): give one of those (`steadytrain {command} report RUN` names the suspects)"
    )
