"""`steadytrain report` of a mixture run (``data.sources``): the per-source plots and the table of sources.

The runs are written by hand (config, plan, environment, metrics with the per-source columns, ``sources.json``
from :class:`SourceMap`), as in ``test_hardening_runs``: no training. Oracles: the rows as written (the final loss
is the last ``loss/<name>``, the best the lowest ``val_loss/<name>`` or else the lowest ``loss/<name>``, chosen by
hand below), the weights normalised by hand, the PNG format's own header, the lines of the Markdown as a renderer
splits them, and the one line of a user error.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from steadytrain.data.sourcemap import SourceMap, SourceSpan
from steadytrain.errors import UserError
from steadytrain.runs import load_run, mixplots, mixture
from steadytrain.runs.report import report
from tests.cli_utils import assert_user_error
from tests.runs.test_hardening_runs import HOSTILE, PLAN, PLOTS, cli, fake_run, rows

SPANS = [
    SourceSpan("web", "/data/web", 3.0, 0, 2, records=600),
    SourceSpan("code", "/data/code", 1.0, 2, 3, records=900),
    SourceSpan("books", "/data/books", 1.0, 5, 1, records=50),
]
SCHEDULE = [{"step": 7, "weights": {"web": 1, "code": 1, "books": 2}}]
EXPOSURE = {
    "web": {"examples": 900, "epoch": 1, "epochs": 1.5, "shards": {"0": 450, "1": 450}},
    "code": {"examples": 300, "epoch": 0, "epochs": 300 / 900, "shards": {"0": 100, "1": 100, "2": 100}},
}  # books: nothing seen, nothing recorded
PER_SOURCE = {  # the last row of each 4-step logging interval; books never logged
    4: {"loss/web": 3.9, "loss/code": 4.0, "mix/web": 0.75, "mix/code": 0.25},
    8: {"loss/web": 3.6, "loss/code": 3.0, "mix/web": 0.7, "mix/code": 0.3},
    12: {"loss/web": 3.25, "loss/code": 3.5, "mix/web": 0.25, "mix/code": 0.75},
}
EVALS = [
    {"step": 6, "val_loss": 3.6, "val_items": 32, "val_loss/web": 3.5, "val_items/web": 24},
    {"step": 12, "val_loss": 3.4, "val_items": 32, "val_loss/web": 3.375, "val_items/web": 24},
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def training_rows(per_source: dict[int, dict] = PER_SOURCE) -> list[dict]:
    return [{**r, **per_source.get(r["step"], {})} for r in rows(12)]


def mixture_run(path: Path, *, spans=SPANS, per_source=PER_SOURCE, evals=EVALS, sources: str | None = None) -> Path:
    """A 12-step mixture run; ``sources``: the text of ``sources.json`` instead of the map's."""
    run = fake_run(path, metrics=training_rows(per_source) + evals, plan={**PLAN, "total_steps": 12})
    text = sources if sources is not None else json.dumps(SourceMap(spans, SCHEDULE, "web", EXPOSURE).to_dict())
    (run / "sources.json").write_text(text)
    return run


def table(summary: str) -> dict[str, list[str]]:
    """The sources table's cells by source name (split on the pipes that are not escaped)."""
    lines = summary.splitlines()
    start = lines.index("| source | weight | examples seen | epochs | final training loss | best loss |")
    out = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        out[cells[0]] = cells[1:]
    return out


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def test_the_table_holds_each_sources_numbers_from_its_rows(tmp_path):
    run = mixture_run(tmp_path / "run")
    rep = report(run)
    summary = (run / "summary.md").read_text()
    cells = table(summary)
    # weights 3, 1, 1 of 5; final = the row at step 12; best: web's lowest val_loss/web (3.375 < 3.5), code has no
    # validation rows: its lowest loss/code (3.0 at step 8); books: no rows, no exposure
    assert cells["web"] == ["3 (60.0%)", "900", "1.50", "3.25 (step 12)", "3.375 (validation, step 12)"]
    assert cells["code"] == ["1 (20.0%)", "300", "0.33", "3.5 (step 12)", "3 (training, step 8)"]
    assert cells["books"] == ["1 (20.0%)", "—", "—", "—", "—"]
    assert "`run.epochs` counts the epochs of source web (the largest)" in summary
    assert "`data.mix_schedule` changes them from step(s) 7 " in summary
    for name in ("source_loss", "mixture"):
        assert png_size(run / "plots" / f"{name}.png") == (800, 450)
        assert f"![{name}](plots/{name}.png)" in summary
    assert set(rep.plots) == {*PLOTS, "source_loss", "mixture"} and not rep.failed
    assert "| optimizer steps | 12 of 12 planned |" in summary  # the run's own table is as before


