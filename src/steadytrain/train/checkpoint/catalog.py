"""Checkpoints: which a run has, what one holds, and restoring one into a (possibly sharded) model.

A checkpoint is a directory ``checkpoints/step-XXXXXXXX/`` written by
:class:`~steadytrain.train.checkpoint.writer.CheckpointWriter`: every rank's tensors in safetensors files and
the rest as JSON (:mod:`steadytrain.train.checkpoint.files`); nothing in it is unpickled. :func:`restore`
loads it through ``torch.distributed.checkpoint`` into the live objects, each rank reading only the
slices its own shards need, on any world size and either strategy (DCP reshards). :func:`load_checkpoint`
assembles the full model on the CPU, one tensor at a time (``eval`` on one process, ``replay``, ``export``).

The single-file checkpoints of earlier versions (``checkpoints/step-XXXXXXXX.pt``, a full state
dict) are still listed, resumed and exported: ``torch.load(weights_only=True)`` reads them (tensors
and plain containers only, never arbitrary objects).
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from steadytrain._text import error_text
from steadytrain.errors import UserError
from steadytrain.train.checkpoint.files import (
    full_tensors,
    join_state,
    placeholders,
    read_state,
    split_state,
    tensor_shapes,
    to_json,
)
from steadytrain.train.checkpoint.schema import check_state

__all__ = [
    "check_latest",
    "checkpoint_at",
    "is_legacy",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "restore",
    "state_file",
]

_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")
_TRAIN_KEYS = ("elapsed_s", "exposure", "scheduler", "accumulator", "data", "scaler", "validation")


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint, oldest first (a save in progress is not listed)."""
    if not ckpt_dir.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in ckpt_dir.iterdir():
        if not (m := _NAME.match(p.name)):
            continue
        step = int(m.group(1))
        if m.group(2) and p.is_file():
            found.setdefault(step, p)  # a directory of the same step (written later) wins
        elif not m.group(2) and (p / "state.json").is_file():
            found[step] = p
    return sorted(found.items())


def latest_checkpoint(ckpt_dir: Path, before_step: int | None = None) -> Path | None:
    """The newest checkpoint (or the newest at or before ``before_step``); None if there is none."""
    found = [p for step, p in list_checkpoints(ckpt_dir) if before_step is None or step <= before_step]
    return found[-1] if found else None


def check_latest(ckpt_dir: Path) -> None:
    """Read the newest checkpoint's ``state.json`` with its checks (a UserError naming it and the key), before a
    resume changes anything in the run directory."""
    path = latest_checkpoint(ckpt_dir)
    if path is not None and not is_legacy(path):
        try:
            read_state(path)
        except UserError as err:
            raise UserError(f"{err}{_older(path)}") from None


def checkpoint_at(ckpt_dir: Path, step: int | None) -> Path:
    """The checkpoint of ``step`` (None: the latest), or a UserError saying which steps there are."""
    found = dict(list_checkpoints(ckpt_dir))
    if not found:
        raise UserError(f"{ckpt_dir}: the run has no checkpoint")
    if step is None:
        return found[max(found)]
    if step not in found:
        have = ", ".join(str(s) for s in sorted(found)[-10:])
        raise UserError(f"--step {step}: the run has no checkpoint of that step (it keeps steps {have})")
    return found[step]


def is_legacy(path: Path) -> bool:
    """A single-file ``.pt`` checkpoint of an earlier version."""
    return Path(path).suffix == ".pt"


def _older(path: Path) -> str:
    """How to fall back to the checkpoint before ``path``, when there is one."""
    m = _NAME.match(path.name)
    before = [p for s, p in list_checkpoints(path.parent) if m and s < int(m.group(1))]
    return f"; move it away to resume from {before[-1].name}" if before else ""


def state_file(path: Path) -> str:
    """Where checkpoint ``path`` keeps its train state, for messages: its ``state.json`` (a legacy file: itself)."""
    return str(path if is_legacy(path) else Path(path) / "state.json")


def _load_legacy(path: Path) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():  # torch's notes on the pickle protocol: the error below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's advice (weights_only=False) would run the file's code: never
        raise UserError(
            f"{path}: not a steadytrain checkpoint (not a torch.save file of tensors and plain containers, the "
            f"only thing ever loaded){_older(path)}"
        ) from None
    except Exception as err:  # the restricted unpickler parses untrusted bytes: any failure means "not ours"
        why = error_text(err, 120) if isinstance(err, RuntimeError | OSError) else type(err).__name__
        raise UserError(f"{path}: not a loadable steadytrain checkpoint ({why}){_older(path)}") from None
    if not isinstance(state, dict) or not {"step", "model", "optimizer"} <= set(state):
        raise UserError(f"{path}: not a steadytrain checkpoint (no step/model/optimizer)")
    train = {k: state[k] for k in _TRAIN_KEYS if k in state} | {"step": state["step"]}
    world = state.get("world_size")
    check_state({"step": state["step"], "world_size": 1 if world is None else world, "train": to_json(train, "train"),
                 "model": {}, "optimizer": {}}, str(path))  # fmt: skip
    return state | {"train": train, "world_size": world}


