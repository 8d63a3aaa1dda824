"""Issue 47's "Weak answers": commands that answered, but not what a user needed, and the hostile pass over them.

``triage`` of a step the run never reached, ``layers`` (and every other text table) under a 200 KB name, a user
model without ``tp_plan`` under ``tp > 1`` with ``--nproc``, ``repro``/``env diff``/``compare`` listing what decides
numerics first, the same ``sweep`` run again (finished: nothing trained; unfinished: resumed), and the hostile inputs
each of these meets. The oracles are the inputs each test writes: which step the run reached, how long a name is,
which fields changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from steadytrain._text import SHORT, md, short
from steadytrain.errors import UserError
from tests.cli_utils import assert_user_error, in_process
from tests.runs.test_hardening_runs import ENV, fake_run, jsonl
from tests.train_utils import sets

HUGE = "blocks.0." + "x" * 200_000 + ".attn.weight"
"""A 200 KB layer (or host, tensor, package) name."""
ESCAPED = "ok\x1b[2J\r\nFORGED LINE"
"""A name that would clear the terminal and forge a line of output."""


# --- 1. triage of a step the run never reached --------------------------------------------------------------------


@pytest.mark.parametrize("metrics", ["empty", "absent"])
def test_triage_of_a_step_a_run_without_rows_never_reached_is_one_line_not_verdict_none(tmp_path, metrics):
    # was: exit 0 and "none: step 500: step 500 was not refused" (no training row: no last step to compare with)
    run = fake_run(tmp_path / "run", metrics=[])
    if metrics == "absent":
        (run / "metrics.jsonl").unlink()
    assert_user_error(in_process("triage", str(run), "--step", "500"), "--step 500", "never reached step 500",
                      "recorded no optimizer step", "metrics.jsonl")  # fmt: skip
    got = in_process("triage", str(run), "--step", "500", "--json")
    assert_user_error(got, "never reached step 500")
    assert set(json.loads(got.stdout)) == {"error"}


def test_triage_past_the_last_row_says_the_run_never_reached_the_step(tmp_path):
    run = fake_run(tmp_path / "run")  # 6 steps
    assert_user_error(in_process("triage", str(run), "--step", "500"), "never reached step 500", "give 1 to 6")
    assert in_process("triage", str(run), "--step", "6").stdout.startswith("none: step 6: step 6 was not refused")


# --- 2. long names in text tables, shortened as the plots shorten them -------------------------------------------


def _layers_run(tmp_path: Path) -> Path:
    run = fake_run(tmp_path / "run")
    row = {"grad_norm": 1.0, "param_norm": 2.0, "update_norm": 0.1, "update_ratio": 0.05}
    names = [HUGE, ESCAPED, "head"]
    (run / "layers.jsonl").write_text(jsonl([{"step": 2, "layer": n, **row} for n in names]))
    return run


def test_a_200_kb_layer_name_does_not_pad_every_row_of_layers(tmp_path):
    # was: every row padded to the longest name (400 KB of output for one 200 KB name)
    run = _layers_run(tmp_path)
    proc = in_process("layers", str(run))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) < 2000
    lines = proc.stdout.splitlines()
    assert all(len(line) < SHORT + 80 for line in lines), max(map(len, lines))
    assert any(line.strip().startswith(short(HUGE)) for line in lines)
    assert short(HUGE).startswith("blocks.0.") and short(HUGE).endswith(".attn.weight")  # both ends kept
    assert not any(line.startswith("FORGED") for line in lines) and "\x1b" not in proc.stdout
    assert json.loads(in_process("layers", str(run), "--json").stdout)["layers"][0]["layer"] == HUGE


def test_the_layers_plot_shortens_a_name_with_the_tables_function(tmp_path, monkeypatch):
    from tests.runs.test_hostile_layers import _figure_of

    fig = _figure_of(_layers_run(tmp_path), monkeypatch)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0] == short(HUGE)  # one function for the table and the plot


def test_a_200_kb_host_and_tensor_name_stay_short_in_ranks(tmp_path):
    from tests.runs.test_hostile_ranks import _row, _run

    rows = [_row(4 * i, r, own_ms=50.0 if r == 1 else 10.0, host=HUGE if r == 1 else "h0")
            for i in range(1, 9) for r in (0, 1)]  # fmt: skip
    run = _run(tmp_path, rows, [{"step": 4, "rank": 1, "host": HUGE, "tensors": [HUGE, ESCAPED]}])
    proc = in_process("ranks", str(run))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) < 3000, len(proc.stdout)  # was: the host three times, the name once (800 KB)
    assert proc.stdout.startswith("straggler: rank 1 on " + short(HUGE))
    assert "\x1b" not in proc.stdout and not any(x.startswith("FORGED") for x in proc.stdout.splitlines())
    assert json.loads(in_process("ranks", str(run), "--json").stdout)["parity"][0]["host"] == HUGE


def test_a_200_kb_host_stays_short_in_the_nan_reports_verdict(tmp_path):
    from tests.runs.test_hostile_ranks import _ledger

    run = _ledger(tmp_path / "run", lambda s, r: HUGE if r == 1 else f"node{r}")
    proc = in_process("nan", "report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) < 3000, len(proc.stdout)
    assert f"rank(s) 1 on {short(HUGE)}, across" in proc.stdout.splitlines()[0]
    assert json.loads(in_process("nan", "report", str(run), "--json").stdout)["suspect_hosts"] == [HUGE]


def test_a_200_kb_source_name_stays_short_in_the_mixture_table(monkeypatch):
    from types import SimpleNamespace

    from steadytrain.runs import mixture

    row = SimpleNamespace(name=HUGE, weight=1.0, share=1.0, examples=3, epochs=0.5, final=None, best=None, best_of="")
    monkeypatch.setattr(mixture, "source_rows", lambda rec, src: [row])
    lines = mixture.summary_lines(SimpleNamespace(), SimpleNamespace(largest=HUGE, schedule=[]))
    assert sum(map(len, lines)) < 3000  # was: the name twice, 400 KB of summary.md
    assert any(line.startswith(f"| {md(short(HUGE))} |") for line in lines)


def test_short_is_one_line_bounded_and_keeps_short_names_whole():
    assert short("head.weight") == "head.weight"
    assert len(short(HUGE)) == SHORT and "\n" not in short(ESCAPED * 100) and "\x1b" not in short(ESCAPED)
    assert len(short(HUGE, 10)) == 10


# --- 3. a user model without tp_plan under tp > 1, said once before launch ----------------------------------------

_NO_PLAN = """
import torch


