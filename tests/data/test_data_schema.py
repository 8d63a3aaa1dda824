"""Schema inference, validation and load-time policies, against violations planted at known rows."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from steadytrain.data import (
    FieldSpec,
    Schema,
    SchemaError,
    SchemaViolationError,
    apply_policy,
    check_table,
    infer_schema,
    validate,
)

LANGS = ["ar", "de", "en", "es", "fr", "hi", "it", "ja", "ko", "nl", "pt", "zh"]  # 12 values, sorted
ITEMS = [3, 5, 8, 13]


class FakeDataset:
    """The two things the validator reads from a dataset."""

    def __init__(self, shards: dict[int, pa.Table]):
        self.tables = shards
        self.reads: list[int] = []

    @property
    def shard_ids(self) -> list[int]:
        return sorted(self.tables)

    def read_shard(self, shard_id: int) -> pa.Table:
        self.reads.append(shard_id)
        return self.tables[shard_id]


def healthy_columns(seed: int, n: int = 64) -> dict[str, np.ndarray | list]:
    rng = np.random.default_rng(seed)
    return {
        "lang": rng.choice(LANGS, n).tolist(),
        "item": rng.choice(ITEMS, n).astype(np.int64),
        "user": rng.integers(1000, 2000, n).astype(np.int64),
        "weight": rng.uniform(0.0, 1.0, n).astype(np.float32),
        "score": rng.normal(size=n),
        "emb": [rng.uniform(-1, 1, int(k)).astype(np.float32) for k in rng.integers(0, 4, n)],
    }


def to_table(cols: dict) -> pa.Table:
    types = {"emb": pa.list_(pa.float32())}
    return pa.table({k: pa.array(v, type=types.get(k)) for k, v in cols.items()})


@pytest.fixture(scope="module")
def healthy() -> tuple[FakeDataset, dict[int, dict]]:
    cols = {sid: healthy_columns(sid) for sid in (0, 1, 2)}
    cols[1]["score"][[4, 9]] = np.nan
    tables = {sid: to_table(c) for sid, c in cols.items()}
    tables[2] = tables[2].append_column("note", pa.array(["a", None] * 32))
    return FakeDataset(tables), cols


@pytest.fixture(scope="module")
def schema(healthy) -> Schema:
    return infer_schema(healthy[0], categorical=["item"])


# --- inference --------------------------------------------------------------------------------


def test_infer_types_ranges_vocabularies(healthy, schema):
    ds, cols = healthy
    f = schema.fields
    assert {k: v.dtype for k, v in f.items()} == {
        "lang": "string",
        "item": "int64",
        "user": "int64",
        "weight": "float32",
        "score": "float64",
        "emb": "list<float32>",
        "note": "string",
    }
    weights = np.concatenate([c["weight"] for c in cols.values()])
    assert (f["weight"].min, f["weight"].max) == (float(weights.min()), float(weights.max()))
    scores = np.concatenate([c["score"] for c in cols.values()])
    assert (f["score"].min, f["score"].max) == (np.nanmin(scores), np.nanmax(scores))
    emb = np.concatenate([e for c in cols.values() for e in c["emb"]])
    assert (f["emb"].min, f["emb"].max) == (float(emb.min()), float(emb.max()))
    users = np.concatenate([c["user"] for c in cols.values()])
    assert (f["user"].min, f["user"].max) == (int(users.min()), int(users.max()))
    assert f["score"].allow_nan and not f["weight"].allow_nan and not f["emb"].allow_nan
    assert f["lang"].vocabulary == sorted({x for c in cols.values() for x in c["lang"]})
    assert f["item"].vocabulary == ITEMS  # named categorical
    assert f["user"].vocabulary is None  # integer, not categorical
    assert f["note"].vocabulary == ["a"] and not f["note"].required  # only in shard 2, with nulls
    assert all(spec.required for name, spec in f.items() if name != "note")
    assert validate(ds, schema).ok


def test_infer_subset_and_limits(healthy):
    ds, cols = healthy
    schema = infer_schema(ds, [0], max_categories=5)
    assert schema.fields["lang"].vocabulary is None  # more than 5 distinct values
    assert schema.fields["weight"].max == float(cols[0]["weight"].max())
    assert not schema.fields["score"].allow_nan  # the NaNs are in shard 1
    assert "note" not in schema.fields
    with pytest.raises(ValueError, match="weight"):
        infer_schema(ds, categorical=["weight"])
    with pytest.raises(ValueError, match="nope"):
        infer_schema(ds, categorical=["nope"])
    drift = FakeDataset({0: ds.tables[0], 1: ds.tables[1].set_column(0, "lang", pa.array(range(64)))})
    with pytest.raises(SchemaError, match="shard 1: column 'lang' is 'int64'"):
        infer_schema(drift)


# --- validation -------------------------------------------------------------------------------


def planted(healthy) -> tuple[FakeDataset, set[tuple[int, str, str, int, tuple[int, ...]]]]:
    """Shard 47 of a newer pipeline, carrying every kind of drift at known rows; the expected report."""
    _, cols = healthy
    tile = np.arange(2000) % 64  # shard 0's values, in range by construction
    c = {k: (v[tile] if isinstance(v, np.ndarray) else [v[i] for i in tile]) for k, v in cols[0].items()}
    oov = list(range(100, 2000, 97))  # 20 rows, more than the 10 examples kept
    for i in oov:
        c["lang"][i] = "fr-CA"
    c["weight"][[3, 8]] = np.nan
    c["weight"][[11, 1500]] = [1.5, -0.25]
    c["emb"][7] = np.array([0.0, np.inf], np.float32)
    c["emb"][9] = np.array([5.0], np.float32)
    c["item"][[2, 1999]] = 21
    lang = pa.array(c.pop("lang"))
    table = to_table(c).append_column(
        "lang", pa.array([None if i == 22 else x for i, x in enumerate(lang.to_pylist())])
    )
    table = table.set_column(table.schema.get_field_index("user"), "user", pa.array(c["user"].astype(np.float64)))
    shard_120 = to_table(cols[0]).drop_columns(["score"])
    ds = FakeDataset({0: to_table(cols[0]), 47: table, 120: shard_120})
    expected = {
        (47, "lang", "missing", 1, (22,)),
        (47, "lang", "unexpected_category", len(oov), tuple(oov[:10])),
        (47, "item", "out_of_range", 2, (2, 1999)),
        (47, "item", "unexpected_category", 2, (2, 1999)),
        (47, "user", "wrong_type", 2000, tuple(range(10))),
        (47, "weight", "non_finite", 2, (3, 8)),
        (47, "weight", "out_of_range", 2, (11, 1500)),
        (47, "emb", "non_finite", 1, (7,)),
        (47, "emb", "out_of_range", 1, (9,)),
        (120, "score", "missing", 64, tuple(range(10))),
    }
    return ds, expected


def test_validate_reports_shard_kind_count_examples(healthy, schema):
    ds, expected = planted(healthy)
    report = validate(ds, schema)
    assert {(v.shard, v.field, v.kind, v.count, tuple(v.examples)) for v in report.violations} == expected
    assert not report.ok and report.shards_with_violations == [47, 120]
    assert report.records_checked == {0: 64, 47: 2000, 120: 64}
    assert set(report.by_shard()) == {47, 120} and len(report.by_shard()[120]) == 1
    d = report.to_dict()
    assert d["ok"] is False and len(d["violations"]) == len(expected) and d["records_checked"][47] == 2000
    assert "shard 47" in str(report)
    assert validate(ds, schema, shards=[0]).ok and ds.reads[-1] == 0


def test_infinities_always_caught_nan_only_when_disallowed():
    values = [0.5, math.nan, math.inf, -math.inf, None, 2.0]
    table = pa.table({"x": values})
    lenient = Schema({"x": FieldSpec("float64", min=0.0, max=1.0, allow_nan=True, required=False)})
    masks = check_table(table, lenient)["x"]
    assert masks["non_finite"].nonzero()[0].tolist() == [2, 3]
    assert masks["out_of_range"].nonzero()[0].tolist() == [5]  # ±inf and NaN are not "out of range"
    strict = Schema({"x": FieldSpec("float64")})
    masks = check_table(table, strict)["x"]
    assert masks["non_finite"].nonzero()[0].tolist() == [1, 2, 3]
    assert masks["missing"].nonzero()[0].tolist() == [4]
    assert check_table(table.slice(0, 1), strict) == {}


def test_list_column_maps_elements_to_rows():
    rows = [[0.1, 0.2], [], None, [0.3, math.nan], [2.0], [0.0, -0.5, math.inf], [0.9]]
    arr = pa.array(rows, pa.list_(pa.float32()))
    schema = Schema({"v": FieldSpec("list<float32>", min=0.0, max=1.0)})
    table = pa.Table.from_batches([pa.record_batch({"v": arr.slice(0, 4)}), pa.record_batch({"v": arr.slice(4)})])
    got = {k: m.nonzero()[0].tolist() for k, m in check_table(table, schema)["v"].items()}
    assert got == {"missing": [2], "non_finite": [3, 5], "out_of_range": [4, 5]}
    sliced = {k: m.nonzero()[0].tolist() for k, m in check_table(table.slice(3), schema)["v"].items()}
    assert sliced == {"non_finite": [0, 2], "out_of_range": [1, 2]}
    fixed = pa.table({"v": pa.array([[0.5, 7.0], None, [0.5, 0.5]], pa.list_(pa.float32(), 2))})
    spec = FieldSpec("fixed_size_list<float32>[2]", max=1.0, required=False)
    assert check_table(fixed, Schema({"v": spec}))["v"]["out_of_range"].tolist() == [True, False, False]
    assert check_table(fixed, Schema({"v": FieldSpec("list<float32>")}))["v"]["wrong_type"].all()


def test_dictionary_encoded_column_is_its_value_type():
    table = pa.table({"lang": pa.array(["en", "xx", "de"]).dictionary_encode()})
    masks = check_table(table, Schema({"lang": FieldSpec("string", vocabulary=["en", "de"])}))
    assert masks["lang"]["unexpected_category"].tolist() == [False, True, False]


# --- load-time policies -----------------------------------------------------------------------

POLICY_SCHEMA = Schema(
    {
        "lang": FieldSpec("string", vocabulary=LANGS),
        "age": FieldSpec("int64", min=0, max=120),
        "w": FieldSpec("float32", min=-0.1, max=0.1),
        "v": FieldSpec("list<float64>", min=0.0, max=1.0),
    }
)


def policy_table() -> pa.Table:
    return pa.table(
        {
            "lang": ["en", "de", "en", "fr-CA", "es", "en", "ja", "en"],
            "age": [30, 250, 40, -3, 50, 60, 70, 80],
            "w": pa.array([0.0, 0.5, 0.05, 0.0, math.nan, -7.0, 0.0, 0.0], pa.float32()),
            "v": pa.array([[0.5], [1.5, 0.2], [], [0.1], [0.2], [0.3], [math.inf], None], pa.list_(pa.float64())),
        }
    )


def test_raise_names_shard_example_field_value():
    with pytest.raises(SchemaViolationError) as info:
        apply_policy(policy_table().slice(3), POLICY_SCHEMA, "raise", shard=47, offset=1200)
    e = info.value
    msg = str(e)
    assert msg.startswith(
        "shard 47, example 1200: field 'lang' = 'fr-CA' "
        "is not in the vocabulary (12 values, e.g. 'ar', 'de', 'en', ...)"
    )
    assert (e.shard, e.example, e.field, e.kind, e.value) == (47, 1200, "lang", "unexpected_category", "fr-CA")
    assert isinstance(e, ValueError)
    with pytest.raises(SchemaViolationError, match=r"shard 3, example 11: field 'age' = 250 is outside \[0, 120\]"):
        apply_policy(policy_table(), POLICY_SCHEMA, "raise", shard=3, offset=10)
    with pytest.raises(SchemaViolationError, match=r"example 6: field 'v' = \[inf\] has an element that is not finite"):
        apply_policy(policy_table().slice(6), POLICY_SCHEMA, "raise", shard=0, offset=6)
    with pytest.raises(SchemaViolationError, match="required field 'age' is missing"):
        apply_policy(policy_table().drop_columns(["age"]), POLICY_SCHEMA, "raise", shard=0)
    with pytest.raises(ValueError, match="policy 'skip'"):
        apply_policy(policy_table(), POLICY_SCHEMA, "skip", shard=0)


def test_drop_keeps_exactly_the_clean_rows():
    table = policy_table()
    out, kept, counts = apply_policy(table, POLICY_SCHEMA, "drop", shard=47, offset=100)
    clean = [0, 2]  # row 1: age, w & v out of range, 3: lang & age, 4: NaN, 5: w, 6: inf, 7: null v
    assert out.to_pylist() == table.take(clean).to_pylist()
    assert kept.dtype == np.int64 and kept.tolist() == [100 + i for i in clean]
    assert counts.dropped == 6 and counts.clamped == 0
    assert counts.by_field == {
        "lang": {"unexpected_category": 1},
        "age": {"out_of_range": 2},
        "w": {"non_finite": 1, "out_of_range": 2},
        "v": {"missing": 1, "non_finite": 1, "out_of_range": 1},
    }


def test_clamp_clips_exactly_and_drops_the_unclampable():
    table = policy_table()
    out, kept, counts = apply_policy(table, POLICY_SCHEMA, "clamp", shard=47, offset=0)
    assert kept.tolist() == [0, 1, 2, 5]  # 3: unknown lang, 4: NaN, 6: inf, 7: null
    assert counts.dropped == 4 and counts.clamped == 2  # rows 1 (age, w, v) and 5 (w)
    assert out["age"].to_pylist() == [30, 120, 40, 60]
    assert out["v"].to_pylist() == [[0.5], [1.0, 0.2], [], [0.3]]
    w = out["w"].to_numpy()
    upper = np.float32(0.1)
    if float(upper) > 0.1:  # float32(0.1) rounds up: the largest float32 <= 0.1 is one step below
        upper = np.nextafter(upper, np.float32(0))
    assert float(upper) <= 0.1 < float(np.nextafter(upper, np.float32(1)))
    lower = -upper
    assert w.tolist() == [0.0, upper, np.float32(0.05), lower]
    assert out.schema == table.schema
    assert check_table(out, POLICY_SCHEMA) == {}  # clipped values really are inside [min, max]
    assert counts.by_field["age"] == {"out_of_range": 2}


def test_clean_table_is_returned_untouched():
    table = policy_table().take([0, 2])
    for policy in ("raise", "drop", "clamp"):
        out, kept, counts = apply_policy(table, POLICY_SCHEMA, policy, shard=1, offset=64)
        assert out is table and kept.tolist() == [64, 65] and kept.dtype == np.int64
        assert (counts.dropped, counts.clamped, counts.by_field) == (0, 0, {})
    total = counts.add(apply_policy(policy_table(), POLICY_SCHEMA, "drop", shard=1)[2])
    assert total.add(apply_policy(policy_table(), POLICY_SCHEMA, "drop", shard=2)[2]).dropped == 12
    assert total.by_field["age"] == {"out_of_range": 4}


# --- YAML -------------------------------------------------------------------------------------


def test_yaml_round_trip_with_sidecar_vocabulary(tmp_path):
    big = [f"tok{i:03d}" for i in range(60)]
    ids = list(range(0, 300, 5))
    schema = Schema(
        {
            "token": FieldSpec("string", vocabulary=big),
            "lang": FieldSpec("string", vocabulary=["en", "no", "yes", "1"]),
            "item": FieldSpec("int64", min=0, max=295, vocabulary=ids),
            "flag": FieldSpec("bool", vocabulary=[False, True], required=False),
            "w": FieldSpec("float32", min=-0.1, max=1e-7, allow_nan=True),
            "emb": FieldSpec("list<float32>", min=-1.0, max=1.0),
        }
    )
    path = tmp_path / "shards.yaml"
    schema.save(path)
    assert (tmp_path / "shards.token.vocab.txt").read_text().split("\n") == [*big, ""]
    assert (tmp_path / "shards.item.vocab.txt").exists() and not (tmp_path / "shards.lang.vocab.txt").exists()
    text = path.read_text()
    assert "vocabulary: shards.token.vocab.txt" in text and "tok000" not in text
    assert Schema.load(path) == schema
    assert Schema.from_dict(schema.to_dict()) == schema


def test_hand_written_yaml_with_aliases_and_relative_vocabulary(tmp_path):
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "langs.txt").write_text("en\r\nde\n\nfr\n")
    path = tmp_path / "s.yaml"
    path.write_text(
        "fields:\n"
        "  lang: {dtype: utf8, vocabulary: vocab/langs.txt}\n"
        "  w: {dtype: float, max: 1}\n"
        "  x: {dtype: 'list<item: double>'}\n"
    )
    schema = Schema.load(path)
    assert schema.fields["lang"] == FieldSpec("string", vocabulary=["en", "de", "fr"])
    assert schema.fields["w"].dtype == "float32" and schema.fields["x"].dtype == "list<float64>"


@pytest.mark.parametrize(
    ("text", "field", "expect"),
    [
        ("fields: {a: {dtype: int64}\n", None, "not valid YAML"),
        ("- a\n- b\n", None, "expected a mapping with a 'fields' mapping"),
        ("fields: {a: {dtype: int64}}\nfeilds: {}\n", None, "unknown top-level key 'feilds'"),
        ("fields: {a: int64}\n", "a", "expected a mapping with at least a 'dtype', got 'int64'"),
        ("fields: {a: {dtype: flaot32}}\n", "a", "'dtype' = 'flaot32' is not a type name (expected e.g. 'int64'"),
        ("fields: {a: {dtype: int64, alow_nan: true}}\n", "a", "unknown key 'alow_nan'"),
        ("fields: {a: {dtype: int64, min: low}}\n", "a", "'min' = 'low' is not a finite number"),
        ("fields: {a: {dtype: int64, min: 5, max: 1}}\n", "a", "'min' = 5 is above 'max' = 1"),
        ("fields: {a: {dtype: string, max: 1}}\n", "a", "'max' = 1 is set but dtype 'string' is not numeric"),
        ("fields: {a: {dtype: float64, allow_nan: maybe}}\n", "a", "'allow_nan' = 'maybe' is not a boolean"),
        ("fields: {a: {dtype: float64, vocabulary: [1.5]}}\n", "a", "dtype 'float64' is not categorical"),
        ("fields: {a: {dtype: string, vocabulary: [en, no]}}\n", "a", "value False is not a string"),
        ("fields: {a: {dtype: int64, vocabulary: [1, x]}}\n", "a", "value 'x' is not an integer"),
        ("fields: {a: {dtype: int64, vocabulary: 3}}\n", "a", "'vocabulary' = 3 is neither a list nor a file path"),
        ("fields: {a: {dtype: string, vocabulary: gone.txt}}\n", "a", "'vocabulary' = 'gone.txt': cannot read"),
        ("fields: {a: {dtype: int64, vocabulary: ids.txt}}\n", "a", "ids.txt, line 2: 'seven' is not an integer"),
    ],
)
def test_malformed_yaml_names_file_field_and_value(tmp_path, text, field, expect):
    (tmp_path / "ids.txt").write_text("1\nseven\n")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SchemaError) as info:
        Schema.load(path)
    msg = str(info.value)
    assert msg.startswith(str(path)) and expect in msg
    if field is not None:
        assert f"field {field!r}" in msg
