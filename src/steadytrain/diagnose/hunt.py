"""Replay one shard (or one optimizer step) of a run in one process and find what turns non-finite.

The seed's procedure, done for the user: run only the suspect shard's data through the model as it
was before the failure, with a forward hook on every module; the first module (in execution order)
whose output is non-finite names where it starts. The examples are narrowed to single ones: every
example that produces a non-finite value on its own, and no other (per-row flags from the hooks, or
halving a bad chunk recursively, bisection, where values cannot be pinned to rows). Those rows are
checked against the run's schema (or one inferred from the shards whose provenance matches the
majority), and the shard's provenance is compared with the majority's. When no forward value is
non-finite, a second sweep backpropagates each chunk and checks the gradients instead.

Cost: one forward pass over the shard with finiteness flags per module output (read once per
chunk). The hooks also flag rows: in a model whose examples do not interact (eval mode: no batch
statistics) a bad chunk's bad rows are read from them directly; a chunk whose non-finite values
cannot be pinned to rows (a gradient, a scalar loss, outputs that mix rows) is bisected, with
small forward passes for that chunk only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor, nn

from steadytrain.data import check_table, healthy_shards, infer_schema, open_dataset, provenance_differences
from steadytrain.diagnose._hooks import Probe
from steadytrain.diagnose.batches import shard_batch, step_batch, take_rows
from steadytrain.diagnose.ledger import LEDGER, SPIKES, check_shard_read, dataset_bounds, read_ledger
from steadytrain.diagnose.mixture import in_mixture
from steadytrain.diagnose.outliers import REFERENCE_SHARDS, example_losses, loss_outliers
from steadytrain.diagnose.settings import ReplaySettings
from steadytrain.errors import UserError

__all__ = ["MIN_CHUNK", "HuntReport", "Loader", "hunt", "sweep"]

log = logging.getLogger("steadytrain.diagnose")

MIN_CHUNK = 256
"""Examples per forward pass of the sweep at least (no gradients are kept: larger than a training micro-batch)."""


@dataclass
class HuntReport:
    """What :func:`hunt` found. ``to_dict`` has the contract keys ``first_module``, ``examples`` (shard-local
    indices), ``fields`` (``{example, field, value, kind}``) and ``provenance_diff`` (``{key: [this, majority]}``)."""

    shard: int | None
    first_module: str | None
    examples: list[int]
    fields: list[dict[str, Any]]
    provenance_diff: dict[str, list[Any]]
    checkpoint: str | None = None
    """The checkpoint whose weights were replayed; None with ``checkpoint_step`` 0: the run's initial weights."""
    checkpoint_step: int | None = None
    """The optimizer step after which the replayed weights were taken (0: before step 1)."""
    note: str | None = None
    """None when the weights are exactly those the replayed step started from; else what they are instead."""
    stage: str | None = None
    """``forward`` (a module output or the loss), ``backward`` (only a gradient), or None (nothing)."""
    examples_checked: int = 0
    step: int | None = None
    reproduced: bool | None = None
    """With ``step``: whether the replayed step's loss or gradient norm was non-finite."""
    bad: list[list[int]] = field(default_factory=list)
    """Every ``[shard, index]`` found (with ``step`` the batch may span several shards)."""
    kind: str = "nonfinite"
    """``nonfinite`` (``nan hunt``: values that turn non-finite) or ``spike`` (``spikes hunt``: outlying losses)."""
    limit: float | None = None
    """``spike``: the loss beyond which an example is an outlier (from the reference shards' losses)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"sentence": self.sentence}

    @property
    def sentence(self) -> str:
        where = f"step {self.step}" if self.step is not None else f"shard {self.shard}"
        if self.kind == "spike":
            head = (
                f"{where}: {len(self.bad)} of {self.examples_checked} examples have a loss beyond the healthy "
                f"shards' limit {self.limit:.4g}"
            )
            return self._details(head)
        if self.stage is None:
            head = f"{where}: nothing non-finite in {self.examples_checked} examples"
            return head + (" (the step does not reproduce)" if self.step is not None else "")
        what = f"first in module {self.first_module!r}" if self.first_module else "in the gradients only"
        head = f"{where}: {len(self.bad)} of {self.examples_checked} examples produce a non-finite value, {what}"
        return self._details(head)

    def _details(self, head: str) -> str:
        if self.fields:
            f = self.fields[0]
            head += f"; example {f['example']}: field {f['field']!r} = {f['value']!r} ({f['kind']})"
        if self.provenance_diff:
            key, (mine, major) = next(iter(self.provenance_diff.items()))
            head += f"; its {key} is {mine!r} where the majority of shards have {major!r}"
        return head


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


class _Runner:
    """Runs a model on sub-batches with a :class:`Probe`; one host read per run."""

    def __init__(self, model: nn.Module, batch: dict[str, Any], backward: bool) -> None:
        self.model, self.batch, self.backward = model, batch, backward
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.probe = Probe(model)
        self.first_module: str | None = None

    def check(self, rows: np.ndarray, *, note: bool = False) -> tuple[bool, np.ndarray, bool]:
        """``(anything non-finite, per-row flags, a non-finite value not attributable to rows)`` for ``rows``."""
        n, probe = len(rows), self.probe
        probe.reset(n, self.device)
        sub = _to(take_rows(self.batch, rows), self.device)
        unattributed = [probe.unattributed]
        with torch.set_grad_enabled(self.backward):
            out = self.model(sub)
            loss_bad = ~torch.isfinite(out.detach())
            if out.dim() == 1 and len(out) == n:
                probe.row_bad |= loss_bad
            else:
                unattributed.append(loss_bad.any())
            if self.backward:  # a gradient cannot be pinned to a row
                grads = torch.autograd.grad(out.float().mean(), self.params, allow_unused=True)
                unattributed += [~torch.isfinite(g).all() for g in grads if g is not None]
        # Every module's flag went into row_bad or unattributed: one host read says whether anything was hit.
        flags = torch.cat([probe.row_bad, torch.stack(unattributed).any().reshape(1)]).cpu().numpy()
        rows_bad, other = flags[:-1], bool(flags[-1])
        hit = bool(rows_bad.any()) or other
        if hit and note and self.first_module is None:
            self.first_module = probe.first()
        return hit, rows_bad, other

    def bad(self, rows: np.ndarray) -> bool:
        """Whether the model, run on ``rows`` of the batch, produces a non-finite value anywhere."""
        return self.check(rows)[0]


def _bisect(bad: Callable[[np.ndarray], bool], rows: np.ndarray, known_bad: bool = False) -> list[int]:
    """Every single row ``bad`` holds on by itself, found by halving the sets ``bad`` holds on."""
    if not known_bad and not bad(rows):
        return []
    if len(rows) == 1:
        return rows.tolist()
    mid = len(rows) // 2
    found = _bisect(bad, rows[:mid]) + _bisect(bad, rows[mid:])
    if not found:
        log.warning("%d examples are non-finite together but none alone (batch statistics?)", len(rows))
        return rows.tolist()
    return found


def sweep(
    model: nn.Module, batch: dict[str, Any], chunk: int, *, bisect_only: bool = False
) -> tuple[list[int], str | None, str | None]:
    """Bad row positions, the first module, and the stage (forward, then backward if the forward is clean).

    A bad chunk's rows come from the hooks' per-row flags when every non-finite output could be pinned
    to rows and not every row is flagged (rows that mix, such as batch statistics, flag them all);
    otherwise (or with ``bisect_only``) the chunk is bisected down to single examples.
    """
    n = len(batch["index"])
    for backward in (False, True):
        runner = _Runner(model, batch, backward)
        found: list[int] = []
        try:
            for start in range(0, n, chunk):
                rows = np.arange(start, min(start + chunk, n))
                hit, rows_bad, other = runner.check(rows, note=True)
                if not hit:
                    continue
                if bisect_only or other or not rows_bad.any() or (rows_bad.all() and len(rows) > 1):
                    found += _bisect(runner.bad, rows, known_bad=True)
                else:
                    found += rows[rows_bad].tolist()
        finally:
            runner.probe.close()
        if found:
            return found, runner.first_module, "backward" if backward else "forward"
    return [], None, None


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def _fields(ds: Any, shard: int, examples: list[int], schema: Any) -> list[dict[str, Any]]:
    """Schema violations of the given rows of ``shard`` (raw, as written), one entry per field and kind."""
    if not examples:
        return []
    schema = schema if schema is not None else infer_schema(ds, healthy_shards(ds))
    rows = ds.read_shard(shard).take(pa.array(examples, type=pa.int64()))
    out = []
    for name, kinds in check_table(rows, schema).items():
        for kind, mask in kinds.items():
            for pos in np.flatnonzero(mask):
                value = rows.column(name)[int(pos)].as_py() if name in rows.column_names else None
                out.append({"example": examples[pos], "field": name, "value": _json_value(value), "kind": kind})
    for name in rows.column_names:
        if name not in schema.fields:
            out += [{"example": e, "field": name, "value": None, "kind": "unexpected_column"} for e in examples]
    return sorted(out, key=lambda f: (f["example"], f["field"], f["kind"]))


def _first_event_step(run_dir: Path, shard: int | None, ledger: str = LEDGER) -> int | None:
    events = read_ledger(run_dir, ledger, bounds=dataset_bounds(run_dir))
    mine = [s for s, e in events if shard is None or any(shard in t["shard"] for t in e.tags)]
    return min(mine or [s for s, _ in events], default=None)


Loader = Callable[..., tuple[nn.Module, ReplaySettings]]
"""``loader(run_dir, checkpoint=..., before_step=...) -> (model, settings)``: builds a run's model with the
weights of a checkpoint (or its initial weights) and the :class:`ReplaySettings` a replay needs. Building a
model is the training layer's business: the command passes :func:`steadytrain.runs.replay.run_model`."""


