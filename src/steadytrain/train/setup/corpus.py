"""The embedded default dataset: the Python standard library's own source, as byte sequences.

Every machine that runs steadytrain has it, so the default run needs no download. It is written on
first use as a sharded dataset with provenance (which files, which Python) under the user's cache
directory, once: concurrent ranks wait on a file lock, the dataset is built aside and renamed into
place, so a killed build leaves nothing half-written under the final name.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
from filelock import FileLock

from steadytrain._io import brief, ensure_dir
from steadytrain.data import DatasetWriter
from steadytrain.errors import UserError

__all__ = ["cache_dir", "default_corpus"]

log = logging.getLogger(__name__)

CORPUS_VERSION = 1
MAX_BYTES = 4 * 2**20  # enough text for a few hundred steps of tiny-lm without repeating
SEQS_PER_SHARD = 1024


def cache_dir() -> Path:
    """``$STEADYTRAIN_CACHE``, else ``$XDG_CACHE_HOME/steadytrain``, else ``~/.cache/steadytrain``."""
    if os.environ.get("STEADYTRAIN_CACHE"):
        return Path(os.environ["STEADYTRAIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "steadytrain"


def _source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # never descend into installed packages
        out += [Path(here, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _write(path: Path, seq_len: int, max_bytes: int) -> None:
    files = _source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    width = seq_len + 1
    chunks: list[bytes] = []
    names: list[str] = []
    total = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        names.append(str(f.relative_to(root)))
        total += len(data)
        if total >= max_bytes:
            break
    if total < width * SEQS_PER_SHARD:
        raise RuntimeError(f"only {total} bytes of standard library source found under {root}")
    blob = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    seqs = blob[: len(blob) // width * width].reshape(-1, width)
    python = ".".join(map(str, sys.version_info[:3]))
    base = {"source": "python-stdlib", "python": python, "pipeline_version": f"corpus-{CORPUS_VERSION}"}
    with DatasetWriter(path, provenance={**base, "seq_len": seq_len, "files": len(names)}) as writer:
        for start in range(0, len(seqs), SEQS_PER_SHARD):
            part = seqs[start : start + SEQS_PER_SHARD]
            tokens = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), width)
            writer.write_shard(pa.table({"tokens": tokens}), provenance={"first_sequence": start})


def default_corpus(seq_len: int = 128, *, max_bytes: int = MAX_BYTES) -> Path:
    """The embedded corpus for ``seq_len``, written on first use; safe to call from every rank at once."""
    python = "".join(map(str, sys.version_info[:2]))
    root = ensure_dir(cache_dir(), "cache directory (STEADYTRAIN_CACHE, else XDG_CACHE_HOME/steadytrain)")
    final = root / f"corpus-stdlib-py{python}-seq{seq_len}-{max_bytes}-v{CORPUS_VERSION}"
    if (final / "index.json").exists():
        return final
    lock = FileLock(str(final) + ".lock")
    try:
        lock.acquire()
    except OSError as err:
        raise UserError(f"cache directory {brief(str(root))} is not writable ({err.strerror or err})") from None
    try:
        if (final / "index.json").exists():  # another rank built it while we waited
            return final
        aside = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        shutil.rmtree(aside, ignore_errors=True)
        log.info("writing the default corpus (Python standard library source) to %s", final)
        try:
            _write(aside, seq_len, max_bytes)
            os.replace(aside, final)
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        lock.release()
    return final
