"""Benchmark: nanoGPT side by side (issue 21). nanoGPT's GPT as a steadytrain user model against nanoGPT's own
``train.py`` loop, re-implemented here as the "hand loop", with the same settings.

The model is a compact re-implementation of Karpathy's nanoGPT ``model.py`` (token + position embeddings,
dropout, pre-LN blocks with causal ``scaled_dot_product_attention``, 4x GELU MLP, final LayerNorm, ``lm_head``
tied to ``wte``, nanoGPT's init, the ``bias`` flag); ``gpt_model(**kwargs)`` is its steadytrain factory
(``model.name: nanogpt:gpt_model`` with ``bench/`` on ``PYTHONPATH``), returning per-sequence cross-entropy.

The corpus is the Python standard library's own source (sorted ``*.py``, UTF-8 files, up to ``--corpus-mb``),
split 90/10 by position. steadytrain reads both parts through ``steadytrain.data.ingest`` (bytes tokenizer,
``seq_len`` windows: fixed, non-overlapping, shuffled); the hand loop reads the same bytes as a flat array and
samples ``block_size + 1`` windows at random offsets every micro-step, as nanoGPT's ``get_batch`` does.

Both sides: same factory and seed, micro-batch, accumulation, peak LR (``batch.scaling=none``), warmup + cosine
to ``lr / 10``, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only, fused), global-norm clip 1.0, losses
read once per 10 steps. Per-step time is the median of per-step wall times after ``--skip`` steps; rounds
alternate the order; the ratio is ours / hand. Validation: each side's own estimate (steadytrain's final
``val_loss`` over the first ``--eval-batches`` val windows; nanoGPT's ``estimate_loss`` over as many random val
batches) and one shared figure: the final weights on the first ``--val-windows`` non-overlapping windows of the
val split. A control run trains steadytrain on random-offset windows drawn like nanoGPT's (written as a
dataset), to tell what fixed windows cost from what the loop costs.

Usage::

    .venv/bin/python bench/nanogpt.py [--steps 300] [--rounds 3] [--skip 10] [--threads 1] [--no-control]
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# nanoGPT's settings (train.py names), sized for a shared 2-core CPU: one optimizer step is ~0.1-0.3 s.
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 257, "dropout": 0.0,
         "bias": False}  # fmt: skip
BATCH_SIZE, GRAD_ACCUM = 8, 2
LEARNING_RATE, MIN_LR_RATIO, WARMUP_ITERS = 1e-3, 0.1, 20
WEIGHT_DECAY, BETAS, GRAD_CLIP = 0.1, (0.9, 0.95), 1.0
LOG_INTERVAL, SEED = 10, 1337


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT: ``forward(idx, targets) -> (logits, mean loss)``, ``configure_optimizers`` as in nanoGPT."""

    def __init__(self, *, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int,
                 dropout: float = 0.0, bias: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd, bias=bias),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def logits(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, idx: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.logits(idx)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str) -> torch.optim.AdamW:  # fmt: skip
        """nanoGPT's AdamW: every >=2-D parameter decayed (tied ``wte``/``lm_head`` once), the rest not.

        nanoGPT fuses only on CUDA; here fused wherever torch has the kernel (CPU too), as steadytrain does.
        """
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}  # shared parameters listed once
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


class SteadyGPT(GPT):
    """The same GPT as a steadytrain user model: ``forward(batch)`` -> per-sequence mean cross-entropy ``[B]``."""

    def forward(self, batch: dict[str, Any]) -> Tensor:  # type: ignore[override]
        tokens = batch["tokens"].long()
        logits = self.logits(tokens[:, :-1])
        loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # [B, T]
        return loss.mean(dim=1)


def gpt_model(**kwargs: Any) -> SteadyGPT:
    """steadytrain's factory (``model.name: nanogpt:gpt_model``): the bench's GPT, its keys overriding ``MODEL``."""
    return SteadyGPT(**{**MODEL, **kwargs})


