"""The installed ``steadytrain`` command, run as a user would run it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXE = shutil.which("steadytrain", path=str(Path(sys.executable).parent)) or "steadytrain"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


SEED = ["--micro-batch-size", "256", "--accumulation-steps", "8", "--base-lr", "1e-3", "--base-batch-size", "256"]


def test_plan_json_is_the_seed_example():
    result = run("plan", *SEED, "--dataset-size", "20480", "--epochs", "2", "--warmup-ratio", "0.1", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["global_batch_size"] == 2048
    assert math.isclose(plan["lr"], 8e-3)
    assert plan["steps_per_epoch"] == 10 and plan["total_steps"] == 20 and plan["warmup_steps"] == 2
    assert math.isclose(plan["lr_sweep"][2], 8e-3)


def test_plan_table():
    result = run("plan", *SEED)
    assert result.returncode == 0, result.stderr
    assert "2048" in result.stdout and "0.008" in result.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            [
                "--micro-batch-size",
                "32",
                "--accumulation-steps",
                "4",
                "--world-size",
                "8",
                "--global-batch-size",
                "1000",
            ],
            ["1000", "1024", "micro 32"],
        ),
        (["--micro-batch-size", "abc"], ["micro-batch-size"]),
        (["--micro-batch-size", "0"], ["micro_batch_size"]),
        ([], ["micro-batch-size"]),
    ],
)
def test_bad_values_one_line_exit_2(args, words):
    result = run("plan", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:")
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in result.stderr


def test_help_and_version():
    assert run("--help").returncode == 0
    assert "steadytrain" in run("--version").stdout


RUN_COMMANDS = [
    ["report"], ["compare", "{missing}"], ["repro"], ["nan", "report"], ["nan", "hunt", "--shard", "0"],
    ["spikes", "report"], ["spikes", "hunt", "--shard", "0"], ["eval"], ["export", "--out", "{out}"], ["hangs"],
    ["ranks"], ["triage", "--step", "1"], ["layers"],
]  # fmt: skip
"""The commands that read a run directory: most tests run them in-process; here each is launched once."""


def test_every_run_command_launched_on_a_missing_run_is_one_line_and_exit_2(tmp_path):
    """The installed command's own exit code and stderr for each command that reads a run (one process each: a
    user error says one line, no traceback)."""
    missing = str(tmp_path / "no-such-run")
    fill = {"{missing}": missing, "{out}": str(tmp_path / "model.safetensors")}
    for command in RUN_COMMANDS:
        argv = [fill.get(a, a) for a in command] + [missing]
        result = run(*argv)
        assert result.returncode == 2, (command, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "no-such-run" in result.stderr, (command, result.stderr)


def test_a_missing_run_is_refused_before_torch_is_imported(tmp_path):
    """A mistyped RUN answers at once: no command that reads a run imports torch (seconds) to say it is missing."""
    missing = str(tmp_path / "no-such-run")
    fill = {"{missing}": missing, "{out}": str(tmp_path / "model.safetensors")}
    argvs = [[fill.get(a, a) for a in command] + [missing] for command in RUN_COMMANDS]
    code = (
        "import json, sys\nfrom steadytrain.cli import main\nout = []\n"
        f"for argv in {argvs!r}:\n    out.append([main(argv), 'torch' in sys.modules])\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [[2, False]] * len(RUN_COMMANDS), list(zip(RUN_COMMANDS, got, strict=True))
