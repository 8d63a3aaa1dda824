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

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from steadytrain._io import append_jsonl, load_json, read_text
from steadytrain.accumulate import NonFiniteEvent
from steadytrain.errors import UserError

__all__ = ["EXPOSURE", "LEDGER", "append_event", "event_record", "read_exposure", "read_ledger"]

log = logging.getLogger("steadytrain.diagnose")

LEDGER = "nonfinite.jsonl"
EXPOSURE = "exposure.json"
_EVENT_KEYS = ("cycle", "rank", "grad_norm", "micro_steps", "nonfinite_micro_batches", "tags", "action", "reason")


def _flags(tag: Any) -> Any:
    """A micro-batch's non-finite flags: given, or derived from its per-example losses (kept lazily)."""
    if not isinstance(tag, dict):
        return None
    losses = tag.get("losses")
    return ~torch.isfinite(losses) if isinstance(losses, torch.Tensor) else tag.get("nonfinite")


def _positions(tags: tuple[Any, ...]) -> list[list[int] | None]:
    """Per micro-batch, the positions of non-finite example losses: one host read for the whole cycle."""
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


def _event(record: Any, where: str) -> tuple[int, NonFiniteEvent]:
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise UserError(f"{where}: not a non-finite event (no integer 'step')")
    try:
        data = {k: record[k] for k in _EVENT_KEYS}
        data["grad_norm"] = float(data["grad_norm"])
        data["nonfinite_micro_batches"] = tuple(data["nonfinite_micro_batches"])
        for tag in data["tags"]:
            if not isinstance(tag, dict) or len(tag["shard"]) != len(tag["index"]):
                raise ValueError("a micro-batch's shard and index lists differ in length")
        return record["step"], NonFiniteEvent.from_dict(data)
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{where}: not a non-finite event of this version ({err})") from None


def read_ledger(run_dir: str | Path) -> list[tuple[int, NonFiniteEvent]]:
    """Every ``(step, event)`` of the run's ledger, in file order; none if it has no ledger.

    A last line cut short (the process was killed in the middle of its write) is skipped with a warning.

    Raises:
        UserError: a line that is not a non-finite event (the message names the file and line).
    """
    path = Path(run_dir) / LEDGER
    if not path.exists():
        return []
    lines = read_text(path, what="non-finite ledger").splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                log.warning("%s: line %d is cut short (killed mid-write?): skipped", path, n)
                continue
            raise UserError(f"{path}: line {n} is not JSON") from None
        out.append(_event(record, f"{path}: line {n}"))
    return out


def read_exposure(run_dir: str | Path) -> dict[int, int] | None:
    """Examples seen per shard (all ranks) as last written; None when the run wrote none yet."""
    path = Path(run_dir) / EXPOSURE
    if not path.exists():
        return None
    data = load_json(path, what="exposure file")
    try:
        return {int(k): int(v) for k, v in data.items()}
    except (AttributeError, TypeError, ValueError):
        raise UserError(f"{path}: not a mapping of shard id to examples seen") from None
