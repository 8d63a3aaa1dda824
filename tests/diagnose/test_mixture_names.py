"""``nan report``, ``spikes report`` and ``triage`` of a mixture run name the source of each shard they name.

Synthetic run directories: ledger lines written as JSON by hand, naming mixture (global) shard ids, and a
``sources.json`` whose offsets make the expected ``(source, own shard id)`` of each id a subtraction done here.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from steadytrain.diagnose import read_ledger, report
from steadytrain.diagnose.ledger import dataset_bounds
from steadytrain.errors import UserError
from tests.cli_utils import in_process

SPANS = [("web", 0, 4), ("code", 4, 3), ("math", 7, 5)]
"""``(name, offset, ids)``: web is ids 0-3, code 4-6, math 7-11 (12 ids in all)."""
IDS = 12


def ledger_lines(
    bad: list[int], *, steps: int = 6, seed: int = 1, spike: bool = False, on_rank: int | None = None
) -> list[dict]:
    """``steps`` refused steps, 2 ranks x 8 examples from 8 different shards each; step ``s`` reads one of ``bad``
    (in turn) on rank ``s % 2`` (or ``on_rank``), and its 2 examples there are the flagged ones (non-finite, or a
    spike's outliers)."""
    rng = random.Random(seed)
    lines = []
    for step in range(1, steps + 1):
        hit = bad[(step - 1) % len(bad)]
        for rank in (0, 1):
            others = rng.sample([s for s in range(IDS) if s not in bad], 8)
            mine = rank == (step % 2 if on_rank is None else on_rank)
            shard = [hit, hit, *others[:6]] if mine else others
            flagged = [0, 1] if mine else []
            line = {
                "step": step, "rank": rank, "host": f"node{rank}", "cycle": step - 1,
                "reason": "spike" if spike else "nonfinite_grad_norm", "action": "skip",
                "grad_norm": 3.5 if spike else "nan", "micro_steps": [step - 1, step - 1],
                "nonfinite_micro_batches": [], "shards": sorted(set(shard)),
                "tags": [{"shard": shard, "index": list(range(len(shard))), "finite": not flagged,
                          "nonfinite": flagged}],
            }  # fmt: skip
            if spike:
                line.update(kind="spike", batch=step - 1, value=9.0, threshold=4.0, median=1.0, mad=0.5, loss=9.0)
            lines.append(line)
    return lines


def write_run(run: Path, lines: list[dict], *, ledger: str = "nonfinite.jsonl", mixture: bool = True) -> Path:
    """A run directory holding ``lines`` as ``ledger``, an exposure of 100 examples per id, a config and, for a
    mixture, ``sources.json``."""
    from steadytrain.data.sourcemap import SourceMap, SourceSpan

    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("run: {}\n")
    (run / ledger).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "exposure.json").write_text(json.dumps({str(s): 100 for s in range(IDS)}))
    if mixture:
        spans = [SourceSpan(name, f"/data/{name}", 1.0, offset, ids) for name, offset, ids in SPANS]
        (run / "sources.json").write_text(json.dumps(SourceMap(spans).to_dict()))
    return run


def own(shard: int) -> tuple[str, int]:
    """``(source, own shard id)`` of a mixture id, by a walk over :data:`SPANS` (what the offsets mean)."""
    for name, offset, ids in SPANS:
        if offset <= shard < offset + ids:
            return name, shard - offset
    raise AssertionError(shard)


def cli(*argv: str) -> str:
    proc = in_process(*argv)
    assert proc.returncode == 0 and not proc.stderr, proc.stdout + proc.stderr
    return proc.stdout


def as_single(text: str) -> str:
    """A mixture report's text told as a single-source run's: ``code shard 2 (id 6)`` back to ``shard 6``."""
    return re.sub(r"\w+ shard \d+ \(id (\d+)\)", r"shard \1", text)


# --- nan report, spikes report -------------------------------------------------------------------------------


