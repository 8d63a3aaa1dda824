"""Careless input to ``steadytrain data ingest``, ``hf:`` models and the trackers config: each case against
the data itself (the tokens are the text's own UTF-8 bytes) or one clear line naming the file, key and fix."""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import assert_user_error
from tests.data.test_ingest import flat_tokens


@pytest.mark.parametrize("name", ["a.txt", "a.md", "a.txt.gz"])
def test_a_utf8_byte_order_mark_is_not_text(tmp_path, cli, name):
    import gzip

    text = "héllo, wörld\nsecond line\n"
    data = b"\xef\xbb\xbf" + text.encode()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    r = cli("data", "ingest", tmp_path / "src", "--out", tmp_path / "ds", "--seq-len", "8")
    assert r.returncode == 0, r.stderr
    flat, _ = flat_tokens(tmp_path / "ds")
    assert flat.tolist() == [*text.encode(), 256]  # the text's own bytes: no 0xEF 0xBB 0xBF tokens


@pytest.mark.parametrize(("name", "encoding"), [("a.txt", "utf-16"), ("b.jsonl", "utf-16-be"), ("c.csv", "utf-32")])
def test_utf16_text_of_a_known_extension_is_one_line_not_garbage_tokens(tmp_path, cli, name, encoding):
    text = {"a.txt": "hello\n", "b.jsonl": '{"text": "hi"}\n', "c.csv": "text\nhi\n"}[name]
    bom = {"utf-16-be": "\ufeff"}.get(encoding, "")  # utf-16 and utf-32 write their own
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / name).write_bytes((bom + text).encode(encoding))
    field = [] if name.endswith(".txt") else ["--field", "text"]
    r = cli("data", "ingest", tmp_path / "src", "--out", tmp_path / "ds", *field)
    assert_user_error(r, name, "UTF-16", "not UTF-8", "iconv")
    assert not (tmp_path / "ds").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        (["[1, 2]", '"a string"'], ["a.jsonl:1", "is a list, not a JSON object"]),
        (["", "{not json", "{also not"], ["a.jsonl:2", "not valid JSON"]),
    ],
)
def test_records_with_no_good_line_name_the_first_bad_one(tmp_path, cli, lines, words):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text("\n".join(lines) + "\n")
    for skip in ([], ["--skip-bad"]):
        r = cli("data", "ingest", tmp_path / "src", "--out", tmp_path / "ds", *skip)
        assert_user_error(r, "no records", *words, "fix")
        assert not (tmp_path / "ds").exists()
    # one good object anywhere is the schema; the bad lines are then reported as before
    (tmp_path / "src" / "a.jsonl").write_text("\n".join([*lines, json.dumps({"x": 1})]) + "\n")
    r = cli("data", "ingest", tmp_path / "src", "--out", tmp_path / "ds", "--skip-bad")
    assert r.returncode == 0 and "1 records" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ('"a\\nb"', ["control character", "one line"]),  # YAML's escape: a real newline
        ("http://", ["no host", "HOST:PORT"]),
        ("https:///", ["no host"]),
    ],
)
def test_an_mlflow_uri_no_store_can_have_is_one_line_before_the_run(tmp_path, cli, uri, words):
    from tests.train_utils import TINY, sets, write_text_dataset

    data = write_text_dataset(tmp_path / "d", [40, 40])
    items = sets(*TINY, f"data.path={data}", "run.max_steps=1", "run.trackers=[mlflow]", f"run.mlflow_uri={uri}")
    r = cli("train", "--run-dir", tmp_path / "run", *items)
    assert_user_error(r, "run.mlflow_uri", *words)
    assert not (tmp_path / "run").exists() and not any(p.name.startswith("a") for p in tmp_path.iterdir())
