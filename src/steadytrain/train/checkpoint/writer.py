"""Writing checkpoints: every rank its own shards, in the background when it can, complete or absent.

:class:`CheckpointWriter` saves the model and optimizer through ``torch.distributed.checkpoint``
(sharded state dicts: an FSDP2 rank writes its DTensor shards, DDP replicas are written once) into
``checkpoints/.step-XXXXXXXX.partial/``; rank 0 renames it to ``step-XXXXXXXX/`` once every rank's
files and ``state.json`` are on disk, then removes the checkpoints retention no longer keeps. A kill
at any point leaves the previous checkpoint the latest complete one.

With ``use_async`` the loop is blocked only while the state is copied to host memory (DCP's
``async_save`` with a staging pool kept across saves, its copy made in a background thread): the
optimizer's next step waits for that copy (a step pre-hook), the write runs in the background on a
process group of its own, the next save waits for the previous one, and :meth:`wait` (the run's end)
for the last. A failed background write is logged and raised by :meth:`wait`; its directory is never
renamed, so it is never mistaken for a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from steadytrain._text import error_text
from steadytrain.train.checkpoint.catalog import list_checkpoints
from steadytrain.train.checkpoint.files import (
    FORMAT,
    VERSION,
    rng_state,
    split_state,
    to_json,
    write_json,
    write_safetensors,
)
from steadytrain.train.setup.distributed import DistInfo, agree, barrier

__all__ = ["CheckpointFailed", "CheckpointWriter", "checkpoint_name", "prune"]

log = logging.getLogger("steadytrain.train")

FILES_PER_RANK = 8
"""A rank's tensors go to up to this many files: the write serializes one file at a time (memory: one file)."""


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written (the previous complete one is still the latest)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def prune(ckpt_dir: Path, keep_last: int, keep: frozenset[int]) -> None:
    """Remove complete checkpoints beyond the last ``keep_last`` but those of the steps in ``keep``."""
    for step, path in list_checkpoints(ckpt_dir)[:-keep_last]:
        if step not in keep:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _file_index(tensors: dict[str, torch.Tensor], files: int) -> dict[str, int]:
    """Each key's file (1-based), balancing the bytes: the largest tensors first, each to the lightest file."""
    loads = [0] * files
    out = {}
    for key in sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].element_size()):
        i = loads.index(min(loads))
        loads[i] += tensors[key].numel() * tensors[key].element_size()
        out[key] = i + 1
    return out


