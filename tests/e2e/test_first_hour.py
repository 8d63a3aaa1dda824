"""A newcomer's first hour: the command is found, ``--json`` answers in JSON on an error too, the quickstart's
files are not offered to git, and the loss plot marks resumes and rollbacks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import click
import pytest

from steadytrain.cli import cli
from tests.cli_utils import assert_user_error

ROOT = Path(__file__).resolve().parents[2]


def test_readme_quickstart_says_how_to_reach_the_command():
    quickstart = (ROOT / "README.md").read_text(encoding="utf-8").split("## Quickstart", 1)[1]
    first_command = quickstart.index("steadytrain data ingest")
    assert ". .venv/bin/activate" in quickstart[:first_command]  # said before the first `steadytrain ...`
    assert ".venv/bin/steadytrain" in quickstart[:first_command]


def test_the_quickstarts_ingest_runs_as_written_on_a_fresh_clone(tmp_path, cli):
    """The folder the quickstart ingests is one every clone has (tracked by git), and it ingests into enough
    windows for the quickstart's training run (one global batch of the defaults, with 5% held out)."""
    quickstart = (ROOT / "README.md").read_text(encoding="utf-8").split("## Quickstart", 1)[1]
    line = next(x for x in quickstart.splitlines() if x.startswith("steadytrain data ingest "))
    args = line.split("#", 1)[0].split()[3:]
    folder = args[0]
    tracked = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout.strip(), f"the quickstart ingests {folder}, which a fresh clone does not have"
    out = tmp_path / "notes"
    r = cli("data", "ingest", ROOT / folder, *[str(out) if a == "data/notes" else a for a in args[1:]])
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "index.json").read_text())
    from steadytrain.train.setup.config import TrainConfig

    assert sum(s["records"] for s in index["shards"]) * 0.95 >= TrainConfig().batch.global_batch_size


def test_make_run_says_where_the_command_is():
    out = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    train, said = out.index("steadytrain train"), out.rindex(". .venv/bin/activate")
    assert train < said and ".venv/bin/steadytrain" in out[said:]  # printed after the run


@pytest.mark.parametrize("path", ["data/notes/index.json", "exported/gpt2-tiny/model.safetensors"])
def test_quickstart_outputs_are_ignored_by_git(path):
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
    assert ignored.returncode == 0, f"{path} is not ignored by .gitignore"


def test_package_data_directory_is_not_ignored():
    # /data/ is anchored: the library's own src/steadytrain/data/ stays tracked.
    kept = subprocess.run(["git", "check-ignore", "--no-index", "-q", "src/steadytrain/data/__init__.py"], cwd=ROOT)
    assert kept.returncode == 1


def _json_commands() -> set[str]:
    """Every command with a ``--json`` flag, by a walk of the command tree."""
    found = set()

    def walk(group: click.Group, path: tuple[str, ...]) -> None:
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                walk(cmd, (*path, name))
            elif any("--json" in getattr(p, "opts", ()) for p in cmd.params):
                found.add(" ".join((*path, name)))

    walk(cli, ())
    return found


BAD = {
    "eval": ["eval", "{missing}", "--json"],
    "nan report": ["nan", "report", "{missing}", "--json"],
    "nan hunt": ["nan", "hunt", "{missing}", "--json"],
    "spikes report": ["spikes", "report", "{missing}", "--json"],
    "spikes hunt": ["spikes", "hunt", "{missing}", "--json"],
    "compare": ["compare", "{missing}", "{missing}", "--json"],
    "repro": ["repro", "{missing}", "--json"],
    "plan": ["plan", "--micro-batch-size", "0", "--json"],
    "hangs": ["hangs", "{missing}", "--json"],
    "ranks": ["ranks", "{missing}", "--json"],
    "goodput": ["goodput", "{missing}", "--json"],
    "triage": ["triage", "{missing}", "--step", "1", "--json"],
    "layers": ["layers", "{missing}", "--json"],
    "check-parallel": ["check-parallel", "{missing}", "--mesh", "tp=2", "--json"],
}
"""A bad input to each ``--json`` command: a run directory that does not exist (plan: a zero batch; check-parallel: a
config file)."""


def test_every_json_command_is_covered():
    assert _json_commands() == set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_json_error_is_a_json_object_on_stdout(cli, tmp_path, name):
    argv = [a.replace("{missing}", str(tmp_path / "no-such-run")) for a in BAD[name]]
    r = cli(*argv)
    assert_user_error(r)  # the one line on stderr and exit 2, as without --json
    answer = json.loads(r.stdout)
    assert set(answer) == {"error"} and "\n" not in answer["error"]
    assert r.stderr.strip() == f"error: {answer['error']}"