def test_final_loss_passes_over_intervals_without_the_source_but_not_a_non_finite_one(tmp_path):
    none_seen = {**PER_SOURCE, 12: {**PER_SOURCE[12], "loss/code": None, "mix/code": 0.0, "mix/web": 1.0}}
    cells = table(report(mixture_run(tmp_path / "a", per_source=none_seen)).summary.read_text())
    assert cells["code"][3] == "3 (step 8)"
    not_finite = {**PER_SOURCE, 12: {**PER_SOURCE[12], "loss/code": None}}  # code had examples: they were not finite
    cells = table(report(mixture_run(tmp_path / "b", per_source=not_finite)).summary.read_text())
    assert cells["code"][3] == "n/a (not finite) (step 12)" and cells["code"][4] == "3 (training, step 8)"


def test_the_plan_is_the_weights_from_step_1_then_the_schedules_normalised(tmp_path):
    sources = mixture.load_mixture(load_run(mixture_run(tmp_path / "run")))
    assert mixture.planned_shares(sources) == [(1, [0.6, 0.2, 0.2]), (7, [0.25, 0.25, 0.5])]


def test_the_plots_draw_the_rows_as_written(tmp_path, monkeypatch):
    rec = load_run(mixture_run(tmp_path / "run"))
    sources = mixture.load_mixture(rec)
    figures = []
    monkeypatch.setattr(mixplots, "_save", lambda fig, path: figures.append(fig) or path)
    mixplots.source_loss_plot(rec, tmp_path / "a.png", sources=sources)
    mixplots.mixture_plot(rec, tmp_path / "b.png", sources=sources)
    losses, mixed = (fig.axes[0] for fig in figures)
    drawn = [(list(line.get_xdata()), list(line.get_ydata())) for line in losses.lines if len(line.get_xdata())]
    assert ([4, 8, 12], [3.9, 3.6, 3.25]) in drawn and ([4, 8, 12], [4.0, 3.0, 3.5]) in drawn
    assert ([6, 12], [3.5, 3.375]) in drawn  # web's validation markers
    # the planned top edges: web 0.6 then 0.25 from step 7, web + code 0.8 then 0.5, held to the end (step 13)
    dashed = [(list(line.get_xdata()), list(line.get_ydata())) for line in mixed.lines if line.get_linestyle() == "--"]
    dashed = [d for d in dashed if d[0]]
    assert dashed == [([1, 7, 13], [0.6, 0.25, 0.25]), ([1, 7, 13], [0.8, 0.5, 0.5])]
    assert len(mixed.collections) == 3  # one band per source


def test_a_single_source_run_has_no_table_and_no_mixture_plots(tmp_path):
    run = fake_run(tmp_path / "run")
    rep = report(run)
    summary = (run / "summary.md").read_text()
    assert "**Sources.**" not in summary and "| source |" not in summary
    assert set(rep.plots) == set(PLOTS)
    assert sorted(p.stem for p in (run / "plots").iterdir()) == sorted(PLOTS)