def _storage_writer(path: Path, mapping: dict[str, int]) -> Any:
    """DCP's safetensors storage (each rank its own files; the Hugging Face reader reads them back), with
    each file streamed: its header, then every tensor's bytes straight from the tensor, then an fsync.
    (DCP's own writer serializes a whole file into one buffer first: a third of the throughput here.)"""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._hf_utils import (
        CUSTOM_METADATA_KEY,
        DCP_VERSION_KEY,
        FORMAT_KEY,
        FORMAT_VALUE,
        HF_DCP_VERSION,
        _gen_file_name,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

    class StreamingWriter(HuggingFaceStorageWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            mapping, shard = plan.storage_data.get("fqn_to_index_mapping"), plan.storage_data.get("shard_index")
            results = []
            for index, items in self._split_by_storage_plan(mapping, plan.items).items() if plan.items else ():
                name = _gen_file_name(index, max(mapping.values()) if mapping else 1, shard)
                results += self._write_file(self.fs.concat_path(self.path, name), name, items, planner)
            fut: Any = TorchFuture()
            fut.set_result(results)
            return fut

        def _write_file(self, file_path: Any, file_name: str, items: list, planner: Any) -> list:
            if any(item.type == WriteItemType.BYTE_IO for item in items):
                raise TypeError("a checkpoint holds tensors only (the rest is state.json)")
            data = {item.index.fqn: (item, planner.resolve_data(item)) for item in items}
            shapes = {k: (tuple(t.shape), t.dtype) for k, (_, t) in data.items()}
            offsets = {k: {"saved_offsets": list(item.tensor_data.chunk.offsets)} for k, (item, _) in data.items()}
            meta = {CUSTOM_METADATA_KEY: json.dumps(offsets), DCP_VERSION_KEY: str(HF_DCP_VERSION)}
            with open(file_path, "wb") as f:
                write_safetensors(f, shapes, ((k, data[k][1]) for k in sorted(data)), meta | {FORMAT_KEY: FORMAT_VALUE})
                f.flush()
                os.fsync(f.fileno())
            out = []
            for item, t in data.values():
                size = t.numel() * t.element_size()
                out.append(
                    WriteResult(index=item.index, size_in_bytes=size, storage_data=_StorageInfo(file_name, 0, size))
                )
            return out

    return StreamingWriter(str(path), save_distributed=True, fqn_to_index_mapping=mapping)


class CheckpointWriter:
    """One run's checkpoint writer (every rank builds one at the same point: it may create a process group)."""

    def __init__(self, ckpt_dir: Path, info: DistInfo, *, use_async: bool, keep_last: int) -> None:
        self.dir, self.info, self.use_async, self.keep_last = ckpt_dir, info, use_async, keep_last
        # async_save needs a CPU (gloo) group, and its collectives run on the background writing thread while the
        # loop's run on the default group: a group of its own (new_group is a collective: every rank, here)
        self.group = dist.new_group(backend="gloo") if info.backend is not None and use_async else None
        self._stager: Any = None
        self._staged: Future | None = None
        self._upload: Future | None = None
        self._pending: tuple[int, Path, frozenset[int]] | None = None
        self.failed: str | None = None
        self._finished = threading.Event()
        self.blocked_s = 0.0
        """Seconds the caller was blocked by saves (the call itself and any wait for a staging copy)."""
        if info.is_main and ckpt_dir.is_dir():
            for stale in ckpt_dir.glob(".step-*.partial"):  # a save a kill interrupted: never a checkpoint
                shutil.rmtree(stale, ignore_errors=True)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step`` wait for an asynchronous save's copy of the state (returns the hook handle)."""
        return optimizer.register_step_pre_hook(lambda *_: self.wait_staged())

    def wait_staged(self) -> None:
        if self._staged is not None:
            t0 = time.perf_counter()
            try:
                self._staged.result()
            except (Exception, CheckpointException) as err:  # the copy failed: the write will too
                self._fail(err)
            self._staged = None
            self.blocked_s += time.perf_counter() - t0

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train: Any, keep: frozenset[int]
    ) -> None:
        """Save ``step`` (a collective: every rank calls it). ``train``: the train state (JSON data), or a function
        rank 0 calls for it. State that cannot be written is one UserError on every rank, before any file."""
        self._drain()  # one save at a time: the previous one completes (and is renamed) first; a failure is logged
        t0 = time.perf_counter()
        partial = self.dir / f".{checkpoint_name(step)}.partial"
        if self.info.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        barrier(self.info)  # the directory exists before any rank writes into it
        model_sd, optim_sd = get_state_dict(model, optimizer)  # sharded: no rank gathers the full state
        tensors: dict[str, torch.Tensor] = {}
        skeleton = {
            "model": split_state(model_sd, "model", tensors),
            "optimizer": split_state(optim_sd, "optimizer", tensors),
        }
        (partial / "rng").mkdir(parents=True, exist_ok=True)
        write_json(partial / "rng" / f"rank-{self.info.rank:05d}.json", rng_state())  # each rank its own streams
        header = {"format": FORMAT, "version": VERSION, "step": step, "world_size": self.info.world_size}
        state, error = None, None
        try:  # every rank encodes the skeleton (the same everywhere): no rank waits in the save for another
            header["train"] = (train() if callable(train) else train) if self.info.is_main else {}
            state = to_json(header | skeleton, "checkpoint state")
        except TypeError as err:
            error = f"the checkpoint of step {step} cannot hold the run's state: {err}"
            if self.info.is_main:
                shutil.rmtree(partial, ignore_errors=True)
        # a rank whose state cannot be written stops every rank here, before any of them enters the save's collectives
        agree(self.info, error, "to checkpoint")
        self._pending = (step, partial, keep)
        self._start(tensors, partial, lambda: self._finish(state, step, partial, keep))
        self.blocked_s += time.perf_counter() - t0

    def _start(self, tensors: dict[str, torch.Tensor], partial: Path, finish: Any) -> None:
        import torch.distributed.checkpoint as dcp

        writer = _storage_writer(partial, _file_index(tensors, FILES_PER_RANK))
        no_dist = self.info.backend is None
        if not self.use_async:
            try:  # a collective: the ranks agree on one write plan, then each writes only the shards it holds
                dcp.save(tensors, storage_writer=writer, no_dist=no_dist)
            except (Exception, CheckpointException) as err:  # DCP's: a BaseException
                self._fail(err)
                failed, self.failed = self.failed, None
                raise CheckpointFailed(failed) from None
            finish()
            return
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(False, False, True, False))  # staging reused across saves
        # the same collective save, on self.group: its exchanges run on the writing thread while the loop goes on
        response = dcp.async_save(
            tensors, storage_writer=writer, process_group=self.group, async_stager=self._stager, no_dist=no_dist
        )
        self._staged = getattr(response, "staging_completion", None)
        self._upload = getattr(response, "upload_completion", response)
        self._finished.clear()

        def done(fut: Future) -> None:  # on the writing thread, as soon as every rank's files are written
            try:
                if fut.exception() is None:
                    finish()
            finally:
                self._finished.set()

        self._upload.add_done_callback(done)

    def _finish(self, state: Any, step: int, partial: Path, keep: frozenset[int]) -> None:
        """Rank 0, after every rank's files: ``state.json``, the rename that makes it a checkpoint, retention."""
        if not self.info.is_main:
            return
        try:
            write_json(partial / "state.json", state)
            final = self.dir / checkpoint_name(step)
            if final.exists():  # the same step saved again (a resumed run): replaced whole
                shutil.rmtree(final)
            os.replace(partial, final)
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            prune(self.dir, self.keep_last, keep | {step})
        except OSError as err:
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        step = self._pending[0] if self._pending else "?"
        if isinstance(err, CheckpointException) and err.failures:  # DCP's wrapper: the ranks' own errors
            err = next(iter(err.failures.values()))[0]
        self.failed = f"checkpoint of step {step} failed: {error_text(err, 200)}"
        log.error("%s; the previous complete checkpoint stays the latest", self.failed)

    def _drain(self) -> str | None:
        """Wait for the save in flight; why it (or an earlier one) failed, or None (a failure is logged once)."""
        self.wait_staged()
        if self._upload is not None:
            t0 = time.perf_counter()
            try:
                self._upload.result()
            except (Exception, CheckpointException) as err:  # DCP's: a BaseException
                self._fail(err)
            self._finished.wait()  # the rename (a callback) ends after result() returns
            self._upload = None
            self.blocked_s += time.perf_counter() - t0
        if self.failed and self._pending is not None and self.info.is_main:
            shutil.rmtree(self._pending[1], ignore_errors=True)  # a failed save's files: never a checkpoint
        self._pending = None
        failed, self.failed = self.failed, None
        return failed

    def wait(self) -> None:
        """Wait for the save in flight: a CheckpointFailed if it (or one since the last wait) failed."""
        if failed := self._drain():
            raise CheckpointFailed(failed)

    def close(self) -> None:
        """Wait for a save in flight (its failure is logged), release the staging pool."""
        self._drain()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
