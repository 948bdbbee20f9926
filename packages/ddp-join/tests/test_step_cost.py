"""A DDP step's Python bookkeeping stays off nn.Module's slow paths."""

from __future__ import annotations

from typing import Any

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
