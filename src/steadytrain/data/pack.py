"""Worker output to shards, in input order: token windows (``--kind text``) or rows (``--kind records``).

Tokens are packed into consecutive, non-overlapping windows of ``seq_len + 1``; the last partial
window is padded with the end-of-document token, so every token is in exactly one window, in order.
Padding never outweighs the data: input shorter than one window becomes one window of all of it (no
padding; ``seq_len`` in the provenance is that window's), never a window of ``seq_len + 1`` allocated
to hold a few tokens.
Records are cut into shards of ``shard_rows`` rows as they come. Each shard's provenance names the
source files whose data it holds (``sources``: path, size, sha256), the lines skipped since the shard
before it (``skipped_lines``, with ``skip_bad``), and on the last shard the padding (``pad_tokens``).
The newest full shard is held back until the next one exists or the input ends, so the last shard is
known when it is written.

Shards go through :class:`AsideWriter`: a :class:`~steadytrain.data.DatasetWriter` (same checks, same
atomic shard files) for a directory no other process writes, which writes ``index.json`` once, at the
end, rather than after every shard (rewriting a growing index per shard costs time quadratic in the
number of shards: minutes for the ten thousand shards of a 10 GB corpus).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from steadytrain._io import write_atomic, write_text_atomic
from steadytrain.data.format import DatasetWriter
from steadytrain.data.index import FORMAT, INDEX, VERSION, ShardInfo, shard_file
from steadytrain.data.sources import IngestError, Source, describe

__all__ = ["AsideWriter", "Output", "ShardPacker"]

log = logging.getLogger(__name__)


class AsideWriter(DatasetWriter):
    """A :class:`~steadytrain.data.DatasetWriter` for a new directory only this process writes: shards are
    checked, serialized and created as usual, numbered from 0; the index is written by :meth:`finish`.

    Until then the directory is no dataset (no ``index.json``), which is right for a directory that is
    renamed into place only when complete.
    """

    def __init__(self, path: Any, *, provenance: dict[str, Any]):
        super().__init__(path, provenance=provenance)
        self._entries: list[dict[str, Any]] = []

    def _commit(
        self, data: pa.Buffer, digest: str, num_rows: int, shard_id: int | None, prov: dict[str, Any]
    ) -> ShardInfo:
        shard_id = len(self._entries)
        name = shard_file(shard_id)
        write_atomic(self.path / name, lambda f: f.write(data), replace=False)
        info = ShardInfo(id=shard_id, file=name, records=num_rows, sha256=digest, bytes=data.size, provenance=prov)
        self._entries.append(asdict(info))
        return info

    def finish(self) -> None:
        """Write ``index.json`` listing every shard written."""
        index = {"format": FORMAT, "version": VERSION, "provenance": self.provenance, "shards": self._entries}
        write_text_atomic(self.path / INDEX, json.dumps(index, indent=1, allow_nan=False) + "\n")


@dataclass
class Output:
    """What a worker made of one chunk."""

    data: np.ndarray | pa.Table | None
    """Tokens (end-of-document tokens included), or rows."""
    counts: list[tuple[int, int]] = field(default_factory=list)
    """``(source index, tokens or rows)`` in order: whose data it is."""
    skipped: int = 0
    notes: list[str] = field(default_factory=list)
    """The first few skipped lines, ``file:line: what``."""


class ShardPacker:
    """Cut worker outputs into shards and write them with ``writer``.

    Args:
        writer: where the shards go.
        sources: the input files (described in provenance the first time a shard holds their data).
        shard_rows: windows (text) or records per shard.
        width: tokens per window (``seq_len + 1``); None for records.
        eod: the end-of-document token, which pads the last window.
        skip_bad: record ``skipped_lines`` in every shard.
    """

    def __init__(
        self,
        writer: DatasetWriter,
        sources: list[Source],
        *,
        shard_rows: int,
        width: int | None,
        eod: int = 0,
        skip_bad: bool = False,
    ):
        self.writer, self.sources = writer, sources
        self.shard_rows, self.width, self.eod, self.skip_bad = shard_rows, width, eod, skip_bad
        self._parts: list[Any] = []
        self._size = 0  # tokens or rows in _parts
        self._owners: deque[list[int]] = deque()  # [source, tokens or rows] not yet in a shard
        self._described: dict[int, dict[str, Any]] = {}
        self._held: tuple[Any, dict[str, Any]] | None = None
        self._skipped = 0
        self.shards = self.rows = self.tokens = self.skipped = 0

    @property
    def _unit(self) -> int:
        """Tokens or rows per shard."""
        return self.shard_rows * (self.width or 1)

    def add(self, out: Output) -> None:
        """Take one chunk's output (in input order) and write every shard it completes but the newest."""
        self._skipped += out.skipped
        self.skipped += out.skipped
        n = 0 if out.data is None else len(out.data)
        if n == 0:
            return
        self._parts.append(out.data)
        self._size += n
        for source, count in out.counts:
            if count and self._owners and self._owners[-1][0] == source:
                self._owners[-1][1] += count
            elif count:
                self._owners.append([source, count])
        if self._size >= self._unit:
            data = self._concat()
            full = len(data) // self._unit * self._unit
            for start in range(0, full, self._unit):
                self._shard(data[start : start + self._unit], {})
            rest = data[full:]
            self._parts, self._size = ([rest] if len(rest) else []), len(rest)

    def close(self) -> None:
        """Write what is left (the last window padded) and the held-back shard; the last gets ``pad_tokens``."""
        last: dict[str, Any] = {}
        if self._size:
            data = self._concat()
            if self.width is not None:
                if self.shards == 0 and self._held is None and len(data) < self.width:
                    self._shrink(len(data))
                pad = -len(data) % self.width
                data = np.concatenate([data, np.full(pad, self.eod, dtype=data.dtype)])
                last["pad_tokens"] = pad
            self._shard(data, last)
        elif self.width is not None and self._held is not None:
            self._held[1]["pad_tokens"] = 0
        if self._held is not None:
            self._held[1]["skipped_lines"] = self._held[1].get("skipped_lines", 0) + self._skipped
            self._skipped = 0
            self._write(*self._held)
            self._held = None

    def _shrink(self, tokens: int) -> None:
        """All the input is ``tokens``, fewer than a window: the window shrinks to hold them all, unpadded."""
        if tokens < 2:
            raise IngestError(
                "all the input is 1 token (one empty document): a window holds 2 at least (an input and its "
                "target): give input with text in it"
            )
        log.warning(
            "--seq-len %d: all the input is %d tokens, fewer than a window of %d: written as one window of them all "
            "(seq_len %d), never padded out",
            self.width - 1,
            tokens,
            self.width,
            tokens - 1,
        )
        self.width = tokens
        self.writer.provenance["seq_len"] = tokens - 1

    def _concat(self) -> Any:
        if self.width is not None:
            return np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]
        return pa.concat_tables(self._parts) if len(self._parts) > 1 else self._parts[0]

    def _take_sources(self, n: int) -> list[dict[str, Any]]:
        """The sources of the next ``n`` tokens or rows, described."""
        out = []
        while n > 0:
            owner = self._owners[0]
            take = min(n, owner[1])
            owner[1] -= take
            n -= take
            if owner[0] not in self._described:
                self._described[owner[0]] = describe(self.sources[owner[0]])
            out.append(self._described[owner[0]])
            if owner[1] == 0:
                self._owners.popleft()
        return out

    def _shard(self, data: Any, provenance: dict[str, Any]) -> None:
        """Make the next shard; write the one held back before it."""
        pad = provenance.get("pad_tokens", 0)
        prov = {"sources": self._take_sources(len(data) - pad), **provenance}
        prov["skipped_lines"], self._skipped = self._skipped, 0
        if self._held is not None:
            self._write(*self._held)
        if self.width is not None:
            self.tokens += len(data) - pad
            data = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(data), self.width)})
        self._held = (data, prov)

    def _write(self, table: pa.Table, provenance: dict[str, Any]) -> None:
        if not self.skip_bad:
            provenance.pop("skipped_lines", None)
        self.writer.write_shard(table, provenance=provenance)
        self.shards += 1
        self.rows += table.num_rows
