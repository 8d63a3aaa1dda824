"""Throughput and memory of a run: FLOPs per step (counted once), tokens/s, MFU, peak memory.

FLOPs are counted on a *meta shadow* of the model: a copy whose parameters and buffers are meta tensors
(shape and dtype, no storage), fed a meta copy of the first micro-batch the loop reads, forward and
backward under :class:`torch.utils.flop_counter.FlopCounterMode`. Nothing real runs: no kernel, no
random number drawn (the CPU generator is forked besides), no parameter, gradient, buffer or optimizer
state of the real model touched, no collective (DDP is unwrapped; FSDP2's hooks are left off the copy,
which holds full, unsharded shapes), no extra read of data. Python attributes are deep-copied, so a
model that counts its forward calls counts them on the copy. Attention is counted as the math it is
(``bmm``), also where the real run would use a fused kernel the counter has no formula for (CPU flash).

A model declares its own figures with two optional attributes (a number, or a method taking no
argument): ``flops_per_example`` (forward + backward FLOPs of one example; skips the count) and
``tokens_per_example`` (tokens predicted per example). Without the latter, a micro-batch with a 2-D
``tokens`` column ``[B, L]`` (next-token prediction, as tiny-lm) predicts ``L - 1`` tokens per example.
A count that fails (an op with no meta kernel, a data-dependent shape, a model that cannot run twice)
is one warning; the run goes on without ``flops_per_s`` and ``mfu``.

Rates are derived at ``MetricsLog.flush`` from each row's ``items_per_s`` (host timestamps): no sync.
``mfu = flops_per_s / (peak FLOP/s per device x world size)``; ``peak_mem_mb`` is rank 0's
``torch.cuda.max_memory_allocated`` on a GPU, its peak resident set size on a CPU.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from steadytrain.train.observe.figures import describe, summarize

__all__ = [
    "PEAK_FLOPS",
    "Throughput",
    "count_flops",
    "declared",
    "describe",
    "for_run",
    "peak_flops",
    "peak_mem_mb",
    "summarize",
]

log = logging.getLogger("steadytrain.train")

# Dense (no structured sparsity) peak FLOP/s per device: (16-bit tensor core, TF32 tensor core, FP32).
# The 16-bit figure is BF16 with FP32 accumulate; FP16 on V100 and T4 (no BF16 tensor cores). Datasheets
# quote "with sparsity" figures twice these. Sources (NVIDIA datasheets / architecture whitepapers):
# H100 SXM, PCIe and NVL: nvidia.com/en-us/data-center/h100 (datasheet table); H200 SXM and NVL:
# nvidia.com/en-us/data-center/h200; GH200: its datasheet (per GPU = H100 SXM); A100: A100 datasheet
# (nvidia-a100-datasheet-us-nvidia-1758950-r4); A10: A10 datasheet (AWS's A10G has none of its own: the A10's
# figures stand in, set run.peak_flops when yours are known); L4, L40, L40S: their datasheets; V100: V100
# datasheet (SXM2 / PCIe); T4: T4 datasheet; RTX 4090: Ada Lovelace whitepaper (appendix, FP32 accumulate);
# RTX 3090: Ampere GA102 whitepaper (FP32 accumulate).
PEAK_FLOPS: list[tuple[str, str, tuple[float, float, float]]] = [
    ("H100 NVL", r"H100.*NVL", (835.5e12, 417.5e12, 60.0e12)),
    ("H100 PCIe", r"H100.*PCIE", (756.5e12, 378.0e12, 51.2e12)),
    ("H100 SXM", r"H100|GH200", (989.4e12, 494.7e12, 66.9e12)),
    ("H200 NVL", r"H200.*NVL", (835.5e12, 417.5e12, 60.0e12)),
    ("H200", r"H200", (989.5e12, 494.5e12, 67.0e12)),
    ("A100", r"A100", (312.0e12, 156.0e12, 19.5e12)),
    ("A10G", r"A10G", (125.0e12, 62.5e12, 31.2e12)),
    ("A10", r"\bA10\b", (125.0e12, 62.5e12, 31.2e12)),
    ("L40S", r"L40S", (362.05e12, 183.0e12, 91.6e12)),
    ("L40", r"\bL40\b", (181.05e12, 90.5e12, 90.5e12)),
    ("L4", r"\bL4\b", (121.0e12, 60.0e12, 30.3e12)),
    ("V100 PCIe", r"V100.*PCIE", (112.0e12, 14.0e12, 14.0e12)),
    ("V100 SXM2", r"V100", (125.0e12, 15.7e12, 15.7e12)),
    ("T4", r"\bT4\b", (65.0e12, 8.1e12, 8.1e12)),
    ("RTX 4090", r"RTX 4090", (165.2e12, 82.6e12, 82.6e12)),
    ("RTX 3090", r"RTX 3090", (71.0e12, 35.6e12, 35.6e12)),
]
"""(entry, pattern searched in ``torch.cuda.get_device_name()`` (case-insensitive), dense peaks); first match wins."""


def accelerator(device_name: str) -> tuple[str, tuple[float, float, float]] | None:
    """The table's entry for a device name: ``accelerator("NVIDIA H100 80GB HBM3")[0] == "H100 SXM"``."""
    for name, pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return name, peaks
    return None