def test_one_suspect_is_named_in_its_source_in_the_sentence_rows_and_json(tmp_path):
    run = write_run(tmp_path / "run", ledger_lines([6]))  # id 6 = code's shard 6 - 4 = 2
    text = cli("nan", "report", str(run))
    assert "6 of 6 non-finite steps involve code shard 2 (id 6), in source 'code' (8.3% of examples seen)" in text
    assert "(steadytrain nan hunt RUN --shard 6)" in text  # the command takes the mixture id
    assert "\n  code shard 2 (id 6): 6 step(s), 12 non-finite losses" in text
    got = json.loads(cli("nan", "report", str(run), "--json"))
    assert got["suspect_shards"] == [6]
    assert got["suspect_sources"] == [{"shard": 6, "source": "code", "source_shard": 2}]
    assert len(got["shards"]) == IDS
    for row in got["shards"]:  # every id, suspect or not, beside its source: the exposure names all 12
        assert (row["source"], row["source_shard"]) == own(row["shard"])


def test_suspects_all_from_one_source_say_so(tmp_path):
    run = write_run(tmp_path / "run", ledger_lines([5, 6]))
    rep = report(run)
    assert rep.verdict == "shard-selective" and rep.suspect_shards == [5, 6]
    assert "involve code shard 1 (id 5), code shard 2 (id 6), all in source 'code' (16.7% of examples seen)" in (
        rep.sentence
    )
    assert rep.to_dict()["suspect_sources"] == [
        {"shard": 5, "source": "code", "source_shard": 1},
        {"shard": 6, "source": "code", "source_shard": 2},
    ]


def test_suspects_from_several_sources_name_each(tmp_path):
    run = write_run(tmp_path / "run", ledger_lines([5, 10]))  # code 5 - 4 = 1, math 10 - 7 = 3
    text = cli("nan", "report", str(run))
    assert "involve code shard 1 (id 5), math shard 3 (id 10), from sources 'code' and 'math' (" in text
    assert "\n  code shard 1 (id 5): 3 step(s)" in text and "\n  math shard 3 (id 10): 3 step(s)" in text
    got = json.loads(cli("nan", "report", str(run), "--json"))
    assert [(s["shard"], s["source"], s["source_shard"]) for s in got["suspect_sources"]] == [
        (5, "code", 1),
        (10, "math", 3),
    ]


def test_spikes_report_names_the_source_too(tmp_path):
    run = write_run(tmp_path / "run", ledger_lines([9], spike=True), ledger="spikes.jsonl")  # math 9 - 7 = 2
    text = cli("spikes", "report", str(run))
    assert "6 of 6 loss spikes involve math shard 2 (id 9), in source 'math' (8.3% of examples seen)" in text
    assert "(steadytrain spikes hunt RUN --shard 9)" in text
    assert "\n  math shard 2 (id 9): 6 step(s), 12 outlying losses" in text
    got = json.loads(cli("spikes", "report", str(run), "--json"))
    assert got["suspect_sources"] == [{"shard": 9, "source": "math", "source_shard": 2}]
    assert got["layers"] == []  # the spike report's own key, as before


def test_spread_and_rank_selective_name_the_source_of_the_shards_they_show(tmp_path):
    spread = write_run(tmp_path / "spread", ledger_lines([8], steps=1))  # math 8 - 7 = 1
    rep = report(spread)
    assert rep.verdict == "spread" and "(smallest tail p = 0.016 (math shard 1, id 8);" in rep.sentence
    assert rep.to_dict()["suspect_sources"] == []  # a mixture's key, empty: no suspect
    ranked = write_run(tmp_path / "rank", ledger_lines([1, 5, 8], on_rank=0))  # one rank flags 3 sources' shards
    text = cli("nan", "report", str(ranked))
    assert text.startswith("rank-selective: 6 of 6 non-finite steps were flagged on rank(s) 0 on node0")
    rows = [line.split(":")[0].strip() for line in text.splitlines()[1:4]]
    assert rows == ["web shard 1 (id 1)", "code shard 1 (id 5)", "math shard 1 (id 8)"]


