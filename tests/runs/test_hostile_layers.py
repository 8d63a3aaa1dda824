"""Issue 34's section, file and commands used carelessly and with hostile input: ``monitor.*``, ``RUN/layers.jsonl``
(the layer monitor writing it, resume and rollback cutting it), ``steadytrain layers``, ``report``'s layers plot and
summary, ``spikes report``'s layer attribution.

Each test is a finding: a tracker turned off by a layer's name, a name the model does not have, a run that records
nothing without a word, a plot that drops rows or crashes, an infinite median, a damaged file read as a step, layers
of two groupings compared, a resume refused by the file's size. The oracles are the inputs each test builds: the
user model's own parameter names, the rows written by hand, the steps and checkpoints of the runs trained here.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

from steadytrain._text import md
from steadytrain.diagnose.layers import largest_update_ratios, spike_layers
from steadytrain.train.observe.layers import tracker_fields
from tests.cli_utils import assert_user_error, in_process
from tests.runs.test_hardening_runs import fake_run
from tests.train_utils import TINY, copy_run, run_cli, sets, train, write_text_dataset

NAMES = ["a/b", 'q"x', "n\nl", "sp ace", "a_b"]
"""``parts`` of the user model below: names torch takes and a tracker key does not ('a_b' is what 'a/b' becomes)."""
_MODEL = f'''
import torch
import torch.nn.functional as F


class Gated(torch.nn.Module):
    """A residual wrapper as users write them: a gate of its own, the wrapped layer as ``self.module``."""

    def __init__(self, module):
        super().__init__()
        self.module, self.gate = module, torch.nn.Parameter(torch.ones(1))

    def forward(self, h):
        return h + self.gate * torch.tanh(self.module(h))


class Odd(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(dim))  # on the root module
        self.emb = torch.nn.Embedding(256, dim)
        self.blocks = torch.nn.ModuleList(Gated(torch.nn.Linear(dim, dim)) for _ in range(2))
        self.parts = torch.nn.ModuleDict({{n: torch.nn.Linear(dim, dim) for n in {NAMES!r}}})
        self.frozen = torch.nn.Linear(dim, dim).requires_grad_(False)
        self.head = torch.nn.Linear(dim, 256, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, batch):
        tokens = batch["tokens"].long()
        h = self.emb(tokens[:, :-1]) * self.scale
        for m in [*self.blocks, *self.parts.values(), self.frozen]:
            h = m(h) if isinstance(m, Gated) else h + 0.1 * torch.tanh(m(h))
        return F.cross_entropy(self.head(h).transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def factory(**kw):
    return Odd(**kw)
'''
KEYS = ("grad_norm", "param_norm", "update_norm", "update_ratio")


def _layers(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "layers.jsonl").read_text().splitlines()]


def _write(run: Path, lines: list[dict]) -> Path:
    (run / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def _r(step: int, layer: str, grad: float | None = 1.0, ratio: float | None = 0.1, **extra) -> dict:
    return {"step": step, "layer": layer, "grad_norm": grad, "param_norm": 1.0, "update_norm": ratio,
            "update_ratio": ratio, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("hl") / "data", [64, 64])


@pytest.fixture(scope="module")
def odd(tmp_path_factory, data) -> tuple[Path, Any, subprocess.CompletedProcess]:
    """The user model above, ``monitor.group: module``, 2 steps to MLflow (a file store); the model's module (loaded
    here: the names' oracle); the run's output."""
    tmp = tmp_path_factory.mktemp("odd")
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "oddmodel.py").write_text(_MODEL)
    items = ["model.name=oddmodel:factory", f"data.path={data}", "data.seq_len=32", "batch.micro_batch_size=16",
             "batch.global_batch_size=16", "batch.base_batch_size=16", "run.max_steps=2", "run.log_every=1",
             "monitor.group=module", "eval.holdout_fraction=null", "run.trackers=[mlflow]",
             f"run.mlflow_uri=file://{tmp / 'mlruns'}"]  # fmt: skip
    proc = train(tmp / "run", *items, PYTHONPATH=str(tmp / "pkg"))
    spec = importlib.util.spec_from_file_location("oddmodel_oracle", tmp / "pkg" / "oddmodel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tmp / "run", module, proc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, data) -> Path:
    """TINY, 4 steps, checkpoints at 2 and 4, every step monitored (``auto``: tok, pos, blocks.0, norm, head)."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    train(run, *TINY, f"data.path={data}", "run.max_steps=4", "run.log_every=1", "checkpoint.every_steps=2",
          "checkpoint.keep_last=5", "monitor.every_steps=1", "run.trackers=[]")  # fmt: skip
    return run


