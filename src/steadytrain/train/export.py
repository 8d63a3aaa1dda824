"""``steadytrain export RUN --out FILE.safetensors``: a run's model as one safetensors file.

Tensors only, under the model's own ``state_dict`` keys (no DDP/FSDP wrapper prefix), so the file
loads into a freshly built model with ``load_state_dict(strict=True)``. The file is streamed: its
header is written from the checkpoint's shard headers, then each tensor is assembled from every
rank's shards and written before the next is read, so exporting holds one tensor in memory and never
the optimizer state. It is written aside and renamed: a killed export leaves no partial file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from steadytrain._io import write_atomic
from steadytrain.errors import UserError
from steadytrain.train.checkpoint import checkpoint_at, is_legacy, load_checkpoint
from steadytrain.train.ckptfiles import TENSOR, full_tensors, read_state, tensor_shapes, write_safetensors
from steadytrain.train.rundir import open_run_dir

__all__ = ["export_model"]

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
    path = checkpoint_at(run.checkpoints, step)
    shapes, tensors, saved_step, others = _model_tensors(path)
    if others:
        raise UserError(f"{path}: the model state holds non-tensor entries ({', '.join(others[:3])}): not exportable")
    meta = {"format": "pt", "step": str(saved_step), "run": run.path.name}
    written = {}
    write_atomic(out, lambda f: written.setdefault("bytes", write_safetensors(f, shapes, tensors, meta)))
    log.info("exported %d tensors (%d bytes) of step %d to %s", len(shapes), written["bytes"], saved_step, out)
    return {"out": str(out), "step": saved_step, "tensors": len(shapes), "bytes": written["bytes"]}