def test_without_sources_json_the_report_is_the_single_source_one(tmp_path):
    """The hand-derived single-source report (6 steps; 2 of the 16 examples in play per step from shard 6, both
    flagged: 12 flagged, 1.5 expected, tail (1/8)^12; 100 of 1200 examples seen), and the mixture report differs
    from it only where it names a shard."""
    lines = ledger_lines([6])
    single = write_run(tmp_path / "single", lines, mixture=False)
    p = f"{(1 / 8) ** 12:.2g}"
    want = (
        "shard-selective: 6 of 6 non-finite steps involve shard 6 (8.3% of examples seen); 12 non-finite example "
        "losses came from it where its share of the batches in play predicts 1.5 (binomial tail p = "
        f"{p}, threshold 0.001/12 shards); inspect its data first (steadytrain nan hunt RUN --shard 6)\n"
        f"  shard 6: 6 step(s), 12 non-finite losses (chance: 1.5), 100 examples seen, rate 0.06, p = {p}\n"
        "  local non-finite losses by rank: rank 0: 3, rank 1: 3\n"
    )
    assert cli("nan", "report", str(single)) == want
    mixed = write_run(tmp_path / "mixed", lines)
    assert as_single(cli("nan", "report", str(mixed))).replace(", in source 'code'", "") == want
    (mixed / "sources.json").unlink()
    assert cli("nan", "report", str(mixed)) == want
    plain = json.loads(cli("nan", "report", str(single), "--json"))
    assert "suspect_sources" not in plain
    assert all(set(row) == {"shard", "events", "exposures", "rate", "nonfinite", "expected", "p_value"}
               for row in plain["shards"])  # fmt: skip
    assert cli("nan", "report", str(mixed), "--json") == cli("nan", "report", str(single), "--json")


def test_mixture_json_only_adds_keys(tmp_path):
    lines = ledger_lines([5, 10])
    plain = report(write_run(tmp_path / "single", lines, mixture=False)).to_dict()
    mixed = report(write_run(tmp_path / "mixed", lines)).to_dict()
    assert mixed.pop("suspect_sources") and mixed.pop("sentence") != plain.pop("sentence")
    for row in mixed["shards"]:
        del row["source"], row["source_shard"]
    assert mixed == plain


# --- the dataset bounds a mixture's ledger is checked against -------------------------------------------------


def write_sources(tmp_path: Path, sizes: dict[str, list[int]]) -> tuple[Path, dict]:
    """A run directory over one small dataset per source (``sizes``: records per shard), ``sources.json`` with
    each source's fingerprint, and a mixture's ``data.json`` (no top-level path)."""
    from steadytrain.data import DatasetWriter, open_dataset
    from steadytrain.data.sourcemap import SourceMap, SourceSpan

    spans, offset = [], 0
    for name, counts in sizes.items():
        with DatasetWriter(tmp_path / name) as w:
            for n in counts:
                w.write_shard([{"x": i} for i in range(n)])
        ds = open_dataset(tmp_path / name)
        spans.append(SourceSpan(name, str(tmp_path / name), 1.0, offset, len(counts), sum(counts), ds.fingerprint()))
        offset += len(counts)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    data = SourceMap(spans).to_dict()
    (run / "sources.json").write_text(json.dumps(data))
    (run / "data.json").write_text(json.dumps({"sources": data["sources"]}))
    return run, data


def one_line_ledger(run: Path, shard: list[int], index: list[int]) -> None:
    line = ledger_lines([0], steps=1)[0]
    line.update(shards=sorted(set(shard)), tags=[{"shard": shard, "index": index, "finite": False, "nonfinite": [0]}])
    (run / "nonfinite.jsonl").write_text(json.dumps(line) + "\n")


def test_dataset_bounds_of_a_mixture_are_every_sources_shards_by_mixture_id(tmp_path):
    run, data = write_sources(tmp_path, {"web": [3, 5], "code": [2, 4, 1]})  # code's ids 2, 3, 4
    assert dataset_bounds(run) == {0: 3, 1: 5, 2: 2, 3: 4, 4: 1}
    one_line_ledger(run, [1, 3], [4, 3])  # web shard 1 index 4, code shard 1 index 3: both inside
    assert report(run).steps == [1]
    one_line_ledger(run, [1, 5], [4, 0])
    with pytest.raises(UserError, match="the run's dataset has no shard 5"):
        report(run)
    one_line_ledger(run, [3], [4])  # code shard 1 has 4 records
    with pytest.raises(UserError, match="shard 3 of the run's dataset has 4 records"):
        report(run)
    data["sources"][1]["fingerprint"] = "0" * 64  # code changed since: the positions cannot be judged
    (run / "sources.json").write_text(json.dumps(data))
    assert dataset_bounds(run) is None and report(run).steps == [1]