def test_json_usage_error_is_json_too(cli):
    r = cli("eval", "--json")  # RUN missing: click's usage error
    assert r.returncode == 2
    assert "RUN" in json.loads(r.stdout)["error"]


def test_without_json_stdout_stays_empty(cli, tmp_path):
    r = cli("eval", str(tmp_path / "no-such-run"))
    assert_user_error(r)
    assert r.stdout == ""


def test_json_flag_is_the_commands_own():
    from steadytrain.cli import wants_json

    assert wants_json(["nan", "report", "x", "--json"])
    assert not wants_json(["nan", "report", "--", "--json"])
    assert not wants_json(["train", "--json"])  # train has no --json: click's own error, in text
    assert not wants_json(["nan", "--json", "report"])  # not the command's flag


def _record(tmp_path, *, resumes, rollbacks):
    from steadytrain.rundir.layout import RunDir
    from steadytrain.runs.record import RunRecord

    metrics = [
        {"step": s, "loss": 3.0 - 0.01 * s, "lr": 0.01, "grad_norm": 1.0, "skipped": False} for s in range(1, 31)
    ]
    return RunRecord(RunDir(tmp_path), config={}, plan={}, env=None, data=None, metrics=metrics,
                     rollbacks=rollbacks, resumes=resumes)  # fmt: skip


def _vline_steps(fig, gid):
    """The x of each vertical line the figure draws under ``gid`` (none: [])."""
    found = [c for ax in fig.axes for c in ax.collections if c.get_gid() == gid]
    return sorted(int(seg[0][0]) for c in found for seg in c.get_segments())


def test_loss_plot_marks_resumes_and_rollbacks(tmp_path):
    from steadytrain.runs.plots import loss_figure, loss_plot

    resumes = [{"step": 10, "world_size": 1, "changes": {}}, {"step": 20, "world_size": 2, "changes": {}}]
    rollbacks = [{"step": 17, "rollback_to": 12, "skipped_batches": [16]}]
    fig = loss_figure(_record(tmp_path, resumes=resumes, rollbacks=rollbacks))
    assert _vline_steps(fig, "resumes") == [10, 20]
    assert _vline_steps(fig, "rollbacks") == [17]
    (ax,) = fig.axes
    assert "17→12" in [t.get_text() for t in ax.texts]  # where it went back from and to
    assert "resumed (2)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert loss_plot(_record(tmp_path, resumes=resumes, rollbacks=rollbacks), tmp_path / "loss.png").stat().st_size


def test_loss_plot_without_resumes_marks_none(tmp_path):
    from steadytrain.runs.plots import loss_figure

    fig = loss_figure(_record(tmp_path, resumes=[], rollbacks=[]))
    assert _vline_steps(fig, "resumes") == [] and _vline_steps(fig, "rollbacks") == []


def test_held_out_records_and_training_records_split_the_dataset(tmp_path):
    import pyarrow.parquet as pq

    from steadytrain.data import BatchedDataset, EvalSet, holdout_records
    from tests.train_utils import write_text_dataset

    sizes = {0: 10, 1: 7, 2: 13}
    data = write_text_dataset(tmp_path / "d", list(sizes.values()))
    held = holdout_records(sizes, 6, seed=3)
    assert held.digest() == holdout_records(sizes, 6, seed=3).digest() != holdout_records(sizes, 6, seed=4).digest()
    train = BatchedDataset(data, batch_size=1, shuffle=False, rows=held.inverse())
    evalset = EvalSet(data, batch_size=4, rows=held)

    def examples(batches):
        return [(s, i, tuple(t)) for mb in batches for s, i, t in zip(mb["shard"].tolist(), mb["index"].tolist(),
                                                                       mb["tokens"].tolist(), strict=True)]  # fmt: skip

    trained, evaluated = examples(train), examples(evalset)
    assert len(evaluated) == 6 and len(trained) == 24 and evalset.num_examples == 6
    assert not {e[:2] for e in trained} & {e[:2] for e in evaluated}
    index = json.loads((data / "index.json").read_text())["shards"]
    files = {s["id"]: pq.read_table(data / s["file"])["tokens"].to_pylist() for s in index}
    everything = {(s, i, tuple(row)) for s, rows in files.items() for i, row in enumerate(rows)}
    assert set(trained) | set(evaluated) == everything  # each row read as the file holds it, on one side only
    assert train.fingerprint != BatchedDataset(data, batch_size=1).fingerprint  # a resume cannot mix them up
