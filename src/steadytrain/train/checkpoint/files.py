"""The files of one checkpoint directory, read and written without unpickling anything.

``checkpoints/step-XXXXXXXX/`` holds:

- ``*.safetensors``: the tensors, each rank its own shards (written by ``torch.distributed.checkpoint``
  with its Hugging Face safetensors storage; a DTensor shard records its offsets in the file's header);
- ``state.json`` (rank 0): the format, the step, the world size, the train state, and the non-tensor
  parts of the model and optimizer state dicts (param groups) with a ``{"$tensor": key}`` where each
  tensor was;
- ``rng/rank-RRRRR.json``: each rank's Python, NumPy, torch CPU (and CUDA) generator states.

A safetensors header and a JSON document are data: loading a checkpoint runs no code from it, and a
file that is anything else is refused with one line naming it.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from steadytrain._io import write_atomic
from steadytrain._text import brief, error_text
from steadytrain.errors import UserError
from steadytrain.train.checkpoint.schema import check_state

__all__ = [
    "FORMAT",
    "TENSOR",
    "from_json",
    "full_tensors",
    "join_state",
    "placeholders",
    "read_rng",
    "read_state",
    "rng_state",
    "set_rng_state",
    "split_state",
    "tensor_shapes",
    "to_json",
    "write_json",
    "write_safetensors",
]

# DCP warns that a process without a process group saves/loads alone: that is the intent (no_dist), once for
# every module that saves or loads (they all import this one)
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

FORMAT, VERSION = "steadytrain-checkpoint", 1
TENSOR, ARRAY = "$tensor", "$array"
"""The key of the placeholder ``state.json`` holds where a tensor was: ``{"$tensor": "model/fc.weight"}``."""


def split_state(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a placeholder; the tensors go to ``out`` under ``prefix/path``.

    Example:
        >>> out = {}
        >>> split_state({"state": {"w": {"step": torch.tensor(2.0)}}, "lr": 0.1}, "optimizer", out)
        {'state': {'w': {'step': {'$tensor': 'optimizer/state/w/step'}}}, 'lr': 0.1}
        >>> list(out)
        ['optimizer/state/w/step']
    """
    if isinstance(value, torch.Tensor):
        out[prefix] = value
        return {TENSOR: prefix}
    if isinstance(value, dict):
        return {k: split_state(v, f"{prefix}/{k}", out) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [split_state(v, f"{prefix}/{i}", out) for i, v in enumerate(value)]
    return value


def join_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_state` (a placeholder whose tensor is missing is a KeyError)."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR}:
            return tensors[skeleton[TENSOR]]
        return {k: join_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_state(v, tensors) for v in skeleton]
    return skeleton


def placeholders(skeleton: Any) -> set[str]:
    """The tensor keys a :func:`split_state` skeleton names."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR}:
            return {str(skeleton[TENSOR])}
        return set().union(*(placeholders(v) for v in skeleton.values()))
    if isinstance(skeleton, list):
        return set().union(*(placeholders(v) for v in skeleton))
    return set()


def to_json(value: Any, where: str) -> Any:
    """``value`` as JSON data (NumPy scalars as numbers, tuples as lists, keys as strings); a TypeError
    naming the path for anything else (a checkpoint never holds an object it could not read back as data)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value  # a non-finite float is written as Infinity/NaN, which Python's json reads back
    if isinstance(value, np.generic):
        return to_json(value.item(), where)
    if isinstance(value, torch.Tensor):  # a small tensor of the train state (e.g. a ledger tag's example ids)
        t = value.detach().cpu()
        return {
            ARRAY: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": t.reshape(-1).tolist(),
            }
        }
    if isinstance(value, dict):
        return {str(k): to_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where}: a {type(value).__name__} is not checkpoint data (numbers, strings, lists, mappings)")


def from_json(value: Any, where: str) -> Any:
    """The inverse of :func:`to_json` for tensors: ``{"$array": ...}`` back to a CPU tensor (a UserError if damaged)."""
    if isinstance(value, list):
        return [from_json(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) != {ARRAY}:
        return {k: from_json(v, where) for k, v in value.items()}
    spec = value[ARRAY]
    try:
        dtype = getattr(torch, spec["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{spec['dtype']} is not a dtype")
        return torch.tensor(spec["data"], dtype=dtype).reshape([int(n) for n in spec["shape"]])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise UserError(f"{where}: a damaged array ({error_text(err, 80)})") from None


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` (JSON data) to ``path`` atomically and durably."""
    text = json.dumps(value, separators=(",", ":"))
    write_atomic(path, lambda f: f.write(text.encode()))


def _load_json(path: Path) -> Any:
    """Not ``_io.load_json``: that one refuses Infinity/NaN, which a train state may hold (``to_json``)."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path}: missing: the checkpoint is incomplete") from None
    except RecursionError:  # json's parser recurses: 100,000 nested brackets are an attack or damage
        raise UserError(f"{path}: nests too deep to be a file steadytrain wrote (damaged?)") from None
    except (ValueError, UnicodeDecodeError, OSError) as err:
        raise UserError(f"{path}: not a steadytrain checkpoint file (not JSON: {error_text(err, 80)})") from None


