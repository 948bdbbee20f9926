"""Paths off the common one: failures at every point of an iteration,
subgroups, comm hooks with the active-count divisor, unused parameters
combined with no_sync, and a rank whose forward reaches no parameter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, flat_params, loss_fn, make_model, reference

from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer, allreduce_hook, fp16_compress_hook
from join_core import Join
from join_core.testing import run_ranks


class _WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.norm(self.linear(x)))
        return out


def _fail_at(rank: int, world_size: int, where: str) -> str:
    model = DistributedDataParallel(_WithBatchNorm())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    try:
        with Join([model, optimizer]):
            for step in range(4 + rank):
                failing = rank == 1 and step == 2
                if failing and where == "before-forward":
                    raise ValueError("bad batch")
                loss = loss_fn(model, *batch(rank, step))
                if failing and where == "after-forward":
                    raise ValueError("bad batch")
                loss.backward()
                if failing and where == "after-backward":
                    raise ValueError("bad batch")
                optimizer.step()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("where", ["before-forward", "after-forward", "after-backward"])
def test_failure_at_any_point_of_an_iteration_aborts_every_rank(where: str) -> None:
    messages = run_ranks(_fail_at, 3, where, timeout=60)
    assert messages[1] == "ValueError: bad batch"
    assert messages[0] == messages[2] == "JoinAbortedError: Join aborted: rank 1 raised ValueError: bad batch"


def _hook_by_active(rank: int, world_size: int) -> torch.Tensor:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)
    model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(divide_by_initial_world_size=False):
        for step in range(2 + 3 * rank):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            optimizer.step()
    return flat_params(model)


def test_allreduce_hook_divides_by_the_ranks_still_training() -> None:
    results = run_ranks(_hook_by_active, 2)
    expected = reference([2, 5], lambda ps: torch.optim.SGD(ps, lr=0.1), divide_by_initial_world_size=False)
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-6)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 2)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out: torch.Tensor = self.b(x) if use_b else self.a(x)
        return out


def _unused_with_no_sync(rank: int, world_size: int) -> torch.Tensor:
    model = DistributedDataParallel(_TwoHeads(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        x, _ = batch(rank, step)
        with model.no_sync():
            model(x, True).sum().backward()  # only b, accumulated locally
        model(x, False).sum().backward()  # only a; b's accumulation is reduced too
        optimizer.step()
    return flat_params(model)


def test_parameters_used_only_under_no_sync_are_reduced() -> None:
    first, second = run_ranks(_unused_with_no_sync, 2)
    assert torch.equal(first, second)


def _subgroup(rank: int, world_size: int) -> list[float]:
    group: dist.ProcessGroup = dist.new_group([1, 2])
    if rank == 0:
        # Collectives on the world while ranks 1 and 2 train on their group.
        stray = torch.full((2,), 100.0, dtype=torch.float16)
        dist.all_reduce(stray)
        return stray.tolist()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(2, 1, bias=False), process_group=group)
    model.register_comm_hook(None, fp16_compress_hook)
    model(torch.full((1, 2), float(rank))).sum().backward()
    weight_grad = model.module.weight.grad
    assert weight_grad is not None
    dist.all_reduce(torch.full((2,), 1.0, dtype=torch.float16))  # meet rank 0's stray collective
    return weight_grad.reshape(-1).tolist()


def test_model_on_a_subgroup_without_rank_zero_reduces_over_its_own_group() -> None:
    _, first, second = run_ranks(_subgroup, 3)
    assert first == second == [1.5, 1.5]  # the mean of inputs 1 and 2


class _Bypass(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        out: torch.Tensor = self.a(x) if use else x[:, :2] * 2
        return out


def _reaches_no_parameter(rank: int, world_size: int) -> list[float]:
    model = DistributedDataParallel(_Bypass(), find_unused_parameters=True)
    for step in range(2):
        x = batch(rank, step)[0].requires_grad_()
        model(x, rank == 0).sum().backward()
    grad = model.module.a.bias.grad
    assert grad is not None
    return grad.tolist()


def test_rank_whose_forward_reaches_no_parameter_still_reduces() -> None:
    first, second = run_ranks(_reaches_no_parameter, 2, timeout=60)
    assert first == second == [5.0, 5.0]  # 5 rows, summed twice, averaged over 2 ranks