def test_a_run_with_no_per_source_rows_yet_still_reports(tmp_path):
    run = mixture_run(tmp_path / "run", per_source={}, evals=[])
    rep = report(run)
    assert set(table(rep.summary.read_text())) == {"web", "code", "books"} and not rep.failed
    assert all(table(rep.summary.read_text())[n][3:] == ["—", "—"] for n in ("web", "code", "books"))
    assert (run / "plots" / "mixture.png").is_file() and (run / "plots" / "source_loss.png").is_file()


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", ["sources.json", "not valid JSON"]),
        ("[1, 2]", ["sources.json", "[1, 2] is not a mixture's sources"]),
        (json.dumps({"sources": [{"name": "web"}]}), ["sources.json", "sources[0].path=None"]),
        (json.dumps({**SourceMap(SPANS).to_dict(), "schedule": [{"step": 0, "weights": {}}]}), ["schedule[0].step"]),
        (json.dumps({**SourceMap(SPANS).to_dict(), "schedule": [{"step": 3, "weights": {"web": "x"}}]}), ["weights"]),
        (json.dumps(SourceMap(SPANS, exposure={"web": {"examples": "many"}}).to_dict()), ["exposure.'web'.examples"]),
        (json.dumps(SourceMap([SourceSpan("web", "/w", 0.0, 0, 1)]).to_dict()), ["weights are all 0"]),
        (json.dumps({**SourceMap(SPANS).to_dict(), "schedule": [{"step": 3, "weights": {"x": 1}}]}), ["no source"]),
        (json.dumps({"sources": [{**SPANS[0].to_dict(), "weight": "nan"}]}), ["weight='nan' must be a number"]),
    ],
    ids=["not-json", "list", "no-path", "step-0", "weight-text", "examples-text", "zero", "elsewhere", "weight-nan"],
)
def test_a_damaged_sources_json_is_one_line_before_anything_is_written(tmp_path, text, words):
    run = mixture_run(tmp_path / "run", sources=text)
    assert_user_error(cli("report", str(run)), "sources.json", *words)
    assert not (run / "summary.md").exists() and not (run / "plots").exists()


def test_a_per_source_value_of_the_wrong_type_is_one_line_naming_it(tmp_path):
    run = mixture_run(tmp_path / "run", per_source={8: {"loss/web": "high"}})
    assert_user_error(cli("report", str(run)), "metrics.jsonl: step 8", "loss/web='high'")
    with pytest.raises(UserError, match="mix/code"):
        report(mixture_run(tmp_path / "b", per_source={4: {"mix/code": -0.5}}))


def test_a_hostile_source_name_stays_inert_in_the_summary_and_the_plots(tmp_path):
    name = HOSTILE + " | $\\frac{$ [x](javascript:alert(1))"
    spans = [SourceSpan(name, "/h", 1.0, 0, 1), SourceSpan("web", "/w", 1.0, 1, 1)]
    per_source = {4: {f"loss/{name}": 2.0, f"mix/{name}": 0.5, "loss/web": 3.0, "mix/web": 0.5}}
    run = mixture_run(tmp_path / "run", spans=spans, per_source=per_source, evals=[])
    proc = cli("report", str(run))
    assert proc.returncode == 0, proc.stderr
    text = (run / "summary.md").read_text()
    lines = text.splitlines()
    assert [line for line in lines if line.lstrip().startswith("#")] == [lines[0]]
    assert "<img" not in text and "[x](javascript" not in text
    (row,) = [line for line in lines if "INJECTED" in line and line.startswith("|")]
    assert len(re.split(r"(?<!\\)\|", row)) == 8  # six cells: the name's pipe is escaped
    assert "2 (step 4)" in row
    assert (run / "plots" / "source_loss.png").is_file() and (run / "plots" / "mixture.png").is_file()


def test_the_per_source_columns_are_the_rows_that_carry_them(tmp_path):
    rec = load_run(mixture_run(tmp_path / "run"))
    assert mixture.series(rec.metrics, "loss/code") == ([4, 8, 12], [4.0, 3.0, 3.5])
    assert mixture.series(rec.evals, "val_loss/code") == ([], [])