def peak_flops(device_name: str, precision: str, *, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of one device for a run's ``precision``: the 16-bit tensor-core figure for bf16/fp16;
    for fp32, the TF32 figure when TF32 matmuls are allowed (``tf32``), else plain FP32. None: not in the table.

    Example:
        >>> peak_flops("NVIDIA A100-SXM4-80GB", "bf16")
        312000000000000.0
    """
    found = accelerator(device_name)
    if found is None:
        return None
    half, tf32_peak, fp32 = found[1]
    return half if precision in ("bf16", "fp16") else tf32_peak if tf32 else fp32


def peak_mem_mb(device: torch.device) -> float:
    """Peak memory so far, in MiB: allocated by tensors on a GPU (an allocator counter: no device sync), the
    process's peak resident set size on a CPU (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (2**20 if sys.platform == "darwin" else 2**10), 1)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (``.module``) or ``torch.compile`` (``._orig_mod``)."""
    while True:
        inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def declared(model: nn.Module, name: str) -> float | None:
    """The model's own ``name`` (``flops_per_example``, ``tokens_per_example``): a number or a method giving one."""
    value = getattr(unwrap(model), name, None)
    value = value() if callable(value) else value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _meta(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="meta")  # DTensor: its global (unsharded) shape
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def meta_shadow(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with meta parameters and buffers (no storage copied); FSDP2's classes, state and hooks
    left off (its modules refuse ``deepcopy``: each module is rebuilt here, children first)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        FSDPModule = None
    model = unwrap(model)
    memo: dict[int, Any] = {id(t): _meta(t) for t in [*model.parameters(), *model.buffers()]}
    for module in reversed(list(model.modules())):  # pre-order reversed: every child before its parent
        fsdp = FSDPModule is not None and isinstance(module, FSDPModule)
        cls = next(c for c in type(module).__mro__ if not (fsdp and issubclass(c, FSDPModule)))
        state = {k: v for k, v in vars(module).items() if not (fsdp and _fsdp_key(k)) and k != "_compiled_call_impl"}
        memo.update({id(v): _meta(v) for v in state.values() if torch.is_tensor(v) and id(v) not in memo})
        shadow = object.__new__(cls)
        shadow.__dict__.update(copy.deepcopy(state, memo))
        for key, value in vars(module).items():
            if fsdp and "hooks" in key:
                shadow.__dict__[key] = type(value)()
            elif key in ("_forward_hooks", "_forward_pre_hooks"):  # a tensor-parallel plan's: they make DTensors
                shadow.__dict__[key] = type(value)((k, f) for k, f in value.items() if not _tensor_parallel(f))
        memo[id(module)] = shadow
    return memo[id(model)]


def _tensor_parallel(hook: Any) -> bool:
    """A hook ``parallelize_module`` registered (its inputs and outputs to and from DTensors): the shadow's
    parameters hold each tensor's whole shape, so it counts the whole model without them."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    return getattr(fn, "__module__", "").startswith("torch.distributed.tensor")


def _fsdp_key(key: str) -> bool:
    return "hooks" in key or key.startswith("__composable_api_state_key")


def count_flops(model: nn.Module, batch: dict[str, Any]) -> int:
    """FLOPs of one forward and backward of ``batch`` through ``model`` (its per-example losses' mean), counted on
    a :func:`meta_shadow`: the model, its gradients and the random generators are left as they were.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 4, bias=False))
        >>> class M(nn.Module):
        ...     def __init__(self): super().__init__(); self.net = mlp
        ...     def forward(self, b): return self.net(b["x"]).pow(2).sum(1)
        >>> count_flops(M(), {"x": torch.zeros(3, 8)})  # forward 2x8x4x3, weight gradient 2x8x4x3
        384
    """
    from torch.utils.flop_counter import FlopCounterMode

    shadow = meta_shadow(model)
    inputs = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta") if torch.is_tensor(v) else v for k, v in batch.items()
    }
    with torch.random.fork_rng(devices=[]), torch.device("meta"), FlopCounterMode(display=False) as counter:
        out = shadow(inputs)
        out.float().mean().backward()
    return int(counter.get_total_flops())


@dataclass
class Throughput:
    """A run's figures for the metrics rows: FLOPs per optimizer step (global, over every rank), tokens per
    example, the peak FLOP/s of one device. Unknown figures are None and their keys are left out of the rows."""

    device: torch.device
    world_size: int
    global_batch_size: int
    accumulation_steps: int
    peak_flops: float | None = None
    """Dense peak FLOP/s of one device (``run.peak_flops``, or the table's); None: no ``mfu``."""
    flops_per_step: float | None = None
    """Forward + backward FLOPs of one optimizer step over all ranks."""
    tokens_per_example: float | None = None

    def fields(self, items_per_s: float) -> dict[str, float]:
        """A row's rates from its examples/s (``flops_per_s``, ``tokens_per_s``, ``mfu``), the known ones."""
        out = {}
        if self.tokens_per_example is not None:
            out["tokens_per_s"] = items_per_s * self.tokens_per_example
        if self.flops_per_step is not None:
            out["flops_per_s"] = items_per_s / self.global_batch_size * self.flops_per_step
            if self.peak_flops is not None:
                out["mfu"] = out["flops_per_s"] / (self.peak_flops * self.world_size)
        return out

    def measure(self, model: nn.Module, micro_batch: dict[str, Any], is_main: bool) -> None:
        """Fill the figures from the model's declarations, or count on the first micro-batch (see the module)."""
        self.tokens_per_example = declared(model, "tokens_per_example")
        tokens = micro_batch.get("tokens")
        if self.tokens_per_example is None and torch.is_tensor(tokens) and tokens.dim() == 2:
            self.tokens_per_example = float(tokens.shape[1] - 1)
        per_example = declared(model, "flops_per_example")
        if per_example is not None:
            self.flops_per_step = per_example * self.global_batch_size
        elif os.environ.get("STEADYTRAIN_FLOP_COUNT", "1") != "0":  # internal: tests compare runs without it
            try:
                per_micro = count_flops(model, micro_batch)
            except Exception as err:  # never worth the run: a model the meta device cannot run, say
                if is_main:
                    log.warning(
                        "FLOPs not counted (%s: %s): no flops_per_s or mfu; give the model a flops_per_example "
                        "attribute to report them", type(err).__name__, str(err).splitlines()[0] if str(err) else ""
                    )  # fmt: skip
                return
            index = micro_batch.get("index")
            if index is not None and len(index):  # per example, times the global batch: the ranks of a tensor-
                self.flops_per_step = float(per_micro / len(index) * self.global_batch_size)  # parallel group share one
            else:
                self.flops_per_step = float(per_micro * self.accumulation_steps * self.world_size)
        if is_main and self.flops_per_step is not None:
            log.info(
                "%.4g FLOPs per optimizer step (%.4g per rank; forward + backward)",
                self.flops_per_step, self.flops_per_step / self.world_size,
            )  # fmt: skip

    def on_first(self, loader: Iterable[dict[str, Any]], model: nn.Module, is_main: bool) -> FirstMicroBatch:
        """``loader``, measuring on the first micro-batch it yields (once: nothing is read for it)."""
        return FirstMicroBatch(loader, lambda mb: self.measure(model, mb, is_main))


def for_run(
    device: torch.device, world_size: int, global_batch_size: int, accumulation_steps: int, *,
    precision: str, peak: float | None, is_main: bool,
) -> Throughput:  # fmt: skip
    """The run's :class:`Throughput`, its peak FLOP/s from ``run.peak_flops`` (``peak``) or the table."""
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, precision, tf32=torch.backends.cuda.matmul.allow_tf32)
        if peak is None and is_main:
            log.info("no peak FLOP/s known for %s: set run.peak_flops (per device, FLOP/s) for mfu", name)
    return Throughput(device, world_size, global_batch_size, accumulation_steps, peak_flops=peak)


class FirstMicroBatch:
    """An iterable of micro-batches that calls ``first(mb)`` on the first one it ever yields, before yielding it."""

    def __init__(self, loader: Iterable[dict[str, Any]], first: Callable[[dict[str, Any]], None]) -> None:
        self.loader, self.first = loader, first

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.first is None:
            return iter(self.loader)
        return self._once()

    def _once(self) -> Iterator[dict[str, Any]]:
        it = iter(self.loader)
        for mb in it:
            first, self.first = self.first, None
            if first is not None:
                first(mb)
            yield mb
            yield from it  # the rest as they come: no check per micro-batch
