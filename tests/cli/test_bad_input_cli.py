"""Bad input to the shared machinery: file readers, YAML/JSON loading, atomic writes, the CLI's error
path, and `steadytrain plan` at the edges of the float range. One line on stderr, exit 2, nothing written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from steadytrain import _io, _yamlio
from steadytrain._check import check_finite, check_int
from steadytrain._io import one_line
from steadytrain.errors import UserError
from steadytrain.schedule import BatchPlan, scale_lr
from tests.cli_utils import EXE, assert_user_error

PLAN = ["plan", "--micro-batch-size", "32", "--base-lr", "1e-3", "--base-batch-size", "256"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


# --- file readers -----------------------------------------------------------------------------


def test_read_text_names_each_problem(tmp_path):
    with pytest.raises(UserError, match="no such config"):
        _io.read_text(tmp_path / "missing.yaml", what="config")
    with pytest.raises(UserError, match="is a directory"):
        _io.read_text(tmp_path, what="config")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        _io.read_text(bad, what="config")
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 101)
    with pytest.raises(UserError, match="too large"):
        _io.read_text(big, max_bytes=100)


def test_load_json_refuses_nan_and_infinity_and_names_the_line(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"a": NaN}')
    with pytest.raises(UserError, match="not valid JSON"):
        _io.load_json(p)
    p.write_text('{"a": 1,\n "b": }')
    with pytest.raises(UserError, match="line 2"):
        _io.load_json(p)
    p.write_text('{"a": [1, 2.5, "x"]}')
    assert _io.load_json(p) == {"a": [1, 2.5, "x"]}


def test_yaml_alias_bomb_is_an_error_not_a_hang(tmp_path):
    # Nine levels of nine aliases: 9**9 (387 million) values once expanded, a few hundred bytes on disk.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines) + "\n")
    assert p.stat().st_size < 1000
    with pytest.raises(UserError, match="expands to more than"):
        _yamlio.load_yaml(p)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(UserError, match=r"c\.yaml.*not valid YAML \(line \d+\)"):
        _yamlio.load_yaml(p)
    # Aliases within the bound still work: they are valid YAML.
    p.write_text("base: &b {lr: 0.1}\nrun: *b\n")
    assert _yamlio.load_yaml(p) == {"base": {"lr": 0.1}, "run": {"lr": 0.1}}


def test_brief_bounds_huge_and_self_nested_values():
    nested: list = []
    nested.append(nested)
    assert len(_io.brief(nested)) < 100
    assert len(_io.brief({"k": "v" * 10**6})) < 200
    assert len(_io.brief(list(range(10**6)))) < 100


# --- atomic writes ---------------------------------------------------------------------------


def test_write_into_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        _io.write_text_atomic(tmp_path / "nope" / "out.txt", "x")
    assert not (tmp_path / "nope").exists()


def test_write_atomic_without_replace_never_overwrites(tmp_path):
    p = tmp_path / "shard.bin"
    _io.write_atomic(p, lambda f: f.write(b"first"), replace=False)
    with pytest.raises(FileExistsError):
        _io.write_atomic(p, lambda f: f.write(b"second"), replace=False)
    assert p.read_bytes() == b"first"
    assert [x.name for x in tmp_path.iterdir()] == ["shard.bin"]  # no temporary file left


def test_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    p = tmp_path / "index.json"
    _io.write_text_atomic(p, "old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        _io.write_atomic(p, boom)
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["index.json"]


def test_append_jsonl_refuses_nan_so_every_line_stays_json(tmp_path):
    p = tmp_path / "events.jsonl"
    _io.append_jsonl(p, {"step": 1, "note": 'quote " and\nnewline'})
    with pytest.raises(ValueError):
        _io.append_jsonl(p, {"step": 2, "norm": math.nan})
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    assert rows == [{"step": 1, "note": 'quote " and\nnewline'}]


# --- argument checks ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1e-3", None, True, 10**400])
def test_check_finite_refuses_non_numbers(value):
    with pytest.raises(UserError, match="lr="):
        check_finite("lr", value)


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "4", None, 2**60])
def test_check_int_refuses_non_counts(value):
    with pytest.raises(UserError, match="n="):
        check_int("n", value, maximum=2**53)


def test_one_line_escapes_control_characters():
    assert one_line("a\nb\rc\x1b[31md\u2028e") == "a\\nb\\rc\\x1b[31md\\u2028e"


# --- schedule at the edges of the float range -------------------------------------------------


def test_scaled_lr_that_overflows_is_refused():
    with pytest.raises(UserError, match="not a usable learning rate"):
        scale_lr(1e300, 1, 2**40)
    with pytest.raises(UserError, match="base_lr"):
        scale_lr(math.nan, 256, 512)


def test_lr_sweep_that_leaves_the_float_range_is_refused():
    plan = BatchPlan(micro_batch_size=32, base_lr=1e-3, base_batch_size=32)
    with pytest.raises(UserError, match="float range"):
        plan.lr_sweep(1000, factor=10.0)
    assert plan.lr_sweep(3) == pytest.approx([5e-4, 1e-3, 2e-3])  # lr * 2**(i - 1)


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--sweep", "3000"], ["--sweep", "3000"]),
        (["--base-lr", "1e400"], ["'--base-lr'", "too large a number"]),  # refused by the flag's type, as every
        (["--base-lr", "nan"], ["'--base-lr'", "'nan' is not a number"]),  # number flag's (they reached plan)
        (["--accumulation-steps", str(10**400)], ["'--accumulation-steps'", "too large: 401 digits"]),
        (["--base-lr", "1e300", "--base-batch-size", "1", "--accumulation-steps", "100000000"], ["lr=inf"]),
        (["--world-size", "0"], ["world_size=0"]),
        (["--warmup-ratio", "nan", "--dataset-size", "1000"], ["'--warmup-ratio'", "'nan' is not a number"]),
    ],
)
def test_plan_bad_values_one_line_exit_2(extra, words):
    assert_user_error(run(*PLAN, *extra, "--json"), *words)


def test_plan_json_is_strict_json_at_large_scale():
    proc = run(*PLAN, "--accumulation-steps", "100000", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    assert all(math.isfinite(x) for x in data["lr_sweep"])


def test_python_dash_m_runs_the_same_command():
    proc = subprocess.run(
        [sys.executable, "-m", "steadytrain", *PLAN, "--accumulation-steps", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["global_batch_size"] == 256


def test_unknown_command_and_option_are_one_line():
    assert_user_error(run("nonsense"), "nonsense")
    assert_user_error(run("plan", "--micro-batch-size", "x"), "--micro-batch-size")