def read_state(ckpt: Path) -> dict[str, Any]:
    """``state.json`` of checkpoint directory ``ckpt``: its format and version, and every value a resume, a
    rollback, ``eval`` or ``export`` reads, checked for type and range (:func:`.ckptschema.check_state`)."""
    _no_links(ckpt)
    path = ckpt / "state.json"
    state = _load_json(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f'{path}: not a steadytrain checkpoint (no "format": "{FORMAT}")')
    if state.get("version") != VERSION:
        got = brief(state.get("version"))
        raise UserError(f"{path}: checkpoint format version {got}; this steadytrain reads version {VERSION}")
    state = check_state(state, str(path))
    named = re.fullmatch(r"step-(\d{8})", ckpt.name)
    if named and int(named.group(1)) != state["step"]:  # --step, retention and the resume's step go by the name
        raise UserError(
            f"{path}: step={state['step']} but the directory is named {ckpt.name}: renamed by hand? name it "
            f"step-{state['step']:08d} or move it out of checkpoints/"
        )
    return state


def _no_links(ckpt: Path) -> None:
    """A UserError naming the first symbolic link among the checkpoint directory and its files: steadytrain never
    writes one, and a link reads (or, by retention, removes) another run's files or a device as if they were
    this checkpoint's."""
    for p in [ckpt, *(ckpt.iterdir() if ckpt.is_dir() and not ckpt.is_symlink() else [])]:
        inside = list(p.iterdir()) if p.is_dir() and not p.is_symlink() and p != ckpt else []
        for q in [p, *inside]:
            if q.is_symlink():
                raise UserError(
                    f"{q}: a symbolic link (to {os.readlink(q)}) in a checkpoint, which holds its own files only; "
                    "replace it with a copy of what it links to or move the checkpoint out of checkpoints/"
                )