# ---- data ------------------------------------------------------------------------------------------------


def stdlib_source(max_bytes: int) -> bytes:
    """Sorted ``*.py`` of the standard library (no tests, no installed packages), UTF-8 files only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(here, n) for n in names if n.endswith(".py")]
    out, total = [], 0
    for f in sorted(files):
        try:
            data = f.read_bytes()
            data.decode("utf-8")  # the ingested text must be the same bytes
        except (OSError, UnicodeDecodeError):
            continue
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def prepare(work: Path, max_bytes: int) -> dict[str, Any]:
    """The train/val split as flat token arrays (the hand loop) and as ingested datasets (steadytrain)."""
    from steadytrain.data import ingest

    blob = stdlib_source(max_bytes)
    cut = len(blob) * 9 // 10
    cut = blob.rfind(b"\n", 0, cut) + 1  # a split between lines keeps both parts valid UTF-8
    out: dict[str, Any] = {}
    for name, part in (("train", blob[:cut]), ("val", blob[cut:])):
        (work / f"{name}.txt").write_bytes(part)
        ingest([str(work / f"{name}.txt")], str(work / name), seq_len=MODEL["block_size"])
        out[name] = np.frombuffer(part, dtype=np.uint8).astype(np.uint16)  # nanoGPT's train.bin / val.bin
        out[f"{name}_ds"] = work / name
    return out


def random_offset_dataset(train: np.ndarray, path: Path, windows: int, seed: int) -> Path:
    """``windows`` windows at random offsets (nanoGPT's sampling, drawn ahead) as a dataset steadytrain reads."""
    from steadytrain.data import DatasetWriter

    width = MODEL["block_size"] + 1
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(train) - width + 1, (windows,), generator=g).numpy()
    seqs = np.stack([train[i : i + width] for i in ix])
    with DatasetWriter(path, provenance={"pipeline_version": "1", "source": "random offsets"}) as w:
        for start in range(0, windows, 8192):
            part = seqs[start : start + 8192].reshape(-1)
            w.write_shard(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(part), width)}))
    return path


@torch.no_grad()
def fixed_val_loss(model: GPT, val: np.ndarray, windows: int, batch: int = 64) -> float:
    """Mean next-token loss on the first ``windows`` non-overlapping ``block_size + 1`` windows of ``val``."""
    width = MODEL["block_size"] + 1
    n = min(windows, len(val) // width)
    seqs = torch.from_numpy(val[: n * width].astype(np.int64)).view(n, width)
    was = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, batch):
        s = seqs[i : i + batch]
        logits = GPT.logits(model, s[:, :-1])
        total += F.cross_entropy(logits.transpose(1, 2), s[:, 1:], reduction="none").mean(1).double().sum().item()
    model.train(was)
    return total / n


# ---- the hand loop: nanoGPT's train.py -----------------------------------------------------------------


def get_lr(it: int, max_iters: int) -> float:
    """nanoGPT's ``get_lr``: linear warmup, then cosine down to ``min_lr`` at ``lr_decay_iters = max_iters``."""
    min_lr = LEARNING_RATE * MIN_LR_RATIO
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > max_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP_ITERS) / (max_iters - WARMUP_ITERS)))
    return min_lr + coeff * (LEARNING_RATE - min_lr)


