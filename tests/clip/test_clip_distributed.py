"""Global norms across real ranks (gloo, CPU): FSDP2 shards, replicated DTensors, pipeline stages; the three
workers run one after another in one spawned job (:func:`runs`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from steadytrain.clip import clip_grad_global_norm_, clip_grad_per_param_norm_, global_grad_norm
from tests.dist_utils import load_all, save, spawn_all

pytestmark = pytest.mark.distributed

NORM_TYPES = (2.0, 1.0, math.inf)
MAX_NORM = 0.05  # below every norm here, so that the clip is applied


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes so that FSDP2 shards unevenly; heterogeneous scales between layers.
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4 * world_size, 7, generator=gen), torch.randn(4 * world_size, 3, generator=gen)


def single_process_reference(world_size: int, max_norm: float) -> dict:
    """Norms and clipped grads of one process on the whole global batch: the oracle."""
    model = make_model()
    x, y = global_batch(world_size)
    nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    out = {f"norm{p}": torch.nn.utils.get_total_norm([q.grad for q in params], p) for p in NORM_TYPES}
    out["norm'inf'"] = torch.nn.utils.get_total_norm([q.grad for q in params], "inf")  # torch's own spelling
    out["per_param"] = [q.grad.norm() for q in params]
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    out["clipped"] = [q.grad.clone() for q in params]
    return out


def sharded_backward(mesh, rank: int, world_size: int) -> list[nn.Parameter]:
    """A fresh model, each layer and the root under ``fully_shard``, after backward on this rank's slice."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = global_batch(world_size)
    local = slice(4 * rank, 4 * (rank + 1))
    # FSDP2 averages gradients over ranks: the mean of local means = the global mean (equal sizes).
    nn.functional.mse_loss(model(x[local]), y[local]).backward()
    return list(model.parameters())


def fsdp_worker(rank: int, world_size: int, out, max_norm: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    params = sharded_backward(mesh, rank, world_size)
    result = {f"norm{p}": global_grad_norm(params, p) for p in NORM_TYPES}
    result["norm'inf'"] = global_grad_norm(params, "inf")  # the max over shards, spelled as torch takes it
    # What a per-shard norm would have given (the bug users report): differs by rank.
    result["local_shard_norm"] = torch.linalg.vector_norm(torch.stack([q.grad.to_local().norm() for q in params]))
    # A second sharded copy for per-parameter clipping.
    result["per_param"] = clip_grad_per_param_norm_(sharded_backward(mesh, rank, world_size), max_norm=1e9)
    result["pre_clip"] = clip_grad_global_norm_(params, max_norm)
    result["clipped"] = [q.grad.full_tensor() for q in params]
    save(out, rank, result)


def test_fsdp2_global_norm_equals_single_process(runs):
    world_size, max_norm = 2, MAX_NORM
    ref = single_process_reference(world_size, max_norm)
    results = load_all(runs["fsdp"], world_size)
    for r in results:
        for p in (*NORM_TYPES, "'inf'"):
            torch.testing.assert_close(r[f"norm{p}"], ref[f"norm{p}"], rtol=1e-5, atol=0)
        torch.testing.assert_close(r["pre_clip"], ref["norm2.0"], rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.stack(r["per_param"]), torch.stack(ref["per_param"]), rtol=1e-5, atol=0)
        for got, want in zip(r["clipped"], ref["clipped"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # The per-shard norm is what the bug returns: not the global norm, and different on each rank.
    assert not math.isclose(float(results[0]["local_shard_norm"]), float(ref["norm2.0"]), rel_tol=1e-3)
    assert not math.isclose(float(results[0]["local_shard_norm"]), float(results[1]["local_shard_norm"]))


def replicated_worker(rank: int, world_size: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(1.0, 13.0).reshape(6, 2)
    replicated = nn.Parameter(distribute_tensor(torch.zeros(6, 2), mesh, [Replicate()]))
    replicated.grad = distribute_tensor(full, mesh, [Replicate()])
    sharded = nn.Parameter(distribute_tensor(torch.zeros(6, 2), mesh, [Shard(1)]))
    sharded.grad = distribute_tensor(full, mesh, [Shard(1)])
    save(out, rank, {"replicated": global_grad_norm([replicated]), "sharded": global_grad_norm([sharded])})


def test_replicated_dtensor_is_not_counted_twice(runs):
    expected = torch.linalg.vector_norm(torch.arange(1.0, 13.0))
    for r in load_all(runs["replicated"], 2):
        torch.testing.assert_close(r["replicated"], expected)
        torch.testing.assert_close(r["sharded"], expected)


def pipeline_worker(rank: int, world_size: int, out, max_norm: float) -> None:
    model = make_model()
    x, y = global_batch(world_size)
    nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    # Each "stage" holds a different, disjoint slice of the parameters.
    stage_params = params[rank::world_size]
    result = {f"norm{p}": global_grad_norm(stage_params, p, process_group=dist.group.WORLD) for p in NORM_TYPES}
    result["norm'inf'"] = global_grad_norm(stage_params, "inf", process_group=dist.group.WORLD)
    result["stage_only"] = global_grad_norm(stage_params)
    result["pre_clip"] = clip_grad_global_norm_(stage_params, max_norm, process_group=dist.group.WORLD)
    result["clipped"] = {i: params[i].grad for i in range(rank, len(params), world_size)}
    save(out, rank, result)


def test_pipeline_stages_summed_through_process_group(runs):
    world_size, max_norm = 2, MAX_NORM
    ref = single_process_reference(world_size, max_norm)
    results = load_all(runs["pipeline"], world_size)
    for r in results:
        for p in (*NORM_TYPES, "'inf'"):
            torch.testing.assert_close(r[f"norm{p}"], ref[f"norm{p}"], rtol=1e-5, atol=0)
        assert float(r["stage_only"]) < float(ref["norm2.0"])
        for i, g in r["clipped"].items():
            torch.testing.assert_close(g, ref["clipped"][i], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's three workers, one after another on the same two ranks (one spawn, not three)."""
    jobs = {"fsdp": (fsdp_worker, MAX_NORM), "replicated": (replicated_worker,)}
    jobs["pipeline"] = (pipeline_worker, MAX_NORM)
    return spawn_all(tmp_path_factory.mktemp("clip-ranks"), jobs)
