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
that saw them is named from the ledger; ``none`` when step ``S`` was not refused (nothing to explain). When every
example of the batch is a suspect there is nothing to replay without them: ``state`` if the earlier state is finite
on the batch, else ``undecided`` (the replay cannot tell the data from the state).

The replay must be of the step the ledger recorded: a step past the run's last, one refused for its item count
(not for non-finite values), data that changed since the run (``data.json``'s fingerprint; a mixture's: each
source's in ``sources.json``) or a rebuilt batch that lacks examples the ledger saw in play at step ``S`` (a batch
size or seed changed since) is an error, not a verdict.

A mixture run (``sources.json``) names the source of the shards the suspects are from: ``suspects`` in the JSON
(``{shard, source, source_shard}``, ``shard`` the mixture's id) and, for a ``data`` verdict, the note.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from steadytrain._io import load_json
from steadytrain._text import brief, short
from steadytrain.accumulate.events import NONFINITE_LOSS, NONFINITE_NORM
from steadytrain.data import open_dataset
from steadytrain.data.sourcemap import read_sources
from steadytrain.diagnose import read_ledger, report
from steadytrain.diagnose.batches import step_batch, take_rows
from steadytrain.diagnose.ledger import LEDGER
from steadytrain.diagnose.mixture import shard_name, source_keys, sources_phrase
from steadytrain.diagnose.ranks import flagged_examples, host_key, read_hosts
from steadytrain.errors import UserError
from steadytrain.rundir.layout import RunDir, open_run_dir
from steadytrain.rundir.origin import require_replayable
from steadytrain.rundir.schema import read_metrics
from steadytrain.runs.replay import run_model

if TYPE_CHECKING:
    from steadytrain.data.sourcemap import SourceMap

__all__ = ["Triage", "triage"]


@dataclass
class Triage:
    """``to_dict``: ``verdict``, ``step``, ``replays`` (``{variant, loss, finite}``), ``rank``, ``host``, ``note``;
    a mixture run's ``suspects`` too."""

    verdict: str
    step: int
    replays: list[dict[str, Any]] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    host: list[str] = field(default_factory=list)
    note: str = ""
    suspects: list[dict[str, Any]] | None = None
    """A mixture run's: ``{shard, source, source_shard}`` of each shard the suspects are from (the report's suspect
    shards and those of the examples flagged at the step); None for a single-source run."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.suspects is None:
            del out["suspects"]
        return out


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
    require_replayable(run.path, "triage")  # first: no check of the step can make an own-loop run replayable
    if not isinstance(step, int) or step < 1:
        raise UserError(f"--step {step!r}: give an optimizer step, 1 or more (a refused one: steadytrain nan report)")
    ledger = read_ledger(run.path)
    _within_run(run, step, {s for s, _ in ledger})
    events = [e for s, e in ledger if s == step]
    if not events:
        return Triage("none", step, note=f"step {step} was not refused: {LEDGER} records nothing to explain there")
    if all(e.reason not in (NONFINITE_NORM, NONFINITE_LOSS) for e in events):
        raise UserError(
            f"--step {step}: {LEDGER} says the step was refused for its item count ({events[0].reason}), not for "
            "non-finite values: there is nothing to replay; look at how the model counts the items of a micro-batch"
        )
    model, settings = run_model(run.path, before_step=step - 1)
    batch = step_batch(settings, step)
    pairs = list(zip(batch["shard"].tolist(), batch["index"].tolist(), strict=True))
    _same_batch(run.path, settings.data, step, events, pairs)
    shards, examples, ranks = _suspects(run.path, events)
    loss, finite, per = _replay(model, batch)
    replays = [{"variant": "recorded", "loss": loss, "finite": finite}]
    keep = np.array([r for r, (s, i) in enumerate(pairs) if s not in shards and (s, i) not in examples], dtype=np.int64)
    if shards or examples:  # nothing left without them: no replay (finite None), never a made-up non-finite one
        kept = _replay(model, take_rows(batch, keep)) if len(keep) else (None, None, [])
        replays.append({"variant": "without_suspects", "loss": kept[0], "finite": kept[1]})
    earlier = _earlier(run.path, settings.checkpoint_step, batch)
    if earlier is not None:
        replays.append({"variant": "earlier_state", "loss": earlier[0], "finite": earlier[1]})
    again = _replay(model, batch)
    same = np.array(again[2], np.float64).tobytes() == np.array(per, np.float64).tobytes()  # NaN == NaN, bit for bit
    replays.append({"variant": "repeat", "loss": again[0], "finite": again[1], "bitwise_equal": same})
    hosts = read_hosts(run.path, LEDGER)  # the step's own lines: a rank's host may have changed during the run
    seen = sorted({hosts[k] for e in events if e.rank in ranks and (k := host_key(step, e)) in hosts})
    return _name_sources(_verdict(step, replays, ranks, seen, settings.note), read_sources(run.path), shards, examples)


def _name_sources(found: Triage, sources: SourceMap | None, shards: set[int], examples: set[tuple[int, int]]) -> Triage:
    """A mixture run's ``found`` with the source of each shard the suspects are from (``shards``: the report's suspect
    shards; ``examples``: ``(shard, index)`` flagged at the step): in ``suspects`` and, for ``data``, the note."""
    if sources is None:
        return found
    ids = sorted(shards | {s for s, _ in examples})
    found.suspects = [{"shard": s, **source_keys(sources, s)} for s in ids]
    if found.verdict == "data" and ids:
        names = ", ".join(shard_name(sources, s) for s in ids)
        found.note += f"; the suspects are from {names}, {sources_phrase(sources, ids)}"
    return found


def _within_run(run: RunDir, step: int, refused: set[int]) -> None:
    """A step the run never reached is an error, not the verdict ``none`` (it was not refused: it never ran). The
    run reached its last row in ``metrics.jsonl`` and every step its ledger records (rows are written every
    ``run.log_every`` steps: a run killed between two writes refused steps past its last row, or before its first)."""
    rows = max((r["step"] for r in read_metrics(run.metrics)[0]), default=None)
    last = max(rows or 0, *refused, 0)
    if not last:
        raise UserError(
            f"--step {step}: the run never reached step {step}: it recorded no optimizer step ({run.metrics.name} "
            f"has no training row, {LEDGER} no refused step): nothing to triage"
        )
    if step > last:
        raise UserError(
            f"--step {step}: the run never reached step {step}: it has {last} optimizer steps "
            f"({run.metrics.name}{', ' + LEDGER if last != rows else ''}): give 1 to {last}"
        )


def _same_batch(run_dir: Path, data: Path, step: int, events: list, pairs: list[tuple[int, int]]) -> None:
    """The replay is of the examples the ledger recorded at ``step``: the same data, and every example in play."""
    for path, recorded, where in _fingerprints(run_dir, data):
        now = open_dataset(path).fingerprint()
        if recorded is not None and recorded != now:
            raise UserError(
                f"{path}: the data changed since the run trained on it (fingerprint {brief(recorded)} in {where}, "
                f"{now} now): a replay would not be of step {step}'s examples; triage against the data the run read"
            )
    rebuilt = Counter(pairs)
    missing = Counter((s, i) for e in events for t in e.tags for s, i in zip(t["shard"], t["index"], strict=True))
    missing -= rebuilt
    if missing:
        raise UserError(
            f"--step {step}: {LEDGER} has examples in play at step {step} that the rebuilt batch lacks (shard, index: "
            f"{brief(sorted(missing))}): the run's batch size, seed or data order changed since (a resume?); the "
            "replay would not be of that step"
        )


def _fingerprints(run_dir: Path, data: Path) -> list[tuple[Path, str | None, str]]:
    """``(dataset, fingerprint the run recorded or None, where)`` of each dataset the run read: ``data``
    (``data.json``), or every source of a mixture (``sources.json``)."""
    sources = read_sources(run_dir)
    if sources is not None:
        return [(Path(s.path), s.fingerprint or None, f"sources.json (source '{s.name}')") for s in sources.spans]
    info = load_json(run_dir / "data.json", what="data description") if (run_dir / "data.json").is_file() else {}
    return [(data, info.get("fingerprint") if isinstance(info, dict) else None, "data.json")]


def _earlier(run_dir: Path, checkpoint_step: int | None, batch: dict[str, Any]) -> tuple | None:
    if not checkpoint_step:
        return None  # the recorded variant already started from the initial weights
    model, _ = run_model(run_dir, before_step=checkpoint_step - 1)
    return _replay(model, batch)


def _verdict(step: int, replays: list[dict[str, Any]], ranks: list[int], hosts: list[str], note: str | None) -> Triage:
    by = {r["variant"]: r for r in replays}
    weights = f" ({note})" if note else ""
    if by["recorded"]["finite"]:
        where = ", ".join(f"rank {r}" for r in ranks) + (f" on {', '.join(map(short, hosts))}" if hosts else "")
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
    head = "non-finite without the suspects too" if "without_suspects" in by else "no example was flagged"
    if "without_suspects" in by and by["without_suspects"]["finite"] is None:
        head = "every example of the batch is a suspect: nothing left to replay without them"
        if not (earlier and earlier["finite"]):
            return Triage(
                "undecided", step, replays, ranks, hosts,
                f"{head}{weights}{tail}: the replay cannot tell the data from the state; look at the batch's "
                f"examples (steadytrain nan hunt RUN --step {step})",
            )  # fmt: skip
    return Triage("state", step, replays, ranks, hosts, f"{head}{weights}{tail}")
