"""Shared pieces of the ddp-join tests: models, per-rank batches, devices,
and the single-process reference a joined run must match."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# (device, backend) cells: CPU over gloo always; CUDA over gloo on one GPU,
# over NCCL with one GPU per rank.
DEVICES = pytest.mark.parametrize(
    "device,backend",
    [
        pytest.param("cpu", "gloo", id="cpu-gloo"),
        pytest.param(
            "cuda",
            "gloo",
            id="cuda-gloo",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
        pytest.param(
            "cuda",
            "nccl",
            id="cuda-nccl",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"),
        ),
    ],
)


def rank_device(device: str, backend: str, rank: int) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank if backend == "nccl" else 0)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(rank: int, step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 4, generator=gen).to(device), torch.randn(5, 2, generator=gen).to(device)


def loss_fn(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def reference(
    counts: list[int],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    divide_by_initial_world_size: bool = True,
) -> torch.Tensor:
    """One process applying, at iteration i, the sum of the gradients of the
    ranks still training divided by the world size (or by their number)."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    world_size = len(counts)
    for step in range(max(counts)):
        active = [r for r in range(world_size) if counts[r] > step]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in active:
            model.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            for acc, p in zip(total, model.parameters()):
                assert p.grad is not None
                acc += p.grad
        divisor = world_size if divide_by_initial_world_size else len(active)
        for acc, p in zip(total, model.parameters()):
            p.grad = acc / divisor
        optimizer.step()
    return flat_params(model)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded parameter or state, on the CPU, on every rank.

    torch 2.11's ``DTensor.full_tensor()`` crashes (SIGSEGV in its functional
    all-gather) on CUDA tensors over gloo, so there the dim-0 shards FSDP2
    makes are gathered with ``all_gather_object``.
    """
    if not isinstance(value, DTensor):
        return value.detach().cpu()
    group = value.device_mesh.get_group()
    if value.device.type == "cpu" or dist.get_backend(group) != "gloo":
        return value.full_tensor().detach().cpu()
    assert value.placements == (Shard(0),), value.placements
    shards: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, value.to_local().detach().cpu(), group=group)
    return torch.cat(shards)