def get_batch(data: np.ndarray) -> tuple[Tensor, Tensor]:
    """nanoGPT's ``get_batch``: ``batch_size`` windows at random offsets (torch's global generator)."""
    bs = MODEL["block_size"]
    ix = torch.randint(len(data) - bs, (BATCH_SIZE,))
    x = torch.stack([torch.from_numpy(data[i : i + bs].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + bs].astype(np.int64)) for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss(model: GPT, data: np.ndarray, eval_iters: int) -> float:
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        losses[k] = model(*get_batch(data))[1].item()
    model.train()
    return losses.mean().item()


def hand_loop(data: dict[str, Any], steps: int, eval_iters: int) -> tuple[list[float], float, GPT]:
    """nanoGPT's training loop (CPU, fp32: no GradScaler work); per-step end times, ``estimate_loss``, model."""
    torch.manual_seed(SEED)
    model = GPT(**MODEL)
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS, "cpu")
    train = data["train"]
    x, y = get_batch(train)
    times = []
    for it in range(steps):
        lr = get_lr(it, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(GRAD_ACCUM):
            _, loss = model(x, y)
            loss = loss / GRAD_ACCUM
            x, y = get_batch(train)  # the next batch, fetched while (on a GPU) the forward runs
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
        if (it + 1) % LOG_INTERVAL == 0:
            _lossf = loss.item() * GRAD_ACCUM  # the one host read per log interval (nanoGPT's lossf)
    return times, estimate_loss(model, data["val"], eval_iters), model


# ---- steadytrain -----------------------------------------------------------------------------------------


def overrides(train_ds: Path, val_ds: Path, steps: int, eval_batches: int) -> list[str]:
    m = MODEL
    return [
        "model.name=nanogpt:gpt_model", *(f"model.{k}={v}" for k, v in m.items()),
        f"data.path={train_ds}", "data.num_workers=0",
        f"batch.micro_batch_size={BATCH_SIZE}", f"batch.accumulation_steps={GRAD_ACCUM}",
        f"batch.base_lr={LEARNING_RATE}", "batch.scaling=none", f"batch.warmup_steps={WARMUP_ITERS}",
        "batch.decay=cosine", f"batch.min_lr_ratio={MIN_LR_RATIO}",
        f"optim.weight_decay={WEIGHT_DECAY}", f"optim.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"clip.max_grad_norm={GRAD_CLIP}",
        f"eval.data={val_ds}", f"eval.every_steps={steps + 1}", f"eval.max_batches={eval_batches}",
        f"run.max_steps={steps}", f"run.log_every={LOG_INTERVAL}", f"run.seed={SEED}",
        f"checkpoint.every_steps={steps + 1}",
    ]  # fmt: skip


def ours(train_ds: Path, val_ds: Path, steps: int, eval_batches: int, run_dir: Path) -> tuple[list[float], float, GPT]:
    """steadytrain in-process; per-step end times (``elapsed_s``), its final ``val_loss``, the final weights."""
    from steadytrain.train.checkpoint.catalog import latest_checkpoint, load_checkpoint
    from steadytrain.train.job.loop import train
    from steadytrain.train.setup.config import load_config

    train(load_config(None, overrides(train_ds, val_ds, steps, eval_batches)), run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["elapsed_s"] for r in rows if "val_loss" not in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    model = GPT(**MODEL)
    state = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))["model"]
    model.load_state_dict(state, strict=False)  # strict=False: a tied weight may be saved under one name
    missing = {k for k in model.state_dict() if k not in state} - {"lm_head.weight", "transformer.wte.weight"}
    if missing or not ({"lm_head.weight", "transformer.wte.weight"} & set(state)):
        raise RuntimeError(f"the final checkpoint lacks {sorted(missing) or 'the tied embedding'}")
    return times, val, model


def median_step(times: list[float], skip: int) -> float:
    return statistics.median(b - a for a, b in zip(times[skip - 1 : -1], times[skip:], strict=True))


def check_groups() -> None:
    """steadytrain's decay groups (``optim.no_decay=[bias, norm]``) are nanoGPT's (decay iff >= 2-D)."""
    from steadytrain.optim import decay_groups

    model = gpt_model()
    ref = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS, "cpu").param_groups
    got = decay_groups(model, WEIGHT_DECAY)
    same = [{id(p) for p in g["params"]} for g in ref] == [{id(p) for p in g["params"]} for g in got]
    if not same:
        raise RuntimeError("steadytrain's decay groups differ from nanoGPT's")
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.2f}M parameters; decay groups identical ({len(got[0]['params'])} decayed tensors, "
          f"{len(got[1]['params'])} not; tied wte/lm_head once)")  # fmt: skip


