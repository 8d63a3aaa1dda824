"""``nan hunt`` on a run of :class:`steadytrain.Run`: the run's own model and examples, replayed in this process.

An own loop's data order is its own, so what a replay can rebuild is what the run recorded: ``loop.json`` names
the model factory (``package.module:function``: a model whose ``forward(batch)`` returns per-example losses, the
trainer's model contract) and the dataset (``package.module:function`` returning the map-style dataset whose item
``i`` is example id ``i``, a dict of tensors; items are batched with torch's ``default_collate``); the ledger names
the examples of each refused step (every rank's, by shard and index: id = shard x shard_size + index). A step is
replayed from the examples the ledger recorded, a shard from all of its ids, with the weights of the newest complete
checkpoint at or before the step the replay starts from (an own loop's initial weights are not recorded: with no
checkpoint that early the replay is refused, never made of other weights). The sweep is the trainer runs' own
(:func:`steadytrain.diagnose.hunt.sweep`): the first module whose output turns non-finite, and the examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from steadytrain._imports import import_callable
from steadytrain.diagnose.hunt import MIN_CHUNK, HuntReport, sweep
from steadytrain.diagnose.ledger import read_ledger
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir
from steadytrain.rundir.origin import read_origin, require_replayable
from steadytrain.rundir.schema import read_plan
from steadytrain.runs.replay import _load_weights
from steadytrain.train.checkpoint.catalog import latest_checkpoint, list_checkpoints, load_checkpoint

__all__ = ["own_loop_hunt"]


def own_loop_hunt(run_dir: str | Path, shard: int | None, step: int | None, checkpoint: str | None) -> HuntReport:
    """Replay refused ``step`` (the examples the ledger recorded) or all of ``shard`` of an own-loop run."""
    run = open_run_dir(Path(run_dir))
    require_replayable(run.path, "nan hunt", own_loop=True)  # both recorded, or one line naming what is missing
    origin = read_origin(run.path)
    size = origin["shard_size"]
    ids, before = _examples(read_ledger(run.path), shard, step, size, run.path)
    model, path, at = _model(run, origin, checkpoint, before, strict=step is not None)
    data = _call(origin["dataset"], "dataset")
    if ids is None:
        ids = torch.arange(shard * size, min((shard + 1) * size, len(data)))
        if not len(ids):
            raise UserError(
                f"shard {shard}: the dataset has {len(data)} examples, shard {shard} starts at {shard * size}"
            )
    batch = _batch(data, ids, size)
    chunk = max(int(read_plan(run.plan).get("micro_batch_size") or 1), MIN_CHUNK)
    rows, first, stage = sweep(model, batch, chunk)
    bad = sorted([int(ids[r]) // size, int(ids[r]) % size] for r in rows)
    if shard is None and len({s for s, _ in bad}) == 1:
        shard = bad[0][0]
    note = None if before is None or at == before else f"the weights after step {at}, not after step {before}"
    report = HuntReport(
        shard=shard, first_module=first, examples=[i for s, i in bad if s == shard], fields=[], provenance_diff={},
        checkpoint=str(path), checkpoint_step=at, note=note, stage=stage, examples_checked=len(ids), step=step, bad=bad,
    )  # fmt: skip
    if step is not None:
        report.reproduced = stage is not None
    return report


def _examples(
    events: list, shard: int | None, step: int | None, size: int, where: Path
) -> tuple[torch.Tensor | None, int | None]:
    """The ids a replay of ``step`` holds (None for a shard: all of its ids) and the step its weights precede."""
    if step is not None:
        tags = [t for s, e in events if s == step for t in e.tags]
        if not tags:
            refused = sorted({s for s, _ in events})
            raise UserError(
                f"step {step}: not a refused step of {where} (the ledger has {refused or 'none'}): an own loop's "
                "examples are recorded for refused steps only; give one of them, or --shard"
            )
        ids = sorted({s * size + i for t in tags for s, i in zip(t["shard"], t["index"], strict=True)})
        return torch.tensor(ids, dtype=torch.int64), step - 1
    if shard is None:
        raise UserError("give the shard to hunt in (--shard N, from `steadytrain nan report`) or a step (--step S)")
    involved = [s for s, e in events if any(shard in t["shard"] for t in e.tags)]
    return None, (min(involved) - 1 if involved else None)


def _call(spec: str, what: str) -> Any:
    """What the recorded ``spec`` builds (the user's function: its error is named)."""
    fn = import_callable(spec, f"loop.json {what}", "package.module:function")
    try:
        return fn()
    except Exception as err:
        raise UserError(f"loop.json {what} {spec!r} raised {type(err).__name__}: {err}") from None


def _model(
    run: Any, origin: dict[str, Any], checkpoint: str | None, before: int | None, *, strict: bool
) -> tuple[Any, Path, int]:
    """The run's model with the weights of ``checkpoint``, or of the newest checkpoint at or before ``before`` (not
    ``strict``, a shard's replay: the earliest checkpoint when there is none that early)."""
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run.checkpoints, before_step=before)
    if path is None and not strict and (found := list_checkpoints(run.checkpoints)):
        path = found[0][1]  # a shard's replay: the run's earliest weights (the note says they are later)
    if path is None:
        at = "" if before is None else f" at or before step {before}"
        raise UserError(
            f"{run.path}: no checkpoint{at}: an own loop's initial weights are not recorded, so there are no weights "
            "to replay that step with (checkpoint more often, or give --checkpoint)"
        )
    state = load_checkpoint(path)
    model = _call(origin["model_factory"], "model_factory")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"loop.json model_factory {origin['model_factory']!r} returned {type(model).__name__}")
    _load_weights(model, state, path)
    model.eval()  # a deterministic replay: no dropout
    return model, path, int(state["step"])


def _batch(data: Any, ids: torch.Tensor, size: int) -> dict[str, Any]:
    """The examples ``ids`` of ``data`` batched as the model takes them, with their shard and index."""
    from torch.utils.data import default_collate

    if int(ids.max()) >= len(data):
        raise UserError(f"example id {int(ids.max())} is beyond the dataset's {len(data)} examples: not the run's data")
    batch = default_collate([data[int(i)] for i in ids])
    if not isinstance(batch, dict):
        raise UserError(
            f"the dataset's items are {type(batch).__name__}s: a replay needs dicts of tensors (the batch the "
            "model_factory's model takes)"
        )
    return batch | {"shard": ids // size, "index": ids % size}
