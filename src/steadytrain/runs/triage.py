"""Data, model state or hardware: replay a refused step in one process, as counterfactual variants.

``steadytrain triage RUN --step S`` rebuilds the weights step ``S`` started from (the newest checkpoint at or
before step ``S - 1``, or the run's initial weights) and replays the global batch step ``S`` really trained on
(rollbacks' skipped batches accounted for), forward and backward, as variants:

- ``recorded``: the same examples;
- ``without_suspects``: the same batch without the suspects: the examples of the shards ``nan report`` calls
  suspect, else the examples the ranks flagged at step ``S`` in the ledger;
- ``earlier_state``: the same batch from the checkpoint before that one (or the initial weights);
- ``repeat``: the recorded variant again: bitwise equal or not.

A variant is *finite* when its loss and every gradient are. The verdict: ``data`` when the recorded variant is
non-finite and the one without the suspects is finite; ``state`` when it is non-finite without the suspects too
(the note says whether it was already so from the earlier state); ``not-reproducible`` when the recorded variant is
finite on replay: the values the run saw were not computed from these inputs and weights, so the rank (and host)
that saw them is named from the ledger; ``none`` when step ``S`` was not refused (nothing to explain).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from steadytrain.diagnose import read_ledger, report
from steadytrain.diagnose.hunt import step_batch, take_rows
from steadytrain.diagnose.ledger import LEDGER
from steadytrain.diagnose.ranks import flagged_examples, read_hosts
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir
from steadytrain.runs.replay import run_model

__all__ = ["Triage", "triage"]


@dataclass
class Triage:
    """``to_dict``: ``verdict``, ``step``, ``replays`` (``{variant, loss, finite}``), ``rank``, ``host``, ``note``."""

    verdict: str
    step: int
    replays: list[dict[str, Any]] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    host: list[str] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _replay(model: nn.Module, batch: dict[str, Any]) -> tuple[float | None, bool, list[float]]:
    """``(loss, finite, per-example losses)`` of one forward and backward of ``batch`` (train mode, seed 0)."""
    model.zero_grad(set_to_none=True)
    model.train()
    torch.manual_seed(0)
    out = model(batch).float()
    loss = out.mean()
    loss.backward()
    grads = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    value = float(loss.detach())
    per = out.detach().reshape(-1).tolist() if out.dim() else [value]
    return (value if math.isfinite(value) else None), math.isfinite(value) and grads, per


def _suspects(run_dir: Path, events: list) -> tuple[set[int], set[tuple[int, int]], list[int]]:
    """Suspect shards (the report's), the examples flagged at the step, and the ranks that flagged them."""
    rep = report(run_dir)
    examples, ranks = set(), []
    for event in events:
        mine = flagged_examples(event)
        examples |= set(mine)
        if mine or event.nonfinite_micro_batches:
            ranks.append(event.rank)
    shards = set(rep.suspect_shards) if rep.verdict == "shard-selective" else set()
    return shards, examples, sorted(set(ranks)) or sorted({e.rank for e in events})


def triage(run_dir: str | Path, step: int) -> Triage:
    """The counterfactual replays of refused step ``step`` and a verdict (see the module docstring)."""
    run = open_run_dir(Path(run_dir))
    if not isinstance(step, int) or step < 1:
        raise UserError(f"--step {step!r}: give an optimizer step, 1 or more (a refused one: steadytrain nan report)")
    events = [e for s, e in read_ledger(run.path) if s == step]
    if not events:
        return Triage("none", step, note=f"step {step} was not refused: {LEDGER} records nothing to explain there")
    model, settings = run_model(run.path, before_step=step - 1)
    batch = step_batch(settings, step)
    shards, examples, ranks = _suspects(run.path, events)
    loss, finite, per = _replay(model, batch)
    replays = [{"variant": "recorded", "loss": loss, "finite": finite}]
    pairs = list(zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True))
    keep = np.array([r for r, (s, i) in enumerate(pairs) if s not in shards and (s, i) not in examples], dtype=np.int64)
    if shards or examples:
        kept = _replay(model, take_rows(batch, keep)) if len(keep) else (None, False, [])
        replays.append({"variant": "without_suspects", "loss": kept[0], "finite": kept[1]})
    earlier = _earlier(run.path, settings.checkpoint_step, batch)
    if earlier is not None:
        replays.append({"variant": "earlier_state", "loss": earlier[0], "finite": earlier[1]})
    again = _replay(model, batch)
    same = again[2] == per or all(math.isnan(a) and math.isnan(b) for a, b in zip(again[2], per, strict=True))
    replays.append({"variant": "repeat", "loss": again[0], "finite": again[1], "bitwise_equal": same})
    hosts = read_hosts(run.path, LEDGER)
    return _verdict(step, replays, ranks, sorted({hosts[r] for r in ranks if r in hosts}), settings.note)


def _earlier(run_dir: Path, checkpoint_step: int | None, batch: dict[str, Any]) -> tuple | None:
    if not checkpoint_step:
        return None  # the recorded variant already started from the initial weights
    model, _ = run_model(run_dir, before_step=checkpoint_step - 1)
    return _replay(model, batch)


def _verdict(step: int, replays: list[dict[str, Any]], ranks: list[int], hosts: list[str], note: str | None) -> Triage:
    by = {r["variant"]: r for r in replays}
    weights = f" ({note})" if note else ""
    if by["recorded"]["finite"]:
        where = ", ".join(f"rank {r}" for r in ranks) + (f" on {', '.join(hosts)}" if hosts else "")
        return Triage(
            "not-reproducible", step, replays, ranks, hosts,
            f"the recorded batch is finite on replay from the same weights{weights}: the non-finite values the run "
            f"saw at step {step} were not computed from these inputs and weights; {where} saw them: suspect that "
            "machine (its device or memory)"
            + ("; but the weights are older than the step's, so the state may only not have gone bad yet: "
               "checkpoint more often to tell" if note else ""),
        )  # fmt: skip
    if by.get("without_suspects", {}).get("finite"):
        return Triage(
            "data", step, replays, ranks, hosts, f"non-finite with the suspects, finite without them{weights}"
        )
    earlier = by.get("earlier_state")
    tail = (
        "; finite from the earlier state: the state went bad in between"
        if earlier and earlier["finite"]
        else "; non-finite from the earlier state too"
        if earlier
        else "; no earlier state to compare (the initial weights)"
    )
    return Triage("state", step, replays, ranks, hosts, f"non-finite without the suspects too{weights}{tail}")
