"""A DDP step's Python bookkeeping stays off nn.Module's slow paths."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from ddp_join import DistributedDataParallel
from join_core.testing import run_ranks


def _setattrs_per_step(rank: int, world_size: int) -> int:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = 0
    original = torch.nn.Module.__setattr__

    def counting(self: torch.nn.Module, name: str, value: Any) -> None:
        nonlocal calls
        calls += self is model
        original(self, name, value)

    torch.nn.Module.__setattr__ = counting  # type: ignore[method-assign]
    try:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
    finally:
        torch.nn.Module.__setattr__ = original  # type: ignore[method-assign]
    return calls


def test_a_step_sets_no_attribute_through_nn_modules_slow_setattr() -> None:
    # nn.Module.__setattr__ costs about 4 us a call; a step set about 22 through it.
    assert run_ranks(_setattrs_per_step, 2) == [0, 0]


def _synchronizing_steps(rank: int, world_size: int) -> str:
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), device_ids=[device])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, device=device)

    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    step()  # the first step allocates and builds what later steps reuse
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    except RuntimeError as error:
        return str(error)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_outside_join_never_makes_the_host_wait_for_the_gpu() -> None:
    # Reading the reduced metadata back each step cost about 0.6 ms a step on an H200.
    assert run_ranks(_synchronizing_steps, 1, backend="nccl") == [""]


def _gradient_hooks_without_distributed_autograd(rank: int, world_size: int) -> tuple[bool, int]:
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    model(torch.ones(3, 4)).sum().backward()
    loaded = "rpc_registry.autograd" in sys.modules
    return loaded, sum(len(param._backward_hooks or {}) for param in model.parameters())


def test_a_step_runs_no_per_gradient_hook_for_distributed_autograd_unless_it_is_loaded() -> None:
    # Such a hook (a Python call per gradient, every backward) serves only a
    # distributed autograd backward, which cannot run before rpc-registry's is imported.
    assert run_ranks(_gradient_hooks_without_distributed_autograd, 2) == [(False, 0), (False, 0)]
