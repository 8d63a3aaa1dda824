"""From a user's files to a run: ``steadytrain data ingest`` and then ``steadytrain train --set data.path=DIR``.

Oracles: the tokenizer's own vocabulary (a BPE of more than 256 tokens only trains when tiny-lm takes its
vocabulary from the dataset's provenance), the ingested windows (the model's context is their length), and
a finite, falling loss on text the run has seen before."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

from steadytrain.data import open_dataset
from tests.data.test_ingest import sentences, train_bpe
from tests.train_utils import metrics, run_cli, sets

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.dim=32", "model.layers=1", "model.heads=2", "batch.micro_batch_size=4", "batch.global_batch_size=8"]
SMALL += ["batch.base_batch_size=8", "batch.base_lr=0.01", "run.log_every=1"]


def text_folder(path: Path, files: int = 4, docs: int = 60) -> Path:
    path.mkdir()
    for i in range(files):
        (path / f"part{i}.txt").write_text("".join(sentences(docs, i)))
    return path


def ingest(*args: str) -> None:
    proc = run_cli("data", "ingest", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]


def train(run_dir: Path, data: Path, *extra: str, steps: int = 4) -> list[dict]:
    args = sets(f"data.path={data}", f"run.max_steps={steps}", *extra)
    proc = run_cli("train", "--run-dir", str(run_dir), *args, PYTHONPATH=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in rows)
    return rows


def test_a_folder_of_text_trains_with_data_path_alone(tmp_path):
    """The README's path, with nothing but ``data.path`` and a step count set: the embedded defaults."""
    out = tmp_path / "ds"
    ingest(str(text_folder(tmp_path / "txt")), "--out", str(out), "--seq-len", "64")
    rows = train(tmp_path / "run", out, steps=2)
    assert rows[0]["loss"] < math.log(256) * 1.2  # next-byte cross-entropy of an untrained model, near uniform


def test_a_bpe_larger_than_bytes_sets_the_models_vocabulary_and_context(tmp_path):
    tok = train_bpe(tmp_path / "bpe.json", vocab_size=400, byte_level=True)
    vocab = json.loads(tok.read_text())["model"]["vocab"]
    assert len(vocab) > 256  # ids past a byte vocabulary: an embedding of 256 rows could not take them
    out = tmp_path / "ds"
    ingest(str(text_folder(tmp_path / "txt")), "--out", str(out), "--tokenizer", str(tok), "--seq-len", "24")
    prov = open_dataset(out).provenance
    assert prov["seq_len"] == 24 and prov["tokenizer"]["vocab_size"] >= len(vocab)
    rows = train(tmp_path / "run", out, *SMALL, "optim.name=adamw", steps=8)
    assert rows[0]["loss"] < math.log(prov["tokenizer"]["vocab_size"]) * 1.2
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns from the windows it reads
    small = sets(f"data.path={out}", "model.vocab_size=256", "run.max_steps=1")
    proc = run_cli("train", "--run-dir", str(tmp_path / "small"), *small)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    want = f"model.vocab_size=256 is smaller than the dataset's vocab_size ({prov['tokenizer']['vocab_size']}"
    assert want in proc.stderr.strip().splitlines()[-1]


def test_records_train_the_tabular_model(tmp_path):
    rng = random.Random(0)
    src = tmp_path / "rows.csv"
    with src.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["x1", "x2", "color", "label"])
        for _ in range(400):
            x1, x2, color = rng.gauss(0, 1), rng.gauss(0, 1), rng.choice(["red", "green", "blue"])
            w.writerow([f"{x1:.4f}", f"{x2:.4f}", color, int(x1 + x2 > 0) + (color == "red")])
    out = tmp_path / "ds"
    ingest(str(src), "--out", str(out), "--shard-rows", "100")
    assert (out / "schema.yaml").exists() and len(open_dataset(out).shard_ids) == 4
    tab = ["model.name=tabular", "batch.micro_batch_size=16", "batch.global_batch_size=32"]
    tab += ["batch.base_batch_size=32", "batch.base_lr=0.01", "run.log_every=1"]
    rows = train(tmp_path / "run", out, *tab, steps=6)
    assert rows[-1]["loss"] < rows[0]["loss"]