# --- names: the model's own, and keys every tracker takes ----------------------------------------------------------


def test_a_users_own_module_part_keeps_its_name_and_its_own_layer(odd):
    """Was: every part named ``module`` was dropped as if DDP's: ``blocks.0``'s gate and ``blocks.0.module``'s
    Linear were one layer ``blocks.0`` (``group: parameter`` named ``blocks.0.module.weight`` ``blocks.0.weight``)."""
    run, module, _ = odd
    model = module.factory()
    owners = [n.rpartition(".")[0] or n for n, p in model.named_parameters() if p.requires_grad]
    want = list(dict.fromkeys(owners))  # the modules holding trainable parameters, in model order
    assert "blocks.0.module" in want and "blocks.0" in want and "frozen" not in want
    assert [r["layer"] for r in _layers(run) if r["step"] == 1] == want
    got = json.loads(in_process("layers", str(run), "--step", "1", "--json").stdout)
    assert [r["layer"] for r in got["layers"]] == want  # the quote and the newline survive --json
    text = in_process("layers", str(run), "--step", "1").stdout.splitlines()
    assert len(text) == 2 + len(want) and "parts.n\\nl" in "\n".join(text)  # one line per layer, newline escaped


def test_layer_names_a_tracker_refuses_reach_it_under_keys_it_takes(odd, monkeypatch):
    """Was: MLflow refused ``layers/parts.q"x/grad_norm`` and was off for the rest of the run (one warning, no more
    metrics there); ``a/b`` and ``a_b`` must not share a key (one's values would overwrite the other's)."""
    from mlflow.tracking import MlflowClient

    run, _, proc = odd
    assert "tracker mlflow" not in proc.stderr, proc.stderr
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store back
    key = {"a/b": "a_b_2", 'q"x': "q_x", "n\nl": "n_l", "sp ace": "sp ace", "a_b": "a_b"}
    state = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(state["uri"])
    got = {k: client.get_metric_history(state["run_id"], k) for k in client.get_run(state["run_id"]).data.metrics}
    for row in _layers(run):
        layer = row["layer"]
        name = "parts." + key[layer.removeprefix("parts.")] if layer.startswith("parts.") else layer
        for k in KEYS:
            history = {m.step: m.value for m in got[f"layers/{name}/{k}"]}
            assert history[row["step"]] == pytest.approx(row[k], rel=1e-12), (layer, k)
    assert len({k for k in got if k.startswith("layers/")}) == 4 * len({r["layer"] for r in _layers(run)})


def test_tracker_keys_stay_distinct_whatever_the_names():
    rows = [_r(1, n) for n in ("x/y", "x_y", "x_y_2", 'x"y', "x\ty")]
    fields = tracker_fields(rows)[1]
    assert len(fields) == 4 * len(rows)  # a key per layer and value: none overwritten
    assert {k.split("/")[1] for k in fields} == {"x_y", "x_y_2", "x_y_3", "x_y_4", "x_y_5"}


# --- a run that monitors nothing ------------------------------------------------------------------------------------


def test_every_steps_beyond_the_run_is_said_at_start_and_by_the_command(tmp_path, data):
    """Was: ``monitor.every_steps`` (or ``run.log_every``, its default) above ``run.max_steps`` recorded nothing
    without a word, and ``steadytrain layers`` blamed ``monitor.layers: off``."""
    proc = train(tmp_path / "run", *TINY, f"data.path={data}", "run.max_steps=2", "monitor.every_steps=3",
                 "run.trackers=[]", "eval.holdout_fraction=null")  # fmt: skip
    assert "monitor.every_steps=3: no step from 1 to 2 is monitored" in proc.stderr
    assert not (tmp_path / "run" / "layers.jsonl").exists()
    said = in_process("layers", str(tmp_path / "run")).stdout
    assert "monitor.every_steps more than the steps run" in said


