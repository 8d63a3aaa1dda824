"""Background loading: this rank's micro-batches read, converted and transformed in worker processes.

:class:`MicroBatchLoader` wraps a :class:`~steadytrain.data.batched.BatchedDataset`. With
``num_workers = 0`` it is the dataset itself, read in the training process. With ``N > 0`` a PyTorch
``DataLoader`` runs ``N`` worker processes: worker ``w`` reads this rank's micro-batches ``w, w+N, ...``
of the remaining epoch (the dataset's own split, :meth:`BatchedDataset.iter_columns`), each keeps
``ceil(prefetch / N)`` ready, and the loader hands them back in their order. So the examples of every
optimizer step, the position a checkpoint saves (kept here, in the training process, as each
micro-batch is handed over) and an exact resume are those of the in-process reader, for any ``N``.

A worker that raises (a corrupt shard, the user's transform) or dies (killed, out of memory) is one
:class:`DataWorkerError` naming the micro-batch and the shards it reads, never a hang: a failure
travels in order as a value, and a dead worker is noticed by the DataLoader's liveness check within
seconds. Workers never touch the process-wide torch RNG: the DataLoader gets its own generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from steadytrain._check import check_int
from steadytrain._text import error_text
from steadytrain.data.batched import BatchedDataset
from steadytrain.errors import UserError

__all__ = ["DataWorkerError", "MicroBatchLoader", "default_num_workers"]

log = logging.getLogger(__name__)


class DataWorkerError(UserError):
    """A background data worker raised or died; the message names the micro-batch and its shards."""


def default_num_workers() -> int:
    """2 on a machine with more than 2 usable cores, else 0 (read in the training process)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    return 2 if cores > 2 else 0


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What a worker sends instead of the micro-batch it could not make."""

    worker: int
    micro: int
    error: str


def _keep(item: Any) -> Any:
    return item  # the worker's (micro-batch number, micro-batch) as it is: no collation


WIRE_MAX_BYTES = 1 << 20
"""A tensor up to this size travels from a worker as a NumPy array pickled through the worker's pipe (a copy
of its bytes); a larger one in shared memory. Each shared-memory tensor costs a segment created, sent and
mapped: about 0.4 ms, so a micro-batch of 8 small columns took 3.7 ms to hand over, and 0.23 ms pickled
(measured on 2 CPU cores)."""


@dataclasses.dataclass(frozen=True)
class _Wire:
    """A small CPU tensor's values on their way from a worker (a NumPy array: pickled, no shared memory)."""

    array: Any


def _to_wire(mb: Any) -> Any:
    if not isinstance(mb, dict):
        return mb
    out = {}
    for k, v in mb.items():
        small = isinstance(v, torch.Tensor) and v.numel() * v.element_size() <= WIRE_MAX_BYTES
        if small and v.device.type == "cpu" and not v.requires_grad:
            with contextlib.suppress(TypeError):  # a dtype NumPy lacks (bfloat16) stays a tensor
                v = _Wire(v.numpy())
        out[k] = v
    return out


def _from_wire(mb: Any) -> Any:
    if not isinstance(mb, dict):
        return mb
    return {k: torch.from_numpy(v.array) if isinstance(v, _Wire) else v for k, v in mb.items()}


class _Numbered(IterableDataset):
    """In a worker: ``(m, micro-batch)`` of the worker's share, then a :class:`_Failure` if it raised."""

    def __init__(self, dataset: BatchedDataset, wire: bool) -> None:
        self.dataset, self.wire = dataset, wire

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        due = self.dataset.micro + wid
        try:
            for m, mb in self.dataset.iter_numbered():
                yield m, _to_wire(mb) if self.wire else mb
                due = m + n
        except Exception as err:  # sent in order, raised by the training process with where it happened
            notes = " ".join(getattr(err, "__notes__", ()))
            yield _Failure(wid, due, f"{type(err).__name__}: {error_text(err)}" + (f" ({notes})" if notes else ""))


class MicroBatchLoader:
    """Iterate ``dataset``'s remaining micro-batches of the epoch, read ahead by ``num_workers`` processes.

    Args:
        dataset: this rank's batched reader (its position advances as micro-batches are handed over).
        num_workers: worker processes; 0 reads in this process.
        prefetch: micro-batches read ahead in all (at least one per worker).
        pin_memory: page-locked host memory for faster, non-blocking copies to a GPU.
    """

    def __init__(self, dataset: BatchedDataset, *, num_workers: int = 0, prefetch: int = 2, pin_memory: bool = False):
        self.dataset = dataset
        self.num_workers = check_int("data.num_workers", num_workers, 0, maximum=256)
        self.prefetch = check_int("data.prefetch", prefetch, 1, maximum=1 << 16)
        self.pin_memory = bool(pin_memory)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.num_workers == 0:
            return iter(self.dataset)
        return self._background()

    def _where(self, m: int) -> str:
        ds = self.dataset
        return f"micro-batch {m} of epoch {ds.epoch} (rank {ds.rank}, shards {ds.micro_batch_shards(m)})"

    def _loader(self) -> DataLoader:
        return DataLoader(
            _Numbered(self.dataset, wire=not self.pin_memory),  # pinning needs tensors: they stay tensors
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=math.ceil(self.prefetch / self.num_workers),
            pin_memory=self.pin_memory,
            collate_fn=_keep,
            generator=torch.Generator().manual_seed(0),  # never a draw from the training RNG
            multiprocessing_context="fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None,
        )

    def _background(self) -> Iterator[dict[str, Any]]:
        ds = self.dataset
        cores = os.cpu_count() or 1
        if self.num_workers > cores:
            log.warning("data.num_workers=%d on %d cores: the workers compete with training", self.num_workers, cores)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create")  # said above, on one line
            loader = self._loader()
        it = _start(loader)
        try:
            while True:
                expected = ds.micro
                try:
                    item = next(it)
                except StopIteration:
                    return
                except RuntimeError as err:
                    if "DataLoader worker" not in str(err):
                        raise
                    raise DataWorkerError(f"data worker died reading {self._where(expected)}: {err}") from None
                if isinstance(item, _Failure):
                    where = self._where(item.micro)
                    raise DataWorkerError(f"data worker {item.worker} failed on {where}: {item.error}")
                m, mb = item
                if m != expected:  # the order is the dataset's: anything else is a bug, never trained on
                    raise RuntimeError(f"data workers handed over micro-batch {m}, expected {expected}")
                ds.micro = m + 1
                yield _from_wire(mb)
        finally:
            with contextlib.suppress(Exception):
                it._shutdown_workers()


def _start(loader: DataLoader) -> Any:
    """The loader's iterator (its workers started), leaving the process's SIGCHLD handling as it was.

    PyTorch installs a SIGCHLD handler that raises wherever the training process happens to be when a
    worker dies (inside a forward, a collective); without it the death is noticed inside ``next()`` by
    the loader's own liveness check, where :class:`MicroBatchLoader` names the micro-batch.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")  # said by MicroBatchLoader
        try:
            before = signal.getsignal(signal.SIGCHLD)
        except (AttributeError, ValueError):  # no SIGCHLD on this platform
            return iter(loader)
        it = iter(loader)
    with contextlib.suppress(ValueError, TypeError):  # not the main thread: leave it
        signal.signal(signal.SIGCHLD, before if before is not None else signal.SIG_DFL)
    return it
