"""Benchmark: input MB/s of ``steadytrain.data.ingest`` against a hand-written tokenize-and-pack loop.

A generated text corpus (``--mb`` MB, default 64, in files of about 100 KB: words drawn from a Zipf
law over a generated vocabulary, sentences and paragraphs; no download) and a byte-level BPE of 8192
tokens trained here on a 2 MB sample. Compared, interleaved, one full ingest each per round:

* ``baseline``            -- one process: read every file, ``Tokenizer.encode_batch`` on groups of about
  1 MiB of files, ``<|endoftext|>`` after each, packed into windows of 129 with NumPy, Parquet shards
  of 8192 windows written with ``pq.write_table``: the loop one would write by hand;
* ``steadytrain 1 worker`` -- ``ingest(..., workers=1)``: the same work plus provenance (sha256 of every
  input), checksummed shards written atomically (fsync), the index, the rename into place;
* ``steadytrain 2 workers`` -- ``ingest(..., workers=2)``: tokenization in 2 forked processes.

Both tokenize with the library's own threads where they tokenize in-process (``TOKENIZERS_PARALLELISM``
is left alone); the workers of ``workers=2`` run one thread each. The token streams are checked to be
identical. Ratios are medians of paired ratios over the rounds. Target: 1 worker >= 0.9x the baseline.

Usage::

    python bench/ingest.py [--mb 64] [--rounds 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from steadytrain.data.ingest import ingest

SEQ_LEN = 128
SHARD_ROWS = 8192
FILE_BYTES = 100_000


def generate(root: Path, mb: int) -> list[Path]:
    """``mb`` MB of generated text in files of about 100 KB (kept between runs)."""
    files = sorted(root.glob("*.txt"))
    if files and sum(f.stat().st_size for f in files) >= mb * 1e6:
        return files
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    syllables = np.array(["ka", "to", "ri", "n", "se", "mu", "la", "pe", "qu", "is", "o", "th", "er", "an", "é"])
    vocab = np.array(["".join(rng.choice(syllables, rng.integers(1, 5))) for _ in range(30_000)])
    written = 0
    while written < mb * 1e6:
        words = vocab[np.minimum(rng.zipf(1.2, FILE_BYTES // 5), len(vocab)) - 1]
        marks = rng.choice(np.array([" ", " ", " ", " ", " ", ", ", ". ", ".\n", ".\n\n"]), len(words))
        text = "".join(np.char.add(words, marks).tolist())
        path = root / f"doc-{len(files):05d}.txt"
        path.write_text(text)
        files.append(path)
        written += path.stat().st_size
    return sorted(files)


def train(files: list[Path], path: Path) -> Path:
    """A byte-level BPE of 8192 tokens with ``<|endoftext|>``, trained on the first 2 MB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([f.read_text() for f in files[:20]], trainer)
    tok.save(str(path))
    return path


def baseline(files: list[Path], tok_path: Path, out: Path) -> None:
    """The hand-written loop."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eod = tok.token_to_id("<|endoftext|>")
    out.mkdir(parents=True)
    width, unit = SEQ_LEN + 1, SHARD_ROWS * (SEQ_LEN + 1)
    pending: list[np.ndarray] = []
    shards = 0

    def flush(tokens: np.ndarray) -> None:
        nonlocal shards
        arr = pa.FixedSizeListArray.from_arrays(pa.array(tokens), width)
        pq.write_table(pa.table({"tokens": arr}), out / f"shard-{shards:05d}.parquet")
        shards += 1

    group: list[str] = []
    size = 0
    for i, f in enumerate(files):
        group.append(f.read_text())
        size += len(group[-1])
        if size < 1 << 20 and i < len(files) - 1:
            continue
        ids = [[*e.ids, eod] for e in tok.encode_batch(group, add_special_tokens=False)]
        pending.append(np.fromiter(itertools.chain.from_iterable(ids), np.uint16, count=sum(map(len, ids))))
        group, size = [], 0
        stream = np.concatenate(pending)
        full = len(stream) // unit * unit
        for start in range(0, full, unit):
            flush(stream[start : start + unit])
        pending = [stream[full:]]
    rest = np.concatenate(pending)
    flush(np.concatenate([rest, np.full(-len(rest) % width, eod, np.uint16)]))


def ours(src: Path, tok_path: Path, out: Path, workers: int) -> None:
    """``ingest`` as a library call."""
    ingest([src], out, tokenizer=tok_path, seq_len=SEQ_LEN, workers=workers)


def token_digest(out: Path) -> str:
    """The sha256 of every window of every shard in ``out``, in order (read after the clock stopped)."""
    digest = hashlib.sha256()
    for f in sorted(out.glob("shard-*.parquet")):
        digest.update(pq.read_table(f).column("tokens").combine_chunks().values.to_numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="corpus size in MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/steadytrain-bench-ingest")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    files = generate(root / "corpus", args.mb)
    total = sum(f.stat().st_size for f in files)
    tok_path = train(files, root / "tokenizer.json")
    print(f"corpus: {len(files)} files, {total / 1e6:.1f} MB; BPE 8192; seq_len {SEQ_LEN}")
    methods = {
        "baseline (hand-written, 1 process)": lambda out: baseline(files, tok_path, out),
        "steadytrain 1 worker": lambda out: ours(root / "corpus", tok_path, out, 1),
        "steadytrain 2 workers": lambda out: ours(root / "corpus", tok_path, out, 2),
    }
    names = list(methods)
    secs: dict[str, list[float]] = {m: [] for m in names}
    digests = set()
    for r in range(args.rounds):
        for m in names[r % len(names) :] + names[: r % len(names)]:
            out = root / "out"
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            methods[m](out)
            secs[m].append(time.perf_counter() - t)
            digests.add(token_digest(out))
    assert len(digests) == 1, "the token streams differ"
    base = names[0]
    print(f"| method | MB/s (median of {args.rounds}) | ratio to baseline (median of paired) |")
    print("|---|---:|---:|")
    for m in names:
        ratio = statistics.median(b / s for b, s in zip(secs[base], secs[m], strict=True))
        print(f"| {m} | {total / 1e6 / statistics.median(secs[m]):.1f} | {ratio:.3f} |")
    w1, w2 = secs[names[1]], secs[names[2]]
    speedup = statistics.median(a / b for a, b in zip(w1, w2, strict=True))
    print(f"2 workers / 1 worker: {speedup:.2f}x; target: 1 worker >= 0.9x baseline; token streams identical")


if __name__ == "__main__":
    main()