def _load(
    loader: Loader, run_dir: Path, model: nn.Module | None, checkpoint: Any, before: int | None
) -> tuple[nn.Module, ReplaySettings]:
    """The model and the replay settings: the run's model with the weights of the newest state at or before
    step ``before`` (a checkpoint, or the run's initial weights; never a later one), or ``model`` as given."""
    built, settings = loader(run_dir, checkpoint=checkpoint, before_step=before)
    if model is None:
        return built, settings
    return model, replace(
        settings,
        checkpoint=None,
        checkpoint_step=None,
        note="the model as given (its own weights; no checkpoint used)",
    )


def hunt(
    run_dir: str | Path,
    shard: int | None = None,
    *,
    loader: Loader,
    checkpoint: str | Path | None = None,
    step: int | None = None,
    model: nn.Module | None = None,
    chunk: int | None = None,
    bisect_only: bool = False,
    kind: str = "nonfinite",
) -> HuntReport:
    """Replay ``shard`` (or optimizer ``step``) of a run in this process and find the non-finite source.

    Args:
        run_dir: the run directory.
        shard: the suspect shard (``steadytrain nan report`` names it). Optional with ``step``.
        loader: builds the run's model and replay settings (see :data:`Loader`; diagnose never imports
            train: ``steadytrain.runs.replay.run_model`` is the usual one).
        checkpoint: the weights to use; default: the weights the run's first non-finite step involving
            ``shard`` (or ``step``) started from, that is the newest checkpoint at or before the step
            before it, or the run's initial weights (rebuilt from its seed) when it saved none that
            early. Never a later state; ``note`` says when the weights are older than that step's.
        step: replay the exact global batch of this optimizer step (1-based, as the ledger and
            ``metrics.jsonl`` count) instead of the shard.
        model: use this module instead of the run's model (weights as given: ``checkpoint`` is ignored).
        chunk: examples per forward pass (default: the run's micro-batch size, at least :data:`MIN_CHUNK`).
        bisect_only: find the examples by bisection alone, not from the hooks' per-row flags (slower;
            the same answer for models whose examples do not interact).
        kind: ``nonfinite`` (the sweep above, the events of ``nonfinite.jsonl``) or ``spike`` (the examples
            whose own loss is an outlier against healthy shards' examples: :mod:`.outliers`; the weights
            those of the first loss spike of ``spikes.jsonl`` involving the shard).

    Returns:
        A :class:`HuntReport`.

    Raises:
        UserError: no such run, shard (or one the run never read) or checkpoint; neither ``shard`` nor ``step``.
    """
    run_dir, command = Path(run_dir), _command(kind, shard, step)
    check_shard_read(run_dir, shard, command)  # a shard the run never read has nothing to say about it
    before = (
        step - 1 if step is not None else _first_event_step(run_dir, shard, LEDGER if kind == "nonfinite" else SPIKES)
    )
    before = before - 1 if step is None and before is not None else before
    net, settings = _load(loader, run_dir, model, checkpoint, before)
    net.eval()  # deterministic replay: no dropout
    if settings.mixture is None:
        return _hunt_in(net, settings, kind, shard, step, chunk, bisect_only)
    if shard is None or step is not None:  # a mixture run: the shard in its own source, read as the run read it
        raise UserError(
            f"a mixture run (data.sources) is hunted by shard, not by step (a step mixes sources): give --shard ID "
            f"alone (steadytrain {command} report names them; steadytrain triage replays a step)"
        )
    mine, own, source = settings.mixture.source(settings, shard)
    return in_mixture(_hunt_in(net, mine, kind, own, None, chunk, bisect_only), shard, own, source)