class Plain(torch.nn.Module):
    def __init__(self, dim=8, **kw):
        super().__init__()
        self.head = torch.nn.Linear(dim, 256)

    def forward(self, batch):
        return self.head(torch.zeros(batch["tokens"].shape[0], self.head.in_features)).mean(1)


def factory(**kw):
    return Plain(**kw)
"""


def test_a_user_model_without_tp_plan_under_tp_is_refused_once_before_launch(tmp_path, cli):
    # was: torchrun started 2 ranks and each said it between torchrun's failure lines
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "noplan_tp.py").write_text(_NO_PLAN)
    items = sets("model.name=noplan_tp:factory", "distributed.mesh=tp=2")
    proc = cli("train", "--nproc", "2", "--run-dir", str(tmp_path / "r"), *items, PYTHONPATH=str(tmp_path / "pkg"))
    assert_user_error(proc, "model Plain has no tensor-parallel plan", "tp_plan(mesh)", "distributed.mesh.tp=1")
    assert "torchrun" not in proc.stderr and not (tmp_path / "r").exists()


def test_check_plan_refuses_a_user_model_without_a_plan_and_leaves_one_with_a_plan_to_the_mesh():
    import torch

    from steadytrain.train.setup.tensor_parallel import check_plan

    class Plain(torch.nn.Module):
        pass

    class Planned(torch.nn.Module):
        def tp_plan(self, mesh):
            raise AssertionError("called before the mesh exists")

    class NotAMethod(torch.nn.Module):
        tp_plan = "colwise"

    with pytest.raises(UserError, match="model Plain has no tensor-parallel plan"):
        check_plan(Plain(), 2)
    with pytest.raises(UserError, match=r"NotAMethod\.tp_plan is a str, not a method"):
        check_plan(NotAMethod(), 2)
    check_plan(Planned(), 2)  # the user's own plan is called on the real mesh only
    check_plan(Plain(), 1)  # no tensor parallelism: nothing to refuse


# --- 4. what decides numerics first ---------------------------------------------------------------------------------


def test_env_diff_lists_torch_cuda_and_the_driver_before_thirty_packages(tmp_path):
    # was: "image differs: packages.aaa-0 ..., packages.aaa-1 ..., packages.aaa-10 ... (+31 more)"
    a = json.loads(json.dumps(ENV))
    a["image"].update(cuda="12.1", packages={f"aaa-{i}": "1.0" for i in range(31)})
    b = json.loads(json.dumps(a))
    b["image"].update(torch="2.4.0", cuda="12.4", packages={f"aaa-{i}": "2.0" for i in range(31)})
    b["host"]["nvidia_driver"] = "550.90.07"
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    proc = in_process("env", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 1, proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("image differs: torch 2.3.0 \u2192 2.4.0, cuda 12.1 \u2192 12.4, packages.aaa-0"), summary
    assert "(+30 more)" in summary and "host differs: nvidia_driver None \u2192 550.90.07" in summary


def test_numerics_first_puts_the_named_fields_first_across_scopes():
    from steadytrain.env.compare import NUMERICS, numerics_first

    paths = ["settings.env.X", "image.packages.aaa", "image.packages.nvidia-cudnn-cu12", "code.git_commit",
             *reversed(NUMERICS)]  # fmt: skip
    assert numerics_first(paths, str) == [*NUMERICS, "image.packages.nvidia-cudnn-cu12", "image.packages.aaa",
                                          "code.git_commit", "settings.env.X"]  # fmt: skip


def test_repro_names_a_changed_torch_and_driver_before_the_packages(tiny_run, tmp_path):
    # was: image.packages.* first (alphabetical, image scope first), torch and the driver in "(+31 more)"
    run = Path(shutil.copytree(tiny_run("run.max_steps=3"), tmp_path / "run"))
    env = json.loads((run / "env.json").read_text())
    env["image"]["packages"] = {f"aaa-{i}": "0.0.1" for i in range(31)}  # every package differs
    env["image"]["torch"], env["host"]["nvidia_driver"] = "1.0.0", "1.0"
    (run / "env.json").write_text(json.dumps(env))
    proc = in_process("repro", str(run), "--steps", "1")
    sentence = proc.stdout.strip()
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = sentence.split("environment differences: ", 1)[1]
    assert listed.startswith("image.torch 1.0.0 recorded"), listed[:300]
    fields = [item.split(" ")[0] for item in listed.split(" (+")[0].split("; ")]
    assert fields[:3] == ["image.torch", "image.packages.torch", "host.nvidia_driver"], listed[:300]


# --- 5. the same sweep again: finished trains nothing, unfinished resumes --------------------------------------------


def _sweep(real: Path, where: Path, *extra: str, factors: str = "0.5,1", steps: str = "2"):
    args = [str(real / "config.yaml"), "--factors", factors, "--steps", steps, "--sweep-dir", str(where), *extra]
    return in_process("sweep", *args)


def _mtimes(where: Path) -> dict[str, int]:
    return {str(p.relative_to(where)): p.stat().st_mtime_ns for p in where.rglob("*")}


@pytest.fixture
def swept(tiny_run, tmp_path) -> tuple[Path, Path]:
    real = tiny_run("run.max_steps=3")
    first = _sweep(real, tmp_path / "s")
    assert first.returncode == 0, first.stderr[-3000:]
    return real, tmp_path / "s"


def test_the_same_sweep_into_a_finished_sweep_dir_trains_nothing_and_shows_the_table(swept):
    real, where = swept
    before = _mtimes(where)
    again = _sweep(real, where)
    assert again.returncode == 0, again.stderr[-3000:]  # was: exit 2, "loss_vs_lr.png ... exist (an earlier sweep)"
    assert "this sweep is finished (2 of 2 trials done): nothing to train" in again.stderr
    assert "trial " not in again.stderr
    assert again.stdout == (where / "sweep.md").read_text()
    assert _mtimes(where) == before  # nothing trained, nothing rewritten


def test_the_same_sweep_into_an_unfinished_sweep_dir_resumes_it(swept):
    real, where = swept
    state = json.loads((where / "sweep-state.json").read_text())
    state["trials"] = state["trials"][:1]  # as if stopped before the second trial started
    (where / "sweep-state.json").write_text(json.dumps(state))
    for name in ("sweep.json", "sweep.md", "loss_vs_lr.png"):
        (where / name).unlink()
    shutil.rmtree(where / "lr-x1")
    kept = _mtimes(where / "lr-x0.5")
    again = _sweep(real, where)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming: 1 of 2 trials done" in again.stderr and "trial 2/2: factor 1" in again.stderr
    assert "trial 1/2" not in again.stderr
    assert _mtimes(where / "lr-x0.5") == kept  # the done trial is not trained again
    result = json.loads((where / "sweep.json").read_text())
    assert [t["factor"] for t in result["trials"]] == [0.5, 1.0]
    assert "| 0.5 |" in again.stdout and "| 1 |" in again.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"steps": "3"}, ["other factors, steps, ranks or config", "give another --sweep-dir"]),
        ({"factors": "0.5,1,2"}, ["other factors, steps, ranks or config"]),
        ({"extra": sets("batch.base_lr=0.02")}, ["other factors, steps, ranks or config"]),
    ],
)
def test_another_sweep_into_a_sweep_dir_is_refused_before_training(swept, args, words):
    real, where = swept
    before = _mtimes(where)
    proc = _sweep(real, where, *args.get("extra", ()), **{k: v for k, v in args.items() if k != "extra"})
    assert_user_error(proc, "--sweep-dir", *words)
    assert _mtimes(where) == before


@pytest.mark.parametrize(
    ("state", "words"),
    [
        ("{not json", ["sweep-state.json", "not valid JSON"]),
        ("TRIALS", ["sweep-state.json: trials must be a list", "changed by hand"]),
    ],
)
def test_a_hostile_sweep_state_is_one_line(swept, state, words):
    real, where = swept
    if state == "TRIALS":
        good = json.loads((where / "sweep-state.json").read_text())
        state = json.dumps({**good, "trials": [{"factor": "0.5\x1b[2J"}]})
    (where / "sweep-state.json").write_text(state)
    proc = _sweep(real, where)
    assert_user_error(proc, *words)
    assert "\x1b" not in proc.stderr


def test_a_sweep_state_that_is_a_directory_is_one_line(swept):
    real, where = swept
    (where / "sweep-state.json").unlink()
    (where / "sweep-state.json").mkdir()
    assert_user_error(_sweep(real, where), "sweep-state.json")
