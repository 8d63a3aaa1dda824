"""A user's own training loop, plain and instrumented with ``steadytrain.Run``.

The model, data and loop are the user's: a small MLP, a map-style dataset whose items carry their example id,
AdamW, accumulation 2 through a :class:`GradientAccumulator` with clipping, and steadytrain's
:class:`~steadytrain.data.GlobalSampler` (the same examples per step at any world size). :func:`train` is that loop;
every line the Run adds to it ends with ``# +run`` (the test counts them). :func:`reference` is the same training
written by hand with plain torch (no steadytrain at all): the oracle for the losses and the layer norms.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

N, DIM, MICRO, ACCUM, SHARD, LR, CLIP = 480, 8, 8, 2, 60, 1e-2, 1.0
"""Examples, features, micro-batch, accumulation, the Run's shard size, learning rate, clip norm."""
NAN = range(130, 140)
"""The examples :func:`planted_examples` makes non-finite (shard 2)."""


class Examples(torch.utils.data.Dataset):
    """``(x, y, id)``; ``nan``: these ids' features are NaN; ``spike``: these ids' targets are scaled by 1000."""

    def __init__(self, nan: range | list = (), spike: range | list = ()) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, DIM, generator=g)
        self.y = self.x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
        self.x[list(nan)] = float("nan")
        self.y[list(spike)] *= 1000.0

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Regressor(nn.Sequential):
    """The user's model: features to a prediction; given a batch dict (a replay's), its per-example losses (the
    contract ``nan hunt`` replays a model factory's model with)."""

    def forward(self, x):
        if isinstance(x, dict):
            return (super().forward(x["x"]) - x["y"]).pow(2).mean(1)
        return super().forward(x)


def build_model() -> nn.Module:
    """The model factory a Run records (``tests.loop.own_loop:build_model``)."""
    return Regressor(nn.Linear(DIM, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


def planted_examples() -> torch.utils.data.Dataset:
    """The dataset factory a Run records: :class:`Examples` with ``NAN`` planted, its items as dicts."""

    class Items(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data = Examples(nan=NAN)

        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.data.x[i], "y": self.data.y[i]}

    return Items()


def model_and_optimizer(seed: int = 0, dropout: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Regressor(nn.Linear(DIM, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train(run_dir: Path, steps: int, *, data: Examples, shuffle: bool = True, resume: bool = False,
          kill_at: int | None = None, dropout: float = 0.1, fsdp: bool = False,
          **run_settings) -> nn.Module:  # fmt: skip
    """The user's loop with the Run (rank and world from the process group, when there is one); ``dropout`` 0: the
    same computation on any number of ranks (each rank's dropout draws from its own stream); ``fsdp``: FSDP2, not
    DDP, on more than one rank."""
    from steadytrain import Run  # +run
    from steadytrain.accumulate import GradientAccumulator
    from steadytrain.data import GlobalSampler

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model, opt = model_and_optimizer(dropout=dropout)
    if world > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)  # over the sharded parameters
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    acc = GradientAccumulator(model, opt, accumulation_steps=ACCUM // world or 1, max_grad_norm=CLIP)
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM // world or 1, rank=rank,
                            world_size=world, seed=3, shuffle=shuffle)  # fmt: skip
    # its own generator: a DataLoader draws a seed from torch's global one each time it starts iterating, which
    # would shift a resumed run's random streams (dropout) by one draw
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    with Run(
        run_dir,
        model=model,
        optimizer=opt,
        accumulator=acc,
        config={"lr": LR, "steps": steps},  # +run
        resume=resume,
        sampler=sampler,
        shard_size=SHARD,
        **run_settings,
    ) as run:  # +run
        step = run.start_step  # +run
        while step < steps:
            for x, y, ids in loader:
                with run.micro_batch(ids) as mb:  # +run
                    mb.backward((model(x) - y).pow(2).mean(1))
                if acc.micro_steps % acc.accumulation_steps:
                    continue
                step += 1
                run.log(step, examples=int(acc.items_seen) or step * MICRO * ACCUM)  # +run
                if step % 4 == 0:
                    run.checkpoint(step)  # +run
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == steps:
                    break
    return model


def reference(steps: int, *, data: Examples, shuffle: bool = True) -> dict:
    """The same training in plain torch: per step the mean loss, the per-layer gradient norms before clipping and
    the parameter norms after the update (layers ``0`` and ``3``: the two Linear layers), and the final weights."""
    from steadytrain.data import GlobalSampler

    model, opt = model_and_optimizer()
    sampler = GlobalSampler(N, batch_size=MICRO, accumulation_steps=ACCUM, seed=3, shuffle=shuffle)
    out: dict = {"loss": [], "grad": [], "param": []}
    batches = iter(torch.utils.data.DataLoader(data, batch_sampler=sampler, generator=torch.Generator()))
    for _ in range(steps):
        losses = []
        for _k in range(ACCUM):
            x, y, _ids = next(batches)
            loss = (model(x) - y).pow(2).mean()
            (loss / ACCUM).backward()
            losses.append(loss.item())
        layer = {name: [p for n, p in model.named_parameters() if n.split(".")[0] == name] for name in ("0", "3")}
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        out["grad"].append({k: torch.stack([p.grad.norm() for p in ps]).norm().item() for k, ps in layer.items()})
        if torch.isfinite(norm):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        opt.zero_grad()
        out["param"].append({k: torch.stack([p.norm() for p in ps]).norm().item() for k, ps in layer.items()})
        out["loss"].append(sum(losses) / ACCUM)
    out["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def nanogpt_style(run_dir: Path, steps: int, *, resume: bool = False, kill_at: int | None = None) -> nn.Module:
    """nanoGPT's way: random batches drawn from torch's generator each micro-batch (no sampler), the Run's own
    accumulator; the random offsets are the example ids."""
    from steadytrain import Run

    data = Examples()
    model, opt = model_and_optimizer()
    with Run(run_dir, model=model, optimizer=opt, accumulation_steps=ACCUM, max_grad_norm=CLIP, resume=resume,
             shard_size=SHARD, report=False) as run:  # fmt: skip
        for step in range(run.start_step + 1, steps + 1):
            for _ in range(ACCUM):
                ix = torch.randint(N, (MICRO,))
                with run.micro_batch(ix) as mb:
                    mb.backward((model(data.x[ix]) - data.y[ix]).pow(2).mean())
            if step % 4 == 0:
                run.checkpoint(step)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    return model


def main(argv: list[str]) -> None:
    """``python -m tests.loop.own_loop KIND RUN STEPS [resume] [kill=S]``: one run in a process of its own, its final
    weights saved to ``RUN.pt`` (``KIND``: ``own`` or ``nanogpt``)."""
    kind, run, steps, *rest = argv
    resume = "resume" in rest
    kill = next((int(a[5:]) for a in rest if a.startswith("kill=")), None)
    torch.set_num_threads(1)
    if kind == "own":
        model = train(Path(run), int(steps), data=Examples(), resume=resume, kill_at=kill, report=False)
    else:
        model = nanogpt_style(Path(run), int(steps), resume=resume, kill_at=kill)
    torch.save(model.state_dict(), f"{run}.pt")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
