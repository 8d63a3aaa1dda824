"""Which loop wrote a run directory: ``loop.json``, the record a run of the user's own loop writes when it opens.

``steadytrain train`` writes ``config.yaml`` as a resolved :class:`~steadytrain.train.setup.config.TrainConfig`,
and the commands that replay a run (``nan hunt``, ``spikes hunt``, ``triage``, ``eval``, ``repro``) rebuild its
model and data from it. A run written by ``steadytrain.Run`` from the user's own training loop holds the user's own
config mapping there instead: read as a training config, it fills in the default model and data, and a replay
would silently replay another model. ``loop.json`` marks such a run (``{"writer", "version", "model_factory",
"dataset", "shard_size"}``); :func:`require_replayable` is the one refusal every replaying command calls before it
reads ``config.yaml``. A run without ``loop.json`` is a trainer run, replayed as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadytrain._io import brief, load_json, one_line, present, write_text_atomic
from steadytrain.errors import UserError

__all__ = ["ORIGIN_FILE", "WRITER", "read_origin", "require_replayable", "write_origin"]

ORIGIN_FILE = "loop.json"
WRITER = "steadytrain.Run"
"""The ``writer`` an own-loop run records."""

_FIX = (
    f"restore {ORIGIN_FILE} as {WRITER} wrote it "
    '({"writer": str, "version": str, "model_factory": str or null, "dataset": str or null, "shard_size": int >= 1})'
)
_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "writer": ((str,), "a string"),
    "version": ((str,), "a string"),
    "model_factory": ((str, type(None)), "a string or null"),
    "dataset": ((str, type(None)), "a string or null"),
    "shard_size": ((int,), "an integer >= 1"),
}


def write_origin(
    run_path: Path, *, model_factory: str | None, dataset: str | None, shard_size: int, version: str
) -> None:
    """Write ``RUN/loop.json`` (atomically): this run was written by :data:`WRITER` from the user's own loop.

    Args:
        run_path: the run directory (it exists).
        model_factory: ``"package.module:function"`` that builds the run's model, or None when the run gave none.
        dataset: the dataset the run read, or None when the run gave none.
        shard_size: examples per shard of the run's data (>= 1).
        version: steadytrain's version that wrote the run.
    """
    record = {
        "writer": WRITER,
        "version": version,
        "model_factory": model_factory,
        "dataset": dataset,
        "shard_size": shard_size,
    }
    _check(record, Path(run_path) / ORIGIN_FILE)  # never write a record the reader would refuse
    write_text_atomic(Path(run_path) / ORIGIN_FILE, json.dumps(record, indent=2) + "\n")


def _check(value: Any, path: Path) -> dict[str, Any]:
    """``value`` if it is a well-formed own-loop record, else one UserError naming the file, the key and the fix."""
    if not isinstance(value, dict):
        raise UserError(f"{path}: an own-loop record is a JSON object, not {type(value).__name__}; {_FIX}")
    for key, (types, what) in _KEYS.items():
        if key not in value:
            raise UserError(f"{path}: key {key!r} is missing; {_FIX}")
        got = value[key]
        if isinstance(got, bool) or not isinstance(got, types) or (key == "shard_size" and got < 1):
            raise UserError(f"{path}: {key}={brief(got)} must be {what}; {_FIX}")
    return value


def read_origin(run_path: Path) -> dict[str, Any] | None:
    """The own-loop record of the run at ``run_path``; None when it has no ``loop.json`` (a ``steadytrain train`` run).

    Raises:
        UserError: ``loop.json`` is present but damaged (not JSON, not an object, a key missing or of the wrong
            type): names the file, the key and the fix. A damaged record is never taken as absent, which would make
            the run look like a trainer run and let a replay rebuild another model.
    """
    path = Path(run_path) / ORIGIN_FILE
    if not present(path):
        return None
    try:
        value = load_json(path, what="own-loop record")
    except UserError as err:
        raise UserError(f"{err}; {_FIX}") from None
    return _check(value, path)


def require_replayable(run_path: Path, command: str, *, own_loop: bool = False) -> None:
    """Refuse, in one line, a command that would rebuild an own-loop run's model and data from ``config.yaml``.

    A trainer run (no ``loop.json``) passes untouched. An own-loop run is refused: without a recorded model factory
    or dataset the command cannot rebuild them (it would replay the default model); with both recorded, the replay
    of an own-loop run is not built yet, and the message names what the run records so the user can replay it.

    Args:
        run_path: the run directory.
        command: the command, as ``steadytrain`` follows it (``"nan hunt"``); a name that starts with
            ``steadytrain`` (a Python function's) is used as it is.
        own_loop: the command replays an own-loop run that records both (``nan hunt``): it passes then.

    Raises:
        UserError: an own-loop run, or a damaged ``loop.json`` (see :func:`read_origin`).
    """
    origin = read_origin(run_path)
    if origin is None:
        return
    name = command if command.startswith("steadytrain") else f"steadytrain {command}"
    factory, dataset = origin["model_factory"], origin["dataset"]
    missing = [what for what, got in (("model factory", factory), ("dataset", dataset)) if got is None]
    where = f"{one_line(run_path)}: written by {WRITER} from your own loop"
    if missing:
        rebuilt = "model" if factory is None else "data"
        rebuilt = "model and data" if len(missing) == 2 else rebuilt
        other = "another model" if factory is None else "other data"
        raise UserError(
            f"{where} without a {' or '.join(missing)}: `{name}` cannot rebuild the {rebuilt} (it would replay "
            f'{other}); give Run(..., model_factory="package.module:function", dataset=...) or replay it in your '
            "own code"
        )
    if own_loop:
        return
    raise UserError(
        f"{where}: `{name}` replays runs of `steadytrain train` only (an own loop's data order is its own: "
        f"`steadytrain nan hunt` replays its recorded steps and shards with model factory {brief(factory)} and "
        f"dataset {brief(dataset)})"
    )