# --- the plot and the summary on odd but legal rows -----------------------------------------------------------------


def _figure_of(run: Path, monkeypatch):
    from steadytrain.runs import layerplot
    from steadytrain.runs.record import load_run

    drawn = []
    monkeypatch.setattr(layerplot, "_save", lambda fig, path: drawn.append(fig) or path)
    assert layerplot.layers_plot(load_run(run), run / "x.png") == run / "x.png"
    return drawn[0]


def test_two_thousand_layers_draw_the_first_hundred_and_say_so(tmp_path, monkeypatch):
    """Was: 2000 rows in a 270-pixel panel (7 rows a pixel: most never drawn, none readable)."""
    names = [f"blocks.{i}.weight" for i in range(2000)]
    run = _write(fake_run(tmp_path / "run"), [_r(s, n, grad=1.0 + i) for s in (2, 4) for i, n in enumerate(names)])
    fig = _figure_of(run, monkeypatch)
    grad = fig.axes[0].images[0].get_array()
    assert grad.shape == (100, 2)
    assert grad[:, 0].tolist() == [1.0 + i for i in range(100)]  # the first hundred, in model order
    assert fig.axes[0].get_title().endswith("(the first 100 of 2000 layers)")
    assert fig.axes[0].get_yticklabels()[0].get_text() == "blocks.0.weight"