def rng_state() -> dict[str, Any]:
    """This process's generator states, as JSON data."""
    version, keys, gauss = random.getstate()
    name, mt, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(keys), gauss],
        "numpy": [name, mt.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def read_rng(ckpt: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s saved generator states (None if the checkpoint has none for it)."""
    path = ckpt / "rng" / f"rank-{rank:05d}.json"
    return _load_json(path) if path.exists() else None


def set_rng_state(state: Any, where: str) -> None:
    """Restore what :func:`rng_state` captured; a UserError naming ``where`` if it is not that."""
    try:
        version, keys, gauss = state["python"]
        random.setstate((int(version), tuple(int(k) for k in keys), None if gauss is None else float(gauss)))
        name, mt, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((str(name), np.asarray(mt, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if state.get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise UserError(f"{where}: not a generator state ({error_text(err, 80)}): the checkpoint is damaged") from None


def _reader_metadata(ckpt: Path) -> Any:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise UserError(f"{ckpt}: no .safetensors file: the checkpoint is incomplete")
    try:
        return HuggingFaceStorageReader(str(ckpt)).read_metadata()
    except Exception as err:  # a header is parsed from untrusted bytes: any failure means "not ours"
        raise UserError(f"{ckpt}: a .safetensors file is not readable ({error_text(err, 100)})") from None


def _check_cover(ckpt: Path, meta: Any) -> Any:
    """``meta`` if the shards of every tensor cover it exactly once (from the headers alone); a UserError naming the
    checkpoint and the tensor when a part is missing or held twice (a stray or copied ``.safetensors`` file,
    whose tensors would otherwise be loaded in place of the run's own, the last file read winning)."""
    for key, md in meta.state_dict_metadata.items():
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        total = math.prod(md.size)
        for i, (off_a, size_a) in enumerate(chunks):
            for off_b, size_b in chunks[:i]:
                if all(a < b + m and b < a + n for a, n, b, m in zip(off_a, size_a, off_b, size_b, strict=True)):
                    raise UserError(
                        f"{ckpt}: tensor {key} is held twice (at offset {list(off_a)}) by its .safetensors files: a "
                        "stray or copied file from another checkpoint? move the extra file out of the directory"
                    )
        if (held := sum(math.prod(s) for _, s in chunks)) != total:
            raise UserError(f"{ckpt}: tensor {key}: its .safetensors files hold {held} of its {total} values (damaged)")
    return meta


def tensor_shapes(ckpt: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor key of the checkpoint with its full shape and dtype (from the files' headers), each tensor's
    shards checked to cover it exactly once."""
    meta = _check_cover(ckpt, _reader_metadata(ckpt))
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.state_dict_metadata.items()}


def full_tensors(ckpt: Path, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key without prefix, full tensor)`` for each tensor under ``prefix/``, one at a time, assembled
    on the CPU from every rank's shards (memory: one tensor, never the whole state)."""
    from safetensors import safe_open

    meta = _check_cover(ckpt, _reader_metadata(ckpt))
    by_key: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in meta.storage_data.items():
        by_key.setdefault(index.fqn, []).append((index, info))
    for key in sorted(k for k in meta.state_dict_metadata if k.startswith(prefix + "/")):
        md = meta.state_dict_metadata[key]
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for index, info in by_key.get(key, []):
            try:
                with safe_open(str(ckpt / Path(info.relative_path).name), framework="pt") as f:
                    part = f.get_tensor(key)
            except Exception as err:  # removed meanwhile (retention), or damaged: never a traceback
                raise UserError(f"{ckpt}: {key} could not be read ({error_text(err, 100)})") from None
            offsets = list(index.offset or [0] * part.dim())
            shape = tuple(part.shape)
            if len(offsets) != out.dim() or any(o + s > n for o, s, n in zip(offsets, shape, out.shape, strict=True)):
                raise UserError(f"{ckpt}: {key}: a shard at {offsets} of shape {shape} outside {tuple(out.shape)}")
            out[tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))] = part
        yield key[len(prefix) + 1 :], out


_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    f: BinaryIO,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: dict[str, str],
) -> int:
    """Write a safetensors file to ``f``: the header from ``shapes``, then ``tensors`` in sorted key order
    (each must match its shape and dtype). Returns the bytes of tensor data written."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key in sorted(shapes):
        shape, dtype = shapes[key]
        if dtype not in _DTYPES:
            raise UserError(f"{key}: dtype {dtype} has no safetensors name")
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)) + text)
    done = []
    for key, tensor in tensors:
        shape, dtype = shapes[key]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise UserError(f"{key}: {tuple(tensor.shape)} {tensor.dtype} where the header says {shape} {dtype}")
        f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy
        done.append(key)
    if done != sorted(shapes):
        raise UserError("the tensors written are not the header's, in its order")
    return offset
