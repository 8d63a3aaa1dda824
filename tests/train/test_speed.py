"""``model.activation_checkpointing`` and ``model.compile``: the same numbers, less memory, clean failures.

Oracles: the same model without checkpointing (gradients, to 1e-6), the bytes autograd saves for the
backward (``saved_tensors_hooks``) against the model without blocks (what no block saves), the eager
run's per-step losses (compiled, on 1 and 2 ranks), and a real compile failure: a C++ compiler that does
not exist (``CXX``), in a fresh inductor cache.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from steadytrain.errors import UserError
from steadytrain.train.setup.models import TinyLM
from steadytrain.train.setup.speed import apply_activation_checkpointing, compile_model, find_blocks
from tests.cli_utils import ROOT
from tests.dist_utils import cli_on_ranks
from tests.train_utils import TINY, metrics, run_cli, sets, write_text_dataset

DIMS = {"dim": 32, "layers": 3, "heads": 2, "seq_len": 16}
SMALL = [*TINY, "model.layers=2", "run.log_every=1", "run.max_steps=3"]
"""Two blocks; 3 optimizer steps of 4 micro-batches."""


def tiny_lm(layers: int = 3) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**{**DIMS, "layers": layers})


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"tokens": torch.randint(0, 256, (4, DIMS["seq_len"] + 1), generator=g)}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    model(batch()).mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


# --- activation checkpointing ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_gives_the_gradients_of_the_plain_model(mode):
    plain = tiny_lm()
    ac = copy.deepcopy(plain)
    n = apply_activation_checkpointing(ac, mode, every=2)
    assert n == (3 if mode == "full" else 2)  # selective: blocks 0 and 2
    assert [name for name, _ in ac.named_parameters()] == [name for name, _ in plain.named_parameters()]
    reference, checkpointed = grads(plain), grads(ac)
    for name, g in reference.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=0, atol=1e-6, msg=name)


def saved_bytes(model: nn.Module) -> int:
    """Bytes of the activations autograd keeps for the backward (each storage once; parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch()).mean()
    loss.backward()
    return sum(seen.values())


def test_checkpointing_saves_fewer_bytes_for_the_backward():
    L = DIMS["layers"]
    none = saved_bytes(tiny_lm())
    outside = saved_bytes(tiny_lm(layers=0))  # embeddings, final norm, head, loss: what no block saves
    sizes = {}
    for mode in ("full", "selective"):
        model = tiny_lm()
        apply_activation_checkpointing(model, mode, every=2)
        sizes[mode] = saved_bytes(model)
    # A checkpointed block keeps only its inputs: x [B, T, dim] in fp32 for each block, and the shared causal
    # mask [T, T]; everything else it saves is recomputed in the backward.
    b, t, d = 4, DIMS["seq_len"], DIMS["dim"]
    inputs = L * b * t * d * 4 + t * t * 4
    assert sizes["full"] <= outside + inputs  # nothing inside the blocks is kept
    assert sizes["full"] <= none / L + inputs + outside  # the bound: one block's share + the inputs + the rest
    assert sizes["full"] < none / 2  # measured here: about 0.3 of none
    assert sizes["full"] < sizes["selective"] < none  # selective (blocks 0 and 2 of 3) lies between


# --- finding the blocks ----------------------------------------------------------------------


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