@pytest.mark.parametrize(
    "values",
    [[5e-324, 5e-324], [1.7e308, 1.7e308], [5e-324, 1.7e308]],
    ids=["tiny", "huge", "widest"],
)
def test_extreme_norms_still_draw(tmp_path, values):
    """Was: ``ValueError: Invalid vmin or vmax`` or an overflow in the colour bar's ticks: no layers plot."""
    from steadytrain.runs import layerplot
    from steadytrain.runs.record import load_run

    run = _write(fake_run(tmp_path / "run"), [_r(2, f"l{i}", grad=v, ratio=v) for i, v in enumerate(values)])
    path = layerplot.layers_plot(load_run(run), run / "layers.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_median_of_two_huge_ratios_is_not_infinite(tmp_path):
    """Was: ``statistics.median`` of two values above half the float maximum is their mean: inf, printed in the
    summary as a layer's update ratio, and a spike's median (its ratio 0: ranked last)."""
    big = 1.5e308
    lines = [_r(s, "a", grad=big, ratio=big) for s in (2, 4)]
    assert largest_update_ratios(lines) == [("a", big)]
    history = [_r(s, "a", grad=big) for s in (1, 2, 3, 4)]
    (found,) = spike_layers([*history, _r(5, "a", grad=big)], [5])
    assert found["layers"][0]["median"] == big and found["layers"][0]["ratio"] == 1.0
    run = _write(fake_run(tmp_path / "run"), lines)
    assert in_process("report", str(run)).returncode == 0
    assert "a 1.5e+308" in (run / "summary.md").read_text()


# --- a damaged file -------------------------------------------------------------------------------------------------


DISORDERED = {
    "a step again": ([_r(2, "a"), _r(4, "a"), _r(2, "a")], 3),
    "a step back": ([_r(4, "a"), _r(2, "a")], 2),
    "a step again after a rolled-back try": ([_r(2, "a"), _r(4, "a", ratio=None, rollback=1), _r(2, "a")], 3),
}


@pytest.mark.parametrize("case", DISORDERED)
def test_steps_that_do_not_go_up_are_one_line_naming_the_line(tmp_path, case):
    """Was: read as they came; ``layers --step 2`` showed layer ``a`` twice in one step's table (rows the run cannot
    have written: only a rolled-back try repeats a step, or comes before a lower one)."""
    lines, line = DISORDERED[case]
    run = _write(fake_run(tmp_path / "run"), lines)
    for args in (["layers", str(run)], ["layers", str(run), "--step", "2"]):
        assert_user_error(in_process(*args), f"layers.jsonl:{line}: step 2 comes after step")
    assert set(json.loads(in_process("layers", str(run), "--json").stdout)) == {"error"}


def test_a_rolled_back_try_may_repeat_and_precede_steps(tmp_path):
    """What the writer does write stays readable: checkpoint 2, spike at 4 rolled back, 3 and 4 trained again."""
    lines = [_r(2, "a"), _r(4, "a", ratio=None, rollback=1), _r(3, "a"), _r(4, "a"), _r(6, "a")]
    run = _write(fake_run(tmp_path / "run"), lines)
    got = json.loads(in_process("layers", str(run), "--step", "4", "--json").stdout)
    assert got["layers"] == [lines[1], lines[3]]


# --- a resume: another grouping, a file past the read limit -------------------------------------------------------


def test_a_resume_with_another_group_compares_a_spike_with_its_own_layers(tmp_path, tiny):
    """Was: a resume from ``auto`` to ``module`` mixed the groupings: a name in both (``blocks.0``: the whole block,
    then its own parameters only) was ranked against the other grouping's median, and the summary's medians mixed
    them. Now a spike is compared with the steps that have its layers, and the summary says where they changed."""
    run = copy_run(tiny, tmp_path / "run")
    proc = run_cli("train", "--resume", str(run), *sets("run.max_steps=6", "monitor.group=parameter"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = {s: [r["layer"] for r in _layers(run) if r["step"] == s] for s in range(1, 7)}
    assert groups[2] == ["tok", "pos", "blocks.0", "norm", "head"] and "head.weight" in groups[5]
    summary = (run / "summary.md").read_text()
    assert "from step 5 on, where the layers changed (monitor.group changed on a resume?)" in summary
    ratios: dict[str, list[float]] = {}
    for r in _layers(run):
        if r["step"] >= 5:  # the parameters' ratios only: no "blocks.0" (a whole block) among them
            ratios.setdefault(r["layer"], []).append(r["update_ratio"])
    medians = sorted(((statistics.median(v), layer) for layer, v in ratios.items()), reverse=True)[:3]
    listed = ", ".join(f"{md(layer)} {m:.3g}" for m, layer in medians)
    assert f"on a resume?)): {listed} (`layers.jsonl`" in summary

    whole = [_r(s, "blocks.0", grad=10.0) for s in (1, 2, 3)]  # auto: the block
    own = [_r(s, n, grad=g) for s in (4, 5, 6) for n, g in (("blocks.0", 0.1), ("blocks.0.w", 10.0))]
    spike = [_r(7, "blocks.0", grad=0.1), _r(7, "blocks.0.w", grad=10.0)]
    (found,) = spike_layers([*whole, *own, *spike], [7])
    assert {x["layer"]: x["ratio"] for x in found["layers"]} == {"blocks.0": 1.0, "blocks.0.w": 1.0}


def test_a_resume_cuts_a_layers_file_past_the_read_limit(tmp_path, tiny, monkeypatch):
    """Was: ``truncate_logs`` read ``layers.jsonl`` whole, under the limit of a log read whole (1 GiB): a long run's
    file (it grows with the layers times the monitored steps) made every resume refuse, the other logs already cut."""
    import steadytrain._io

    run = copy_run(tiny, tmp_path / "run")
    limit = max(p.stat().st_size for p in run.glob("*.jsonl") if p.name != "layers.jsonl") + 1
    assert (run / "layers.jsonl").stat().st_size > limit
    with (run / "layers.jsonl").open("ab") as f:
        f.write(b'{"step": 5, "lay')  # and a last line cut short by a kill
    monkeypatch.setattr(steadytrain._io, "MAX_LOG_BYTES", limit)
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # the resume starts at 2: steps 3 and 4 are cut, trained again
    proc = run_cli("train", "--resume", str(run), *sets("run.max_steps=4"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in _layers(run)] == [s for s in (1, 2, 3, 4) for _ in range(5)]
