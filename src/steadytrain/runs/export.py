"""``steadytrain export RUN --out FILE.safetensors``: a run's model as one safetensors file; with ``--format hf``
(a run of an ``hf:`` model) a directory that ``transformers``' ``from_pretrained`` loads.

Tensors only, under the model's own ``state_dict`` keys (no DDP/FSDP wrapper prefix), so the file
loads into a freshly built model with ``load_state_dict(strict=True)``. The file is streamed: its
header is written from the checkpoint's shard headers, then each tensor is assembled from every
rank's shards and written before the next is read, so exporting holds one tensor in memory and never
the optimizer state. It is written aside and renamed: a killed export leaves no partial file.

``--format hf`` writes ``model.safetensors`` (the same stream, under the ``transformers`` model's own keys),
the tokenizer the run's data was ingested with (``tokenizer.json`` and ``tokenizer_config.json``, kept in
the run directory: see :mod:`~steadytrain.train.hf.tokenizer`; none for data whose provenance names no tokenizer)
and then ``config.json`` (the config the run's model was built from, its ``eos_token_id`` the data's end of
document): a killed export leaves no ``config.json``, which ``from_pretrained`` needs. The directory may be
new, empty, or an earlier export (its files are replaced, an earlier tokenizer removed where this run has
none); anything else in it is refused rather than mixed with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from steadytrain._io import ensure_dir, read_text, write_atomic, write_text_atomic
from steadytrain.errors import UserError
from steadytrain.rundir.layout import open_run_dir
from steadytrain.train.checkpoint.catalog import checkpoint_at, is_legacy, load_checkpoint
from steadytrain.train.checkpoint.files import TENSOR, full_tensors, read_state, tensor_shapes, write_safetensors
from steadytrain.train.hf.model import CONFIG_FILE as HF_CONFIG
from steadytrain.train.hf.model import TOKENIZER_FILE as HF_TOKENIZER
from steadytrain.train.hf.tokenizer import EXPORT_FILES as TOKENIZER_FILES
from steadytrain.train.hf.tokenizer import tokenizer_files

__all__ = ["export_hf", "export_model"]

HF_FILES = ("config.json", "model.safetensors", *TOKENIZER_FILES)

log = logging.getLogger("steadytrain.train")


def _model_tensors(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Iterator, int, list[str]]:
    """The model's tensor shapes, its full tensors (sorted by key), the checkpoint's step, its non-tensor keys."""
    if is_legacy(path):
        state = load_checkpoint(path)
        model = state["model"]
        others = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.items() if isinstance(v, torch.Tensor)}
        return shapes, iter(sorted((k, model[k]) for k in shapes)), int(state["step"]), others
    state = read_state(path)
    others = [k for k, v in state["model"].items() if not (isinstance(v, dict) and set(v) == {TENSOR})]
    shapes = {k.removeprefix("model/"): v for k, v in tensor_shapes(path).items() if k.startswith("model/")}
    return shapes, full_tensors(path, "model"), int(state["step"]), others


def export_model(run_dir: str | Path, out: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """Write the model of RUN's checkpoint at ``step`` (default: the latest) to ``out``; what was written."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise UserError(f"--out {out}: give a file name ending in .safetensors")
    if out.is_dir():
        raise UserError(f"--out {out}: a directory; give a file name ending in .safetensors")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the directory {out.parent} does not exist")
    run = open_run_dir(Path(run_dir))
    _check_out(out, run.checkpoints)
    path = checkpoint_at(run.checkpoints, step)
    shapes, tensors, saved_step, others = _model_tensors(path)
    if others:
        raise UserError(f"{path}: the model state holds non-tensor entries ({', '.join(others[:3])}): not exportable")
    return _write(out, shapes, tensors, saved_step, run.path.name)


_MARK = ("format", "step", "run")
"""The metadata keys an export writes in its safetensors header (a checkpoint's files carry DCP's instead)."""