class HFStyle(nn.Module):
    """Blocks nested as ``transformer.h`` next to a smaller list (``heads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(8, 2)])


def test_blocks_are_found_by_size_or_by_name():
    assert find_blocks(tiny_lm())[0] == "blocks"
    name, blocks = find_blocks(HFStyle())
    assert name == "transformer.h" and len(blocks) == 3
    assert find_blocks(HFStyle(), "heads")[0] == "heads"
    assert find_blocks(NoBlocks()) is None


@pytest.mark.parametrize(
    ("model", "attr", "words"),
    [
        (NoBlocks(), None, ["model.activation_checkpointing=full", "no nn.ModuleList", "NoBlocks", "model.ac_blocks"]),
        (NoBlocks(), "mlp", ["model.ac_blocks='mlp'", "NoBlocks.mlp is a Sequential", "not an nn.ModuleList"]),
        (tiny_lm(), "block", ["model.ac_blocks='block'", "TinyLM.block is absent"]),
    ],
)
def test_checkpointing_without_blocks_is_one_line_naming_the_key(model, attr, words):
    with pytest.raises(UserError) as err:
        apply_activation_checkpointing(model, "full", attr=attr)
    assert "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_two_lists_of_equal_size_are_ambiguous():
    model = nn.Module()
    model.a, model.b = (nn.ModuleList([nn.Linear(2, 2)]) for _ in range(2))
    with pytest.raises(UserError, match=r"name the blocks with model\.ac_blocks"):
        find_blocks(model)


def test_config_show_refuses_a_bad_ac_blocks_before_any_run(tmp_path):
    proc = run_cli("config", "show", *sets("model.ac_blocks=norm", "model.activation_checkpointing=full"))
    assert proc.returncode == 2, proc.stderr
    assert "model.ac_blocks='norm'" in proc.stderr and "LayerNorm" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# --- compile ---------------------------------------------------------------------------------


def test_a_compile_refused_at_once_falls_back_or_is_one_line(monkeypatch):
    """``torch.compile`` refusing the module outright (as on a platform Dynamo does not support)."""

    def refuse(*args, **kwargs):
        raise RuntimeError("Dynamo is not supported on this platform\nmore detail")

    monkeypatch.setattr(torch, "compile", refuse)
    model = tiny_lm()
    with pytest.raises(UserError) as err:
        compile_model(model, model.blocks, name="tiny-lm")
    assert str(err.value) == (
        "model.compile: tiny-lm could not be compiled (Dynamo is not supported on this platform): "
        "set model.compile_fallback=true to train eagerly, or model.compile=false"
    )
    model = tiny_lm()
    handle = compile_model(model, model.blocks, name="tiny-lm", fallback=True)
    assert handle.eager
    torch.testing.assert_close(grads(model), grads(tiny_lm()), rtol=0, atol=0)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("text"), [90, 130, 70, 110])


def train(run_dir: Path, data: Path, *items: str, **env: str) -> subprocess.CompletedProcess:
    return run_cli("train", "--run-dir", str(run_dir), *sets(*SMALL, f"data.path={data}", *items), **env)


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in metrics(run_dir)]


@pytest.fixture(scope="module")
def eager(tmp_path_factory, text_data) -> Path:
    run_dir = tmp_path_factory.mktemp("eager") / "run"
    proc = train(run_dir, text_data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_full_checkpointing_trains_to_the_same_losses(tmp_path, text_data, eager):
    proc = train(tmp_path / "ac", text_data, "model.activation_checkpointing=full")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "activation checkpointing (full): 2 of 2 block(s)" in proc.stderr
    np.testing.assert_allclose(losses(tmp_path / "ac"), losses(eager), rtol=1e-6)


def test_compiled_training_gives_the_eager_losses_and_reports_the_compile_time(tmp_path, text_data, eager):
    proc = train(tmp_path / "compiled", text_data, "model.compile=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds = re.search(r"compiled 2 block\(s\) in ([0-9.]+) s", proc.stderr)
    assert seconds is not None and float(seconds.group(1)) > 0, proc.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "compiled"), losses(eager), rtol=1e-5)
    assert len(losses(eager)) == 3


NO_COMPILER = """\
import json, sys
import torch._dynamo
from tests.cli_utils import in_process
commands, out = json.loads(sys.argv[1]), sys.argv[2]
results = []
for argv, env in commands:
    torch._dynamo.reset()  # each command compiles anew, as in a process of its own
    done = in_process(*argv, **env)
    results.append([done.returncode, done.stdout, done.stderr])