def test_dataset_bounds_of_a_mixture_whose_source_is_gone_or_grew_are_unknown(tmp_path):
    run, data = write_sources(tmp_path, {"web": [3, 5], "code": [2]})
    data["sources"][0]["fingerprint"] = ""  # not recorded: the shard ids still must fit the run's numbering
    data["sources"][0]["ids"] = 1
    data["sources"][1]["offset"] = 1
    (run / "sources.json").write_text(json.dumps(data))
    assert dataset_bounds(run) is None  # web has a shard 1 the run did not number: it grew
    data["sources"][0]["ids"], data["sources"][1]["offset"] = 2, 2
    (run / "sources.json").write_text(json.dumps(data))
    assert dataset_bounds(run) == {0: 3, 1: 5, 2: 2}
    shutil.rmtree(tmp_path / "code")
    assert dataset_bounds(run) is None


# --- triage ---------------------------------------------------------------------------------------------------


def test_triage_names_the_source_of_the_suspects_for_a_mixture_only(tmp_path):
    from steadytrain.data.sourcemap import read_sources
    from steadytrain.runs.triage import Triage, _name_sources, _suspects

    lines = ledger_lines([5, 6])  # step 2 reads id 6 (code shard 2) on rank 0, its 2 examples flagged
    runs = {
        "mixed": write_run(tmp_path / "mixed", lines),
        "single": write_run(tmp_path / "single", lines, mixture=False),
    }
    found = {}
    for name, run in runs.items():
        events = [e for s, e in read_ledger(run) if s == 2]
        shards, examples, ranks = _suspects(run, events)
        assert (shards, examples, ranks) == ({5, 6}, {(6, 0), (6, 1)}, [0])
        replays = [{"variant": "recorded", "loss": None, "finite": False}]
        data = Triage("data", 2, replays, ranks, [], "non-finite with the suspects, finite without them")
        found[name] = _name_sources(data, read_sources(run), shards, examples)
    assert found["mixed"].note == (
        "non-finite with the suspects, finite without them; the suspects are from code shard 1 (id 5), "
        "code shard 2 (id 6), all in source 'code'"
    )
    assert found["mixed"].to_dict()["suspects"] == [
        {"shard": 5, "source": "code", "source_shard": 1},
        {"shard": 6, "source": "code", "source_shard": 2},
    ]
    assert found["single"].note == "non-finite with the suspects, finite without them"
    assert found["single"].to_dict() == {
        "verdict": "data", "step": 2, "replays": [{"variant": "recorded", "loss": None, "finite": False}],
        "rank": [0], "host": [], "note": "non-finite with the suspects, finite without them",
    }  # fmt: skip
    sources = read_sources(runs["mixed"])
    state = _name_sources(Triage("state", 2, note="non-finite without the suspects too"), sources, set(), {(10, 3)})
    assert state.note == "non-finite without the suspects too"  # not the data: the note stays
    assert state.suspects == [{"shard": 10, "source": "math", "source_shard": 3}]


def test_triage_refuses_a_mixture_whose_source_changed_since_the_run_naming_it(tmp_path):
    from steadytrain.data import DatasetWriter
    from steadytrain.runs.triage import _same_batch

    run, _ = write_sources(tmp_path, {"web": [3, 5], "code": [2]})
    _same_batch(run, tmp_path / "web", 1, [], [])  # every source as the run read it
    with DatasetWriter(tmp_path / "code") as w:
        w.write_shard([{"x": 0}])  # the second source grew: its fingerprint is another
    with pytest.raises(UserError, match=r"code: the data changed since .* in sources.json \(source 'code'\)"):
        _same_batch(run, tmp_path / "web", 1, [], [])
