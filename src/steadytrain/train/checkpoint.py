"""Checkpoints: one file per optimizer step, written atomically, loaded without unpickling code.

The model and optimizer states come from ``torch.distributed.checkpoint.state_dict`` as *full*
state dicts (plain, DDP and FSDP2 models alike: FSDP2 gathers the shards), so a checkpoint loads
on any world size. Rank 0 writes ``checkpoints/step-XXXXXXXX.pt`` aside, fsyncs and renames it: a
kill -9 mid-write leaves the previous checkpoint the latest one. Loading uses
``torch.load(weights_only=True)``: tensors and plain containers only, never arbitrary objects.
Gathering the full state on rank 0 suits models that fit one host's memory; beyond that, sharded
``torch.distributed.checkpoint.save`` is the tool (not used here: its metadata file is a pickle).
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from steadytrain._io import write_atomic
from steadytrain._text import error_text
from steadytrain.errors import UserError

__all__ = [
    "apply_checkpoint",
    "apply_model_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

_NAME = re.compile(r"^step-(\d{8})\.pt$")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint, oldest first (temporary files are not listed)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(ckpt_dir: Path, before_step: int | None = None) -> Path | None:
    """The newest checkpoint (or the newest at or before ``before_step``); None if there is none."""
    found = [p for step, p in list_checkpoints(ckpt_dir) if before_step is None or step <= before_step]
    return found[-1] if found else None


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    is_main: bool,
    keep_last: int,
    keep: frozenset[int] = frozenset(),
) -> Path:
    """Write the checkpoint of ``step`` (a collective under FSDP2: every rank calls it); keep the last
    ``keep_last`` and those of the steps in ``keep`` (the best validation loss), remove the rest."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_FULL)
    path = ckpt_dir / f"step-{step:08d}.pt"
    if is_main:
        payload = {"step": step, "model": model_sd, "optimizer": optim_sd, **extra}
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: torch.save(payload, f))
        for old_step, old in list_checkpoints(ckpt_dir)[:-keep_last]:
            if old_step not in keep:
                old.unlink(missing_ok=True)
    return path


def _older(path: Path) -> str:
    """How to fall back to the checkpoint before ``path``, when there is one."""
    before = [p for _, p in list_checkpoints(path.parent) if p.name < path.name]
    return f"; move it away to resume from {before[-1].name}" if before and _NAME.match(path.name) else ""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents (tensors and plain containers only), or a UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such checkpoint file"
        raise UserError(f"{path}: {what} (a checkpoint is a checkpoints/step-NNNNNNNN.pt file)")
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
    return state


def apply_model_state(state: dict[str, Any], model: nn.Module) -> None:
    """Load a checkpoint's model weights alone into a (possibly DDP- or FSDP2-wrapped) model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    try:
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError, TypeError, AssertionError) as err:
        raise UserError(f"checkpoint does not fit this model: {error_text(err)}") from None


def apply_checkpoint(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimizer states into (possibly DDP- or FSDP2-wrapped) objects."""
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
    except (RuntimeError, KeyError, ValueError, TypeError, AssertionError) as err:
        raise UserError(f"checkpoint does not fit this model/optimizer: {error_text(err)}") from None