with open(out, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def no_compiler(tmp_path_factory, text_data) -> dict[bool, tuple[Path, subprocess.CompletedProcess]]:
    """Per ``model.compile_fallback``: the run directory and the exit of a compiled run whose first compiled call
    fails for real: inductor finds no C++ compiler (``CXX``), in a fresh cache (nothing reused).

    Launched: inductor reads ``CXX`` when it is first imported, which a test process has long done. Both commands
    run in that one launched Python (``main(argv)`` each, as :func:`~tests.cli_utils.in_process` runs it), with
    Dynamo reset and a fresh inductor cache before each: one start-up for the two."""
    root = tmp_path_factory.mktemp("no-compiler")
    runs, commands = {}, []
    for fallback in (True, False):
        runs[fallback] = root / f"fallback-{fallback}" / "run"
        items = [*SMALL, f"data.path={text_data}", "model.compile=true", f"model.compile_fallback={fallback}".lower()]
        env = {"TORCHINDUCTOR_CACHE_DIR": str(root / f"fallback-{fallback}" / "inductor")}
        commands.append([["train", "--run-dir", str(runs[fallback]), *sets(*items)], env])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CXX": str(root / "no-such-g++")}
    argv = [sys.executable, "-c", NO_COMPILER, json.dumps(commands), str(root / "results.json")]
    child = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    return {
        fallback: (runs[fallback], subprocess.CompletedProcess(command[0], *result))
        for fallback, command, result in zip(runs, commands, results, strict=True)
    }


@pytest.mark.parametrize("fallback", [True, False])
def test_a_compiler_that_fails_falls_back_or_stops_in_one_line(no_compiler, eager, fallback):
    run_dir, proc = no_compiler[fallback]
    if fallback:
        assert proc.returncode == 0, proc.stderr[-3000:]
        warnings = [line for line in proc.stderr.splitlines() if "could not be compiled" in line]
        assert len(warnings) == 1 and "No working C++ compiler" in warnings[0], proc.stderr[-3000:]
        assert "training eagerly" in warnings[0]
        np.testing.assert_allclose(losses(run_dir), losses(eager), rtol=1e-7)
    else:
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: model.compile: tiny-lm could not be compiled (")
        assert "No working C++ compiler" in last and "model.compile_fallback=true" in last
        assert "Traceback" not in proc.stderr


STRATEGIES = ("ddp", "fsdp")
COMPILED = ("model.compile=true", "model.activation_checkpointing=full")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, text_data) -> dict[tuple[str, str], tuple[Path, list[subprocess.CompletedProcess]]]:
    """Per (strategy, eager|compiled): the 2-rank run directory and each rank's exit, trained on one spawn of ranks
    (each rank runs ``main(argv)`` as under torchrun)."""
    root = tmp_path_factory.mktemp("two-ranks")
    runs = {(s, kind): root / s / kind for s in STRATEGIES for kind in ("eager", "compiled")}
    commands = []
    for (strategy, kind), run_dir in runs.items():
        items = [*SMALL, f"data.path={text_data}", f"distributed.strategy={strategy}"]
        items += COMPILED if kind == "compiled" else ()
        commands.append(["train", "--run-dir", run_dir, *sets(*items)])
    results = cli_on_ranks(root, commands)
    return {key: (run_dir, procs) for (key, run_dir), procs in zip(runs.items(), results, strict=True)}


def two_rank_losses(run: tuple[Path, list[subprocess.CompletedProcess]]) -> list[float]:
    run_dir, procs = run
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return losses(run_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_and_checkpointed_two_ranks_give_the_eager_losses(two_ranks, strategy):
    eager = two_rank_losses(two_ranks[strategy, "eager"])
    compiled = two_rank_losses(two_ranks[strategy, "compiled"])
    assert len(eager) == 3
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