def one_round(r: int, data: dict[str, Any], args: argparse.Namespace, work: Path) -> tuple[float, ...]:
    """Both sides once (steadytrain first in even rounds): ms/step, ratio, own and fixed-window val losses."""
    sides = [
        lambda: ours(data["train_ds"], data["val_ds"], args.steps, args.eval_batches, work / f"run{r}"),
        lambda: hand_loop(data, args.steps, args.eval_batches),
    ]
    order = [0, 1] if r % 2 == 0 else [1, 0]
    got = {i: sides[i]() for i in order}
    (t_o, v_o, m_o), (t_h, v_h, m_h) = got[0], got[1]
    a, b = median_step(t_o, args.skip), median_step(t_h, args.skip)
    f_o, f_h = (fixed_val_loss(m, data["val"], args.val_windows) for m in (m_o, m_h))
    print(f"  round {r}: ours {a * 1e3:.1f} ms/step, hand {b * 1e3:.1f} ms/step, ratio {a / b:.3f}; "
          f"val ours {v_o:.4f} hand {v_h:.4f}; fixed val ours {f_o:.4f} hand {f_h:.4f}")  # fmt: skip
    return a, b, a / b, v_o, v_h, f_o, f_h


def print_table(rows: list[tuple[float, ...]], control: tuple[float, float, float] | None, windows: int) -> None:
    def line(name: str, row: list[float] | tuple[float, ...], bold: bool = False) -> str:
        ratio = f"**{row[2]:.3f}**" if bold else f"{row[2]:.3f}"
        losses = " | ".join(f"{v:.4f}" for v in row[3:])
        return f"| {name} | {row[0] * 1e3:.1f} | {row[1] * 1e3:.1f} | {ratio} | {losses} |"

    print("\n| round | steadytrain ms/step | hand loop ms/step | ratio | val_loss ours (own) | estimate_loss hand "
          f"| fixed val ({windows} windows) ours | fixed val hand |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, row in enumerate(rows):
        print(line(str(i), row))
    print(line("median", [statistics.median(col) for col in zip(*rows, strict=True)], bold=True))
    if control is not None:
        t, own, fixed = control
        print(f"| steadytrain on random-offset windows | {t * 1e3:.1f} | | | {own:.4f} | | {fixed:.4f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--corpus-mb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared 2-core VM)")
    parser.add_argument("--eval-batches", type=int, default=20, help="nanoGPT's eval_iters; eval.max_batches")
    parser.add_argument("--val-windows", type=int, default=1024, help="fixed val windows of the shared figure")
    parser.add_argument("--no-control", action="store_true", help="skip the random-offset steadytrain run")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # steadytrain imports nanogpt:gpt_model
    logging.getLogger("steadytrain").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; micro-batch {BATCH_SIZE} x accumulation "
          f"{GRAD_ACCUM} x {MODEL['block_size'] + 1} tokens; {args.steps} steps; data.num_workers=0")  # fmt: skip
    check_groups()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare(work, int(args.corpus_mb * 2**20))
        print(f"corpus: {len(data['train']):,} train / {len(data['val']):,} val bytes")
        for r in range(args.rounds):
            rows.append(one_round(r, data, args, work))
        control = None
        if not args.no_control:
            windows = args.steps * BATCH_SIZE * GRAD_ACCUM
            ds = random_offset_dataset(data["train"], work / "random", windows, SEED)
            t_c, v_c, m_c = ours(ds, data["val_ds"], args.steps, args.eval_batches, work / "control")
            control = (median_step(t_c, args.skip), v_c, fixed_val_loss(m_c, data["val"], args.val_windows))
    print_table(rows, control, args.val_windows)
    print("target: ratio <= 1.05; fixed-val loss ours <= hand")


if __name__ == "__main__":
    main()