def _check(path: Path) -> None:
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint (a checkpoint is a checkpoints/step-NNNNNNNN directory)")
    if not (path.is_file() or path.is_dir()):
        raise UserError(
            f"{path}: not a regular file or a directory (a checkpoint is a checkpoints/step-NNNNNNNN directory)"
        )


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """``{"step", "world_size", "train", "model"}`` of a checkpoint, the model's full tensors on the CPU
    (a legacy file also gives ``optimizer`` and ``rng``); a UserError naming the file if it is not one."""
    path = Path(path)
    _check(path)
    if path.is_file():
        return _load_legacy(path)
    try:
        state = read_state(path)
        model = {f"model/{k}": v for k, v in full_tensors(path, "model")}
        full = join_state(state["model"], model)
    except KeyError as err:
        raise UserError(f"{path}: state.json names a tensor no file holds ({err}){_older(path)}") from None
    except UserError as err:
        raise UserError(f"{err}{_older(path)}") from None
    return {"step": state["step"], "world_size": state["world_size"], "train": state["train"], "model": full}


def _fits(path: Path, tensors: dict[str, torch.Tensor], shapes: dict[str, Any], prefixes: tuple[str, ...]) -> None:
    """A UserError unless the checkpoint holds exactly ``tensors``' keys (under ``prefixes``), same shapes."""
    saved = {k: v for k, v in shapes.items() if k.startswith(prefixes)}
    missing, unexpected = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
    wrong = [k for k in set(tensors) & set(saved) if tuple(tensors[k].shape) != saved[k][0]]
    if missing or unexpected or wrong:
        named = (("missing", missing), ("unexpected", unexpected), ("other shape", sorted(wrong)))
        parts = [f"{what}: {', '.join(keys[:3])}" for what, keys in named if keys]
        raise UserError(f"{path}: the checkpoint does not fit this model/optimizer ({'; '.join(parts)})")


def restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, no_dist: bool) -> dict[str, Any]:
    """Load a checkpoint into the (possibly DDP- or FSDP2-wrapped) model and optimizer (every rank calls
    it); returns ``{"step", "world_size", "train", ...}``. Each rank reads only the slices it holds."""
    path = Path(path)
    _check(path)
    if path.is_file():
        state = _load_legacy(path)
        _apply_full(state, model, optimizer)
        return state
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        state, shapes = read_state(path), tensor_shapes(path)
        if lost := sorted(placeholders([state["model"], state["optimizer"]]) - set(shapes)):
            raise UserError(f"{path}: state.json names tensors no .safetensors file holds ({', '.join(lost[:3])})")
    except UserError as err:
        raise UserError(f"{err}{_older(path)}") from None
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # creates the optimizer's state to load into
    else:
        model_sd, optim_sd = get_model_state_dict(model), None
    tensors: dict[str, torch.Tensor] = {}
    split_state(model_sd, "model", tensors)
    if optim_sd is not None:
        split_state(optim_sd, "optimizer", tensors)
    _fits(path, tensors, shapes, ("model/", "optimizer/") if optimizer is not None else ("model/",))
    try:  # a collective (unless no_dist): the ranks plan the read together, each loads the shards it now holds
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=no_dist)
        model_sd = join_state(state["model"], tensors)
        if optimizer is None:
            set_model_state_dict(model, model_sd)
        else:
            set_state_dict(
                model, optimizer, model_state_dict=model_sd, optim_state_dict=join_state(state["optimizer"], tensors)
            )
    except (RuntimeError, KeyError, ValueError, TypeError, AssertionError, OSError, CheckpointException) as err:
        if isinstance(err, CheckpointException) and err.failures:  # DCP's wrapper: the ranks' own errors
            err = next(iter(err.failures.values()))[0]
        raise UserError(f"{path}: the checkpoint does not load into this model/optimizer: {error_text(err)}") from None
    return state


def _apply_full(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """A legacy checkpoint's full state dicts into (possibly DDP- or FSDP2-wrapped) objects."""
    full = StateDictOptions(full_state_dict=True)
    try:
        if optimizer is None:
            set_model_state_dict(model, state["model"], options=full)
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=full)  # fmt: skip
    except (RuntimeError, KeyError, ValueError, TypeError, AssertionError) as err:
        raise UserError(f"checkpoint does not fit this model/optimizer: {error_text(err)}") from None
