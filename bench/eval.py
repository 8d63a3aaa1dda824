"""Benchmark: the validation pass against a hand-written ``no_grad`` loop over the same examples.

The default model (tiny-lm: dim 128, 2 layers, 4 heads, 128-byte sequences) and 2 shards of the
embedded corpus (2,048 sequences). Compares, per evaluation, examples/s of

* ``steadytrain`` -- ``EvalSet`` (reads the shards through the data layer) + ``evaluate`` (eval mode,
  no_grad, RNG fork, per-example sums in float64, one host read);
* ``hand-written`` -- ``pyarrow.parquet.read_table`` of the same shards, a tensor, then a ``no_grad``
  loop of the same micro-batches summing the per-example losses (the loop users write by hand);
* ``preloaded`` -- the same loop over tensors already in memory (a lower bound: no reading at all).

Rounds alternate the order; the headline is the median paired ratio of throughputs.

Usage::

    python bench/eval.py [--repeats N] [--batch B]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from steadytrain.data import EvalSet
from steadytrain.train.job.evaluate import evaluate
from steadytrain.train.setup.corpus import default_corpus
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.models import TinyLM

SHARDS = [0, 1]


def read_tokens(path: Path) -> torch.Tensor:
    index = json.loads((path / "index.json").read_text())
    files = {s["id"]: path / s["file"] for s in index["shards"]}
    cols = [pq.read_table(files[s], columns=["tokens"])["tokens"].combine_chunks() for s in SHARDS]
    flat = np.concatenate([c.flatten().to_numpy() for c in cols]).reshape(-1, cols[0].type.list_size)
    return torch.from_numpy(flat)


def by_hand(model: torch.nn.Module, tokens: torch.Tensor, batch: int) -> tuple[float, int]:
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for t in tokens.split(batch):
            total += model({"tokens": t}).double().sum().item()
            n += len(t)
    return total / n, n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(2)
    path = default_corpus(128)
    torch.manual_seed(0)
    model = TinyLM(dim=128, layers=2, heads=4, seq_len=128)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    preloaded = read_tokens(path)
    evaluate(model, EvalSet(path, shards=SHARDS, batch_size=args.batch), info)  # warm up
    ratios, ratios_pre = [], []
    for r in range(args.repeats):
        times = {}
        for name in ["ours", "hand", "pre"] if r % 2 else ["pre", "hand", "ours"]:
            t0 = time.perf_counter()
            if name == "ours":
                res = evaluate(model, EvalSet(path, shards=SHARDS, batch_size=args.batch), info)
                loss, n = res.val_loss, res.val_items
            elif name == "hand":
                loss, n = by_hand(model, read_tokens(path), args.batch)
            else:
                loss, n = by_hand(model, preloaded, args.batch)
            times[name] = (time.perf_counter() - t0, loss, n)
        (t_ours, l_ours, n_ours), (t_hand, l_hand, _), (t_pre, _, _) = times["ours"], times["hand"], times["pre"]
        assert abs(l_ours - l_hand) <= 1e-6 * abs(l_hand), (l_ours, l_hand)  # the same examples, the same loss
        ratios.append(t_hand / t_ours)
        ratios_pre.append(t_pre / t_ours)
        print(f"round {r}: ours {n_ours / t_ours:.0f} ex/s, hand-written {n_ours / t_hand:.0f}, "
              f"preloaded {n_ours / t_pre:.0f}; ours/hand x{ratios[-1]:.3f}")  # fmt: skip
    print(f"median throughput ours / hand-written (reads the shards too): {statistics.median(ratios):.3f}")
    print(f"median throughput ours / preloaded tensors (no reading): {statistics.median(ratios_pre):.3f}")


if __name__ == "__main__":
    main()
