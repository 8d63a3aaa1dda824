"""Runs on 4 gloo ranks laid out on a ``DeviceMesh`` that :mod:`tests.train.test_mesh` checks against one rank, all
trained on ONE job of 4 ranks (``train_mesh``): ``{shard: 2, tp: 2}`` and ``{replicate: 2, shard: 2}`` of one
config, the first one's checkpoint resumed on ``{shard: 4}`` and on ``{replicate: 2, shard: 2}``, a bf16 and compiled
run, a run whose model returns NaN losses on rank 1 at one step (the ranks must agree to skip it), and an HSDP run
whose rank 3 corrupts its replica of a shard (the parity check must name it and repair it from rank 1).

The test-only models live in ``PLANTED_TP`` (``planted_tp:factory``): tiny-lm whose forward number ``nan_at`` returns
NaN losses on rank 1, and, with ``forget=True``, a tensor-parallel plan that runs ``blocks.0.norm2`` on this rank's
part of the sequence and forgets to all-reduce its weights' gradients over ``tp`` (the classic sequence-parallel
norm bug: the forward is right, the norm's gradient is one rank's part of it).
"""

from __future__ import annotations

import importlib
import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from subprocess import CompletedProcess

from tests.dist_utils import cli_on_ranks
from tests.train_utils import sets, write_text_dataset

PLANTED_TP = '''
import os

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim.optimizer import register_optimizer_step_post_hook

from steadytrain.train.setup.models import TinyLM


class ForgetfulSequenceNorm(ParallelStyle):
    """A norm on this rank's part of the sequence, its output gathered: its weights' gradient is never all-reduced."""

    def _apply(self, module, mesh):
        def split(mod, args):
            whole = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
            return (whole.redistribute(mesh, [Shard(1)]).to_local(),)  # backward: all-gathers the input's gradient

        def gather(mod, args, out):
            return DTensor.from_local(out, mesh, [Shard(1)], run_check=False).full_tensor()

        module.register_forward_pre_hook(split)
        module.register_forward_hook(gather)
        return module


class PlantedTP(TinyLM):
    def __init__(self, nan_at=0, forget=False, flip_at=0, **kw):
        super().__init__(**kw)
        self.nan_at, self.forget, self.flip_at, self.calls = int(nan_at), bool(forget), int(flip_at), 0
        if self.flip_at:  # after optimizer step flip_at, outside any forward: the parameters are this rank's shards
            register_optimizer_step_post_hook(self._flip)
        self.steps = 0

    def _flip(self, optimizer, args, kwargs):
        if not any(p is self.head.weight for group in optimizer.param_groups for p in group["params"]):
            return  # another model's optimizer (this process trains several)
        self.steps += 1
        if self.steps == self.flip_at and os.environ.get("RANK") == "3":
            with torch.no_grad():
                shard = self.head.weight.to_local() if hasattr(self.head.weight, "to_local") else self.head.weight
                shard.view(-1)[0] = -shard.view(-1)[0] + 1.0  # a silent corruption of this replica's shard

    def forward(self, batch):
        self.calls += self.training  # training forwards only: an evaluation's do not count
        losses = super().forward(batch)
        if self.training and self.calls == self.nan_at and os.environ.get("RANK") == "1":
            return losses * float("nan")  # rank 1's device fails; its tensor-parallel partner rank 0 does not
        return losses

    def tp_plan(self, mesh):
        plan = super().tp_plan(mesh)
        if self.forget:
            plan["blocks.0.norm2"] = ForgetfulSequenceNorm()
        return plan


def factory(**kw):
    return PlantedTP(**kw)
'''

TINY_LM = ("model.dim=32", "model.layers=2", "model.heads=4")
HF_LLAMA = (
    "model.name=hf:llama", "model.num_hidden_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.intermediate_size=64", "model.max_position_embeddings=64",
)  # fmt: skip
"""transformers' Llama: its own tensor-parallel plan (q/k/v/gate/up column-wise, o/down row-wise)."""
COMMON = (
    "data.seq_len=32", "batch.micro_batch_size=2", "batch.global_batch_size=8", "batch.base_batch_size=8",
    "batch.base_lr=0.01", "run.max_steps=4", "run.log_every=1", "eval.holdout_shards=1",
)  # fmt: skip
WATCHED = ("monitor.every_steps=1", "monitor.group=module", "eval.every_steps=2", "checkpoint.every_steps=2",
           "checkpoint.keep_last=5")  # fmt: skip
