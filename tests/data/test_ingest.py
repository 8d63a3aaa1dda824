"""``steadytrain data ingest`` against independent references: the documents' own bytes, ``tokenizers``
encoding each document, pyarrow reading the same JSON lines / CSV / Parquet; bad input through the CLI;
a kill -9 in the middle of an ingest."""

from __future__ import annotations

import csv
import gzip
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest

from steadytrain.cli import main
from steadytrain.data import Schema, ShardedDataset, open_dataset, validate
from steadytrain.data.ingest import IngestError, ingest
from steadytrain.data.sources import PIECE_BYTES
from steadytrain.errors import UserError
from tests.cli_utils import EXE, assert_user_error

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "naïve",
    "café",
    "ünïcödé",
    "東京",
    "data",
    "shard",
    "token",
    "window",
]


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), rng.integers(1, 30))]
        out.append(" ".join(words) + (".\n" if rng.random() < 0.5 else "\n\n"))
    return out


def train_bpe(
    path: Path, *, vocab_size: int = 150, eod: str | None = "<|endoftext|>", byte_level: bool = False
) -> Path:
    """A tiny BPE trained on a few hundred strings, saved as JSON: on characters split at whitespace, or
    byte-level (GPT-2 style: whitespace belongs to tokens, so any cut in the text changes the tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level else pre_tokenizers.Whitespace()
    specials = ([] if byte_level else ["[UNK]"]) + ([eod] if eod else [])
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(sentences(300, 0), trainer)
    tok.save(str(path))
    return path


def shards_of(path: Path) -> list[pa.Table]:
    """Every shard read with plain pyarrow, in index order."""
    index = json.loads((path / "index.json").read_text())
    return [pq.read_table(path / s["file"]) for s in index["shards"]]


def flat_tokens(path: Path) -> tuple[np.ndarray, dict]:
    """All windows of a text dataset, flattened, the padding stripped; and the index."""
    index = json.loads((path / "index.json").read_text())
    width = index["provenance"]["seq_len"] + 1
    parts = []
    for table in shards_of(path):
        col = table.column("tokens").combine_chunks()
        assert col.type.list_size == width
        parts.append(col.values.to_numpy())
    flat = np.concatenate(parts)
    pad = index["shards"][-1]["provenance"]["pad_tokens"]
    assert pad < width and all(flat[len(flat) - pad :] == index["provenance"]["tokenizer"]["eod"])
    return flat[: len(flat) - pad], index


def write_text_tree(root: Path) -> list[bytes]:
    """Documents in a directory tree (plain, .gz, .zst, one larger than a piece, one with no newline at all,
    UTF-8 text of another name); returns their bytes in the order ingest reads them (sorted by path inside the
    directory). A hidden file and a binary one are there too, never read."""
    docs = {
        "a.txt": b"first document\nwith two lines\n",
        "b/c.txt": "ünïcödé — 東京\r\nno trailing newline".encode(),
        "b/d.txt.gz": b"gzip'd\ndocument\n",
        "b/e.txt.zst": "zstd document ✓\n".encode(),
        "big.txt": "".join(sentences(40_000, 1)).encode(),
        "empty.txt": b"",
        "long.txt": (("x" * 999 + "é") * 1500 + "\n").encode(),
        "notes.md": "# UTF-8 text of any name is text ✓\n".encode(),
        "z.txt": b"\x00\xff raw bytes, not UTF-8\n",
    }
    assert len(docs["big.txt"]) > 2 * PIECE_BYTES and b"\n" not in docs["long.txt"][:-1]
    for rel, data in docs.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".gz"):
            path.write_bytes(gzip.compress(data))
        elif rel.endswith(".zst"):
            with pa.CompressedOutputStream(str(path), "zstd") as f:
                f.write(data)
        else:
            path.write_bytes(data)
    (root / ".hidden.txt").write_text("never read")
    (root / "b" / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00 binary: skipped inside a directory")
    return [docs[k] for k in sorted(docs)]


def test_text_bytes_round_trip(tmp_path):
    docs = write_text_tree(tmp_path / "src")
    result = ingest([tmp_path / "src"], tmp_path / "ds", seq_len=64, shard_rows=500)
    flat, index = flat_tokens(tmp_path / "ds")
    assert index["provenance"]["tokenizer"] == {"name": "bytes", "vocab_size": 257, "sha256": None, "eod": 256}
    assert index["provenance"]["dtype"] == "uint16" and shards_of(tmp_path / "ds")[0].column("tokens").type == (
        pa.list_(pa.uint16(), 65)
    )
    ends = np.flatnonzero(flat == 256)
    assert len(ends) == len(docs) and ends[-1] == len(flat) - 1  # every document ends with EOD
    got = [flat[s + 1 : e].astype(np.uint8).tobytes() for s, e in zip([-1, *ends[:-1]], ends, strict=True)]
    assert got == docs
    assert result.tokens == len(flat) == sum(map(len, docs)) + len(docs)
    assert result.rows * 65 == result.tokens + result.pad_tokens and result.shards == len(index["shards"])
    # sources: every file in exactly the shards its bytes landed in, named as given + path inside the directory
    named = [p["path"] for s in index["shards"] for p in s["provenance"]["sources"]]
    files = ("a.txt", "b/c.txt", "b/d.txt.gz", "b/e.txt.zst", "big.txt", "empty.txt", "long.txt", "notes.md", "z.txt")
    assert sorted(set(named)) == [str(tmp_path / "src" / k) for k in files]
    first = index["shards"][0]["provenance"]["sources"][0]
    assert first["size"] == len(docs[0]) and len(first["sha256"]) == 64
    assert result.binary_files == (str(tmp_path / "src" / "b" / "img.png"),)
    assert result.files == f"read {len(files)} files ({len(files)} text); skipped 1 binary"


@pytest.mark.parametrize(("eod", "byte_level", "dtype"), [("<|endoftext|>", True, "uint16"), (None, False, "uint8")])
def test_text_bpe_from_txt_and_jsonl_field(tmp_path, eod, byte_level, dtype):
    from tokenizers import Tokenizer

    tok_path = train_bpe(tmp_path / "tok.json", eod=eod, byte_level=byte_level, vocab_size=400 if byte_level else 150)
    tok = Tokenizer.from_file(str(tok_path))
    docs = ["".join(sentences(int(n), int(n))) for n in np.random.default_rng(3).integers(1, 40, 200)]
    docs += ["", "东京 ✓ emoji 🙂"]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    whole = "".join(sentences(2000, 9)) + "end.\n\ntail"  # smaller than a piece: one document, tokenized whole
    (tmp_path / "a.txt").write_text(whole)
    sources = [tmp_path / "a.txt", tmp_path / "docs.jsonl"]
    ingest(sources, tmp_path / "ds", tokenizer=tok_path, field="text", seq_len=32, shard_rows=64)
    flat, index = flat_tokens(tmp_path / "ds")
    vocab = tok.get_vocab_size()
    eod_id = tok.token_to_id(eod) if eod else vocab
    expected = [i for d in [whole, *docs] for i in [*tok.encode(d).ids, eod_id]]
    assert flat.tolist() == expected
    prov = index["provenance"]["tokenizer"]
    assert prov["name"] == "tok.json" and prov["eod"] == eod_id
    assert prov["vocab_size"] == (vocab if eod else vocab + 1)
    assert index["provenance"]["dtype"] == str(np.min_scalar_type(prov["vocab_size"] - 1)) == dtype


def test_text_from_a_parquet_column(tmp_path):
    docs = ["first", None, "ünïcödé\nsecond", ""]
    pq.write_table(pa.table({"text": docs, "n": [1, 2, 3, 4]}), tmp_path / "d.parquet")
    with pytest.raises(IngestError, match=r"d\.parquet:2: column 'text' is null"):
        ingest([tmp_path / "d.parquet"], tmp_path / "ds", field="text")
    with pytest.raises(IngestError, match="not a string"):
        ingest([tmp_path / "d.parquet"], tmp_path / "ds", field="n")
    ingest([tmp_path / "d.parquet"], tmp_path / "ds", field="text", seq_len=8, skip_bad=True)
    flat, _ = flat_tokens(tmp_path / "ds")
    assert flat.tolist() == [t for d in docs if d is not None for t in [*d.encode(), 256]]


def test_same_shards_for_any_number_of_workers(tmp_path):
    tok_path = train_bpe(tmp_path / "tok.json")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"part{i}.txt").write_text("".join(sentences(6000, 10 + i)))
    with open(src / "more.jsonl", "w") as f:
        for d in sentences(20_000, 20):
            f.write(json.dumps({"text": d}) + "\n")
    digests = []
    for workers in (1, 3):
        out = tmp_path / f"ds{workers}"
        ingest([src], out, tokenizer=tok_path, field="text", seq_len=64, shard_rows=256, workers=workers)
        digests.append([s.sha256 for s in open_dataset(out).shards])
    assert len(digests[0]) > 3 and digests[0] == digests[1]


def test_first_bad_line_in_input_order_for_any_number_of_workers(tmp_path):
    lines = [json.dumps({"text": d}) for d in sentences(40_000, 5)]
    lines[30_000] = "{not json"  # a late chunk
    lines[20] = '{"text": 7}'  # the first chunk: reported, whichever chunk a worker finishes first
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    for workers in (1, 3):
        with pytest.raises(IngestError, match=r"d\.jsonl:21: field 'text' is a number"):
            ingest([tmp_path / "d.jsonl"], tmp_path / "ds", field="text", workers=workers)
        assert not (tmp_path / "ds").exists()
    (tmp_path / "e.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n{"text": \n')  # found by two passes
    with pytest.raises(IngestError, match=r"e\.jsonl:2: no field 'text'"):
        ingest([tmp_path / "e.jsonl"], tmp_path / "ds", field="text")
    (tmp_path / "e.jsonl").write_text('{"n": 1}\n{"n": 2}\n{"n": "x"}\n{"n": \n')
    with pytest.raises(IngestError, match=r"e\.jsonl:3: field 'n' = 'x' does not fit"):
        ingest([tmp_path / "e.jsonl"], tmp_path / "ds")
    result = ingest([tmp_path / "d.jsonl"], tmp_path / "ds", field="text", workers=3, skip_bad=True)
    assert result.skipped_lines == 2
    assert sum(s.provenance["skipped_lines"] for s in open_dataset(tmp_path / "ds").shards) == 2


def test_a_later_row_that_does_not_fit_is_a_bad_line_never_converted(tmp_path):
    lines = [json.dumps({"n": i, "s": str(i)}) for i in range(100_000)]  # > 1 MiB: rows past the first piece
    lines[90_000] = json.dumps({"n": 2.5, "s": "x"})  # would be truncated to 2 by a plain pyarrow conversion
    lines[95_000] = json.dumps({"n": 1, "s": "x", "new": True})
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(IngestError, match=r"r\.jsonl:90001: field 'n' = 2\.5 does not fit"):
        ingest([tmp_path / "r.jsonl"], tmp_path / "ds")
    result = ingest([tmp_path / "r.jsonl"], tmp_path / "ds", skip_bad=True)
    assert result.skipped_lines == 2 and result.rows == 99_998
    got = pa.concat_tables(shards_of(tmp_path / "ds")).column("n").to_pylist()
    assert got == [i for i in range(100_000) if i not in (90_000, 95_000)]


def check_records(out: Path, reference: pa.Table) -> None:
    """The rows read back equal ``reference``; schema.yaml loads and the data validates against it."""
    got = pa.concat_tables(shards_of(out))
    assert got.column_names == reference.column_names
    assert got.to_pylist() == reference.to_pylist()
    ds = open_dataset(out)
    assert ds.provenance["kind"] == "records" and not validate(ds, Schema.load(out / "schema.yaml")).by_shard()


def test_records_from_jsonl(tmp_path):
    langs = ["en", "de", "fr"]
    rows = [{"id": i, "score": i / 7, "lang": langs[i % 3], "tag": None if i % 5 else "x"} for i in range(30_000)]
    rows[3]["score"] = 2  # an integer among floats: a float column
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest([tmp_path / "r.jsonl"], tmp_path / "ds", shard_rows=7000)
    check_records(tmp_path / "ds", pajson.read_json(tmp_path / "r.jsonl"))
    assert len(open_dataset(tmp_path / "ds").shards) == 5


def test_records_from_csv_with_quoted_newlines_across_pieces(tmp_path):
    lines = ["id,price,name,note"]
    for i in range(80_000):
        note = f'"line one, {i}\nline ""two"""' if i % 7 == 0 else ("" if i % 11 == 0 else f"plain {i}")
        lines.append(f"{i},{i * 0.25 if i % 13 else ''},name{i % 17},{note}")
    (tmp_path / "r.csv").write_text("\n".join(lines) + "\n")
    assert (tmp_path / "r.csv").stat().st_size > 2 * PIECE_BYTES
    ingest([tmp_path / "r.csv"], tmp_path / "ds")
    opts = pacsv.ConvertOptions(strings_can_be_null=True)
    ref = pacsv.read_csv(tmp_path / "r.csv", pacsv.ReadOptions(), pacsv.ParseOptions(newlines_in_values=True), opts)
    check_records(tmp_path / "ds", ref)
    assert [str(t) for t in shards_of(tmp_path / "ds")[0].schema.types] == ["int64", "double", "string", "string"]