def _is_export(path: Path) -> bool:
    """``path`` is a safetensors file this command wrote (its header carries the export's metadata keys)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # a header parsed from whatever the file holds: anything unreadable is not an export
        return False
    return set(_MARK) <= set(meta)


def _outside_checkpoints(out: Path, checkpoints: Path, what: str) -> None:
    """A UserError if ``out`` (links resolved) lies in the run's checkpoints: an export there would replace a
    checkpoint's file or make a later save of that step fail."""
    if out.resolve().is_relative_to(checkpoints.resolve()):
        raise UserError(f"--out {out}: inside the run's checkpoints ({checkpoints}); export to a {what} outside them")


def _check_out(out: Path, checkpoints: Path) -> None:
    """``--out`` may be a new file or an earlier export; never a file of the run's checkpoints, nor another file."""
    _outside_checkpoints(out, checkpoints, "file")
    if out.exists() and not (out.is_file() and _is_export(out)):
        raise UserError(
            f"--out {out}: exists and is not an earlier export (it would be replaced); give a new file name"
        )


def _write(out: Path, shapes: dict[str, Any], tensors: Iterator, step: int, run: str, to: str = "") -> dict[str, Any]:
    """``out``: the safetensors file of ``tensors`` (streamed, written aside and renamed); what was written."""
    meta = {"format": "pt", "step": str(step), "run": run}
    written: dict[str, int] = {}

    def write(f: Any) -> None:
        written["bytes"] = write_safetensors(f, shapes, tensors, meta)

    write_atomic(out, write)
    log.info("exported %d tensors (%d bytes) of step %d to %s%s", len(shapes), written["bytes"], step, out, to)
    return {"out": str(out), "step": step, "tensors": len(shapes), "bytes": written["bytes"]}


def _hf_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: a file; --format hf writes a directory (config.json, model.safetensors, ...)")
    if out.is_dir() and (others := sorted(p.name for p in out.iterdir() if p.name not in HF_FILES)):
        raise UserError(f"--out {out}: holds other files ({', '.join(others[:3])}); give a new or empty directory")


def export_hf(run_dir: str | Path, out: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """Write RUN's HF model at ``step`` (default: the latest) to the directory ``out``: ``config.json`` and
    ``model.safetensors``, which ``AutoModelForCausalLM.from_pretrained(out)`` loads, and the data's tokenizer
    (``AutoTokenizer.from_pretrained(out)``) where the run kept one; what was written."""
    out = Path(out)
    _hf_out(out)
    run = open_run_dir(Path(run_dir))
    _outside_checkpoints(out, run.checkpoints, "directory")
    if not (run.path / HF_CONFIG).is_file():
        raise UserError(
            f"{run.path}: not a run of an hf: model (no {HF_CONFIG}): export it with --out FILE.safetensors"
        )
    config = read_text(run.path / HF_CONFIG, what="HF model config")
    kept = run.path / HF_TOKENIZER
    tokenizer = tokenizer_files(read_text(kept, what="HF tokenizer"), json.loads(config)) if kept.is_file() else {}
    path = checkpoint_at(run.checkpoints, step)
    shapes, tensors, saved_step, others = _model_tensors(path)
    if others or not shapes or any(not k.startswith("hf.") for k in shapes):
        raise UserError(f"{path}: its model state is not an hf: model's (keys {', '.join(sorted(shapes)[:3])})")
    shapes = {k.removeprefix("hf."): v for k, v in shapes.items()}
    renamed = ((k.removeprefix("hf."), t) for k, t in tensors)
    ensure_dir(out, "--out")  # parents too: a new directory for the model
    done = _write(out / "model.safetensors", shapes, renamed, saved_step, run.path.name, " (hf)")
    for name in TOKENIZER_FILES:
        if name in tokenizer:
            write_text_atomic(out / name, tokenizer[name])
        else:
            (out / name).unlink(missing_ok=True)  # an earlier export's: not this run's tokenizer
    write_text_atomic(out / "config.json", config)  # last: only a complete export has one
    log.info("tokenizer: %s", "the data's, as ingested" if tokenizer else "none (the run's data names none)")
    return {**done, "out": str(out), "tokenizer": bool(tokenizer)}
