"""FSDP2 mixed precision under ``precision: bf16``: bf16 parameters for compute, fp32 gradient reduction.

Two gloo ranks each run a forward and backward of their half of a batch through ``wrap_model`` with
the run's policy; the reference is one process that casts a copy of the model to bf16, runs each half,
and averages the two halves' gradients in fp32: what "bf16 compute, fp32 reduction" means.
"""

from __future__ import annotations

import copy

import pytest
import torch

from steadytrain.train.setup.config import TrainConfig
from steadytrain.train.setup.distributed import DistInfo, mixed_precision, wrap_model
from steadytrain.train.setup.models import TinyLM
from steadytrain.train.setup.pieces import fsdp_policy
from tests.dist_utils import load_all, save, spawn_all

WORLD = 2


def model_and_batch() -> tuple[TinyLM, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM(dim=32, layers=2, heads=2, seq_len=16)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    return model, tokens


def fsdp_worker(rank: int, world_size: int, out, param_dtype: str | None) -> None:
    from torch.distributed.tensor import DTensor

    model, tokens = model_and_batch()
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo")
    wrapped = wrap_model(model, info, "fsdp", mixed_precision("bf16", param_dtype, "fp32"))
    seen = []
    wrapped.head.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    half = tokens.chunk(world_size)[rank]
    loss = wrapped({"tokens": half}).float().mean()
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in wrapped.named_parameters()}
    assert all(isinstance(p, DTensor) for p in wrapped.parameters())
    save(
        out,
        rank,
        {"compute_dtype": seen[0], "grads": grads, "grad_dtypes": {p.grad.dtype for p in wrapped.parameters()}},
    )


def reference(param_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each half's gradient with the parameters in ``param_dtype``, then averaged in fp32.

    On one thread, as the ranks run: bf16 sums in another order round differently.
    """
    model, tokens = model_and_batch()
    total: dict[str, torch.Tensor] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for half in tokens.chunk(WORLD):
            m = copy.deepcopy(model).to(param_dtype)
            m({"tokens": half}).float().mean().backward()
            for n, p in m.named_parameters():
                total[n] = total.get(n, 0) + p.grad.float() / WORLD
    finally:
        torch.set_num_threads(threads)
    return total


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both tests' workers (the run's bf16 policy; ``fsdp_param_dtype: fp32``) in one spawned job."""
    jobs = {"bf16": (fsdp_worker, None), "fp32": (fsdp_worker, "fp32")}
    return spawn_all(tmp_path_factory.mktemp("fsdp-precision"), jobs, world_size=WORLD)


@pytest.mark.distributed
def test_bf16_parameters_for_compute_and_fp32_gradient_reduction(ranks):
    want, full_precision = reference(torch.bfloat16), reference(torch.float32)
    for r in load_all(ranks["bf16"], WORLD):
        assert r["compute_dtype"] == torch.bfloat16  # the gathered weights the forward sees
        assert r["grad_dtypes"] == {torch.float32}  # the sharded gradient the optimizer steps on
        for name, got in r["grads"].items():
            torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-6)
        # and it is a bf16 computation, not fp32 relabelled: the full-precision gradient differs
        head = r["grads"]["head.weight"]
        assert not torch.allclose(head, full_precision["head.weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_fsdp_param_dtype_fp32_keeps_full_precision(ranks):
    want = reference(torch.float32)
    for r in load_all(ranks["fp32"], WORLD):
        assert r["compute_dtype"] == torch.float32
        for name, got in r["grads"].items():
            torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-6)


def test_policy_follows_precision_and_strategy():
    def cfg(**kw):
        return TrainConfig.model_validate(kw)

    assert fsdp_policy(cfg(precision="bf16")) is None  # DDP: autocast alone
    policy = fsdp_policy(cfg(precision="bf16", distributed={"strategy": "fsdp"}))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy(cfg(precision="fp32", distributed={"strategy": "fsdp"})) is None
    reduce_bf16 = cfg(precision="bf16", distributed={"strategy": "fsdp", "fsdp_reduce_dtype": "bf16"})
    assert fsdp_policy(reduce_bf16).reduce_dtype == torch.bfloat16