def _command(kind: str, shard: int | None, step: int | None) -> str:
    """The command a hunt of ``kind`` is (``nan`` or ``spikes``); a UserError for what it cannot hunt."""
    if kind not in ("nonfinite", "spike"):
        raise UserError(f"kind={kind!r}: use nonfinite or spike")
    command = "nan" if kind == "nonfinite" else "spikes"
    if shard is None and step is None:
        raise UserError(
            f"give the shard to hunt in (--shard N, from `steadytrain {command} report`) or a step (--step S)"
        )
    if step is not None and step < 1:
        raise UserError(f"step={step}: optimizer steps count from 1 (as metrics.jsonl and the ledger do)")
    return command


def _hunt_in(net, settings: ReplaySettings, kind: str, shard, step, chunk, bisect_only: bool) -> HuntReport:
    ds = open_dataset(settings.data)
    if shard is not None:
        ds.shard(shard)  # a DatasetError naming the known ids
    batch = shard_batch(settings, shard) if step is None else step_batch(settings, step)
    chunk = chunk or max(settings.micro_batch_size, MIN_CHUNK)
    if kind == "spike":
        rows, limit = _spike_rows(net, ds, batch, settings, shard, chunk)
        report = _report(ds, batch, rows, None, "loss" if len(rows) else None, shard, step, settings, net)
        report.kind, report.limit = "spike", limit
        return report
    rows, first, stage = sweep(net, batch, chunk, bisect_only=bisect_only)
    return _report(ds, batch, rows, first, stage, shard, step, settings, net)