"""What the layouts and resumes are compared on: layer rows and validation at every other step, checkpoints."""
LEAN = ("monitor.layers=off", "eval.every_steps=100", "checkpoint.every_steps=100")
"""The other runs compare the training rows only."""
"""2 micro-batches of 2 on each of 2 data-parallel ranks per step (1 on 4): accumulation re-derived per layout."""

LAYOUTS = {"st": "shard=2,tp=2", "rs": "replicate=2,shard=2"}
"""Two layouts of tiny-lm."""
RESUMED = {"st_s4": "shard=4", "st_rs": "replicate=2,shard=2"}
"""Copies of ``st`` cut back to its step-2 checkpoint, resumed on another mesh."""
EXTRA = {
    "bf16": (
        *TINY_LM,
        *LEAN,
        "distributed.mesh=shard=2,tp=2",
        "precision=bf16",
        "model.compile=true",
        "run.max_steps=2",
    ),
    "nan": (*TINY_LM, *LEAN, "distributed.mesh=shard=2,tp=2", "model.name=planted_tp:factory", "model.nan_at=5"),
    "hf": (*HF_LLAMA, *LEAN, "distributed.mesh=shard=2,tp=2", "run.max_steps=2"),
    "parity": (
        *TINY_LM,
        *LEAN,
        "distributed.mesh=replicate=2,shard=2",
        "model.name=planted_tp:factory",
        "model.seq_len=32",  # tiny-lm's, as the data gives it: the same initial weights as the 1-rank runs
        "model.flip_at=1",
        "distributed.parity_every_steps=2",
    ),
}
"""Rank 1's forward number 5 is its first of step 3 (2 micro-batches a step); rank 3 corrupts its shard of the head
after optimizer step 1, found by the parity check after step 2."""


def cut_to_step(run: Path, to: Path, step: int) -> None:
    """A copy of ``run`` whose checkpoints after ``step`` are gone (the resume starts from ``step``)."""
    shutil.copytree(run, to)
    for ck in (to / "checkpoints").iterdir():
        if ck.name.startswith("step-") and int(ck.name.split("-")[1]) > step:
            shutil.rmtree(ck)


def copy_run_with(run: Path, to: Path, log: str, step: int, layer: str | None, key: str) -> Path:
    """A copy of ``run`` whose ``log`` row at ``step`` (of ``layer``) has ``key`` 1% larger: a planted difference."""
    shutil.copytree(run, to)
    rows = [json.loads(x) for x in (to / log).read_text().splitlines()]
    for row in rows:
        if row.get("step") == step and row.get("layer") == layer and row.get(key) is not None:
            row[key] *= 1.01
    (to / log).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return to


@dataclass(frozen=True)
class MeshRuns:
    pkg: Path
    data: Path
    runs: dict[str, Path]
    results: dict[str, list[CompletedProcess]]


def train_mesh(root: Path) -> MeshRuns:
    """Every run of the module's docstring on one job of 4 gloo ranks, in order."""
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "planted_tp.py").write_text(PLANTED_TP)
    data = write_text_dataset(root / "data", [12] * 8)
    runs = {name: root / name for name in [*LAYOUTS, *RESUMED, *EXTRA]}
    base = (*COMMON, f"data.path={data}")
    commands: list = [
        ["train", "--run-dir", runs[n], *sets(*base, *TINY_LM, *WATCHED, f"distributed.mesh={m}")]
        for n, m in LAYOUTS.items()
    ]
    names = list(LAYOUTS)
    for name, mesh in RESUMED.items():
        commands.append(partial(cut_to_step, runs["st"], runs[name], 2))
        commands.append(["train", "--resume", runs[name], *sets(f"distributed.mesh={mesh}")])
        names += [f"cut-{name}", name]
    for name, extra in EXTRA.items():
        commands.append(["train", "--run-dir", runs[name], *sets(*base, *extra)])
        names.append(name)
    # The ranks are forks of this process: 4 ranks on 2 cores would spend ~25 s of CPU importing anew what it has
    # imported. What they would each import later (the compiler, transformers' Llama) is imported here, once.
    for module in ("torch._inductor.compile_fx", "transformers.models.llama.modeling_llama"):
        importlib.import_module(module)
    done = cli_on_ranks(root, commands, world_size=4, start_method="fork", PYTHONPATH=str(pkg), HF_HUB_OFFLINE="1")
    return MeshRuns(pkg, data, runs, {n: d for n, d in zip(names, done, strict=True) if d is not None})