def test_records_from_parquet(tmp_path):
    n = 100_000
    table = pa.table(
        {"x": np.arange(n, dtype=np.int32), "y": np.linspace(0, 1, n), "s": [f"v{i % 9}" for i in range(n)]}
    )
    pq.write_table(table.slice(0, 60_000), tmp_path / "a.parquet")
    pq.write_table(table.slice(60_000), tmp_path / "b.parquet")
    ingest([tmp_path / "a.parquet", tmp_path / "b.parquet"], tmp_path / "ds", shard_rows=40_000, workers=2)
    check_records(tmp_path / "ds", table)
    sources = [[p["path"] for p in s.provenance["sources"]] for s in open_dataset(tmp_path / "ds").shards]
    assert sources[1] == [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed command, as a user runs it."""
    return subprocess.run([EXE, "data", "ingest", *args], capture_output=True, text=True, timeout=120)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command's entry point in this process (the same code, without a second of imports per case)."""
    logger = logging.getLogger("steadytrain.data")
    saved = logger.handlers[:], logger.propagate, logger.level
    try:
        rc = main(["data", "ingest", *args])
    finally:
        logger.handlers[:], logger.propagate, logger.level = saved
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


BAD_CASES = {
    "malformed-json": ("d.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": \n', ["--field", "text"], "d.jsonl:3"),
    "missing-field": ("d.jsonl", b'{"text": "a"}\n{"body": "b"}\n', ["--field", "text"], "d.jsonl:2"),
    "non-string-field": ("d.jsonl", b'{"text": ["a"]}\n', ["--field", "text"], "d.jsonl:1"),
    "bad-utf8-jsonl": ("d.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', ["--field", "text"], "d.jsonl:2"),
    "bad-utf8-txt-bpe": ("d.txt", b"fine\nbad \xc3\x28 byte\n", ["--tokenizer", "TOK"], "d.txt:2"),
    "not-a-tokenizer": ("d.txt", b"hi\n", ["--tokenizer", "NOTTOK"], "not a Hugging Face tokenizers file"),
    "binary-tokenizer": ("d.txt", b"hi\n", ["--tokenizer", "BINTOK"], "not UTF-8"),
    "corrupt-gz": ("d.txt.gz", gzip.compress(b"x\n" * 1000)[:-30] + b"\x00" * 30, [], "d.txt.gz"),
    "seq-len-0": ("d.txt", b"hi\n", ["--seq-len", "0"], "--seq-len"),
    "field-not-in-csv": ("d.csv", b"a,b\n1,2\n", ["--field", "nope"], "has no column 'nope' (columns: 'a', 'b')"),
    "csv-text-no-field": ("d.csv", b"a,b\n1,2\n", ["--kind", "text"], "--field"),
    "parquet-text-no-field": ("d.parquet", None, ["--kind", "text"], "--field"),
    "records-from-txt": ("d.txt", b"hi\n", ["--kind", "records"], "--kind text"),
    "reserved-column": ("d.jsonl", b'{"index": 1}\n', [], "rename"),
    "string-in-int-column": ("d.jsonl", b'{"n": 1}\n{"n": "2"}\n', [], "d.jsonl:2"),
    "binary-file": ("d.bin", b"\x89PNG\r\n\x1a\n\x00\x00\xff", [], "not a file ingest reads"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, case):
    name, data, args, words = BAD_CASES[case]
    src = tmp_path / name
    if data is None:
        pq.write_table(pa.table({"text": ["a"]}), src)
    else:
        src.write_bytes(data)
    if "TOK" in args:
        train_bpe(tmp_path / "tok.json")
    (tmp_path / "not-tok.json").write_text('{"vocab": [1, 2]}')
    (tmp_path / "bin-tok.json").write_bytes(bytes(range(256)))
    subst = {"TOK": "tok.json", "NOTTOK": "not-tok.json", "BINTOK": "bin-tok.json"}
    args = [str(tmp_path / subst[a]) if a in subst else a for a in args]
    proc = run_main(capsys, str(src), "--out", str(tmp_path / "out"), *args)
    assert_user_error(proc, words)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # the aside directory is gone


def test_bad_paths_and_out(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "d.txt").write_text("hi\n")
    assert_user_error(run_main(capsys, str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")), "no such file")
    assert_user_error(run_main(capsys, str(tmp_path / "empty"), "--out", str(tmp_path / "o")), "no .txt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("precious")
    assert_user_error(run_main(capsys, str(tmp_path / "d.txt"), "--out", str(tmp_path / "full")), "not empty")
    assert (tmp_path / "full" / "keep").read_text() == "precious"
    proc = run_cli(str(tmp_path / "d.txt"), "--out", str(tmp_path / "empty"))  # an empty directory is fine
    assert proc.returncode == 0 and "1 shards" in proc.stdout and (tmp_path / "empty" / "index.json").exists()


def test_skip_bad_counts_lines_in_provenance(tmp_path):
    case = b'{"text": "a"}\n{"text": \n{"body": 1}\n{"text": 2}\n{"text": "\xff"}\n{"text": "b"}\n'
    (tmp_path / "d.jsonl").write_bytes(case)
    proc = run_cli(str(tmp_path / "d.jsonl"), "--field", "text", "--out", str(tmp_path / "ds"), "--skip-bad")
    assert proc.returncode == 0, proc.stderr
    assert "4 bad line(s) skipped" in proc.stdout and "d.jsonl:2" in proc.stderr
    flat, index = flat_tokens(tmp_path / "ds")
    assert flat.tolist() == [ord("a"), 256, ord("b"), 256]
    assert sum(s["provenance"]["skipped_lines"] for s in index["shards"]) == 4


def test_kill_9_leaves_nothing_at_out_and_a_second_ingest_succeeds(tmp_path):
    (tmp_path / "big.txt").write_text("".join(sentences(60_000, 7)))
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "steadytrain", "data", "ingest", str(tmp_path / "big.txt"), "--out", str(out)]
    proc = subprocess.Popen([*cmd, "--seq-len", "64", "--shard-rows", "8"], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once the aside directory holds a few shards
            asides = list(tmp_path.glob(".ds.ingest-*"))
            if asides and len(list(asides[0].glob("shard-*.parquet"))) >= 3:
                break
            assert proc.poll() is None, "the ingest finished before it could be killed: use a larger input"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and len(list(tmp_path.glob(".ds.ingest-*"))) == 1
    result = ingest([tmp_path / "big.txt"], out, seq_len=64)
    open_dataset(out).verify()
    assert result.tokens == (tmp_path / "big.txt").stat().st_size + 1


def test_readable_by_sharded_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("".join(sentences(500, 2)))
    ingest([tmp_path / "a.txt"], tmp_path / "ds", seq_len=16, shard_rows=40)
    batch = next(iter(ShardedDataset(tmp_path / "ds", batch_size=4)))
    assert tuple(batch["tokens"].shape) == (4, 17)


def test_two_ingests_to_one_directory_one_wins(tmp_path):
    (tmp_path / "a.txt").write_text("".join(sentences(30_000, 8)))
    out = tmp_path / "ds"
    args = [EXE, "data", "ingest", str(tmp_path / "a.txt"), "--out", str(out), "--shard-rows", "64"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    _, _, err = next(r for r in results if r[0] == 2)
    assert len(err.strip().splitlines()) == 1 and ("another ingest" in err or "not empty" in err), err
    open_dataset(out).verify()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]


def test_a_dataset_inside_src_is_skipped_and_a_dataset_as_src_is_refused(tmp_path, capsys):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n")
    first = ingest([src], src / "ds", seq_len=8)  # the output lands inside the input folder
    second = ingest([src], tmp_path / "again", seq_len=8)  # a re-run reads the text, not the first's shards
    assert second.tokens == first.tokens == len("hello world\n") + 1
    assert_user_error(run_main(capsys, str(src / "ds"), "--out", str(tmp_path / "o")), "data.path=")
    assert not (tmp_path / "o").exists()


# --- the --field column, --seq-len, text of any name -------------------------------------------------------


def write_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` in the format ``path`` names (.parquet, .jsonl, .csv), compressed when it ends .gz or .zst."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    fmt = path.name.split(".")[1]
    if fmt == "jsonl":
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    else:
        out = io.StringIO(newline="")
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        data = out.getvalue().encode()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    if path.suffix == ".zst":
        with pa.CompressedOutputStream(str(path), "zstd") as f:
            f.write(data)
        return
    path.write_bytes(data)


ROWS = [
    {"text": "first document", "lang": "en"},
    {"text": 'a comma, a "quote"\nand a newline', "lang": "de"},
    {"text": "ünïcödé 東京", "lang": "ja"},
]


@pytest.mark.parametrize("name", ["d.parquet", "d.csv", "d.csv.gz", "d.csv.zst", "d.jsonl", "d.jsonl.gz"])
def test_a_field_the_file_lacks_is_one_line_naming_it_and_the_columns(tmp_path, cli, name):
    write_rows(tmp_path / name, ROWS)
    r = cli("data", "ingest", tmp_path / name, "--out", tmp_path / "ds", "--field", "nope")
    assert_user_error(r, "--field", "'nope'", name, "'text'", "'lang'")
    assert not (tmp_path / "ds").exists()
    # the column that exists is the text, a document per row, CSV included
    r = cli("data", "ingest", tmp_path / name, "--out", tmp_path / "ds", "--field", "text", "--seq-len", "8")
    assert r.returncode == 0, r.stderr
    flat, _ = flat_tokens(tmp_path / "ds")
    assert flat.tolist() == [t for row in ROWS for t in [*row["text"].encode(), 256]]


def seq_len_bound() -> int:
    """The training config's bound on ``data.seq_len``, as pydantic enforces it."""
    from steadytrain.train.setup.config import DataConfig

    return next(m.le for m in DataConfig.model_fields["seq_len"].metadata if getattr(m, "le", None) is not None)


def test_seq_len_is_bounded_like_the_training_configs(tmp_path, cli):
    bound = seq_len_bound()
    (tmp_path / "a.txt").write_bytes(b"x" * (bound + 100))
    r = cli("data", "ingest", tmp_path / "a.txt", "--out", tmp_path / "ds", "--seq-len", bound + 1)
    assert_user_error(r, "--seq-len", str(bound + 1), str(bound))
    assert not (tmp_path / "ds").exists()
    with pytest.raises(UserError, match=f"seq_len=1000000000 .* at most {bound}"):
        ingest([tmp_path / "a.txt"], tmp_path / "ds", seq_len=1_000_000_000)  # refused before anything is made
    r = cli("data", "ingest", tmp_path / "a.txt", "--out", tmp_path / "ds", "--seq-len", bound)
    assert r.returncode == 0, r.stderr
    assert open_dataset(tmp_path / "ds").provenance["seq_len"] == bound


@pytest.mark.parametrize("size", [2, 11, 60, 128, 129, 200])
def test_input_shorter_than_a_window_is_one_unpadded_window(tmp_path, size):
    (tmp_path / "a.txt").write_bytes(bytes(range(97, 123)) * 8)  # 208 bytes
    (tmp_path / "a.txt").write_bytes((tmp_path / "a.txt").read_bytes()[:size])
    result = ingest([tmp_path / "a.txt"], tmp_path / "ds", seq_len=128)
    flat, index = flat_tokens(tmp_path / "ds")
    assert flat.tolist() == [*(tmp_path / "a.txt").read_bytes(), 256] and result.tokens == size + 1
    width = min(129, size + 1)  # a window of all the data when it is shorter than one of seq_len + 1
    assert index["provenance"]["seq_len"] == width - 1 == index["shards"][0]["provenance"]["seq_len"]
    assert shards_of(tmp_path / "ds")[0].column("tokens").type.list_size == width
    assert result.pad_tokens == -(size + 1) % width and result.pad_tokens < result.tokens


def test_a_folder_of_text_of_any_name_is_read_and_binary_files_are_counted(tmp_path, cli):
    notes = tmp_path / "notes"
    texts = {
        "README": "no extension\n",
        "a.md": "# A note ✓\n",
        "code/x.py": "print('hi')\n",
        "code/y.rst": "Title\n=====\n",
        "data.json": '{"a": 1}\n',
        "zipped.md.gz": "compressed note\n",
    }
    for rel, text in texts.items():
        (notes / rel).parent.mkdir(parents=True, exist_ok=True)
        (notes / rel).write_bytes(gzip.compress(text.encode()) if rel.endswith(".gz") else text.encode())
    write_rows(notes / "rows.csv", ROWS)
    write_rows(notes / "rows.jsonl", ROWS[:2])
    write_rows(notes / "more.jsonl.gz", ROWS[2:])
    binary = {"img.png": b"\x89PNG\r\n\x1a\n\x00\x00", "latin1.log": "café\n".encode("latin-1")}
    binary["code/utf16.txt.bak"] = "utf-16\n".encode("utf-16")
    for rel, data in binary.items():
        (notes / rel).write_bytes(data)
    r = cli("data", "ingest", notes, "--out", tmp_path / "ds", "--field", "text", "--seq-len", "16")
    assert r.returncode == 0, r.stderr
    assert "read 9 files (6 text, 2 jsonl, 1 csv); skipped 3 binary" in r.stdout
    assert all(str(notes / rel) in r.stderr for rel in binary)  # named in a warning
    docs = {rel: [text] for rel, text in texts.items()}
    docs |= {"rows.csv": [x["text"] for x in ROWS], "rows.jsonl": [x["text"] for x in ROWS[:2]]}
    docs["more.jsonl.gz"] = [ROWS[2]["text"]]
    flat, _ = flat_tokens(tmp_path / "ds")
    assert flat.tolist() == [t for rel in sorted(docs) for d in docs[rel] for t in [*d.encode(), 256]]
    # a folder of .md files alone is text; a binary file named on its own is refused
    r = cli("data", "ingest", notes / "code", "--out", tmp_path / "code", "--seq-len", "8")
    assert r.returncode == 0 and "read 2 files (2 text); skipped 1 binary" in r.stdout, r.stderr
    r = cli("data", "ingest", notes / "img.png", "--out", tmp_path / "img")
    assert_user_error(r, "img.png", "binary")