def _spike_rows(net, ds, batch, settings: ReplaySettings, shard, chunk) -> tuple[list[int], float]:
    """Rows of ``batch`` whose loss is an outlier against the examples of a few healthy shards (not ``shard``)."""
    train = set(settings.shards or ds.shard_ids)
    refs = [s for s in healthy_shards(ds) if s != shard and s in train][:REFERENCE_SHARDS]
    if not refs:
        raise UserError(f"no healthy shard besides shard {shard} to compare its examples' losses with")
    reference = np.concatenate([example_losses(net, shard_batch(settings, s), chunk) for s in refs])
    rows, limit = loss_outliers(example_losses(net, batch, chunk), reference, **settings.spike_rule)
    return rows.tolist(), limit


def _report(ds, batch, rows, first, stage, shard, step, settings, net) -> HuntReport:
    shards, index = batch["shard"].tolist(), batch["index"].tolist()
    bad = sorted([shards[r], index[r]] for r in rows)
    if shard is None and len({s for s, _ in bad}) == 1:
        shard = bad[0][0]  # a replayed step whose bad examples all come from one shard
    examples = [i for s, i in bad if s == shard]
    report = HuntReport(
        shard=shard,
        first_module=first,
        examples=examples,
        fields=_fields(ds, shard, examples, settings.schema) if shard is not None else [],
        provenance_diff={k: list(v) for k, v in provenance_differences(ds, shard).items()} if shard is not None else {},
        checkpoint=settings.checkpoint,
        checkpoint_step=settings.checkpoint_step,
        note=settings.note,
        stage=stage,
        examples_checked=len(index),
        step=step,
        bad=bad,
    )
    if step is not None:
        report.reproduced = stage is not None
    return report
